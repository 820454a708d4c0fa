package proxy

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// ErrClosed is why a request that arrives after Close is refused (503).
var ErrClosed = errors.New("proxy: closed")

var (
	// errPrefillFailed cancels D's request when P failed on its own (push).
	errPrefillFailed = errors.New("proxy: prefill failed")
	// errDecodeFailed cancels P's request when D failed (push): P's work
	// is of no use any more.
	errDecodeFailed = errors.New("proxy: decode failed")
	// errDecodeDone cancels P's request when it has not answered
	// prefillGrace after D's whole response (push).
	errDecodeDone = errors.New("proxy: decode done")
	// errClientGone wraps a failed write to the client.
	errClientGone = errors.New("proxy: client went away")
)

// endpoint is one of the generation endpoints.
type endpoint struct {
	path string
	chat bool // chat completions: max_completion_tokens is capped too
}

var (
	epCompletions = endpoint{path: "/v1/completions"}
	epChat        = endpoint{path: "/v1/chat/completions", chat: true}
)

// upstream is one P or D server.
type upstream struct {
	role     string
	base     string  // base URL, no trailing slash
	prefill  Prefill // P servers only
	inflight prometheus.Gauge
	// label is the upstream label of its error metrics (default base):
	// "fleet" for a Fleet's instances, whose URLs come and go.
	label  string
	group  string  // a Fleet's instance: its compatibility group
	health *health // shared by the copies a Fleet's picks make
}

// Proxy is the OpenAI-compatible router in front of P and D servers. It is
// an http.Handler and safe for concurrent use.
type Proxy struct {
	cfg     Config
	log     *slog.Logger
	prefill []*upstream
	decode  []*upstream
	ppool   *pool
	dpool   *pool
	client  *http.Client
	own     *http.Transport // the default transport, closed by Close; nil with Config.Transport
	m       *metrics
	mux     *http.ServeMux
	fleet   *fleetRouter // Config.Fleet's, or nil
	mu      struct {
		sync.Mutex
		active  int  // requests admitted and not yet ended
		closed  bool // Close was called: admit nothing more
		drained chan struct{}
	}
}

// New validates cfg, fills its defaults and returns a Proxy.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	p := &Proxy{cfg: cfg, log: cfg.Logger, m: newMetrics(),
		ppool: newPool(cfg.Policy, len(cfg.Prefill)), dpool: newPool(cfg.Policy, len(cfg.Decode))}
	p.mu.drained = make(chan struct{})
	if cfg.Fleet != nil {
		p.fleet = newFleetRouter(p, cfg.Fleet, cfg.MaxFleet)
	}
	// A server listed twice (a weight) is one server: one health, as it
	// has one gauge.
	healths := map[[2]string]*health{}
	healthOf := func(role, url string) *health {
		h := healths[[2]string{role, url}]
		if h == nil {
			h = newHealth(cfg.now, p.m.up.WithLabelValues(role, url))
			healths[[2]string{role, url}] = h
		}
		return h
	}
	for _, pf := range cfg.Prefill {
		p.prefill = append(p.prefill, &upstream{role: rolePrefill, base: pf.URL, prefill: pf,
			inflight: p.m.inflight.WithLabelValues(rolePrefill, pf.URL), health: healthOf(rolePrefill, pf.URL)})
	}
	for _, d := range cfg.Decode {
		p.decode = append(p.decode, &upstream{role: roleDecode, base: d,
			inflight: p.m.inflight.WithLabelValues(roleDecode, d), health: healthOf(roleDecode, d)})
	}
	rt := cfg.Transport
	if rt == nil {
		p.own = &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          1024,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			TLSHandshakeTimeout:   10 * time.Second,
			ExpectContinueTimeout: time.Second,
			ForceAttemptHTTP2:     true,
		}
		rt = p.own
	}
	p.client = &http.Client{Transport: rt}
	p.mux = http.NewServeMux()
	p.mux.HandleFunc("POST "+epCompletions.path, p.generate(epCompletions))
	p.mux.HandleFunc("POST "+epChat.path, p.generate(epChat))
	p.mux.HandleFunc("GET /v1/models", p.models)
	p.mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"status":"ok"}`+"\n")
	})
	p.mux.Handle("GET /metrics", promhttp.HandlerFor(p.m.reg, promhttp.HandlerOpts{}))
	return p, nil
}

// ServeHTTP serves the proxy's endpoints.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// Close refuses new requests (503), waits for the requests in flight to
// end and closes idle upstream connections. Requests end when their
// upstreams answer, time out (Config.Timeout) or their clients go away:
// an http.Server's Close makes them go away. Close is idempotent and safe
// to call concurrently.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if !p.mu.closed {
		p.mu.closed = true
		if p.mu.active == 0 {
			close(p.mu.drained)
		}
	}
	p.mu.Unlock()
	<-p.mu.drained
	if p.fleet != nil {
		p.fleet.close()
	}
	if p.own != nil {
		p.own.CloseIdleConnections()
	}
	return nil
}

// enter admits a request unless Config.MaxConcurrent are in flight or the
// proxy is closed; an admitted request calls leave once.
func (p *Proxy) enter() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.mu.closed:
		return ErrClosed
	case p.mu.active >= p.cfg.MaxConcurrent:
		return fmt.Errorf("%d requests in flight (the limit)", p.mu.active)
	}
	p.mu.active++
	return nil
}

func (p *Proxy) leave() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mu.active--
	if p.mu.closed && p.mu.active == 0 {
		close(p.mu.drained)
	}
}

// pick chooses an upstream of a role and counts a request in flight on
// it until release is called (once). With a Fleet, the upstream is one
// of with's group (with nil: a prefill instance of a group that has a
// decode instance), and there may be none (errNoPair).
func (p *Proxy) pick(role string, with *upstream) (u *upstream, release func(), err error) {
	if p.fleet != nil {
		return p.fleet.pick(role, with)
	}
	pl, list := p.ppool, p.prefill
	if role == roleDecode {
		pl, list = p.dpool, p.decode
	}
	i := pl.acquire(func(i int) bool { return list[i].health.down() })
	u = list[i]
	u.inflight.Inc()
	return u, func() {
		u.inflight.Dec()
		pl.release(i)
	}, nil
}

// noPair answers a request that found no live, compatible P and D (a
// Fleet's): 503, to retry.
func (p *Proxy) noPair(w http.ResponseWriter, rec *record, err error) {
	rec.outcome, rec.err = outcomeNoUpstream, err
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusServiceUnavailable, "no_upstream", err.Error())
}

// record is what one client request logs and counts.
type record struct {
	id, transfer, endpoint string
	prefill, decode        string
	pStatus, dStatus       int
	pTime, dTTFB           time.Duration
	outcome                string
	err                    error
	cut                    bool // the response started and broke off: abort the client's connection
}

func (p *Proxy) finish(rec *record, start time.Time) {
	total := time.Since(start)
	mode := string(p.cfg.Mode)
	p.m.requests.WithLabelValues(mode, rec.endpoint, rec.outcome).Inc()
	p.m.total.WithLabelValues(mode, rec.endpoint).Observe(total.Seconds())
	attrs := []slog.Attr{
		slog.String("request_id", rec.id), slog.String("transfer_id", rec.transfer),
		slog.String("mode", mode), slog.String("endpoint", rec.endpoint),
		slog.String("prefill", rec.prefill), slog.String("decode", rec.decode),
		slog.Int("p_status", rec.pStatus), slog.Int("d_status", rec.dStatus),
		slog.Duration("p_time", rec.pTime), slog.Duration("d_ttfb", rec.dTTFB),
		slog.Duration("total", total), slog.String("outcome", rec.outcome),
	}
	level := slog.LevelInfo
	if rec.err != nil {
		attrs = append(attrs, slog.String("err", rec.err.Error()))
		if rec.outcome != outcomeCanceled {
			level = slog.LevelWarn
		}
	}
	p.log.LogAttrs(context.Background(), level, "proxy: request", attrs...)
}

// newRecord starts a request's record: its id (the client's X-Request-Id
// when it is a sane one) and a fresh transfer id, unique per request.
func newRecord(w http.ResponseWriter, r *http.Request, path string) *record {
	id := r.Header.Get("X-Request-Id")
	if !saneID(id) {
		id = randomHex(8)
	}
	w.Header().Set("X-Request-Id", id)
	return &record{id: id, transfer: randomHex(16), endpoint: path}
}

func saneID(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("-_.:", c) >= 0) {
			return false
		}
	}
	return true
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails (crypto/rand's contract since Go 1.24)
	return hex.EncodeToString(b)
}

// admit admits a client request unless Config.MaxConcurrent are in
// flight or the proxy is closed, in which case it answers 503, records and
// returns false. An admitted request ends with p.end.
func (p *Proxy) admit(w http.ResponseWriter, rec *record, start time.Time) bool {
	if err := p.enter(); err != nil {
		rec.outcome, rec.err = outcomeOverloaded, err
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "overloaded", "proxy: "+err.Error())
		p.finish(rec, start)
		return false
	}
	return true
}

// end logs and counts an admitted request, then lets Close go on: Close
// returns after every request's log line.
func (p *Proxy) end(rec *record, start time.Time) {
	p.finish(rec, start)
	p.leave()
}

// readJSON reads the client's body; on failure it has answered the client
// and set rec.outcome.
func (p *Proxy) readJSON(w http.ResponseWriter, r *http.Request, rec *record, ep endpoint) (map[string]any, bool) {
	body, status, err := p.readBody(w, r, ep)
	if err != nil {
		rec.outcome, rec.err = outcomeBadRequest, err
		if status == http.StatusRequestEntityTooLarge {
			rec.outcome = outcomeTooLarge
		}
		writeError(w, status, "invalid_request_error", err.Error())
		return nil, false
	}
	return body, true
}

// readBody reads the client's body, bounded in size (Config.MaxBody) and
// time, as a JSON object whose numbers stay json.Number (re-encoded as
// the same literal), for one engine request (checkOneSequence).
func (p *Proxy) readBody(w http.ResponseWriter, r *http.Request, ep endpoint) (map[string]any, int, error) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(bodyReadTimeout)) // unsupported only off a real server
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, p.cfg.MaxBody))
	_ = rc.SetReadDeadline(time.Time{})
	if err != nil {
		if mbe, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, http.StatusRequestEntityTooLarge, fmt.Errorf("request body is over %d bytes", mbe.Limit)
		}
		return nil, http.StatusBadRequest, fmt.Errorf("reading the request body: %w", err)
	}
	if !utf8.Valid(data) {
		// Decoding would replace the bad bytes with U+FFFD: P and D would
		// get a prompt the client did not write.
		return nil, http.StatusBadRequest, fmt.Errorf("request body is not valid UTF-8 (byte %d)", invalidUTF8At(data))
	}
	if i := loneSurrogateAt(data); i >= 0 {
		// As bad UTF-8: decoding would replace it with U+FFFD.
		return nil, http.StatusBadRequest, fmt.Errorf("request body has an unpaired UTF-16 surrogate escape %q (byte %d): not a character", data[i:i+6], i)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var body map[string]any
	if err := dec.Decode(&body); err != nil {
		return nil, http.StatusBadRequest, fmt.Errorf("request body is not a JSON object: %w", err)
	}
	if body == nil {
		return nil, http.StatusBadRequest, errors.New("request body is not a JSON object: null")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, http.StatusBadRequest, errors.New("request body has data after its JSON object")
	}
	if err := checkOneSequence(body, ep); err != nil {
		return nil, http.StatusBadRequest, err
	}
	return body, 0, nil
}

// invalidUTF8At is the offset of data's first byte that is not valid
// UTF-8, or -1.
func invalidUTF8At(data []byte) int {
	for i := 0; i < len(data); {
		r, n := utf8.DecodeRune(data[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return -1
}

// loneSurrogateAt is the offset of the first \uXXXX escape in data's
// JSON strings that is a UTF-16 surrogate not in a high-low pair, or -1.
// Outside strings there are no backslashes in valid JSON, so a scan for
// escapes is enough: an escaped backslash is skipped whole.
func loneSurrogateAt(data []byte) int {
	hex4 := func(i int) (rune, bool) {
		if i+6 > len(data) || data[i] != '\\' || data[i+1] != 'u' {
			return 0, false
		}
		var r rune
		for _, c := range data[i+2 : i+6] {
			switch {
			case c >= '0' && c <= '9':
				r = r<<4 | rune(c-'0')
			case c >= 'a' && c <= 'f':
				r = r<<4 | rune(c-'a'+10)
			case c >= 'A' && c <= 'F':
				r = r<<4 | rune(c-'A'+10)
			default:
				return 0, false
			}
		}
		return r, true
	}
	for i := 0; i < len(data); i++ {
		if data[i] != '\\' {
			continue
		}
		r, ok := hex4(i)
		switch {
		case !ok:
			i++ // another escape (\\, \", \n...): skip its second byte
		case r >= 0xD800 && r <= 0xDBFF:
			if lo, ok := hex4(i + 6); ok && lo >= 0xDC00 && lo <= 0xDFFF {
				i += 11
				continue
			}
			return i
		case r >= 0xDC00 && r <= 0xDFFF:
			return i
		default:
			i += 5
		}
	}
	return -1
}

// checkOneSequence refuses a request for several sequences (n or best_of
// above 1, beam search) or, on the completions endpoint, several prompts
// (a batch in prompt, prompt_embeds), naming the field and its value.
// vLLM runs each sequence and each prompt as an engine request of its own
// that carries the request's one kv_transfer_params: in push, P's and D's
// would all register under one transfer id (one pair, the rest waiting
// out their lease); in pull, D's would all get the params P returned for
// its first (the KV of another prompt, or blocks P frees after the first
// read).
func checkOneSequence(body map[string]any, ep endpoint) error {
	if !ep.chat {
		prompts, embeds := promptCount(body["prompt"], true), promptCount(body["prompt_embeds"], false)
		switch {
		case prompts > 1:
			return fmt.Errorf("prompt = %s: a batch of %d prompts; the proxy serves one prompt per request (kv_transfer_params name one request on each side); send several requests",
				snippetN(mustJSON(body["prompt"]), 40), prompts)
		case embeds > 1:
			return fmt.Errorf("prompt_embeds: a batch of %d; the proxy serves one prompt per request (kv_transfer_params name one request on each side); send several requests", embeds)
		case prompts+embeds > 1:
			return errors.New("prompt and prompt_embeds both given: two prompts; the proxy serves one prompt per request (kv_transfer_params name one request on each side)")
		}
	}
	for _, k := range []string{"n", "best_of"} {
		v, ok := body[k]
		if !ok || v == nil {
			continue
		}
		if n, isNum := v.(json.Number); isNum {
			if f, err := n.Float64(); err == nil && f == 1 {
				continue
			}
		}
		return fmt.Errorf("%s = %s: the proxy serves one sequence per request (kv_transfer_params name one request on each side); send several requests",
			k, snippetN(mustJSON(v), 40))
	}
	if v, ok := body["use_beam_search"]; ok && v != nil && v != false {
		return fmt.Errorf("use_beam_search = %s: the proxy serves one sequence per request (kv_transfer_params name one request on each side)",
			snippetN(mustJSON(v), 40))
	}
	return nil
}

// promptCount is how many engine requests a completions prompt (tokens:
// a list of token ids is one prompt) or prompt_embeds field makes.
func promptCount(v any, tokens bool) int {
	switch v := v.(type) {
	case nil:
		return 0
	case []any:
		if len(v) == 0 {
			return 0
		}
		if _, isNum := v[0].(json.Number); isNum && tokens {
			return 1
		}
		return len(v)
	}
	return 1
}

// mustJSON is v (decoded from JSON) as JSON again.
func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		return []byte(fmt.Sprint(v))
	}
	return b
}

// prefillBody is the body P gets: the client's, generating one token, not
// streamed, with P's kv_transfer_params. body is not modified.
func prefillBody(body map[string]any, ep endpoint, params map[string]any) map[string]any {
	b := maps.Clone(body)
	b["max_tokens"] = 1
	if _, ok := b["max_completion_tokens"]; ok && ep.chat {
		b["max_completion_tokens"] = 1
	}
	b["stream"] = false
	delete(b, "stream_options")
	// vLLM refuses min_tokens > max_tokens: the client's is D's to honour.
	delete(b, "min_tokens")
	b["kv_transfer_params"] = params
	return b
}

// withParams is body with kv_transfer_params set; body is not modified.
func withParams(body map[string]any, params any) map[string]any {
	b := maps.Clone(body)
	b["kv_transfer_params"] = params
	return b
}

// send starts an upstream request with the client's Authorization and the
// request id. The response's body must be closed; Config.Timeout bounds
// the request until then.
func (p *Proxy) send(ctx context.Context, method, url string, body map[string]any, in *http.Request, reqID string) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		var buf bytes.Buffer
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(body); err != nil {
			return nil, fmt.Errorf("encode the request body: %w", err)
		}
		rd = &buf
	}
	cancel := context.CancelFunc(func() {})
	if p.cfg.Timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, p.cfg.Timeout)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		cancel()
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if a := in.Header.Get("Authorization"); a != "" {
		req.Header.Set("Authorization", a)
	}
	req.Header.Set("X-Request-Id", reqID)
	resp, err := p.client.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = cancelOnClose{resp.Body, ctx, cancel}
	return resp, nil
}

type cancelOnClose struct {
	io.ReadCloser
	ctx    context.Context // the upstream request's, Config.Timeout included
	cancel context.CancelFunc
}

// upstreamContext is the context of resp's upstream request (sent by
// send): it ends when the request times out or is cancelled.
func upstreamContext(resp *http.Response, fallback context.Context) context.Context {
	if c, ok := resp.Body.(cancelOnClose); ok {
		return c.ctx
	}
	return fallback
}

func (c cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// sendFailed counts an upstream request that got no response (as
// upstreamError) and, when the connection failed, leaves the upstream
// out of the picks for a while (see health). It returns the error's kind.
func (p *Proxy) sendFailed(ctx context.Context, u *upstream, err error) string {
	kind := errKind(err)
	p.upstreamError(ctx, u, kind)
	if kind == kindConnect && ctx.Err() == nil && u.health != nil {
		d := u.health.failed()
		p.log.Warn("proxy: upstream down", "role", u.role, "upstream", u.base, "for", d, "err", err)
	}
	return kind
}

// answered notes that u responded: it is up.
func (p *Proxy) answered(u *upstream) {
	if u.health != nil && u.health.answered() {
		p.log.Info("proxy: upstream up", "role", u.role, "upstream", u.base)
	}
}

// upstreamError counts a failed upstream request, unless ctx (the
// request's context before Config.Timeout) was cancelled: then the client
// left or the other side failed, which is not this upstream's fault.
func (p *Proxy) upstreamError(ctx context.Context, u *upstream, kind string) {
	if ctx.Err() == nil {
		p.m.upstreamErrs.WithLabelValues(u.role, cmp.Or(u.label, u.base), kind).Inc()
	}
}

func errKind(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return kindTimeout
	}
	return kindConnect
}

// prefillResult is how P's request ended.
type prefillResult struct {
	status int
	params json.RawMessage // pull: P's kv_transfer_params, byte for byte
	dur    time.Duration
	err    error
	// refused: P refused the request itself (see refusal); answer and
	// ctype are its answer, for the client.
	refused bool
	answer  []byte
	ctype   string
}

// refusal reports whether an upstream's HTTP status refuses the request
// itself (a bad parameter, an unknown model, a prompt too long, a rate
// limit): the client's to fix or retry, relayed as it is rather than
// answered 502 and counted as the upstream's failure. 408 is the
// upstream's own time running out.
func refusal(status int) bool {
	return status >= 400 && status <= 499 && status != http.StatusRequestTimeout
}

// callPrefill sends P its request and reads its response (bounded by
// Config.MaxBody); with wantParams it takes the kv_transfer_params object
// out of it.
func (p *Proxy) callPrefill(ctx context.Context, u *upstream, ep endpoint, body map[string]any, in *http.Request, rec *record, wantParams bool) (res prefillResult) {
	start := time.Now()
	defer func() {
		res.dur = time.Since(start)
		if res.err == nil {
			p.m.prefillTime.WithLabelValues(string(p.cfg.Mode)).Observe(res.dur.Seconds())
		}
	}()
	fail := func(kind string, err error) prefillResult {
		p.upstreamError(ctx, u, kind)
		res.err = fmt.Errorf("prefill %s: %w", u.base, err)
		return res
	}
	resp, err := p.send(ctx, http.MethodPost, u.base+ep.path, body, in, rec.id)
	if err != nil {
		p.sendFailed(ctx, u, err)
		res.err = fmt.Errorf("prefill %s: %w", u.base, err)
		return res
	}
	p.answered(u)
	defer resp.Body.Close()
	res.status = resp.StatusCode
	data, err := io.ReadAll(io.LimitReader(resp.Body, p.cfg.MaxBody+1))
	if err != nil {
		kind := errKind(err)
		if kind == kindConnect {
			kind = kindRead
		}
		return fail(kind, fmt.Errorf("reading the response: %w", err))
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		kind := kindStatus
		if refusal(resp.StatusCode) && int64(len(data)) <= p.cfg.MaxBody {
			kind, res.refused, res.answer, res.ctype = kindRejected, true, data, resp.Header.Get("Content-Type")
		}
		return fail(kind, fmt.Errorf("HTTP %d: %s", resp.StatusCode, snippet(data)))
	}
	if int64(len(data)) > p.cfg.MaxBody {
		return fail(kindProtocol, fmt.Errorf("response is over %d bytes", p.cfg.MaxBody))
	}
	if !wantParams {
		return res
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil || top == nil {
		return fail(kindProtocol, fmt.Errorf("response is not a JSON object: %s", snippet(data)))
	}
	raw := bytes.TrimSpace(top["kv_transfer_params"])
	if len(raw) == 0 || raw[0] != '{' {
		return fail(kindProtocol, fmt.Errorf("response has no kv_transfer_params object (got %q): is P's vLLM running with the kvxfer connector as a producer?", snippetN(raw, 80)))
	}
	res.params = raw
	return res
}

func snippet(b []byte) string { return snippetN(b, 512) }

func snippetN(b []byte, n int) string {
	s := strings.TrimSpace(string(b))
	if len(s) > n {
		s = s[:n] + "..."
	}
	return s
}

func (rec *record) notePrefill(res prefillResult) {
	rec.pStatus, rec.pTime = res.status, res.dur
}

func isOK(status int) bool { return status >= 200 && status <= 299 }

// generate serves a completions endpoint in the configured mode.
func (p *Proxy) generate(ep endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := newRecord(w, r, ep.path)
		if !p.admit(w, rec, start) {
			return
		}
		defer p.end(rec, start)
		body, ok := p.readJSON(w, r, rec, ep)
		if !ok {
			return
		}
		if p.cfg.Mode == ModePull {
			p.pull(w, r, rec, ep, body)
		} else {
			p.push(w, r, rec, ep, body)
		}
		if rec.cut {
			// Close the connection without ending the response properly
			// (no last chunk), so the client sees a broken response, not a
			// short one. The deferred calls above still run.
			panic(http.ErrAbortHandler)
		}
	}
}

// pull runs P to completion, then D with the kv_transfer_params P
// returned.
func (p *Proxy) pull(w http.ResponseWriter, r *http.Request, rec *record, ep endpoint, body map[string]any) {
	ctx := r.Context()
	pu, releaseP, err := p.pick(rolePrefill, nil)
	if err != nil {
		p.noPair(w, rec, err)
		return
	}
	rec.prefill = pu.base
	pBody := prefillBody(body, ep, map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": rec.transfer,
	})
	res := p.callPrefill(ctx, pu, ep, pBody, r, rec, true)
	releaseP()
	rec.notePrefill(res)
	if res.err != nil {
		p.prefillFailed(w, rec, ctx, res, false)
		return
	}
	du, releaseD, err := p.pick(roleDecode, pu)
	if err != nil {
		p.noPair(w, rec, err)
		return
	}
	defer releaseD()
	rec.decode = du.base
	p.runDecode(w, r, ctx, ctx, du, ep.path, withParams(body, res.params), rec, nil)
}

// push dispatches P and D at once under one transfer id; D's kvxferd
// registers its blocks with P's, whose prefill WRITEs into them. If P
// fails before D's response started, D's request is cancelled (which
// makes vLLM abort it) and the client gets 502; after it started, D's
// stream is cut. Once D's response is whole, P's answer is waited for at
// most prefillGrace (the client's response ends only then), then P's
// request is cancelled.
func (p *Proxy) push(w http.ResponseWriter, r *http.Request, rec *record, ep endpoint, body map[string]any) {
	ctx := r.Context()
	pu, releaseP, err := p.pick(rolePrefill, nil)
	if err != nil {
		p.noPair(w, rec, err)
		return
	}
	du, releaseD, err := p.pick(roleDecode, pu)
	if err != nil {
		releaseP()
		p.noPair(w, rec, err)
		return
	}
	defer releaseD()
	rec.prefill, rec.decode = pu.base, du.base
	pBody := prefillBody(body, ep, map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": rec.transfer, "mode": "push",
	})
	dBody := withParams(body, map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": rec.transfer, "mode": "push",
		"remote_engine_id": pu.prefill.Engine, "remote_host": pu.prefill.KVHost,
		"remote_port": pu.prefill.KVPort, "tp_size": pu.prefill.TP,
	})
	pctx, pcancel := context.WithCancelCause(ctx)
	dctx, dcancel := context.WithCancelCause(ctx)
	defer pcancel(nil)
	defer dcancel(nil)
	// The P goroutine is ours: every path below receives from pdone.
	pdone := make(chan prefillResult, 1)
	go func() {
		defer releaseP()
		res := p.callPrefill(pctx, pu, ep, pBody, r, rec, false)
		if res.err != nil && pctx.Err() == nil {
			dcancel(errPrefillFailed) // P failed on its own: D would wait for KV in vain
		}
		pdone <- res
	}()
	p.runDecode(w, r, ctx, dctx, du, ep.path, dBody, rec, func(dFailed bool) prefillResult {
		if dFailed {
			pcancel(errDecodeFailed)
		} else {
			// D's response is whole, and the client's ends only once
			// this returns: P's answer is due (it came before D's KV),
			// and one that does not come soon (P stuck in its queue
			// while D recomputed) is of no use any more.
			t := time.AfterFunc(prefillGrace, func() { pcancel(errDecodeDone) })
			defer t.Stop()
		}
		res := <-pdone
		if res.err != nil && context.Cause(pctx) == errDecodeDone {
			res.err = fmt.Errorf("no answer %v after D's response, cancelled: %w", prefillGrace, res.err)
		}
		rec.notePrefill(res)
		return res
	})
}

// runDecode sends D its request and relays D's response to the client.
// dctx is ctx (the client's) or a child of it that push cancels when P
// fails. waitP (push only) ends P's leg, cancelling it first when D
// failed, and is called exactly once before runDecode returns.
func (p *Proxy) runDecode(w http.ResponseWriter, r *http.Request, ctx, dctx context.Context, du *upstream, path string,
	body map[string]any, rec *record, waitP func(dFailed bool) prefillResult) {
	// prefillCause reports P's failure when it is why D's leg ended; read
	// before waitP, whose cancelling of P must not count as P's failure.
	prefillCause := func() bool { return context.Cause(dctx) == errPrefillFailed }
	var pres prefillResult
	pEnded := waitP == nil
	endP := func(dFailed bool) prefillResult {
		if !pEnded {
			pEnded, pres = true, waitP(dFailed)
		}
		return pres
	}
	defer endP(true) // every path below has ended P's leg already; this guards the rule
	dStart := time.Now()
	resp, err := p.send(dctx, r.Method, du.base+path, body, r, rec.id)
	if err != nil {
		pFailed := prefillCause()
		pres := endP(true)
		if pFailed {
			p.prefillFailed(w, rec, ctx, pres, false)
			return
		}
		p.sendFailed(dctx, du, err)
		p.failed(w, rec, ctx, outcomeDecodeFail, fmt.Errorf("decode %s: %w", du.base, err), false)
		return
	}
	p.answered(du)
	defer resp.Body.Close()
	rec.dStatus = resp.StatusCode
	dOK := isOK(resp.StatusCode)
	if !dOK {
		// D's own answer (its status and error body) goes to the client.
		p.upstreamError(dctx, du, statusKind(resp.StatusCode))
		endP(true)
	}
	started, err := relay(upstreamContext(resp, dctx), w, resp, func() {
		rec.dTTFB = time.Since(dStart)
		p.m.decodeTTFB.WithLabelValues(string(p.cfg.Mode)).Observe(rec.dTTFB.Seconds())
	})
	switch {
	case err == nil && dOK:
		rec.outcome = outcomeOK
		if pres := endP(false); pres.err != nil {
			rec.err = fmt.Errorf("after D's response: %w", pres.err) // D had its KV: the client is served
		}
	case err == nil:
		rec.outcome, rec.err = outcomeDecodeFail, fmt.Errorf("decode %s: HTTP %d", du.base, resp.StatusCode)
		if refusal(resp.StatusCode) {
			rec.outcome = outcomeRejected
		}
	case prefillCause():
		pres := endP(true)
		p.prefillFailed(w, rec, ctx, pres, started)
	default:
		if dOK {
			endP(true)
		}
		if !errors.Is(err, errClientGone) {
			p.upstreamError(dctx, du, kindRead)
			err = fmt.Errorf("decode %s: reading the response: %w", du.base, err)
		}
		p.failed(w, rec, ctx, outcomeDecodeFail, err, started)
	}
}

// statusKind is the error kind of an upstream's non-2xx status.
func statusKind(status int) string {
	if refusal(status) {
		return kindRejected
	}
	return kindStatus
}

// prefillFailed ends a request whose P failed: a refusal of P's (see
// refusal) goes to the client as P answered it, unless D's response
// started; any other failure as failed does.
func (p *Proxy) prefillFailed(w http.ResponseWriter, rec *record, ctx context.Context, res prefillResult, started bool) {
	if !res.refused || started || ctx.Err() != nil {
		p.failed(w, rec, ctx, outcomePrefillFail, res.err, started)
		return
	}
	rec.outcome, rec.err = outcomeRejected, res.err
	w.Header().Set("Content-Type", cmp.Or(res.ctype, "application/json"))
	w.WriteHeader(res.status)
	_, _ = w.Write(res.answer)
}

// failed ends a request that failed with outcome, or with outcomeCanceled
// when the client went away; it answers 502 unless the response started.
func (p *Proxy) failed(w http.ResponseWriter, rec *record, ctx context.Context, outcome string, err error, started bool) {
	rec.outcome, rec.err = outcome, err
	if ctx.Err() != nil || errors.Is(err, errClientGone) {
		rec.outcome = outcomeCanceled
		return
	}
	if started {
		rec.cut = true
		return
	}
	writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
}

// models forwards GET /v1/models to a D server.
func (p *Proxy) models(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rec := newRecord(w, r, "/v1/models")
	rec.transfer = ""
	if !p.admit(w, rec, start) {
		return
	}
	defer p.end(rec, start)
	du, releaseD, err := p.pick(roleDecode, nil)
	if err != nil {
		p.noPair(w, rec, err)
		return
	}
	defer releaseD()
	rec.decode = du.base
	p.runDecode(w, r, r.Context(), r.Context(), du, "/v1/models", nil, rec, nil)
	if rec.cut {
		panic(http.ErrAbortHandler) // as in generate
	}
}

// relay copies D's response to the client: status and headers once D's
// first body byte (or its end) arrived, so that a failure before then can
// still be answered with an error status; then every chunk as it is read,
// flushed, never buffered whole. started reports whether anything went
// to the client. A failed write to the client wraps errClientGone. Once
// ctx (the upstream request's) ends, a write blocked on a client that
// does not read gives up: such a client holds its request no longer than
// its upstream request may last (Config.Timeout).
func relay(ctx context.Context, w http.ResponseWriter, resp *http.Response, firstByte func()) (started bool, err error) {
	buf := make([]byte, 32<<10)
	rc := http.NewResponseController(w)
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		_ = rc.SetWriteDeadline(time.Now())
		close(fired)
	})
	defer func() {
		if !stop() {
			<-fired // set before the handler returns: the connection is not reused with it
		}
	}()
	for {
		n, rerr := resp.Body.Read(buf)
		if !started && (n > 0 || rerr == io.EOF) {
			started = true
			firstByte()
			copyHeader(w.Header(), resp.Header)
			w.WriteHeader(resp.StatusCode)
		}
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return started, fmt.Errorf("%w: %w", errClientGone, err)
			}
			if err := rc.Flush(); err != nil {
				return started, fmt.Errorf("%w: flush: %w", errClientGone, err)
			}
		}
		switch {
		case rerr == io.EOF:
			return started, nil
		case rerr != nil:
			return started, rerr
		}
	}
}

// hopHeaders are per-connection headers a proxy does not forward.
var hopHeaders = []string{"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func copyHeader(dst, src http.Header) {
	skip := map[string]bool{}
	for _, h := range hopHeaders {
		skip[h] = true
	}
	for _, v := range src.Values("Connection") {
		for f := range strings.SplitSeq(v, ",") {
			skip[http.CanonicalHeaderKey(strings.TrimSpace(f))] = true
		}
	}
	for k, vs := range src {
		if !skip[k] {
			dst[k] = append([]string(nil), vs...)
		}
	}
}

// writeError answers with an OpenAI-style JSON error.
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"error": map[string]any{"message": msg, "type": typ, "code": status},
	})
}
