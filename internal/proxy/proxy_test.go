package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"reflect"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// wait bounds every wait of a fake server or a test: long enough for a
// loaded CI machine (a -race run on 2 cores beside the other packages:
// 5 s left a fake's round trip little room), short enough that a broken
// proxy fails instead of hanging. Nothing waits it out when all is well.
const wait = 15 * time.Second

const auth = "Bearer sk-test"

// got is one request a fake server received.
type got struct {
	server string
	path   string
	auth   string
	reqID  string
	body   map[string]any
}

// hook may answer a request itself (returning true) instead of the fake's
// default answer.
type hook func(w http.ResponseWriter, r *http.Request, body map[string]any) bool

// fake is a fake vLLM OpenAI server: P answers JSON with a
// kv_transfer_params object; D answers JSON or, for "stream": true, SSE.
type fake struct {
	name string
	role string
	srv  *httptest.Server
	log  *reqLog
	mu   struct {
		sync.Mutex
		hook hook
	}
}

// reqLog is every request the fakes of one test received, in order.
type reqLog struct {
	mu      sync.Mutex
	all     []got
	changed chan struct{} // closed and replaced by add
}

func (l *reqLog) add(g got) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.all = append(l.all, g)
	if l.changed != nil {
		close(l.changed)
	}
	l.changed = make(chan struct{})
}

// waitPrefill waits (up to wait) for a P request with the transfer id.
func (l *reqLog) waitPrefill(ctx context.Context, tid any) bool {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		l.mu.Lock()
		for _, g := range l.all {
			if params, ok := g.body["kv_transfer_params"].(map[string]any); ok && g.server[0] == 'p' && params["transfer_id"] == tid {
				l.mu.Unlock()
				return true
			}
		}
		if l.changed == nil {
			l.changed = make(chan struct{})
		}
		changed := l.changed
		l.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return false
		case <-timer.C:
			return false
		}
	}
}

func (l *reqLog) snapshot() []got {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]got(nil), l.all...)
}

func (l *reqLog) of(role string) []got {
	var out []got
	for _, g := range l.snapshot() {
		if strings.HasPrefix(g.server, role[:1]) {
			out = append(out, g)
		}
	}
	return out
}

func (f *fake) setHook(h hook) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mu.hook = h
}

// pParams is what the fake P returns as kv_transfer_params: arbitrary
// keys, a number too large for a float64 and characters JSON could
// escape, all to be passed to D untouched.
const pParams = `{"remote_engine_id":"p-engine","remote_block_ids":[3,1,2],"remote_host":"10.9.8.7","remote_port":7400,"big":123456789012345678901,"note":"a<b>&c","nested":{"x":null}}`

func (f *fake) serve(w http.ResponseWriter, r *http.Request) {
	data, err := io.ReadAll(r.Body) // to EOF, so that the server notices a client that leaves
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var body map[string]any
	if len(data) > 0 {
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		if err := dec.Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
	}
	f.log.add(got{server: f.name, path: r.URL.Path, auth: r.Header.Get("Authorization"), reqID: r.Header.Get("X-Request-Id"), body: body})
	f.mu.Lock()
	h := f.mu.hook
	f.mu.Unlock()
	if h != nil && h(w, r, body) {
		return
	}
	if r.URL.Path == "/v1/models" {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":"m","owned_by":%q}]}`, f.name)
		return
	}
	if f.role == rolePrefill {
		if body["stream"] != false {
			http.Error(w, "P got stream != false", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-%s","choices":[{"index":0,"text":"x"}],"kv_transfer_params":%s}`, f.name, pParams)
		return
	}
	// Like a real D in push mode, answer only once P has the request: D's
	// KV comes from P's prefill. (This also keeps the tests' view of the
	// requests complete once the client has its answer.)
	if params, _ := body["kv_transfer_params"].(map[string]any); params["mode"] == "push" &&
		!f.log.waitPrefill(r.Context(), params["transfer_id"]) {
		http.Error(w, "P never got the request", http.StatusInternalServerError)
		return
	}
	if body["stream"] == true {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"tok%d\"}]}\n\n", i)
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: [DONE]\n\n")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"cmpl-%s","choices":[{"index":0,"text":"hello"}]}`, f.name)
}

// wantStream is the fake D's SSE stream.
const wantStream = "data: {\"choices\":[{\"text\":\"tok0\"}]}\n\ndata: {\"choices\":[{\"text\":\"tok1\"}]}\n\n" +
	"data: {\"choices\":[{\"text\":\"tok2\"}]}\n\ndata: [DONE]\n\n"

// env is a proxy over fake P and D servers, with a client of its own.
type env struct {
	t      *testing.T
	p      *Proxy
	url    string
	client *http.Client
	ps, ds []*fake
	log    *reqLog
}

// newEnv starts nP fake P servers, nD fake D servers and a proxy over
// them, all torn down (and checked for leaked goroutines) when t ends.
func newEnv(t *testing.T, mode Mode, nP, nD int, edit func(*Config)) *env {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() { leakcheck.Check(t, before, 0, 10*time.Second) })
	e := &env{t: t, log: &reqLog{}}
	cfg := Config{Mode: mode, Logger: discardLogger()}
	for i := range nP {
		f := &fake{name: fmt.Sprintf("p%d", i), role: rolePrefill, log: e.log}
		f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
		t.Cleanup(f.srv.Close)
		e.ps = append(e.ps, f)
		cfg.Prefill = append(cfg.Prefill, Prefill{URL: f.srv.URL, Engine: "engine-" + f.name, KVHost: "10.0.0.1", KVPort: 7400 + i, TP: 2})
	}
	for i := range nD {
		f := &fake{name: fmt.Sprintf("d%d", i), role: roleDecode, log: e.log}
		f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
		t.Cleanup(f.srv.Close)
		e.ds = append(e.ds, f)
		cfg.Decode = append(cfg.Decode, f.srv.URL)
	}
	if edit != nil {
		edit(&cfg)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	e.p = p
	srv := httptest.NewServer(p)
	t.Cleanup(func() {
		srv.Close()
		if err := p.Close(); err != nil {
			t.Errorf("Close = %v", err)
		}
	})
	e.url = srv.URL
	tr := &http.Transport{}
	e.client = &http.Client{Transport: tr}
	t.Cleanup(tr.CloseIdleConnections)
	return e
}

func (e *env) post(ctx context.Context, path, body string) *http.Response {
	e.t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", auth)
	resp, err := e.client.Do(req)
	if err != nil {
		e.t.Fatalf("POST %s: %v", path, err)
	}
	return resp
}

// do posts body and returns the status and the whole response body.
func (e *env) do(ctx context.Context, path, body string) (int, string) {
	e.t.Helper()
	resp := e.post(ctx, path, body)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatalf("POST %s: reading the response: %v", path, err)
	}
	return resp.StatusCode, string(data)
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func decodeJSON(t *testing.T, s string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("decode %q: %v", s, err)
	}
	return m
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

var transferIDRe = regexp.MustCompile(`^[0-9a-f]{32}$`)

// Each side gets exactly the body and kv_transfer_params it should, for
// both modes, both endpoints, streaming and not.
func TestModes(t *testing.T) {
	completion := `{"model":"m","prompt":"hi <b> & \u00e9","max_tokens":50,"temperature":0.70,"seed":123456789012345678901,"kv_transfer_params":{"from":"client"}}`
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"max_completion_tokens":40,"top_p":1e-3}`
	streamed := func(body string) string {
		return strings.TrimSuffix(body, "}") + `,"stream":true,"stream_options":{"include_usage":true}}`
	}
	for _, tc := range []struct {
		name   string
		mode   Mode
		path   string
		body   string
		stream bool
	}{
		{"pull completions", ModePull, epCompletions.path, completion, false},
		{"pull completions stream", ModePull, epCompletions.path, streamed(completion), true},
		{"pull chat", ModePull, epChat.path, chat, false},
		{"pull chat stream", ModePull, epChat.path, streamed(chat), true},
		{"push completions", ModePush, epCompletions.path, completion, false},
		{"push completions stream", ModePush, epCompletions.path, streamed(completion), true},
		{"push chat", ModePush, epChat.path, chat, false},
		{"push chat stream", ModePush, epChat.path, streamed(chat), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.mode, 1, 1, nil)
			status, resp := e.do(testCtx(t), tc.path, tc.body)
			if status != http.StatusOK {
				t.Fatalf("status = %d (%s), want 200", status, resp)
			}
			if tc.stream {
				if resp != wantStream {
					t.Errorf("stream = %q, want %q", resp, wantStream)
				}
			} else if want := `{"id":"cmpl-d0","choices":[{"index":0,"text":"hello"}]}`; resp != want {
				t.Errorf("response = %s, want %s", resp, want)
			}
			reqs := e.log.snapshot()
			if len(reqs) != 2 {
				t.Fatalf("upstream requests = %d, want 2 (one P, one D)", len(reqs))
			}
			pReq, dReq := e.log.of(rolePrefill)[0], e.log.of(roleDecode)[0]
			for _, g := range reqs {
				if g.path != tc.path || g.auth != auth {
					t.Errorf("%s got path %q Authorization %q, want %q %q", g.server, g.path, g.auth, tc.path, auth)
				}
			}
			orig := decodeJSON(t, tc.body)
			tid, _ := pReq.body["kv_transfer_params"].(map[string]any)["transfer_id"].(string)
			if !transferIDRe.MatchString(tid) {
				t.Fatalf("P's transfer_id = %q, want 32 hex digits", tid)
			}
			// P: the original body, one token, not streamed, P's params.
			wantP := maps.Clone(orig)
			wantP["max_tokens"] = json.Number("1")
			if _, ok := orig["max_completion_tokens"]; ok {
				wantP["max_completion_tokens"] = json.Number("1")
			}
			wantP["stream"] = false
			delete(wantP, "stream_options")
			wantP["kv_transfer_params"] = map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": tid}
			// D: the original body with D's params.
			wantD := maps.Clone(orig)
			if tc.mode == ModePull {
				wantD["kv_transfer_params"] = decodeJSON(t, pParams)
			} else {
				wantP["kv_transfer_params"].(map[string]any)["mode"] = "push"
				wantD["kv_transfer_params"] = map[string]any{
					"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": tid, "mode": "push",
					"remote_engine_id": "engine-p0", "remote_host": "10.0.0.1", "remote_port": json.Number("7400"),
					"tp_size": json.Number("2"),
				}
			}
			if !reflect.DeepEqual(pReq.body, wantP) {
				t.Errorf("P's body = %s\nwant %s", jsonString(pReq.body), jsonString(wantP))
			}
			if !reflect.DeepEqual(dReq.body, wantD) {
				t.Errorf("D's body = %s\nwant %s", jsonString(dReq.body), jsonString(wantD))
			}
		})
	}
}

// Transfer ids are unique per request.
func TestTransferIDsUnique(t *testing.T) {
	e := newEnv(t, ModePush, 1, 1, nil)
	ctx := testCtx(t)
	seen := map[string]bool{}
	for range 10 {
		if status, resp := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
			t.Fatalf("status = %d (%s)", status, resp)
		}
	}
	for _, g := range e.log.of(rolePrefill) {
		tid := g.body["kv_transfer_params"].(map[string]any)["transfer_id"].(string)
		if seen[tid] {
			t.Errorf("transfer id %s used twice", tid)
		}
		seen[tid] = true
	}
}

// waitFor waits for ch to close, up to wait or until ctx ends.
func waitFor(ctx context.Context, ch <-chan struct{}) bool {
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-ctx.Done():
	case <-t.C:
	}
	return false
}

// Push dispatches P and D at once: each fake answers only once the other
// has received its request, so a sequential proxy fails (P gives up after
// `wait` and answers 500) instead of passing.
func TestPushIsConcurrent(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			e := newEnv(t, ModePush, 1, 1, nil)
			pArrived, dArrived := make(chan struct{}), make(chan struct{})
			e.ps[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
				close(pArrived)
				if !waitFor(r.Context(), dArrived) {
					http.Error(w, "D's request never arrived while P was busy", http.StatusInternalServerError)
					return true
				}
				return false
			})
			e.ds[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
				close(dArrived)
				if !waitFor(r.Context(), pArrived) {
					http.Error(w, "P's request never arrived while D was busy", http.StatusInternalServerError)
					return true
				}
				return false
			})
			body := `{"prompt":"x"}`
			if stream {
				body = `{"prompt":"x","stream":true}`
			}
			if status, resp := e.do(testCtx(t), epCompletions.path, body); status != http.StatusOK {
				t.Fatalf("status = %d (%s), want 200", status, resp)
			}
		})
	}
}

// Chunks are relayed as D sends them: D sends its second chunk only after
// the client has read the first, so a proxy that buffers D's response
// gets a cut stream.
func TestStreamRelayedChunkByChunk(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 1, 1, nil)
			clientGotFirst := make(chan struct{})
			e.ds[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: 1\n\n")
				w.(http.Flusher).Flush()
				if waitFor(r.Context(), clientGotFirst) {
					io.WriteString(w, "data: 2\n\ndata: [DONE]\n\n")
				}
				return true
			})
			resp := e.post(testCtx(t), epCompletions.path, `{"prompt":"x","stream":true}`)
			defer resp.Body.Close()
			if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
				t.Errorf("Content-Type = %q, want text/event-stream", ct)
			}
			br := bufio.NewReader(resp.Body)
			var first string
			for range 2 {
				line, err := br.ReadString('\n')
				if err != nil {
					t.Fatalf("reading the first event: %v", err)
				}
				first += line
			}
			if first != "data: 1\n\n" {
				t.Fatalf("first event = %q", first)
			}
			close(clientGotFirst)
			rest, err := io.ReadAll(br)
			if err != nil || string(rest) != "data: 2\n\ndata: [DONE]\n\n" {
				t.Errorf("rest = %q, %v; want the second event and [DONE]", rest, err)
			}
		})
	}
}

// cancelWatch is a fake's hook that records that the request's context
// was cancelled (the proxy closed the connection), after optionally
// sending a first SSE chunk.
type cancelWatch struct {
	arrived, cancelled chan struct{}
}

func newCancelWatch() *cancelWatch {
	return &cancelWatch{arrived: make(chan struct{}), cancelled: make(chan struct{})}
}

func (c *cancelWatch) hook(firstChunk bool) hook {
	return func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
		if firstChunk {
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "data: 1\n\n")
			w.(http.Flusher).Flush()
		}
		close(c.arrived)
		timer := time.NewTimer(wait)
		defer timer.Stop()
		select {
		case <-r.Context().Done():
			close(c.cancelled)
		case <-timer.C:
			if !firstChunk {
				http.Error(w, "not cancelled", http.StatusInternalServerError)
			}
		}
		return true
	}
}

func (c *cancelWatch) check(t *testing.T, who string) {
	t.Helper()
	select {
	case <-c.cancelled:
	case <-time.After(wait):
		t.Errorf("%s's request was not cancelled", who)
	}
}

// A P failure in push mode cancels D: before D's response started the
// client gets 502; after, the stream is cut.
func TestPushPrefillFailureCancelsDecode(t *testing.T) {
	for _, tc := range []struct {
		name    string
		started bool // D sent a first chunk before P failed
		pFails  func(w http.ResponseWriter)
	}{
		{name: "HTTP 500 before D started", pFails: func(w http.ResponseWriter) { http.Error(w, "boom", http.StatusInternalServerError) }},
		{name: "connection broken before D started", pFails: func(w http.ResponseWriter) { panic(http.ErrAbortHandler) }},
		{name: "HTTP 500 after D started", started: true, pFails: func(w http.ResponseWriter) { http.Error(w, "boom", http.StatusInternalServerError) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, ModePush, 1, 1, nil)
			d := newCancelWatch()
			e.ds[0].setHook(d.hook(tc.started))
			clientGotFirst := make(chan struct{})
			e.ps[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
				waitFor(r.Context(), d.arrived) // D's request is in flight
				if tc.started {
					waitFor(r.Context(), clientGotFirst)
				}
				tc.pFails(w)
				return true
			})
			if tc.started {
				resp := e.post(testCtx(t), epCompletions.path, `{"prompt":"x","stream":true}`)
				defer resp.Body.Close()
				first := make([]byte, len("data: 1\n\n"))
				if _, err := io.ReadFull(resp.Body, first); err != nil || string(first) != "data: 1\n\n" {
					t.Fatalf("first chunk = %q, %v", first, err)
				}
				close(clientGotFirst)
				rest, err := io.ReadAll(resp.Body)
				d.check(t, "D")
				if resp.StatusCode != http.StatusOK || len(rest) != 0 || err == nil {
					t.Errorf("response = %d, then %q, %v; want 200 with the first chunk only, then a broken stream", resp.StatusCode, rest, err)
				}
				return
			}
			status, resp := e.do(testCtx(t), epCompletions.path, `{"prompt":"x","stream":true}`)
			d.check(t, "D")
			if status != http.StatusBadGateway || !strings.Contains(resp, "prefill") {
				t.Errorf("response = %d %s, want 502 naming the prefill", status, resp)
			}
		})
	}
}

// The client's request ends when it goes away, and so do the upstream
// requests.
func TestClientDisconnectCancelsUpstreams(t *testing.T) {
	for _, mode := range []Mode{ModePush, ModePull} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 1, 1, nil)
			p, d := newCancelWatch(), newCancelWatch()
			e.ps[0].setHook(p.hook(false))
			e.ds[0].setHook(d.hook(true))
			ctx, cancel := context.WithCancel(testCtx(t))
			defer cancel()
			// The client's request returns only after the proxy sent
			// headers (push: D's first chunk; pull: never), so it runs
			// on its own goroutine, which ends when ctx does.
			done := make(chan struct{})
			go func() {
				defer close(done)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.url+epCompletions.path, strings.NewReader(`{"prompt":"x","stream":true}`))
				if resp, err := e.client.Do(req); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}()
			defer func() { <-done }()
			switch mode {
			case ModePush:
				if !waitFor(ctx, p.arrived) || !waitFor(ctx, d.arrived) {
					t.Fatal("P and D did not both get their requests")
				}
			case ModePull: // P never answers: D is never asked
				if !waitFor(ctx, p.arrived) {
					t.Fatal("P did not get its request")
				}
			}
			cancel()
			p.check(t, "P")
			if mode == ModePush {
				d.check(t, "D")
			}
		})
	}
}

// In pull mode, a P response without a kv_transfer_params object fails
// the request with 502, and D is not asked.
func TestPullWithoutParams(t *testing.T) {
	for _, tc := range []struct{ name, answer string }{
		{"missing", `{"id":"x","choices":[]}`},
		{"null", `{"id":"x","kv_transfer_params":null}`},
		{"not an object", `{"id":"x","kv_transfer_params":[1]}`},
		{"not JSON", `<html>`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, ModePull, 1, 1, nil)
			e.ps[0].setHook(func(w http.ResponseWriter, _ *http.Request, _ map[string]any) bool {
				io.WriteString(w, tc.answer)
				return true
			})
			status, resp := e.do(testCtx(t), epChat.path, `{"messages":[]}`)
			if status != http.StatusBadGateway {
				t.Errorf("status = %d (%s), want 502", status, resp)
			}
			m := decodeJSON(t, resp)
			if msg := fmt.Sprint(m["error"].(map[string]any)["message"]); !strings.Contains(msg, "kv_transfer_params") && !strings.Contains(msg, "JSON") {
				t.Errorf("error = %q, want it to say what is wrong with P's response", msg)
			}
			if n := len(e.log.of(roleDecode)); n != 0 {
				t.Errorf("D got %d requests, want 0", n)
			}
		})
	}
}

// D's own error answer reaches the client as D sent it.
func TestDecodeErrorRelayed(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, mode, 1, 1, nil)
			e.ds[0].setHook(func(w http.ResponseWriter, _ *http.Request, _ map[string]any) bool {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusBadRequest)
				io.WriteString(w, `{"error":{"message":"prompt too long"}}`)
				return true
			})
			status, resp := e.do(testCtx(t), epCompletions.path, `{"prompt":"x"}`)
			if status != http.StatusBadRequest || resp != `{"error":{"message":"prompt too long"}}` {
				t.Errorf("response = %d %s, want D's 400", status, resp)
			}
		})
	}
}

// Round-robin takes P and D servers in turn, and D's push params name the
// P that was chosen.
func TestRoundRobin(t *testing.T) {
	e := newEnv(t, ModePush, 3, 2, func(c *Config) { c.Policy = PolicyRoundRobin })
	ctx := testCtx(t)
	for range 6 {
		if status, resp := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
			t.Fatalf("status = %d (%s)", status, resp)
		}
	}
	var ps, ds []string
	for _, g := range e.log.of(rolePrefill) {
		ps = append(ps, g.server)
	}
	for _, g := range e.log.of(roleDecode) {
		ds = append(ds, g.server)
		// Which P served this D's request: the transfer ids pair them.
		tid := g.body["kv_transfer_params"].(map[string]any)["transfer_id"]
		for _, pg := range e.log.of(rolePrefill) {
			if pg.body["kv_transfer_params"].(map[string]any)["transfer_id"] == tid {
				if got, want := g.body["kv_transfer_params"].(map[string]any)["remote_engine_id"], "engine-"+pg.server; got != want {
					t.Errorf("D's remote_engine_id = %v, want %v (the P chosen)", got, want)
				}
			}
		}
	}
	if want := []string{"p0", "p1", "p2", "p0", "p1", "p2"}; !reflect.DeepEqual(ps, want) {
		t.Errorf("P order = %v, want %v", ps, want)
	}
	if want := []string{"d0", "d1", "d0", "d1", "d0", "d1"}; !reflect.DeepEqual(ds, want) {
		t.Errorf("D order = %v, want %v", ds, want)
	}
}

// Least-loaded avoids a P that is busy, where round-robin would return to
// it.
func TestLeastLoaded(t *testing.T) {
	e := newEnv(t, ModePull, 2, 1, func(c *Config) { c.Policy = PolicyLeastLoaded })
	ctx := testCtx(t)
	busy := newCancelWatch()
	release := make(chan struct{})
	e.ps[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
		close(busy.arrived)
		waitFor(r.Context(), release)
		return false
	})
	first := make(chan int, 1)
	go func() {
		resp := e.post(ctx, epCompletions.path, `{"prompt":"first"}`)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	if !waitFor(ctx, busy.arrived) {
		t.Fatal("the first request did not reach p0")
	}
	for range 2 {
		if status, resp := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
			t.Fatalf("status = %d (%s)", status, resp)
		}
	}
	close(release)
	if status := <-first; status != http.StatusOK {
		t.Errorf("first request's status = %d", status)
	}
	var ps []string
	for _, g := range e.log.of(rolePrefill) {
		ps = append(ps, g.server)
	}
	if want := []string{"p0", "p1", "p1"}; !reflect.DeepEqual(ps, want) {
		t.Errorf("P order = %v, want %v", ps, want)
	}
}

func TestPool(t *testing.T) {
	// ops: "+i" acquire expecting i, "-i" release i.
	for _, tc := range []struct {
		name   string
		policy Policy
		n      int
		ops    []string
	}{
		{"round-robin ignores load", PolicyRoundRobin, 3, []string{"+0", "+1", "+2", "+0", "-1", "+1"}},
		{"least-loaded ties go in turn", PolicyLeastLoaded, 3, []string{"+0", "-0", "+1", "-1", "+2", "-2", "+0"}},
		{"least-loaded skips the busy", PolicyLeastLoaded, 3, []string{"+0", "+1", "-1", "+2", "+1", "-0", "+0", "+1"}},
		{"least-loaded with one", PolicyLeastLoaded, 1, []string{"+0", "+0", "-0", "+0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(tc.policy, tc.n)
			for k, op := range tc.ops {
				var i int
				fmt.Sscanf(op[1:], "%d", &i)
				if op[0] == '-' {
					p.release(i)
					continue
				}
				if got := p.acquire(nil); got != i {
					t.Fatalf("op %d: acquire() = %d, want %d (ops %v)", k, got, i, tc.ops)
				}
			}
		})
	}
}

// Client errors: bodies that are too large or not a JSON object.
func TestBadRequests(t *testing.T) {
	e := newEnv(t, ModePush, 1, 1, func(c *Config) { c.MaxBody = 1024 })
	ctx := testCtx(t)
	for _, tc := range []struct {
		name, body string
		status     int
	}{
		{"over the size limit", `{"prompt":"` + strings.Repeat("x", 2048) + `"}`, http.StatusRequestEntityTooLarge},
		{"not JSON", `prompt=x`, http.StatusBadRequest},
		{"an array", `[1,2]`, http.StatusBadRequest},
		{"null", `null`, http.StatusBadRequest},
		{"trailing data", `{"prompt":"x"} {}`, http.StatusBadRequest},
		{"just under the limit", `{"prompt":"` + strings.Repeat("x", 1000) + `"}`, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, resp := e.do(ctx, epCompletions.path, tc.body)
			if status != tc.status {
				t.Errorf("status = %d (%s), want %d", status, resp, tc.status)
			}
		})
	}
	if n := len(e.log.of(rolePrefill)); n != 1 {
		t.Errorf("P got %d requests, want 1 (only the good one)", n)
	}
}

// Requests over MaxConcurrent are refused with 503.
func TestMaxConcurrent(t *testing.T) {
	e := newEnv(t, ModePull, 1, 1, func(c *Config) { c.MaxConcurrent = 1 })
	ctx := testCtx(t)
	arrived, release := make(chan struct{}), make(chan struct{})
	e.ps[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
		close(arrived)
		waitFor(r.Context(), release)
		return false
	})
	first := make(chan int, 1)
	go func() {
		resp := e.post(ctx, epCompletions.path, `{"prompt":"x"}`)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	if !waitFor(ctx, arrived) {
		t.Fatal("the first request did not reach P")
	}
	if status, resp := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusServiceUnavailable {
		t.Errorf("second request: status = %d (%s), want 503", status, resp)
	}
	close(release)
	if status := <-first; status != http.StatusOK {
		t.Errorf("first request: status = %d, want 200", status)
	}
}

// GET /v1/models goes to a D, /health answers, /metrics counts.
func TestModelsHealthMetrics(t *testing.T) {
	e := newEnv(t, ModePull, 1, 1, nil)
	ctx := testCtx(t)
	get := func(path string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.url+path, nil)
		req.Header.Set("Authorization", auth)
		resp, err := e.client.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if status, resp := get("/v1/models"); status != http.StatusOK || !strings.Contains(resp, `"owned_by":"d0"`) {
		t.Errorf("GET /v1/models = %d %s, want D's list", status, resp)
	}
	if g := e.log.of(roleDecode); len(g) != 1 || g[0].auth != auth {
		t.Errorf("D's /v1/models requests = %+v, want one with the Authorization", g)
	}
	if status, resp := get("/health"); status != http.StatusOK || !strings.Contains(resp, "ok") {
		t.Errorf("GET /health = %d %s", status, resp)
	}
	for range 2 {
		e.do(ctx, epCompletions.path, `{"prompt":"x"}`)
	}
	e.do(ctx, epChat.path, `{"messages":[]}`)
	e.ps[0].setHook(func(w http.ResponseWriter, _ *http.Request, _ map[string]any) bool {
		http.Error(w, "boom", http.StatusInternalServerError)
		return true
	})
	if status, _ := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusBadGateway {
		t.Errorf("failed P: status = %d, want 502", status)
	}
	_, metrics := get("/metrics")
	pURL := e.ps[0].srv.URL
	for _, want := range []string{
		`kvxfer_proxy_requests_total{endpoint="/v1/completions",mode="pull",outcome="ok"} 2`,
		`kvxfer_proxy_requests_total{endpoint="/v1/chat/completions",mode="pull",outcome="ok"} 1`,
		`kvxfer_proxy_requests_total{endpoint="/v1/completions",mode="pull",outcome="prefill_failed"} 1`,
		`kvxfer_proxy_requests_total{endpoint="/v1/models",mode="pull",outcome="ok"} 1`,
		`kvxfer_proxy_upstream_errors_total{kind="status",role="prefill",upstream="` + pURL + `"} 1`,
		`kvxfer_proxy_upstream_in_flight{role="prefill",upstream="` + pURL + `"} 0`,
		`kvxfer_proxy_prefill_seconds_count{mode="pull"} 3`,
		`kvxfer_proxy_decode_ttfb_seconds_count{mode="pull"}`,
		`kvxfer_proxy_request_seconds_count{endpoint="/v1/completions",mode="pull"} 3`,
		`go_goroutines`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// Every upstream request carries the request id, which the client gets
// back; a client's own sane X-Request-Id is kept.
func TestRequestID(t *testing.T) {
	e := newEnv(t, ModePull, 1, 1, nil)
	req, _ := http.NewRequestWithContext(testCtx(t), http.MethodPost, e.url+epCompletions.path, strings.NewReader(`{"prompt":"x"}`))
	req.Header.Set("X-Request-Id", "client-id-1")
	resp, err := e.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if got := resp.Header.Get("X-Request-Id"); got != "client-id-1" {
		t.Errorf("X-Request-Id = %q, want client-id-1", got)
	}
	for _, g := range e.log.snapshot() {
		if g.reqID != "client-id-1" {
			t.Errorf("%s got X-Request-Id %q, want client-id-1", g.server, g.reqID)
		}
	}
}

// Config.Timeout bounds an upstream request: a P that never answers
// fails the request with 502 and counts a timeout.
func TestUpstreamTimeout(t *testing.T) {
	e := newEnv(t, ModePull, 1, 1, func(c *Config) { c.Timeout = 100 * time.Millisecond })
	e.ps[0].setHook(func(w http.ResponseWriter, r *http.Request, _ map[string]any) bool {
		<-r.Context().Done() // the proxy gives up and closes the connection
		return true
	})
	ctx := testCtx(t)
	if status, resp := e.do(ctx, epCompletions.path, `{"prompt":"x"}`); status != http.StatusBadGateway || !strings.Contains(resp, "deadline") {
		t.Errorf("response = %d %s, want 502 naming the deadline", status, resp)
	}
	resp, err := e.client.Get(e.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if want := `kvxfer_proxy_upstream_errors_total{kind="timeout",role="prefill",upstream="` + e.ps[0].srv.URL + `"} 1`; !strings.Contains(string(b), want) {
		t.Errorf("/metrics lacks %q", want)
	}
}

// syncBuffer is a bytes.Buffer for a logger written from handlers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Each request logs one line with its ids, upstreams, statuses, times and
// outcome.
func TestRequestLog(t *testing.T) {
	var buf syncBuffer
	e := newEnv(t, ModePush, 1, 1, func(c *Config) { c.Logger = slog.New(slog.NewJSONHandler(&buf, nil)) })
	if status, resp := e.do(testCtx(t), epCompletions.path, `{"prompt":"x"}`); status != http.StatusOK {
		t.Fatalf("status = %d (%s)", status, resp)
	}
	e.p.Close() // waits for the handler, which logs as it ends
	line := decodeJSON(t, buf.String())
	tid := e.log.of(rolePrefill)[0].body["kv_transfer_params"].(map[string]any)["transfer_id"]
	for k, want := range map[string]any{
		"msg": "proxy: request", "transfer_id": tid, "mode": "push", "endpoint": epCompletions.path,
		"prefill": e.ps[0].srv.URL, "decode": e.ds[0].srv.URL, "p_status": json.Number("200"),
		"d_status": json.Number("200"), "outcome": "ok",
	} {
		if line[k] != want {
			t.Errorf("log %s = %v, want %v (line %s)", k, line[k], want, buf.String())
		}
	}
	for _, k := range []string{"request_id", "p_time", "d_ttfb", "total"} {
		if _, ok := line[k]; !ok {
			t.Errorf("log lacks %s (line %s)", k, buf.String())
		}
	}
}
