package kvxfer_test

import (
	"bytes"
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// Example pushes one request's KV from a P rank to a D rank in one
// process: both Workers share an in-memory fabric and a Directory.
func Example() {
	fab, dir := kvxfertest.NewFabric(), kvxfertest.NewDirectory()
	// One layer, one KV head of 4 two-byte elements, 16-token blocks:
	// a block is 16 tokens x (K and V) x 8 bytes = 256 bytes.
	start := func(engine string) (*kvxfer.Worker, []byte) {
		a, _ := fab.NewAgent(engine)
		mem := a.Alloc(8*256, 0)
		l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2,
			KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
			Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: mem.Addr, BlockLen: 256, NumBlocks: 8}}}
		w, err := kvxfer.NewWorker(kvxfer.WorkerConfig{EngineID: engine, Addr: engine + ":1", Mode: kvxfer.ModePush,
			Layout: l, Backend: a, Resolver: dir, CompatHash: "model-x", Logger: quiet})
		if err != nil {
			panic(err)
		}
		meta, _ := a.LocalMetadata()
		_ = dir.Publish(kvxfer.RankInfo{EngineID: engine, CompatHash: "model-x", Layout: l, Agent: meta})
		return w, a.Bytes(mem.Addr, mem.Len)
	}
	p, pMem := start("P")
	d, dMem := start("D")
	defer p.Close()
	defer d.Close()
	copy(pMem[2*256:4*256], bytes.Repeat([]byte{7}, 512)) // P's KV in blocks 2 and 3

	now := time.Now()
	// D registers its blocks 5 and 6 for the request; P finished it.
	_ = d.Step(&kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{{ReqID: "d-1", TransferID: "t-1",
		Local:    []topology.Span{{IDs: []topology.BlockID{5, 6}}},
		Remote:   kvxfer.RemoteRef{EngineID: "P", Addr: "P:1", TPSize: 1},
		Deadline: now.Add(time.Minute)}}})
	_ = p.Step(&kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{{ReqID: "p-1", TransferID: "t-1",
		Deadline: now.Add(30 * time.Second), Blocks: []topology.Span{{IDs: []topology.BlockID{2, 3}}}, Tokens: 32}}})

	wait := func(w *kvxfer.Worker) kvxfer.Finished {
		select {
		case <-w.Ready():
		case <-time.After(10 * time.Second):
		}
		return w.Finished()
	}
	fmt.Println("P:", wait(p).Sending)
	fmt.Println("D:", wait(d).Recving)
	fmt.Println("D blocks 5-6 hold P's KV:", bytes.Equal(dMem[5*256:7*256], pMem[2*256:4*256]))
	// Output:
	// P: [{p-1 done none }]
	// D: [{d-1 done none }]
	// D blocks 5-6 hold P's KV: true
}
