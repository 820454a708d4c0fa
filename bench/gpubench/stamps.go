package main

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/kvxfer/kvxfer/internal/hoptrace"
	"github.com/kvxfer/kvxfer/internal/netxfer"
)

// Where the same-host path's time goes, hop by hop: the destination (the
// child) stamps its GPU batches as its agent makes, posts and sees them
// done (a device wrapper: netxfer itself is not touched), the source (the
// parent) stamps its post and the moment it saw the transfer done, both
// with CLOCK_MONOTONIC (hoptrace.Now), which the two processes share.

// batchStamp is one batch on the destination's device.
type batchStamp struct {
	Made, Posted, Done int64 // NewBatch called, Post returned, Done first true
}

// stampLog collects the child's batch stamps until the parent fetches
// them (the "stamps" request).
var stampLog struct {
	sync.Mutex
	list []*batchStamp
}

func takeStamps() []batchStamp {
	stampLog.Lock()
	defer stampLog.Unlock()
	out := make([]batchStamp, len(stampLog.list))
	for i, s := range stampLog.list {
		out[i] = *s
	}
	stampLog.list = stampLog.list[:0]
	return out
}

// stampGPU is a gpu whose batches are stamped.
type stampGPU struct{ gpu }

func (g stampGPU) NewBatch(n int) (netxfer.DevBatch, error) {
	s := &batchStamp{Made: hoptrace.Now()}
	b, err := g.gpu.NewBatch(n)
	if err != nil {
		return nil, err
	}
	return &stampBatch{b: b, s: s}, nil
}

type stampBatch struct {
	b netxfer.DevBatch
	s *batchStamp
}

func (b *stampBatch) Add(dst, src, n uint64) bool { return b.b.Add(dst, src, n) }

func (b *stampBatch) AddLayout(regions []netxfer.DevRegion, entries []netxfer.DevEntry) bool {
	lb, ok := b.b.(netxfer.LayoutBatch)
	return ok && lb.AddLayout(regions, entries)
}

func (b *stampBatch) Discard() { b.b.Discard() }

func (b *stampBatch) Post() (netxfer.DevCopy, error) {
	c, err := b.b.Post()
	b.s.Posted = hoptrace.Now()
	if err != nil {
		return nil, err
	}
	stampLog.Lock()
	stampLog.list = append(stampLog.list, b.s)
	stampLog.Unlock()
	return &stampCopy{c: c, s: b.s}, nil
}

type stampCopy struct {
	c  netxfer.DevCopy
	s  *batchStamp
	mu sync.Mutex
}

func (c *stampCopy) Done() (bool, error) {
	done, err := c.c.Done()
	if done {
		c.mu.Lock()
		if c.s.Done == 0 {
			c.s.Done = hoptrace.Now()
		}
		c.mu.Unlock()
	}
	return done, err
}

// hopNames are the hops of a same-host transfer, in order.
var hopNames = []string{
	"P post -> D's batch made (the part's way to D, D's checks)",
	"D's batch made -> posted (staging, launch)",
	"D posted -> D saw it done (the GPU, D's poller)",
	"D saw it done -> P saw it done (D's answer, P's wake-up)",
	"total: P post -> P saw it done",
}

// hopsOf pairs the parent's transfers (post and done-seen times, in
// order) with the child's batch stamps: a transfer's batches are those
// made while it was under way (the first made, the last posted and done).
// It returns, per hop, the microseconds of each transfer that had its
// batches, the warm-up ones left out.
func hopsOf(times [][2]int64, stamps []batchStamp, warmup int) [][]float64 {
	out := make([][]float64, len(hopNames))
	for i, t := range times {
		if i < warmup {
			continue
		}
		var made, posted, done int64
		for _, s := range stamps {
			if s.Made < t[0] || s.Made > t[1] || s.Done == 0 {
				continue
			}
			if made == 0 || s.Made < made {
				made = s.Made
			}
			posted, done = max(posted, s.Posted), max(done, s.Done)
		}
		if made == 0 {
			continue
		}
		for h, d := range []int64{made - t[0], posted - made, done - posted, t[1] - done, t[1] - t[0]} {
			out[h] = append(out[h], float64(d)/1e3)
		}
	}
	return out
}

// hopReport is one contender's hops on one case.
type hopReport struct {
	name string
	c    xcase
	hops [][]float64
}

// reportHops prints the hop table: a row per contender, case and hop,
// the median (min-max) microseconds.
func reportHops(w io.Writer, reps []hopReport) {
	if len(reps) == 0 {
		return
	}
	fmt.Fprintf(w, "\nSame-host hops, microseconds, median (min-max) of the timed transfers (CLOCK_MONOTONIC stamps: P's post and done-seen, D's GPU batches)\n\n")
	fmt.Fprintf(w, "| contender | case | hop | n | median | min-max |\n| --- | --- | --- | --- | --- | --- |\n")
	for _, r := range reps {
		for h, xs := range r.hops {
			if len(xs) == 0 {
				continue
			}
			s := slices.Clone(xs)
			slices.Sort(s)
			fmt.Fprintf(w, "| %s | %s | %s | %d | %.1f | %.1f-%.1f |\n", r.name, r.c, hopNames[h], len(s), s[len(s)/2], s[0], s[len(s)-1])
		}
	}
}

func encodeStamps(s []batchStamp) []byte {
	b, _ := json.Marshal(s)
	return b
}
