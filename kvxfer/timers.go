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
	tGiveUp
	tHoldCheck
)

type timerEntry struct {
	at   time.Time
	kind timerKind
	id   string
}

// timerHeap is a min-heap of entries by time. push and pop are
// container/heap's Push and Pop without their boxing (an entry through an
// interface is an allocation, two per request armed), and keep its order:
// the same sift up and down, so entries due at the same time fire as they
// did.
type timerHeap []timerEntry

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(timerEntry)) }
func (h *timerHeap) Pop() any          { return h.removeLast() }

func (h *timerHeap) push(e timerEntry) {
	*h = append(*h, e)
	h.up(len(*h) - 1)
}

// pop removes and returns the earliest entry; h is not empty.
func (h *timerHeap) pop() timerEntry {
	n := len(*h) - 1
	h.Swap(0, n)
	h.down(0, n)
	return h.removeLast()
}

// removeLast removes the last entry, clearing its slot (its id).
func (h *timerHeap) removeLast() timerEntry {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = timerEntry{}
	*h = old[:len(old)-1]
	return e
}

func (h timerHeap) up(j int) {
	for {
		i := (j - 1) / 2 // parent
		if i == j || !h.Less(j, i) {
			break
		}
		h.Swap(i, j)
		j = i
	}
}

func (h timerHeap) down(i, n int) {
	for {
		j1 := 2*i + 1
		if j1 >= n || j1 < 0 { // j1 < 0 after int overflow
			break
		}
		j := j1 // left child
		if j2 := j1 + 1; j2 < n && h.Less(j2, j1) {
			j = j2 // right child
		}
		if !h.Less(j, i) {
			break
		}
		h.Swap(i, j)
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
		s := st.sends.get(t.id)
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
	case tGiveUp:
		r := st.recvs[t.id]
		return r != nil && r.giveUpAt.Equal(t.at)
	case tHoldCheck:
		r := st.recvs[t.id]
		return r != nil && !r.decided && r.hc != nil && r.hc.next.Equal(t.at)
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
