package kvxfer

import (
	"fmt"
	"math/rand/v2"
	"time"

	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// accessLayout: an attention group (two regions of kernel blocks, two per
// logical block, 256 bytes each) and a Mamba group (one region of 1 KiB
// pages), 8 logical blocks each.
func accessLayout() (*topology.Layout, []int) {
	l := &topology.Layout{LogicalBlockSize: 32, KernelBlockSize: 16,
		Regions: []topology.Region{
			{Kind: topology.KindFullAttention, Base: 0x10000, BlockLen: 256, NumBlocks: 16},
			{Kind: topology.KindFullAttention, Base: 0x20000, BlockLen: 256, NumBlocks: 16},
			{Kind: topology.KindMamba, Base: 0x30000, BlockLen: 1024, NumBlocks: 8},
		},
		Groups: []topology.Group{{Kind: topology.KindFullAttention, Regions: []int{0, 1}}, {Kind: topology.KindMamba, Regions: []int{2}}},
	}
	return l, []int{8, 8}
}

func spansOf(g0, g1 []topology.BlockID) []topology.Span {
	return []topology.Span{{IDs: g0}, {IDs: g1}}
}

// A push table: WRITE grants by peer and block, kernel blocks mapped to
// their logical block, late WRITEs of a revoked grant told apart from
// WRITEs that never had one, and every refusal counted.
func TestAccessTablePush(t *testing.T) {
	l, gb := accessLayout()
	m := NewMetrics()
	tab := newAccessTable(l, gb, ModePush, m)
	const p1, p2, evil = PeerName("p1"), PeerName("p2"), PeerName("evil")
	const g, g2 = 1, 2
	tab.grantWrite(g, []PeerName{p1, p2}, spansOf([]topology.BlockID{2, 3, 6}, []topology.BlockID{5}), "")
	w := hotpath.OpWrite
	for _, c := range []struct {
		name string
		peer PeerName
		op   hotpath.Op
		addr uint64
		n    uint64
		want Access
	}{
		{"logical block 2 = kernel blocks 4-5", p1, w, 0x10000 + 4*256, 512, AccessAllow},
		{"blocks 2-3 in one run", p2, w, 0x10000 + 4*256, 4 * 256, AccessAllow},
		{"second region, block 6 tail", p1, w, 0x20000 + 13*256 + 100, 156, AccessAllow},
		{"run past the grant into block 4", p1, w, 0x10000 + 6*256, 3 * 256, AccessDeny},
		{"block 1", p1, w, 0x10000 + 2*256, 1, AccessDeny},
		{"Mamba block 5", p2, w, 0x30000 + 5*1024, 1024, AccessAllow},
		{"Mamba block 2 (granted in the other group only)", p1, w, 0x30000 + 2*1024, 8, AccessDeny},
		{"another peer", evil, w, 0x10000 + 4*256, 512, AccessDeny},
		{"READ in push", p1, hotpath.OpRead, 0x10000 + 4*256, 512, AccessDeny},
		{"between regions", p1, w, 0x18000, 16, AccessDeny},
		{"across a region's end", p1, w, 0x10000 + 15*256, 512, AccessDeny},
		{"below every region", p1, w, 0x100, 16, AccessDeny},
		{"nothing", evil, w, 0x100, 0, AccessAllow},
	} {
		if got := tab.CheckAccess(c.peer, c.op, c.addr, c.n); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	tab.revokeWrite(g)
	if got := tab.CheckAccess(p1, w, 0x10000+4*256, 512); got != AccessLate {
		t.Errorf("after revoke, its peer: %v, want late", got)
	}
	if got := tab.CheckAccess(evil, w, 0x10000+4*256, 512); got != AccessDeny {
		t.Errorf("after revoke, another peer: %v, want deny", got)
	}
	// The block goes to another request of another producer.
	tab.grantWrite(g2, []PeerName{evil}, spansOf([]topology.BlockID{2}, nil), "")
	if got := tab.CheckAccess(p1, w, 0x10000+4*256, 512); got != AccessDeny {
		t.Errorf("block regranted, old peer: %v, want deny", got)
	}
	if got := tab.CheckAccess(p1, w, 0x10000+6*256, 512); got != AccessLate {
		t.Errorf("block 3 still the old grant's: %v, want late", got)
	}
	if got := tab.CheckAccess(evil, w, 0x10000+4*256, 512); got != AccessAllow {
		t.Errorf("block regranted, new peer: %v, want allow", got)
	}
	tab.revokeWrite(g2)
	tab.revokeWrite(g2) // idempotent
	// Ended grants are remembered up to a bound, then forgotten (deny).
	for i := range maxRevoked {
		tab.grantWrite(uint32(3+i), []PeerName{p2}, spansOf([]topology.BlockID{7}, nil), "")
		tab.revokeWrite(uint32(3 + i))
	}
	if got := tab.CheckAccess(p1, w, 0x10000+6*256, 512); got != AccessDeny {
		t.Errorf("a forgotten grant: %v, want deny", got)
	}
	if n := len(tab.grants); n != maxRevoked {
		t.Errorf("%d grants remembered, want %d", n, maxRevoked)
	}
	s := m.Snapshot().RefusedAccess
	if s["write_deny"] == 0 || s["write_late"] == 0 || s["read_deny"] != 1 {
		t.Errorf("refusals counted: %v", s)
	}
}

// A pull READ is admitted only out of the hold it names: by its producer
// request when it names one, else by its transfer. Before, a READ naming
// no producer request (params without remote_request_id) was admitted out
// of any hold: one of a request whose producer engine had crashed and
// attached again read the new engine's request held in the same blocks,
// and reported done with its bytes (test/recovery_test.go,
// TestPullReadOfCrashedHoldMeetsNewHold).
func TestAccessTablePullReadNamesItsHold(t *testing.T) {
	l, gb := accessLayout()
	tab := newAccessTable(l, gb, ModePull, NewMetrics())
	read := func(preq, tid string) Access {
		tag := appendMsg(nil, &msg{Kind: msgDone, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d", PReq: preq, TransferID: tid})
		a, _, adm := tab.Admit("d", hotpath.OpRead, []Range{{Addr: 0x10000 + 4*256, Len: 512}}, tag, nil)
		tab.Done(adm)
		return a
	}
	blocks := spansOf([]topology.BlockID{2}, nil)
	tab.hold(blocks, 1, "p-new", "t-new") // the new engine's request
	for _, c := range []struct {
		preq, tid string
		want      Access
	}{
		{"p-new", "t-new", AccessAllow},
		{"p-new", "", AccessAllow},
		{"", "t-new", AccessAllow},
		{"p-old", "t-new", AccessLate}, // the producer request named decides
		{"p-new", "t-old", AccessLate}, // and the transfer: the id reused, a late READ of its earlier transfer
		{"p-old", "", AccessLate},
		{"", "t-old", AccessLate}, // the crashed engine's transfer
		{"", "", AccessAllow},     // nothing named: the lease bounds it (README)
	} {
		if got := read(c.preq, c.tid); got != c.want {
			t.Errorf("READ naming producer request %q, transfer %q: %v, want %v", c.preq, c.tid, got, c.want)
		}
	}
	tab.hold(blocks, -1, "p-new", "t-new")
	tab.hold(blocks, 1, "p-x", "") // a hold of no transfer
	if got := read("", "t-new"); got != AccessLate {
		t.Errorf("READ naming a transfer, of a hold of none: %v, want late", got)
	}
	if got := read("p-x", ""); got != AccessAllow {
		t.Errorf("READ naming the holding request: %v, want allow", got)
	}
	if got := read("p-x", "t-x"); got != AccessAllow {
		t.Errorf("READ naming the holding request and a transfer, of a hold that said none: %v, want allow", got)
	}
}

// A pull table: READs of held blocks only, holds counted (blocks shared by
// two requests stay readable until both let go), WRITEs never.
func TestAccessTablePull(t *testing.T) {
	l, gb := accessLayout()
	tab := newAccessTable(l, gb, ModePull, NewMetrics())
	r := hotpath.OpRead
	a := spansOf([]topology.BlockID{1, 2}, []topology.BlockID{3})
	b := spansOf([]topology.BlockID{2}, nil)
	if got := tab.CheckAccess("d", r, 0x10000+2*256, 256); got != AccessLate {
		t.Errorf("before any hold: %v, want late (the producer may not have taken its step yet)", got)
	}
	tab.hold(a, 1, "", "")
	tab.hold(b, 1, "", "")
	for _, c := range []struct {
		addr, n uint64
		op      hotpath.Op
		want    Access
	}{
		{0x10000 + 2*256, 4 * 256, r, AccessAllow},
		{0x20000 + 5*256, 10, r, AccessAllow},
		{0x30000 + 3*1024, 1024, r, AccessAllow},
		{0x30000 + 2*1024, 1024, r, AccessLate},
		{0x10000 + 2*256, 6 * 256, r, AccessLate},
		{0x10000 + 2*256, 256, hotpath.OpWrite, AccessDeny},
		{0x50000, 256, r, AccessDeny},
	} {
		if got := tab.CheckAccess("d", c.op, c.addr, c.n); got != c.want {
			t.Errorf("%v [%#x, +%d): %v, want %v", c.op, c.addr, c.n, got, c.want)
		}
	}
	tab.hold(a, -1, "", "")
	if got := tab.CheckAccess("d", r, 0x10000+4*256, 512); got != AccessAllow {
		t.Errorf("block 2 still held by b: %v", got)
	}
	if got := tab.CheckAccess("d", r, 0x10000+2*256, 256); got != AccessLate {
		t.Errorf("block 1 released: %v, want late", got)
	}
	tab.hold(b, -1, "", "")
	tab.hold(b, -1, "", "") // never below zero
	tab.hold(b, 1, "", "")
	if got := tab.CheckAccess("d", r, 0x10000+4*256, 512); got != AccessAllow {
		t.Errorf("block 2 held again: %v", got)
	}
}

// Revocation and landing are atomic: a revocation (or a pull hold let go)
// cuts short every part admitted under it and returns only once each has
// ended; parts of other grants, or of blocks still held, go on untouched;
// once it returns, nothing more is admitted under it.
func TestAccessFenceDrains(t *testing.T) {
	l, gb := accessLayout()
	t.Run("push", func(t *testing.T) {
		m := NewMetrics()
		tab := newAccessTable(l, gb, ModePush, m)
		tab.grantWrite(1, []PeerName{"p"}, spansOf([]topology.BlockID{2}, nil), "")
		tab.grantWrite(2, []PeerName{"p"}, spansOf([]topology.BlockID{3}, nil), "")
		aborted := make(chan struct{}, 2)
		abort := func() { aborted <- struct{}{} }
		a, i, adm1 := tab.Admit("p", hotpath.OpWrite, []Range{{0x10000 + 4*256, 512}}, nil, abort)
		if a != AccessAllow || i != -1 || adm1 == 0 {
			t.Fatalf("Admit of a granted part: %v, %d, %d", a, i, adm1)
		}
		_, _, adm2 := tab.Admit("p", hotpath.OpWrite, []Range{{0x10000 + 6*256, 512}}, nil, func() { t.Error("a part of another grant was cut short") })
		if a, i, _ := tab.Admit("p", hotpath.OpWrite, []Range{{0x10000 + 4*256, 16}, {0x10000 + 2*256, 16}}, nil, nil); a != AccessDeny || i != 1 {
			t.Errorf("a part with an ungranted range: %v at %d, want deny at 1", a, i)
		}
		revoked := make(chan struct{})
		go func() { tab.revokeWrite(1); close(revoked) }()
		select {
		case <-aborted:
		case <-time.After(10 * time.Second):
			t.Fatal("the part landing under a revoked grant was not cut short")
		}
		select {
		case <-revoked:
			t.Fatal("revokeWrite returned while a part admitted under the grant still moved bytes")
		case <-time.After(50 * time.Millisecond):
		}
		tab.Done(adm1)
		<-revoked
		tab.Done(adm1) // a second Done is ignored
		if a, _, _ := tab.Admit("p", hotpath.OpWrite, []Range{{0x10000 + 4*256, 512}}, nil, nil); a != AccessLate {
			t.Errorf("a part after the revocation: %v, want late", a)
		}
		tab.Done(adm2)
		tab.revokeWrite(2) // nothing in flight: at once
		if s := m.Snapshot().RefusedAccess; s["write_aborted"] != 1 {
			t.Errorf("refusals %v, want one write_aborted", s)
		}
	})
	t.Run("pull", func(t *testing.T) {
		tab := newAccessTable(l, gb, ModePull, NewMetrics())
		a, b := spansOf([]topology.BlockID{1}, nil), spansOf([]topology.BlockID{1, 2}, nil)
		tab.hold(a, 1, "", "")
		tab.hold(b, 1, "", "")
		aborted := make(chan struct{}, 1)
		_, _, adm := tab.Admit("d", hotpath.OpRead, []Range{{0x10000 + 2*256, 512}}, nil, func() { aborted <- struct{}{} })
		tab.hold(a, -1, "", "") // block 1 still held by b: the READ goes on
		select {
		case <-aborted:
			t.Fatal("a READ of blocks still held was cut short")
		default:
		}
		released := make(chan struct{})
		go func() { tab.hold(b, -1, "", ""); close(released) }()
		<-aborted
		select {
		case <-released:
			t.Fatal("a hold let go while a READ of its blocks was still admitted")
		case <-time.After(50 * time.Millisecond):
		}
		tab.Done(adm)
		<-released
	})
}

// A part's tag is the peer's: one that does not decode, is not a notice a
// transfer carries, or names no request, is refused and its connection
// dropped (deny); a tag naming the request its blocks are granted for is
// admitted, one naming another is late.
func TestAccessFenceTags(t *testing.T) {
	l, gb := accessLayout()
	tab := newAccessTable(l, gb, ModePush, NewMetrics())
	tab.grantWrite(1, []PeerName{"p"}, spansOf([]topology.BlockID{2}, nil), "d-1")
	part := []Range{{0x10000 + 4*256, 512}}
	tag := func(k msgKind, dreq string) []byte {
		return appendMsg(nil, &msg{Kind: k, Engine: "P", TPSize: 1, PPSize: 1, DReq: dreq})
	}
	for _, c := range []struct {
		name string
		tag  []byte
		want Access
	}{
		{"no tag (a peer of an earlier build)", nil, AccessAllow},
		{"its request", tag(msgDone, "d-1"), AccessAllow},
		{"its request, a layer's tag", tag(msgTag, "d-1"), AccessAllow},
		{"another request", tag(msgDone, "d-2"), AccessLate},
		{"garbage", []byte{0xff, 0x01, 0x02}, AccessDeny},
		{"a registration", tag(msgReg, "d-1"), AccessDeny},
		{"no request named", tag(msgDone, ""), AccessDeny},
	} {
		a, _, adm := tab.Admit("p", hotpath.OpWrite, part, c.tag, nil)
		tab.Done(adm)
		if a != c.want {
			t.Errorf("%s: %v, want %v", c.name, a, c.want)
		}
	}
}

// AdmitLayout decides exactly what Admit decides for the ranges the
// layouts expand to, with the same first refusal, over random grants,
// revocations, layouts (bases in and across regions, at region starts and
// inside them, entries in, across and past blocks) and tags.
func TestAdmitLayoutMatchesAdmit(t *testing.T) {
	for _, l := range []*topology.Layout{nil, sameShapeGroups()} {
		testAdmitLayoutMatchesAdmit(t, l)
	}
}

// sameShapeGroups: two groups whose regions have the same blocks (a
// full attention group of two regions, a sliding window one of one).
func sameShapeGroups() *topology.Layout {
	return &topology.Layout{LogicalBlockSize: 32, KernelBlockSize: 16,
		Regions: []topology.Region{
			{Kind: topology.KindFullAttention, Base: 0x10000, BlockLen: 256, NumBlocks: 16},
			{Kind: topology.KindFullAttention, Base: 0x20000, BlockLen: 256, NumBlocks: 16},
			{Kind: topology.KindSlidingWindow, Base: 0x30000, BlockLen: 256, NumBlocks: 16},
		},
		Groups: []topology.Group{{Kind: topology.KindFullAttention, Regions: []int{0, 1}}, {Kind: topology.KindSlidingWindow, Regions: []int{2}}},
	}
}

func testAdmitLayoutMatchesAdmit(t *testing.T, l *topology.Layout) {
	gb := []int{8, 8}
	if l == nil {
		l, gb = accessLayout()
	}
	r := rand.New(rand.NewPCG(11, 12))
	tag := func(dreq string) []byte {
		return appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 1, PPSize: 1, DReq: dreq})
	}
	peers := []PeerName{"p1", "p2"}
	bases := []uint64{0x10000, 0x20000, 0x30000, 0x10000 + 512, 0x20000 + 1024, 0x30000 + 1024, 0x10000 + 3*256, 0x18000, 0x1f000,
		0x30000, 0x20000, 0x10000}
	allowed, refused := 0, 0
	for range 3000 {
		tab := newAccessTable(l, gb, ModePush, NewMetrics())
		for id := uint32(1); id <= uint32(1+r.IntN(3)); id++ {
			tab.grantWrite(id, peers[:1+r.IntN(2)], randomSpans(r), fmt.Sprintf("d-%d", id))
			if r.IntN(4) == 0 {
				tab.revokeWrite(id)
			}
		}
		lays, ranges, where := randomLayouts(r, bases)
		peer := peers[r.IntN(2)]
		var tg []byte
		if r.IntN(2) == 0 {
			tg = tag(fmt.Sprintf("d-%d", 1+r.IntN(3)))
		}
		wa, wj, wadm := tab.Admit(peer, hotpath.OpWrite, ranges, tg, nil)
		tab.Done(wadm)
		ga, li, bi, ei, gadm := tab.AdmitLayout(peer, hotpath.OpWrite, lays, tg, nil)
		tab.Done(gadm)
		want := [3]int{-1, -1, -1}
		if wj >= 0 {
			want = where[wj]
		}
		if ga != wa || [3]int{li, bi, ei} != want {
			t.Fatalf("layouts %+v, peer %s, tag %v: AdmitLayout %v at %v, Admit %v at %v", lays, peer, tg != nil, ga, [3]int{li, bi, ei}, wa, want)
		}
		if ga == AccessAllow {
			allowed++
		} else {
			refused++
		}
	}
	if allowed < 100 || refused < 100 {
		t.Fatalf("%d allowed and %d refused: the cases do not cover both", allowed, refused)
	}
	t.Logf("%d allowed, %d refused", allowed, refused)
}

// AdmitLayout for a pull producer's READs decides what Admit decides for
// the expanded ranges (holds, the request a READ names), and a layout it
// admitted is cut short by the release of a hold exactly when the same
// ranges admitted one by one are.
func TestAdmitLayoutMatchesAdmitRead(t *testing.T) {
	for _, lay := range []*topology.Layout{nil, sameShapeGroups()} {
		gb := []int{8, 8}
		l := lay
		if l == nil {
			l, gb = accessLayout()
		}
		r := rand.New(rand.NewPCG(13, 14))
		bases := []uint64{0x10000, 0x20000, 0x30000, 0x10000 + 512, 0x20000 + 1024, 0x30000 + 1024, 0x18000, 0x30000, 0x20000, 0x10000}
		tag := func(preq string) []byte {
			return appendMsg(nil, &msg{Kind: msgDone, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d", PReq: preq})
		}
		allowed, cut := 0, 0
		for range 2000 {
			type hold struct {
				spans []topology.Span
				req   string
			}
			var holds []hold
			mk := func() *accessTable {
				tab := newAccessTable(l, gb, ModePull, NewMetrics())
				for _, h := range holds {
					tab.hold(h.spans, 1, h.req, "")
				}
				return tab
			}
			for k := range 1 + r.IntN(3) {
				holds = append(holds, hold{randomSpans(r), fmt.Sprintf("p-%d", k)})
			}
			lays, ranges, where := randomLayouts(r, bases)
			var tg []byte
			if r.IntN(2) == 0 {
				tg = tag(fmt.Sprintf("p-%d", r.IntN(3)))
			}
			release := holds[r.IntN(len(holds))]
			// Admit, then let one hold go: was the part cut short?
			run := func(layout bool) (Access, [3]int, bool) {
				tab := mk()
				var adm Admission
				aborted := false
				abort := func() { aborted = true; go tab.Done(adm) }
				var a Access
				at := [3]int{-1, -1, -1}
				if layout {
					var li, bi, ei int
					a, li, bi, ei, adm = tab.AdmitLayout("d", hotpath.OpRead, lays, tg, abort)
					at = [3]int{li, bi, ei}
				} else {
					var j int
					a, j, adm = tab.Admit("d", hotpath.OpRead, ranges, tg, abort)
					if j >= 0 {
						at = where[j]
					}
				}
				if a == AccessAllow {
					tab.hold(release.spans, -1, release.req, "")
					tab.Done(adm)
				}
				return a, at, aborted
			}
			wa, wat, wcut := run(false)
			ga, gat, gcut := run(true)
			if ga != wa || gat != wat || gcut != wcut {
				t.Fatalf("layouts %+v, tag %v: AdmitLayout %v at %v (cut %v), Admit %v at %v (cut %v)", lays, tg != nil, ga, gat, gcut, wa, wat, wcut)
			}
			if ga == AccessAllow {
				allowed++
			}
			if gcut {
				cut++
			}
		}
		if allowed < 50 || cut < 20 {
			t.Fatalf("%d allowed, %d cut short: the cases do not cover both", allowed, cut)
		}
		t.Logf("%d allowed, %d cut short by a hold's release", allowed, cut)
	}
}

// randomSpans is a random set of blocks of accessLayout's two groups
// (or sameShapeGroups').
func randomSpans(r *rand.Rand) []topology.Span {
	var g0, g1 []topology.BlockID
	for range r.IntN(8) {
		g0 = append(g0, topology.BlockID(r.IntN(8)))
	}
	for range r.IntN(3) {
		g1 = append(g1, topology.BlockID(r.IntN(8)))
	}
	return spansOf(g0, g1)
}

// randomLayouts is one or two layouts at some of bases, entries in, across
// and past 256-byte blocks, the ranges they expand to, and where each
// range comes from (layout, base, entry).
func randomLayouts(r *rand.Rand, bases []uint64) (lays []LayoutRanges, ranges []Range, where [][3]int) {
	for range 1 + r.IntN(2) {
		var lr LayoutRanges
		for range 1 + r.IntN(4) {
			lr.Bases = append(lr.Bases, bases[r.IntN(len(bases))])
		}
		for range r.IntN(5) {
			lr.Entries = append(lr.Entries, Range{uint64(r.IntN(16))*256*uint64(r.IntN(2)) + uint64(r.IntN(3))*100, uint64(r.IntN(4)) * 200})
		}
		lays = append(lays, lr)
	}
	for li, lr := range lays {
		for bi, b := range lr.Bases {
			for ei, e := range lr.Entries {
				ranges, where = append(ranges, Range{b + e.Addr, e.Len}), append(where, [3]int{li, bi, ei})
			}
		}
	}
	return lays, ranges, where
}

// A grant laid out for a gate (grantLayouts) is exactly what the table
// allows its peer: the attention regions share their entries (logical
// blocks of two kernel blocks), the Mamba region has its own; every
// range laid out is allowed, and its neighbours are not. Admitted as a
// standing admission (AdmitGate), the grant's end cuts it short without
// counting an aborted part, and waits for its end.
func TestGrantLayouts(t *testing.T) {
	l, gb := accessLayout()
	m := NewMetrics()
	tab := newAccessTable(l, gb, ModePush, m)
	const p = PeerName("p")
	tab.grantWrite(1, []PeerName{p}, spansOf([]topology.BlockID{2, 3, 6}, []topology.BlockID{5}), "d-1")
	lays := tab.grantLayouts(spansOf([]topology.BlockID{2, 3, 6}, []topology.BlockID{5}))
	want := fmt.Sprint([]LayoutRanges{
		{Bases: []uint64{0x10000, 0x20000}, Entries: []Range{{2 * 512, 512}, {3 * 512, 512}, {6 * 512, 512}}},
		{Bases: []uint64{0x30000}, Entries: []Range{{5 * 1024, 1024}}},
	})
	if got := fmt.Sprint(lays); got != want {
		t.Fatalf("laid out %s, want %s", got, want)
	}
	w := hotpath.OpWrite
	for _, lay := range lays {
		for _, b := range lay.Bases {
			for _, e := range lay.Entries {
				if a := tab.CheckAccess(p, w, b+e.Addr, e.Len); a != AccessAllow {
					t.Errorf("[%#x, +%d) laid out, and %v", b+e.Addr, e.Len, a)
				}
				if a := tab.CheckAccess(p, w, b+e.Addr+e.Len, 1); a == AccessAllow && e.Addr+e.Len != 3*512 {
					t.Errorf("the byte after [%#x, +%d) is allowed, and not laid out", b+e.Addr, e.Len)
				}
			}
		}
	}
	tag := appendMsg(nil, &msg{Kind: msgTag, Engine: "D", DReq: "d-1", TPSize: 1, PPSize: 1})
	aborted := make(chan struct{})
	a, _, _, _, adm := tab.AdmitGate(p, lays, tag, func() { close(aborted) })
	if a != AccessAllow {
		t.Fatalf("the gate's grant admitted %v", a)
	}
	revoked := make(chan struct{})
	go func() {
		tab.revokeWrite(1)
		close(revoked)
	}()
	<-aborted
	select {
	case <-revoked:
		t.Fatal("the grant's end returned before its gate's admission ended")
	case <-time.After(20 * time.Millisecond):
	}
	tab.Done(adm)
	<-revoked
	if n := m.Snapshot().RefusedAccess["write_aborted"]; n != 0 {
		t.Fatalf("a gate's end counted as %d aborted parts", n)
	}
}
