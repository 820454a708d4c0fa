package kvxfer

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// refHeap is the timer heap through container/heap, the reference the
// unboxed push and pop keep the order of.
type refHeap struct{ timerHeap }

func (h *refHeap) Push(x any) { h.timerHeap = append(h.timerHeap, x.(timerEntry)) }
func (h *refHeap) Pop() any {
	e := h.timerHeap[len(h.timerHeap)-1]
	h.timerHeap = h.timerHeap[:len(h.timerHeap)-1]
	return e
}

// The timer heap's push and pop fire entries in container/heap's order,
// entries due at the same time included (the traces depend on it), over
// random interleavings of pushes, pops and rebuilds.
func TestTimerHeapOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	base := time.Unix(1000, 0)
	for round := range 200 {
		var got timerHeap
		var want refHeap
		for op := range 300 {
			switch r := rng.IntN(10); {
			case r < 6:
				e := timerEntry{at: base.Add(time.Duration(rng.IntN(8)) * time.Millisecond), kind: timerKind(1 + rng.IntN(6)), id: fmt.Sprint(op)}
				got.push(e)
				heap.Push(&want, e)
			case r < 9 && len(got) > 0:
				g, w := got.pop(), heap.Pop(&want).(timerEntry)
				if g != w {
					t.Fatalf("round %d op %d: pop = %+v, container/heap pops %+v", round, op, g, w)
				}
			case r == 9:
				heap.Init(&got)
				heap.Init(&want)
			}
		}
		for len(got) > 0 {
			if g, w := got.pop(), heap.Pop(&want).(timerEntry); g != w {
				t.Fatalf("round %d draining: pop = %+v, container/heap pops %+v", round, g, w)
			}
		}
	}
}
