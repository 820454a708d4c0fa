package kvxfer_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// heldGPU stands in for a GPU on the same-host path: "device memory" is
// the ranks' memory at its real addresses (one process: an allocation's
// handle is its address, and importing it returns that address), and a
// batch copies its pieces only when it runs, which it does once released
// after hold was set: a kernel the test keeps running.
type heldGPU struct {
	mem     sync.Map // base address -> []byte: the ranks' memory
	mu      sync.Mutex
	hold    bool
	held    int // batches posted while held, not run yet
	release chan struct{}
	layouts int // layouts staged (AddLayout)
}

type heldCopy struct {
	mu   sync.Mutex
	done bool
}

func (c *heldCopy) Done() (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.done, nil
}

// at returns the bytes at [addr, addr+n) of a rank's memory.
func (g *heldGPU) at(addr, n uint64) []byte {
	var b []byte
	g.mem.Range(func(k, v any) bool {
		base, m := k.(uint64), v.([]byte)
		if addr >= base && addr-base+n <= uint64(len(m)) {
			b = m[addr-base : addr-base+n]
			return false
		}
		return true
	})
	if b == nil {
		panic("heldGPU: an address outside the ranks' memory")
	}
	return b
}

func (g *heldGPU) Import(h [64]byte) (uint64, error) { return binary.LittleEndian.Uint64(h[:]), nil }
func (g *heldGPU) Unmap(uint64) error                { return nil }
func (g *heldGPU) CopyDevice(dst, src uint64, n int) error {
	copy(g.at(dst, uint64(n)), g.at(src, uint64(n)))
	return nil
}
func (g *heldGPU) CopyIn(dst uint64, src []byte) error {
	copy(g.at(dst, uint64(len(src))), src)
	return nil
}
func (g *heldGPU) CopyOut(dst []byte, src uint64) error {
	copy(dst, g.at(src, uint64(len(dst))))
	return nil
}

func (g *heldGPU) NewBatch(int) (tcp.DevBatch, error) { return &heldBatch{g: g}, nil }

// heldBatch stages heldGPU's batches as lists of pieces.
type heldBatch struct {
	g  *heldGPU
	ps []tcp.DevPiece
}

func (b *heldBatch) Add(dst, src, n uint64) bool {
	b.ps = append(b.ps, tcp.DevPiece{Dst: dst, Src: src, Len: n})
	return true
}
func (b *heldBatch) Post() (tcp.DevCopy, error) { return b.g.PostCopy(b.ps) }

// AddLayout stages a layout's pieces as the copy kernel addresses them.
func (b *heldBatch) AddLayout(regions []tcp.DevRegion, entries []tcp.DevEntry) bool {
	b.g.mu.Lock()
	b.g.layouts++
	b.g.mu.Unlock()
	for _, r := range regions {
		for _, e := range entries {
			b.ps = append(b.ps, tcp.DevPiece{Dst: r.Dst + e.Dst, Src: r.Src + e.Src, Len: e.Len})
		}
	}
	return true
}

func (g *heldGPU) layoutsStaged() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.layouts
}
func (b *heldBatch) Discard() {}

func (g *heldGPU) PostCopy(ps []tcp.DevPiece) (tcp.DevCopy, error) {
	ps = append([]tcp.DevPiece(nil), ps...)
	c := &heldCopy{}
	run := func() {
		for _, p := range ps {
			copy(g.at(p.Dst, p.Len), g.at(p.Src, p.Len))
		}
		c.mu.Lock()
		c.done = true
		c.mu.Unlock()
	}
	g.schedule(run, false)
	return c, nil
}

// schedule runs a batch: now (on a goroutine of its own if async), or,
// while hold is set, once release is closed.
func (g *heldGPU) schedule(run func(), async bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case !g.hold && async:
		go run()
		return
	case !g.hold:
		run()
		return
	}
	g.held++
	rel := g.release
	go func() {
		<-rel
		run()
		g.mu.Lock()
		g.held--
		g.mu.Unlock()
	}()
}

func (g *heldGPU) heldBatches() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.held
}

// gpuBackend is a built-in backend whose rank memory is "GPU memory" of
// g, moved on the same-host path as one batch per part.
func gpuBackend(t *testing.T, name string, r *kvsim.Rank, g *heldGPU) *tcp.Backend {
	return gpuBackendOn(t, name, r, g, g)
}

// gpuBackendOn is gpuBackend with dev the device (g's memory).
func gpuBackendOn(t *testing.T, name string, r *kvsim.Rank, g *heldGPU, dev tcp.Device) *tcp.Backend {
	t.Helper()
	r.Rebase(uint64(uintptr(unsafe.Pointer(&r.Mem[0]))))
	uuid := [16]byte{0x9b}
	g.mem.Store(r.Base, r.Mem)
	// Agents of one process: DisableLocal keeps them off the direct copy
	// (host memory only), on the same-host path.
	b := tcpBackend(t, name, r, tcp.Config{DisableLocal: true, Devices: func(u [16]byte) (tcp.Device, error) { return dev, nil }})
	if err := b.Unmap(r.Base); err != nil { // tcpBackend mapped it as host memory
		t.Fatal(err)
	}
	var h [64]byte
	binary.LittleEndian.PutUint64(h[:], r.Base)
	if err := b.MapIPC(r.Base, uint64(len(r.Mem)), dev, uuid, h); err != nil {
		t.Fatal(err)
	}
	return b
}

// A consumer that gives a request up while a GPU batch writing its blocks
// still runs reports it only once the batch ran: the grant's revocation
// waits for the batch (a kernel cannot be cut short), so no byte lands in
// blocks the engine was told are free. Then the engine reuses them and
// nothing changes them.
func TestGiveUpWaitsForGPUBatch(t *testing.T) {
	g := &heldGPU{release: make(chan struct{})}
	d, dir, release := heldPush(t, g, func(name string, r *kvsim.Rank) *tcp.Backend { return gpuBackend(t, name, r, g) }, nil)
	// The partition: D hears nothing more from P and gives the request
	// up after PeerTimeout; its revocation waits for the batch.
	dir.FailHandshakes("P", 1<<20)
	out := newOutcomes()
	// Watched past the give-up (PeerTimeout, 2 s, and a probe) by as much
	// again: D gives up in it and must not report before release.
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		out.collect(t, d)
		if len(out.recv["d-a"]) > 0 {
			t.Fatalf("D reported %+v while a GPU batch writing its blocks still ran", out.recv["d-a"][0])
		}
	}
	release()
	for deadline := time.Now().Add(20 * time.Second); len(out.recv["d-a"]) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("D never reported the request once the batch ran")
		}
		out.collect(t, d)
	}
	reused := bytes.Repeat([]byte{0xCD}, len(d.ranks[0][0].Mem))
	copy(d.ranks[0][0].Mem, reused)
	time.Sleep(100 * time.Millisecond)
	if !bytes.Equal(d.ranks[0][0].Mem, reused) {
		t.Fatal("bytes landed in D's blocks after D reported them free")
	}
}

// heldPush starts a P and a D engine (one rank each) on backends from
// on, D giving up on P after 500 ms of silence, registers one push
// request, runs ready (if not nil) once P holds the registration, holds
// g's batches and has P send: it returns once P's batch is posted and
// held, with D, the engines' directory and the release of the held
// batches (also on cleanup, before the engines close).
func heldPush(t *testing.T, g *heldGPU, on func(name string, r *kvsim.Rank) *tcp.Backend, ready func(p *simEngine)) (d *simEngine, dir *kvxfertest.Directory, release func()) {
	t.Helper()
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir = kvxfertest.NewDirectory()
	fast := func(c *kvxfer.WorkerConfig) { c.PeerTimeout = 2 * time.Second } // the partition is found by it; 500 ms left a loaded machine little room before it
	mk := func(id string) *simEngine {
		return startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), id, kvxfer.ModePush, fast,
			func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) { return on(name, r), nil })
	}
	p := mk("P")
	d = mk("D")
	t.Cleanup(func() { d.close(t); p.close(t) })
	var once sync.Once
	release = func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(release) // first: closing waits for the batches
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(3, 4))
	q := makeRequest("a", 160, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p.ranks[0][0].Scramble(1)
	p.ranks[0][0].Fill(q.sim.P)
	d.ranks[0][0].Scramble(2)
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Minute))}})
	awaitRegistration(t, p)
	if ready != nil {
		ready(p)
	}
	g.mu.Lock()
	g.hold = true
	g.mu.Unlock()
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	for deadline := time.Now().Add(10 * time.Second); g.heldBatches() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("P's WRITE never reached the GPU")
		}
	}
	return d, dir, release
}

// rawPostLayouts posts one layout WRITE on a backend, outside any Worker,
// and waits (bounded) for its end.
func rawPostLayouts(t *testing.T, be *tcp.Backend, peerMeta []byte, l *hotpath.Layouts) error {
	t.Helper()
	peer, err := be.LoadPeer(peerMeta)
	if err != nil {
		t.Fatal(err)
	}
	id, err := be.PostLayouts(hotpath.OpWrite, peer, l, nil)
	if err != nil {
		return err
	}
	return awaitRaw(t, be, id)
}

// D's grants hold for WRITEs sent as layouts (GPU memory on the same
// host): its producer's layout into blocks of no request, or one that
// reaches a single block outside the request's among its own, is denied
// as a whole (the connection dropped) and nothing lands; the request's own WRITE (as layouts too)
// lands byte for byte; once it ended, the producer's layout into its
// blocks is refused as late.
func TestDataPlaneGrantsLayouts(t *testing.T) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir := kvxfertest.NewDirectory()
	g := &heldGPU{release: make(chan struct{})}
	on := func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		return gpuBackend(t, name, r, g), nil
	}
	p := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil, on)
	d := startEngineOn(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePush, nil, on)
	t.Cleanup(func() { d.close(t); p.close(t) })
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(1, 2))
	q := makeRequest("a", 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p.ranks[0][0].Scramble(1)
	p.ranks[0][0].Fill(q.sim.P)
	d.ranks[0][0].Scramble(2)
	dl, pl := &d.ranks[0][0].Layout, &p.ranks[0][0].Layout
	dMeta, pbe, dbe := metaOf(t, d.backends[0]), p.backends[0].(*tcp.Backend), d.backends[0].(*tcp.Backend)
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Minute))}})
	awaitRegistration(t, p)
	before := d.ranks[0][0].Snapshot()
	// A layout over every layer (region) of both ranks, entries at the
	// given D blocks (P's block 0 as the source).
	layouts := func(blocks ...topology.BlockID) *hotpath.Layouts {
		l := &hotpath.Layouts{}
		for i := range dl.Regions {
			l.Bases = append(l.Bases, hotpath.BasePair{Local: pl.Regions[i].Base, Remote: dl.Regions[i].Base})
		}
		blockLen := uint64(dl.Regions[0].BlockLen) * uint64(dl.PagesPerBlock())
		for _, b := range blocks {
			l.Entries = append(l.Entries, hotpath.LayoutEntry{Local: 0, Remote: uint64(b) * blockLen, Len: 64})
		}
		l.Spans = []hotpath.LayoutSpan{{B0: 0, B1: len(l.Bases), E0: 0, E1: len(l.Entries)}}
		return l
	}
	own := q.sim.D[0].IDs
	parts := dbe.LayoutParts()
	for _, c := range []struct {
		name   string
		blocks []topology.BlockID
	}{
		{"blocks of no request", []topology.BlockID{95, 94}},
		{"one block outside the request's, among them", append(slices.Clone(own), 95)},
	} {
		// Denied: the part fails and D drops the connection.
		if err := rawPostLayouts(t, pbe, dMeta, layouts(c.blocks...)); err == nil {
			t.Errorf("%s: the WRITE succeeded", c.name)
		}
		g.mu.Lock() // the stand-in GPU copies under it: sockets order those copies, unseen by the race detector
		same := bytes.Equal(d.ranks[0][0].Mem, before)
		g.mu.Unlock()
		if !same {
			t.Fatalf("%s: D's memory changed", c.name)
		}
	}
	if n := dbe.LayoutParts() - parts; n != 2 {
		t.Fatalf("%d of the refused WRITEs came as layouts, want 2", n)
	}
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	out := awaitOutcomes(t, 2, p, d)
	if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("D outcome %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q.sim}, 16, 16); err != nil {
		t.Fatal(err)
	}
	if n := dbe.LayoutParts() - parts; n != 3 {
		t.Fatalf("the request's WRITE: %d layout parts in all, want 3", n)
	}
	after := d.ranks[0][0].Snapshot()
	if err := rawPostLayouts(t, pbe, dMeta, layouts(own[0])); !errors.Is(err, kvxfer.ErrNotGranted) {
		t.Errorf("a late layout WRITE of the producer: %v, want ErrNotGranted", err)
	}
	if !bytes.Equal(d.ranks[0][0].Mem, after) {
		t.Fatal("a late WRITE landed")
	}
	s := d.workers[0][0].Metrics().Snapshot().RefusedAccess
	if s["write_deny"] != 2 || s["write_late"] != 1 {
		t.Errorf("D refusals %v, want 2 write_deny and 1 write_late", s)
	}
}

// gateGPU is a heldGPU that makes gates and runs gated batches as the
// copy kernel does (internal/cuda's kvxfer_copy_gated), one piece per
// CTA: count in, read the generation, copy only if it is the launch's,
// count out. Gates and the copies through them are under gmu, as are the
// consumer's stores and loads of them (CopyIn, CopyOut).
type gateGPU struct {
	*heldGPU
	gmu    sync.Mutex
	allocs [][]byte
	gated  int // gated launches posted
	shut   int // gated launches that found their gate shut
}

func (g *gateGPU) Alloc(n int) (uint64, error) {
	m := make([]byte, n)
	g.gmu.Lock()
	g.allocs = append(g.allocs, m)
	g.gmu.Unlock()
	p := uint64(uintptr(unsafe.Pointer(&m[0])))
	g.mem.Store(p, m)
	return p, nil
}
func (g *gateGPU) Free(uint64) error                        { return nil }
func (g *gateGPU) SideCopyIn(dst uint64, src []byte) error  { return g.CopyIn(dst, src) }
func (g *gateGPU) SideCopyOut(dst []byte, src uint64) error { return g.CopyOut(dst, src) }
func (g *gateGPU) Export(ptr uint64) ([64]byte, error) {
	var h [64]byte
	binary.LittleEndian.PutUint64(h[:], ptr)
	return h, nil
}
func (g *gateGPU) CopyIn(dst uint64, src []byte) error {
	g.gmu.Lock()
	defer g.gmu.Unlock()
	return g.heldGPU.CopyIn(dst, src)
}
func (g *gateGPU) CopyOut(dst []byte, src uint64) error {
	g.gmu.Lock()
	defer g.gmu.Unlock()
	return g.heldGPU.CopyOut(dst, src)
}
func (g *gateGPU) NewBatch(int) (tcp.DevBatch, error) {
	return &gatedBatch{heldBatch: heldBatch{g: g.heldGPU}, gg: g}, nil
}

func (g *gateGPU) counts() (gated, shut int) {
	g.gmu.Lock()
	defer g.gmu.Unlock()
	return g.gated, g.shut
}

type gatedBatch struct {
	heldBatch
	gg   *gateGPU
	gate uint64
	want uint32
}

func (b *gatedBatch) Gate(gate uint64, want uint32) bool {
	b.gate, b.want = gate, want
	return true
}

func (b *gatedBatch) Post() (tcp.DevCopy, error) {
	if b.gate == 0 {
		return b.heldBatch.Post()
	}
	g, ps, gate, want := b.gg, slices.Clone(b.ps), b.gate, b.want
	c := &gatedCopy{}
	run := func() {
		shut := false
		for i, p := range ps {
			g.gmu.Lock()
			act := g.at(gate+64+uint64(i%16)*4, 4)
			binary.LittleEndian.PutUint32(act, binary.LittleEndian.Uint32(act)+1)
			if binary.LittleEndian.Uint32(g.at(gate, 4)) == want {
				copy(g.at(p.Dst, p.Len), g.at(p.Src, p.Len))
			} else {
				shut = true
			}
			binary.LittleEndian.PutUint32(act, binary.LittleEndian.Uint32(act)-1)
			g.gmu.Unlock()
		}
		g.gmu.Lock()
		if shut {
			g.shut++
		}
		g.gmu.Unlock()
		c.mu.Lock()
		c.done, c.shut = true, shut
		c.mu.Unlock()
	}
	g.gmu.Lock()
	g.gated++
	g.gmu.Unlock()
	g.schedule(run, true)
	return c, nil
}

type gatedCopy struct {
	heldCopy
	shut bool
}

func (c *gatedCopy) Shut() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.shut
}

// On one GPU a push consumer offers its grant to the producer one-sided
// (a gate): the producer's WRITE of the request is its own launch
// straight into D's blocks (no part reaches D), every value lands, the
// request ends done on both sides, and its end shuts the gate. A second
// request's gate is a new one, and its WRITE one-sided too.
func TestPushOneSidedGPU(t *testing.T) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir := kvxfertest.NewDirectory()
	g := &gateGPU{heldGPU: &heldGPU{release: make(chan struct{})}}
	on := func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		return gateBackend(t, name, r, g), nil
	}
	p := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil, on)
	d := startEngineOn(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePush, nil, on)
	t.Cleanup(func() { d.close(t); p.close(t) })
	pbe, dbe := p.backends[0].(*tcp.Backend), d.backends[0].(*tcp.Backend)
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(1, 2))
	pp, dp := newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true)
	p.ranks[0][0].Scramble(1)
	d.ranks[0][0].Scramble(2)
	for i, id := range []string{"a", "b"} {
		q := makeRequest(id, 40, 0, groups, p.eng, d.eng, pp, dp)
		p.ranks[0][0].Fill(q.sim.P)
		before := d.ranks[0][0].Snapshot()
		now := time.Now()
		d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Minute))}})
		awaitRegistration(t, p)
		awaitGate(t, pbe)
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
		out := awaitOutcomes(t, 2, p, d)
		if o := out.recv["d-"+id]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
			t.Fatalf("%s: D outcome %+v, want done", id, o)
		}
		if err := d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q.sim}, 16, 16); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		if n := pbe.OneSidedWrites(); n != uint64(i+1) {
			t.Fatalf("%s: %d one-sided WRITEs in all, want %d", id, n, i+1)
		}
		if n := dbe.LayoutParts(); n != 0 {
			t.Fatalf("%s: %d WRITE parts reached D, want none (one-sided)", id, n)
		}
		if mine, _ := dbe.Gates(); mine != 0 {
			t.Fatalf("%s: D keeps %d gates open after the request ended", id, mine)
		}
	}
	st := d.workers[0][0].Metrics().Snapshot()
	if st.Gates["opened"] != 2 || st.Gates["failed"] != 0 || st.RefusedAccess["write_aborted"] != 0 {
		t.Fatalf("D's gates %v, refusals %v; want 2 opened, none failed, no aborted part", st.Gates, st.RefusedAccess)
	}
	if gated, shut := g.counts(); gated != 2 || shut != 0 {
		t.Fatalf("%d gated launches, %d found their gate shut; want 2 and 0", gated, shut)
	}
}

// A consumer that gives a request up while the producer's one-sided
// launch into its blocks is queued reports it, and the launch, run after,
// copies nothing into the blocks the engine reuses: the gate shut before
// the report. The producer's transfer fails.
func TestGiveUpShutsGate(t *testing.T) {
	g := &gateGPU{heldGPU: &heldGPU{release: make(chan struct{})}}
	var pbe *tcp.Backend
	d, dir, release := heldPush(t, g.heldGPU, func(name string, r *kvsim.Rank) *tcp.Backend { return gateBackend(t, name, r, g) },
		func(p *simEngine) {
			pbe = p.backends[0].(*tcp.Backend)
			awaitGate(t, pbe)
		})
	dir.FailHandshakes("P", 1<<20)
	out := awaitOutcomes(t, 1, d) // D gives the request up
	if o := out.recv["d-a"][0]; o.Result == kvxfer.ResultDone {
		t.Fatalf("D's outcome %+v, want a failure", o)
	}
	reused := bytes.Repeat([]byte{0xCD}, len(d.ranks[0][0].Mem))
	copy(d.ranks[0][0].Mem, reused)
	release()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, shut := g.counts(); shut == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the held launch never ran into its shut gate")
		}
	}
	if !bytes.Equal(d.ranks[0][0].Mem, reused) {
		t.Fatal("bytes landed in D's blocks after D reported them free")
	}
	if pbe.OneSidedWrites() != 1 {
		t.Fatalf("%d one-sided WRITEs, want 1", pbe.OneSidedWrites())
	}
}

// gateBackend is gpuBackend on a GPU that makes gates.
func gateBackend(t *testing.T, name string, r *kvsim.Rank, g *gateGPU) *tcp.Backend {
	return gpuBackendOn(t, name, r, g.heldGPU, g)
}

// awaitGate waits (bounded) until the producer's backend holds one gate.
func awaitGate(t *testing.T, pbe *tcp.Backend) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, held := pbe.Gates(); held == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the producer never held the consumer's gate")
		}
	}
}
