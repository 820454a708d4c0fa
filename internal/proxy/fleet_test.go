package proxy

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeFleet is a Fleet a test changes.
type fakeFleet struct {
	mu      sync.Mutex
	list    []Instance
	changed chan struct{}
}

func newFakeFleet() *fakeFleet { return &fakeFleet{changed: make(chan struct{})} }

func (f *fakeFleet) Instances() []Instance {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.list)
}

func (f *fakeFleet) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

func (f *fakeFleet) set(list ...Instance) {
	f.mu.Lock()
	f.list = list
	close(f.changed)
	f.changed = make(chan struct{})
	f.mu.Unlock()
}

// fleetEnv is newEnv whose fakes are a fleet's instances rather than
// fixed lists; inst makes the instance of a fake in a group.
func fleetEnv(t *testing.T, mode Mode, nP, nD int) (*env, *fakeFleet) {
	fl := newFakeFleet()
	e := newEnv(t, mode, nP, nD, func(c *Config) {
		c.Prefill, c.Decode, c.Fleet, c.Policy = nil, nil, fl, ""
	})
	return e, fl
}

func inst(f *fake, group string) Instance {
	return instIn(ModePush, f, group)
}

func instIn(mode Mode, f *fake, group string) Instance {
	return Instance{ID: f.name, URL: f.srv.URL, Group: group, Mode: mode, Prefill: f.role == rolePrefill, Decode: f.role == roleDecode,
		Engine: "engine-" + f.name, KVHost: "10.0.0.1", KVPort: 7400, TP: 1}
}

// waitFleet waits until the proxy routes over n prefill and m decode
// instances.
func waitFleet(t *testing.T, p *Proxy, n, m int) {
	t.Helper()
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if tb := p.fleet.table.Load(); len(tb.prefill) == n && len(tb.decode) == m {
			return
		}
	}
	t.Fatalf("the proxy's fleet never had %d prefill and %d decode instances", n, m)
}

// pairs sends n requests and returns the (P, D) pair each went to.
func pairs(t *testing.T, e *env, n int) [][2]string {
	t.Helper()
	ctx := testCtx(t)
	before := len(e.log.snapshot())
	for range n {
		if code, body := e.do(ctx, "/v1/completions", `{"prompt":"hi","max_tokens":4}`); code != http.StatusOK {
			t.Fatalf("status %d: %s", code, body)
		}
	}
	var out [][2]string
	pOf := map[any]string{}
	reqs := e.log.snapshot()[before:]
	for _, g := range reqs {
		if params, _ := g.body["kv_transfer_params"].(map[string]any); g.server[0] == 'p' {
			pOf[params["transfer_id"]] = g.server
		}
	}
	for _, g := range reqs {
		if params, _ := g.body["kv_transfer_params"].(map[string]any); g.server[0] == 'd' {
			out = append(out, [2]string{pOf[params["transfer_id"]], g.server})
		}
	}
	if len(out) != n {
		t.Fatalf("%d requests reached D, want %d", len(out), n)
	}
	return out
}

// The proxy routes over a fleet's instances: only P and D of one group
// (compatibility hash and mode) pair, an instance that joins is routed to
// once the fleet says so, one that leaves is not, an instance of another
// mode never is, and with no pair a request gets 503.
func TestFleetRoutesCompatiblePairs(t *testing.T) {
	e, fl := fleetEnv(t, ModePush, 2, 2)
	p0, p1, d0, d1 := e.ps[0], e.ps[1], e.ds[0], e.ds[1]
	pull := inst(d1, "B")
	pull.Mode = ModePull
	fl.set(inst(p0, "A"), inst(p1, "B"), inst(d0, "A"), pull)
	waitFleet(t, e.p, 2, 1)
	for _, pr := range pairs(t, e, 4) {
		if pr != [2]string{"p0", "d0"} {
			t.Errorf("request went to %v, want p0 and d0 (the only pair of one group and mode)", pr)
		}
	}
	fl.set(inst(p0, "A"), inst(p1, "B"), inst(d0, "A"), inst(d1, "B"))
	waitFleet(t, e.p, 2, 2)
	seen := map[[2]string]int{}
	for _, pr := range pairs(t, e, 6) {
		seen[pr]++
	}
	if len(seen) != 2 || seen[[2]string{"p0", "d0"}] == 0 || seen[[2]string{"p1", "d1"}] == 0 {
		t.Errorf("pairs %v, want both p0-d0 and p1-d1 and nothing else", seen)
	}
	fl.set(inst(p1, "B"), inst(d0, "A"), inst(d1, "B"))
	waitFleet(t, e.p, 1, 2)
	for _, pr := range pairs(t, e, 3) {
		if pr != [2]string{"p1", "d1"} {
			t.Errorf("request went to %v after p0 left, want p1 and d1", pr)
		}
	}
	fl.set()
	waitFleet(t, e.p, 0, 0)
	if code, body := e.do(testCtx(t), "/v1/completions", `{"prompt":"hi"}`); code != http.StatusServiceUnavailable {
		t.Errorf("empty fleet: status %d (%s), want 503", code, body)
	}
}

// Within a group the proxy takes the instance with the fewest requests
// in flight (pull: P is in flight on its own).
func TestFleetLeastInFlight(t *testing.T) {
	e, fl := fleetEnv(t, ModePull, 2, 1)
	release := make(chan struct{})
	arrived := make(chan string, 2)
	for _, f := range e.ps {
		f.setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
			arrived <- f.name
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return false
		})
	}
	fl.set(instIn(ModePull, e.ps[0], "A"), instIn(ModePull, e.ps[1], "A"), instIn(ModePull, e.ds[0], "A"))
	waitFleet(t, e.p, 2, 1)
	ctx, cancel := context.WithTimeout(testCtx(t), wait)
	defer cancel()
	var wg sync.WaitGroup
	var got []string
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.do(ctx, "/v1/completions", `{"prompt":"hi"}`)
		}()
		select {
		case name := <-arrived: // in flight at its P until release
			got = append(got, name)
		case <-time.After(wait):
			close(release)
			wg.Wait()
			t.Fatalf("requests reached P: %v, want 2", got)
		}
	}
	close(release)
	wg.Wait()
	first, second := got[0], got[1]
	if first == second {
		t.Errorf("both requests went to %s while the other P had none in flight", first)
	}
}

// An instance of both roles is never paired with itself.
func TestFleetNoSelfPair(t *testing.T) {
	e, fl := fleetEnv(t, ModePush, 1, 1)
	both := inst(e.ps[0], "A")
	both.Decode = true
	fl.set(both)
	waitFleet(t, e.p, 1, 1)
	if code, body := e.do(testCtx(t), "/v1/completions", `{"prompt":"hi"}`); code != http.StatusServiceUnavailable {
		t.Errorf("one instance of both roles: status %d (%s), want 503", code, body)
	}
	fl.set(both, inst(e.ds[0], "A"))
	waitFleet(t, e.p, 1, 2)
	for _, pr := range pairs(t, e, 3) {
		if pr != [2]string{"p0", "d0"} {
			t.Errorf("request went to %v, want p0 and d0", pr)
		}
	}
}
