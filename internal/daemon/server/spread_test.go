package server_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// portRun finds n consecutive free loopback ports and returns listeners
// on them.
func portRun(t *testing.T, n int) []net.Listener {
	t.Helper()
	for try := 0; try < 200; try++ {
		base := 20000 + rand.IntN(40000)
		var ls []net.Listener
		for i := range n {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		if len(ls) == n {
			return ls
		}
		for _, l := range ls {
			l.Close()
		}
	}
	t.Fatalf("no %d consecutive free ports", n)
	return nil
}

// spreadDaemons starts one per-rank server per listener (the in-process
// placement's scheme: rank i at base + i).
func spreadDaemons(t *testing.T, shmDir string, n int) []*daemon {
	t.Helper()
	ls := portRun(t, n)
	_, ps, _ := net.SplitHostPort(ls[0].Addr().String())
	base, _ := strconv.Atoi(ps)
	var ds []*daemon
	for _, l := range ls {
		ds = append(ds, startDaemonOn(t, l, shmDir, func(c *server.Config) { c.RankPortBase = base }))
	}
	return ds
}

// attachSpread attaches engine e's rank (pp, tp) to ds[pp*TP+tp].
func attachSpread(t *testing.T, ds []*daemon, shmDir, id string, m *kvsim.Model, e kvsim.Engine, mode kvxfer.Mode) *engine {
	t.Helper()
	ranks, err := kvsim.Build(m, &e)
	if err != nil {
		t.Fatal(err)
	}
	en := &engine{id: id, eng: e, ranks: ranks}
	for pp, stage := range ranks {
		en.streams = append(en.streams, nil)
		for tp, r := range stage {
			rs, err := attachRank(t, ds[pp*e.TP+tp], shmDir, id, r, mode)
			if err != nil {
				t.Fatal(err)
			}
			en.streams[pp] = append(en.streams[pp], rs)
		}
	}
	return en
}

func attachRank(t *testing.T, d *daemon, shmDir, id string, r *kvsim.Rank, mode kvxfer.Mode) (*stream.RankStream, error) {
	t.Helper()
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return connectRank(t, c, shmDir, id, r, mode)
}

// An engine whose ranks are served each by its own server (the in-process
// placement, -rank-port-base): P with TP 2 over two servers, D with TP 2
// over two others; D names P by its base address only. Both directions
// handshake through every rank's port (D finds P's rank 1, P finds D's
// rank 1 from the address of D's rank 0 or 1), in push and pull; every
// byte checked; no goroutine left behind.
func TestPerRankServers(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			before := runtime.NumGoroutine()
			t.Run("run", func(t *testing.T) { runSpread(t, mode) })
			leakcheck.Check(t, before, 2, 10*time.Second)
		})
	}
}

func runSpread(t *testing.T, mode kvxfer.Mode) {
	shmDir := t.TempDir()
	dps, dds := spreadDaemons(t, shmDir, 2), spreadDaemons(t, shmDir, 2)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}
	pe := kvsim.Engine{ID: 1, TP: 2, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 64}
	de := pe
	de.ID = 2
	P := attachSpread(t, dps, shmDir, "P", &model, pe, mode)
	D := attachSpread(t, dds, shmDir, "D", &model, de, mode)
	// What a peer sees at P's base: every rank.
	pr := server.NewPeerResolver(server.ResolverConfig{})
	res, err := pr.Handshake(context.Background(), "P", dps[0].peerAddr)
	pr.Close()
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Ranks) != 2 || res.Ranks[0].Layout.TPRank != 0 || res.Ranks[1].Layout.TPRank != 1 {
		t.Fatalf("handshake at P's base lists %d ranks (%+v), want tp 0 and 1", len(res.Ranks), res.Ranks)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	pIDs, dIDs := rng.Perm(64), rng.Perm(64)
	const n = 8
	now := time.Now()
	var pm, dm kvxfer.StepMeta
	pm.SchedulerClock, dm.SchedulerClock = now, now
	var sims []*kvsim.Request
	for i := range n {
		tokens := 10 + rng.IntN(60)
		nb := (tokens + 15) / 16
		var ps, ds topology.Span
		for j := range nb {
			ps.IDs = append(ps.IDs, topology.BlockID(pIDs[j]))
			ds.IDs = append(ds.IDs, topology.BlockID(dIDs[j]))
		}
		pIDs, dIDs = pIDs[nb:], dIDs[nb:]
		for _, r := range P.ranks[0] {
			r.Fill([]topology.Span{ps})
		}
		sims = append(sims, &kvsim.Request{Tokens: tokens, P: []topology.Span{ps}, D: []topology.Span{ds}})
		id := fmt.Sprint(i)
		pm.Send = append(pm.Send, kvxfer.SendReq{ReqID: "p-" + id, TransferID: "t-" + id, Deadline: now.Add(30 * time.Second),
			Blocks: []topology.Span{ps}, Tokens: tokens})
		rr := kvxfer.RecvReq{ReqID: "d-" + id, TransferID: "t-" + id, Local: []topology.Span{ds}, Deadline: now.Add(time.Minute),
			Remote: kvxfer.RemoteRef{EngineID: "P", Addr: dps[0].peerAddr, ReqID: "p-" + id, TPSize: 2, Tokens: tokens}}
		if mode == kvxfer.ModePull {
			rr.Remote.Blocks = []topology.Span{ps}
		}
		dm.Recv = append(dm.Recv, rr)
	}
	var befores [][]byte
	for _, r := range D.ranks[0] {
		befores = append(befores, r.Snapshot())
	}
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
		if o := recvd[fmt.Sprint("d-", i)]; len(o) != 2 || o[0].Result != kvxfer.ResultDone || o[1].Result != kvxfer.ResultDone {
			t.Errorf("D outcomes %+v, want done on both ranks", o)
		}
	}
	for i, r := range D.ranks[0] {
		if err := r.CheckValues(befores[i], sims, 16, 16); err != nil {
			t.Errorf("D rank %d: %v", i, err)
		}
	}
	P.close(t)
	D.close(t)
}

// A per-rank server takes only the rank its port is for, and says why
// not; a rank whose server is down fails the handshake naming the rank
// and its port; a rank's server restarted shows a new generation.
func TestPerRankServerPorts(t *testing.T) {
	shmDir := t.TempDir()
	ds := spreadDaemons(t, shmDir, 2)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}
	e := kvsim.Engine{ID: 1, TP: 2, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	ranks, err := kvsim.Build(&model, &e)
	if err != nil {
		t.Fatal(err)
	}
	// Rank 1 on rank 0's server: refused, naming the scheme.
	_, err = attachRank(t, ds[0], shmDir, "E", ranks[0][1], kvxfer.ModePush)
	if err == nil || !strings.Contains(err.Error(), "rank-port-base") || !strings.Contains(err.Error(), "tp rank 1") {
		t.Fatalf("rank 1 on rank 0's port: %v, want refused naming rank-port-base", err)
	}
	r0, err := attachRank(t, ds[0], shmDir, "E", ranks[0][0], kvxfer.ModePush)
	if err != nil {
		t.Fatal(err)
	}
	defer closeRank(t, r0)
	res := server.NewPeerResolver(server.ResolverConfig{})
	defer res.Close()
	_, err = res.Handshake(context.Background(), "E", ds[0].peerAddr)
	if err == nil || !strings.Contains(err.Error(), "rank tp 1 pp 0") || !strings.Contains(err.Error(), ds[1].peerAddr[strings.LastIndex(ds[1].peerAddr, ":")+1:]) {
		t.Fatalf("handshake with rank 1 not attached: %v, want an error naming rank tp 1 and its port", err)
	}
	// The rank that answered is still named, with its agent: its messages
	// are admitted by it (kvxfer.PartialHandshakeError).
	var partial *kvxfer.PartialHandshakeError
	if !errors.As(err, &partial) || len(partial.Answered) != 1 || partial.Answered[0].Layout.TPRank != 0 || len(partial.Answered[0].Agent) == 0 {
		t.Fatalf("handshake with rank 1 not attached: %#v, want a PartialHandshakeError listing rank tp 0 with its agent", err)
	}
	r1, err := attachRank(t, ds[1], shmDir, "E", ranks[0][1], kvxfer.ModePush)
	if err != nil {
		t.Fatal(err)
	}
	first, err := res.Handshake(context.Background(), "E", ds[1].peerAddr) // any rank's address will do
	if err != nil {
		t.Fatal(err)
	}
	if len(first.Ranks) != 2 {
		t.Fatalf("%d ranks, want 2", len(first.Ranks))
	}
	again, err := res.Handshake(context.Background(), "E", ds[0].peerAddr)
	if err != nil || again.Generation != first.Generation {
		t.Fatalf("asked again: generation %d (%v), want %d unchanged", again.Generation, err, first.Generation)
	}
	closeRank(t, r1) // rank 1 goes and comes back: a new generation
	r1, err = attachRank(t, ds[1], shmDir, "E", ranks[0][1], kvxfer.ModePush)
	if err != nil {
		t.Fatal(err)
	}
	defer closeRank(t, r1)
	after, err := res.Handshake(context.Background(), "E", ds[0].peerAddr)
	if err != nil || after.Generation == first.Generation {
		t.Fatalf("after rank 1 re-attached: generation %d (%v), want other than %d", after.Generation, err, first.Generation)
	}
	if errors.Is(err, kvxfer.ErrUnknownEngine) {
		t.Fatal(err)
	}
	// A scheduler opened on any of them names the engine by its base (the
	// first rank's port): what transfer params carry.
	cc, err := grpc.NewClient("unix://"+ds[1].sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	op, err := pb.NewSchedulerServiceClient(cc).OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH,
		TpSize: 2, PpSize: 1, LogicalBlockSize: 16, Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}})
	if err != nil {
		t.Fatal(err)
	}
	if op.Addr != ds[0].peerAddr {
		t.Errorf("scheduler on rank 1's server names the engine %q, want its base %q", op.Addr, ds[0].peerAddr)
	}
}

func closeRank(t *testing.T, rs *stream.RankStream) {
	t.Helper()
	go func() {
		for range rs.Finished() {
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := rs.Close(ctx); err != nil {
		t.Errorf("Close: %v", err)
	}
}

// forgedBase answers handshakes as srv does, with rank_port_base set to
// base: a peer's word that the engine's ranks are spread.
type forgedBase struct {
	pb.UnimplementedPeerServiceServer
	srv  *server.Server
	base uint32
}

func (f *forgedBase) Handshake(ctx context.Context, req *pb.HandshakeRequest) (*pb.HandshakeResponse, error) {
	resp, err := f.srv.Handshake(ctx, req)
	if resp != nil {
		resp.RankPortBase = f.base
	}
	return resp, err
}

// spreadTP2 serves engine E, TP 2, one rank on each of two per-rank
// servers, until the test ends.
func spreadTP2(t *testing.T) []*daemon {
	t.Helper()
	shmDir := t.TempDir()
	ds := spreadDaemons(t, shmDir, 2)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}
	e := kvsim.Engine{ID: 1, TP: 2, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	ranks, err := kvsim.Build(&model, &e)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		rs, err := attachRank(t, ds[i], shmDir, "E", ranks[0][i], kvxfer.ModePush)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeRank(t, rs) })
	}
	return ds
}

// What a peer says of its ranks' ports is bounded and checked: a base
// whose ranks would lie past port 65535, an answer at a rank's port
// naming another base, and a rank's port that does not answer are
// refused, naming the rank and the port.
func TestSpreadHandshakeRefusals(t *testing.T) {
	ds := spreadTP2(t)
	_, ps, _ := net.SplitHostPort(ds[0].peerAddr)
	base, _ := strconv.Atoi(ps)
	serve := func(b uint32) string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		g := grpc.NewServer()
		pb.RegisterPeerServiceServer(g, &forgedBase{srv: ds[0].srv, base: b})
		go func() { _ = g.Serve(l) }()
		t.Cleanup(g.Stop)
		return l.Addr().String()
	}
	res := server.NewPeerResolver(server.ResolverConfig{})
	defer res.Close()
	for _, tc := range []struct {
		name string
		base uint32
		want string
	}{
		// Rank 1 at 65535 + 1: no such port.
		{"past the last port", 65535, "would be at port 65536"},
		// Rank 1 at ds[0]'s port: a server that says the base is another.
		{"another base at the rank's port", uint32(base - 1), "rank_port_base " + strconv.Itoa(base) + ", but"},
		// Rank 1 at a port nobody serves: the handshake fails, naming it.
		{"no server at the rank's port", uint32(base + 7), "rank tp 1 pp 0 (port " + strconv.Itoa(base+8)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := serve(tc.base)
			_, err := res.Handshake(context.Background(), "E", addr)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("rank_port_base %d: %v, want an error containing %q", tc.base, err, tc.want)
			}
		})
	}
}

// slowAnswer answers handshakes as srv does, delay after srv took its
// clock's reading (a busy peer, a new connection's setup).
type slowAnswer struct {
	pb.UnimplementedPeerServiceServer
	srv   *server.Server
	delay time.Duration
}

func (s *slowAnswer) Handshake(ctx context.Context, req *pb.HandshakeRequest) (*pb.HandshakeResponse, error) {
	resp, err := s.srv.Handshake(ctx, req)
	time.Sleep(s.delay)
	return resp, err
}

// A spread engine's clock offset is the quickest answer's (SPEC §2: the
// least round trip), each answer's offset being off by up to half its
// round trip. Before, it was the first answer's, whatever its round trip:
// a first answer 2 s late put the offset 1 s off on one host's clock, and
// every lease and deadline rebased with it.
func TestSpreadClockOffsetFromQuickestAnswer(t *testing.T) {
	ds := spreadTP2(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	const delay = 2 * time.Second
	pb.RegisterPeerServiceServer(g, &slowAnswer{srv: ds[0].srv, delay: delay})
	go func() { _ = g.Serve(l) }()
	defer g.Stop()
	res := server.NewPeerResolver(server.ResolverConfig{})
	defer res.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Rank 0 answers slowly at l (its answer names rank 0 and the base);
	// rank 1 is asked at its port, ds[1], which answers at once. All run
	// on one clock: the true offset is 0.
	out, err := res.Handshake(ctx, "E", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Ranks) != 2 {
		t.Fatalf("%d ranks, want 2", len(out.Ranks))
	}
	if off := out.ClockOffset; off < -delay/4 || off > delay/4 {
		t.Errorf("clock offset %v between processes of one clock, want about 0 (the quick answer's), within %v", off, delay/4)
	}
}
