package kvxfer

import (
	"container/heap"
	"time"
)

// The core's timers: deadlines it arms and fires when the driver's input
// time passes them (runTimers); nextWake tells the driver when to come back.

type timerKind uint8

const (
	tLease timerKind = iota + 1
	tRecvDeadline
	tFence
	tReadRetry
	tProbe
	tRehandshake
)

type timerEntry struct {
	at   time.Time
	kind timerKind
	id   string
}

type timerHeap []timerEntry

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(timerEntry)) }
func (h *timerHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

func (st *loopState) arm(at time.Time, k timerKind, id string) {
	heap.Push(&st.timers, timerEntry{at: at, kind: k, id: id})
}

// timerLive reports whether a timer entry still refers to live state.
func (st *loopState) timerLive(t timerEntry) bool {
	switch t.kind {
	case tLease:
		s := st.sends[t.id]
		return s != nil && s.deadline.Equal(t.at)
	case tRecvDeadline:
		r := st.recvs[t.id]
		return r != nil && r.deadline.Equal(t.at)
	case tFence:
		r := st.recvs[t.id]
		return r != nil && r.fenceBy.Equal(t.at)
	case tProbe:
		e := st.engines[t.id]
		return e != nil && e.watching && e.probeAt.Equal(t.at)
	case tRehandshake:
		e := st.engines[t.id]
		return e != nil && e.refreshing && e.state != hsPending
	case tReadRetry:
		r := st.recvs[t.id]
		if r == nil || r.decided {
			return false
		}
		for _, at := range r.retryAt {
			if at.Equal(t.at) {
				return true
			}
		}
	}
	return false
}
