package proxy

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A client's min_tokens must not reach P beside P's max_tokens 1: vLLM
// refuses min_tokens > max_tokens ("min_tokens must be less than or equal
// to max_tokens"), which failed a valid request with 502. D keeps it.
func TestPrefillMinTokens(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		for _, ep := range []endpoint{epCompletions, epChat} {
			t.Run(string(mode)+ep.path, func(t *testing.T) {
				e := newEnv(t, mode, 1, 1, nil)
				// As vLLM's SamplingParams checks it.
				e.ps[0].setHook(func(w http.ResponseWriter, _ *http.Request, body map[string]any) bool {
					minT, _ := numberOf(body["min_tokens"])
					maxT, ok := numberOf(body["max_tokens"])
					if ok && minT > maxT {
						http.Error(w, fmt.Sprintf("min_tokens must be less than or equal to max_tokens=%v, got %v", maxT, minT), http.StatusBadRequest)
						return true
					}
					return false
				})
				body := `{"prompt":"x","max_tokens":50,"min_tokens":10}`
				if ep.chat {
					body = `{"messages":[],"max_completion_tokens":50,"min_tokens":10}`
				}
				if status, resp := e.do(testCtx(t), ep.path, body); status != http.StatusOK {
					t.Fatalf("status = %d (%s), want 200", status, resp)
				}
				if d := e.log.of(roleDecode); len(d) != 1 || fmt.Sprint(d[0].body["min_tokens"]) != "10" {
					t.Errorf("D's requests = %+v, want one with the client's min_tokens 10", d)
				}
			})
		}
	}
}

func numberOf(v any) (float64, bool) {
	switch n := v.(type) {
	case interface{ Float64() (float64, error) }:
		f, err := n.Float64()
		return f, err == nil
	case float64:
		return n, true
	}
	return 0, false
}

// A request for several sequences (n > 1, best_of > 1, beam search) is
// refused with 400 naming the field and value, and asks no upstream: each
// sequence is a child request of its own in vLLM carrying the one
// transfer id (push: P's and D's children would all register under it,
// one pairing and the rest waiting out their lease; pull: D's children
// would all read the one P request's blocks, freed after the first). One
// sequence passes.
func TestSeveralSequencesRefused(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 1, 1, nil)
			ctx := testCtx(t)
			for _, tc := range []struct {
				body, field string
			}{
				{`{"prompt":"x","n":2}`, "n"},
				{`{"prompt":"x","n":"2"}`, "n"},
				{`{"prompt":"x","best_of":3}`, "best_of"},
				{`{"prompt":"x","use_beam_search":true}`, "use_beam_search"},
				// A batch of prompts: one engine request each, all with
				// the one transfer id (pull: D's would all get the params
				// of P's first prompt, the KV of another prompt).
				{`{"prompt":["a","b"]}`, "prompt"},
				{`{"prompt":[[1,2],[3]]}`, "prompt"},
				{`{"prompt":"a","prompt_embeds":"AAAA"}`, "prompt"},
				{`{"prompt_embeds":["AAAA","BBBB"]}`, "prompt_embeds"},
			} {
				status, resp := e.do(ctx, epCompletions.path, tc.body)
				if status != http.StatusBadRequest || !strings.Contains(resp, tc.field) {
					t.Errorf("%s: response = %d %s, want 400 naming %s", tc.body, status, resp, tc.field)
				}
			}
			if n := len(e.log.snapshot()); n != 0 {
				t.Errorf("upstreams got %d requests, want 0", n)
			}
			for _, body := range []string{`{"prompt":"x","n":1}`, `{"prompt":"x","n":null,"best_of":1,"use_beam_search":false}`,
				`{"prompt":["a"]}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1,2]]}`} {
				if status, resp := e.do(ctx, epCompletions.path, body); status != http.StatusOK {
					t.Errorf("%s: status = %d (%s), want 200", body, status, resp)
				}
			}
			want := fmt.Sprintf(`kvxfer_proxy_requests_total{endpoint="/v1/completions",mode="%s",outcome="bad_request"} 8`, mode)
			if m := e.metrics(); !strings.Contains(m, want) {
				t.Errorf("/metrics lacks %q", want)
			}
		})
	}
}

func (e *env) metrics() string {
	e.t.Helper()
	resp, err := e.client.Get(e.url + "/metrics")
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// deadListener closes every connection it accepts while dead is set: a
// server that is down (no response, as if refused).
type deadListener struct {
	net.Listener
	dead *atomic.Bool
}

func (l deadListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || !l.dead.Load() {
			return c, err
		}
		c.Close()
	}
}

// fakeClock is a clock a test moves.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// An upstream that is down (its connections fail) is left out for a
// while, so that requests go to the live ones instead of failing in turn
// (round-robin) or nearly all (least-loaded: a dead server has none in
// flight); once its time is out it is tried again, and used again once
// it answers. /metrics says which are up.
func TestDeadUpstreamAvoided(t *testing.T) {
	for _, role := range []string{rolePrefill, roleDecode} {
		for _, policy := range []Policy{PolicyRoundRobin, PolicyLeastLoaded} {
			t.Run(role+"/"+string(policy), func(t *testing.T) {
				var dead atomic.Bool
				dead.Store(true)
				clock := &fakeClock{t: time.Unix(1e9, 0)}
				f := &fake{name: role[:1] + "x", role: role, log: &reqLog{}}
				f.srv = httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
				f.srv.Listener = deadListener{f.srv.Listener, &dead}
				f.srv.Start()
				t.Cleanup(f.srv.Close)
				e := newEnv(t, ModePull, 1, 1, func(c *Config) {
					c.Policy, c.now = policy, clock.now
					if role == rolePrefill {
						c.Prefill = append(c.Prefill, Prefill{URL: f.srv.URL})
					} else {
						c.Decode = append(c.Decode, f.srv.URL)
					}
				})
				ctx := testCtx(t)
				// A request in flight on the live server, for least-loaded
				// to count (pull: P's answer waits).
				busy := e.ps[0]
				if role == roleDecode {
					busy = e.ds[0]
				}
				arrived, release := make(chan struct{}), make(chan struct{})
				var once sync.Once
				busy.setHook(func(w http.ResponseWriter, r *http.Request, body map[string]any) bool {
					if fmt.Sprint(body["prompt"]) == "hold" {
						once.Do(func() { close(arrived) })
						waitFor(r.Context(), release)
					}
					return false
				})
				held := make(chan int, 1)
				go func() {
					status, _ := e.do(ctx, epCompletions.path, `{"prompt":"hold"}`)
					held <- status
				}()
				if !waitFor(ctx, arrived) {
					t.Fatal("the held request did not arrive")
				}
				failed := 0
				for range 8 {
					if status, _ := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
						failed++
					}
				}
				if failed > 1 {
					t.Errorf("%d of 8 requests failed on the dead %s, want at most 1 (the one that found it dead)", failed, role)
				}
				url := f.srv.URL
				if m := e.metrics(); !strings.Contains(m, fmt.Sprintf(`kvxfer_proxy_upstream_up{role="%s",upstream="%s"} 0`, role, url)) {
					t.Errorf("/metrics does not say %s is down:\n%s", url, grep(m, "upstream_up"))
				}
				// It comes back; once its time out is over it is tried again.
				dead.Store(false)
				clock.add(time.Minute)
				for range 4 {
					if status, resp := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
						t.Errorf("after recovery: status = %d (%s)", status, resp)
					}
				}
				if n := len(f.log.snapshot()); n == 0 {
					t.Errorf("the recovered %s got no request", role)
				}
				if m := e.metrics(); !strings.Contains(m, fmt.Sprintf(`kvxfer_proxy_upstream_up{role="%s",upstream="%s"} 1`, role, url)) {
					t.Errorf("/metrics does not say %s is up again:\n%s", url, grep(m, "upstream_up"))
				}
				close(release)
				if status := <-held; status != http.StatusOK {
					t.Errorf("held request: status = %d", status)
				}
			})
		}
	}
}

func grep(s, sub string) string {
	var out []string
	for l := range strings.SplitSeq(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// The pool leaves out the upstreams reported down, unless all are.
func TestPoolSkipsDown(t *testing.T) {
	for _, policy := range []Policy{PolicyRoundRobin, PolicyLeastLoaded} {
		t.Run(string(policy), func(t *testing.T) {
			p := newPool(policy, 3)
			downSet := map[int]bool{1: true}
			down := func(i int) bool { return downSet[i] }
			var got []int
			for range 4 {
				i := p.acquire(down)
				got = append(got, i)
				p.release(i)
			}
			if want := []int{0, 2, 0, 2}; fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("picks with 1 down = %v, want %v", got, want)
			}
			downSet[0], downSet[2] = true, true
			i := p.acquire(down)
			p.release(i)
			if i < 0 || i > 2 {
				t.Errorf("pick with all down = %d, want one of them", i)
			}
		})
	}
}

// A fleet's instance that is down is left out too.
func TestFleetSkipsDown(t *testing.T) {
	var dead atomic.Bool
	dead.Store(true)
	clock := &fakeClock{t: time.Unix(1e9, 0)}
	fl := newFakeFleet()
	e := newEnv(t, ModePull, 1, 1, func(c *Config) {
		c.Prefill, c.Decode, c.Fleet, c.Policy, c.now = nil, nil, fl, "", clock.now
	})
	x := &fake{name: "px", role: rolePrefill, log: &reqLog{}}
	x.srv = httptest.NewUnstartedServer(http.HandlerFunc(x.serve))
	x.srv.Listener = deadListener{x.srv.Listener, &dead}
	x.srv.Start()
	t.Cleanup(x.srv.Close)
	fl.set(instIn(ModePull, x, "g"), instIn(ModePull, e.ps[0], "g"), instIn(ModePull, e.ds[0], "g"))
	waitFleet(t, e.p, 2, 1)
	ctx := testCtx(t)
	failed := 0
	for range 6 {
		if status, _ := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
			failed++
		}
	}
	if failed > 1 {
		t.Errorf("%d of 6 requests failed on the dead instance, want at most 1", failed)
	}
}

// A body that is not valid UTF-8 is refused with 400 saying where:
// decoding it would replace the bad bytes with U+FFFD and send P and D a
// prompt the client did not write (vLLM itself refuses such a body).
func TestBodyNotUTF8Refused(t *testing.T) {
	e := newEnv(t, ModePull, 1, 1, nil)
	ctx := testCtx(t)
	for _, body := range []string{
		"{\"prompt\":\"a\xffb\"}", "{\"prompt\":\"x\",\"stop\":[\"\xc3\"]}",
		// Escapes of unpaired UTF-16 surrogates decode to U+FFFD too.
		`{"prompt":"\ud800"}`, `{"prompt":"x\udc00"}`, `{"prompt":"\ud83dx"}`, `{"prompt":"\\\ud800"}`,
	} {
		status, resp := e.do(ctx, epCompletions.path, body)
		if status != http.StatusBadRequest || !strings.Contains(resp, "UTF") {
			t.Errorf("%q: response = %d %s, want 400 saying it is not UTF-8", body, status, resp)
		}
	}
	if n := len(e.log.snapshot()); n != 0 {
		t.Errorf("upstreams got %d requests (%+v), want 0", n, e.log.snapshot())
	}
	for _, body := range []string{`{"prompt":"h\u00e9 é"}`, `{"prompt":"\ud83d\ude00 \\ud800 \\\ud83d\uDE00"}`, `{"prompt":"\\u"}`} {
		if status, resp := e.do(ctx, epCompletions.path, body); status != http.StatusOK {
			t.Errorf("%s: status = %d (%s), want 200", body, status, resp)
		}
	}
}

// A client that goes away mid-stream ends its request once: P's and D's
// in-flight counts (least-loaded's and the gauges) come back to zero and
// the next requests are spread as if it never was.
func TestDisconnectMidStreamReleasesOnce(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 2, 2, func(c *Config) { c.Policy = PolicyLeastLoaded })
			ctx := testCtx(t)
			d := newCancelWatch()
			e.ds[0].setHook(d.hook(true))
			for range 3 {
				rctx, cancel := context.WithCancel(ctx)
				resp := e.post(rctx, epCompletions.path, `{"prompt":"x","stream":true}`)
				buf := make([]byte, len("data: 1\n\n"))
				if _, err := io.ReadFull(resp.Body, buf); err != nil {
					t.Fatalf("first chunk: %v", err)
				}
				cancel()
				resp.Body.Close()
				if !waitIdle(e.p, wait) {
					t.Fatal("the request did not end after its client left")
				}
				d.check(t, "D")
				d = newCancelWatch()
				e.ds[0].setHook(d.hook(true))
				e.ds[1].setHook(d.hook(true))
			}
			for _, pl := range []*pool{e.p.ppool, e.p.dpool} {
				pl.mu.Lock()
				if got := fmt.Sprint(pl.mu.inflight); got != "[0 0]" {
					t.Errorf("in flight = %s, want [0 0]", got)
				}
				pl.mu.Unlock()
			}
			m := e.metrics()
			if g := grep(m, "kvxfer_proxy_upstream_in_flight{"); strings.Count(g, "} 0") != 4 {
				t.Errorf("in-flight gauges = \n%s\nwant 4 at 0", g)
			}
			if want := fmt.Sprintf(`kvxfer_proxy_requests_total{endpoint="/v1/completions",mode="%s",outcome="canceled"} 3`, mode); !strings.Contains(m, want) {
				t.Errorf("/metrics lacks %q:\n%s", want, grep(m, "requests_total"))
			}
		})
	}
}

// A request P refuses as invalid (HTTP 4xx: a bad parameter, an unknown
// model, a prompt too long) gets P's own answer, as a D's refusal does,
// not 502: the client's request is wrong, not the gateway. In push, D
// refuses it too, and which answers first must not decide the status.
// Such refusals are counted apart from upstream failures.
func TestPrefillRefusalRelayed(t *testing.T) {
	const refusal = `{"error":{"message":"temperature must be non-negative, got -1.0","type":"BadRequestError","code":400}}`
	for _, mode := range []Mode{ModePull, ModePush} {
		for _, dFirst := range []bool{false, true} {
			if mode == ModePull && dFirst {
				continue // D is not asked
			}
			t.Run(fmt.Sprintf("%s/D first=%v", mode, dFirst), func(t *testing.T) {
				e := newEnv(t, mode, 1, 1, nil)
				refuse := func(first bool) hook {
					return func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
						if first != dFirst && mode == ModePush {
							// The other refuses first: wait for this one's
							// request to be cancelled, or answer after.
							timer := time.NewTimer(200 * time.Millisecond)
							defer timer.Stop()
							select {
							case <-r.Context().Done():
								return true
							case <-timer.C:
							}
						}
						w.Header().Set("Content-Type", "application/json")
						w.WriteHeader(http.StatusBadRequest)
						io.WriteString(w, refusal)
						return true
					}
				}
				e.ps[0].setHook(refuse(false))
				e.ds[0].setHook(refuse(true))
				status, resp := e.do(testCtx(t), epCompletions.path, `{"prompt":"x","temperature":-1}`)
				if status != http.StatusBadRequest || resp != refusal {
					t.Errorf("response = %d %s, want the upstream's 400 %s", status, resp, refusal)
				}
				m := e.metrics()
				if g := grep(m, `kvxfer_proxy_upstream_errors_total{kind="status"`); g != "" {
					t.Errorf("a refusal counted as an upstream failure:\n%s", g)
				}
				want := fmt.Sprintf(`kvxfer_proxy_requests_total{endpoint="/v1/completions",mode="%s",outcome="rejected"} 1`, mode)
				if !strings.Contains(m, want) {
					t.Errorf("/metrics lacks %q:\n%s", want, grep(m, "requests_total"))
				}
			})
		}
	}
}

// D's response headers reach the client but for the hop-by-hop ones,
// those its Connection header names included.
func TestResponseHopHeaders(t *testing.T) {
	e := newEnv(t, ModePull, 1, 1, nil)
	e.ds[0].setHook(func(w http.ResponseWriter, _ *http.Request, _ map[string]any) bool {
		h := w.Header()
		h.Set("Connection", "X-Hop, keep-alive")
		h.Set("X-Hop", "1")
		h.Set("Keep-Alive", "timeout=5")
		h.Set("Proxy-Authenticate", "Basic")
		h.Set("X-End", "2")
		h.Set("Content-Type", "application/json")
		io.WriteString(w, `{}`)
		return true
	})
	resp := e.post(testCtx(t), epCompletions.path, `{"prompt":"x"}`)
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	for _, k := range []string{"X-Hop", "Keep-Alive", "Proxy-Authenticate"} {
		if v := resp.Header.Get(k); v != "" {
			t.Errorf("client got %s: %s, a hop-by-hop header", k, v)
		}
	}
	if resp.Header.Get("X-End") != "2" || resp.Header.Get("X-Request-Id") == "" {
		t.Errorf("client's headers = %v, want X-End and X-Request-Id", resp.Header)
	}
}

func TestLoneSurrogateAt(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{`{"a":"x"}`, -1},
		{`{"a":"\ud83d\ude00"}`, -1},
		{`{"a":"\uD83D\uDE00\u00e9"}`, -1},
		{`{"a":"\\ud800"}`, -1},
		{`{"a":"\"\n\\"}`, -1},
		{`{"a":"\ud800"}`, 6},
		{`{"a":"\ude00"}`, 6},
		{`{"a":"\ud800\ud800"}`, 6},
		{`{"a":"\ud83d\ude00\ud800"}`, 18},
		{`{"a":"\"\ud800"}`, 8},
		{`{"a":"\\\ud800"}`, 8},
		{`{"a":"\ud800x"}`, 6},
		{`{"a":"\ud800\u0041"}`, 6},
	} {
		if got := loneSurrogateAt([]byte(tc.in)); got != tc.want {
			t.Errorf("loneSurrogateAt(%s) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

// Under concurrent requests whose P and D fail every way (an error
// status, a refusal, a broken connection, a stream cut, a hang until
// cancelled) and whose clients leave at random, every request ends once:
// one outcome counted per request, and least-loaded's and the gauges'
// in-flight counts back at zero.
func TestFailuresHammer(t *testing.T) {
	n := 120
	if testing.Short() {
		n = 30
	}
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 2, 2, func(c *Config) { c.Policy, c.Timeout = PolicyLeastLoaded, time.Second })
			behave := func(w http.ResponseWriter, r *http.Request, body map[string]any) bool {
				var k int
				fmt.Sscan(fmt.Sprint(body["prompt"]), &k)
				if r.URL.Path != epCompletions.path {
					return false
				}
				switch (k + len(r.Host)) % 7 { // P and D differ by their ports
				case 0:
					http.Error(w, "boom", http.StatusInternalServerError)
				case 1:
					http.Error(w, `{"error":"bad"}`, http.StatusBadRequest)
				case 2:
					panic(http.ErrAbortHandler)
				case 3:
					w.Header().Set("Content-Type", "text/event-stream")
					io.WriteString(w, "data: 1\n\n")
					w.(http.Flusher).Flush()
					panic(http.ErrAbortHandler)
				case 4:
					<-r.Context().Done()
				default:
					return false
				}
				return true
			}
			for _, f := range append(append([]*fake(nil), e.ps...), e.ds...) {
				f.setHook(behave)
			}
			// The requests that reach the proxy (a client that leaves at
			// once may not).
			var entered atomic.Int64
			front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				entered.Add(1)
				e.p.ServeHTTP(w, r)
			}))
			defer front.Close()
			ctx := testCtx(t)
			var wg sync.WaitGroup
			sem := make(chan struct{}, 16)
			for i := range n {
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					rctx, cancel := context.WithCancel(ctx)
					defer cancel()
					if i%5 == 0 {
						time.AfterFunc(time.Duration(i%20)*time.Millisecond, cancel)
					}
					req, _ := http.NewRequestWithContext(rctx, http.MethodPost, front.URL+epCompletions.path,
						strings.NewReader(fmt.Sprintf(`{"prompt":"%d","stream":%v}`, i, i%2 == 0)))
					if resp, err := e.client.Do(req); err == nil {
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				}()
			}
			wg.Wait()
			if !waitIdle(e.p, wait) {
				t.Fatal("requests still in flight after every client ended")
			}
			for _, pl := range []*pool{e.p.ppool, e.p.dpool} {
				pl.mu.Lock()
				if got := fmt.Sprint(pl.mu.inflight); got != "[0 0]" {
					t.Errorf("in flight = %s, want [0 0]", got)
				}
				pl.mu.Unlock()
			}
			m := e.metrics()
			if g := grep(m, "kvxfer_proxy_upstream_in_flight{"); strings.Count(g, "} 0") != 4 {
				t.Errorf("in-flight gauges =\n%s\nwant 4 at 0", g)
			}
			total := 0
			for l := range strings.SplitSeq(grep(m, "kvxfer_proxy_requests_total{"), "\n") {
				var v int
				fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v)
				total += v
			}
			if got := int(entered.Load()); total != got || got < n/2 {
				t.Errorf("outcomes counted = %d, want %d (one per request that reached the proxy, of %d):\n%s", total, got, n, grep(m, "requests_total"))
			}
		})
	}
}
