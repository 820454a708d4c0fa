package nixl

import (
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/finesleep"
)

// polls is the process's poller of NIXL Backends. NIXL has no completion
// callback, so every Backend is polled for notifications and finished
// transfers, each at its own pace (pollAfter); one goroutine polls them
// all, on a thread of its own, so that a process with many Backends (a
// kvxferd serving several ranks) pays one thread's wake-ups per round,
// not one per Backend: a wake-up is what a round costs (about 25 µs of
// CPU on the 2-vCPU CI machine, against 0.1 µs for the NIXL calls).
//
// Pauses under a millisecond are slept in nanosleep (finesleep): Go's
// timers would wake an otherwise idle process only a millisecond later,
// and a 50 µs interval became a millisecond at each hop of a transfer.
// A Backend's woken ends a longer pause at once.
var polls = poller{wake: make(chan struct{}, 1)}

type poller struct {
	wake chan struct{}
	mu   sync.Mutex
	set  []*Backend
	// running: the loop runs (it ends when the set is empty).
	running bool
}

// add has n polled from now on.
func (p *poller) add(n *Backend) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.set = append(p.set, n)
	if !p.running {
		p.running = true
		go p.loop()
	}
	p.wakeUp()
}

// remove stops polling n; once it returns, no round of n runs or will.
// The loop, woken, ends soon after its last Backend left.
func (p *poller) remove(n *Backend) {
	p.mu.Lock()
	p.set = slices.DeleteFunc(p.set, func(m *Backend) bool { return m == n })
	p.mu.Unlock()
	p.wakeUp()
	n.round.Lock() // a round under way ends first
	n.round.out = true
	n.round.Unlock()
}

// wakeUp ends the loop's pause if it is waiting on a timer.
func (p *poller) wakeUp() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *poller) loop() {
	// The loop keeps its thread while it runs, the thread's timer slack
	// tightened so that short pauses end on time.
	defer finesleep.Tighten()()
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	var set []*Backend
	for {
		p.mu.Lock()
		if len(p.set) == 0 {
			p.running = false
			p.mu.Unlock()
			return
		}
		set = append(set[:0], p.set...)
		p.mu.Unlock()
		now := time.Now()
		next := now.Add(idlePoll)
		for _, n := range set {
			if due := n.due.Load(); due <= now.UnixNano() {
				n.round.Lock()
				if !n.round.out {
					n.due.Store(now.Add(n.pollRound()).UnixNano())
				}
				n.round.Unlock()
			}
			if due := time.Unix(0, n.due.Load()); due.Before(next) {
				next = due
			}
		}
		clear(set) // no Backend kept alive by the buffer
		d := time.Until(next)
		switch {
		case d <= 0:
		case d < finesleep.Fine:
			finesleep.Sleep(d)
			select {
			case <-p.wake: // no pause left to end: drop it
			default:
			}
		default:
			t.Reset(d)
			select {
			case <-t.C:
			case <-p.wake:
			}
		}
	}
}
