package server_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// daemon is a kvxferd in miniature: a Server on a unix socket for engines
// and on loopback TCP for peers.
type daemon struct {
	srv      *server.Server
	g        *grpc.Server
	sock     string
	peerAddr string
}

func startDaemon(t testing.TB, shmDir string) *daemon {
	t.Helper()
	return startDaemonWith(t, shmDir, nil)
}

func startDaemonWith(t testing.TB, shmDir string, tweak func(*server.Config)) *daemon {
	t.Helper()
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return startDaemonOn(t, pl, shmDir, tweak)
}

// startDaemonOn is startDaemonWith serving peers on pl.
func startDaemonOn(t testing.TB, pl net.Listener, shmDir string, tweak func(*server.Config)) *daemon {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "kvxferd.sock")
	unix, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	cfg := server.Config{PeerAddr: pl.Addr().String(), ShmDir: shmDir, Logger: quiet,
		NewBackend: func(string, *topology.Layout, bool) (server.Backend, error) {
			return backendOf(tcp.New(tcp.Config{Logger: quiet, Conns: 2, DisableLocal: true}))
		}}
	if tweak != nil {
		tweak(&cfg)
	}
	srv, err := server.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.Creds(server.EngineCredentials()), srv.BoundCalls()) // as kvxferd's
	srv.RegisterEngine(g)
	pg := grpc.NewServer()
	srv.RegisterPeer(pg)
	go func() { _ = pg.Serve(pl) }()
	go func() { _ = g.Serve(unix) }()
	d := &daemon{srv: srv, g: g, sock: sock, peerAddr: pl.Addr().String()}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Drain(ctx)
		g.Stop()
		pg.Stop()
		_ = srv.Close()
	})
	return d
}

// backendOf is a backend constructor's results as a NewBackend factory
// returns them: nil beside an error, never a nil *B in a non-nil
// server.Backend (which the server would Close).
func backendOf[B server.Backend](b B, err error) (server.Backend, error) {
	if err != nil {
		return nil, err
	}
	return b, nil
}

// engine is a simulated engine attached to a daemon: kvsim ranks whose
// memory lives in shared-memory files the daemon maps.
type engine struct {
	id      string
	eng     kvsim.Engine
	ranks   [][]*kvsim.Rank
	streams [][]*stream.RankStream
	client  *stream.Client
}

// attachSmall attaches a push engine id of one rank (kvsim engine number
// n): one full-attention layer of 2 heads of 8, 8 blocks of 16 tokens.
func attachSmall(t testing.TB, d *daemon, shmDir, id string, n int) *engine {
	t.Helper()
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
	return attach(t, d, shmDir, id, &model, kvsim.Engine{ID: n, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16,
		Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}, kvxfer.ModePush)
}

func attach(t testing.TB, d *daemon, shmDir, id string, m *kvsim.Model, e kvsim.Engine, mode kvxfer.Mode) *engine {
	t.Helper()
	en, err := tryAttach(t, d, shmDir, id, m, e, mode)
	if err != nil {
		t.Fatal(err)
	}
	return en
}

// tryAttach is attach returning Connect's error.
func tryAttach(t testing.TB, d *daemon, shmDir, id string, m *kvsim.Model, e kvsim.Engine, mode kvxfer.Mode) (*engine, error) {
	t.Helper()
	ranks, err := kvsim.Build(m, &e)
	if err != nil {
		t.Fatal(err)
	}
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	en := &engine{id: id, eng: e, ranks: ranks, client: c}
	for pp, stage := range ranks {
		en.streams = append(en.streams, nil)
		for _, r := range stage {
			rs, err := connectRank(t, c, shmDir, id, r, mode)
			if err != nil {
				return nil, err
			}
			en.streams[pp] = append(en.streams[pp], rs)
		}
	}
	return en, nil
}

// connectRank moves rank r's cache into a shared-memory file (the
// engine's cache from then on) and connects its stream over c.
func connectRank(t testing.TB, c *stream.Client, shmDir, id string, r *kvsim.Rank, mode kvxfer.Mode) (*stream.RankStream, error) {
	t.Helper()
	if shmDir == "" {
		// The rank's memory named by its address (the in-process
		// placement: the server runs in this process).
		r.Rebase(addrOf(r.Mem))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return c.Connect(ctx, stream.Hello{EngineID: id, Mode: mode, Layout: r.Layout, CompatHash: "m",
			Memory: []stream.Memory{{Base: r.Base, Size: uint64(len(r.Mem)), InProcess: stream.InProcessHost}}})
	}
	name := fmt.Sprintf("%s-pp%d-tp%d-%d", id, r.Layout.PPRank, r.Layout.TPRank, rand.Uint64())
	mp, err := shm.Create(shmDir, name, uint64(len(r.Mem)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mp.Close() })
	copy(mp.Bytes, r.Mem)
	r.Mem = mp.Bytes // the engine's cache is the shared file now
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Connect(ctx, stream.Hello{EngineID: id, Mode: mode, Layout: r.Layout, CompatHash: "m",
		Memory: []stream.Memory{{Path: filepath.Join(shmDir, name), Base: r.Base, Size: uint64(len(r.Mem))}}})
}

func (e *engine) step(t *testing.T, m *kvxfer.StepMeta) {
	t.Helper()
	for _, stage := range e.streams {
		for _, rs := range stage {
			if err := rs.Step(m); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// collect gathers outcomes until every rank reported n requests.
func (e *engine) collect(t *testing.T, n int, send bool) map[string][]kvxfer.Outcome {
	t.Helper()
	out := map[string][]kvxfer.Outcome{}
	deadline := time.After(20 * time.Second)
	for _, stage := range e.streams {
		for _, rs := range stage {
			got := 0
			for got < n {
				select {
				case f, ok := <-rs.Finished():
					if !ok {
						t.Fatalf("%s: stream ended after %d of %d outcomes", e.id, got, n)
					}
					os := f.Recving
					if send {
						os = f.Sending
					}
					for _, o := range os {
						out[o.ReqID] = append(out[o.ReqID], o)
						got++
					}
				case <-deadline:
					t.Fatalf("%s: %d of %d outcomes after 20 s", e.id, got, n)
				}
			}
		}
	}
	return out
}

func (e *engine) close(t *testing.T) {
	t.Helper()
	for _, stage := range e.streams {
		for _, rs := range stage {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			go func() {
				for range rs.Finished() {
				}
			}()
			if err := rs.Close(ctx); err != nil {
				t.Errorf("Close: %v", err)
			}
			cancel()
		}
	}
}

// TestDaemonsEndToEnd: two daemons, engines attached over unix sockets
// with their KV caches in shared memory, handshakes over PeerService,
// bytes over the built-in TCP backend, in push and pull with P TP 2 ->
// D TP 1; every byte checked; no goroutine left behind.
func TestDaemonsEndToEnd(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			before := runtime.NumGoroutine()
			t.Run("run", func(t *testing.T) { runDaemons(t, mode) }) // its cleanups end with it
			leakcheck.Check(t, before, 2, 10*time.Second)
		})
	}
}

func runDaemons(t *testing.T, mode kvxfer.Mode) {
	shmDir := t.TempDir()
	dp, dd := startDaemon(t, shmDir), startDaemon(t, shmDir)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}
	pe := kvsim.Engine{ID: 1, TP: 2, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 64}
	de := kvsim.Engine{ID: 2, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 64}
	P := attach(t, dp, shmDir, "P", &model, pe, mode)
	D := attach(t, dd, shmDir, "D", &model, de, mode)
	rng := rand.New(rand.NewPCG(1, 2))
	perm := func(n int) []topology.BlockID {
		ids := make([]topology.BlockID, 64)
		for i := range ids {
			ids[i] = topology.BlockID(i)
		}
		rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
		return ids
	}
	pIDs, dIDs := perm(64), perm(64)
	const n = 10
	now := time.Now()
	var pm, dm kvxfer.StepMeta
	pm.SchedulerClock, dm.SchedulerClock = now, now
	var sims []*kvsim.Request
	for i := range n {
		tokens := 10 + rng.IntN(50)
		nb := (tokens + 15) / 16
		ps := []topology.Span{{IDs: pIDs[:nb]}, {IDs: pIDs[nb : 2*nb]}}
		ds := []topology.Span{{IDs: dIDs[:nb]}, {IDs: dIDs[nb : 2*nb]}}
		_ = ps
		// One group over both regions: a single span each.
		ps, ds = ps[:1], ds[:1]
		pIDs, dIDs = pIDs[nb:], dIDs[nb:]
		for _, r := range P.ranks[0] {
			r.Fill(ps)
		}
		sims = append(sims, &kvsim.Request{Tokens: tokens, P: ps, D: ds})
		id := fmt.Sprint(i)
		pm.Send = append(pm.Send, kvxfer.SendReq{ReqID: "p-" + id, TransferID: "t-" + id, Deadline: now.Add(30 * time.Second), Blocks: ps, Tokens: tokens})
		rr := kvxfer.RecvReq{ReqID: "d-" + id, TransferID: "t-" + id, Local: ds, Deadline: now.Add(time.Minute),
			Remote: kvxfer.RemoteRef{EngineID: "P", Addr: dp.peerAddr, ReqID: "p-" + id, TPSize: 2, Tokens: tokens}}
		if mode == kvxfer.ModePull {
			rr.Remote.Blocks = ps
		}
		dm.Recv = append(dm.Recv, rr)
	}
	before := D.ranks[0][0].Snapshot()
	P.step(t, &pm)
	D.step(t, &dm)
	sent := P.collect(t, n, true)
	recvd := D.collect(t, n, false)
	for i := range n {
		for _, o := range sent[fmt.Sprint("p-", i)] {
			if o.Result != kvxfer.ResultDone {
				t.Errorf("P outcome %+v", o)
			}
		}
		if o := recvd[fmt.Sprint("d-", i)]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
			t.Errorf("D outcomes %+v", o)
		}
	}
	if err := D.ranks[0][0].CheckValues(before, sims, 16, 16); err != nil {
		t.Error(err)
	}
	P.close(t)
	D.close(t)
}

// A bad hello is refused with InvalidArgument naming the field.
func TestHelloValidation(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemon(t, shmDir)
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	good := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	mp, err := shm.Create(shmDir, "ok", 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	mem := []stream.Memory{{Path: filepath.Join(shmDir, "ok"), Base: 1 << 20, Size: 1024}}
	// A later pipeline stage with K and V in regions of their own: its
	// first layer is not derivable from its region offset (3: an earlier
	// stage's one-region MLA or Mamba layer), so layer-wise push cannot
	// name its layers.
	sepStage := good
	sepStage.PPRank, sepStage.PPSize, sepStage.RegionOffset, sepStage.Packing = 1, 2, 3, topology.SeparateKV
	sepStage.Regions = []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 128, NumBlocks: 4},
		{Kind: topology.KindFullAttention, Base: 1<<20 + 512, BlockLen: 128, NumBlocks: 4}}
	tests := []struct {
		name string
		h    stream.Hello
		want string
	}{
		{"layer-wise later stage, separate K and V, no first layer", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: sepStage, Memory: mem, Layerwise: true},
			"hello.first_layer = 0 with hello.layerwise, hello.layout.packing = separate and hello.layout.region_offset = 3"},
		{"first layer past the region offset", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: sepStage, Memory: mem, Layerwise: true, FirstLayer: 4},
			"hello.first_layer = 4 with hello.layout.region_offset = 3"},
		{"first layer under half the region offset", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: sepStage, Memory: mem, Layerwise: true, FirstLayer: 1},
			"hello.first_layer = 1 with hello.layout.region_offset = 3"},
		{"first layer negative", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: mem, FirstLayer: -1}, "hello.first_layer = -1"},
		{"first layer that is not the region offset", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: mem, FirstLayer: 2},
			"hello.first_layer = 2 with hello.layout.packing = packed and hello.layout.region_offset = 0"},
		{"no engine", stream.Hello{Mode: kvxfer.ModePush, Layout: good, Memory: mem}, "engine_id"},
		{"no mode", stream.Hello{EngineID: "E", Layout: good, Memory: mem}, "hello.mode"},
		{"bad layout", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: topology.Layout{KVLayout: topology.LayoutHND, Packing: topology.PackedKV}, Memory: mem}, "hello.layout"},
		{"no memory", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good}, "hello.memory"},
		{"region outside memory", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: []stream.Memory{{Path: mem[0].Path, Base: 1 << 20, Size: 512}}}, "regions[0]"},
		{"file too small", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: []stream.Memory{{Path: mem[0].Path, Base: 1 << 20, Size: 4096}}}, "declares 4096"},
		{"malformed device_uuid", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good,
			Memory: []stream.Memory{{Base: 1 << 20, Size: 1024, CUDAIPCHandle: make([]byte, 64), DeviceUUID: "GPU-1234"}}}, `hello.memory[0].device_uuid: cuda: invalid device UUID "GPU-1234"`},
		{"device_uuid without the GPU- prefix", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good,
			Memory: []stream.Memory{{Base: 1 << 20, Size: 1024, CUDAIPCHandle: make([]byte, 64), DeviceUUID: "5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"}}},
			`hello.memory[0].device_uuid: cuda: invalid device UUID "5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"`},
		{"device_uuid on host memory", stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good,
			Memory: []stream.Memory{{Path: mem[0].Path, Base: 1 << 20, Size: 1024, DeviceUUID: "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"}}},
			`hello.memory[0].device_uuid = "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b" on host memory`},
	}
	for _, tc := range tests {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.Connect(ctx, tc.h)
		cancel()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Connect error = %v, want InvalidArgument naming %q", tc.name, err, tc.want)
		}
	}
	// A file the daemon may not map is PermissionDenied, saying nothing more.
	ctx0, cancel0 := context.WithTimeout(context.Background(), 10*time.Second)
	_, err = c.Connect(ctx0, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: []stream.Memory{{Path: "/etc/passwd", Base: 1 << 20, Size: 1024}}})
	cancel0()
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "shm: map /etc/passwd: refused") {
		t.Errorf("file outside the shm dir: %v, want PermissionDenied, refused", err)
	}
	// The good one works, and the peer service then knows the engine.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: mem, CompatHash: "m"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := server.NewPeerResolver(server.ResolverConfig{}).Handshake(ctx, "E", d.peerAddr)
	if err != nil || len(res.Ranks) != 1 || res.Ranks[0].CompatHash != "m" {
		t.Errorf("handshake = %+v, %v; want the one rank", res, err)
	}
	if _, err := server.NewPeerResolver(server.ResolverConfig{}).Handshake(ctx, "nope", d.peerAddr); status.Code(err) != codes.NotFound {
		t.Errorf("handshake of an unknown engine: %v, want NotFound", err)
	}
	// An attached rank is never replaced: a second hello for it is refused
	// and the first stays.
	if _, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: good, Memory: mem, CompatHash: "x"}); status.Code(err) != codes.AlreadyExists ||
		!strings.Contains(err.Error(), `engine "E" tp rank 0 pp rank 0 has a stream open`) {
		t.Errorf("second hello for an attached rank: %v, want AlreadyExists", err)
	}
	if res, err := server.NewPeerResolver(server.ResolverConfig{}).Handshake(ctx, "E", d.peerAddr); err != nil || len(res.Ranks) != 1 || res.Ranks[0].CompatHash != "m" {
		t.Errorf("handshake after the refused replacement = %+v, %v; want the first rank", res, err)
	}
	// Engine services are not on the peer port.
	tc, err := stream.Dial(d.peerAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	if _, err := tc.Connect(ctx, stream.Hello{EngineID: "F", Mode: kvxfer.ModePush, Layout: good, Memory: mem}); status.Code(err) != codes.Unimplemented {
		t.Errorf("WorkerService over the peer port: %v, want Unimplemented", err)
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	_ = rs.Close(ctx)
	_ = pb.Mode_MODE_PUSH
}

// Engine services served over TCP by mistake (a server built with
// EngineCredentials on a TCP listener) refuse every connection: they need
// the unix socket's credentials.
func TestEngineServicesNeedTheUnixSocket(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := server.New(server.Config{PeerAddr: ln.Addr().String(), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	g := grpc.NewServer(grpc.Creds(server.EngineCredentials()))
	srv.RegisterEngine(g)
	go func() { _ = g.Serve(ln) }()
	defer g.Stop()
	c, err := stream.Dial(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Connect over TCP: %v, want Unavailable (the handshake refused)", err)
	}
	// And without the credentials at all, every call is PermissionDenied.
	g2 := grpc.NewServer()
	srv.RegisterEngine(g2)
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g2.Serve(ln2) }()
	defer g2.Stop()
	c2, err := stream.Dial(ln2.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := c2.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush}); status.Code(err) != codes.PermissionDenied ||
		!strings.Contains(err.Error(), "unix socket") {
		t.Errorf("Connect without engine credentials: %v, want PermissionDenied naming the unix socket", err)
	}
	cc, err := grpc.NewClient(ln2.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	sc := pb.NewSchedulerServiceClient(cc)
	if _, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E"}}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("OpenScheduler without engine credentials: %v, want PermissionDenied", err)
	}
}

// GPU memory on a GPU this daemon does not have is FailedPrecondition: with
// no driver here the daemon has no GPU at all; with one, no visible device
// has the nil UUID.
func TestHelloGPUNotHere(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	layout := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	const nilUUID = "GPU-00000000-0000-0000-0000-000000000000"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: layout, CompatHash: "m",
		Memory: []stream.Memory{{Base: 1 << 20, Size: 1024, CUDAIPCHandle: make([]byte, 64), DeviceUUID: nilUUID}}})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "hello.memory[0].device_uuid "+strconv.Quote(nilUUID)) {
		t.Errorf("Connect with GPU memory on %s: %v, want FailedPrecondition naming hello.memory[0].device_uuid and the value", nilUUID, err)
	}
}

// Drain (SIGTERM in kvxferd): a rank with a request still open gets the
// request's outcome before its stream ends; its memory is released.
func TestDrainReportsEveryOutcome(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) { c.DrainTimeout = 200 * time.Millisecond })
	srv := d.srv
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2}
	de := kvsim.Engine{ID: 2, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	D := attach(t, d, shmDir, "D", &model, de, kvxfer.ModePush)
	now := time.Now()
	D.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{{ReqID: "d-1", Local: []topology.Span{{IDs: []topology.BlockID{1}}},
		Deadline: now.Add(time.Hour), Remote: kvxfer.RemoteRef{EngineID: "P-nowhere", Addr: "127.0.0.1:1", TPSize: 1}}}})
	time.Sleep(50 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	var got []kvxfer.Outcome
	for f := range D.streams[0][0].Finished() {
		got = append(got, f.Recving...)
	}
	if len(got) != 1 || got[0].ReqID != "d-1" || got[0].Result == kvxfer.ResultDone {
		t.Errorf("outcomes before the stream ended = %+v, want d-1 failed", got)
	}
	if len(srv.Workers()) != 0 {
		t.Errorf("workers left after drain: %v", srv.Workers())
	}
}

// Engine streams are bounded: one that never says hello is closed after
// HelloTimeout, and past MaxStreamsPerUID a uid's new stream is refused;
// each refusal is counted by reason.
func TestEngineStreamLimits(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.HelloTimeout = 200 * time.Millisecond
		c.MaxStreamsPerUID = 2
	})
	cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wc := pb.NewWorkerServiceClient(cc)
	silent, err := wc.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := silent.Recv(); status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "no hello within 200ms") {
		t.Errorf("a stream that never says hello: %v, want DeadlineExceeded", err)
	}
	// Two Steps streams of this uid are the most; the third is refused.
	sc := pb.NewSchedulerServiceClient(cc)
	if _, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "L", Mode: pb.Mode_MODE_PUSH,
		TpSize: 1, PpSize: 1, LogicalBlockSize: 16, Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}}); err != nil {
		t.Fatal(err)
	}
	var open []grpc.BidiStreamingClient[pb.StepsRequest, pb.StepsResponse]
	for range 2 {
		st, err := sc.Steps(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// Answered: the server admitted the stream and it stays open.
		if err := st.Send(&pb.StepsRequest{Step: &pb.StepRequest{EngineId: "L"}}); err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		open = append(open, st)
	}
	third := func() error {
		st, err := wc.Connect(ctx)
		if err != nil {
			return err
		}
		_, err = st.Recv()
		return err
	}
	refusedErr := third()
	if status.Code(refusedErr) != codes.ResourceExhausted || !strings.Contains(refusedErr.Error(), "-max-streams-per-uid") {
		t.Errorf("a third stream of one uid past MaxStreamsPerUID 2: %v, want ResourceExhausted", refusedErr)
	}
	for _, st := range open {
		_ = st.CloseSend()
	}
	r := d.srv.Refusals()
	if r["hello_timeout"] < 1 || r["streams_per_uid"] < 1 {
		t.Errorf("refusals = %v, want hello_timeout and streams_per_uid counted", r)
	}
}

// An engine-supplied peer address outside the allow-list is refused
// before anything is dialed, with an error naming it.
func TestResolverAllowList(t *testing.T) {
	al, err := server.ParseAllowList("10.0.0.0/8")
	if err != nil {
		t.Fatal(err)
	}
	r := server.NewPeerResolver(server.ResolverConfig{Allow: al.Check})
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = r.Handshake(ctx, "P", "127.0.0.1:1")
	if !errors.Is(err, server.ErrPeerNotAllowed) || !strings.Contains(err.Error(), "127.0.0.1:1 is not in kvxferd's -peer-allow list") {
		t.Errorf("handshake with a peer outside the allow-list: %v", err)
	}
}

// The resolver keeps at most MaxConns peer connections: engines name the
// addresses, and a thousand of them leave no thousand connections (nor
// their goroutines) behind.
func TestResolverConnsBounded(t *testing.T) {
	before := runtime.NumGoroutine()
	r := server.NewPeerResolver(server.ResolverConfig{MaxConns: 4})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 200 {
		// Nothing listens there: each handshake fails, its connection stays cached.
		cctx, ccancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, _ = r.Handshake(cctx, "P", fmt.Sprintf("127.0.0.1:%d", 1+i))
		ccancel()
		if n := r.Conns(); n > 4 {
			t.Fatalf("after %d addresses the resolver keeps %d connections, want at most 4", i+1, n)
		}
	}
	r.Close()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before+5 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before+5 {
		t.Errorf("goroutines: %d before, %d after 200 addresses and Close", before, n)
	}
}

// The bound sendFinished checks a set against before sending it whole is
// never below the set's encoded size: for sets of every shape (empty,
// outcomes of either side with or without reasons, the largest field
// values, negative block ids, stats at their largest).
func TestFinishedBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 500 {
		f := &pb.Finished{}
		if rng.IntN(2) == 0 {
			f.Stats = &pb.TransferStats{Transfers: rng.Uint64(), FailedTransfers: math.MaxUint64, Bytes: math.MaxUint64,
				Descriptors: math.MaxUint64, TransferSeconds: rng.Float64(), Expired: math.MaxUint64}
		}
		outcome := func() *pb.Outcome {
			return &pb.Outcome{RequestId: strings.Repeat("r", rng.IntN(300)), Result: pb.Outcome_Result(rng.IntN(5) - rng.IntN(2)*1000),
				Reason: strings.Repeat("x", rng.IntN(3)*rng.IntN(200)), FailureKind: pb.FailureKind(rng.IntN(12))}
		}
		for range rng.IntN(40) {
			f.Sending = append(f.Sending, outcome())
		}
		for range rng.IntN(40) {
			f.Recving = append(f.Recving, outcome())
		}
		for range rng.IntN(20) {
			f.InvalidBlockIds = append(f.InvalidBlockIds, rng.Int32()-rng.Int32())
		}
		if b, n := server.FinishedBoundForTest(f), proto.Size(f); b < n {
			t.Fatalf("set %d: bound %d < encoded size %d: %v", i, b, n, f)
		}
	}
}

// A big set of outcomes (20,000 failed receives with long reasons) goes
// out as several Finished messages under 1 MiB each, nothing lost, in
// order; a huge step error is clipped.
func TestLargeFinishedSplit(t *testing.T) {
	f := &pb.Finished{Stats: &pb.TransferStats{Transfers: 7}}
	for i := range 20000 {
		f.Recving = append(f.Recving, &pb.Outcome{RequestId: fmt.Sprintf("d-%d", i), Result: pb.Outcome_RESULT_FAILED,
			Reason: strings.Repeat("handshake with producer failed: x ", 6)})
		f.InvalidBlockIds = append(f.InvalidBlockIds, int32(i))
	}
	f.Sending = append(f.Sending, &pb.Outcome{RequestId: "p-1", Result: pb.Outcome_RESULT_DONE})
	if proto.Size(f) < 4<<20 {
		t.Fatalf("the test's set is %d bytes, want over 4 MiB", proto.Size(f))
	}
	parts := server.SplitFinishedForTest(f, 1<<20)
	var got pb.Finished
	for i, p := range parts {
		if n := proto.Size(p); n > 1<<20 {
			t.Errorf("part %d: %d bytes, want at most 1 MiB", i, n)
		}
		if i > 0 && p.Stats != nil {
			t.Errorf("part %d carries stats again", i)
		}
		got.Sending = append(got.Sending, p.Sending...)
		got.Recving = append(got.Recving, p.Recving...)
		got.InvalidBlockIds = append(got.InvalidBlockIds, p.InvalidBlockIds...)
	}
	got.Stats = parts[0].Stats
	if len(parts) < 5 || !proto.Equal(&got, f) {
		t.Errorf("%d parts; their union equals the set: %v", len(parts), proto.Equal(&got, f))
	}
	msg := server.ClipForTest(strings.Repeat("é", 1<<20))
	if len(msg) > 70<<10 || !strings.Contains(msg, "more bytes)") || !utf8.ValidString(msg) {
		t.Errorf("clipped step error: %d bytes, valid UTF-8 %v", len(msg), utf8.ValidString(msg))
	}
}

// 100,000 requests fail at once (their producer cannot be reached), on a
// stream whose client accepts messages of 256 KiB at most and says so in
// its hello: every outcome arrives, exactly once, in messages that fit
// (a message over the client's limit would end the stream instead).
func TestHundredThousandOutcomes(t *testing.T) {
	const limit = 256 << 10
	shmDir := t.TempDir()
	d := startDaemon(t, shmDir)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2}
	de := kvsim.Engine{ID: 2, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	ranks, err := kvsim.Build(&model, &de)
	if err != nil {
		t.Fatal(err)
	}
	r := ranks[0][0]
	mp, err := shm.Create(shmDir, "big-d", uint64(len(r.Mem)))
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	c, err := stream.Dial("unix://"+d.sock, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(limit)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: "D", Mode: kvxfer.ModePush, Layout: r.Layout, CompatHash: "m", MaxMessageBytes: limit,
		Memory: []stream.Memory{{Path: filepath.Join(shmDir, "big-d"), Base: r.Base, Size: uint64(len(r.Mem))}}})
	if err != nil {
		t.Fatal(err)
	}
	const n, per = 100000, 10000
	// Outcomes are read as the steps go out, as an engine does: the
	// daemon stops taking steps while their outcomes wait unread
	// (TestUnreadStreamHoldsTheEngine), so reading only after the last
	// step would hold Step for ever once the failures came quickly.
	type result struct {
		messages int
		err      string
	}
	res := make(chan result, 1)
	go func() {
		seen := make(map[string]bool, n)
		messages := 0
		timeout := time.After(120 * time.Second)
		fail := func(format string, a ...any) {
			res <- result{messages: messages, err: fmt.Sprintf(format, a...)}
			go func() { // the steps still going out are not held
				for range rs.Finished() {
				}
			}()
		}
		for len(seen) < n {
			select {
			case f, ok := <-rs.Finished():
				if !ok {
					fail("the stream ended after %d of %d outcomes: %v", len(seen), n, rs.Err())
					return
				}
				messages++
				for _, o := range f.Recving {
					if seen[o.ReqID] {
						fail("%s reported twice", o.ReqID)
						return
					}
					if o.Result != kvxfer.ResultFailed {
						fail("%s: %+v, want failed", o.ReqID, o)
						return
					}
					seen[o.ReqID] = true
				}
			case <-timeout:
				fail("%d of %d outcomes after 120 s", len(seen), n)
				return
			}
		}
		res <- result{messages: messages}
	}()
	now := time.Now()
	for s := range n / per {
		m := &kvxfer.StepMeta{Step: uint64(s + 1), SchedulerClock: now}
		for i := range per {
			m.Recv = append(m.Recv, kvxfer.RecvReq{ReqID: fmt.Sprintf("d-%06d", s*per+i), Local: []topology.Span{{IDs: []topology.BlockID{1}}},
				Deadline: now.Add(time.Hour), Remote: kvxfer.RemoteRef{EngineID: "P-nowhere", Addr: "127.0.0.1:1", TPSize: 1}})
		}
		if err := rs.Step(m); err != nil {
			t.Fatal(err)
		}
	}
	out := <-res
	if out.err != "" {
		t.Fatal(out.err)
	}
	messages := out.messages
	if messages < 10 {
		t.Errorf("%d outcomes came in %d messages: the sets were not split to fit %d bytes", n, messages, limit)
	}
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	go func() {
		for range rs.Finished() {
		}
	}()
	if err := rs.Close(cctx); err != nil {
		t.Errorf("Close: %v", err)
	}
}
