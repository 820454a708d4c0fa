package proxy

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// active is how many admitted requests have not ended.
func (p *Proxy) activeNow() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mu.active
}

// waitIdle waits up to d for every admitted request to end.
func waitIdle(p *Proxy, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for p.activeNow() != 0 {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

// A client that stops reading a stream cannot hold its request (its
// MaxConcurrent slot, its goroutine, its D in-flight count, Close) past
// Config.Timeout: once the upstream request ends, a write blocked on the
// client gives up.
func TestStalledClientBoundedByTimeout(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 1, 1, func(c *Config) { c.Timeout = 300 * time.Millisecond })
			dGone := make(chan struct{})
			e.ds[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
				defer close(dGone)
				w.Header().Set("Content-Type", "text/event-stream")
				chunk := "data: " + strings.Repeat("x", 64<<10) + "\n\n"
				for r.Context().Err() == nil {
					if _, err := io.WriteString(w, chunk); err != nil {
						return true
					}
					w.(http.Flusher).Flush()
				}
				return true
			})
			// A raw client: it sends its request and never reads the answer.
			conn, err := net.Dial("tcp", strings.TrimPrefix(e.url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			body := `{"prompt":"x","stream":true}`
			fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
				epCompletions.path, len(body), body)
			select {
			case <-dGone: // the proxy gave up on D (its Timeout)
			case <-time.After(wait):
				t.Fatal("D's request did not end")
			}
			if !waitIdle(e.p, wait) {
				t.Errorf("the request of a client that stopped reading is still in flight %v after its upstream request ended (Timeout 300ms)", wait)
			}
		})
	}
}

// A fleet instance the proxy does not route to (another mode, a bad URL,
// past MaxFleet) is counted and logged once, not again at every change of
// the fleet: kvxfer_proxy_fleet_refused_total counts instances, and a
// registry that changes often (a churn of other instances) must not turn
// one bad entry into a log line per change.
func TestFleetRefusalsCountedOnce(t *testing.T) {
	var buf syncBuffer
	fl := newFakeFleet()
	e := newEnv(t, ModePush, 1, 2, func(c *Config) {
		c.Prefill, c.Decode, c.Fleet, c.Policy, c.MaxFleet = nil, nil, fl, "", 5
		c.Logger = slog.New(slog.NewTextHandler(&buf, nil))
	})
	other := inst(e.ds[1], "A")
	other.ID, other.Mode = "pull-one", ModePull
	badURL := inst(e.ds[1], "A")
	badURL.ID, badURL.URL = "bad-url", "ftp://x"
	extra := inst(e.ds[1], "A") // the fifth routed: MaxFleet's last
	extra.ID = "extra"
	past := inst(e.ds[1], "A")
	past.ID = "past-bound"
	good := []Instance{inst(e.ps[0], "A"), inst(e.ds[0], "A"), inst(e.ds[1], "A")}
	const changes = 10
	for i := range changes {
		churn := inst(e.ps[0], "A") // an instance that changes: a fleet change
		churn.ID, churn.TP = "churn", 1+i%2
		fl.set(append(slices.Clone(good), churn, other, badURL, extra, past)...)
		waitJoins(t, e.p, float64(len(good)+2+i))
	}
	for _, reason := range []string{"mode", "bad_url", "max_fleet"} {
		if n := counterValue(e.p.fleet.m.refused.WithLabelValues(reason)); n != 1 {
			t.Errorf("kvxfer_proxy_fleet_refused_total{reason=%q} = %v after %d fleet changes, want 1 (one instance)", reason, n, changes)
		}
	}
	for _, msg := range []string{"fleet instance refused", "fleet past its bound"} {
		if n := strings.Count(buf.String(), msg); n != 1 {
			t.Errorf("%q logged %d times after %d fleet changes, want once", msg, n, changes)
		}
	}
}

// waitJoins waits for the fleet router to have counted n joins.
func waitJoins(t *testing.T, p *Proxy, n float64) {
	t.Helper()
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if counterValue(p.fleet.m.changes.WithLabelValues("join")) >= n {
			return
		}
	}
	t.Fatalf("the fleet router never counted %v joins", n)
}

// In push, once D's response is whole the client's response ends: a P
// that has not answered by then (stuck in its queue while D gave up
// waiting for the KV and recomputed) does not hold the client's response
// open until Config.Timeout, and P's request, of no use any more, is
// cancelled.
func TestPushDecodeDoneDoesNotWaitOutPrefill(t *testing.T) {
	e := newEnv(t, ModePush, 1, 1, nil) // Timeout: the default, 10 minutes
	pw := newCancelWatch()
	e.ps[0].setHook(pw.hook(false))
	ctx, cancel := context.WithTimeout(testCtx(t), wait)
	defer cancel()
	start := time.Now()
	resp := e.post(ctx, epCompletions.path, `{"prompt":"x","stream":true}`)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK || string(body) != wantStream {
		t.Fatalf("response = %d %q, %v after %v; want D's whole stream, ended", resp.StatusCode, body, err, time.Since(start).Round(time.Millisecond))
	}
	pw.check(t, "P")
}
