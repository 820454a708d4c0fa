package kvxfer

import (
	"encoding/binary"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// olderNotice is a peer notice byte for byte as builds from f5e7efc to
// 9630804 encoded it (wire version 1; no trailing fail kind or until), so
// that a change to appendMsg cannot hide a change of what this build
// accepts from them: magic, version, kind, engine, addr, tp and pp rank
// and size (varints), transfer id, d_req, p_req, no spans, no ids, no
// reason. A producer's WRITE notice (done, or tag on a layer-wise WRITE
// not the last) named the transfer its consumer registered with (the
// registration's, echoed: send.go's s.match.tid) since f5e7efc; a
// consumer's gate tag (worker.go's openGates, c5cbf22 to 9630804) named
// only its request: msgTag{DReq}.
func olderNotice(kind msgKind, engine, tid, dreq, preq string) []byte {
	b := []byte{'K', 1, byte(kind)}
	str := func(s string) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	str(engine)
	str("")
	for _, v := range []int64{0, 1, 0, 1} { // tp rank, tp size, pp rank, pp size
		b = binary.AppendVarint(b, v)
	}
	str(tid)
	str(dreq)
	str(preq)
	b = append(b, 0, 0) // spans, ids
	str("")             // reason
	return b
}

// A rolling upgrade across 9630804 (a WRITE grant keyed by the consumer
// request and its transfer, writeKey): a producer of an older build still
// WRITEs into a newer consumer's blocks, since its notices named the
// transfer all along; its late WRITE of an earlier transfer under the
// same consumer id is refused as late as a new producer's is. Gates do
// not match across the change (each side keys them by its own GateKey:
// the request alone before it, the request and its transfer after), so
// such a pair's WRITEs go two-sided, where the consumer's grant admits
// them: slower, never lost or misplaced (README, mixed builds).
func TestWriteGrantOlderBuilds(t *testing.T) {
	l := traceLayout(0, 1, 1<<20)
	m := NewMetrics()
	tab := newAccessTable(&l, []int{16}, ModePush, m)
	w := &Worker{access: tab}
	// The newer consumer's grant for d-1 of transfer t2, made as its loop
	// makes it (d-1 of transfer t1 ended before; its grant revoked).
	for _, o := range []op{
		{kind: opGrant, grant: 1, peers: []PeerName{"P/0"}, spans: []topology.Span{{IDs: []topology.BlockID{2}}}, req: "d-1", tid: "t1"},
		{kind: opRevoke, grant: 1},
		{kind: opGrant, grant: 2, peers: []PeerName{"P/0"}, spans: []topology.Span{{IDs: []topology.BlockID{2}}}, req: "d-1", tid: "t2"},
	} {
		if err := w.do(0, &o); err != nil {
			t.Fatal(err)
		}
	}
	blockLen := uint64(l.Regions[0].BlockLen)
	block2 := []Range{{l.Regions[0].Base + 2*blockLen, blockLen}}
	admit := func(tag []byte) Access {
		a, _, adm := tab.Admit("P/0", hotpath.OpWrite, block2, tag, nil)
		tab.Done(adm)
		return a
	}
	for _, c := range []struct {
		name string
		tag  []byte
		want Access
	}{
		{"an older producer's completion of t2", olderNotice(msgDone, "P", "t2", "d-1", "p-2"), AccessAllow},
		{"an older producer's layer tag of t2", olderNotice(msgTag, "P", "t2", "d-1", "p-2"), AccessAllow},
		{"an older producer's late completion of t1", olderNotice(msgDone, "P", "t1", "d-1", "p-1"), AccessLate},
		{"an older producer's late layer tag of t1", olderNotice(msgTag, "P", "t1", "d-1", "p-1"), AccessLate},
	} {
		if got := admit(c.tag); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	if got := m.Snapshot().RefusedAccess["write_late"]; got != 2 {
		t.Errorf("late WRITEs counted %d, want 2", got)
	}

	// Gates: the key a gate is announced under (the consumer's GateKey of
	// its tag) and the one a producer looks it up by (its own GateKey of
	// its WRITE's notice) must differ across the change, so that neither
	// side's WRITE goes one-sided into a gate the other keyed otherwise.
	olderGateKey := func(notif []byte) string { // GateKey before 9630804
		m, err := decodeMsg(notif)
		if err != nil || m.Kind != msgDone && m.Kind != msgTag || m.DReq == "" {
			return ""
		}
		return m.DReq
	}
	newTag := appendMsg(nil, &msg{Kind: msgTag, Engine: "D", TPSize: 1, PPSize: 1, TransferID: "t2", DReq: "d-1"})
	newNotice := appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 1, PPSize: 1, TransferID: "t2", DReq: "d-1", PReq: "p-2"})
	olderTag := olderNotice(msgTag, "D", "", "d-1", "")
	olderDone := olderNotice(msgDone, "P", "t2", "d-1", "p-2")
	if GateKey(newTag) != GateKey(newNotice) || olderGateKey(olderTag) != olderGateKey(olderDone) {
		t.Fatal("a gate does not match its own build's WRITE")
	}
	if GateKey(newTag) == olderGateKey(olderDone) || olderGateKey(olderTag) == GateKey(newNotice) {
		t.Errorf("a gate of one build matches a WRITE of the other: keys %q / %q", GateKey(newTag), olderGateKey(olderTag))
	}
	// The two-sided WRITE a newer producer sends an older consumer names
	// its request as the older consumer's grant (keyed by d-1 alone)
	// reads it: the older tagRequest took m.DReq.
	if dm, err := decodeMsg(newNotice); err != nil || dm.DReq != "d-1" {
		t.Errorf("a newer producer's notice as an older consumer reads it: %+v, %v", dm, err)
	}
}
