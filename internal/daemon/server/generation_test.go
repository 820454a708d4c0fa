package server_test

import (
	"context"
	"encoding/binary"
	"hash/fnv"
	"net"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// genModel is a small engine for the generation tests.
func genEngine(t *testing.T, tp int) [][]*kvsim.Rank {
	t.Helper()
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}
	e := kvsim.Engine{ID: 1, TP: tp, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	ranks, err := kvsim.Build(&model, &e)
	if err != nil {
		t.Fatal(err)
	}
	return ranks
}

// handshakeGen is the generation a peer's handshake with engine at addr
// reports.
func handshakeGen(t *testing.T, engine, addr string) uint64 {
	t.Helper()
	pr := server.NewPeerResolver(server.ResolverConfig{})
	defer pr.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := pr.Handshake(ctx, engine, addr)
	if err != nil {
		t.Fatal(err)
	}
	return res.Generation
}

// A pull producer's scheduler on kvxferd tells, in every step's answer,
// its engine's generation as a peer's handshake reports it, and stamps it
// on the params it returns (remote_generation): a consumer then reads
// nothing those params name once the engine is at another generation.
// When the engine's rank attaches again (a worker restarted), the next
// answer tells the new generation. A push scheduler tells none.
func TestSchedulerTellsItsEngineGeneration(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		d := startDaemon(t, shmDir)
		_, c, ctx := schedulerClientOn(t, d)
		ranks := genEngine(t, 1)
		rs, err := attachRank(t, d, shmDir, "P", ranks[0][0], kvxfer.ModePull)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range []struct {
			id   string
			mode pb.Mode
		}{{"P", pb.Mode_MODE_PULL}, {"Q", pb.Mode_MODE_PUSH}} {
			if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: e.id, Mode: e.mode, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
				t.Fatal(err)
			}
		}
		gen1 := handshakeGen(t, "P", d.peerAddr)
		finish := func(id string) *pb.StepResponse {
			t.Helper()
			req := &pb.EngineRequest{RequestId: id, PromptTokens: 40, Params: &pb.TransferParams{DoRemoteDecode: true}}
			resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "P", Ops: []*pb.SchedulerOp{{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{
				Request: req, Status: pb.FinishStatus_FINISH_STATUS_STOPPED, Blocks: []*pb.BlockList{{BlockIds: []int32{1, 2, 3}}}, Computed: 40}}}}})
			if err != nil || len(resp.Results) != 1 || resp.Results[0].Params == nil {
				t.Fatalf("Step(request_finished %s) = %v, %v; want its params", id, resp, err)
			}
			return resp
		}
		resp := finish("p-1")
		if gen1 == 0 || resp.Generation != gen1 || resp.Results[0].Params.RemoteGeneration != gen1 {
			t.Errorf("step answer's generation %d, params' remote_generation %d; want both the handshake's %d",
				resp.Generation, resp.Results[0].Params.RemoteGeneration, gen1)
		}
		if q, err := c.Step(ctx, &pb.StepRequest{EngineId: "Q"}); err != nil || q.Generation != 0 {
			t.Errorf("push scheduler's step answer = %v, %v; want no generation", q, err)
		}
		// The rank attaches again: a new generation, told at once.
		closeRank(t, rs)
		rs, err = attachRank(t, d, shmDir, "P", ranks[0][0], kvxfer.ModePull)
		if err != nil {
			t.Fatal(err)
		}
		defer closeRank(t, rs)
		gen2 := handshakeGen(t, "P", d.peerAddr)
		resp = finish("p-2")
		if gen2 == gen1 || resp.Generation != gen2 || resp.Results[0].Params.RemoteGeneration != gen2 {
			t.Errorf("after the rank attached again: handshake %d (before %d), step answer %d, params %d; want a new generation told in both",
				gen2, gen1, resp.Generation, resp.Results[0].Params.RemoteGeneration)
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// In-process placement: an engine's scheduler runs on a server of its own
// (the engine core's process) while each rank is served by its own
// per-rank server. The scheduler's server learns the engine's generation
// by handshaking the ranks at its advertised base, as a peer would (the
// same value: a consumer compares the two), and learns a new one after a
// rank's server sees the rank attach again. Before, such a scheduler
// stamped nothing (0), so vLLM's default placement had no protection
// against reading a restarted producer's blocks with old params. It asks
// as it opens, so that its first answer and params carry the generation.
func TestSpreadSchedulerLearnsItsEngineGeneration(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		ds := spreadDaemons(t, shmDir, 2)
		_, ps, _ := net.SplitHostPort(ds[0].peerAddr)
		base, _ := strconv.Atoi(ps)
		sd := startDaemonWith(t, shmDir, func(c *server.Config) { c.RankPortBase = base })
		_, c, _ := schedulerClientOn(t, sd)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		ranks := genEngine(t, 2)
		var streams [2]func()
		attach := func(i int) {
			rs, err := attachRank(t, ds[i], shmDir, "E", ranks[0][i], kvxfer.ModePull)
			if err != nil {
				t.Fatal(err)
			}
			streams[i] = func() { closeRank(t, rs) }
		}
		attach(0)
		attach(1)
		if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PULL, TpSize: 2, LogicalBlockSize: 16}}); err != nil {
			t.Fatal(err)
		}
		// told waits (bounded) for the step answers to tell want.
		told := func(want uint64) {
			t.Helper()
			var got uint64
			for ctx.Err() == nil {
				resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "E"})
				if err != nil {
					t.Fatal(err)
				}
				if got = resp.Generation; got == want {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
			t.Fatalf("step answers tell generation %d, want %d (a handshake with the engine's ranks)", got, want)
		}
		// Opening it asked the ranks: its first answer tells their
		// generation.
		gen1 := handshakeGen(t, "E", ds[0].peerAddr)
		if resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "E"}); err != nil || resp.Generation != gen1 {
			t.Fatalf("first step answer = %v, %v; want generation %d (a handshake with the engine's ranks)", resp, err, gen1)
		}
		// Rank 1's worker restarts: its server sees it attach again.
		streams[1]()
		attach(1)
		gen2 := handshakeGen(t, "E", ds[0].peerAddr)
		if gen2 == gen1 {
			t.Fatalf("the engine's generation stayed %d across a rank's new attach", gen1)
		}
		told(gen2)
		// Params it returns carry what it knows now.
		req := &pb.EngineRequest{RequestId: "p-1", PromptTokens: 40, Params: &pb.TransferParams{DoRemoteDecode: true}}
		resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", Ops: []*pb.SchedulerOp{{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{
			Request: req, Status: pb.FinishStatus_FINISH_STATUS_STOPPED, Blocks: []*pb.BlockList{{BlockIds: []int32{1, 2, 3}}}, Computed: 40}}}}})
		if err != nil || len(resp.Results) != 1 || resp.Results[0].Params.GetRemoteGeneration() != gen2 {
			t.Errorf("Step(request_finished) = %v, %v; want params of generation %d", resp, err, gen2)
		}
		streams[0]()
		streams[1]()
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// A spread engine's generation is FNV-1a over its ranks' generations'
// little-endian bytes, as builds before it computed with hash/fnv: a
// consumer of either build compares the same value with the params'.
func TestSpreadGenerationIsFNV1a(t *testing.T) {
	for _, gens := range [][]uint64{{1}, {1 << 63, 42}, {0x0102030405060708, 0, ^uint64(0)}} {
		h := fnv.New64a()
		var b [8]byte
		for _, g := range gens {
			binary.LittleEndian.PutUint64(b[:], g)
			_, _ = h.Write(b[:])
		}
		if got, want := server.SpreadGenerationForTest(gens), max(h.Sum64(), 1); got != want {
			t.Errorf("spreadGeneration(%x) = %x, want %x", gens, got, want)
		}
	}
}
