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
// done (a device wrapper), both agents stamp each WRITE part's way
// (netxfer's WireTrace: the part's frame written and read, its answer
// written and read), and the source (the parent) stamps its post and the
// moment it saw the transfer done; all with CLOCK_MONOTONIC
// (hoptrace.Now), which the two processes share.

// batchStamp is one batch on the destination's device.
type batchStamp struct {
	Made, Posted, Done int64 // NewBatch called, Post returned, Done first true
}

// stampList collects stamps of one kind until they are taken (the
// child's, by the parent's "stamps" request). It is safe for concurrent
// use.
type stampList[T any] struct {
	mu   sync.Mutex
	list []T
}

func (l *stampList[T]) add(v T) {
	l.mu.Lock()
	l.list = append(l.list, v)
	l.mu.Unlock()
}

// take returns the stamps so far and empties the list.
func (l *stampList[T]) take() []T {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.list
	l.list = nil
	return out
}

// childBatches is the child's batches, each logged once it was seen done.
var childBatches stampList[batchStamp]

// stampGPU is a gpu whose batches are stamped.
type stampGPU struct{ gpu }

func (g stampGPU) NewBatch(n int) (netxfer.DevBatch, error) {
	made := hoptrace.Now()
	b, err := g.gpu.NewBatch(n)
	if err != nil {
		return nil, err
	}
	return &stampBatch{b: b, s: batchStamp{Made: made}}, nil
}

type stampBatch struct {
	b netxfer.DevBatch
	s batchStamp
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
	return &stampCopy{c: c, s: b.s}, nil
}

// stampCopy logs its batch (childBatches) the first time it is seen done.
type stampCopy struct {
	c    netxfer.DevCopy
	s    batchStamp
	once sync.Once
}

func (c *stampCopy) Done() (bool, error) {
	done, err := c.c.Done()
	if done {
		c.once.Do(func() {
			c.s.Done = hoptrace.Now()
			childBatches.add(c.s)
		})
	}
	return done, err
}

// wireStamp is one point of a part's way (netxfer.WireEvent) on one side.
type wireStamp struct {
	Ev   netxfer.WireEvent
	ID   netxfer.XferID // the sender's transfer
	Part uint32
	T    int64
}

// wireLog collects an agent's wire stamps (netxfer's WireTrace).
type wireLog struct{ stampList[wireStamp] }

// trace is a netxfer.Config.WireTrace.
func (l *wireLog) trace(ev netxfer.WireEvent, id netxfer.XferID, part uint32) {
	l.add(wireStamp{ev, id, part, hoptrace.Now()})
}

// childWire is the child's agents' wire stamps, fetched with its batch
// stamps (the "stamps" request).
var childWire wireLog

// childStamps is what the child answers a "stamps" request with.
type childStamps struct {
	Batches []batchStamp
	Wire    []wireStamp
	Notes   []int64 // when the one-sided sketch's notifications arrived
}

// xferTimes is one of the parent's transfers: its id, its post and when
// the parent saw it done.
type xferTimes struct {
	id           netxfer.XferID
	posted, seen int64
}

// hopNames are the hops of a same-host transfer, in order.
var hopNames = []string{
	"P post -> part sent (P: the part's frame made and written)",
	"part sent -> D read it (the wake-up of D's connection)",
	"D read it -> D's batch made (D's checks)",
	"D's batch made -> posted (staging, launch)",
	"D posted -> D saw it done (the GPU, D's poller)",
	"D saw it done -> D's answer sent (the answer's goroutine, its write)",
	"D's answer sent -> P read it (the wake-up of P's connection)",
	"P read it -> P saw it done (the wake-up of P's waiter)",
	"total: P post -> P saw it done",
}

// hopsOf pairs the parent's transfers (by id and time) with the wire
// stamps of both sides (by transfer id: the first part's frame written
// and read, the last answer written and read) and the child's batch
// stamps (those made while the transfer was under way: the first made,
// the last posted and done). It returns, per hop, the microseconds of
// each transfer that had all its stamps, the warm-up ones left out.
func hopsOf(times []xferTimes, wire []wireStamp, child childStamps, warmup int) [][]float64 {
	ways := wireWays(append(slices.Clone(wire), child.Wire...))
	out := make([][]float64, len(hopNames))
	for i, t := range times {
		if i < warmup {
			continue
		}
		w := ways[t.id]
		var made, posted, done int64
		for _, s := range child.Batches {
			if s.Made < t.posted || s.Made > t.seen || s.Done == 0 {
				continue
			}
			made = firstOf(made, s.Made)
			posted, done = max(posted, s.Posted), max(done, s.Done)
		}
		if made == 0 || w == nil || w.sent == 0 || w.read == 0 || w.ansSent == 0 || w.ansRead == 0 {
			continue
		}
		for h, d := range []int64{w.sent - t.posted, w.read - w.sent, made - w.read, posted - made, done - posted,
			w.ansSent - done, w.ansRead - w.ansSent, t.seen - w.ansRead, t.seen - t.posted} {
			out[h] = append(out[h], float64(d)/1e3)
		}
	}
	return out
}

// wireWay is a transfer's way out and back as its wire stamps tell it:
// its first part sent and read, its last answer sent and read.
type wireWay struct{ sent, read, ansSent, ansRead int64 }

// wireWays gathers stamps by transfer.
func wireWays(stamps []wireStamp) map[netxfer.XferID]*wireWay {
	ways := map[netxfer.XferID]*wireWay{}
	for _, s := range stamps {
		w := ways[s.ID]
		if w == nil {
			w = &wireWay{}
			ways[s.ID] = w
		}
		switch s.Ev {
		case netxfer.WirePartSent:
			w.sent = firstOf(w.sent, s.T)
		case netxfer.WirePartRead:
			w.read = firstOf(w.read, s.T)
		case netxfer.WireAnswerSent:
			w.ansSent = max(w.ansSent, s.T)
		case netxfer.WireAnswerRead:
			w.ansRead = max(w.ansRead, s.T)
		}
	}
	return ways
}

// firstOf is the earlier of a stamp so far (0: none) and t.
func firstOf(so int64, t int64) int64 {
	if so == 0 || t < so {
		return t
	}
	return so
}

// hopReport is one contender's hops on one case.
type hopReport struct {
	name  string
	c     xcase
	names []string // of the hops
	hops  [][]float64
}

// reportHops prints the hop table: a row per contender, case and hop,
// the median (min-max) microseconds.
func reportHops(w io.Writer, reps []hopReport) {
	if len(reps) == 0 {
		return
	}
	fmt.Fprintf(w, "\nSame-host hops, microseconds, median (min-max) of the timed transfers (CLOCK_MONOTONIC stamps: P's post and done-seen, both agents' part frames and answers, D's GPU batches)\n\n")
	fmt.Fprintf(w, "| contender | case | hop | n | median | min-max |\n| --- | --- | --- | --- | --- | --- |\n")
	for _, r := range reps {
		for h, xs := range r.hops {
			if len(xs) == 0 {
				continue
			}
			med, lo, hi := spread(xs)
			fmt.Fprintf(w, "| %s | %s | %s | %d | %.1f | %.1f-%.1f |\n", r.name, r.c, r.names[h], len(xs), med, lo, hi)
		}
	}
}

func encodeStamps(s childStamps) []byte {
	b, _ := json.Marshal(s)
	return b
}
