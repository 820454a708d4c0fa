package proxy

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Passive health: an upstream whose connection fails (no response at
// all: refused, reset, closed before answering) is left out of the picks
// for a while, doubling from healthMinDown to healthMaxDown while it keeps
// failing, so that requests go to the live servers instead of failing in
// turn (round-robin) or nearly all of them (least-loaded: a dead server
// has none in flight, so it always looks the least loaded). Once its time
// is out it is picked again; its first response makes it up. Where every
// candidate is down, the picks ignore health (a request that may fail
// beats a refusal when all may have come back). Timeouts and HTTP
// statuses are not counted: a slow or refusing server is alive.
const (
	healthMinDown = time.Second
	healthMaxDown = 30 * time.Second
)

// health is one upstream's. It is safe for concurrent use.
type health struct {
	now func() time.Time
	up  prometheus.Gauge // 1 up, 0 down
	mu  struct {
		sync.Mutex
		fails int       // connection failures in a row
		until time.Time // down until then
	}
}

func newHealth(now func() time.Time, up prometheus.Gauge) *health {
	up.Set(1)
	return &health{now: now, up: up}
}

// down reports whether the upstream is left out of the picks now.
func (h *health) down() bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.now().Before(h.mu.until)
}

// failed notes a connection failure and returns for how long the
// upstream is down.
func (h *health) failed() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.mu.fails++
	d := healthMaxDown
	if h.mu.fails <= 6 { // 1 s << 5 = 32 s: the cap from then on
		d = min(healthMinDown<<(h.mu.fails-1), healthMaxDown)
	}
	h.mu.until = h.now().Add(d)
	h.up.Set(0)
	return d
}

// answered notes a response and reports whether the upstream was down
// (failures noted since its last response).
func (h *health) answered() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	was := h.mu.fails > 0
	h.mu.fails, h.mu.until = 0, time.Time{}
	h.up.Set(1)
	return was
}
