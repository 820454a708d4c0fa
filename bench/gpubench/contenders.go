package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/internal/hoptrace"
	"github.com/kvxfer/kvxfer/internal/netxfer"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
	kvnixl "github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
)

// side is one process's memory for the bench: a region of its GPU.
type side struct {
	g      gpu
	base   uint64
	size   int
	handle [64]byte
	uuid   [16]byte
}

// mover moves one case's pieces, one transfer per write. prepare marks
// the destination before a case's transfers, check verifies every byte
// of its destination pieces after them.
type mover interface {
	prepare(c xcase) error
	write(c xcase) (time.Duration, error)
	check(c xcase) error
	close() error
}

// peerSide is a contender's side in the child (the destination process).
type peerSide interface {
	// link hands it the parent side's metadata, where it needs it.
	link(meta []byte) error
	close() error
}

// contender is one way of moving the pieces.
type contender struct {
	name, what string
	// avail says why it cannot run here (nil: it can); run before the
	// child starts, it may set the environment the child inherits.
	avail func(o *opts) error
	// peer opens the child's side (nil: the contender runs in the
	// parent alone, into its scratch region).
	peer func(o *opts, s *side) ([]byte, peerSide, error)
	// open opens the parent's side: meta is the child side's metadata;
	// it returns the metadata to link the child side with (or nil).
	open func(o *opts, src, scratch *side, r *remote, meta []byte) (mover, []byte, error)
}

// opts are what the contenders read.
type opts struct {
	fake bool
	// fakeBusy: a fake GPU's batch is done this long after it was posted
	// (a kernel's time), so the hops around it are polled as on a GPU.
	fakeBusy time.Duration
}

var contenders = []contender{
	{name: "samehost", what: "kvxfer same-host (internal/netxfer agents in two processes, GPU memory by MapDevice; one PostLayout: a base pair per layer, an entry per block; post to completion)",
		peer: netxferPeer, open: netxferOpen(true, 1)},
	{name: "samehost-pieces", what: "kvxfer same-host as above, posted as one Post of every piece (layers x blocks descriptors)",
		peer: netxferPeer, open: netxferOpen(false, 1)},
	{name: "samehost-x4", what: "kvxfer same-host as a layout, four transfers of the case in flight at once (posted together, timed to the last one's completion; GB/s of all four): " +
		"what a Worker that posts several requests' transfers without waiting gets, the hops between the processes shared",
		peer: netxferPeer, open: netxferOpen(true, 4)},
	{name: "samehost-gate", what: "kvxfer same-host, one-sided: D offers P its region as a gate (netxfer OpenGate, what a push consumer does per grant); " +
		"P's layout WRITE is its own gated launch into D's imported memory, then the notification: P's post to P seeing it done (and, in the hop table, D notified)",
		peer: gatePeer, open: gateOpen},
	{name: "samehost-read", what: "kvxfer same-host, pulling (vLLM's default mode): the parent READs the child's source region into its own scratch " +
		"as one layout (the child checks the READ against its memory and answers where the pieces lie; the parent's GPU copies them)",
		peer: netxferPeer, open: netxferReadOpen},
	{name: "nixl", what: "kvxfer NIXL (internal/nixl, UCX backend, default num_threads; one Post, State polled until done)",
		avail: nixlAvail, peer: nixlPeer(tune{}), open: nixlOpen(tune{})},
	{name: "nixl4", what: "kvxfer NIXL, UCX num_threads=4 (what vLLM sets)",
		avail: nixlAvail, peer: nixlPeer(tune{threads: 4}), open: nixlOpen(tune{threads: 4})},
	{name: "nixl4-read", what: "kvxfer NIXL, num_threads=4, pulling: the parent READs the child's source region into its own scratch (vLLM's default mode)",
		avail: nixlAvail, peer: nixlPeer(tune{threads: 4}), open: nixlReadOpen(tune{threads: 4})},
	{name: "nixl-gpu", what: "kvxfer NIXL with the parameters kvxfer's VRAM agents get (num_threads=4, split_batch_size=" + kvnixl.GPUSplitBatch +
		": a transfer of that many descriptors or more posted by every worker, a share each)",
		avail: nixlAvail, peer: nixlPeer(gpuTune), open: nixlOpen(gpuTune)},
	{name: "nixl8", what: "kvxfer NIXL with kvxfer's VRAM parameters but num_threads=8: a transfer of 8,192 descriptors posted by eight workers, 1,024 each " +
		"(the UCX plugin shares a transfer of n descriptors out as max(n/num_threads, split_batch_size) each; issuing them is most of a large transfer's time)",
		avail: nixlAvail, peer: nixlPeer(tune{threads: 8, split: gpuTune.split}), open: nixlOpen(tune{threads: 8, split: gpuTune.split})},
	{name: "contig", what: "device copy: one contiguous cuMemcpyDtoD of the same bytes in one process (the limit)",
		open: contigOpen},
	{name: "kernel", what: "kvxfer's copy kernel in one process: one launch of every piece (internal/cuda Post), post to done",
		open: kernelOpen},
	{name: "kernel-layout", what: "kvxfer's copy kernel in one process, staged as a layout (a region per layer, an entry per block: what the same-host path stages), post to done",
		open: kernelLayoutOpen},
	{name: "kernel-gated", what: "kvxfer's gated copy kernel (what a one-sided WRITE launches) in one process, staged as a layout, through an open gate in the process's own memory, post to done: " +
		"the GPU's share of samehost-gate, its per-CTA gate checks included",
		open: kernelGatedOpen},
	{name: "perpiece", what: "one asynchronous cuMemcpyDtoD per piece on one stream, one event at the end (internal/cuda PostEach: the fallback)",
		open: perPieceOpen},
}

// pythonName and pushName are the contenders run by nixl_py.py (see
// python.go): NIXL's Python API posting a WRITE and polling it to
// completion, and the push round trip (a registration notification from
// the destination, the WRITE with its notification back).
const (
	pythonName = "python"
	pushName   = "python-push"
	readName   = "python-read"
	splitName  = "python-split"
)

func findContender(name string) (contender, bool) {
	for _, c := range contenders {
		if c.name == name {
			return c, true
		}
	}
	return contender{}, false
}

var quiet = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// wait polls until done reports true, an error, or 30 s passed.
func waitDone(done func() (bool, error), wake <-chan struct{}) error {
	deadline := time.Now().Add(30 * time.Second)
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		ok, err := done()
		if ok || err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return errors.New("not done in 30 s")
		}
		if wake == nil {
			continue // spin, as NIXL's own benchmarks do
		}
		select {
		case <-wake:
		case <-t.C:
		}
	}
}

// remoteMover is the part of a mover into the child's memory: the child
// marks and checks its destination.
type remoteMover struct{ r *remote }

func (m remoteMover) prepare(c xcase) error {
	_, err := m.r.call(ctlReq{Op: "mark", Case: c})
	return err
}

func (m remoteMover) check(c xcase) error {
	_, err := m.r.call(ctlReq{Op: "verify", Case: c})
	return err
}

// agents numbers the netxfer agents of this process (one pair per
// contender that uses them).
var agents atomic.Uint64

// kvxfer's built-in backend on its same-host path: each process maps its
// own GPU memory into its agent with its CUDA IPC handle; the receiver
// imports the sender's and copies every piece with its GPU.
func netxferAgent(s *side, role string, wire *wireLog) (*netxfer.Agent, error) {
	a, err := netxfer.New(netxfer.Config{Name: fmt.Sprintf("gpubench-%s-%d-%d", role, os.Getpid(), agents.Add(1)), Logger: quiet,
		WireTrace: wire.trace,
		Devices: func(u [16]byte) (netxfer.Device, error) {
			if u != s.uuid {
				return nil, fmt.Errorf("no GPU %s in this process", cuda.FormatUUID(u))
			}
			return s.g, nil
		}})
	if err != nil {
		return nil, err
	}
	err = a.MapDevice(s.base, uint64(s.size), s.g, s.uuid, s.handle)
	if err == nil {
		err = a.Register([]netxfer.Region{{Addr: s.base, Len: uint64(s.size)}})
	}
	if err != nil {
		a.Close()
		return nil, err
	}
	return a, nil
}

type netxferSide struct{ a *netxfer.Agent }

func (s netxferSide) link(meta []byte) error {
	_, err := s.a.LoadPeer(meta)
	return err
}

func (s netxferSide) close() error { return s.a.Close() }

func netxferPeer(_ *opts, s *side) ([]byte, peerSide, error) {
	// Its GPU batches stamped (stamps.go): where the time goes.
	st := *s
	st.g = stampGPU{s.g}
	a, err := netxferAgent(&st, "d", &childWire)
	if err != nil {
		return nil, nil, err
	}
	return a.Metadata(), netxferSide{a}, nil
}

type netxferMover struct {
	remoteMover
	a      *netxfer.Agent
	wire   *wireLog // its agent's parts' way out and their answers' back
	peer   string
	src    uint64
	dst    uint64
	layout bool
	// inflight is how many transfers of the case one write posts before
	// it waits for them (the duration it reports is the time per transfer).
	inflight int
	descs    map[xcase][]netxfer.Desc
	lays     map[xcase][]netxfer.Layout
	times    []xferTimes // this case's transfers
	notif    []byte      // each WRITE's notification (nil: none)
}

// hopper is a mover that can say where its last case's time went.
type hopper interface {
	// hops returns the names of its hops and, per hop, the microseconds
	// of each of the case's transfers after the warm-up ones (nil: it has
	// none to tell).
	hops(warmup int) ([]string, [][]float64, error)
}

func (m *netxferMover) prepare(c xcase) error {
	m.times = m.times[:0]
	m.wire.take()
	if _, err := m.r.call(ctlReq{Op: "stamps"}); err != nil { // the child's log emptied
		return err
	}
	return m.remoteMover.prepare(c)
}

func (m *netxferMover) hops(warmup int) ([]string, [][]float64, error) {
	if m.inflight > 1 {
		return nil, nil, nil // its transfers' hops overlap: none to tell apart
	}
	st, err := m.r.stamps()
	if err != nil {
		return nil, nil, err
	}
	return hopNames, hopsOf(m.times, m.wire.take(), st, warmup), nil
}

func netxferOpen(layout bool, inflight int) func(*opts, *side, *side, *remote, []byte) (mover, []byte, error) {
	return func(_ *opts, src, _ *side, r *remote, meta []byte) (mover, []byte, error) {
		wire := new(wireLog)
		a, peer, err := netxferInitiator(src, "p", wire, meta)
		if err != nil {
			return nil, nil, err
		}
		return &netxferMover{remoteMover: remoteMover{r}, a: a, wire: wire, peer: peer, src: src.base, dst: r.base, layout: layout, inflight: inflight,
			descs: map[xcase][]netxfer.Desc{}, lays: map[xcase][]netxfer.Layout{}}, a.Metadata(), nil
	}
}

func (m *netxferMover) write(c xcase) (time.Duration, error) {
	ds, ok := m.descs[c]
	if !ok && !m.layout {
		for _, p := range c.pairs() {
			ds = append(ds, netxfer.Desc{Local: m.src + p.src, Remote: m.dst + p.dst, Len: uint64(c.Piece)})
		}
		m.descs[c] = ds
	}
	lays, ok := m.lays[c]
	if !ok && m.layout {
		lays = []netxfer.Layout{c.layout(m.src, m.dst)}
		m.lays[c] = lays
	}
	start, t0 := time.Now(), hoptrace.Now()
	ids := make([]netxfer.XferID, 0, m.inflight)
	defer func() {
		for _, id := range ids {
			_ = m.a.Release(id)
		}
	}()
	for range m.inflight {
		var id netxfer.XferID
		var err error
		if m.layout {
			id, err = m.a.PostLayout(netxfer.Write, m.peer, lays, m.notif)
		} else {
			id, err = m.a.Post(netxfer.Write, m.peer, ds, nil)
		}
		if err != nil {
			return 0, err
		}
		ids = append(ids, id)
	}
	err := waitDone(func() (bool, error) {
		for _, id := range ids {
			s, err := m.a.State(id)
			if s == netxfer.Failed && err == nil {
				err = errors.New("failed")
			}
			if s != netxfer.Done || err != nil {
				return false, err
			}
		}
		return true, nil
	}, m.a.Events())
	d := time.Since(start)
	m.times = append(m.times, xferTimes{id: ids[0], posted: t0, seen: hoptrace.Now()})
	return d / time.Duration(m.inflight), err
}

func (m *netxferMover) close() error { return m.a.Close() }

// netxferReadMover pulls on the same-host path: the parent's agent on its
// scratch region READs the case's pieces from the child's region (filled
// with the source pattern) as one layout, and they are checked there.
type netxferReadMover struct {
	puller
	a    *netxfer.Agent
	peer string
	lays map[xcase][]netxfer.Layout
}

// puller is a pulling mover's own side: before each case the child's
// region holds the source pattern and the parent's scratch the marker;
// the pieces are checked in the scratch.
type puller struct {
	r       *remote
	scratch *side
	host    *[]byte
}

func (m *puller) prepare(c xcase) error {
	if _, err := m.r.call(ctlReq{Op: "fill", Case: c}); err != nil {
		return err
	}
	return mark(m.scratch, c)
}

func (m *puller) check(c xcase) error { return checkSide(m.scratch, c, m.host) }

// initiator is the parent's agent, opened by open, with the child's
// (meta) loaded: the side that posts.
func initiator[A interface {
	*netxfer.Agent | *capi.Agent
	LoadPeer([]byte) (string, error)
	Close() error
}](a A, err error, meta []byte) (A, string, error) {
	if err != nil {
		return nil, "", err
	}
	peer, err := a.LoadPeer(meta)
	if err != nil {
		a.Close()
		return nil, "", err
	}
	return a, peer, nil
}

// netxferInitiator is initiator for the built-in backend's agents.
func netxferInitiator(s *side, role string, wire *wireLog, meta []byte) (*netxfer.Agent, string, error) {
	a, err := netxferAgent(s, role, wire)
	return initiator(a, err, meta)
}

func netxferReadOpen(_ *opts, _, scratch *side, r *remote, meta []byte) (mover, []byte, error) {
	a, peer, err := netxferInitiator(scratch, "p-read", new(wireLog), meta)
	if err != nil {
		return nil, nil, err
	}
	return &netxferReadMover{puller: puller{r: r, scratch: scratch, host: new([]byte)}, a: a, peer: peer, lays: map[xcase][]netxfer.Layout{}}, a.Metadata(), nil
}

func (m *netxferReadMover) write(c xcase) (time.Duration, error) {
	lays, ok := m.lays[c]
	if !ok {
		// Local: the scratch at the destination offsets; remote: the
		// child's region at the source offsets.
		l := c.layout(m.r.base, m.scratch.base)
		for i := range l.Bases {
			l.Bases[i].Local, l.Bases[i].Remote = l.Bases[i].Remote, l.Bases[i].Local
		}
		for i := range l.Entries {
			l.Entries[i].Local, l.Entries[i].Remote = l.Entries[i].Remote, l.Entries[i].Local
		}
		lays = []netxfer.Layout{l}
		m.lays[c] = lays
	}
	start := time.Now()
	id, err := m.a.PostLayout(netxfer.Read, m.peer, lays, nil)
	if err != nil {
		return 0, err
	}
	defer m.a.Release(id)
	err = waitDone(func() (bool, error) {
		s, err := m.a.State(id)
		if s == netxfer.Failed && err == nil {
			err = errors.New("failed")
		}
		return s == netxfer.Done, err
	}, m.a.Events())
	return time.Since(start), err
}

func (m *netxferReadMover) close() error { return m.a.Close() }

// kvxfer's NIXL binding: each process registers its own GPU memory with
// its agent (VRAM; host memory with -fake-gpu); UCX moves the bytes
// (cuda_ipc on one GPU).
func nixlAvail(o *opts) error {
	lib, err := capi.FindLibrary()
	if err != nil {
		return err
	}
	env := capi.ProcessEnv(lib)
	if o.fake && os.Getenv("UCX_TLS") == "" {
		env = append(env, "UCX_TLS=sm") // host memory between processes (xferbench)
	}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if err := os.Setenv(k, v); err != nil {
			return err
		}
	}
	a, err := capi.OpenConfig(nixlConfig(o, "probe", tune{}))
	if err != nil {
		return err
	}
	return a.Close()
}

// tune is a NIXL contender's UCX plugin parameters: num_threads and
// split_batch_size (0: the plugin's default).
type tune struct{ threads, split int }

// gpuTune is what kvxfer's VRAM agents get (kvxfer/backend/nixl's
// GPUThreads and GPUSplitBatch).
var gpuTune = func() tune {
	t, _ := strconv.Atoi(kvnixl.GPUThreads)
	s, _ := strconv.Atoi(kvnixl.GPUSplitBatch)
	return tune{threads: t, split: s}
}()

func nixlConfig(o *opts, role string, tn tune) capi.Config {
	params := map[string]string{}
	if tn.threads > 0 {
		params["num_threads"] = strconv.Itoa(tn.threads)
	}
	if tn.split > 0 {
		params["split_batch_size"] = strconv.Itoa(tn.split)
	}
	if o.fake {
		params["ucx_error_handling_mode"] = "none" // shared memory transports (xferbench)
	}
	if ec := engineConfig(o); ec != "" {
		params["engine_config"] = ec
	}
	return capi.Config{Name: fmt.Sprintf("gpubench-%s-t%d-s%d-%d-%d", role, tn.threads, tn.split, os.Getpid(), agents.Add(1)), Plugin: "UCX", Params: params,
		VRAM: !o.fake, ProgressDelay: capi.DefaultProgressDelay}
}

func nixlAgent(o *opts, s *side, role string, tn tune) (*capi.Agent, error) {
	a, err := capi.OpenConfig(nixlConfig(o, role, tn))
	if err != nil {
		return nil, err
	}
	if err := a.Register([][3]uint64{{s.base, uint64(s.size), uint64(s.g.Ordinal())}}); err != nil {
		a.Close()
		return nil, fmt.Errorf("register %d MiB: %w", s.size>>20, err)
	}
	return a, nil
}

// engineConfig is the UCX plugin's engine_config every NIXL contender
// gets, Go's and Python's alike: on a GPU kvxfer's VRAM defaults
// (nixl.GPUEngineConfig: READs over cuda_ipc without NVLink), unless
// UCX_CUDA_IPC_ENABLE_GET_ZCOPY in the environment decides.
func engineConfig(o *opts) string {
	if o.fake || os.Getenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") != "" {
		return ""
	}
	return strings.Join(kvnixl.GPUEngineConfig, ",")
}

type nixlSide struct{ a *capi.Agent }

func (nixlSide) link([]byte) error { return nil }
func (s nixlSide) close() error    { return s.a.Close() }
func (m *nixlMover) close() error  { return m.a.Close() }

func nixlPeer(tn tune) func(*opts, *side) ([]byte, peerSide, error) {
	return func(o *opts, s *side) ([]byte, peerSide, error) {
		a, err := nixlAgent(o, s, "d", tn)
		if err != nil {
			return nil, nil, err
		}
		meta, err := a.Metadata()
		if err != nil {
			a.Close()
			return nil, nil, err
		}
		return meta, nixlSide{a}, nil
	}
}

// nixlInitiator opens the parent's agent on s and loads the child's
// (meta): the side that posts.
func nixlInitiator(o *opts, s *side, role string, tn tune, meta []byte) (*capi.Agent, string, error) {
	a, err := nixlAgent(o, s, role, tn)
	return initiator(a, err, meta)
}

type nixlMover struct {
	remoteMover
	a      *capi.Agent
	peer   string
	src    uint64
	dst    uint64
	posted bool
	descs  map[xcase][][3]uint64
}

func nixlOpen(tn tune) func(*opts, *side, *side, *remote, []byte) (mover, []byte, error) {
	return func(o *opts, src, _ *side, r *remote, meta []byte) (mover, []byte, error) {
		a, peer, err := nixlInitiator(o, src, "p", tn, meta)
		if err != nil {
			return nil, nil, err
		}
		return &nixlMover{remoteMover: remoteMover{r}, a: a, peer: peer, src: src.base, dst: r.base,
			descs: map[xcase][][3]uint64{}}, nil, nil
	}
}

func (m *nixlMover) write(c xcase) (time.Duration, error) {
	ds, ok := m.descs[c]
	if !ok {
		for _, p := range c.pairs() {
			ds = append(ds, [3]uint64{m.src + p.src, m.dst + p.dst, uint64(c.Piece)})
		}
		m.descs[c] = ds
	}
	return timedPost(m.a, true, m.peer, ds, &m.posted)
}

// timedPost posts one transfer of ds and polls it to its end, timed from
// the post. The first post may find UCX still connecting to the peer: it
// is tried again for up to 20 s (posted records that one went through).
func timedPost(a *capi.Agent, write bool, peer string, ds [][3]uint64, posted *bool) (time.Duration, error) {
	start := time.Now()
	x, err := a.Post(write, peer, ds, nil)
	for deadline := time.Now().Add(20 * time.Second); err != nil && !*posted && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
		start = time.Now()
		x, err = a.Post(write, peer, ds, nil)
	}
	if err != nil {
		return 0, err
	}
	*posted = true
	err = waitDone(func() (bool, error) { return a.State(x) }, nil)
	d := time.Since(start)
	_ = a.Release(x)
	return d, err
}

// nixlReadMover pulls: the parent READs the pieces from the child's
// region (filled with the source pattern) into its own scratch region,
// where they are checked.
type nixlReadMover struct {
	puller
	a      *capi.Agent
	peer   string
	posted bool
	descs  map[xcase][][3]uint64
}

func nixlReadOpen(tn tune) func(*opts, *side, *side, *remote, []byte) (mover, []byte, error) {
	return func(o *opts, _, scratch *side, r *remote, meta []byte) (mover, []byte, error) {
		a, peer, err := nixlInitiator(o, scratch, "p-read", tn, meta)
		if err != nil {
			return nil, nil, err
		}
		return &nixlReadMover{puller: puller{r: r, scratch: scratch, host: new([]byte)}, a: a, peer: peer, descs: map[xcase][][3]uint64{}}, nil, nil
	}
}

func (m *nixlReadMover) write(c xcase) (time.Duration, error) {
	ds, ok := m.descs[c]
	if !ok {
		for _, p := range c.pairs() {
			ds = append(ds, [3]uint64{m.scratch.base + p.dst, m.r.base + p.src, uint64(c.Piece)})
		}
		m.descs[c] = ds
	}
	return timedPost(m.a, false, m.peer, ds, &m.posted)
}

func (m *nixlReadMover) close() error { return m.a.Close() }

// localMover copies within the parent, from its source region into its
// scratch region, and checks there.
type localMover struct {
	src, scratch *side
	host         *[]byte // the parent's host buffer for checks
}

func (m localMover) prepare(c xcase) error { return mark(m.scratch, c) }

// The limit: one contiguous device copy of the same bytes.
type contigMover struct{ localMover }

func contigOpen(_ *opts, src, scratch *side, _ *remote, _ []byte) (mover, []byte, error) {
	return contigMover{localMover{src, scratch, new([]byte)}}, nil, nil
}

func (m contigMover) write(c xcase) (time.Duration, error) {
	start := time.Now()
	err := m.src.g.CopyDevice(m.scratch.base, m.src.base, c.total())
	if err == nil {
		err = m.src.g.Sync()
	}
	return time.Since(start), err
}

func (m contigMover) check(c xcase) error {
	got, want := make([]byte, c.total()), make([]byte, c.total())
	pattern(want, c.seed(), 0)
	if err := m.src.g.CopyOut(got, m.scratch.base); err != nil {
		return err
	}
	if string(got) != string(want) {
		return fmt.Errorf("%s: the contiguous copy differs from the source", c)
	}
	return nil
}

func (contigMover) close() error { return nil }

// batchMover copies c's pieces as one batch in one process: kvxfer's
// copy kernel alone (PostCopy), or what the same-host path did per piece
// (PostEach).
type batchMover struct {
	localMover
	post func([]netxfer.DevPiece) (netxfer.DevCopy, error)
}

func kernelOpen(_ *opts, src, scratch *side, _ *remote, _ []byte) (mover, []byte, error) {
	return batchMover{localMover{src, scratch, new([]byte)}, src.g.PostCopy}, nil, nil
}

func kernelLayoutOpen(_ *opts, src, scratch *side, _ *remote, _ []byte) (mover, []byte, error) {
	return kernelLayoutMover{localMover{src, scratch, new([]byte)}}, nil, nil
}

// kernelLayoutMover posts a case as the same-host path stages it: one
// region per layer, one entry per block.
type kernelLayoutMover struct{ localMover }

func (m kernelLayoutMover) write(c xcase) (time.Duration, error) {
	regs, ents := devLayout(c.layout(m.src.base, m.scratch.base))
	start := time.Now()
	err := postLayout(m.src.g, regs, ents)
	return time.Since(start), err
}

// devLayout is l as a device batch takes it (Remote the destination).
func devLayout(l netxfer.Layout) ([]netxfer.DevRegion, []netxfer.DevEntry) {
	regs := make([]netxfer.DevRegion, len(l.Bases))
	for i, b := range l.Bases {
		regs[i] = netxfer.DevRegion{Dst: b.Remote, Src: b.Local}
	}
	ents := make([]netxfer.DevEntry, len(l.Entries))
	for i, e := range l.Entries {
		ents[i] = netxfer.DevEntry{Dst: e.Remote, Src: e.Local, Len: e.Len}
	}
	return regs, ents
}

// postLayout stages a layout on g as one batch (the copy kernel), posts
// it and waits (spinning) until it is done.
func postLayout(g gpu, regs []netxfer.DevRegion, ents []netxfer.DevEntry) error {
	b, err := g.NewBatch(len(regs) + len(ents))
	if err != nil {
		return err
	}
	lb, ok := b.(netxfer.LayoutBatch)
	if !ok || !lb.AddLayout(regs, ents) {
		b.Discard()
		return fmt.Errorf("the device's batch took no layout of %d regions and %d entries", len(regs), len(ents))
	}
	cp, err := b.Post()
	if err != nil {
		return err
	}
	return waitDone(cp.Done, nil)
}

func (m kernelLayoutMover) check(c xcase) error { return checkSide(m.scratch, c, m.host) }

// kernelGatedMover posts a case as kernelLayoutMover does, through a gate
// of its own (open: its generation is the launch's), so that the gated
// kernel's time is measured without P's checks and the processes' hops.
type kernelGatedMover struct {
	localMover
	gate uint64
}

const kernelGateGen = 0x6b76_0001

func kernelGatedOpen(_ *opts, src, scratch *side, _ *remote, _ []byte) (mover, []byte, error) {
	gd, ok := src.g.(netxfer.GateDevice)
	if !ok {
		return nil, nil, errors.New("this device makes no gates")
	}
	gate, err := gd.Alloc(netxfer.GateSize)
	if err != nil {
		return nil, nil, err
	}
	var g [netxfer.GateSize]byte
	binary.LittleEndian.PutUint32(g[:], kernelGateGen)
	if err := gd.SideCopyIn(gate, g[:]); err != nil {
		_ = gd.Free(gate)
		return nil, nil, err
	}
	return &kernelGatedMover{localMover{src, scratch, new([]byte)}, gate}, nil, nil
}

func (m *kernelGatedMover) write(c xcase) (time.Duration, error) {
	regs, ents := devLayout(c.layout(m.src.base, m.scratch.base))
	start := time.Now()
	b, err := m.src.g.NewBatch(len(regs) + len(ents))
	if err != nil {
		return 0, err
	}
	lb, ok := b.(netxfer.LayoutBatch)
	gb, gok := b.(netxfer.GatedBatch)
	if !ok || !gok || !lb.AddLayout(regs, ents) || !gb.Gate(m.gate, kernelGateGen) {
		b.Discard()
		return 0, errors.New("the device's batch took no gated layout")
	}
	cp, err := b.Post()
	if err != nil {
		return 0, err
	}
	err = waitDone(cp.Done, nil)
	d := time.Since(start)
	if g, ok := cp.(netxfer.GatedCopy); err == nil && ok && g.Shut() {
		err = errors.New("the gated launch found its open gate shut")
	}
	return d, err
}

func (m *kernelGatedMover) check(c xcase) error { return checkSide(m.scratch, c, m.host) }

func (m *kernelGatedMover) close() error { return m.src.g.Free(m.gate) }

func (kernelLayoutMover) close() error { return nil }

func perPieceOpen(_ *opts, src, scratch *side, _ *remote, _ []byte) (mover, []byte, error) {
	return batchMover{localMover{src, scratch, new([]byte)}, src.g.PostEach}, nil, nil
}

func (m batchMover) write(c xcase) (time.Duration, error) { return postPieces(m.localMover, c, m.post) }

func (m batchMover) check(c xcase) error { return checkSide(m.scratch, c, m.host) }

func (batchMover) close() error { return nil }

// postPieces posts c's pieces from the source into the scratch region as
// one batch and waits (spinning) for it.
func postPieces(m localMover, c xcase, post func([]netxfer.DevPiece) (netxfer.DevCopy, error)) (time.Duration, error) {
	ps := c.pairs()
	s, d, n := m.src.base, m.scratch.base, uint64(c.Piece)
	batch := make([]netxfer.DevPiece, len(ps))
	for i, p := range ps {
		batch[i] = netxfer.DevPiece{Dst: d + p.dst, Src: s + p.src, Len: n}
	}
	start := time.Now()
	cp, err := post(batch)
	if err != nil {
		return 0, err
	}
	err = waitDone(cp.Done, nil)
	return time.Since(start), err
}

// markers is a host buffer of marker bytes, grown as needed (one
// goroutine uses it: the parent's or the child's loop).
var markers []byte

// mark fills a destination region's span of c with the marker.
func mark(s *side, c xcase) error {
	if len(markers) < c.span() {
		markers = bytes.Repeat([]byte{marker}, c.span())
	}
	return s.g.CopyIn(s.base, markers[:c.span()])
}

// checkSide reads a destination region back and verifies c there.
func checkSide(s *side, c xcase, host *[]byte) error {
	b := grow(host, c.span())
	if err := s.g.CopyOut(b, s.base); err != nil {
		return err
	}
	return verify(c, b)
}

// grow returns (*buf)[:n], reallocating when it is shorter.
func grow(buf *[]byte, n int) []byte {
	if cap(*buf) < n {
		*buf = make([]byte, n)
	}
	return (*buf)[:n]
}
