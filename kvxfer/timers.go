package kvxfer

import "time"

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

// timerHeap is a min-heap of entries by time, container/heap's algorithm
// on the concrete type (no entry boxed into an interface per push and
// pop: one allocation less per request armed).
type timerHeap []timerEntry

func (h timerHeap) less(i, j int) bool { return h[i].at.Before(h[j].at) }

func (h *timerHeap) push(e timerEntry) {
	*h = append(*h, e)
	h.up(len(*h) - 1)
}

func (h *timerHeap) pop() timerEntry {
	n := len(*h) - 1
	(*h)[0], (*h)[n] = (*h)[n], (*h)[0]
	h.down(0, n)
	e := (*h)[n]
	(*h)[n] = timerEntry{}
	*h = (*h)[:n]
	return e
}

func (h timerHeap) init() {
	n := len(h)
	for i := n/2 - 1; i >= 0; i-- {
		h.down(i, n)
	}
}

func (h timerHeap) up(j int) {
	for {
		i := (j - 1) / 2 // parent
		if i == j || !h.less(j, i) {
			break
		}
		h[i], h[j] = h[j], h[i]
		j = i
	}
}

func (h timerHeap) down(i0, n int) {
	i := i0
	for {
		j1 := 2*i + 1
		if j1 >= n || j1 < 0 {
			break
		}
		j := j1 // left child
		if j2 := j1 + 1; j2 < n && h.less(j2, j1) {
			j = j2
		}
		if !h.less(j, i) {
			break
		}
		h[i], h[j] = h[j], h[i]
		i = j
	}
}

func (st *loopState) arm(at time.Time, k timerKind, id string) {
	st.timers.push(timerEntry{at: at, kind: k, id: id})
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
