package server_test

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// Per-rank servers (the in-process placement's port scheme) between
// engines that differ: P TP 2 to D TP 1, P TP 1 to D TP 2, P PP 2 to D
// TP 1, and P's 16-token blocks into D's 32-token ones; D names P by its
// base address only, in push and pull; every byte of D checked, one
// outcome per request per rank on each side, no goroutine left behind.
// Each engine's memory is a shared file (kvxferd's way), or named by its
// address (the in-process placement's: the servers run in this process).
func TestPerRankServersHeterogeneous(t *testing.T) {
	eng := func(id, tp, pp, block int) kvsim.Engine {
		return kvsim.Engine{ID: id, TP: tp, PP: pp, LogicalBlock: block, KernelBlock: block, Layout: topology.LayoutHND,
			Packing: topology.PackedKV, Blocks: 64}
	}
	for _, c := range []struct {
		name   string
		pe, de kvsim.Engine
	}{
		{"tp2-1", eng(1, 2, 1, 16), eng(2, 1, 1, 16)},
		{"tp1-2", eng(1, 1, 1, 16), eng(2, 2, 1, 16)},
		{"pp2-1", eng(1, 1, 2, 16), eng(2, 1, 1, 16)},
		{"block16-32", eng(1, 1, 1, 16), eng(2, 1, 1, 32)},
	} {
		for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
			for _, byAddr := range []bool{false, true} {
				name := c.name + "/" + mode.String() + map[bool]string{false: "/file", true: "/address"}[byAddr]
				t.Run(name, func(t *testing.T) {
					before := runtime.NumGoroutine()
					t.Run("run", func(t *testing.T) { runSpreadHetero(t, mode, c.pe, c.de, byAddr) })
					leakcheck.Check(t, before, 2, 10*time.Second)
				})
			}
		}
	}
}

func runSpreadHetero(t *testing.T, mode kvxfer.Mode, pe, de kvsim.Engine, byAddr bool) {
	shmDir := t.TempDir()
	dps, dds := spreadDaemons(t, shmDir, pe.TP*pe.PP), spreadDaemons(t, shmDir, de.TP*de.PP)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}
	memDir := shmDir
	if byAddr {
		memDir = "" // connectRank: memory named by address
	}
	P := attachSpread(t, dps, memDir, "P", &model, pe, mode)
	D := attachSpread(t, dds, memDir, "D", &model, de, mode)
	rng := rand.New(rand.NewPCG(5, 6))
	pIDs, dIDs := rng.Perm(64), rng.Perm(64)
	const n = 6
	now := time.Now()
	var pm, dm kvxfer.StepMeta
	pm.SchedulerClock, dm.SchedulerClock = now, now
	var sims []*kvsim.Request
	for i := range n {
		tokens := 10 + rng.IntN(100)
		pn, dn := (tokens+pe.LogicalBlock-1)/pe.LogicalBlock, (tokens+de.LogicalBlock-1)/de.LogicalBlock
		var ps, ds topology.Span
		for _, id := range pIDs[:pn] {
			ps.IDs = append(ps.IDs, topology.BlockID(id))
		}
		for _, id := range dIDs[:dn] {
			ds.IDs = append(ds.IDs, topology.BlockID(id))
		}
		pIDs, dIDs = pIDs[pn:], dIDs[dn:]
		for _, stage := range P.ranks {
			for _, r := range stage {
				r.Fill([]topology.Span{ps})
			}
		}
		sims = append(sims, &kvsim.Request{Tokens: tokens, P: []topology.Span{ps}, D: []topology.Span{ds}})
		id := fmt.Sprint(i)
		pm.Send = append(pm.Send, kvxfer.SendReq{ReqID: "p-" + id, TransferID: "t-" + id, Deadline: now.Add(30 * time.Second),
			Blocks: []topology.Span{ps}, Tokens: tokens})
		rr := kvxfer.RecvReq{ReqID: "d-" + id, TransferID: "t-" + id, Local: []topology.Span{ds}, Deadline: now.Add(time.Minute),
			Remote: kvxfer.RemoteRef{EngineID: "P", Addr: dps[0].peerAddr, ReqID: "p-" + id, TPSize: pe.TP, PPSize: pe.PP, Tokens: tokens}}
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
		if o := sent[fmt.Sprint("p-", i)]; len(o) != pe.TP*pe.PP {
			t.Errorf("P outcomes of p-%d: %+v, want one per rank (%d)", i, o, pe.TP*pe.PP)
		}
		for _, o := range sent[fmt.Sprint("p-", i)] {
			if o.Result != kvxfer.ResultDone {
				t.Errorf("P outcome %+v", o)
			}
		}
		o := recvd[fmt.Sprint("d-", i)]
		if len(o) != de.TP*de.PP {
			t.Errorf("D outcomes of d-%d: %+v, want one per rank (%d)", i, o, de.TP*de.PP)
		}
		for _, x := range o {
			if x.Result != kvxfer.ResultDone {
				t.Errorf("D outcome %+v", x)
			}
		}
	}
	for i, r := range D.ranks[0] {
		if err := r.CheckValues(befores[i], sims, pe.KernelBlock, pe.LogicalBlock); err != nil {
			t.Errorf("D rank %d: %v", i, err)
		}
	}
	P.close(t)
	D.close(t)
}
