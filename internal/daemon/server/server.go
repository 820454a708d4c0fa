package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/klauspost/compress/zstd"
	"github.com/puzpuzpuz/xsync/v4"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

var errDraining = errors.New("server: kvxferd is shutting down")

// Backend is a transfer backend that adopts mapped memory: what the
// server needs to serve an engine's shared-memory KV cache.
type Backend interface {
	kvxfer.Backend
	Map(base uint64, mem []byte) error
}

// FileMapper is a Backend that adopts memory with the file it maps (the
// built-in backend: same-host peers copy out of the file directly).
type FileMapper interface {
	MapFile(base uint64, mem []byte, f *os.File, off int64) error
}

// IPCMapper is a Backend that adopts GPU memory by its CUDA IPC export
// (the built-in backend: moved on the same-host path only).
type IPCMapper interface {
	MapIPC(base, size uint64, dev tcp.Device, uuid [16]byte, handle [64]byte) error
}

// cudaDevice is a CUDA device as the built-in backend uses it.
type cudaDevice struct{ *cuda.Device }

func (d cudaDevice) Import(h [64]byte) (uint64, error) { return d.Device.Import(cuda.Handle(h)) }

// Export returns the CUDA IPC handle of memory from Alloc (the gates a
// consumer offers same-host producers: netxfer.GateDevice).
func (d cudaDevice) Export(ptr uint64) ([64]byte, error) {
	h, err := d.Device.Export(ptr)
	return [64]byte(h), err
}

// NewBatch stages a same-host part's GPU pieces for one launch of the
// copy kernel (tcp.BatchDevice).
func (d cudaDevice) NewBatch(n int) (tcp.DevBatch, error) {
	b, err := d.Device.NewBatch(n)
	if err != nil {
		return nil, err
	}
	return cudaBatch{b}, nil
}

var (
	_ tcp.BatchDevice = cudaDevice{} // same-host GPU parts go as one launch
	_ tcp.GateDevice  = cudaDevice{} // and producers on its GPU write grants one-sided
)

// cudaBatch is a cuda.Batch as the built-in backend stages it.
type cudaBatch struct{ *cuda.Batch }

var _ tcp.LayoutBatch = cudaBatch{} // a layout part is staged as its bases and entries

// AddLayout stages a layout as the copy kernel's regions and entries
// (the same shapes on both sides).
func (b cudaBatch) AddLayout(regions []tcp.DevRegion, entries []tcp.DevEntry) bool {
	return b.Batch.AddLayout(unsafe.Slice((*cuda.Region)(unsafe.Pointer(unsafe.SliceData(regions))), len(regions)),
		unsafe.Slice((*cuda.Entry)(unsafe.Pointer(unsafe.SliceData(entries))), len(entries)))
}

func (b cudaBatch) Post() (tcp.DevCopy, error) {
	c, err := b.Batch.Post()
	if err != nil {
		return nil, err
	}
	return c, nil
}

// IPCDevice returns this process's device for the GPU of uuid (opened
// once), for the built-in backend to import same-host peers' GPU memory
// on.
func (s *Server) IPCDevice(uuid [16]byte) (tcp.Device, error) {
	s.gpuMu.Lock()
	defer s.gpuMu.Unlock()
	ordinal, ok := s.gpuUUIDs[uuid]
	if !ok {
		var err error
		if ordinal, err = cuda.OrdinalOf(uuid); err != nil {
			return nil, err
		}
		if s.gpuUUIDs == nil {
			s.gpuUUIDs = map[[16]byte]int{}
		}
		s.gpuUUIDs[uuid] = ordinal
	}
	d, err := s.deviceLocked(ordinal)
	if err != nil {
		return nil, err
	}
	return cudaDevice{d}, nil
}

// DeviceMapper is a Backend that also adopts GPU memory (NIXL).
type DeviceMapper interface {
	MapDevice(base, size uint64) error
}

// Config configures a Server. Zero fields mean the defaults.
type Config struct {
	// PeerAddr is the address of this daemon's Peer service that other
	// daemons dial (host:port); engines' transfer params carry it.
	PeerAddr string
	// RankPortBase, when not 0, says this server is one of an engine's
	// per-rank servers (the in-process placement): rank (pp, tp) of an
	// engine is served at port RankPortBase + pp*tp_size + tp of
	// PeerAddr's host. A rank attaches here only if that port is
	// PeerAddr's, and handshakes say RankPortBase, so a peer asks each
	// rank's port (PeerResolver).
	RankPortBase int
	// ShmDir is the only directory shared-memory files are mapped from
	// (default shm.DefaultDir, /dev/shm), by shm.MapOwned: an engine's
	// files only (owned by its uid).
	ShmDir string
	// NewBackend makes the backend of one rank (default: a tcp.Backend
	// listening on 127.0.0.1). vram says the rank's memory is GPU memory.
	NewBackend func(engine string, layout *topology.Layout, vram bool) (Backend, error)
	// Resolver handshakes with peer engines (default: a PeerResolver).
	Resolver kvxfer.Resolver
	// WorkerConfig, when set, adjusts each rank's WorkerConfig (leases,
	// timeouts) before the Worker starts.
	WorkerConfig func(*kvxfer.WorkerConfig)
	// DrainTimeout bounds how long a closing rank waits for its
	// transfers (default 30 s).
	DrainTimeout time.Duration
	// CompressAbove compresses handshake payloads larger than this many
	// bytes when the caller accepts it (default 1024; negative: never).
	CompressAbove int
	// PeerCreds authenticate the default resolver to peer daemons
	// (default: none). Ignored when Resolver is set.
	PeerCreds credentials.TransportCredentials
	// PeerInsecure says PeerCreds authenticate nothing (-insecure-peers),
	// for clearer handshake errors (ResolverConfig.Insecure).
	PeerInsecure bool
	// PeerTLS says PeerCreds are mutual TLS (ResolverConfig.TLS).
	PeerTLS bool
	// AllowPeer, when set, vets every engine-supplied peer address before
	// the default resolver dials it (kvxferd -peer-allow). Ignored when
	// Resolver is set.
	AllowPeer func(addr string) error
	// HelloTimeout bounds the wait for a worker stream's hello (default
	// 10 s): a stream that never says hello holds nothing for long.
	HelloTimeout time.Duration
	// PublishWait bounds how long a rank's step_ref waits for its
	// scheduler to publish the step (default 10 s); past it the rank gets
	// a dropped StepError and the engine fails the step's requests.
	PublishWait time.Duration
	// MaxStreams bounds the engine streams (worker streams and Steps
	// streams) open at once (default 4096); MaxStreamsPerUID bounds those
	// of one uid (default 1024). Past them, a stream is refused with
	// ResourceExhausted. They bound open schedulers (OpenScheduler of a
	// new engine) the same way, counted apart from streams.
	MaxStreams, MaxStreamsPerUID int
	// MaxEngineConns bounds the connections open at once on the engine
	// listener (default 4096), and MaxEngineConnsPerUID those of one uid
	// (default 1024): a connection holds a descriptor and the gRPC
	// transport's buffers whether or not it carries a stream, and one that
	// never opens any would stay for ever. Past them a connection is
	// closed as soon as its uid is known (BoundEngineConns), and counted
	// (engine_conns, engine_conns_per_uid).
	MaxEngineConns, MaxEngineConnsPerUID int
	// MaxCalls bounds the calls in flight at once on the engine listener
	// (HTTP/2 streams of every method: scheduler calls, worker and Steps
	// streams, health and reflection), all engines together, and
	// MaxCallsPerUID those of one uid, whatever connections they come
	// over (defaults: twice MaxStreams and MaxStreamsPerUID). Each holds a
	// goroutine and the transport's buffers in the daemon, and gRPC bounds
	// no stream count of a connection. Past them a call is refused before
	// its handler starts (ResourceExhausted, counted as calls or
	// calls_per_uid), by the server option BoundCalls returns.
	MaxCalls, MaxCallsPerUID int
	// MaxRequests bounds the requests each engine's scheduler keeps
	// (kvxfer.SchedulerConfig.MaxRequests; 0: its default): one more is
	// refused with ResourceExhausted, counted as scheduler_requests.
	MaxRequests int
	// MaxMemoryEntries bounds the hello.memory entries the daemon holds
	// mapped at once (shared-memory files and CUDA IPC imports; memory
	// named by address in the engine's own process maps nothing), in all,
	// and MaxMemoryEntriesPerUID those of one uid: each keeps file
	// descriptors and a mapping for its rank's life, and a process that
	// runs out of either fails every engine's (a failed mmap of Go's own
	// heap ends it). The defaults: a quarter of the open-file limit, at
	// most 16,384, and half of that per uid. Past them a rank's hello is
	// refused with ResourceExhausted.
	MaxMemoryEntries, MaxMemoryEntriesPerUID int
	Logger                                   *slog.Logger
	// OnEnginesChanged, when set, is called (under the server's lock:
	// it must not block) whenever an engine's ranks change, for a
	// registry to publish Published again (kvxferd -etcd).
	OnEnginesChanged func()
	// PeerLookup, when set, finds the Peer service address of an engine
	// named without one (transfer params without an address), by its id:
	// kvxferd -etcd's registry. The default resolver uses it; consumers'
	// schedulers then take params without an address. It returns once
	// ctx (the handshake's) is done, at the latest.
	PeerLookup func(ctx context.Context, engineID string) (string, error)
	// EngineOwners reserve engine ids for uids (kvxferd -engine-owner,
	// -engine-owners): an id a rule matches may be claimed (a rank's
	// hello, OpenScheduler) by the rule's uid only, any other uid's claim
	// refused up front with PermissionDenied naming the id, the rule and
	// its uid (a *ReservedError, counted as engine_reserved), the id's
	// holder undisturbed. An id matched by several rules belongs to the
	// most specific: an exact id, else the longest prefix. Ids no rule
	// matches are first come, first served across uids (type owners).
	EngineOwners []EngineOwner
	// EngineOwnersOnly refuses every engine id no EngineOwners rule
	// matches (kvxferd -engine-owners-only; counted as
	// engine_unreserved): no id is first come, first served.
	EngineOwnersOnly bool
}

// Server implements the kvxfer.v1 WorkerService and PeerService. It is
// safe for concurrent use.
type Server struct {
	pb.UnimplementedWorkerServiceServer
	pb.UnimplementedPeerServiceServer

	cfg   Config
	sched *schedulers
	// checkAddr checks a peer address an engine names (nil: unchecked,
	// the configured resolver's own kind).
	checkAddr func(string) error
	// sameHostGone: same-host parts landed by ranks that detached.
	sameHostGone atomic.Uint64
	// oneSidedGone: one-sided WRITEs posted by ranks that detached.
	oneSidedGone atomic.Uint64
	// workerPanics: ranks whose worker stopped on a panic it contained.
	workerPanics atomic.Uint64
	owners       *owners
	limits       *limits
	log          *slog.Logger
	resolver     *PeerResolver
	enc          *zstd.Encoder
	draining     chan struct{}
	drainOne     sync.Once
	drainMu      sync.Mutex    // a stream counted (enter) and draining begun take turns
	drained      chan struct{} // closed once Drain saw every worker stream end: Steps streams end then
	drainedOnce  sync.Once
	gpuMu        sync.Mutex
	gpus         map[int]*cuda.Device // by this process's ordinal
	gpuUUIDs     map[[16]byte]int     // UUID -> ordinal, resolved once
	streams      sync.WaitGroup
	// life ends with Close: the direct streams' contexts (OpenDirect),
	// as stopping the gRPC server ends its streams'.
	life    context.Context
	endLife context.CancelFunc
	// bg: background handshakes of a scheduler's engine (generation),
	// waited for by Close.
	bg   sync.WaitGroup
	bgMu sync.Mutex // orders bg.Add after life's end against Close's Wait
	// stats: each rank's kvxfer.Metrics, kept over its detach (RankStats).
	stats rankStats

	// engines are the attached engines' ranks, read without a lock by
	// every peer handshake and probe, and written (copy on write, one
	// writer at a time under mu) when a rank attaches or detaches.
	engines *xsync.Map[string, *engineEntry]
	// leavingRanks are, by engine, the ranks unpublished whose Worker
	// still closes (mu.leaving), with what a handshake says of them
	// (RankList.leaving): read without a lock by every handshake, written
	// (copy on write) under mu.
	leavingRanks *xsync.Map[string, map[[2]int]kvxfer.RankInfo]
	mu           struct {
		sync.Mutex
		gen uint64
		// leaving are the ranks unpublished and still being let go
		// (their Worker's close fences what moves the engine's bytes):
		// a hello for one is refused until that ended.
		leaving map[rankKey]int
	}
}

// rankKey names an engine's rank (pp, tp).
type rankKey struct {
	engine string
	pp, tp int
}

// engineEntry is one engine's ranks, never changed once stored: a change
// stores a new entry. Its handshake answer is encoded once, by the first
// handshake that asks for it, not per handshake (liveness probes ask
// every PeerTimeout/5 per waiting consumer rank).
type engineEntry struct {
	gen     uint64
	ranks   map[[2]int]*rankEntry
	encode  sync.Once
	payload []byte // the marshaled RankList
	zstd    []byte // payload compressed, when larger than CompressAbove
}

// answer returns e's handshake payload, and its compressed form (nil
// when not larger than compressAbove, or compressAbove is negative).
func (e *engineEntry) answer(enc *zstd.Encoder, compressAbove int) (payload, compressed []byte) {
	e.encode.Do(func() {
		var list pb.RankList
		for _, k := range slices.SortedFunc(maps.Keys(e.ranks), byRank) {
			list.Ranks = append(list.Ranks, rankInfoProto(&e.ranks[k].info))
		}
		e.payload, _ = proto.Marshal(&list) // a RankList of valid layouts always marshals
		if compressAbove >= 0 && len(e.payload) > compressAbove {
			e.zstd = enc.EncodeAll(e.payload, nil)
		}
	})
	return e.payload, e.zstd
}

// byRank orders ranks (pp, tp) as handshakes list them.
func byRank(a, b [2]int) int { return cmp.Compare(a[0]<<16|a[1], b[0]<<16|b[1]) }

// rankInfoProto is ri as a handshake lists it.
func rankInfoProto(ri *kvxfer.RankInfo) *pb.RankInfo {
	return &pb.RankInfo{EngineId: ri.EngineID, CompatHash: ri.CompatHash, Layout: stream.LayoutToProto(&ri.Layout), Agent: ri.Agent}
}

type rankEntry struct {
	info    kvxfer.RankInfo
	worker  *kvxfer.Worker
	backend Backend
}

// New returns a Server.
func New(cfg Config) (*Server, error) {
	if cfg.PeerAddr == "" {
		return nil, errors.New("server: Config.PeerAddr is empty")
	}
	if cfg.ShmDir == "" {
		cfg.ShmDir = shm.DefaultDir
	}
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = 30 * time.Second
	}
	if cfg.CompressAbove == 0 {
		cfg.CompressAbove = 1024
	}
	if cfg.HelloTimeout <= 0 {
		cfg.HelloTimeout = 10 * time.Second
	}
	if cfg.PublishWait <= 0 {
		cfg.PublishWait = defaultPublishWait
	}
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = 4096
	}
	if cfg.MaxStreamsPerUID <= 0 {
		cfg.MaxStreamsPerUID = 1024
	}
	if cfg.MaxCalls <= 0 {
		cfg.MaxCalls = 2 * cfg.MaxStreams
	}
	if cfg.MaxCallsPerUID <= 0 {
		cfg.MaxCallsPerUID = 2 * cfg.MaxStreamsPerUID
	}
	if cfg.MaxEngineConns <= 0 {
		cfg.MaxEngineConns = 4096
	}
	if cfg.MaxEngineConnsPerUID <= 0 {
		cfg.MaxEngineConnsPerUID = 1024
	}
	if cfg.MaxMemoryEntries <= 0 {
		cfg.MaxMemoryEntries = defaultMemoryEntries()
	}
	if cfg.MaxMemoryEntriesPerUID <= 0 {
		cfg.MaxMemoryEntriesPerUID = max(1, cfg.MaxMemoryEntries/2)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.NewBackend == nil {
		log := cfg.Logger
		cfg.NewBackend = func(_ string, _ *topology.Layout, vram bool) (Backend, error) {
			if vram {
				return nil, errors.New("the built-in backend moves host memory only (GPU memory needs NIXL)")
			}
			b, err := tcp.New(tcp.Config{Logger: log})
			if err != nil {
				return nil, err // not b: a nil *tcp.Backend would be a non-nil Backend
			}
			return b, nil
		}
	}
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
	if err != nil {
		return nil, err
	}
	res, err := newReservations(cfg.EngineOwners, cfg.EngineOwnersOnly)
	if err != nil {
		return nil, err
	}
	own := &owners{m: map[string]*owner{}, reserved: res}
	s := &Server{cfg: cfg, log: cfg.Logger, enc: enc, draining: make(chan struct{}), drained: make(chan struct{}), owners: own,
		limits: &limits{streams: newBudget(cfg.MaxStreams, cfg.MaxStreamsPerUID, "engine streams", "-max-streams", "streams"),
			mem:   newBudget(cfg.MaxMemoryEntries, cfg.MaxMemoryEntriesPerUID, "mapped memory entries", "-max-memory-entries", "memory_entries"),
			conns: newBudget(cfg.MaxEngineConns, cfg.MaxEngineConnsPerUID, "engine connections", "-max-engine-conns", "engine_conns"),
			calls: newBudget(cfg.MaxCalls, cfg.MaxCallsPerUID, "engine calls in flight", "-max-calls", "calls")}}
	s.life, s.endLife = context.WithCancel(context.Background())
	// Generations start from the clock, so a restarted daemon never gives
	// an engine a generation its peers saw from the previous process: a
	// peer that asks again learns the engine's ranks changed.
	s.mu.gen = uint64(time.Now().UnixNano())
	schedAddr := cfg.PeerAddr
	if cfg.RankPortBase != 0 {
		// Transfer params name an engine by its first rank's port.
		if host, _, err := net.SplitHostPort(cfg.PeerAddr); err == nil {
			schedAddr = net.JoinHostPort(host, strconv.Itoa(cfg.RankPortBase))
		}
	}
	s.sched = &schedulers{addr: schedAddr, m: xsync.NewMap[string, *lockedScheduler](), owners: own, limits: s.limits,
		publishWait: cfg.PublishWait, resolveByID: cfg.PeerLookup != nil, maxRequests: cfg.MaxRequests, drained: s.drained, log: cfg.Logger,
		generation: s.generation}
	if cfg.Resolver == nil {
		allow := cfg.AllowPeer
		if allow != nil {
			allow = func(addr string) error {
				err := cfg.AllowPeer(addr)
				if err != nil {
					s.limits.refuse("peer_not_allowed")
				}
				return err
			}
		}
		s.resolver = NewPeerResolver(ResolverConfig{Creds: cfg.PeerCreds, Insecure: cfg.PeerInsecure, TLS: cfg.PeerTLS, Allow: allow,
			Lookup: cfg.PeerLookup})
		s.cfg.Resolver = s.resolver
	}
	if _, ok := s.cfg.Resolver.(*PeerResolver); ok {
		// Peer addresses are host:port, as that resolver dials them: one
		// it would refuse is bad input where an engine names it.
		s.checkAddr = checkPeerAddr
		s.sched.checkAddr = checkPeerAddr
	}
	s.engines = xsync.NewMap[string, *engineEntry]()
	s.leavingRanks = xsync.NewMap[string, map[[2]int]kvxfer.RankInfo]()
	return s, nil
}

// RegisterEngine adds the engine-facing services (WorkerService,
// SchedulerService) to g: serve g on kvxferd's unix socket only, built
// with grpc.Creds(EngineCredentials()), which identify each engine's uid;
// the services refuse calls that did not come through them.
func (s *Server) RegisterEngine(g *grpc.Server) {
	pb.RegisterWorkerServiceServer(g, s)
	pb.RegisterSchedulerServiceServer(g, s.sched)
}

// RegisterPeer adds PeerService, what other daemons call, to g: serve g
// on the peer listener, with the peers' authentication as its
// credentials.
func (s *Server) RegisterPeer(g *grpc.Server) {
	pb.RegisterPeerServiceServer(g, s)
}

type sameHostCounter interface{ SameHostParts() uint64 }

type oneSidedCounter interface{ OneSidedWrites() uint64 }

// OneSidedWrites returns how many WRITEs this daemon's engines' ranks
// posted one-sided, through a same-host consumer's gate (the built-in
// backend's producer launching the copy into the consumer's GPU memory
// itself), over the daemon's life.
func (s *Server) OneSidedWrites() uint64 {
	n := s.oneSidedGone.Load()
	s.engines.Range(func(_ string, e *engineEntry) bool {
		for _, r := range e.ranks {
			if c, ok := r.backend.(oneSidedCounter); ok {
				n += c.OneSidedWrites()
			}
		}
		return true
	})
	return n
}

// SameHostParts returns how many transfer parts this daemon copied
// straight out of a peer engine's memory file on this host into its
// engines' memory (the built-in backend's same-host path: WRITEs from
// peers, READs of them), over the daemon's life.
func (s *Server) SameHostParts() uint64 {
	n := s.sameHostGone.Load()
	s.engines.Range(func(_ string, e *engineEntry) bool {
		for _, r := range e.ranks {
			if sp, ok := r.backend.(sameHostCounter); ok {
				n += sp.SameHostParts()
			}
		}
		return true
	})
	return n
}

// WorkerPanics returns how many ranks' workers hit an internal error (a
// panic, contained: kvxfer.WorkerConfig.ContainPanics) over the daemon's
// life. Each failed its requests and ended its rank's stream with the
// error (Internal); the daemon and its other ranks carried on. A rank is
// counted once it is released, right after its stream ended.
func (s *Server) WorkerPanics() uint64 { return s.workerPanics.Load() }

// Workers returns every rank's worker, for metrics.
func (s *Server) Workers() map[string][]*kvxfer.Worker {
	out := map[string][]*kvxfer.Worker{}
	s.engines.Range(func(id string, e *engineEntry) bool {
		for _, r := range e.ranks {
			out[id] = append(out[id], r.worker)
		}
		return true
	})
	return out
}

// Drain makes every worker stream finish: each rank lets its transfers
// complete (up to DrainTimeout), reports every outcome, releases its
// memory and ends its stream. It returns when they all ended or ctx ends.
func (s *Server) Drain(ctx context.Context) error {
	s.drainMu.Lock()
	s.drainOne.Do(func() { close(s.draining) })
	s.drainMu.Unlock()
	done := make(chan struct{}) // no stream is counted from here on (enter)
	go func() { s.streams.Wait(); close(done) }()
	select {
	case <-done:
		s.drainedOnce.Do(func() { close(s.drained) })
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// enter counts a worker stream that Drain waits for, unless the server
// drains already (false). A stream that came as Drain began is either
// counted before its Wait or refused, never counted under it (a
// WaitGroup's Add racing its Wait at zero).
func (s *Server) enter() bool {
	s.drainMu.Lock()
	defer s.drainMu.Unlock()
	select {
	case <-s.draining:
		return false
	default:
		s.streams.Add(1)
		return true
	}
}

// closeWait bounds how long Close waits for the rank streams to end (a
// variable for tests).
var closeWait = 40 * time.Second

// Close releases the server's own resources (after Drain), and ends the
// direct streams still open. It returns once every rank stream ended (its
// Worker closed, its backend closed, its memory let go), within
// closeWait: a drain that ran out of time is followed by a gRPC stop that
// does not wait for the streams' handlers, and until a rank detached its
// transfers may still touch the memory its engine named (an in-process
// engine frees it once kvxfer_stop returns). Streams still going after
// closeWait are logged, and Close then returns ErrRanksStillClosing.
func (s *Server) Close() error {
	s.drainMu.Lock()
	s.drainOne.Do(func() { close(s.draining) }) // no stream enters under the Wait below
	s.drainMu.Unlock()
	s.endLife()
	// A background handshake starting from now on sees life ended.
	s.bgMu.Lock()
	bg := &s.bg
	s.bgMu.Unlock()
	bg.Wait()
	done := make(chan struct{})
	go func() { s.streams.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-time.After(closeWait):
		s.log.Error("kvxferd: rank streams still ending after the server closed: the memory their engines named may still be touched", "waited", closeWait)
		err = fmt.Errorf("%w %v after the close: the memory their engines named may still be touched", ErrRanksStillClosing, closeWait)
	}
	if s.resolver != nil {
		s.resolver.Close()
	}
	return errors.Join(err, s.enc.Close())
}

// ErrRanksStillClosing is Close's error when a rank stream had not ended
// within its wait: an in-process engine must not free the memory it named.
var ErrRanksStillClosing = errors.New("server: rank streams still ending")

// rankPort checks, on a per-rank server (RankPortBase), that the rank at l
// is the one this server's port serves.
func (s *Server) rankPort(l *topology.Layout) error {
	if s.cfg.RankPortBase == 0 {
		return nil
	}
	_, ps, err := net.SplitHostPort(s.cfg.PeerAddr)
	port, perr := strconv.Atoi(ps)
	if err != nil || perr != nil {
		return fmt.Errorf("server: peer address %q has no port", s.cfg.PeerAddr)
	}
	if want := RankPort(s.cfg.RankPortBase, l.TPSize, l.PPRank, l.TPRank); want != port {
		return stream.Invalid("hello.layout: tp rank %d pp rank %d of tp size %d is served at port %d (rank-port-base %d + pp_rank*tp_size + tp_rank), "+
			"but this server's peer port is %d: start each rank's server on its own port", l.TPRank, l.PPRank, l.TPSize, want, s.cfg.RankPortBase, port)
	}
	return nil
}

// RankPort is the peer port of rank (pp, tp) of an engine of TP size
// tpSize whose ranks are served each by its own server from port base
// (the in-process placement's port scheme).
func RankPort(base, tpSize, pp, tp int) int { return base + pp*tpSize + tp }

// ErrAttached is the error of a hello for a rank that is attached
// already: a rank is never replaced, and only its own stream detaches it
// (Status: AlreadyExists).
var ErrAttached = errors.New("rank attached already")

// attached is an ErrAttached error when engine's rank at l is attached.
func (s *Server) attached(engine string, l *topology.Layout) error {
	if e, _ := s.engines.Load(engine); e != nil && e.ranks[[2]int{l.PPRank, l.TPRank}] != nil {
		return fmt.Errorf("%w: engine %q tp rank %d pp rank %d has a stream open (a rank detaches only by closing its own stream; retry once it has)",
			ErrAttached, engine, l.TPRank, l.PPRank)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leavingLocked(engine, l)
}

// leavingLocked is an ErrAttached error while engine's rank at l is being
// let go (its stream ended, its Worker still closing). Caller holds mu.
func (s *Server) leavingLocked(engine string, l *topology.Layout) error {
	if s.mu.leaving[rankKey{engine, l.PPRank, l.TPRank}] > 0 {
		return fmt.Errorf("%w: engine %q tp rank %d pp rank %d: its last stream ended and the rank is still being let go "+
			"(what it moved is fenced first); retry once it has", ErrAttached, engine, l.TPRank, l.PPRank)
	}
	return nil
}

func (s *Server) publish(info kvxfer.RankInfo, w *kvxfer.Worker, be Backend) error {
	if err := s.attached(info.EngineID, &info.Layout); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old, _ := s.engines.Load(info.EngineID)
	k := [2]int{info.Layout.PPRank, info.Layout.TPRank}
	if old != nil && old.ranks[k] != nil { // attached between the check and here
		return fmt.Errorf("%w: engine %q tp rank %d pp rank %d", ErrAttached, info.EngineID, info.Layout.TPRank, info.Layout.PPRank)
	}
	if err := s.leavingLocked(info.EngineID, &info.Layout); err != nil { // detached between the check and here
		return err
	}
	ranks := map[[2]int]*rankEntry{}
	if old != nil {
		maps.Copy(ranks, old.ranks)
	}
	ranks[k] = &rankEntry{info: info, worker: w, backend: be}
	s.storeLocked(info.EngineID, ranks)
	return nil
}

// spreadGenRefresh is how long a scheduler's server keeps the generation
// of its engine's ranks served elsewhere (spreadGen) before it asks them
// again.
const spreadGenRefresh = time.Second

// generation returns the source of engine's generation as a handshake with
// this server reports it, for its scheduler to stamp on pull params
// (kvxfer.SchedulerConfig.Generation; 0: unknown):
//   - on a daemon (no RankPortBase), its entry's;
//   - on a per-rank server (RankPortBase) that serves every rank of the
//     engine (one rank), the resolver's spreadGeneration of it;
//   - on one that does not (an in-process engine's scheduler, in its
//     engine core's process apart from its ranks'), what a handshake with
//     the engine's ranks at this server's advertised address (HOST:BASE)
//     last said: asked when its scheduler opens (prime, waited for), then
//     again in the background once spreadGenRefresh has passed since the
//     last time (0 until the first answer, and after a handshake that
//     failed: its ranks are gone or restarting).
//
// The source is the scheduler's own, and goes with it.
func (s *Server) generation(engine string) *genSource {
	return &genSource{s: s, engine: engine}
}

// genSource is one scheduler's source of its engine's generation
// (Server.generation).
type genSource struct {
	s      *Server
	engine string
	gen    atomic.Uint64
	last   atomic.Int64 // unix nanos the last handshake began (0: none)
	busy   atomic.Bool
}

// get is the engine's generation now (kvxfer.SchedulerConfig.Generation):
// it never waits.
func (g *genSource) get() uint64 {
	s := g.s
	if v, ok := s.localGeneration(g.engine); ok {
		return v
	}
	if now := time.Now().UnixNano(); now-g.last.Load() >= int64(spreadGenRefresh) && g.busy.CompareAndSwap(false, true) {
		g.last.Store(now)
		s.bgMu.Lock()
		if s.life.Err() != nil { // closed: Close waits for none started now
			s.bgMu.Unlock()
			g.busy.Store(false)
			return g.gen.Load()
		}
		s.bg.Add(1)
		s.bgMu.Unlock()
		go func() {
			defer s.bg.Done()
			defer g.busy.Store(false)
			ctx, cancel := context.WithTimeout(s.life, spreadGenRefresh*5)
			defer cancel()
			g.ask(ctx)
		}()
	}
	return g.gen.Load()
}

// prime asks the engine's ranks at once, where this server does not serve
// them, and waits for the answer (within ctx and primeWait): a scheduler
// opened on it tells the generation from its first step's answer, and
// the params it returns first carry it (an engine's ranks attach before
// its scheduler opens: vLLM builds its workers first).
func (g *genSource) prime(ctx context.Context) {
	if _, ok := g.s.localGeneration(g.engine); ok || !g.busy.CompareAndSwap(false, true) {
		return
	}
	defer g.busy.Store(false)
	g.last.Store(time.Now().UnixNano())
	ctx, cancel := context.WithTimeout(ctx, primeWait)
	defer cancel()
	g.ask(ctx)
}

// primeWait bounds how long opening a scheduler waits for its engine's
// ranks' generation (genSource.prime).
const primeWait = 2 * time.Second

// ask handshakes with the engine's ranks at this server's advertised
// address, as a peer does, and keeps the generation they report (0 when
// they do not answer: they are gone or restarting).
func (g *genSource) ask(ctx context.Context) {
	s := g.s
	res, err := s.cfg.Resolver.Handshake(ctx, g.engine, s.sched.addr)
	if err != nil {
		g.gen.Store(0)
		s.log.Debug("kvxferd: the generation of this scheduler's engine is unknown: its ranks did not answer", "engine", g.engine, "err", err)
		return
	}
	g.gen.Store(res.Generation)
}

// localGeneration is engine's generation when this server can tell it
// from the ranks it serves (generation); ok false when its ranks are
// served elsewhere.
func (s *Server) localGeneration(engine string) (uint64, bool) {
	e, _ := s.engines.Load(engine)
	if s.cfg.RankPortBase == 0 {
		if e == nil {
			return 0, true
		}
		return e.gen, true
	}
	if e == nil {
		return 0, false
	}
	n := 0
	for _, r := range e.ranks {
		n = r.info.Layout.TPSize * r.info.Layout.PPSize
		break
	}
	if n <= 0 || len(e.ranks) != n {
		return 0, false
	}
	return spreadGeneration(n, func(int) uint64 { return e.gen }), true
}

// storeLocked stores engine's new entry of ranks (none: it is gone),
// under a new generation. Caller holds mu.
func (s *Server) storeLocked(engine string, ranks map[[2]int]*rankEntry) {
	if len(ranks) == 0 {
		s.engines.Delete(engine)
		if s.cfg.OnEnginesChanged != nil {
			s.cfg.OnEnginesChanged()
		}
		return
	}
	s.mu.gen++
	s.engines.Store(engine, &engineEntry{gen: s.mu.gen, ranks: ranks})
	if s.cfg.OnEnginesChanged != nil {
		s.cfg.OnEnginesChanged()
	}
}

// unpublish removes the rank of w from engine's published ranks, and
// marks it leaving (refused to a new hello) until the returned func,
// called once the rank was let go, says so. Meanwhile a handshake lists
// it as leaving (RankList.leaving): its Worker's close waits for peers'
// word on what it moved (a push consumer's cancels confirmed, a pull
// producer's holds released), and a peer that had not handshaken with
// the engine yet must still reach it. Before, a handshake did not know
// the rank at all once its stream ended: such a peer could tell it
// nothing, and its close waited out its CloseTimeout (10 s), and its
// engine's next attach with it.
func (s *Server) unpublish(engine string, l *topology.Layout, w *kvxfer.Worker) (left func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := rankKey{engine, l.PPRank, l.TPRank}
	if s.mu.leaving == nil {
		s.mu.leaving = map[rankKey]int{}
	}
	s.mu.leaving[key]++
	k := [2]int{l.PPRank, l.TPRank}
	var listed bool // listed as leaving by this call
	left = func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.mu.leaving[key]--; s.mu.leaving[key] <= 0 {
			delete(s.mu.leaving, key)
		}
		if listed {
			lv, _ := s.leavingRanks.Load(engine)
			lv = maps.Clone(lv)
			delete(lv, k)
			if len(lv) == 0 {
				s.leavingRanks.Delete(engine)
			} else {
				s.leavingRanks.Store(engine, lv)
			}
		}
	}
	e, _ := s.engines.Load(engine)
	if e == nil {
		return left
	}
	if r := e.ranks[k]; r != nil && r.worker == w {
		ranks := maps.Clone(e.ranks)
		delete(ranks, k)
		lv, _ := s.leavingRanks.Load(engine)
		lv = maps.Clone(lv)
		if lv == nil {
			lv = map[[2]int]kvxfer.RankInfo{}
		}
		lv[k], listed = r.info, true
		s.leavingRanks.Store(engine, lv) // before the rank goes: a handshake finds it in one or the other
		s.storeLocked(engine, ranks)
	}
	return left
}

// Handshake implements PeerService: an engine's ranks, zstd-compressed
// when large and the caller accepts it.
func (s *Server) Handshake(_ context.Context, req *pb.HandshakeRequest) (*pb.HandshakeResponse, error) {
	if req.GetEngineId() == "" {
		s.limits.refuse("bad_handshake")
		return nil, Status(stream.Invalid("handshake.engine_id is empty"))
	}
	if n := len(req.EngineId); n > MaxEngineID {
		// No engine has such an id (a hello refuses it); and the error
		// must not echo a peer's megabyte back.
		s.limits.refuse("bad_handshake")
		return nil, Status(stream.Invalid("handshake.engine_id = %.32q... has %d bytes, want at most %d", req.EngineId, n, MaxEngineID))
	}
	// The published ranks first: unpublish lists a rank as leaving
	// before it takes it from them, so one read after the other finds it
	// in one or both (leavingAnswer lists it once).
	e, _ := s.engines.Load(req.EngineId)
	lv, _ := s.leavingRanks.Load(req.EngineId)
	if e == nil && lv == nil {
		return nil, Status(fmt.Errorf("handshake: engine %q: %w", req.EngineId, kvxfer.ErrUnknownEngine))
	}
	var resp *pb.HandshakeResponse
	if lv == nil {
		payload, compressed := e.answer(s.enc, s.cfg.CompressAbove)
		resp = &pb.HandshakeResponse{EngineId: req.EngineId, Generation: e.gen, Payload: payload}
		if req.AcceptZstd && compressed != nil {
			resp.Payload, resp.Zstd = compressed, true
		}
	} else {
		// Ranks leaving: an answer of its own, not cached (a rank leaves
		// for as long as its close, milliseconds mostly).
		resp = s.leavingAnswer(req, e, lv)
	}
	resp.RankPortBase = uint32(s.cfg.RankPortBase)
	resp.ServerUnixNanos = time.Now().UnixNano()
	return resp, nil
}

// leavingAnswer is the handshake answer for an engine with ranks leaving
// (lv), and e's published ones (e may be nil: none).
func (s *Server) leavingAnswer(req *pb.HandshakeRequest, e *engineEntry, lv map[[2]int]kvxfer.RankInfo) *pb.HandshakeResponse {
	var list pb.RankList
	resp := &pb.HandshakeResponse{EngineId: req.EngineId}
	if e != nil {
		resp.Generation = e.gen
		for _, k := range slices.SortedFunc(maps.Keys(e.ranks), byRank) {
			list.Ranks = append(list.Ranks, rankInfoProto(&e.ranks[k].info))
		}
	}
	for _, k := range slices.SortedFunc(maps.Keys(lv), byRank) {
		if e != nil && e.ranks[k] != nil {
			continue // read published before unpublish took it
		}
		ri := lv[k]
		list.Leaving = append(list.Leaving, rankInfoProto(&ri))
	}
	resp.Payload, _ = proto.Marshal(&list) // valid layouts always marshal
	if req.AcceptZstd && s.cfg.CompressAbove >= 0 && len(resp.Payload) > s.cfg.CompressAbove {
		resp.Payload, resp.Zstd = s.enc.EncodeAll(resp.Payload, nil), true // EncodeAll may be called concurrently
	}
	return resp
}

// Connect implements WorkerService: one engine rank's stream.
func (s *Server) Connect(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	if !s.enter() {
		return Status(errDraining)
	}
	defer s.streams.Done()
	engine, err := caller(st.Context())
	if err != nil {
		s.limits.refuse("permission")
		return Status(err)
	}
	uid := engine.UID
	done, err := s.limits.admit(uid)
	if err != nil {
		return Status(err)
	}
	defer done()
	first, err := s.recvHello(st)
	if err != nil {
		return Status(err)
	}
	hello := first.GetHello()
	if hello == nil {
		s.limits.refuse("bad_hello")
		return Status(stream.Invalid("the first message of a worker stream must be hello"))
	}
	r, err := s.attach(hello, uid, engine.Groups, engine.PID)
	if err != nil {
		switch {
		case s.limits.refuseReserved(err):
		case errors.Is(err, errForeignAddress):
			s.limits.refuse("memory_address")
		case errors.Is(err, shm.ErrRefused):
			s.limits.refuse("memory")
		case errors.Is(err, ErrPermission):
			s.limits.refuse("permission")
		case errors.Is(err, ErrAttached):
			s.limits.refuse("rank_attached")
		case errors.Is(err, stream.ErrInvalid):
			s.limits.refuse("bad_hello")
		}
		return Status(err)
	}
	defer r.detach()
	r.maxMsg, r.maxErr = messageLimits(hello.GetMaxMessageBytes())
	if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Ready{Ready: &pb.Ready{AgentName: r.agent, MaxMessageBytes: uint32(r.maxMsg)}}}); err != nil {
		return Status(err)
	}
	return r.serve(st)
}

// recvHello receives a worker stream's first message, waiting at most
// HelloTimeout, and not once the server drains.
func (s *Server) recvHello(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) (*pb.ConnectRequest, error) {
	type recvd struct {
		m   *pb.ConnectRequest
		err error
	}
	ch := make(chan recvd, 1)
	go func() { // ends with the stream at the latest
		m, err := st.Recv()
		ch <- recvd{m, err}
	}()
	t := time.NewTimer(s.cfg.HelloTimeout)
	defer t.Stop()
	select {
	case r := <-ch:
		return r.m, r.err
	case <-t.C:
		s.limits.refuse("hello_timeout")
		return nil, fmt.Errorf("no hello within %v: %w", s.cfg.HelloTimeout, context.DeadlineExceeded)
	case <-s.draining:
		// A rank not yet attached is new work, which a draining server
		// refuses: Drain does not wait out its hello timeout. (A hello
		// that came already is served.)
		select {
		case r := <-ch:
			return r.m, r.err
		default:
			return nil, errDraining
		}
	}
}

// Refusals returns how many calls and streams the server refused since it
// started, by reason: permission (another uid's engine, or not on the
// unix socket), engine_reserved (an engine id the daemon's rules reserve
// for another uid: Config.EngineOwners), engine_unreserved (an id no rule
// matches, under Config.EngineOwnersOnly), rank_attached, memory (a shared-memory file refused),
// memory_address (memory named by address from another process),
// bad_request (a SchedulerService call's bad input), hello_timeout, bad_message (what an engine handed without gRPC did not
// parse, or was too large; a message that ended a rank's stream: empty, or a
// second hello), bad_step (a step the rank dropped whole: a step_ref naming
// no step published, or one the rank dropped before; or a step_ref
// repeating one the rank took in, ignored), bad_handshake (a peer's handshake naming no engine), streams and streams_per_uid (limits),
// schedulers and schedulers_per_uid (the same limits on open schedulers),
// engine_conns and engine_conns_per_uid (BoundEngineConns), calls and calls_per_uid (BoundCalls), peer_calls and peer_calls_per_conn (BoundPeerCalls), scheduler_requests (a scheduler call past kvxfer.SchedulerConfig.MaxRequests), peer_not_allowed
// (AllowPeer), and what the daemon counted with Refuse.
func (s *Server) Refusals() map[string]uint64 { return s.limits.counts() }

// Refuse counts a refusal the daemon made around the server (e.g.
// peer_conns_per_addr: a peer connection past its bound).
func (s *Server) Refuse(reason string) { s.limits.refuse(reason) }

// ErrLimit is the error of a stream refused by a limit (Status:
// ResourceExhausted).
var ErrLimit = errors.New("limit reached")

// limits bounds what engines hold at once, in all and per uid: their
// streams (streams, which bound open schedulers too), the memory entries
// their ranks hold mapped (mem), their connections (conns) and their
// calls in flight (calls); and counts refusals by reason.
type limits struct {
	mu      sync.Mutex
	streams budget
	mem     budget
	conns   budget
	calls   budget
	refused map[string]uint64
}

// budget is one bounded count, in all and by uid (limits.mu).
type budget struct {
	max, perUID, total int
	by                 map[uint32]int
	// what is counted, the flags that bound it, and the refusal reason
	// (reason+"_per_uid" for a uid's), for errors and metrics.
	what, flag, flagUID, reason string
}

func newBudget(max, perUID int, what, flag, reason string) budget {
	return budget{max: max, perUID: perUID, by: map[uint32]int{}, what: what, flag: flag, flagUID: flag + "-per-uid", reason: reason}
}

// defaultMemoryEntries is Config.MaxMemoryEntries's default: a quarter
// of the open-file limit (an entry keeps two descriptors, and streams and
// peer connections want theirs), at most 16,384 (a quarter of Linux's
// default map count), at least 256.
func defaultMemoryEntries() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == 0 {
		return 1024
	}
	return int(min(max(rl.Cur/4, 256), 16384))
}

// take counts n more of b for uid, or refuses them (counted); done gives
// them back.
func (l *limits) take(b *budget, uid uint32, n int) (done func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case b.total+n > b.max:
		l.refuseLocked(b.reason)
		return nil, fmt.Errorf("%w: %d %s more, with %d held the daemon's most is %d (kvxferd %s)", ErrLimit, n, b.what, b.total, b.max, b.flag)
	case b.by[uid]+n > b.perUID:
		l.refuseLocked(b.reason + "_per_uid")
		return nil, fmt.Errorf("%w: %d %s more, with uid %d's %d held the most one user may is %d (kvxferd %s)",
			ErrLimit, n, b.what, uid, b.by[uid], b.perUID, b.flagUID)
	}
	b.total += n
	b.by[uid] += n
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			b.total -= n
			if b.by[uid] -= n; b.by[uid] <= 0 {
				delete(b.by, uid)
			}
		})
	}, nil
}

// admit counts a new stream of uid, or refuses it; done undoes it.
func (l *limits) admit(uid uint32) (done func(), err error) { return l.take(&l.streams, uid, 1) }

func (l *limits) refuse(reason string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.refuseLocked(reason)
}

func (l *limits) refuseLocked(reason string) {
	if l.refused == nil {
		l.refused = map[string]uint64{}
	}
	l.refused[reason]++
}

func (l *limits) counts() map[string]uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]uint64, len(l.refused))
	for k, v := range l.refused {
		out[k] = v
	}
	return out
}

// maxFinishedBytes bounds one Finished message on a worker stream, well
// under gRPC's default 4 MiB limit of the engine's client: a bigger set of
// outcomes goes out as several messages (each a delta, as always).
const maxFinishedBytes = 1 << 20

// defaultClientMax is the limit of a client that does not say its own
// (WorkerHello.max_message_bytes 0): gRPC's default.
const defaultClientMax = 4 << 20

// minClientMax is the least WorkerHello.max_message_bytes taken: twice the
// least a Finished message is held to (messageLimits).
const minClientMax = 32 << 10

// messageLimits returns, for a client that accepts messages up to max
// bytes (0: defaultClientMax), the most one Finished message may carry
// and the longest step error: half the client's limit (the rest for
// framing and one outcome over the mark), maxFinishedBytes at most, 16 KiB
// at least; step errors half of that, maxStepError at most.
func messageLimits(client uint32) (finished, stepErr int) {
	limit := int(client)
	if limit == 0 {
		limit = defaultClientMax
	}
	finished = min(maxFinishedBytes, max(limit/2, 16<<10))
	return finished, min(maxStepError, finished/2)
}

// sendFinished sends f, split into messages of at most max bytes.
func sendFinished(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse], max int, f *pb.Finished) error {
	if finishedBound(f) <= max { // the usual case, without sizing it twice
		return st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Finished{Finished: f}})
	}
	for _, part := range splitFinished(f, max) {
		if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Finished{Finished: part}}); err != nil {
			return err
		}
	}
	return nil
}

// finishedBound is at least f's encoded size (proto.Size), for a fraction
// of the work: each outcome counted at its strings' lengths and the most
// its other fields, tags and lengths take; each block id at 10 bytes.
func finishedBound(f *pb.Finished) int {
	const (
		outcome = 2*(1+5) + 2*(1+10) + (1 + 5) // two strings' tags and lengths, result, kind; its own tag and length
		stats   = 5*(1+10) + (1 + 8) + (1 + 5)
		ids     = 1 + 5
	)
	n := stats + ids + 10*len(f.InvalidBlockIds)
	for _, os := range [2][]*pb.Outcome{f.Sending, f.Recving} {
		n += len(os) * outcome
		for _, o := range os {
			n += len(o.GetRequestId()) + len(o.GetReason())
		}
	}
	return n
}

// splitFinished splits f into messages of about max bytes or less (one
// outcome bigger than max alone excepted), in order: sending outcomes,
// receiving outcomes, invalid block ids; the stats go with the first.
func splitFinished(f *pb.Finished, max int) []*pb.Finished {
	if proto.Size(f) <= max {
		return []*pb.Finished{f}
	}
	var out []*pb.Finished
	cur := &pb.Finished{Stats: f.Stats}
	size := proto.Size(cur)
	flush := func(add int) {
		if size+add > max && size > 0 && (len(cur.Sending)+len(cur.Recving)+len(cur.InvalidBlockIds) > 0) {
			out = append(out, cur)
			cur, size = &pb.Finished{}, 0
		}
		size += add
	}
	for _, o := range f.Sending {
		flush(proto.Size(o) + 8)
		cur.Sending = append(cur.Sending, o)
	}
	for _, o := range f.Recving {
		flush(proto.Size(o) + 8)
		cur.Recving = append(cur.Recving, o)
	}
	for _, id := range f.InvalidBlockIds {
		flush(6)
		cur.InvalidBlockIds = append(cur.InvalidBlockIds, id)
	}
	return append(out, cur)
}

// maxStepError bounds the message of a StepError.
const maxStepError = 64 << 10

// clip shortens an error message to maxStepError bytes.
func clip(msg string) string { return clipTo(msg, maxStepError) }

// clipTo shortens an error message to about n bytes.
func clipTo(msg string, n int) string {
	if len(msg) <= n {
		return msg
	}
	cut := n
	for cut > 0 && msg[cut]&0xC0 == 0x80 { // not inside a UTF-8 sequence
		cut--
	}
	return fmt.Sprintf("%s... (%d more bytes)", msg[:cut], len(msg)-cut)
}

// rank is one attached engine rank.
type rank struct {
	s      *Server
	engine string
	uid    uint32 // the engine process's, from the unix socket
	// maxMsg and maxErr bound a Finished message and a step error on the
	// stream (messageLimits of the hello's max_message_bytes).
	maxMsg, maxErr int
	claimed        bool // r.uid holds a claim on engine (owners)
	// entriesDone gives back the memory entries this rank counted
	// against the budgets (limits.admitEntries; nil: none).
	entriesDone func()
	layout      topology.Layout
	backend     Backend
	worker      *kvxfer.Worker
	// trace is the worker's hop trace (nil: off): the stream's sender
	// adds when outcomes leave on it.
	trace kvxfer.HopTracer
	// mappings: the shared-memory files of hello.memory, by entry (nil
	// for an entry that is not one).
	mappings []*shm.Mapping
	// gpu: imported CUDA IPC memory (device pointers), unmapped on detach.
	gpu   []gpuImport
	agent string
	// stats: the rank whose Metrics the worker records into (nil: none
	// acquired), released once the worker closed; statsBase: what they
	// held before the worker (its stream's TransferStats count from it).
	stats     *rankKey
	statsBase kvxfer.Stats
	// refs: the step_refs this stream handled (its receiver's alone).
	refs stepRefs
}

// stepRefs are the steps a rank's stream took in or dropped by reference
// (StepRef), the last maxPublished of them: its scheduler keeps no older
// step. A step_ref naming one of them again is not looked up again: one
// taken in is refused and ignored (taking it in again would give each of
// its requests a second outcome: a request whose transfer ended would be
// received or held anew, in blocks its engine freed), one dropped is
// dropped again (the engine failed its requests; it may have been
// published since).
type stepRefs struct {
	seen map[uint64]bool // step -> taken in (false: dropped)
	top  uint64
	// ids: the requests each dropped step of seen named (its step_ref's,
	// and its metadata's when read), by a hash of role and id, so that
	// one named again (the engine repeating the step) is not named twice;
	// nids: how many in all, at most maxNamedIDs (a dropped step whose ids
	// did not fit has none: its repeat names none).
	ids  map[uint64]map[uint64]struct{}
	nids int
	// forgot: every step up to it (and none after) that seen held has
	// been forgotten (0: none).
	forgot uint64
}

// forgotten reports whether step is one stepRefs may have forgotten: a
// step_ref for it is refused (the engine's steps come in order, so it is
// a repeat, or out of order): taken in then, its requests had their
// outcomes; dropped, the engine ended them.
func (s *stepRefs) forgotten(step uint64) bool {
	_, known := s.seen[step]
	return !known && s.forgot > 0 && step <= s.forgot
}

// maxNamedIDs bounds the request ids a rank's stepRefs remembers for its
// dropped steps (stepRefs.ids): 8 bytes each, and the maps' keep.
const maxNamedIDs = 1 << 16

// idKey is the key of a request of a role (send or not) in stepRefs.ids.
func idKey(send bool, id string) uint64 {
	var h maphash.Hash
	h.SetSeed(idSeed)
	if send {
		h.WriteByte('s')
	} else {
		h.WriteByte('r')
	}
	h.WriteString(id)
	return h.Sum64()
}

var idSeed = maphash.MakeSeed()

// named records the requests a dropped step names: ref's lists and
// meta's entries (either nil), as far as maxNamedIDs allows.
func (s *stepRefs) named(ref *pb.StepRef, meta *pb.StepMeta) {
	step := ref.GetStep()
	n := len(ref.GetRecvRequestIds()) + len(ref.GetSendRequestIds()) + len(meta.GetRecv()) + len(meta.GetSend())
	if n == 0 {
		return
	}
	if s.ids == nil {
		s.ids = map[uint64]map[uint64]struct{}{}
	}
	m, ok := s.ids[step]
	if ok && m == nil {
		return // not known already
	}
	if m == nil {
		m = map[uint64]struct{}{}
		s.ids[step] = m
	}
	add := func(send bool, id string) {
		if k := idKey(send, id); s.nids < maxNamedIDs {
			if _, ok := m[k]; !ok {
				m[k] = struct{}{}
				s.nids++
			}
		}
	}
	for _, id := range ref.GetRecvRequestIds() {
		add(false, id)
	}
	for _, id := range ref.GetSendRequestIds() {
		add(true, id)
	}
	for _, e := range meta.GetRecv() {
		add(false, e.GetRequestId())
	}
	for _, e := range meta.GetSend() {
		add(true, e.GetRequestId())
	}
	if s.nids >= maxNamedIDs {
		s.forget(step) // some did not fit: which is not known
		s.ids[step] = nil
	}
}

// forget drops what stepRefs.ids remembers of step.
func (s *stepRefs) forget(step uint64) {
	s.nids -= len(s.ids[step])
	delete(s.ids, step)
}

// unnamed returns ref (a repeat of a step the rank dropped) with only the
// requests its drop did not name, and records them as named now; whole
// is false when the drop's ids are not known (they did not fit
// maxNamedIDs): then none is named.
func (s *stepRefs) unnamed(ref *pb.StepRef) (_ *pb.StepRef, whole bool) {
	m, ok := s.ids[ref.GetStep()]
	if ok && m == nil {
		return &pb.StepRef{Step: ref.GetStep()}, false
	}
	out := &pb.StepRef{Step: ref.GetStep()}
	for _, id := range ref.GetRecvRequestIds() {
		if _, ok := m[idKey(false, id)]; !ok {
			out.RecvRequestIds = append(out.RecvRequestIds, id)
		}
	}
	for _, id := range ref.GetSendRequestIds() {
		if _, ok := m[idKey(true, id)]; !ok {
			out.SendRequestIds = append(out.SendRequestIds, id)
		}
	}
	s.named(out, nil)
	return out, true
}

// note records step as taken in or dropped.
func (s *stepRefs) note(step uint64, takenIn bool) {
	if s.seen == nil {
		s.seen = map[uint64]bool{}
	}
	s.seen[step] = takenIn
	s.top = max(s.top, step)
	if len(s.seen) > 2*maxPublished {
		for k := range s.seen {
			if k+maxPublished <= s.top {
				delete(s.seen, k)
				s.forget(k)
			}
		}
		s.forgot = max(s.forgot, s.top-maxPublished)
	}
}

type gpuImport struct {
	dev *cuda.Device
	ptr uint64
}

// MaxEngineID bounds an engine id's bytes: it labels every metric of the
// engine's ranks, and names the engine in handshakes and messages.
const MaxEngineID = 256

// attach validates a hello from engine process pid of uid and groups,
// maps the rank's memory (files uid owns only, through directories it may
// search; memory named by address only when pid is this process), starts
// its backend and worker, and publishes it for handshakes.
func (s *Server) attach(h *pb.WorkerHello, uid uint32, groups []uint32, pid int32) (_ *rank, err error) {
	if h.EngineId == "" {
		return nil, stream.Invalid("hello.engine_id is empty")
	}
	if len(h.EngineId) > MaxEngineID {
		return nil, stream.Invalid("hello.engine_id has %d bytes, want at most %d", len(h.EngineId), MaxEngineID)
	}
	if h.Mode != pb.Mode_MODE_PUSH && h.Mode != pb.Mode_MODE_PULL {
		return nil, stream.Invalid("hello.mode = %v, want push or pull", h.Mode)
	}
	if m := h.MaxMessageBytes; m != 0 && m < minClientMax {
		// Below it the daemon's messages (one outcome, one step error)
		// could not be kept within half of it: the engine's client would
		// refuse one and lose the stream, and every outcome with it.
		return nil, stream.Invalid("hello.max_message_bytes = %d, want 0 (%d) or at least %d", m, defaultClientMax, minClientMax)
	}
	l, err := stream.LayoutFromProto("hello.layout", h.Layout)
	if err != nil {
		return nil, err
	}
	if err := checkFirstLayer(h, &l); err != nil {
		return nil, err
	}
	r := &rank{s: s, engine: h.EngineId, layout: l, uid: uid}
	defer func() {
		if err != nil {
			r.release()
		}
	}()
	// An id reserved for another uid is refused before anything else
	// (its holder's gone scheduler is not reclaimed for this claim).
	if err := s.owners.check(h.EngineId, uid); err != nil {
		return nil, err
	}
	if err := s.owners.claim(h.EngineId, uid); err != nil {
		// Another uid's engine holds the id: not once its process is gone
		// (a scheduler it never closed would hold it for ever).
		if !s.sched.reclaimGone(h.EngineId) {
			return nil, err
		}
		if err := s.owners.claim(h.EngineId, uid); err != nil {
			return nil, err
		}
	}
	r.claimed = true
	if err := s.attached(h.EngineId, &l); err != nil {
		return nil, err
	}
	if err := s.rankPort(&l); err != nil {
		return nil, err
	}
	if len(h.Memory) == 0 {
		return nil, stream.Invalid("hello.memory is empty")
	}
	vram := isGPU(h.Memory[0])
	for i, m := range h.Memory {
		if err := checkInProcess(i, m, pid); err != nil {
			return nil, err
		}
		gpu := isGPU(m)
		switch {
		case gpu != vram:
			return nil, stream.Invalid("hello.memory[%d]: a rank's memory must be all host or all GPU memory", i)
		case gpu && !byAddress(m) && len(m.CudaIpcHandle) != len(cuda.Handle{}):
			return nil, stream.Invalid("hello.memory[%d].cuda_ipc_handle: %d bytes, want %d", i, len(m.CudaIpcHandle), len(cuda.Handle{}))
		case !gpu && m.GetPath() == "" && !byAddress(m), m.GetSize() == 0, m.Base+m.Size < m.Base:
			return nil, stream.Invalid("hello.memory[%d]: path %q, base %#x, size %d", i, m.GetPath(), m.GetBase(), m.GetSize())
		case !gpu && m.DeviceUuid != "":
			return nil, stream.Invalid("hello.memory[%d].device_uuid = %q on host memory (no cuda_ipc_handle, in_process not device)", i, m.DeviceUuid)
		}
		if m.DeviceUuid != "" {
			if _, err := cuda.ParseUUID(m.DeviceUuid); err != nil {
				return nil, fmt.Errorf("%w: hello.memory[%d].device_uuid: %w", stream.ErrInvalid, i, err)
			}
		}
	}
	// The entries this rank maps (files, IPC imports), within the
	// daemon's and the uid's budgets.
	mapped := 0
	for _, m := range h.Memory {
		if !byAddress(m) {
			mapped++
		}
	}
	if mapped > 0 {
		if r.entriesDone, err = s.limits.take(&s.limits.mem, uid, mapped); err != nil {
			return nil, fmt.Errorf("hello.memory: %w", err)
		}
	}
	// in[i]: the memory entry region i lies in, which it is relocated
	// into (entries whose addresses overlap may hold its start and not
	// all of it).
	in := make([]int, len(l.Regions))
	for i, reg := range l.Regions {
		end := reg.Base + uint64(reg.BlockLen)*uint64(reg.NumBlocks)
		in[i] = -1
		for j, m := range h.Memory {
			if reg.Base >= m.Base && end <= m.Base+m.Size {
				in[i] = j
				break
			}
		}
		if in[i] < 0 {
			return nil, stream.Invalid("hello.layout.regions[%d] [%#x, %#x) lies in no hello.memory entry", i, reg.Base, end)
		}
	}
	// Where each memory entry lives in this process.
	real := make([]uint64, len(h.Memory))
	r.mappings = make([]*shm.Mapping, len(h.Memory))
	devs := make([]*cuda.Device, len(h.Memory)) // GPU memory's devices
	// host: each host entry's bytes here.
	host := make([][]byte, len(h.Memory))
	for i, m := range h.Memory {
		switch m.InProcess {
		case pb.InProcessMemory_IN_PROCESS_MEMORY_HOST:
			if host[i], err = ownHostMemory(i, m); err != nil {
				return nil, err
			}
			real[i] = m.Base
			continue
		case pb.InProcessMemory_IN_PROCESS_MEMORY_DEVICE:
			dev, err := s.gpuOf(i, m)
			if err != nil {
				return nil, err
			}
			if err := ownDeviceMemory(i, m, dev); err != nil {
				return nil, err
			}
			devs[i], real[i] = dev, m.Base
			continue
		}
		if vram {
			dev, err := s.gpuOf(i, m)
			if err != nil {
				return nil, err
			}
			var hd cuda.Handle
			copy(hd[:], m.CudaIpcHandle)
			ptr, err := dev.Import(hd)
			if err != nil {
				return nil, stream.Invalid("hello.memory[%d].cuda_ipc_handle: %v", i, err)
			}
			// The import maps the exported allocation, whatever the engine
			// claims: a copy past its end would fault this process's
			// context on that GPU, every engine's of the daemon there.
			if n, err := dev.AllocSize(ptr); err == nil && m.Size > n {
				_ = dev.Unmap(ptr)
				return nil, stream.Invalid("hello.memory[%d].size %d: its cuda_ipc_handle exports an allocation of %d bytes", i, m.Size, n)
			}
			r.gpu = append(r.gpu, gpuImport{dev, ptr})
			devs[i], real[i] = dev, ptr
			continue
		}
		mp, err := shm.MapAs(s.cfg.ShmDir, m.Path, m.Size, shm.Cred{UID: uid, Groups: groups})
		switch {
		case errors.Is(err, shm.ErrRefused):
			return nil, fmt.Errorf("%w: hello.memory[%d]: %w", ErrPermission, i, err)
		case err != nil:
			return nil, stream.Invalid("hello.memory[%d]: %v", i, err)
		}
		r.mappings[i], host[i] = mp, mp.Bytes
		real[i] = realAddr(mp.Bytes)
	}
	// Relocate the layout to where the memory is here, so every backend
	// (NIXL included) sees real addresses; peers get the relocated layout.
	// The engine keeps talking in block ids.
	for i := range l.Regions {
		reg := &l.Regions[i]
		j := in[i]
		reg.Base = real[j] + (reg.Base - h.Memory[j].Base)
		if vram {
			// The device as this process numbers it: backends register the
			// imported memory with it, and peers get it.
			reg.DeviceID = int32(devs[j].Ordinal())
		}
	}
	r.layout = l
	// What a factory returns beside an error is not a backend: release
	// must not close it (it may be a nil pointer in a non-nil interface).
	be, err := s.cfg.NewBackend(h.EngineId, &l, vram)
	switch {
	case err != nil:
		return nil, fmt.Errorf("server: backend for %s rank tp %d pp %d: %w", h.EngineId, l.TPRank, l.PPRank, err)
	case be == nil:
		return nil, fmt.Errorf("server: backend for %s rank tp %d pp %d: the factory returned none", h.EngineId, l.TPRank, l.PPRank)
	}
	r.backend = be
	exported := map[uint64]bool{} // in-process GPU allocations mapped already
	for i, m := range h.Memory {
		var err error
		if im, ok := r.backend.(IPCMapper); ok && vram && byAddress(m) {
			// The built-in backend, GPU memory of this process: same-host
			// peers import the engine's own allocation by its IPC handle.
			err = mapOwnDevice(im, devs[i], m.Base, exported)
		} else if im, ok := r.backend.(IPCMapper); ok && vram {
			// The built-in backend: GPU memory moves on the same host only.
			var u [16]byte
			if u, err = devs[i].UUID(); err == nil {
				var hd [64]byte
				copy(hd[:], m.CudaIpcHandle)
				err = im.MapIPC(real[i], m.Size, cudaDevice{devs[i]}, u, hd)
			}
		} else if vram {
			dm, ok := r.backend.(DeviceMapper)
			if !ok {
				return nil, stream.Invalid("hello.memory: GPU memory needs a backend that moves it (kvxferd -backend=nixl, or the built-in backend between daemons of one host)")
			}
			err = dm.MapDevice(real[i], m.Size)
		} else if fm, ok := r.backend.(FileMapper); ok && r.mappings[i] != nil && r.mappings[i].File() != nil {
			err = fm.MapFile(real[i], r.mappings[i].Bytes, r.mappings[i].File(), 0)
		} else {
			err = r.backend.Map(real[i], host[i])
		}
		if err != nil {
			return nil, stream.Invalid("hello.memory[%d]: %v", i, err)
		}
	}
	// ContainPanics: a rank whose worker breaks fails its own requests and
	// ends its own stream (serve); the daemon's other ranks carry on.
	wc := kvxfer.WorkerConfig{EngineID: h.EngineId, Addr: s.cfg.PeerAddr, Mode: kvxfer.Mode(h.Mode), Layout: l,
		Backend: r.backend, Resolver: s.cfg.Resolver, CompatHash: h.CompatHash, Layerwise: h.Layerwise, FirstLayer: int(h.FirstLayer), Logger: s.log,
		ContainPanics: true, CheckAddr: s.checkAddr}
	if s.cfg.WorkerConfig != nil {
		s.cfg.WorkerConfig(&wc)
	}
	if wc.Metrics == nil {
		// The rank's own, which its next worker carries on (RankStats).
		r.stats = &rankKey{h.EngineId, l.PPRank, l.TPRank}
		wc.Metrics = s.stats.acquire(*r.stats)
	}
	r.statsBase = wc.Metrics.Snapshot()
	if r.worker, err = kvxfer.NewWorker(wc); err != nil {
		return nil, err
	}
	r.trace = wc.HopTrace
	meta, err := r.backend.LocalMetadata()
	if err != nil {
		return nil, err
	}
	if nb, ok := r.backend.(interface{ Name() kvxfer.PeerName }); ok {
		r.agent = string(nb.Name())
	}
	if err := s.publish(kvxfer.RankInfo{EngineID: h.EngineId, CompatHash: h.CompatHash, Layout: l, Agent: meta}, r.worker, r.backend); err != nil {
		return nil, err
	}
	s.log.Info("kvxferd: rank attached", "engine", h.EngineId, "tp_rank", l.TPRank, "pp_rank", l.PPRank, "regions", len(l.Regions), "uid", uid)
	return r, nil
}

// checkFirstLayer checks hello.first_layer against the layout: under
// separate K and V a later stage's first layer is not its region offset
// (an earlier stage's attention layers take two regions, its MLA or Mamba
// layers one), so layer-wise push from such a stage needs it; each
// earlier layer has one or two regions, which bounds it. Elsewhere the
// first layer is the region offset, and first_layer, if set, must say so.
func checkFirstLayer(h *pb.WorkerHello, l *topology.Layout) error {
	first, off := int(h.FirstLayer), l.RegionOffset
	switch {
	case first < 0:
		return stream.Invalid("hello.first_layer = %d, want >= 0", first)
	case l.Packing == topology.SeparateKV && off > 0:
		if first == 0 && h.Layerwise {
			return stream.Invalid("hello.first_layer = 0 with hello.layerwise, hello.layout.packing = %v and hello.layout.region_offset = %d "+
				"(pp_rank %d): a later pipeline stage whose K and V have regions of their own must say its first layer "+
				"(LayerSaved numbers layers from it)", l.Packing, off, l.PPRank)
		}
		if first != 0 && (first > off || 2*first < off) {
			return stream.Invalid("hello.first_layer = %d with hello.layout.region_offset = %d: the layers before it have "+
				"one or two regions each, so it is between %d and %d", first, off, (off+1)/2, off)
		}
	case first != 0 && first != off:
		return stream.Invalid("hello.first_layer = %d with hello.layout.packing = %v and hello.layout.region_offset = %d: "+
			"the first layer is the region offset there (0 or %d)", first, l.Packing, off, off)
	}
	return nil
}

// realAddr is the address of mapped memory in this process.
func realAddr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

// release frees what attach acquired, in reverse order.
func (r *rank) release() {
	if r.worker != nil {
		_ = r.worker.Close()
		if errors.Is(r.worker.Err(), kvxfer.ErrInternal) && r.s != nil {
			r.s.workerPanics.Add(1)
		}
	}
	if r.stats != nil {
		r.s.stats.release(*r.stats) // the worker closed: it counts no more
		r.stats = nil
	}
	if r.backend != nil {
		_ = r.backend.Close()
		if sp, ok := r.backend.(sameHostCounter); ok && r.s != nil {
			r.s.sameHostGone.Add(sp.SameHostParts())
		}
		if c, ok := r.backend.(oneSidedCounter); ok && r.s != nil {
			r.s.oneSidedGone.Add(c.OneSidedWrites())
		}
	}
	for _, m := range r.mappings {
		if m != nil {
			_ = m.Close()
		}
	}
	for _, g := range r.gpu {
		_ = g.dev.Unmap(g.ptr)
	}
	if r.entriesDone != nil {
		r.entriesDone()
	}
	if r.claimed {
		r.s.owners.release(r.engine)
		r.claimed = false
	}
}

// owners records the uid each engine id belongs to: that of the first of
// its ranks or its scheduler to arrive, for as long as any of them stays.
// Another uid's rank or scheduler for the engine is refused, so one user's
// engine cannot read, replace or close another's. An id reserved (the
// daemon's rules: Config.EngineOwners) may be claimed by its rule's uid
// only; the others are first come, first served.
type owners struct {
	reserved *reservations // nil: none (read only)
	mu       sync.Mutex
	m        map[string]*owner
}

// check refuses uid's claim of engine where the daemon's rules do not let
// uid use it (a *ReservedError); it changes nothing.
func (o *owners) check(engine string, uid uint32) error { return o.reserved.check(engine, uid) }

type owner struct {
	uid  uint32
	refs int
}

// claim records uid's claim of engine, refused where another uid holds
// it. Callers check the daemon's rules first (check), once per claim.
func (o *owners) claim(engine string, uid uint32) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if w := o.m[engine]; w != nil {
		if w.uid != uid {
			return fmt.Errorf("%w: engine %q belongs to uid %d for as long as any of its ranks or its scheduler stays (uid %d may not attach its ranks or use its scheduler; "+
				"engine ids no kvxferd -engine-owner rule reserves are first come, first served: use another one)",
				ErrPermission, engine, w.uid, uid)
		}
		w.refs++
		return nil
	}
	o.m[engine] = &owner{uid: uid, refs: 1}
	return nil
}

func (o *owners) release(engine string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if w := o.m[engine]; w != nil {
		if w.refs--; w.refs <= 0 {
			delete(o.m, engine)
		}
	}
}

// gpuOf returns the device of GPU memory entry i, m: the one with
// m.DeviceUuid when set (already validated), else ordinal m.Device as the
// engine numbers it (right only when the engine and kvxferd see the same
// CUDA_VISIBLE_DEVICES). No driver here, or no local GPU with that UUID,
// is an error wrapping cuda.ErrUnavailable or cuda.ErrNoDevice, which
// Status maps to FailedPrecondition.
func (s *Server) gpuOf(i int, m *pb.SharedMemory) (*cuda.Device, error) {
	s.gpuMu.Lock()
	defer s.gpuMu.Unlock()
	if m.DeviceUuid == "" {
		d, err := s.deviceLocked(int(m.Device))
		switch {
		case errors.Is(err, cuda.ErrUnavailable):
			return nil, fmt.Errorf("hello.memory[%d].device %d: %w", i, m.Device, err)
		case err != nil:
			return nil, stream.Invalid("hello.memory[%d].device %d: %v", i, m.Device, err)
		}
		return d, nil
	}
	u, err := cuda.ParseUUID(m.DeviceUuid)
	if err != nil {
		return nil, fmt.Errorf("%w: hello.memory[%d].device_uuid: %w", stream.ErrInvalid, i, err)
	}
	ordinal, ok := s.gpuUUIDs[u]
	if !ok {
		if ordinal, err = cuda.OrdinalOf(u); err != nil {
			return nil, fmt.Errorf("hello.memory[%d].device_uuid %q: %w", i, m.DeviceUuid, err)
		}
		if s.gpuUUIDs == nil {
			s.gpuUUIDs = map[[16]byte]int{}
		}
		s.gpuUUIDs[u] = ordinal
	}
	d, err := s.deviceLocked(ordinal)
	if err != nil {
		return nil, fmt.Errorf("hello.memory[%d].device_uuid %q (device %d here): %w", i, m.DeviceUuid, ordinal, err)
	}
	return d, nil
}

// deviceLocked returns CUDA device ordinal's context, opened once.
func (s *Server) deviceLocked(ordinal int) (*cuda.Device, error) {
	if d := s.gpus[ordinal]; d != nil {
		return d, nil
	}
	d, err := cuda.Open(ordinal)
	if err != nil {
		return nil, err
	}
	if s.gpus == nil {
		s.gpus = map[int]*cuda.Device{}
	}
	s.gpus[ordinal] = d
	return d, nil
}

func (r *rank) detach() {
	// Peers stop finding the rank at once; the engine's next hello for it
	// is refused until its Worker's close (the fence of what it moves) and
	// the release of its memory ended: an engine takes the rank attached
	// again as the word that nothing of the old one moves any more.
	left := r.s.unpublish(r.engine, &r.layout, r.worker)
	defer left()
	r.release()
	r.s.log.Info("kvxferd: rank detached", "engine", r.engine, "tp_rank", r.layout.TPRank, "pp_rank", r.layout.PPRank)
}

// waitToken waits until c (capacity one) holds a token, and leaves it
// there (idle); takeToken puts one in, waiting for room (handling). Each
// succeeds when it can at once, whether or not ctx ended (in one select a
// ready channel and an ended context are picked at random): false only
// when ctx ended while it could not.
func waitToken(ctx context.Context, c chan struct{}) bool {
	select {
	case <-c:
		c <- struct{}{}
		return true
	default:
	}
	select {
	case <-c:
		c <- struct{}{}
		return true
	case <-ctx.Done():
		return false
	}
}

// takeToken: see waitToken.
func takeToken(ctx context.Context, c chan struct{}) bool {
	select {
	case c <- struct{}{}:
		return true
	default:
	}
	select {
	case c <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// serve runs the stream: this goroutine receives; one goroutine sends.
func (r *rank) serve(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	ctx := st.Context()
	out := make(chan *pb.ConnectResponse, 16)
	sendErr := make(chan error, 1)
	stop := make(chan struct{})
	// idle holds a token while the sender is not sending: it takes it
	// across each message it sends, and the receiver waits for it before
	// handing the worker the next message. An engine that stops reading
	// its stream leaves the sender waiting in Send (gRPC's flow control),
	// and then the receiver, so the engine's own sends are held in turn:
	// the outcomes its steps make wait for it in the stream's bounded
	// windows, not piling up in the daemon (they did, every request's, for
	// as long as the engine went on sending).
	idle := make(chan struct{}, 1)
	idle <- struct{}{}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the one sender
		defer wg.Done()
		prev := r.statsBase // the rank's earlier workers' are not this stream's
		// What a Finished message is made of, reused from one to the next
		// (gRPC has encoded a message when Send returns): outcomes drained
		// and converted allocate nothing per request.
		var (
			f     kvxfer.Finished
			enc   stream.FinishedEncoder
			stats pb.TransferStats
		)
		for {
			var m *pb.ConnectResponse
			select {
			case <-r.worker.Ready():
				var t0 time.Time
				if r.trace != nil {
					t0 = time.Now()
				}
				f = r.worker.AppendFinished(f)
				fp := enc.Encode(&f)
				var moved bool
				if moved, prev = statsSince(&stats, r.worker.Metrics().Snapshot(), prev); moved {
					fp.Stats = &stats
				}
				<-idle
				err := sendFinished(st, r.maxMsg, fp)
				idle <- struct{}{}
				if r.trace != nil && err == nil {
					r.hopSent(&f, t0)
				}
				f.Clear()
				if err != nil {
					sendErr <- err
					return
				}
				continue
			case m = <-out:
			case <-stop:
				return
			}
			<-idle
			err := st.Send(m)
			idle <- struct{}{}
			if err != nil {
				sendErr <- err
				return
			}
		}
	}()
	// The one receiver hands steps and layer signals to the worker itself,
	// in order (a step goes to the worker without a hop through this
	// goroutine); what ends the stream (bye, a second hello, an empty
	// message) comes here, and it receives nothing after it.
	recvd := make(chan *pb.ConnectRequest)
	recvErr := make(chan error, 1)
	// handling holds a token while the receiver hands a message on;
	// finish takes it for good (the stream's end), draining out meanwhile,
	// so that what the receiver handled is answered before the stream
	// ends: a dropped step's error alone names its requests to the
	// engine. A message received after is not handled: the stream ended
	// before it.
	handling := make(chan struct{}, 1)
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			// A message received is handed on when the tokens are free,
			// also once the stream's context ended: an engine that crashed
			// right after sending a step (its connection closed at once)
			// had it received, and its consumer requests must reach the
			// worker, whose close tells their producers they end.
			// Before, a select between the free token and the ended
			// context dropped it half the time: the producer, told
			// nothing, held those blocks for their lease, and a producer
			// engine that crashed meanwhile waited for them, its close's
			// fence 10 s (the daemon soak's NIXL pull P crashes).
			// (Not while a send waits for the engine to read: idle.)
			if !waitToken(ctx, idle) || !takeToken(ctx, handling) {
				recvErr <- ctx.Err()
				return
			}
			if r.handle(ctx, m, out) {
				<-handling
				continue
			}
			<-handling
			select {
			case recvd <- m:
			case <-ctx.Done():
			}
			return
		}
	}()
	finish := func(graceful bool) error {
		if graceful {
			r.drain()
		}
		close(stop)
		wg.Wait()
		// What the receiver queued for the sender, and what it queues as
		// it ends the message at hand (handling), goes out first, on
		// every end of the stream but a failed send: the stopped sender
		// may have left it (its select takes the stop as readily as a
		// message), and it holds dropped steps' errors, which alone name
		// their requests to the engine (a worker that stopped on its own
		// drops every step after). The receiver handles nothing more.
		sendOK := true
		flush := func(m *pb.ConnectResponse) {
			if sendOK && st.Send(m) != nil {
				sendOK = false
			}
		}
	gate:
		for {
			select {
			case m := <-out:
				flush(m)
			case handling <- struct{}{}:
				break gate
			}
		}
		for range len(out) {
			flush(<-out)
		}
		if graceful {
			// Everything left, reported once, before the stream ends.
			_ = r.worker.Close()
			f := r.worker.Finished()
			if len(f.Sending)+len(f.Recving)+len(f.InvalidBlocks) > 0 {
				_ = sendFinished(st, r.maxMsg, stream.FinishedToProto(&f))
			}
		}
		return nil
	}
	for {
		select {
		case <-r.s.draining:
			return finish(true)
		case <-r.worker.Done():
			// The worker stopped on its own: it hit an internal error and
			// failed every request it held (kvxfer.WorkerConfig.ContainPanics).
			// The engine gets those outcomes, then the error; the daemon's
			// other ranks carry on.
			finish(false)
			_ = r.worker.Close()
			if f := r.worker.Finished(); len(f.Sending)+len(f.Recving)+len(f.InvalidBlocks) > 0 {
				_ = sendFinished(st, r.maxMsg, stream.FinishedToProto(&f))
			}
			err := cmp.Or(r.worker.Err(), kvxfer.ErrClosed)
			r.s.log.Error("kvxferd: a rank's worker stopped; its stream ends", "engine", r.engine, "tp_rank", r.layout.TPRank,
				"pp_rank", r.layout.PPRank, "err", err)
			return Status(err)
		case err := <-sendErr:
			finish(false)
			return Status(err)
		case err := <-recvErr:
			finish(false)
			if errors.Is(err, io.EOF) {
				return nil
			}
			return Status(err)
		case m := <-recvd:
			switch m.Msg.(type) {
			case *pb.ConnectRequest_Bye:
				return finish(true)
			case *pb.ConnectRequest_Hello:
				r.s.limits.refuse("bad_message")
				finish(false)
				return Status(stream.Invalid("hello sent twice on one stream"))
			default:
				r.s.limits.refuse("bad_message")
				finish(false)
				return Status(stream.Invalid("empty message"))
			}
		}
	}
}

// hopSent reports f's outcomes sent on the stream, by a wake of the
// sender, begun at t0, that drained, encoded and sent them.
func (r *rank) hopSent(f *kvxfer.Finished, t0 time.Time) {
	e := kvxfer.HopEvent{Hop: kvxfer.HopOutcomeSent, Engine: r.engine, TPRank: r.layout.TPRank, PPRank: r.layout.PPRank,
		Call: time.Since(t0), Began: t0}
	for _, o := range f.Sending {
		e.Side, e.PReq, e.Result = kvxfer.RoleProducer, o.ReqID, o.Result.String()
		r.trace.Hop(e)
	}
	e.PReq = ""
	for _, o := range f.Recving {
		e.Side, e.DReq, e.Result = kvxfer.RoleConsumer, o.ReqID, o.Result.String()
		r.trace.Hop(e)
	}
}

// handle hands a step (its metadata, or a published step it names) or a
// layer signal to the worker, a step's error to out, and reports whether m
// was one of them. A step the worker did not take in at all is reported
// dropped, naming its requests (those its step_ref lists and those its
// metadata names, when read): no outcome will come for them, and the
// engine fails them. Not named: a layer-wise producer the worker holds
// prefilling from an earlier step, which the lost step finished or
// aborted: the worker ends it, with its outcome (endHeld). One whose
// entries the worker refused in part is
// reported for the engine's log only: each refused entry's request gets
// its failed outcome from the worker.
func (r *rank) handle(ctx context.Context, m *pb.ConnectRequest, out chan<- *pb.ConnectResponse) bool {
	var (
		step    uint64
		err     error
		dropped bool
		ref     *pb.StepRef  // the step's reference (StepRef), for its requests
		meta    *pb.StepMeta // the step's metadata, when read, for its requests
	)
	apply := func(p *pb.StepMeta) {
		meta = p
		sm, bad, cerr := stream.StepEntriesFromProto(p)
		if cerr != nil {
			err, dropped = cerr, true
			return
		}
		// An entry that could not be read is refused alone, as one the
		// worker refuses: its request fails, the rest of the step runs.
		var refused []kvxfer.Refusal
		for _, b := range bad {
			refused = append(refused, b.Refusal)
		}
		err = r.worker.StepRefusing(sm, refused)
		// Step takes a step in, whatever it refuses of it, unless the
		// worker is closed.
		dropped = errors.Is(err, kvxfer.ErrClosed)
	}
	switch x := m.Msg.(type) {
	case *pb.ConnectRequest_Step:
		step = x.Step.GetStep()
		apply(x.Step)
	case *pb.ConnectRequest_StepRef:
		ref, step = x.StepRef, x.StepRef.GetStep()
		takenIn, again := r.refs.seen[step]
		switch {
		case again && takenIn:
			// Refused, not dropped: the step's requests have (or had)
			// the outcomes it took them to.
			r.s.limits.refuse("bad_step")
			err, ref = stream.Invalid("step_ref.step = %d: this rank took the step in already; the repeat is ignored", step), nil
		case again:
			// Its requests named when it was dropped are not named
			// again (a second outcome); others are, once.
			var whole bool
			ref, whole = r.refs.unnamed(ref)
			err, dropped = stream.Invalid("step_ref.step = %d: this rank dropped the step already", step), true
			if !whole {
				err = stream.Invalid("step_ref.step = %d: this rank dropped the step already, and no longer knows which requests it named then: "+
					"none is named again", step)
			}
		case r.refs.forgotten(step):
			// Refused, not dropped: named again, its requests would have
			// a second outcome.
			r.s.limits.refuse("bad_step")
			err, ref = stream.Invalid("step_ref.step = %d: older than the last %d steps this rank handled (the newest %d), which it no longer tracks: "+
				"a repeat, or out of order; ignored", step, maxPublished, r.refs.top), nil
		default:
			takenIn := false
			if p, perr := r.s.sched.published(ctx, r.worker.Done(), r.engine, r.uid, step); perr != nil {
				err, dropped = perr, true
			} else if apply(p); !dropped {
				takenIn = true
				// The requests the step does not stage fail on the worker,
				// after the step, as entries it refused: once each, and not
				// one it holds from an earlier step. Its error, which only
				// names them again, is not the engine's news: their
				// outcomes say why. (A worker closed meanwhile fails what it
				// holds and ends the stream.)
				if u := unstaged(step, ref, p); len(u) > 0 {
					if uerr := r.worker.StepRefusing(nil, u); errors.Is(uerr, kvxfer.ErrClosed) {
						// The worker closed after it took the step in:
						// the refusals reached no worker, so this error
						// names them, but for any the closed worker held
						// (its close ended each).
						err, dropped, meta = fmt.Errorf("step %d: the requests it does not stage could not be failed on the worker: %w", step, uerr), true, nil
						ref = unstagedRef(step, u)
					}
				}
			}
			r.refs.note(step, takenIn)
			if !takenIn {
				r.refs.named(ref, meta)
			}
		}
	case *pb.ConnectRequest_LayerSaved:
		// A layer the rank does not hold is the engine's mistake: told
		// (for its log) as a step error; nothing is dropped.
		step = x.LayerSaved.GetStep()
		if err = r.worker.LayerSaved(step, int(x.LayerSaved.GetLayer())); errors.Is(err, kvxfer.ErrClosed) {
			err = nil // as for a step: the stream ends
		}
	default:
		return false
	}
	if err == nil {
		return true
	}
	if dropped && !errors.Is(err, kvxfer.ErrClosed) && ctx.Err() == nil {
		// The engine's step refused whole (its entries refused alone
		// are counted by the worker, by field).
		r.s.limits.refuse("bad_step")
	}
	msg := clipTo(err.Error(), r.maxErr)
	errs := []*pb.StepError{{Step: step, Message: msg}}
	if dropped {
		// Whether the worker is closed or not: a closed one ended every
		// request it held, with its own outcome, which the error must not
		// repeat (endHeld).
		errs = r.droppedErrs(step, msg, ref, meta)
	}
	for _, e := range errs {
		select {
		case out <- &pb.ConnectResponse{Msg: &pb.ConnectResponse_StepError{StepError: e}}:
		case <-ctx.Done():
			return true
		}
	}
	return true
}

// droppedErrs is the error of a step the rank dropped (droppedStep), but
// for the requests whose outcome is the worker's (endHeld, recvsHeld).
func (r *rank) droppedErrs(step uint64, msg string, ref *pb.StepRef, meta *pb.StepMeta) []*pb.StepError {
	return droppedStep(step, msg, ref, meta, r.endHeld(step, msg, ref, meta), r.recvsHeld(ref, meta), r.maxErr)
}

// recvsHeld returns the consumer requests a dropped step names (its
// step_ref's receives, and its metadata's, when read) that the rank's
// worker holds, or held when it closed (Worker.RecvsHeld): the engine
// named each in an earlier step too, and the worker gives its outcome, so
// the dropped step's error leaves it out (told twice, the engine would
// free blocks a transfer may still fill at the first).
func (r *rank) recvsHeld(ref *pb.StepRef, meta *pb.StepMeta) []string {
	ids := append([]string(nil), ref.GetRecvRequestIds()...)
	for _, e := range meta.GetRecv() {
		ids = append(ids, e.GetRequestId())
	}
	held, _ := r.worker.RecvsHeld(ids)
	return held
}

// unstagedRef is a step_ref of step listing the requests of u (unstaged),
// by role.
func unstagedRef(step uint64, u []kvxfer.Refusal) *pb.StepRef {
	ref := &pb.StepRef{Step: step}
	for _, f := range u {
		if f.Role == kvxfer.RoleConsumer {
			ref.RecvRequestIds = append(ref.RecvRequestIds, f.ReqID)
		} else {
			ref.SendRequestIds = append(ref.SendRequestIds, f.ReqID)
		}
	}
	return ref
}

// endHeld hands the rank's worker the producer requests a dropped step
// names (its step_ref's sends, and its metadata's sends and aborts, when
// read) and returns those whose outcome is the worker's
// (Worker.StepDropped): the layer-wise producers it holds prefilling from
// an earlier step, which it ends, and any other it holds (a lease ends
// it); once the worker is closed, those it held then (its close ended
// them). A prefilling request has no lease: the finish or abort this step
// carried alone would have ended it, and without this it prefilled for
// ever, its blocks granted, with no outcome on the rank. Its outcome is
// the worker's (failed, once its WRITEs in flight end), so the dropped
// step's error leaves it out: the engine, which frees what that error
// names at once, would free blocks a WRITE still reads, then hear of it
// twice. Before, a step dropped because the worker was closed (after a
// contained panic, or as the rank left) named them all: the closed
// worker's outcome came too.
func (r *rank) endHeld(step uint64, msg string, ref *pb.StepRef, meta *pb.StepMeta) []string {
	ids := append([]string(nil), ref.GetSendRequestIds()...)
	for _, e := range meta.GetSend() {
		ids = append(ids, e.GetRequestId())
	}
	ids = append(ids, meta.GetNotProcessed()...)
	held, _ := r.worker.StepDropped(ids, fmt.Sprintf("step %d, which finished or aborted it, was dropped: %s", step, msg))
	return held
}

// unstaged returns, as refusals for the rank's worker, the requests a
// step_ref lists that its published metadata does not stage, each once
// (nil: none). The engine's Scheduler refused their calls (or never got
// them): the Step answer said so, but the engine may never read it (it is
// lost when the Steps stream breaks after the step was applied), and no
// worker outcome would come, so without these the engine would wait on
// them forever. No worker took them in with this step, so nothing of the
// step moves their blocks: the worker fails each at once (its blocks may
// be freed), unless it holds a request of that id from an earlier step,
// whose outcome is its own to give (the engine named it in two steps). (A
// layer-wise producer an earlier step's prefill entry holds prefilling is
// the exception: the refusal of its finish fails it there, once its
// WRITEs in flight end: it has no lease to end it otherwise.)
func unstaged(step uint64, ref *pb.StepRef, meta *pb.StepMeta) []kvxfer.Refusal {
	if len(ref.GetRecvRequestIds())+len(ref.GetSendRequestIds()) == 0 {
		return nil
	}
	reason := fmt.Sprintf("step %d does not stage it: the engine's scheduler refused its call, or never got it "+
		"(see the scheduler's error)", step)
	out := unstagedOf(nil, kvxfer.RoleConsumer, "step_ref.recv_request_ids", ref.GetRecvRequestIds(), meta.GetRecv(), reason)
	return unstagedOf(out, kvxfer.RoleProducer, "step_ref.send_request_ids", ref.GetSendRequestIds(), meta.GetSend(), reason)
}

// unstagedOf appends to dst a refusal of role for each of ids (once per
// id) that no entry of staged names; field is the list's, as counted.
func unstagedOf[E interface{ GetRequestId() string }](dst []kvxfer.Refusal, role kvxfer.Role, field string, ids []string,
	staged []E, reason string) []kvxfer.Refusal {
	if len(ids) == 0 {
		return dst
	}
	// seen: the ids staged or refused so far, in a set where scanning
	// would cost more (an id listed twice is refused once).
	var seen map[string]bool
	if len(ids)*(len(staged)+len(ids)) > 64 {
		seen = make(map[string]bool, len(staged)+len(ids))
		for _, e := range staged {
			seen[e.GetRequestId()] = true
		}
	}
	for i, id := range ids {
		found := seen[id]
		for j := 0; seen == nil && !found && j < len(staged); j++ {
			found = staged[j].GetRequestId() == id
		}
		for j := 0; seen == nil && !found && j < i; j++ {
			found = ids[j] == id
		}
		if found {
			continue
		}
		if seen != nil {
			seen[id] = true
		}
		dst = append(dst, kvxfer.Refusal{Role: role, ReqID: id, Field: field, Reason: reason})
	}
	return dst
}

// droppedStep is the error of a dropped step: its message and every
// request it names, each once, from its StepRef's lists (ref; nil: a step
// sent whole) and its metadata's entries (meta; nil: not read), but the
// sends and receives whose outcome is the rank's worker's (held: endHeld;
// heldRecv: recvsHeld), in as many StepErrors as keep the ids of each
// within about limit bytes.
func droppedStep(step uint64, msg string, ref *pb.StepRef, meta *pb.StepMeta, held, heldRecv []string, limit int) []*pb.StepError {
	cur := &pb.StepError{Step: step, Message: msg, Dropped: true}
	out := []*pb.StepError{cur}
	n := 0
	seen := map[string]bool{}
	for _, id := range held {
		seen["s"+id] = true
	}
	for _, id := range heldRecv {
		seen["r"+id] = true
	}
	add := func(send bool, id string) {
		k := "r" + id
		if send {
			k = "s" + id
		}
		if id == "" || seen[k] {
			return
		}
		seen[k] = true
		if n > 0 && n+len(id)+8 > limit {
			cur, n = &pb.StepError{Step: step, Dropped: true}, 0
			out = append(out, cur)
		}
		n += len(id) + 8 // the id, its tag and length, with room to spare
		if send {
			cur.SendRequestIds = append(cur.SendRequestIds, id)
		} else {
			cur.RecvRequestIds = append(cur.RecvRequestIds, id)
		}
	}
	for _, id := range ref.GetRecvRequestIds() {
		add(false, id)
	}
	for _, e := range meta.GetRecv() {
		add(false, e.GetRequestId())
	}
	for _, id := range ref.GetSendRequestIds() {
		add(true, id)
	}
	for _, e := range meta.GetSend() {
		add(true, e.GetRequestId())
	}
	return out
}

// drain waits until the rank holds no request, or DrainTimeout. What it
// waits for is logged (Warn) a second into it, and again if DrainTimeout
// runs out, as a closing worker logs what its close waits for
// (kvxfer.Worker.LogWaits). Before, a daemon's shutdown waited up to
// -drain-timeout saying nothing of which requests or peers held it.
func (r *rank) drain() {
	began := time.Now()
	deadline := began.Add(r.s.cfg.DrainTimeout)
	logAt := began.Add(time.Second)
	for {
		st, err := r.worker.State()
		if err != nil || st.Sends+st.Recvs+st.Handles == 0 {
			return
		}
		now := time.Now()
		if !now.Before(deadline) {
			_ = r.worker.LogWaits("kvxferd: a draining rank's -drain-timeout ran out; its worker closes, ending what it still waits for", began,
				"engine", r.engine, "tp_rank", r.layout.TPRank, "pp_rank", r.layout.PPRank)
			return
		}
		if !logAt.IsZero() && !now.Before(logAt) {
			_ = r.worker.LogWaits("kvxferd: a draining rank still waits", began, "engine", r.engine, "tp_rank", r.layout.TPRank, "pp_rank", r.layout.PPRank)
			logAt = time.Time{}
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// statsSince sets d to the transfer stats between prev and now, and
// returns whether a transfer ended in between and the snapshot to diff
// against next.
func statsSince(d *pb.TransferStats, now, prev kvxfer.Stats) (bool, kvxfer.Stats) {
	d.Transfers, d.FailedTransfers = now.Transfers-prev.Transfers, now.FailedTransfers-prev.FailedTransfers
	d.Bytes, d.Descriptors = now.TotalBytes-prev.TotalBytes, now.TotalDescriptors-prev.TotalDescriptors
	d.TransferSeconds, d.Expired = now.TransferSeconds.Sum-prev.TransferSeconds.Sum, now.ExpiredRequests-prev.ExpiredRequests
	return d.Transfers+d.FailedTransfers+d.Expired > 0, now
}
