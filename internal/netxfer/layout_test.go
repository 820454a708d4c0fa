package netxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"
)

// layoutBatch is a pieceBatch that takes layouts as they are (counting
// them), expanding them the way the copy kernel addresses them.
type layoutBatch struct {
	pieceBatch
	layouts *int
	mu      *sync.Mutex
}

func (b *layoutBatch) AddLayout(regions []DevRegion, entries []DevEntry) bool {
	b.mu.Lock()
	*b.layouts++
	b.mu.Unlock()
	for _, r := range regions {
		for _, e := range entries {
			b.ps = append(b.ps, DevPiece{r.Dst + e.Dst, r.Src + e.Src, e.Len})
		}
	}
	return true
}

// layoutGPU is a batchGPU whose batches take layouts.
type layoutGPU struct {
	*batchGPU
	layouts int
}

func (d *layoutGPU) NewBatch(n int) (DevBatch, error) {
	return &layoutBatch{pieceBatch: pieceBatch{room: 1 << 30, post: d.PostCopy}, layouts: &d.layouts, mu: &d.mu}, nil
}

func (d *layoutGPU) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.layouts
}

// kvLayout is a KV-shaped layout in [local, +1 MiB) and [remote, +1 MiB):
// layers of 128 KiB (bases), n scattered blocks of piece bytes in each
// (entries, the same in every layer).
func kvLayout(r *rand.Rand, local, remote uint64, layers, n, piece int) Layout {
	const layer = 128 << 10
	var l Layout
	for i := range layers {
		l.Bases = append(l.Bases, BasePair{local + uint64(i*layer), remote + uint64(i*layer)})
	}
	ls, rs := r.Perm(layer/piece), r.Perm(layer/piece)
	for i := range n {
		l.Entries = append(l.Entries, LayoutEntry{Local: uint64(ls[i] * piece), Remote: uint64(rs[i] * piece), Len: uint64(piece)})
	}
	return l
}

// A layout WRITE between GPU memories on the same host goes as one
// layout part and one batch of the layouts as they are (no piece listed
// on either side), every byte where it belongs and nothing else changed;
// with a fence that is not a LayoutFence, the part is admitted piece by
// piece.
func TestPostLayoutDevice(t *testing.T) {
	for _, op := range []Op{Write, Read} {
		for _, fenced := range []bool{false, true} {
			testPostLayoutDevice(t, op, fenced)
		}
	}
}

func testPostLayoutDevice(t *testing.T, op Op, fenced bool) {
	g := newFakeGPU()
	d := &layoutGPU{batchGPU: newBatchGPU(g, "gpu0")}
	a, b, pa, pb := layoutPair(t, d)
	f := &recordFence{}
	if fenced {
		if err := b.SetGuard(f); err != nil {
			t.Fatal(err)
		}
	}
	r := rand.New(rand.NewPCG(7, 8))
	for i := range 3 {
		// Two layouts, the second's 512-byte pieces in blocks the
		// first does not write.
		lays := []Layout{kvLayout(r, pa, pb, 8, 15, 4096)}
		second := Layout{Bases: lays[0].Bases[2:4], Entries: lays[0].Entries[12:]}
		for i := range second.Entries {
			second.Entries[i].Len = 512
			second.Entries[i].Remote += uint64(r.IntN(8)) * 512
		}
		lays[0].Entries = lays[0].Entries[:12]
		lays = append(lays, second)
		dst := pb // the memory that changes
		if op == Read {
			dst = pa
		}
		before := g.view(dst, 1<<20)
		id, err := a.PostLayout(op, b.Name(), lays, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("%v: %v, %v", op, s, err)
		}
		ds := ExpandLayouts(nil, lays)
		checkGPUMoved(t, g, op, ds)
		if op == Read {
			for i := range ds {
				ds[i].Local, ds[i].Remote = ds[i].Remote, ds[i].Local
			}
		}
		checkUntouched(t, g.view(dst, 1<<20), before, dst, ds)
		if b.LayoutParts() != uint64(i+1) || d.count() != 2*(i+1) {
			t.Fatalf("%v: after %d transfers: %d layout parts, %d layouts staged; want %d and %d", op, i+1, b.LayoutParts(), d.count(), i+1, 2*(i+1))
		}
		if posts, _ := d.stats(); posts != i+1 {
			t.Fatalf("%v: %d batches for %d transfers", op, posts, i+1)
		}
		g.fill(pa, 1<<20)
		g.fill(pb, 1<<20)
	}
	if fenced {
		// A READ's server ends its admission once its answer went out,
		// maybe after the client copied.
		for deadline := time.Now().Add(10 * time.Second); f.open() != 0 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		}
		f.mu.Lock()
		admitted := f.admitted
		f.mu.Unlock()
		if admitted != 3 || f.open() != 0 {
			t.Fatalf("%v: the fence admitted %d parts (%d still open), want 3, none open", op, admitted, f.open())
		}
	}
}

// layoutPair is batchPair over a device that takes layouts, failing the
// test if a batch named memory outside the allocations.
func layoutPair(t *testing.T, d *layoutGPU) (a, b *Agent, pa, pb uint64) {
	t.Helper()
	return layoutPairCfg(t, d, Config{})
}

// layoutPairCfg is layoutPair with cfgB for b.
func layoutPairCfg(t *testing.T, d *layoutGPU, cfgB Config) (a, b *Agent, pa, pb uint64) {
	t.Helper()
	// Run last (cleanups run in reverse): no batch of the test named
	// memory outside the allocations.
	t.Cleanup(func() {
		d.fakeGPU.mu.Lock()
		defer d.fakeGPU.mu.Unlock()
		if d.fakeGPU.illegal > 0 {
			t.Errorf("%d pieces of GPU batches named memory outside every allocation", d.fakeGPU.illegal)
		}
	})
	return batchPairCfgs(t, d, d, Config{}, cfgB)
}

// checkUntouched fails unless after equals before outside the
// destinations of ds (memory at base).
func checkUntouched(t *testing.T, after, before []byte, base uint64, ds []Desc) {
	t.Helper()
	moved := make([]bool, len(after))
	for _, d := range ds {
		for i := d.Remote - base; i < d.Remote-base+d.Len; i++ {
			moved[i] = true
		}
	}
	for i := range after {
		if !moved[i] && after[i] != before[i] {
			t.Fatalf("byte %d of the destination changed, outside every piece", i)
		}
	}
}

// Layouts in host memory, between agents of two kinds of connection
// (same-host and TCP), WRITE and READ: posted as the pieces they stand
// for, every byte checked.
func TestPostLayoutHost(t *testing.T) {
	for _, cfg := range []Config{{Conns: 2}, {Conns: 2, DisableSameHost: true}} {
		a, b, am, bm := localPair(t, 1<<20, cfg)
		r := rand.New(rand.NewPCG(1, 2))
		for _, op := range []Op{Write, Read} {
			fillRandom(am)
			fillRandom(bm)
			lays := []Layout{kvLayout(r, base, base, 8, 10, 1024)}
			id, err := a.PostLayout(op, b.Name(), lays, nil)
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, id); s != Done {
				t.Fatalf("%v: %v, %v", op, s, err)
			}
			for i, d := range ExpandLayouts(nil, lays) {
				if !bytes.Equal(am[d.Local-base:d.Local-base+d.Len], bm[d.Remote-base:d.Remote-base+d.Len]) {
					t.Fatalf("%v (same host %v): piece %d differs", op, !cfg.DisableSameHost, i)
				}
			}
		}
		if b.LayoutParts() != 0 {
			t.Fatalf("host memory went as %d layout parts", b.LayoutParts())
		}
	}
}

// A layout whose pieces leave the receiver's memory (a base's span past
// its end, an entry past it) fails with ErrOutOfBounds named, and nothing
// lands; one past the sender's own memory is refused at PostLayout.
func TestPostLayoutOutOfBounds(t *testing.T) {
	g := newFakeGPU()
	d := &layoutGPU{batchGPU: newBatchGPU(g, "gpu0")}
	a, b, pa, pb := layoutPair(t, d)
	r := rand.New(rand.NewPCG(3, 4))
	for _, op := range []Op{Write, Read} {
		for _, c := range []struct {
			name string
			mod  func(*Layout)
		}{
			{"base past the end", func(l *Layout) { l.Bases[3].Remote = pb + 1<<20 - 4096 }},
			{"entry past the end", func(l *Layout) { l.Entries[5].Remote = 1<<20 - 100 }},
			{"base before the start", func(l *Layout) { l.Bases[0].Remote = pb - 1<<20 }},
			{"wrapping base", func(l *Layout) { l.Bases[1].Remote = ^uint64(0) - 4095 }},
		} {
			lay := kvLayout(r, pa, pb, 8, 12, 4096)
			c.mod(&lay)
			before, beforeA := g.view(pb, 1<<20), g.view(pa, 1<<20)
			id, err := a.PostLayout(op, b.Name(), []Layout{lay}, []byte("n"))
			if err != nil {
				t.Fatal(err)
			}
			s, err := wait(t, a, id)
			if s != Failed || !strings.Contains(err.Error(), "outside") && !errors.Is(err, ErrOutOfBounds) {
				t.Fatalf("%v %s: %v, %v; want failed out of bounds", op, c.name, s, err)
			}
			if !bytes.Equal(g.view(pb, 1<<20), before) || !bytes.Equal(g.view(pa, 1<<20), beforeA) {
				t.Fatalf("%v %s: bytes landed", op, c.name)
			}
			t.Logf("%v %s: %v", op, c.name, err)
		}
	}
	lay := kvLayout(r, pa, pb, 8, 12, 4096)
	lay.Bases[7].Local = pa + 1<<20 - 4096
	if id, err := a.PostLayout(Write, b.Name(), []Layout{lay}, nil); err == nil {
		if s, err := wait(t, a, id); s != Failed || !errors.Is(err, ErrOutOfBounds) {
			t.Fatalf("a layout past the sender's memory: %v, %v", s, err)
		}
	} else if !errors.Is(err, ErrOutOfBounds) {
		t.Fatalf("a layout past the sender's memory: %v", err)
	}
}

// layoutTable encodes one layout's table as PostLayout's sender does.
func layoutTable(bases []wireBase, ents []DevEntry) []byte {
	t := binary.LittleEndian.AppendUint32(nil, 1)
	t = binary.LittleEndian.AppendUint32(t, uint32(len(bases)))
	t = binary.LittleEndian.AppendUint32(t, uint32(len(ents)))
	for _, b := range bases {
		t = binary.LittleEndian.AppendUint64(t, b.dst)
		t = binary.LittleEndian.AppendUint32(t, b.ref.chunk)
		t = binary.LittleEndian.AppendUint64(t, b.ref.off)
	}
	for _, e := range ents {
		t = binary.LittleEndian.AppendUint64(t, e.Dst)
		t = binary.LittleEndian.AppendUint64(t, e.Src)
		t = binary.LittleEndian.AppendUint64(t, e.Len)
	}
	return t
}

// Layout tables a peer may send: well-formed ones parse to what was
// sent; malformed ones (truncated, bytes past the end, too many layouts
// or pieces, offsets past 2^47) are protocol errors naming what.
func TestParseLayouts(t *testing.T) {
	s := newLocalServer(nil)
	bases := []wireBase{{0x1000, localRef{3, 0}}, {0x9000, localRef{3, 1 << 20}}}
	ents := []DevEntry{{0, 4096, 4096}, {8192, 0, 100}, {5, 5, 0}}
	lays, err := s.parseLayouts(layoutTable(bases, ents))
	if err != nil {
		t.Fatal(err)
	}
	if len(lays) != 1 || len(lays[0].bases) != 2 || len(lays[0].ents) != 2 || lays[0].pieces != 4 ||
		lays[0].dspan != [2]uint64{0, 8292} || lays[0].sspan != [2]uint64{0, 8192} {
		t.Fatalf("parsed %+v", lays)
	}
	big := binary.LittleEndian.AppendUint32(nil, 1)
	big = binary.LittleEndian.AppendUint32(big, 1<<11)
	big = binary.LittleEndian.AppendUint32(big, 1<<10)
	big = append(big, make([]byte, (1<<11)*layoutBaseSize+(1<<10)*layoutEntrySize)...)
	many := binary.LittleEndian.AppendUint32(nil, maxLayouts+1)
	good := layoutTable(bases, ents)
	for _, c := range []struct {
		name, want string
		tab        []byte
	}{
		{"empty", "0 bytes", nil},
		{"truncated", "bytes left", good[:len(good)-1]},
		{"trailing", "past its layouts", append(append([]byte(nil), good...), 0)},
		{"too many layouts", "layouts, over", many},
		{"too many pieces", "pieces in the part", big},
		{"offset past 2^47", "over 2^47", layoutTable(bases, []DevEntry{{1 << 48, 0, 1}})},
		{"length past 2^47", "over 2^47", layoutTable(bases, []DevEntry{{0, 0, 1<<47 + 1}})},
	} {
		_, err := s.parseLayouts(c.tab)
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want a protocol error naming %q", c.name, err, c.want)
		}
	}
}

// A peer naming source bytes past the GPU memory it passed (a crafted
// layout part: an honest sender checks its own spans) is refused, and
// nothing lands.
func TestLayoutSourceOutOfBounds(t *testing.T) {
	g := newFakeGPU()
	d := &layoutGPU{batchGPU: newBatchGPU(g, "gpu0")}
	a, b, pa, pb := layoutPair(t, d)
	r := rand.New(rand.NewPCG(5, 6))
	// An honest transfer first: the connection and a's memory passed.
	id, err := a.PostLayout(Write, b.Name(), []Layout{kvLayout(r, pa, pb, 2, 2, 4096)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("%v, %v", s, err)
	}
	a.mu.Lock()
	chunk := a.chunkLocked(pa).id
	a.mu.Unlock()
	p, err := a.peer(b.Name())
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range []localRef{{chunk, 1<<20 - 100}, {chunk, ^uint64(0) - 10}, {chunk + 7, 0}} {
		before := g.view(pb, 1<<20)
		c, err := p.conn()
		if err != nil {
			t.Fatal(err)
		}
		x := &xfer{id: XferID(1<<40 + rand.Uint64N(1<<20)), op: Write, peer: p, parts: 1, state: InProgress}
		if err := c.expect(partKey{x.id, 0}, x); err != nil {
			t.Fatal(err)
		}
		tab := layoutTable([]wireBase{{pb, ref}}, []DevEntry{{0, 0, 4096}})
		h := appendWriteHeader(nil, tWriteLayout, x, 0, len(tab))
		c.wmu.Lock()
		_, err = c.c.Write(append(h, tab...))
		c.wmu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			a.mu.Lock()
			st, xerr := x.state, x.err
			a.mu.Unlock()
			if st == Failed {
				t.Logf("source %+v: %v", ref, xerr)
				break
			}
			if st == Done {
				t.Fatalf("source %+v: a part naming bytes past the memory passed landed", ref)
			}
			if time.Now().After(deadline) {
				t.Fatalf("source %+v: no answer in 10 s", ref)
			}
			time.Sleep(time.Millisecond)
		}
		if !bytes.Equal(g.view(pb, 1<<20), before) {
			t.Fatalf("source %+v: bytes landed", ref)
		}
	}
}

// FuzzParseLayouts: any table a peer sends parses to layouts or a
// protocol error, never a panic; what parses stays within the part's
// bounds (pieces, offsets) and its spans cover its entries.
func FuzzParseLayouts(f *testing.F) {
	f.Add(layoutTable([]wireBase{{0x1000, localRef{3, 0}}}, []DevEntry{{0, 4096, 4096}, {8192, 0, 100}}))
	f.Add(layoutTable(nil, nil))
	f.Add([]byte{2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, tab []byte) {
		s := newLocalServer(nil)
		lays, err := s.parseLayouts(tab)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("not a protocol error: %v", err)
			}
			return
		}
		pieces := 0
		for _, l := range lays {
			pieces += l.pieces
			for _, e := range l.ents {
				if e.Len == 0 || e.Dst > maxLayoutOff || e.Src > maxLayoutOff || e.Len > maxLayoutOff {
					t.Fatalf("entry %+v accepted", e)
				}
				if e.Dst < l.dspan[0] || e.Dst+e.Len > l.dspan[1] || e.Src < l.sspan[0] || e.Src+e.Len > l.sspan[1] {
					t.Fatalf("entry %+v outside the spans %v %v", e, l.dspan, l.sspan)
				}
			}
		}
		if pieces > maxDescs {
			t.Fatalf("%d pieces accepted", pieces)
		}
	})
}

// A layout READ answer is bounded before anything is allocated for it:
// more than maxLayouts layouts, or more than maxDescs bases in all (each
// layout's count under the limit), is a protocol error.
func TestReadLayoutAnswerBounded(t *testing.T) {
	a, err := New(Config{Name: fmt.Sprintf("%s-%d", t.Name(), rand.Uint64()), DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	answer := func(counts ...uint32) []byte {
		b := binary.LittleEndian.AppendUint64(nil, 7)
		b = binary.LittleEndian.AppendUint32(b, 0)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(counts)))
		for i, n := range counts {
			b = binary.LittleEndian.AppendUint32(b, n)
			if i < len(counts)-1 { // the last one's bases never arrive
				b = append(b, make([]byte, localRefSize*int(n))...)
			}
		}
		return b
	}
	tooMany := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint64(nil, 7), 0), maxLayouts+1)
	for _, c := range []struct {
		name, want string
		frame      []byte
	}{
		{"layouts", "layouts", tooMany},
		{"bases in all", "bases", answer(4, maxDescs/2, maxDescs/2+1)},
	} {
		conn := &conn{p: &peer{owner: a}, r: newScatterReader(bytes.NewReader(c.frame)), in: newLocalServer(nil)}
		var hdr [32]byte
		err := conn.readLayoutLocal(hdr[:])
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want a protocol error naming the %s", c.name, err, c.want)
		}
	}
}

// Builds from before layout frames and after reach each other: an agent
// that does not take them (noLayouts: its socket's name lacks
// layoutsMark, and a layout frame drops its connection) is sent the
// pieces the layouts stand for, WRITE and READ, every byte where it
// belongs and its connections kept; one that takes them gets layouts.
func TestPostLayoutToOlderBuild(t *testing.T) {
	for _, old := range []bool{true, false} {
		g := newFakeGPU()
		d := &layoutGPU{batchGPU: newBatchGPU(g, "gpu0")}
		a, b, pa, pb := layoutPairCfg(t, d, Config{noLayouts: old})
		r := rand.New(rand.NewPCG(3, 4))
		for i, op := range []Op{Write, Read, Write} {
			lays := []Layout{kvLayout(r, pa, pb, 8, 15, 4096)}
			id, err := a.PostLayout(op, b.Name(), lays, []byte("n"))
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, id); s != Done {
				t.Fatalf("older build %v, %v: %v, %v", old, op, s, err)
			}
			checkGPUMoved(t, g, op, ExpandLayouts(nil, lays))
			want := uint64(i + 1)
			if old {
				want = 0
			}
			if got := b.LayoutParts(); got != want {
				t.Fatalf("older build %v: %d layout parts after %d transfers, want %d", old, got, i+1, want)
			}
			g.fill(pa, 1<<20)
			g.fill(pb, 1<<20)
		}
	}
}

// spans is span of both sides at once: the same offsets, and false when
// either side's span is.
func TestSpans(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	pick := func() uint64 {
		switch r.IntN(8) {
		case 0:
			return 0
		case 1:
			return maxLayoutOff + uint64(r.IntN(2))
		default:
			return uint64(r.IntN(1 << 20))
		}
	}
	for range 5000 {
		es := make([]LayoutEntry, r.IntN(5))
		for i := range es {
			es[i] = LayoutEntry{Local: pick(), Remote: pick(), Len: pick()}
		}
		l, rm, ok := spans(es)
		llo, lhi, lok := span(es, true)
		rlo, rhi, rok := span(es, false)
		if ok != (lok && rok) || ok && (l != [2]uint64{llo, lhi} || rm != [2]uint64{rlo, rhi}) {
			t.Fatalf("%v: spans %v %v %v; span local %d %d %v, remote %d %d %v", es, l, rm, ok, llo, lhi, lok, rlo, rhi, rok)
		}
	}
}
