package server_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// gatedResolver holds its handshakes with one engine until open closes,
// and says on asked when the first is asked.
type gatedResolver struct {
	kvxfer.Resolver
	engine string
	asked  chan struct{}
	open   chan struct{}
}

func (g *gatedResolver) Handshake(ctx context.Context, engine, addr string) (kvxfer.HandshakeResult, error) {
	if engine == g.engine {
		select {
		case g.asked <- struct{}{}:
		default:
		}
		select {
		case <-g.open:
		case <-ctx.Done():
			return kvxfer.HandshakeResult{}, ctx.Err()
		}
	}
	return g.Resolver.Handshake(ctx, engine, addr)
}

// An engine that dies while a peer's first handshake with it is still
// under way: the peer's handshake reaches its daemon once the dead
// engine's rank is being let go. That rank's close waits for the peer (a
// push consumer for its producer's word that nothing more lands, after
// its cancel; a pull producer for its consumer's word on the blocks it
// holds), so the peer must still reach the rank: the handshake lists it
// as leaving, the peer loads its agent for notices only (nothing is
// planned against it), and what waited on the handshake fails at once,
// told to the rank. Before, a leaving rank was not in the handshake at
// all (unknown engine): the peer could not tell it anything, and the
// rank's close waited out its CloseTimeout (10 s), and its engine's next
// attach with it.
//
// The data plane open (WorkerConfig.OpenDataPlane: the backend enforces
// no grants, as NIXL's one-sided WRITEs and READs): a push consumer's
// close waits for its producer's word (guarded, the backend revokes the
// grants and it waits for nothing).
func TestPeerReachesALeavingRank(t *testing.T) {
	for _, c := range []struct {
		mode kvxfer.Mode
		open bool
	}{{kvxfer.ModePush, true}, {kvxfer.ModePull, true}, {kvxfer.ModePull, false}} {
		name := c.mode.String() + "/guarded"
		if c.open {
			name = c.mode.String() + "/open"
		}
		t.Run(name, func(t *testing.T) { runPeerReachesALeavingRank(t, c.mode, c.open) })
	}
}

func runPeerReachesALeavingRank(t *testing.T, mode kvxfer.Mode, open bool) {
	shmDir := t.TempDir()
	// The rank that dies: D's in push (P handshakes with it on D's
	// registration), P's in pull (D handshakes with it to READ).
	dying, asker := "D", "P"
	if mode == kvxfer.ModePull {
		dying, asker = "P", "D"
	}
	gate := &gatedResolver{Resolver: server.NewPeerResolver(server.ResolverConfig{}), engine: dying,
		asked: make(chan struct{}, 1), open: make(chan struct{})}
	t.Cleanup(func() {
		select {
		case <-gate.open:
		default:
			close(gate.open)
		}
	})
	const closeTimeout = 30 * time.Second
	tweak := func(name string) func(*server.Config) {
		return func(c *server.Config) {
			c.WorkerConfig = func(wc *kvxfer.WorkerConfig) { wc.CloseTimeout, wc.OpenDataPlane = closeTimeout, open }
			if name == asker {
				c.Resolver = gate
			}
		}
	}
	dp, dd := startDaemonWith(t, shmDir, tweak("P")), startDaemonWith(t, shmDir, tweak("D"))
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
	eng := func(n int) kvsim.Engine {
		return kvsim.Engine{ID: n, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	}
	P := attach(t, dp, shmDir, "P", &model, eng(1), mode)
	D := attach(t, dd, shmDir, "D", &model, eng(2), mode)
	now := time.Now()
	ps := []topology.Span{{IDs: []topology.BlockID{1, 2}}}
	P.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{{ReqID: "p-1", TransferID: "t-1",
		Deadline: now.Add(time.Minute), Blocks: ps, Tokens: 32}}})
	rr := kvxfer.RecvReq{ReqID: "d-1", TransferID: "t-1", Local: []topology.Span{{IDs: []topology.BlockID{3, 4}}}, Deadline: now.Add(time.Minute),
		Remote: kvxfer.RemoteRef{EngineID: "P", Addr: dp.peerAddr, ReqID: "p-1", TPSize: 1, Tokens: 32}}
	if mode == kvxfer.ModePull {
		rr.Remote.Blocks = ps
	}
	D.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{rr}})
	select {
	case <-gate.asked:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s never handshook with %s", asker, dying)
	}
	// The dying engine crashes (its connection ends without a word) while
	// the handshake with it waits at the gate.
	dyingEngine, dyingDaemon, survivor := D, dd, P
	if mode == kvxfer.ModePull {
		dyingEngine, dyingDaemon, survivor = P, dp, D
	}
	_ = dyingEngine.client.Close()
	crashed := time.Now()
	// Its rank is unpublished at once: wait for that, then let the
	// handshake go.
	probe := server.NewPeerResolver(server.ResolverConfig{})
	defer probe.Close()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := probe.Handshake(ctx, dying, dyingDaemon.peerAddr)
		cancel()
		if err != nil {
			break
		}
		if time.Since(crashed) > 10*time.Second {
			t.Fatalf("%s's rank still published 10 s after its engine crashed", dying)
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(gate.open)
	// The dying rank is let go once the survivor told it (a few ms here);
	// its CloseTimeout is 30 s. 10 s leaves room for a loaded machine.
	var letGo bool
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !letGo; time.Sleep(5 * time.Millisecond) {
		for _, rs := range dyingDaemon.srv.RankStats() {
			if rs.Engine == dying && !rs.Attached {
				letGo = true
			}
		}
	}
	if !letGo {
		t.Fatalf("%s's rank, its engine crashed, not let go %v later (its close waits for %s, which could not reach it)",
			dying, time.Since(crashed).Round(time.Millisecond), asker)
	}
	t.Logf("%s's rank let go %v after its engine crashed", dying, time.Since(crashed).Round(time.Millisecond))
	// The survivor's request ended, failed, at once (not at its deadline).
	sendSide := mode == kvxfer.ModePush
	got := survivor.collect(t, 1, sendSide)
	for id, os := range got {
		if len(os) != 1 || os[0].Result != kvxfer.ResultFailed {
			t.Errorf("%s's %s: outcomes %+v, want one failed", asker, id, os)
		}
	}
	survivor.close(t)
}

// asLeaving answers handshakes as srv does, its ranks listed as leaving.
type asLeaving struct {
	pb.UnimplementedPeerServiceServer
	srv *server.Server
}

func (a *asLeaving) Handshake(ctx context.Context, req *pb.HandshakeRequest) (*pb.HandshakeResponse, error) {
	plain := &pb.HandshakeRequest{EngineId: req.EngineId} // uncompressed
	resp, err := a.srv.Handshake(ctx, plain)
	if err != nil {
		return nil, err
	}
	var list pb.RankList
	if err := proto.Unmarshal(resp.Payload, &list); err != nil {
		return nil, err
	}
	list.Ranks, list.Leaving = nil, list.Ranks
	resp.Payload, _ = proto.Marshal(&list)
	return resp, nil
}

// A handshake whose answer lists a rank leaving fails, naming the rank,
// with every rank that answered, those leaving too, in a
// PartialHandshakeError (their agents admit their messages and take our
// notices). A spread engine (per-rank servers) whose first answer has
// its one rank leaving still asks the others.
func TestHandshakeWithARankLeaving(t *testing.T) {
	ds := spreadTP2(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	pb.RegisterPeerServiceServer(g, &asLeaving{srv: ds[1].srv}) // rank 1, leaving
	go func() { _ = g.Serve(l) }()
	defer g.Stop()
	res := server.NewPeerResolver(server.ResolverConfig{})
	defer res.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = res.Handshake(ctx, "E", l.Addr().String())
	var partial *kvxfer.PartialHandshakeError
	if !errors.As(err, &partial) {
		t.Fatalf("handshake with rank 1 leaving: %v, want a PartialHandshakeError", err)
	}
	if !strings.Contains(err.Error(), "rank tp 1 pp 0 leaving") {
		t.Errorf("error %q does not name rank tp 1 pp 0 leaving", err)
	}
	var got []int
	for _, ri := range partial.Answered {
		got = append(got, ri.Layout.TPRank)
	}
	if !slices.Equal(got, []int{0, 1}) {
		t.Errorf("answered tp ranks %v, want [0 1] (rank 0 asked at its port, rank 1 leaving)", got)
	}
	// The decoder alone: a rank both published and leaving is refused.
	resp, err := ds[0].srv.Handshake(ctx, &pb.HandshakeRequest{EngineId: "E"})
	if err != nil {
		t.Fatal(err)
	}
	var list pb.RankList
	if err := proto.Unmarshal(resp.Payload, &list); err != nil {
		t.Fatal(err)
	}
	list.Leaving = list.Ranks
	resp.Payload, _ = proto.Marshal(&list)
	if _, err := server.NewHandshakeDecoder().Decode("E", resp); !errors.Is(err, kvxfer.ErrBadMetadata) || !strings.Contains(err.Error(), "leaving[0]: rank tp 0 pp 0 listed twice") {
		t.Errorf("a rank published and leaving: %v, want ErrBadMetadata naming leaving[0]", err)
	}
}
