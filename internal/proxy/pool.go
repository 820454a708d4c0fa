package proxy

import "sync"

// pool picks upstreams of one role by a policy and counts the requests
// each has in flight through this proxy. It is safe for concurrent use.
type pool struct {
	policy Policy
	mu     struct {
		sync.Mutex
		next     int   // round-robin cursor: where the next scan starts
		inflight []int // per upstream
	}
}

func newPool(policy Policy, n int) *pool {
	p := &pool{policy: policy}
	p.mu.inflight = make([]int, n)
	return p
}

// acquire picks an upstream, leaving out those down reports (nil: none)
// unless all are, and counts a request in flight on it; the caller calls
// release(i) exactly once when that request ends.
func (p *pool) acquire(down func(i int) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	i := p.pickLocked(down)
	if i < 0 {
		i = p.pickLocked(nil) // all down: any may have come back
	}
	p.mu.inflight[i]++
	p.mu.next = (i + 1) % len(p.mu.inflight)
	return i
}

// pickLocked is the policy over the upstreams down does not report
// (nil: all), -1 if none: round-robin takes the first from the cursor;
// least-loaded takes the fewest in flight, scanning from the cursor so
// that ties go round-robin.
func (p *pool) pickLocked(down func(i int) bool) int {
	n := len(p.mu.inflight)
	best := -1
	for k := range n {
		i := (p.mu.next + k) % n
		if down != nil && down(i) {
			continue
		}
		if p.policy != PolicyLeastLoaded {
			return i
		}
		if best < 0 || p.mu.inflight[i] < p.mu.inflight[best] {
			best = i
		}
	}
	return best
}

func (p *pool) release(i int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.inflight[i] <= 0 {
		panic("proxy: pool.release without a matching acquire")
	}
	p.mu.inflight[i]--
}
