// Command nixlprep times, side by side on this machine, the posting of one
// fragmented request through NIXL: kvxfer's way (hotpath index and
// descriptor building, the NIXL backend's cost model picking a prepared
// or an on-the-fly post, then Backend.PostPrepared or Backend.Post) and
// the reference's way (vllm_way.py: numpy descriptor ids, nixl_cu12's
// make_prepped_xfer and transfer). Each side has its own two agents
// (host memory, UCX), in its own process; the two alternate in rounds,
// the order flipped each round. Timings stop when the post returns: each
// transfer then completes and is released untimed.
//
// The request is the 70B shape at TP4 to TP4 (bench/shapes 70b_bs16:
// 80 layers, 8 KV heads of 128, bf16, blocks of 16 tokens, so 16 KiB
// per block per rank) with 2048 tokens on shuffled distinct block ids
// (128 blocks per layer, 10240 blocks in all), over pools of -blocks
// blocks per layer (real memory here, so smaller than the shapes'
// 4096).
//
//	go run ./bench/nixlprep [-rounds 10] [-iters 20] [-python python3]
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/topology"
)

const (
	layers   = 80
	tokens   = 2048
	block    = 16
	blockLen = 2 * 2 * block * 128 * 2 // K and V, 2 of 8 heads at TP4, bf16
)

// progressDelay is the kvxfer side's NIXL progress thread pause
// (nixl.Config.ProgressDelay; 0: the backend's default).
var progressDelay = flag.Duration("progress-delay", 0, "the kvxfer side's NIXL progress thread pause (0: the backend's default, 100µs; negative: spin)")

// pollInterval is the kvxfer side's backends' busy poll interval
// (nixl.Config.PollInterval; 0: the default, 1 ms).
var pollInterval = flag.Duration("poll-interval", 0, "the kvxfer side's backends' busy poll interval (0: the default, 1ms)")

// hugepages advises the pools to use transparent huge pages, as numpy
// does the reference's.
var hugepages = flag.Bool("hugepages", true, "advise the pools to use transparent huge pages, as numpy does the reference's")

func main() {
	rounds := flag.Int("rounds", 10, "rounds, each side once per round")
	iters := flag.Int("iters", 20, "posts per side per round")
	blocks := flag.Int("blocks", 512, "blocks per layer in each pool")
	python := flag.String("python", "python3", "python with nixl_cu12 and numpy")
	script := flag.String("script", "bench/nixlprep/vllm_way.py", "the reference's side")
	flag.Parse()
	if err := run(*rounds, *iters, *blocks, *python, *script); err != nil {
		log.Fatal(err)
	}
}

// side is one process's memory, layout and agent.
type side struct {
	be     *nixl.Backend
	mem    []byte
	layout *topology.Layout
}

func newSide(name string, nb int) (*side, error) {
	mem, err := poolMemory(layers * nb * blockLen)
	if err != nil {
		return nil, err
	}
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	l := &topology.Layout{TPRank: 0, TPSize: 4, PPSize: 1, TotalKVHeads: 8, HeadSize: 128, ElemBytes: 2,
		KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: block, KernelBlockSize: block}
	be, err := nixl.New(nixl.Config{Name: fmt.Sprintf("nixlprep-%s-%d", name, rand.Uint64()), ProgressDelay: *progressDelay, PollInterval: *pollInterval})
	if err != nil {
		return nil, err
	}
	if err := be.Map(base, mem); err != nil {
		return nil, err
	}
	var regs []kvxfer.MemRegion
	for i := range layers {
		b := base + uint64(i*nb*blockLen)
		l.Regions = append(l.Regions, topology.Region{Kind: topology.KindFullAttention, Base: b, BlockLen: blockLen, NumBlocks: nb})
		regs = append(regs, kvxfer.MemRegion{Addr: b, Len: uint64(nb * blockLen), Kind: kvxfer.MemDRAM})
	}
	if err := be.Register(regs); err != nil {
		return nil, err
	}
	return &side{be: be, mem: mem, layout: l}, nil
}

// ours is kvxfer's side: its two agents, plan, prepared lists and
// scratch.
type ours struct {
	src, dst      *side
	peer          kvxfer.PeerName
	plan          *topology.Plan
	req           *hotpath.Request
	bl            *hotpath.Builder
	cost          kvxfer.PostCost
	local, remote kvxfer.PrepID
	idx           []hotpath.IndexPair
	descs         []hotpath.Desc
	prepared      int // posts that went prepared
}

func newOurs(nb int, src, dst []topology.BlockID) (*ours, error) {
	o := &ours{}
	var err error
	if o.src, err = newSide("src", nb); err != nil {
		return nil, err
	}
	if o.dst, err = newSide("dst", nb); err != nil {
		return nil, err
	}
	meta, err := o.dst.be.LocalMetadata()
	if err != nil {
		return nil, err
	}
	if o.peer, err = o.src.be.LoadPeer(meta); err != nil {
		return nil, err
	}
	if o.plan, err = topology.NewPlan(o.src.layout, o.dst.layout, topology.PlanOptions{}); err != nil {
		return nil, err
	}
	o.req = &hotpath.Request{Tokens: tokens, Src: []topology.Span{{IDs: src}}, Dst: []topology.Span{{IDs: dst}}}
	if o.bl, err = hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite}); err != nil {
		return nil, err
	}
	o.cost = o.src.be.PostCost()
	le, err := hotpath.AppendPrepared(nil, o.plan, hotpath.SrcSide)
	if err != nil {
		return nil, err
	}
	re, err := hotpath.AppendPrepared(nil, o.plan, hotpath.DstSide)
	if err != nil {
		return nil, err
	}
	if o.local, err = o.src.be.Prepare("", le); err != nil {
		return nil, err
	}
	if o.remote, err = o.src.be.Prepare(o.peer, re); err != nil {
		return nil, err
	}
	return o, nil
}

// post times one post: building (indices, descriptors, the choice) and
// the backend's post call; the transfer then completes untimed.
func (o *ours) post() (build, post time.Duration, err error) {
	notif := []byte("done:0123456789abcdef")
	t0 := time.Now()
	if o.idx, err = o.bl.AppendIndices(o.idx[:0], o.plan, o.req); err != nil {
		return 0, 0, err
	}
	// As the Worker does (kvxfer's postPrepared): the descriptors are
	// built only when coalescing could make an on-the-fly post cheaper.
	prep := o.cost.Prepared(hotpath.IndexRuns(o.idx), len(o.idx))
	if !prep {
		if o.descs, err = o.bl.AppendDescs(o.descs[:0], o.plan, o.req); err != nil {
			return 0, 0, err
		}
		prep = o.cost.Prepared(len(o.descs), len(o.idx))
	}
	t1 := time.Now()
	var id kvxfer.XferID
	if prep {
		id, err = o.src.be.PostPrepared(hotpath.OpWrite, o.local, o.remote, o.idx, notif)
		o.prepared++
	} else {
		id, err = o.src.be.Post(hotpath.OpWrite, o.peer, o.descs, notif)
	}
	t2 := time.Now()
	if err != nil {
		return 0, 0, err
	}
	for {
		s, err := o.src.be.State(id)
		if err != nil {
			return 0, 0, err
		}
		if s == kvxfer.XferDone {
			break
		}
		if s == kvxfer.XferFailed {
			return 0, 0, errors.New("transfer failed")
		}
	}
	o.src.be.DrainNotifs(nil)
	o.dst.be.DrainNotifs(nil)
	return t1.Sub(t0), t2.Sub(t1), o.src.be.Release(id)
}

func ids(rng *rand.Rand, n, limit int) []topology.BlockID {
	perm := rng.Perm(limit)
	out := make([]topology.BlockID, n)
	for i := range out {
		out[i] = topology.BlockID(perm[i])
	}
	return out
}

func run(rounds, iters, nb int, python, script string) error {
	rng := rand.New(rand.NewPCG(2048, 4*16+4))
	n := tokens / block
	src, dst := ids(rng, n, nb), ids(rng, n, nb)
	o, err := newOurs(nb, src, dst)
	if err != nil {
		return err
	}
	cmd := exec.Command(python, script)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	outPipe, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() { _ = in.Close(); _ = cmd.Wait() }()
	rd := bufio.NewReader(outPipe)
	cfg, _ := json.Marshal(map[string]any{"layers": layers, "block_len": blockLen, "num_blocks": nb, "src_ids": src, "dst_ids": dst})
	if _, err := fmt.Fprintf(in, "%s\n", cfg); err != nil {
		return err
	}
	if l, err := rd.ReadString('\n'); err != nil || l != "ready\n" {
		return fmt.Errorf("python side: %q, %v", l, err)
	}
	var oBuild, oPost, oAll, pIDs, pMake, pXfer, pAll []float64
	runOurs := func() error {
		for range iters {
			b, p, err := o.post()
			if err != nil {
				return err
			}
			oBuild, oPost, oAll = append(oBuild, us(b)), append(oPost, us(p)), append(oAll, us(b+p))
		}
		return nil
	}
	runTheirs := func() error {
		if _, err := fmt.Fprintf(in, "run %d\n", iters); err != nil {
			return err
		}
		l, err := rd.ReadString('\n')
		if err != nil {
			return err
		}
		var got [][3]float64
		if err := json.Unmarshal([]byte(l), &got); err != nil {
			return fmt.Errorf("python side: %q: %w", l, err)
		}
		for _, g := range got {
			pIDs, pMake, pXfer = append(pIDs, g[0]*1e6), append(pMake, g[1]*1e6), append(pXfer, g[2]*1e6)
			pAll = append(pAll, (g[0]+g[1]+g[2])*1e6)
		}
		return nil
	}
	// One warm-up round each, untimed.
	if err := runOurs(); err != nil {
		return err
	}
	if err := runTheirs(); err != nil {
		return err
	}
	oBuild, oPost, oAll, pIDs, pMake, pXfer, pAll = nil, nil, nil, nil, nil, nil, nil
	o.prepared = 0
	for r := range rounds {
		first, second := runOurs, runTheirs
		if r%2 == 1 {
			first, second = runTheirs, runOurs
		}
		if err := first(); err != nil {
			return err
		}
		if err := second(); err != nil {
			return err
		}
	}
	w := os.Stdout
	descs, err := o.bl.AppendDescs(nil, o.plan, o.req) // for the report, untimed
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "70b_bs16 tp4to4 %d tokens, fragmented: %d index pairs in %d runs, %d coalesced descriptors; %d of %d posts went prepared\n",
		tokens, len(o.idx), hotpath.IndexRuns(o.idx), len(descs), o.prepared, rounds*iters)
	fmt.Fprintf(w, "%d rounds x %d posts per side, interleaved; GOMAXPROCS %d; medians [p10 p90] in µs\n\n",
		rounds, iters, runtime.GOMAXPROCS(0))
	fmt.Fprintf(w, "| step | kvxfer (Go) | reference (Python, numpy) | ratio |\n|---|---|---|---|\n")
	row(w, "descriptor ids (build + choice / numpy)", oBuild, pIDs)
	fmt.Fprintf(w, "| request creation (make_prepped_xfer) | (in the post call) | %s | |\n", stat(pMake))
	fmt.Fprintf(w, "| post (transfer) | (in the post call) | %s | |\n", stat(pXfer))
	pPost := make([]float64, len(pMake))
	for i := range pMake {
		pPost[i] = pMake[i] + pXfer[i]
	}
	row(w, "request creation + post", oPost, pPost)
	row(w, "end to end", oAll, pAll)
	return nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func stat(v []float64) string {
	s := slices.Sorted(slices.Values(v))
	q := func(p float64) float64 { return s[int(p*float64(len(s)-1))] }
	return fmt.Sprintf("%.1f [%.1f %.1f]", q(0.5), q(0.1), q(0.9))
}

func row(w io.Writer, name string, ours, theirs []float64) {
	m := func(v []float64) float64 { s := slices.Sorted(slices.Values(v)); return s[len(s)/2] }
	fmt.Fprintf(w, "| %s | %s | %s | %.2fx |\n", name, stat(ours), stat(theirs), m(theirs)/m(ours))
}

// poolMemory returns n bytes of anonymous memory as numpy gives the
// reference's pools: mapped, and advised to use transparent huge pages
// (numpy does so for arrays of 4 MiB and more on Linux). A Go slice of
// the same size lives on the Go heap, which is not advised: its post
// moved the same bytes about 20% slower through UCX's cma transport.
func poolMemory(n int) ([]byte, error) {
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	if *hugepages {
		_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	}
	return mem, nil
}
