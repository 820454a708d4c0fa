package kvxfer_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// rawPost posts one transfer on a backend, outside any Worker, and waits
// for its end (bounded).
func rawPost(t *testing.T, be kvxfer.Backend, op hotpath.Op, peerMeta []byte, local, remote, n uint64) error {
	t.Helper()
	peer, err := be.LoadPeer(peerMeta)
	if err != nil {
		t.Fatal(err)
	}
	id, err := be.Post(op, peer, []hotpath.Desc{{Local: local, Remote: remote, Len: n}}, nil)
	if err != nil {
		return err
	}
	return awaitRaw(t, be, id)
}

// awaitRaw waits (bounded) for a raw transfer's end, releases it and
// returns its error.
func awaitRaw(t *testing.T, be kvxfer.Backend, id kvxfer.XferID) error {
	t.Helper()
	defer func() { _ = be.Release(id) }()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		switch s, err := be.State(id); s {
		case kvxfer.XferDone:
			return nil
		case kvxfer.XferFailed:
			return err
		}
	}
	t.Fatal("a raw transfer did not end")
	return nil
}

// blockAddr is the address of logical block b of region 0 of a rank.
func blockAddr(l *topology.Layout, b topology.BlockID) uint64 {
	r := l.Regions[0]
	return r.Base + uint64(int64(b)*int64(l.PagesPerBlock())*r.BlockLen)
}

func metaOf(t *testing.T, be kvxfer.Backend) []byte {
	t.Helper()
	m, err := be.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// awaitRegistration waits (bounded) until P's first rank holds one
// registration waiting for its request.
func awaitRegistration(t *testing.T, p *simEngine) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		if s, _ := p.workers[0][0].State(); s.PendingRegs == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("P never got D's registration")
		}
	}
}

// awaitOutcomes steps nothing; it collects outcomes until want reports
// arrived (bounded).
func awaitOutcomes(t *testing.T, want int, engines ...*simEngine) *outcomes {
	t.Helper()
	out := newOutcomes()
	for deadline := time.Now().Add(20 * time.Second); len(out.seen) < want && time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		for _, e := range engines {
			out.collect(t, e)
		}
	}
	if len(out.seen) != want {
		t.Fatalf("%d outcome reports, want %d: %v", len(out.seen), want, out.seen)
	}
	return out
}

// Least privilege on the built-in data plane, between real Workers over
// loopback TCP: in push, only the producer ranks of a request WRITE into
// its D blocks, only while it is registered (a rogue agent, the producer
// itself outside the request, and the producer after the request ended
// are refused, and nothing they send lands); in pull, D READs only blocks
// P holds for a request, and a READ that arrives before P holds them is
// tried again until it succeeds.
func TestDataPlaneGrants(t *testing.T) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	setup := func(t *testing.T, mode kvxfer.Mode) (p, d *simEngine, q *xreq, rogue *tcp.Backend, rogueBase uint64) {
		dir := kvxfertest.NewDirectory()
		p = startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", mode, nil)
		d = startNetEngine(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", mode, nil)
		t.Cleanup(func() { d.close(t); p.close(t) })
		groups := d.ranks[0][0].Layout.GroupList()
		rng := rand.New(rand.NewPCG(1, 2))
		q = makeRequest("a", 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
		p.ranks[0][0].Scramble(1)
		p.ranks[0][0].Fill(q.sim.P)
		d.ranks[0][0].Scramble(2)
		var err error
		rogue, err = tcp.New(tcp.Config{Name: fmt.Sprintf("%s-rogue-%d", t.Name(), rand.Uint64()), DisableLocal: true, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rogue.Close() })
		rogueBase = 0x7000_0000
		mem := bytes.Repeat([]byte{0xEE}, 1<<16)
		if err := rogue.Map(rogueBase, mem); err != nil {
			t.Fatal(err)
		}
		if err := rogue.Register([]kvxfer.MemRegion{{Addr: rogueBase, Len: 1 << 16, Kind: kvxfer.MemDRAM}}); err != nil {
			t.Fatal(err)
		}
		return p, d, q, rogue, rogueBase
	}

	t.Run("push", func(t *testing.T) {
		p, d, q, rogue, rb := setup(t, kvxfer.ModePush)
		dl, pl := &d.ranks[0][0].Layout, &p.ranks[0][0].Layout
		dMeta, pbe := metaOf(t, d.backends[0]), p.backends[0]
		now := time.Now()
		d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Minute))}})
		// D registered with P (its grant is in place): P holds the
		// registration, waiting for its own request.
		awaitRegistration(t, p)
		before := d.ranks[0][0].Snapshot()
		target := blockAddr(dl, q.sim.D[0].IDs[0])
		notMine := blockAddr(dl, 95) // a D block of no request
		for _, c := range []struct {
			name   string
			be     kvxfer.Backend
			local  uint64
			remote uint64
		}{
			{"a rogue agent into the request's blocks", rogue, rb, target},
			{"a rogue agent into other blocks", rogue, rb, notMine},
			{"the producer into blocks of no request", pbe, pl.Regions[0].Base, notMine},
		} {
			if err := rawPost(t, c.be, hotpath.OpWrite, dMeta, c.local, c.remote, 64); err == nil {
				t.Errorf("%s: the WRITE succeeded", c.name)
			}
			if !bytes.Equal(d.ranks[0][0].Mem, before) {
				t.Fatalf("%s: D's memory changed", c.name)
			}
		}
		// (The reads above come before the request's WRITE lands; only
		// sockets order them, which the race detector does not see.)
		d.backends[0].(*tcp.Backend).Settle()
		// The request itself goes through, byte for byte.
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
		out := awaitOutcomes(t, 2, p, d)
		if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
			t.Fatalf("D outcome %+v, want done", o)
		}
		if err := d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q.sim}, 16, 16); err != nil {
			t.Fatal(err)
		}
		// Once the request ended, its producer may not write there again.
		after := d.ranks[0][0].Snapshot()
		err := rawPost(t, pbe, hotpath.OpWrite, dMeta, pl.Regions[0].Base, target, 64)
		if !errors.Is(err, kvxfer.ErrNotGranted) {
			t.Errorf("a late WRITE of the producer: %v, want ErrNotGranted", err)
		}
		if !bytes.Equal(d.ranks[0][0].Mem, after) {
			t.Fatal("a late WRITE landed")
		}
		s := d.workers[0][0].Metrics().Snapshot().RefusedAccess
		if s["write_deny"] != 3 || s["write_late"] != 1 {
			t.Errorf("D refusals %v, want 3 write_deny and 1 write_late", s)
		}
	})

	t.Run("pull", func(t *testing.T) {
		p, d, q, rogue, rb := setup(t, kvxfer.ModePull)
		dl, pl := &d.ranks[0][0].Layout, &p.ranks[0][0].Layout
		pMeta, dbe := metaOf(t, p.backends[0]), d.backends[0]
		src := blockAddr(pl, q.sim.P[0].IDs[0])
		// Before P holds the blocks: no READ, and never a WRITE.
		if err := rawPost(t, dbe, hotpath.OpRead, pMeta, dl.Regions[0].Base, src, 64); !errors.Is(err, kvxfer.ErrNotGranted) {
			t.Errorf("READ of blocks not held: %v, want ErrNotGranted", err)
		}
		pBefore := p.ranks[0][0].Snapshot()
		if err := rawPost(t, rogue, hotpath.OpWrite, pMeta, rb, src, 64); err == nil {
			t.Error("a WRITE into a pull producer succeeded")
		}
		if !bytes.Equal(p.ranks[0][0].Mem, pBefore) {
			t.Fatal("a WRITE landed in the producer")
		}
		// D asks before P's step holds the blocks: the READ is refused,
		// tried again, and succeeds once P holds them.
		before := d.ranks[0][0].Snapshot()
		now := time.Now()
		d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, p, now.Add(time.Minute))}})
		for deadline := time.Now().Add(10 * time.Second); d.workers[0][0].Metrics().Snapshot().RefusedAccess["read_retried"] == 0; time.Sleep(2 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("D's READ was never refused and retried")
			}
		}
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
		out := awaitOutcomes(t, 2, p, d)
		if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
			t.Fatalf("D outcome %+v, want done", o)
		}
		if err := d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q.sim}, 16, 16); err != nil {
			t.Fatal(err)
		}
		// P let go of the blocks: no more READs.
		if err := rawPost(t, rogue, hotpath.OpRead, pMeta, rb, src, 64); !errors.Is(err, kvxfer.ErrNotGranted) {
			t.Errorf("READ after the request ended: %v, want ErrNotGranted", err)
		}
		s := p.workers[0][0].Metrics().Snapshot().RefusedAccess
		if s["write_deny"] != 1 || s["read_late"] < 3 {
			t.Errorf("P refusals %v, want 1 write_deny and at least 3 read_late", s)
		}
	})
}

// A grant is for a request, not only for blocks and a producer: the
// consumer hands the blocks of a request it gave up to its next request,
// registered with the same producer, and the producer's late WRITE of the
// first (held up, then let through after the consumer reported it) is
// refused — its notice names the request it is for — while the next
// request's own WRITE lands. Over the built-in backend's TCP path, the
// same-host copy and the in-process copy.
//
// The same for a pull READ: a hold is for a producer request, and a READ
// (naming the request it reads, when the consumer knows P's id) that
// comes after that request let its blocks go is refused even though the
// engine holds them again for another request.
func TestLateTransferOfEndedRequestRefused(t *testing.T) {
	for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
		for _, path := range []string{"tcp", "same-host", "in-process"} {
			t.Run(op.String()+"/"+path, func(t *testing.T) { lateTransfer(t, op, path) })
		}
	}
}

func lateTransfer(t *testing.T, op hotpath.Op, path string) {
	const base, block, blocks = 2 << 32, 4 << 10, 8
	l := topology.Layout{LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: base, BlockLen: block, NumBlocks: blocks}}}
	// mk is an agent over n bytes at b (a shared file's mapping for
	// the same-host path, which copies out of the sender's file).
	mk := func(b uint64, n int) (*tcp.Backend, []byte) {
		c := tcp.Config{Name: fmt.Sprintf("%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), rand.Uint64()), DisableLocal: path != "in-process",
			DisableSameHost: path != "same-host", Conns: 2, Logger: quiet}
		be, err := tcp.New(c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = be.Close() })
		f, err := os.CreateTemp(t.TempDir(), "mem")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		if err := f.Truncate(int64(n)); err != nil {
			t.Fatal(err)
		}
		mem, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = syscall.Munmap(mem) })
		if err := be.MapFile(b, mem, f, 0); err != nil {
			t.Fatal(err)
		}
		if err := be.Register([]kvxfer.MemRegion{{Addr: b, Len: uint64(n), Kind: kvxfer.MemDRAM}}); err != nil {
			t.Fatal(err)
		}
		return be, mem
	}
	// The guarded side (dst: D's for a WRITE, P's for a READ) has
	// block 3; the other (src) posts, its bytes 0x5A.
	const sbase = 1 << 32
	src, smem := mk(sbase, block)
	dst, dmem := mk(base, block*blocks)
	var table kvxfer.AccessChecker
	if op == hotpath.OpWrite {
		copy(smem, bytes.Repeat([]byte{0x5A}, block))
		table = kvxfer.RegrantedTable(&l, []int{blocks}, kvxfer.PeerName(src.Name()), []topology.BlockID{3}, "d-old", "d-next")
	} else {
		copy(dmem[3*block:], bytes.Repeat([]byte{0x5A}, block))
		table = kvxfer.ReheldTable(&l, []int{blocks}, []topology.BlockID{3}, "p-old", "p-next")
	}
	if err := dst.SetGuard(table); err != nil {
		t.Fatal(err)
	}
	peer, err := src.LoadPeer(metaOf(t, dst))
	if err != nil {
		t.Fatal(err)
	}
	post := func(req string) error {
		dreq, preq := req, "p-"+req
		if op == hotpath.OpRead {
			dreq, preq = "d-"+req, req
		}
		id, err := src.Post(op, peer, []hotpath.Desc{{Local: sbase, Remote: base + 3*block, Len: block}},
			kvxfer.AppendDoneMsg("D", 0, 1, "t-"+req, dreq, preq))
		if err != nil {
			return err
		}
		defer func() { _ = src.Release(id) }()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			switch s, err := src.State(id); s {
			case kvxfer.XferDone:
				return nil
			case kvxfer.XferFailed:
				return err
			}
		}
		t.Fatal("the WRITE did not end")
		return nil
	}
	// What the transfer wrote: into dst's block (WRITE) or src's
	// memory (READ).
	read := func() []byte { return slices.Clone(dmem[3*block : 4*block]) }
	old, next := "d-old", "d-next"
	if op == hotpath.OpRead {
		read = func() []byte { return slices.Clone(smem) }
		old, next = "p-old", "p-next"
	}
	if err := post(old); !errors.Is(err, kvxfer.ErrNotGranted) {
		t.Errorf("the late %v of the ended request: %v, want refused (not granted)", op, err)
	}
	if got := read(); !bytes.Equal(got, make([]byte, block)) {
		t.Fatalf("the late %v of the ended request moved the next request's bytes", op)
	}
	if err := post(next); err != nil {
		t.Errorf("the next request's %v: %v, want done", op, err)
	}
	if got := read(); !bytes.Equal(got, bytes.Repeat([]byte{0x5A}, block)) {
		t.Errorf("the next request's %v did not move its bytes", op)
	}
	if path == "same-host" && dst.SameHostParts()+src.SameHostParts() == 0 {
		t.Error("no part went the same-host path")
	}
}
