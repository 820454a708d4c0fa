package nixl

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/kvxfer"

	"github.com/kvxfer/kvxfer/hotpath"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
)

// Config configures a NIXL backend.
type Config struct {
	// Name is the agent's unique name (required).
	Name string
	// Plugin is NIXL's transfer plugin (default "UCX").
	Plugin string
	// Params configure the plugin; with Debian's UCX 1.13 and shared
	// memory, set "ucx_error_handling_mode": "none". For a VRAM agent of
	// the UCX plugin, "num_threads" defaults to GPUThreads and
	// "split_batch_size" to GPUSplitBatch. New refuses UCX parameters the
	// plugin would misread or break on (checkParams).
	Params map[string]string
	// VRAM makes the agent move GPU memory (adopted with MapDevice).
	VRAM bool
	// PollInterval is how often notifications and transfers are polled
	// while a transfer is in flight, or a Worker awaits peer messages
	// (kvxfer.Awaiter) within 50 ms of activity (default
	// DefaultPollInterval); four times less often while a Worker awaits
	// within a second of activity; while a Worker awaits longer, or within
	// a second of activity, every millisecond; otherwise every 10 ms. NIXL
	// has no completion callback: each hop of a transfer (a registration
	// reaching P, P's WRITE ending, its notification reaching D) is seen
	// at the next poll, so this interval is paid up to three times per
	// transfer. One poller serves every Backend of the process, each at
	// its pace; its pauses under a millisecond are slept in nanosleep
	// (internal/finesleep): Go's timers would round them up to one.
	PollInterval time.Duration
	// ProgressDelay is how long NIXL's progress thread pauses between
	// rounds (default 100 µs, whole microseconds). Negative makes it spin:
	// the lowest latency where cores are to spare, but a whole core per
	// agent even when idle.
	ProgressDelay time.Duration
	// PostCost is the model by which a Worker with WorkerConfig.Prepared
	// picks, per request, a prepared or an on-the-fly post
	// (kvxfer.PostCoster); zero means DefaultPostCost. Set it where the
	// transport's cost per posted descriptor differs from UCX's over host
	// memory (RDMA, NVLink): see DefaultPostCost.
	PostCost kvxfer.PostCost
	// AnyVersion opens a NIXL library whose version is not one whose C
	// API this build declares (capi.SupportedVersions), or cannot be
	// told: undefined behaviour where the C API differs.
	AnyVersion bool
}

// ParseParams parses plugin parameters (Config.Params) written as
// key=value,... (kvxferd -nixl-params); an empty list is none. Spaces
// around keys and values are dropped (the plugin would take "num_threads "
// for another key than num_threads, and the GPU defaults would win over
// it); a key given twice is refused.
func ParseParams(list string) (map[string]string, error) {
	out := map[string]string{}
	for _, item := range strings.Split(list, ",") {
		if item = strings.TrimSpace(item); item == "" {
			continue
		}
		k, v, ok := strings.Cut(item, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" {
			return nil, fmt.Errorf("item %q, want key=value", item)
		}
		if _, twice := out[k]; twice {
			return nil, fmt.Errorf("item %q: key %q given twice", item, k)
		}
		out[k] = v
	}
	return out, nil
}

// progressDelay is the pause NIXL's progress thread gets: the default for
// 0, none (a spin) for a negative value.
func (cfg *Config) progressDelay() time.Duration {
	switch d := cfg.ProgressDelay; {
	case d == 0:
		return capi.DefaultProgressDelay
	case d < 0:
		return 0
	default:
		return d
	}
}

// Backend is a kvxfer.Backend on NVIDIA NIXL (internal/nixl). Memory is
// adopted with Map before Register, as with NetBackend, so a registration
// can never name memory the caller did not hand over. Its metadata
// carries its process's identity, and a peer on the same host is watched
// through a pidfd, because UCX over shared memory cannot report a dead
// peer (nixlpeer.go). It is safe for concurrent use.
type Backend struct {
	a      *capi.Agent
	cfg    Config
	events chan struct{}
	once   sync.Once
	// due is when the process's poller next polls this Backend (unix ns;
	// 0: at once); round serializes a poll round with Close (pollOut).
	due   atomic.Int64
	round struct {
		sync.Mutex
		out bool // taken out of the poller: no more rounds
	}
	// life is held shared by a call that makes or frees a NIXL handle
	// (a transfer, a prepared list) outside mu, and exclusively by Close:
	// every handle made before Close is in mu's maps when Close releases
	// them, and none is made or freed once the agent is destroyed.
	life sync.RWMutex
	// prep is held shared by PostPrepared from looking its lists up to
	// NIXL's return, and exclusively by ReleasePrepared while it frees
	// one: NIXL never gets a list handle already freed. (Order: life,
	// prep, mu.)
	prep sync.RWMutex
	mu   struct {
		sync.Mutex
		closed bool
		chunks [][2]uint64 // mapped memory: base, len
		xfers  map[kvxfer.XferID]*nixlXfer
		next   kvxfer.XferID
		preps  map[kvxfer.PrepID]nixlPrep
		nextP  kvxfer.PrepID
		inbox  []kvxfer.Notif
		busy   time.Time
		await  int                           // Workers awaiting peer messages (Awaiting)
		peers  map[kvxfer.PeerName]*peerLife // peers whose process is watched (nixlpeer.go)
		// metas are the loaded peers' NIXL metadata, to load again when
		// their connection broke (remake.go); remaking are the peers whose
		// connection is being made again, and remade when each was last.
		metas    map[kvxfer.PeerName][]byte
		remaking map[kvxfer.PeerName]error
		remadeAt map[kvxfer.PeerName]time.Time
	}
	// bg are the goroutines remaking connections (Close waits for them).
	bg sync.WaitGroup
}

type nixlXfer struct {
	x     capi.Xfer
	peer  kvxfer.PeerName
	state kvxfer.XferState
	err   error
	// releasing: a Release waits for the transfer to end (see Release).
	releasing bool
}

type nixlPrep struct {
	p    capi.Prepped
	peer kvxfer.PeerName // "" for a local list
	// entries are the list's (addr, len, dev): a local list's, to tell
	// it stale; a peer's, to prepare it again once the connection to
	// the peer is made again (remake.go).
	entries [][3]uint64
	// dead: p was freed (a remake could not prepare the list again);
	// stale says why.
	dead bool
	// stale says why a local list can no longer be posted: memory it
	// names was deregistered (NIXL's list keeps that registration).
	stale error
}

var _ kvxfer.Backend = (*Backend)(nil)

// ErrUnavailable is returned where NIXL's library cannot be loaded.
var ErrUnavailable = capi.ErrUnavailable

// GPUThreads is the UCX plugin's num_threads a VRAM agent gets unless its
// Params set one: with the plugin's default, one worker, an H100 moved
// 8,192 scattered 64 KiB pieces between two processes at 6-7 GB/s; with
// 4 (what vLLM's NixlConnector sets), 19-20 GB/s, and no slower at 256
// or 2,048 pieces (bench/RESULTS.md, issue 25's GPU table).
const GPUThreads = "4"

// GPUSplitBatch is the UCX plugin's split_batch_size a VRAM agent gets
// unless its Params set one: a transfer of at least that many descriptors
// is posted by all num_threads workers at once, a share each, instead of
// by the calling thread alone. Posting is what a GPU transfer of many
// pieces spends its time on (UCX's cuda_ipc queues a copy per piece: 2.2
// ms of a 256-piece WRITE's 2.8 on an H200 went in NIXL's post call), and
// the plugin's default (1,024 descriptors; 4,096 with SGL) splits none of
// vLLM's smaller transfers: 8 blocks of 32 layers are 256 descriptors. At
// 8,192 pieces four workers made a transfer 3-4x faster; the default
// takes that to transfers of 64 and more (16 a worker). A WRITE's
// notification still follows all of its shares.
const GPUSplitBatch = "64"

// GPUEngineConfig are the UCX settings a VRAM agent of the UCX plugin
// gets through the plugin's "engine_config" parameter (UCX's own names
// without the UCX_ prefix), each unless that parameter sets it already.
// CUDA_IPC_ENABLE_GET_ZCOPY=y: UCX disables READs over cuda_ipc on GPUs
// without an active NVLink (its "auto"), so a pull between two processes
// of such a GPU (one H100 or H200 alone, PCIe cards) fell back to an
// emulation over TCP: 0.09 GB/s on an H200 where WRITEs moved 19 GB/s
// (bench/RESULTS.md). A UCX_CUDA_IPC_ENABLE_GET_ZCOPY in the environment
// still decides: the setting is then left out (NIXL applies engine_config
// over the environment).
var GPUEngineConfig = []string{"CUDA_IPC_ENABLE_GET_ZCOPY=y"}

// withDefaults returns the plugin parameters an agent opens with: params,
// and for a VRAM agent of the UCX plugin num_threads=GPUThreads and
// split_batch_size=GPUSplitBatch unless params set them and
// GPUEngineConfig's settings added to engine_config
// unless it names them (a copy: the caller's map is not changed). For the
// UCX plugin, engine_config's settings may be separated by ';' as well as
// ',' (kvxferd -nixl-params is itself a comma-separated list): NIXL gets
// them comma-separated.
func withDefaults(plugin string, params map[string]string, vram bool) map[string]string {
	if plugin != "UCX" {
		return params
	}
	_, threads := params["num_threads"]
	_, split := params["split_batch_size"]
	ec, hasEC := params["engine_config"]
	var settings []string
	for _, kv := range strings.FieldsFunc(ec, func(r rune) bool { return r == ',' || r == ';' }) {
		if kv = strings.TrimSpace(kv); kv != "" {
			// UCX's names without its prefix (what ucp_config_modify takes).
			if k, v, ok := strings.Cut(kv, "="); ok && len(k) > 4 && strings.EqualFold(k[:4], "UCX_") {
				kv = k[4:] + "=" + v
			}
			settings = append(settings, kv)
		}
	}
	if vram {
		for _, d := range GPUEngineConfig {
			key, _, _ := strings.Cut(d, "=")
			if os.Getenv("UCX_"+key) != "" || slices.ContainsFunc(settings, func(kv string) bool {
				k, _, _ := strings.Cut(kv, "=")
				return strings.EqualFold(strings.TrimSpace(k), key)
			}) {
				continue // the user's: NIXL 1.5 would apply ours over the environment's
			}
			settings = append(settings, d)
		}
	}
	joined := strings.Join(settings, ",")
	if (!vram || threads && split) && joined == ec {
		return params
	}
	out := make(map[string]string, len(params)+3)
	for k, v := range params {
		out[k] = v
	}
	if vram && !threads {
		out["num_threads"] = GPUThreads
	}
	if vram && !split {
		out["split_batch_size"] = GPUSplitBatch
	}
	if joined != "" || hasEC {
		out["engine_config"] = joined
	}
	return out
}

// ucxCounts are the UCX plugin's numeric parameters (unsigned ints in the
// plugin), each with the least and most checkParams lets through:
// split_batch_size 0 made the plugin divide by zero (SIGFPE) at a
// transfer of fewer descriptors than num_threads, and each of
// num_threads and num_workers is a UCX worker (a thread, for
// num_threads) that the plugin makes when the agent opens.
var ucxCounts = map[string][2]uint64{
	"num_threads":             {0, maxUCXWorkers},
	"num_workers":             {0, maxUCXWorkers},
	"split_batch_size":        {1, math.MaxUint32},
	"ucx_num_device_channels": {0, math.MaxUint32},
}

// maxUCXWorkers bounds num_threads and num_workers (4 is what a GPU
// agent gets: GPUThreads).
const maxUCXWorkers = 256

// checkParams refuses plugin parameters that the UCX plugin would take
// badly, naming the key and the value: numbers it would misread or that
// break it (ucxCounts) and an unknown ucx_error_handling_mode. Other
// keys, and other plugins' parameters, are NIXL's to judge.
func checkParams(plugin string, params map[string]string) error {
	if plugin != "UCX" {
		return nil
	}
	for _, k := range slices.Sorted(maps.Keys(params)) {
		v := params[k]
		if r, ok := ucxCounts[k]; ok {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil || n < r[0] || n > r[1] {
				return fmt.Errorf("kvxfer: nixl plugin UCX parameter %s=%q: want a whole number from %d to %d", k, v, r[0], r[1])
			}
		}
		if k == "ucx_error_handling_mode" && v != "none" && v != "peer" {
			return fmt.Errorf("kvxfer: nixl plugin UCX parameter %s=%q: want none or peer", k, v)
		}
	}
	return nil
}

// New opens a NIXL agent.
func New(cfg Config) (*Backend, error) {
	if cfg.Name == "" {
		return nil, errors.New("kvxfer: Config.Name is empty")
	}
	if cfg.Plugin == "" {
		cfg.Plugin = "UCX"
	}
	cfg.Params = withDefaults(cfg.Plugin, cfg.Params, cfg.VRAM)
	if err := checkParams(cfg.Plugin, cfg.Params); err != nil {
		return nil, err
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	a, err := capi.OpenConfig(capi.Config{Name: cfg.Name, Plugin: cfg.Plugin, Params: cfg.Params, VRAM: cfg.VRAM, AnyVersion: cfg.AnyVersion,
		ProgressDelay: cfg.progressDelay()})
	if err != nil {
		return nil, err
	}
	n := &Backend{a: a, cfg: cfg, events: make(chan struct{}, 1)}
	n.mu.xfers = map[kvxfer.XferID]*nixlXfer{}
	n.mu.preps = map[kvxfer.PrepID]nixlPrep{}
	n.mu.peers = map[kvxfer.PeerName]*peerLife{}
	n.mu.metas = map[kvxfer.PeerName][]byte{}
	n.mu.remaking = map[kvxfer.PeerName]error{}
	n.mu.remadeAt = map[kvxfer.PeerName]time.Time{}
	nixlOpened(a.Name())
	polls.add(n)
	return n, nil
}

// Name returns the agent's name (its kvxfer.PeerName at peers).
func (n *Backend) Name() kvxfer.PeerName { return kvxfer.PeerName(n.a.Name()) }

// Map adopts caller-owned memory at base for registration.
func (n *Backend) Map(base uint64, mem []byte) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(mem) == 0 || base+uint64(len(mem)) < base {
		return fmt.Errorf("kvxfer: nixl map %#x +%d: empty or wrapping", base, len(mem))
	}
	n.mu.chunks = append(n.mu.chunks, [2]uint64{base, uint64(len(mem))})
	return nil
}

// MapDevice adopts GPU memory (a device pointer, e.g. imported from a
// CUDA IPC handle) of size bytes at base for registration.
func (n *Backend) MapDevice(base, size uint64) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if size == 0 || base+size < base {
		return fmt.Errorf("kvxfer: nixl map device %#x +%d: empty or wrapping", base, size)
	}
	n.mu.chunks = append(n.mu.chunks, [2]uint64{base, size})
	return nil
}

func (n *Backend) mappedLocked(r kvxfer.MemRegion) bool {
	for _, c := range n.mu.chunks {
		if r.Addr >= c[0] && r.Addr-c[0] <= c[1] && r.Len <= c[1]-(r.Addr-c[0]) {
			return true
		}
	}
	return false
}

func nixlErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, capi.ErrClosed):
		return fmt.Errorf("%w: %w", kvxfer.ErrClosed, err)
	}
	return err
}

func (n *Backend) regions(rs []kvxfer.MemRegion) ([][3]uint64, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.closed {
		return nil, kvxfer.ErrClosed
	}
	out := make([][3]uint64, len(rs))
	for i, r := range rs {
		if r.Len == 0 || !n.mappedLocked(r) {
			return nil, fmt.Errorf("kvxfer: nixl region %d [%#x, +%d): not mapped", i, r.Addr, r.Len)
		}
		out[i] = [3]uint64{r.Addr, r.Len, uint64(max(r.Dev, 0))}
	}
	return out, nil
}

// Register implements kvxfer.Backend.
func (n *Backend) Register(rs []kvxfer.MemRegion) error {
	t, err := n.regions(rs)
	if err != nil {
		return err
	}
	return nixlErr(n.a.Register(t))
}

// Deregister implements kvxfer.Backend. Local prepared lists that name
// the memory become stale: a list keeps the registration it was prepared
// with, which NIXL frees here, so posting one would move bytes of memory
// no longer registered (PostPrepared refuses it; ReleasePrepared still
// frees it). No PostPrepared runs meanwhile (prep).
func (n *Backend) Deregister(rs []kvxfer.MemRegion) error {
	t, err := n.regions(rs)
	if err != nil {
		return err
	}
	n.life.RLock()
	defer n.life.RUnlock()
	n.prep.Lock()
	defer n.prep.Unlock()
	if err := n.a.Deregister(t); err != nil {
		return fmt.Errorf("%w: %w", kvxfer.ErrNotRegistered, nixlErr(err))
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for id, p := range n.mu.preps {
		if p.peer != "" || p.stale != nil {
			continue
		}
		for i, e := range p.entries {
			if r := slices.IndexFunc(t, func(r [3]uint64) bool { return e[0] < r[0]+r[1] && r[0] < e[0]+e[1] }); r >= 0 {
				p.stale = fmt.Errorf("prepared list %d entry %d [%#x, +%d): region %d [%#x, +%d) was deregistered after the list was prepared: %w",
					id, i, e[0], e[1], r, t[r][0], t[r][1], kvxfer.ErrNotRegistered)
				p.entries = nil
				n.mu.preps[id] = p
				break
			}
		}
	}
	return nil
}

// LocalMetadata implements kvxfer.Backend: NIXL's metadata, behind this
// process's identity where it has one, and a check of both (peer.go).
func (n *Backend) LocalMetadata() ([]byte, error) {
	b, err := n.a.Metadata()
	if err != nil {
		return nil, nixlErr(err)
	}
	if id, ok := selfProc(); ok {
		b = wrapMeta(id, b)
	}
	return sealMeta(b), nil
}

// LoadPeer implements kvxfer.Backend. A peer on this host, in this pid
// namespace, is watched: once its process exits, posts and notifications
// to it fail (nixlpeer.go).
func (n *Backend) LoadPeer(meta []byte) (kvxfer.PeerName, error) {
	meta, err := unsealMeta(meta)
	if err != nil {
		return "", err
	}
	id, ok, raw := unwrapMeta(meta)
	s, err := n.a.LoadPeer(raw)
	if err != nil {
		return "", fmt.Errorf("%w: %w", kvxfer.ErrBadMetadata, nixlErr(err))
	}
	name := kvxfer.PeerName(s)
	var w *peerLife
	if ok {
		w = watchPeer(name, id)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.mu.closed {
		n.mu.metas[name] = raw
	}
	n.mu.peers[name].close()
	delete(n.mu.peers, name)
	if w != nil {
		if n.mu.closed {
			w.close()
		} else {
			n.mu.peers[name] = w
		}
	}
	return name, nil
}

// InvalidatePeer implements kvxfer.Backend. Transfers to the peer still
// in flight are first waited for, all within one releaseWait: once NIXL
// has forgotten a peer it says its transfers were not found without asking
// UCX, which goes on moving their bytes, so the Worker would report their
// requests, and the engine reuse the blocks, while bytes still land
// (TestInvalidatePeerInFlight). The peer's process stays watched meanwhile,
// so that transfers to a peer that died end as failed instead of holding
// the call for releaseWait. Where some have not ended by then, the peer is
// forgotten all the same, they are counted as released in flight, and the
// error says so.
func (n *Backend) InvalidatePeer(peer kvxfer.PeerName) error {
	n.mu.Lock()
	var waitErr error
	if left := n.quietLocked(func(x *nixlXfer) bool { return x.peer == peer }, time.Now().Add(releaseWait)); left > 0 {
		releasedInFlight.Add(uint64(left))
		waitErr = fmt.Errorf("invalidate peer %s: %d transfers still in flight after %v: NIXL may still move their bytes", peer, left, releaseWait)
	}
	n.mu.peers[peer].close()
	delete(n.mu.peers, peer)
	n.mu.Unlock()
	// A remake of the peer's connection under way ends first, or sees
	// the peer forgotten (it would load it again behind this call).
	n.prep.Lock()
	defer n.prep.Unlock()
	n.mu.Lock()
	delete(n.mu.metas, peer)
	delete(n.mu.remadeAt, peer)
	n.mu.Unlock()
	if err := n.a.InvalidatePeer(string(peer)); err != nil {
		return fmt.Errorf("%w: %w", kvxfer.ErrUnknownPeer, nixlErr(err))
	}
	return waitErr
}

// quietLocked waits (mu held, let go between polls) until no transfer
// that match picks is in flight, or the deadline passed; it returns how
// many still are. Transfers are looked up afresh after each pause: one
// released meanwhile is gone from the map, and its handle is never polled
// again. settleLocked asks NIXL, and whether the peer's process is gone,
// so a transfer to a peer that died ends as failed instead of holding
// the wait to its deadline.
func (n *Backend) quietLocked(match func(*nixlXfer) bool, deadline time.Time) int {
	for wait := 20 * time.Microsecond; ; wait = min(2*wait, 2*time.Millisecond) {
		left := 0
		for _, x := range n.mu.xfers {
			if !match(x) || x.state != kvxfer.XferInProgress || n.mu.closed {
				continue
			}
			done, err := n.a.State(x.x)
			if n.settleLocked(x, done, err); x.state == kvxfer.XferInProgress {
				left++
			}
		}
		if left == 0 || time.Now().After(deadline) {
			return left
		}
		n.mu.Unlock()
		time.Sleep(wait)
		n.mu.Lock()
	}
}

func (n *Backend) peerGoneLocked(peer kvxfer.PeerName) error {
	if p := n.mu.peers[peer]; p.gone() {
		return p.err()
	}
	return nil
}

// Post implements kvxfer.Backend: one C call per transfer.
func (n *Backend) Post(op hotpath.Op, peer kvxfer.PeerName, descs []hotpath.Desc, notif []byte) (kvxfer.XferID, error) {
	if op != hotpath.OpWrite && op != hotpath.OpRead {
		return 0, fmt.Errorf("kvxfer: post op %v", op)
	}
	t := make([][3]uint64, len(descs))
	var devs [][2]uint64 // each descriptor's devices; nil: all 0
	for i, d := range descs {
		// NIXL's own check lets a range whose end wraps past 2^64
		// through, and UCX then writes to a wild address (seen with
		// UCX over TCP: a segfault). Such a range is refused here.
		if d.Len == 0 || d.Local+d.Len < d.Local || d.Remote+d.Len < d.Remote {
			return 0, fmt.Errorf("desc %d [%#x -> %#x, +%d): %w", i, d.Local, d.Remote, d.Len, kvxfer.ErrOutOfBounds)
		}
		t[i] = [3]uint64{d.Local, d.Remote, d.Len}
		if devs == nil && (d.LocalDev > 0 || d.RemoteDev > 0) {
			devs = make([][2]uint64, len(descs))
		}
		if devs != nil {
			devs[i] = [2]uint64{uint64(max(d.LocalDev, 0)), uint64(max(d.RemoteDev, 0))}
		}
	}
	if err := n.usable(peer); err != nil {
		return 0, err
	}
	n.life.RLock()
	defer n.life.RUnlock()
	n.prep.RLock() // no remake of the peer's connection under way
	defer n.prep.RUnlock()
	// NIXL finds each descriptor's registered memory by device and
	// address (as Register and Prepare name them).
	x, err := n.a.PostDevs(op == hotpath.OpWrite, string(peer), t, devs, notif)
	if err != nil {
		n.broke(peer, err)
		return 0, fmt.Errorf("%w: %w", kvxfer.ErrXferFailed, lostErr(err))
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.mu.next++
	n.mu.xfers[n.mu.next] = &nixlXfer{x: x, peer: peer, state: kvxfer.XferInProgress}
	n.mu.busy = time.Now()
	n.woken()
	return n.mu.next, nil
}

// State implements kvxfer.Backend.
func (n *Backend) State(id kvxfer.XferID) (kvxfer.XferState, error) {
	// NIXL calls on a transfer happen under mu, so Release can never free
	// a request another goroutine is polling.
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.closed {
		return kvxfer.XferFailed, fmt.Errorf("transfer %d: %w: %w", id, kvxfer.ErrXferFailed, kvxfer.ErrClosed)
	}
	x := n.mu.xfers[id]
	if x == nil {
		return 0, fmt.Errorf("transfer %d: %w", id, kvxfer.ErrUnknownXfer)
	}
	if x.state == kvxfer.XferInProgress {
		done, err := n.a.State(x.x)
		n.settleLocked(x, done, err)
	}
	return x.state, x.err
}

// settleLocked records what NIXL said of an in-progress transfer. An
// error from NIXL is final, and may come while parts of the transfer
// still move: with the UCX plugin's split_batch_size, a transfer split
// over num_threads workers fails as soon as one part's connection does,
// while its other parts' bytes go on landing (measured: 640 pages of a 64 MiB WRITE of 4 KiB pieces, split
// over 4 workers over TCP, landed after NIXL said it failed). NIXL keeps
// no handle to wait on for them, so neither State nor Release can.
func (n *Backend) settleLocked(x *nixlXfer, done bool, err error) {
	switch {
	case err != nil:
		x.state, x.err = kvxfer.XferFailed, fmt.Errorf("%w: %w", kvxfer.ErrXferFailed, err)
		n.brokeLocked(x.peer, err, true)
	case done:
		x.state = kvxfer.XferDone
	default:
		// Over UCX's shared memory nothing ends a transfer to a
		// dead peer: its process's exit does.
		if err := n.peerGoneLocked(x.peer); err != nil {
			x.state, x.err = kvxfer.XferFailed, err
		}
	}
}

// tryState is State for the poller: ok is false, and nothing asked,
// where another call holds the Backend or its agent.
func (n *Backend) tryState(id kvxfer.XferID) (s kvxfer.XferState, ok bool) {
	if !n.mu.TryLock() {
		return 0, false
	}
	defer n.mu.Unlock()
	x := n.mu.xfers[id]
	if x == nil {
		return 0, true
	}
	if x.state == kvxfer.XferInProgress {
		done, asked, err := n.a.TryState(x.x)
		if !asked {
			return x.state, false
		}
		n.settleLocked(x, done, err)
	}
	return x.state, true
}

// Telemetry implements kvxfer.Telemeter with NIXL's own figures.
func (n *Backend) Telemetry(id kvxfer.XferID) (kvxfer.XferTelemetry, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	x := n.mu.xfers[id]
	if x == nil || x.state != kvxfer.XferDone {
		return kvxfer.XferTelemetry{}, false
	}
	t, ok := n.a.Telemetry(x.x)
	return kvxfer.XferTelemetry{Post: t.Post, Transfer: t.Transfer, Bytes: t.Bytes, Descs: t.Descs}, ok
}

var _ kvxfer.Telemeter = (*Backend)(nil)

var _ kvxfer.PreparedPoster = (*Backend)(nil)

// Prepare implements kvxfer.PreparedPoster.
func (n *Backend) Prepare(peer kvxfer.PeerName, entries []hotpath.Entry) (kvxfer.PrepID, error) {
	t := make([][3]uint64, len(entries))
	for i, e := range entries {
		if e.Len == 0 || e.Addr+e.Len < e.Addr {
			return 0, fmt.Errorf("prepared entry %d [%#x, +%d): %w", i, e.Addr, e.Len, kvxfer.ErrOutOfBounds)
		}
		t[i] = [3]uint64{e.Addr, e.Len, uint64(max(e.Dev, 0))}
	}
	if peer != "" {
		if err := n.usable(peer); err != nil {
			return 0, err
		}
	}
	n.life.RLock()
	defer n.life.RUnlock()
	n.prep.RLock() // a remake of the peer's connection sees every list of it
	defer n.prep.RUnlock()
	p, err := n.a.Prepare(string(peer), t)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", kvxfer.ErrXferFailed, nixlErr(err))
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.mu.nextP++
	np := nixlPrep{p: p, peer: peer, entries: t}
	n.mu.preps[n.mu.nextP] = np
	return n.mu.nextP, nil
}

// PostPrepared implements kvxfer.PreparedPoster.
func (n *Backend) PostPrepared(op hotpath.Op, local, remote kvxfer.PrepID, pairs []hotpath.IndexPair, notif []byte) (kvxfer.XferID, error) {
	n.life.RLock()
	defer n.life.RUnlock()
	n.prep.RLock()
	defer n.prep.RUnlock()
	n.mu.Lock()
	closed := n.mu.closed
	lp, lok := n.mu.preps[local]
	rp, rok := n.mu.preps[remote]
	gone := n.peerGoneLocked(rp.peer)
	if gone == nil {
		gone = n.remakingLocked(rp.peer)
	}
	n.mu.Unlock()
	if testHookPostPrepared != nil {
		testHookPostPrepared()
	}
	if closed {
		return 0, fmt.Errorf("kvxfer: post prepared: %w", kvxfer.ErrClosed)
	}
	if !lok || !rok {
		return 0, fmt.Errorf("kvxfer: post prepared: unknown list %d or %d", local, remote)
	}
	if gone != nil {
		return 0, gone
	}
	if lp.stale != nil {
		return 0, fmt.Errorf("kvxfer: post prepared: %w", lp.stale)
	}
	if rp.stale != nil {
		return 0, fmt.Errorf("kvxfer: post prepared: %w", rp.stale)
	}
	// An IndexPair is two int32s, as a [2]int32 is: the pairs go to the
	// binding as they are, not copied.
	idx := unsafe.Slice((*[2]int32)(unsafe.Pointer(unsafe.SliceData(pairs))), len(pairs))
	x, err := n.a.PostPrepared(op == hotpath.OpWrite, lp.p, rp.p, idx, notif)
	if err != nil {
		n.broke(rp.peer, err)
		return 0, fmt.Errorf("%w: %w", kvxfer.ErrXferFailed, lostErr(err))
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.mu.next++
	n.mu.xfers[n.mu.next] = &nixlXfer{x: x, peer: rp.peer, state: kvxfer.XferInProgress}
	n.mu.busy = time.Now()
	n.woken()
	return n.mu.next, nil
}

// testHookPostPrepared, when set, runs in PostPrepared between looking
// its lists up and handing them to NIXL (tests).
var testHookPostPrepared func()

// An IndexPair must stay laid out as a [2]int32 (PostPrepared).
var _ = [1]struct{}{}[unsafe.Sizeof(hotpath.IndexPair{})-unsafe.Sizeof([2]int32{})]

// DefaultPostCost is what a post cost through NIXL 1.5.1 (nixl-cu12) and
// UCX between host-memory agents (UCX's cma transport: a system call per
// descriptor) on the development machine (2 cores of an AMD EPYC;
// bench/results/nixl-prepared.md). Request creation (internal/nixl's
// BenchmarkMake): create_xfer_req about 3 µs + 40 ns per descriptor,
// make_xfer_req about 1.3 µs + 20.5 ns per index pair. Posting
// (BenchmarkStart): about 20 µs + 2 µs per descriptor either way,
// which dominates: here a prepared post wins only where coalescing
// saves (almost) nothing, as with scattered blocks.
var DefaultPostCost = kvxfer.PostCost{
	Fixed:         23 * time.Microsecond,
	PerDesc:       2040 * time.Nanosecond,
	PreparedFixed: 21300 * time.Nanosecond,
	PerPair:       2020 * time.Nanosecond,
}

// PostCost implements kvxfer.PostCoster: Config.PostCost, or
// DefaultPostCost.
func (n *Backend) PostCost() kvxfer.PostCost {
	if n.cfg.PostCost == (kvxfer.PostCost{}) {
		return DefaultPostCost
	}
	return n.cfg.PostCost
}

var _ kvxfer.PostCoster = (*Backend)(nil)

// PreparedLists returns how many prepared lists the backend holds.
func (n *Backend) PreparedLists() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.mu.preps)
}

// ReleasePrepared implements kvxfer.PreparedPoster.
func (n *Backend) ReleasePrepared(id kvxfer.PrepID) error {
	n.life.RLock()
	defer n.life.RUnlock()
	n.prep.Lock() // the posts of it under way end first
	defer n.prep.Unlock()
	n.mu.Lock()
	closed := n.mu.closed
	p, ok := n.mu.preps[id]
	delete(n.mu.preps, id)
	n.mu.Unlock()
	if closed {
		return fmt.Errorf("kvxfer: release prepared list %d: %w", id, kvxfer.ErrClosed)
	}
	if !ok {
		return fmt.Errorf("kvxfer: release prepared list %d: unknown", id)
	}
	if p.dead {
		return nil
	}
	return nixlErr(n.a.Unprepare(p.p))
}

// releaseWait bounds how long Release waits for a transfer in flight to
// end (a variable for tests). UCX ends a transfer to a peer that died or
// hung with an error well within it.
var releaseWait = 30 * time.Second

// releasedInFlight counts the transfers released while NIXL still moved
// them (releaseWait passed).
var releasedInFlight atomic.Uint64

// ReleasedInFlight returns how many transfers this process released while
// they were still in flight, their bytes possibly still moving.
func ReleasedInFlight() uint64 { return releasedInFlight.Load() }

// Release implements kvxfer.Backend. A transfer still in flight is first
// waited for: NIXL's release of one returns at once while UCX goes on
// moving its bytes, into blocks the engine reuses once the Worker reports
// the request (TestReleaseInFlightStops). Where it has not ended after
// releaseWait, it is released all the same, counted, and the error says
// so.
func (n *Backend) Release(id kvxfer.XferID) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.closed {
		return fmt.Errorf("release transfer %d: %w", id, kvxfer.ErrClosed)
	}
	x := n.mu.xfers[id]
	if x == nil || x.releasing {
		return fmt.Errorf("release transfer %d: %w", id, kvxfer.ErrUnknownXfer)
	}
	var waitErr error
	x.releasing = true // no other Release frees it while this one waits
	if n.quietLocked(func(y *nixlXfer) bool { return y == x }, time.Now().Add(releaseWait)) > 0 {
		releasedInFlight.Add(1)
		waitErr = fmt.Errorf("release transfer %d: still in flight after %v: NIXL may still move its bytes", id, releaseWait)
	}
	if n.mu.closed { // Close released it meanwhile
		return fmt.Errorf("release transfer %d: %w", id, kvxfer.ErrClosed)
	}
	delete(n.mu.xfers, id)
	if err := nixlErr(n.a.Release(x.x)); err != nil {
		return err
	}
	return waitErr
}

// Notify implements kvxfer.Backend.
func (n *Backend) Notify(peer kvxfer.PeerName, msg []byte) error {
	if err := n.usable(peer); err != nil {
		return fmt.Errorf("notify %s: %w", peer, err)
	}
	if err := n.a.Notify(string(peer), msg); err != nil {
		n.broke(peer, err)
		return fmt.Errorf("notify %s: %w", peer, lostErr(err))
	}
	n.mu.Lock()
	n.mu.busy = time.Now() // an answer may come soon (hotPoll)
	n.mu.Unlock()
	return nil
}

// DrainNotifs implements kvxfer.Backend.
func (n *Backend) DrainNotifs(dst []kvxfer.Notif) []kvxfer.Notif {
	n.pull()
	n.mu.Lock()
	defer n.mu.Unlock()
	dst = append(dst, n.mu.inbox...)
	clear(n.mu.inbox) // the caller's now: not kept alive by the buffer
	n.mu.inbox = n.mu.inbox[:0]
	return dst
}

// pull moves NIXL's notifications into the inbox; reports whether any.
func (n *Backend) pull() bool {
	got, err := n.a.Drain(nil)
	return n.inboxed(got, err)
}

// tryPull is pull for the poller: ok is false, and nothing drained, where
// another call holds the agent.
func (n *Backend) tryPull() (got, ok bool) {
	notifs, ok, err := n.a.TryDrain(nil)
	return n.inboxed(notifs, err), ok
}

// inboxed moves drained notifications into the inbox; reports whether any.
func (n *Backend) inboxed(got []capi.Notif, err error) bool {
	if err != nil || len(got) == 0 {
		return false
	}
	n.mu.Lock()
	for _, g := range got {
		n.mu.inbox = append(n.mu.inbox, kvxfer.Notif{From: kvxfer.PeerName(g.From), Msg: g.Msg})
	}
	n.mu.busy = time.Now()
	n.mu.Unlock()
	return true
}

// Events implements kvxfer.Backend.
func (n *Backend) Events() <-chan struct{} { return n.events }

// Awaiting implements kvxfer.Awaiter.
func (n *Backend) Awaiting(on bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if on {
		n.mu.await++
		n.woken() // the poll loop may be sleeping its idle interval
	} else if n.mu.await > 0 {
		n.mu.await--
	}
	n.mu.busy = time.Now()
}

var _ kvxfer.Awaiter = (*Backend)(nil)

// DefaultPollInterval is Config.PollInterval's default. A poll round's
// NIXL calls cost about 0.1 µs; the poller's wake-up from nanosleep costs
// more: about 25 µs of CPU on the 2-vCPU CI machine (a virtual machine),
// so polling every 50 µs takes a third of a core there, for as long as a
// Backend of the process polls at this rate (hotPoll; one poller serves
// them all: poller.go). Each hop of a transfer is seen about 140 µs after
// it came, against 0.5 ms on average (up to 1.1 ms) when Go's timers
// paced the polls (bench/RESULTS.md).
const DefaultPollInterval = 50 * time.Microsecond

// recentPoll is how often a Backend that was active within the last
// second, with nothing awaited now, polls.
const recentPoll = time.Millisecond

// hotPoll is how long after its last activity (a post, a notification
// sent or received, Awaiting) a Backend whose Worker awaits peer messages
// polls at PollInterval: an answer to what it did comes within it (a
// WRITE of 512 MiB at 20 GB/s takes 25 ms). Up to a second after, it
// polls four times less often (a peer's next request, say a registration
// reaching a producer between transfers); past that, every recentPoll. A
// Worker that waits long for a peer with nothing to say costs a poll a
// millisecond, not one every PollInterval: each is a nanosleep wake-up,
// about 25 µs of CPU on the 2-vCPU CI machine (a third of a core at 50 µs).
const hotPoll = 50 * time.Millisecond

// idlePoll is how often an idle Backend polls for notifications: the
// longest a first message after a lull (a registration reaching an idle
// producer that awaits nothing) waits to be seen.
const idlePoll = 10 * time.Millisecond

// pollRound is one poll of the Backend (by the process's poller, at its
// due time): Events signalled on notifications and finished transfers;
// it returns how long until the next (pollAfter). It never waits for
// another call on the Backend (a post of many descriptors holds the
// agent for milliseconds, a registration of much memory for longer):
// the one poller serves every Backend of the process, and would keep
// them all waiting. What it could not ask is asked at the next round,
// within busyPoll.
func (n *Backend) pollRound() time.Duration {
	signal, ok := n.tryPull()
	if !n.mu.TryLock() {
		return min(n.cfg.PollInterval, busyPoll)
	}
	ids := slices.Collect(func(yield func(kvxfer.XferID) bool) {
		for id, x := range n.mu.xfers {
			if x.state == kvxfer.XferInProgress && !yield(id) {
				return
			}
		}
	})
	awaited, since := n.mu.await > 0, time.Since(n.mu.busy)
	n.mu.Unlock()
	for _, id := range ids {
		s, asked := n.tryState(id)
		if !asked {
			ok = false
			break
		}
		if s != kvxfer.XferInProgress {
			signal = true
		}
	}
	if signal {
		select {
		case n.events <- struct{}{}:
		default:
		}
	}
	d := pollAfter(n.cfg.PollInterval, len(ids) > 0, awaited, since)
	if !ok {
		d = min(d, busyPoll)
	}
	return d
}

// busyPoll is the longest a Backend whose poll found it busy (another
// call holding its agent) waits for the next.
const busyPoll = time.Millisecond

// woken has the Backend polled at once (a transfer was posted, a Worker
// began awaiting): it ends the poller's pause if that is a long one.
func (n *Backend) woken() {
	n.due.Store(0)
	polls.wakeUp()
}

// pollAfter is how long the poll loop pauses before its next round, with
// transfers in flight or not, a Worker awaiting peer messages or not, and
// since the Backend's last activity (see Config.PollInterval and hotPoll).
func pollAfter(interval time.Duration, inFlight, awaited bool, since time.Duration) time.Duration {
	switch {
	case inFlight || awaited && since < hotPoll:
		return interval
	case awaited && since < time.Second:
		return min(4*interval, max(recentPoll, interval))
	case !awaited && since > time.Second:
		return idlePoll
	default:
		return max(recentPoll, interval)
	}
}

// Close implements kvxfer.Backend: it stops polling, releases the
// transfers (those in flight abandoned) and prepared lists still held, and
// destroys the agent. It is idempotent.
func (n *Backend) Close() error {
	var err error
	n.once.Do(func() {
		polls.remove(n)
		n.life.Lock() // posts and prepares under way end first
		defer n.life.Unlock()
		n.mu.Lock()
		// Those in flight are waited for first (see Release), all within
		// one releaseWait, their peers still watched.
		if left := n.quietLocked(func(*nixlXfer) bool { return true }, time.Now().Add(releaseWait)); left > 0 {
			releasedInFlight.Add(uint64(left))
		}
		n.mu.closed = true
		for name, p := range n.mu.peers {
			p.close()
			delete(n.mu.peers, name)
		}
		// Destroying the agent under them would leak NIXL's requests (and
		// UCX's under them) and lists: nothing can free them after.
		for id, x := range n.mu.xfers {
			_ = n.a.Release(x.x)
			delete(n.mu.xfers, id)
		}
		for id, p := range n.mu.preps {
			if !p.dead {
				_ = n.a.Unprepare(p.p)
			}
			delete(n.mu.preps, id)
		}
		n.mu.Unlock()
		nixlClosed(n.a.Name())
		err = n.a.Close()
	})
	n.bg.Wait() // remakes end once they see the close
	return err
}
