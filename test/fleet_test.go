package test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/internal/proxy"
)

// fakeVLLM is a P or D OpenAI server that answers at once and counts
// the requests of each transfer id.
type fakeVLLM struct {
	srv  *httptest.Server
	mu   sync.Mutex
	seen map[string]int
}

func newFakeVLLM(t *testing.T) *fakeVLLM {
	f := &fakeVLLM{seen: map[string]int{}}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Params map[string]any `json:"kv_transfer_params"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		if tid, ok := body.Params["transfer_id"].(string); ok {
			f.mu.Lock()
			f.seen[tid]++
			f.mu.Unlock()
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"text":"x"}],"kv_transfer_params":{}}`)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// routed records when the proxy sent a request to which upstream host.
type routed struct {
	mu   sync.Mutex
	at   []time.Time
	host []string
	rt   http.RoundTripper
}

func (r *routed) RoundTrip(req *http.Request) (*http.Response, error) {
	r.mu.Lock()
	r.at, r.host = append(r.at, time.Now()), append(r.host, req.URL.Host)
	r.mu.Unlock()
	return r.rt.RoundTrip(req)
}

// fleetProxy is a proxy over the registry at ep, served on loopback.
func fleetProxy(t *testing.T, ep string, rt http.RoundTripper) (base string, stop func()) {
	fl, stopFleet, err := daemon.ProxyFleet(proxy.FleetFlags{Endpoints: ep, Prefix: "/kvxfer"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	p, err := proxy.New(proxy.Config{Mode: proxy.ModePush, Fleet: fl, Transport: rt, Timeout: 5 * time.Second,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	return srv.URL, func() { srv.Close(); _ = p.Close(); stopFleet() }
}

// register publishes a fake as an instance, under a lease of its own
// (a client of its own: closing it is the instance dying).
func register(t *testing.T, ep string, f *fakeVLLM, id, role string) (*registry.Registrar, *clientv3.Client) {
	cl, err := registry.Dial(registry.ClientConfig{Endpoints: ep})
	if err != nil {
		t.Fatal(err)
	}
	r, err := registry.NewRegistrar(registry.RegistrarConfig{Client: cl, TTL: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(f.srv.URL)
	if err := r.Set([]registry.Entry{{EngineID: id, Role: role, Mode: "push", CompatHash: "h", TPSize: 1, PPSize: 1,
		Ranks: []registry.Rank{{Peer: u.Host}}, Generation: uint64(time.Now().UnixNano()), URL: f.srv.URL}}); err != nil {
		t.Fatal(err)
	}
	return r, cl
}

func post(client *http.Client, base string) int {
	resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi","max_tokens":2}`))
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// A router over the registry picks up a new P and D as they register:
// the first request served through them is logged (bench/RESULTS.md).
func TestRouterPicksUpNewInstance(t *testing.T) {
	etcd := etcdtest.Start(t)
	before := runtime.NumGoroutine()
	func() {
		base, stop := fleetProxy(t, etcd.Endpoint(), http.DefaultTransport)
		defer stop()
		client := &http.Client{Timeout: 10 * time.Second}
		defer client.CloseIdleConnections()
		if code := post(client, base); code != http.StatusServiceUnavailable {
			t.Fatalf("empty fleet: status %d, want 503", code)
		}
		resp, err := client.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, name := range []string{"kvxfer_proxy_fleet_upstreams", "kvxfer_registry_errors_total", "kvxfer_registry_events_total"} {
			if !strings.Contains(string(b), name) {
				t.Errorf("the router's /metrics has no %s", name)
			}
		}
		P, D := newFakeVLLM(t), newFakeVLLM(t)
		rp, cp := register(t, etcd.Endpoint(), P, "p-new", registry.RoleProducer)
		rd, cd := register(t, etcd.Endpoint(), D, "d-new", registry.RoleConsumer)
		registered := time.Now()
		defer func() { _ = rp.Close(context.Background()); _ = rd.Close(context.Background()); cp.Close(); cd.Close() }()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if post(client, base) == http.StatusOK {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the router never served through the new instances")
			}
		}
		t.Logf("a new P and D served traffic through the router %v after they registered", time.Since(registered).Round(time.Millisecond))
		P.srv.Close()
		D.srv.Close()
	}()
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// Churn: 100 instances (P and D) join, leave cleanly, or die (their
// keepalives stop) at random for a bounded time while clients send
// requests through the router. Every request gets exactly one answer,
// every P and D sees each transfer id at most once, and no request is
// routed to an instance more than 1 s after its lease ended (when etcd
// deleted its entry, as watched: at once for a clean leave, about the
// TTL, 2 s, after a death). A slot that rejoins is a new instance (a new
// server, a new generation) under the same engine id.
func TestFleetChurn(t *testing.T) {
	etcd := etcdtest.Start(t)
	rt := &routed{rt: http.DefaultTransport}
	base, stop := fleetProxy(t, etcd.Endpoint(), rt)
	defer stop()
	const n = 100
	ttl := 2 * time.Second
	churn := 4 * time.Second
	if testing.Short() {
		churn = 2 * time.Second
	}
	if s := os.Getenv("KVXFER_CHURN"); s != "" { // the goal's 5 minutes: KVXFER_CHURN=5m
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("KVXFER_CHURN=%q: %v", s, err)
		}
		churn = d
	}
	type slot struct {
		f    *fakeVLLM
		reg  *registry.Registrar
		cl   *clientv3.Client
		role string
		dead bool
		up   bool
	}
	slots := make([]*slot, n)
	ended := map[string]time.Time{} // host -> its lease's end, at the latest
	var died []string               // hosts whose keepalives stopped
	var all []*fakeVLLM
	join := func(i int, s *slot) {
		s.f = newFakeVLLM(t)
		all = append(all, s.f)
		s.reg, s.cl = register(t, etcd.Endpoint(), s.f, "e"+strconv.Itoa(i), s.role)
		s.up = true
	}
	for i := range slots {
		s := &slot{role: registry.RoleProducer}
		if i%2 == 1 {
			s.role = registry.RoleConsumer
		}
		slots[i] = s
		if i < 20 || i%5 == 0 {
			join(i, s)
		}
	}
	time.Sleep(500 * time.Millisecond) // the router sees the first ones
	var sent, answered atomic.Int64
	codes := sync.Map{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := &http.Client{Timeout: 10 * time.Second}
			defer client.CloseIdleConnections()
			for {
				select {
				case <-done:
					return
				default:
				}
				sent.Add(1)
				code := post(client, base)
				answered.Add(1)
				v, _ := codes.LoadOrStore(code, new(atomic.Int64))
				v.(*atomic.Int64).Add(1)
				time.Sleep(2 * time.Millisecond) // leave the churn CPU
			}
		}()
	}
	// When each lease ended: when etcd deleted its key, as a watcher sees
	// it (etcd revokes an expired lease within about half a second of its
	// TTL).
	var leftMu sync.Mutex
	left := map[string]time.Time{}
	wcl, err := registry.Dial(registry.ClientConfig{Endpoints: etcd.Endpoint()})
	if err != nil {
		t.Fatal(err)
	}
	defer wcl.Close()
	wctx, wcancel := context.WithCancel(context.Background())
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for resp := range wcl.Watch(wctx, registry.EnginesPrefix("/kvxfer"), clientv3.WithPrefix()) {
			now := time.Now()
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypeDelete {
					k := string(ev.Kv.Key)
					leftMu.Lock()
					left[k[strings.LastIndexByte(k, '/')+1:]] = now
					leftMu.Unlock()
				}
			}
		}
	}()
	defer func() { wcancel(); <-watched }()
	rng := rand.New(rand.NewPCG(1, 2))
	joins, leaves, deaths := 0, 0, 0
	for end := time.Now().Add(churn); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		i := rng.IntN(n)
		s := slots[i]
		u, _ := url.Parse("http://x")
		if s.f != nil {
			u, _ = url.Parse(s.f.srv.URL)
		}
		switch {
		case !s.up:
			join(i, s)
			joins++
		case rng.IntN(2) == 0: // a clean leave: the lease ends now
			if err := s.reg.Close(context.Background()); err != nil {
				t.Logf("clean leave of %s: %v", u.Host, err)
			}
			ended[u.Host] = time.Now()
			s.cl.Close()
			s.f.srv.Close()
			s.up = false
			leaves++
		default: // a death: keepalives stop, the lease ends within the TTL
			s.cl.Close()
			ended[u.Host] = time.Now().Add(ttl)
			died = append(died, u.Host)
			_ = s.reg.Close(context.Background()) // its revoke fails: the client is closed
			s.f.srv.Close()
			s.up, s.dead = false, true
			deaths++
		}
	}
	close(done)
	wg.Wait()
	for _, s := range slots {
		if s.up {
			_ = s.reg.Close(context.Background())
			s.cl.Close()
		}
	}
	// Every request one answer; every transfer id at most once per side.
	if sent.Load() != answered.Load() {
		t.Errorf("%d requests sent, %d answered", sent.Load(), answered.Load())
	}
	for _, f := range all {
		f.mu.Lock()
		for tid, k := range f.seen {
			if k != 1 {
				t.Errorf("transfer %s reached %s %d times", tid, f.srv.URL, k)
			}
		}
		f.mu.Unlock()
	}
	// The last leases end: each dead instance's key seen going, as etcd
	// revokes its expired lease (about half a second past its TTL, later
	// on a busy machine: a fixed TTL and a second left a lease that ended
	// past it at the test's bound, and a request routed to it while it
	// still stood counted as routed after its end).
	for deadline := time.Now().Add(3*ttl + 10*time.Second); ; time.Sleep(20 * time.Millisecond) {
		var standing []string
		leftMu.Lock()
		for _, h := range died {
			if _, ok := left[h]; !ok {
				standing = append(standing, h)
			}
		}
		leftMu.Unlock()
		if len(standing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the leases of dead instances %v still stand %v after the churn", standing, 3*ttl+10*time.Second)
			break
		}
	}
	leftMu.Lock()
	for h, at := range left {
		if _, ok := ended[h]; ok {
			ended[h] = at // etcd's time (as watched), not the test's bound
		}
	}
	leftMu.Unlock()
	late := 0
	var lag time.Duration // the latest a request was routed past a lease's end
	rt.mu.Lock()
	for i, h := range rt.host {
		if e, ok := ended[h]; ok {
			lag = max(lag, rt.at[i].Sub(e))
		}
		if e, ok := ended[h]; ok && rt.at[i].After(e.Add(time.Second)) {
			late++
			t.Errorf("a request was routed to %s %v after its lease ended", h, rt.at[i].Sub(e).Round(time.Millisecond))
		}
	}
	total := len(rt.host)
	rt.mu.Unlock()
	var summary []string
	codes.Range(func(k, v any) bool {
		summary = append(summary, fmt.Sprintf("%v: %d", k, v.(*atomic.Int64).Load()))
		return true
	})
	t.Logf("churn %v over %d instance slots: %d joins, %d clean leaves, %d deaths; %d requests (%s), %d upstream calls, %d routed more than 1 s after a lease ended (the latest %v after)",
		churn, n, joins, leaves, deaths, sent.Load(), strings.Join(summary, ", "), total, late, lag.Round(time.Millisecond))
}
