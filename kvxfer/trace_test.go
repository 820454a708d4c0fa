package kvxfer

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of testdata/trace scripts")

// TestTraces steps the Worker's core alone through the scripts in
// testdata/trace: the script plays its peers, the clock and the backend,
// and after each command the test prints what the core asked for (the
// ops it wants carried out, handshakes, releases) and the outcomes it
// reported. No goroutine, clock or backend is involved: the core's
// backend panics if called. `go test ./kvxfer -run TestTraces -rewrite`
// records new output.
//
// Commands (one per case, then "----" and the expected output, then a
// blank line):
//
//	core mode=push|pull engine=D tp=0/1 [prepared=always|model]   a fresh core; prepared: posts go through prepared lists, always or where traceCost says they cost less
//	step recv=ID remote=ENGINE tid=T preq=ID blocks=1,2 [tokens=N] [deadline=30s] [remote-blocks=3,4] [remote-tp=N] [remote-gen=N] [aborted=true]   aborted: the engine aborted it before it was scheduled (no blocks); remote-gen: the params' producer generation (default 0: none, its READs wait for the hold check)
//	step send=ID tid=T blocks=1,2 [tokens=N] [deadline=30s]
//	step abort=ID [tid=T]                      the engine aborted a producer request
//	handshake ENGINE tp=N [gen=N] [hash=H] [agents=A] [probe=true] [loaded=false]   answer a handshake or probe (agents A/0..., default ENGINE/0...)
//	handshake ENGINE fail=REASON [answered=0,1 tp=N [agents=A]]   answered: a partial answer (PartialHandshakeError) by those ranks (agents A/r, default ENGINE/r)
//	notif from=ENGINE/RANK [agent=NAME] kind=reg|done|fail|cancel|ack|heartbeat [tid=] [dreq=] [preq=] [spans=1,2] [reason=] [failkind=] [tp=N]
//	ended xfer=N [fail=REASON [refused=true]]  a posted transfer ended (refused: the peer's grants refused it)
//	advance DURATION                           time passes; due timers fire
//	fail notify|post [exited=true]             the next op of that kind fails (exited: its peer's process exited, ErrPeerExited)
type traceCore struct {
	st     *loopState
	now    time.Time
	fail   map[opKind]int // ops of a kind to fail, next first
	exited map[opKind]int // of those, the first ones fail for a peer whose process exited
	engine string
	onOp   func(*op) // when set, sees every op the core asks for
}

func TestTraces(t *testing.T) {
	files, err := filepath.Glob("testdata/trace/*.txt")
	if err != nil || len(files) == 0 {
		t.Fatalf("no trace scripts: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".txt"), func(t *testing.T) { runTrace(t, f) })
	}
}

// traceCase is one command of a script and its expected output.
type traceCase struct {
	pre      []string // comments and blank lines before it
	line     int
	cmd      string
	expected string
}

// parseTrace reads a script, checking every command against traceCmds: an
// unknown command or key, a key given twice, a value that is not of its
// key's kind (a number, a duration, one of a set) is an error naming the
// line, the key and the value. A script therefore says exactly what it
// runs: nothing in it is ignored or read as zero.
func parseTrace(name string, r io.Reader) (cases []traceCase, err error) {
	sc := bufio.NewScanner(r)
	n := 0
	var cur *traceCase
	var pre []string
	inOut := false
	var out []string
	for sc.Scan() {
		n++
		l := sc.Text()
		switch {
		case inOut && l == "":
			cur.expected = strings.Join(out, "\n")
			cases = append(cases, *cur)
			cur, inOut, out = nil, false, nil
		case inOut:
			out = append(out, l)
		case l == "----":
			if cur == nil {
				return nil, fmt.Errorf("%s:%d: ---- without a command", name, n)
			}
			inOut = true
		case cur == nil && (l == "" || strings.HasPrefix(l, "#")):
			pre = append(pre, l)
		case cur == nil:
			if err := checkTraceCmd(l); err != nil {
				return nil, fmt.Errorf("%s:%d: %w", name, n, err)
			}
			cur = &traceCase{pre: pre, line: n, cmd: l}
			pre = nil
		default:
			return nil, fmt.Errorf("%s:%d: one command per case", name, n)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if inOut {
		cur.expected = strings.Join(out, "\n")
		cases = append(cases, *cur)
	} else if cur != nil {
		cases = append(cases, *cur)
	}
	return cases, nil
}

// traceVal checks a value of a script command.
type traceVal func(string) error

// traceCmd is what a command takes: its positional arguments, in order,
// and its key=value arguments, of which req must be given.
type traceCmd struct {
	pos  []traceVal
	keys map[string]traceVal
	req  []string
}

var (
	anyVal traceVal = func(string) error { return nil }
	intVal traceVal = func(v string) error { _, err := strconv.Atoi(v); return err }
	durVal traceVal = func(v string) error { _, err := time.ParseDuration(v); return err }
	// idsVal: block ids, comma-separated (empty: none).
	idsVal traceVal = func(v string) error {
		for _, f := range strings.Split(v, ",") {
			if f == "" {
				continue
			}
			if _, err := strconv.Atoi(f); err != nil {
				return err
			}
		}
		return nil
	}
	// rankVal: R/N for core's tp=.
	rankVal traceVal = func(v string) error {
		r, n, ok := strings.Cut(v, "/")
		if !ok {
			return errors.New("want RANK/SIZE")
		}
		return errors.Join(intVal(r), intVal(n))
	}
	// peerRankVal: ENGINE/RANK for notif's from=.
	peerRankVal traceVal = func(v string) error {
		e, r, ok := strings.Cut(v, "/")
		if !ok || e == "" {
			return errors.New("want ENGINE/RANK")
		}
		return intVal(r)
	}
	boolVal = oneOf("true", "false")
)

func oneOf(vals ...string) traceVal {
	return func(v string) error {
		if !slices.Contains(vals, v) {
			return fmt.Errorf("want one of %s", strings.Join(vals, ", "))
		}
		return nil
	}
}

func failKindNames() []string {
	var out []string
	for _, k := range FailureKinds() {
		out = append(out, k.String())
	}
	return out
}

// traceCmds is every command of the scripts (see TestTraces).
var traceCmds = map[string]traceCmd{
	"core": {keys: map[string]traceVal{"mode": oneOf("push", "pull"), "engine": anyVal, "tp": rankVal, "prepared": oneOf("always", "model")},
		req: []string{"engine", "tp"}},
	"step": {keys: map[string]traceVal{"recv": anyVal, "send": anyVal, "abort": anyVal, "remote": anyVal, "tid": anyVal, "preq": anyVal,
		"blocks": idsVal, "tokens": intVal, "deadline": durVal, "remote-blocks": idsVal, "remote-tp": intVal, "remote-gen": intVal, "aborted": boolVal}},
	"handshake": {pos: []traceVal{anyVal}, keys: map[string]traceVal{"tp": intVal, "gen": intVal, "hash": anyVal, "agents": anyVal,
		"probe": boolVal, "loaded": boolVal, "fail": anyVal, "offset": durVal, "answered": anyVal}},
	"notif": {keys: map[string]traceVal{"from": peerRankVal, "agent": anyVal, "kind": oneOf("reg", "done", "fail", "cancel", "ack", "heartbeat", "hold"),
		"tid": anyVal, "dreq": anyVal, "preq": anyVal, "spans": idsVal, "reason": anyVal, "failkind": oneOf(failKindNames()...),
		"tp": intVal, "ids": anyVal, "until": durVal, "hold": durVal}, req: []string{"from", "kind"}},
	"ended":   {keys: map[string]traceVal{"xfer": intVal, "fail": anyVal, "refused": boolVal}, req: []string{"xfer"}},
	"advance": {pos: []traceVal{durVal}},
	"fail":    {pos: []traceVal{oneOf("notify", "post")}, keys: map[string]traceVal{"exited": boolVal}},
}

// checkTraceCmd checks one command line against traceCmds.
func checkTraceCmd(line string) error {
	f := strings.Fields(line)
	spec, ok := traceCmds[f[0]]
	if !ok {
		return fmt.Errorf("unknown command %q", f[0])
	}
	rest := f[1:]
	if len(rest) < len(spec.pos) {
		return fmt.Errorf("%s: %d arguments, want %d before its keys", f[0], len(rest), len(spec.pos))
	}
	for i, check := range spec.pos {
		if strings.Contains(rest[i], "=") {
			return fmt.Errorf("%s: argument %d = %q, want a value before the keys", f[0], i+1, rest[i])
		}
		if err := check(rest[i]); err != nil {
			return fmt.Errorf("%s: argument %d = %q: %v", f[0], i+1, rest[i], err)
		}
	}
	seen := map[string]bool{}
	for _, kv := range rest[len(spec.pos):] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return fmt.Errorf("%s: %q is not key=value", f[0], kv)
		}
		check, known := spec.keys[k]
		if !known {
			return fmt.Errorf("%s: unknown key %q (= %q)", f[0], k, v)
		}
		if seen[k] {
			return fmt.Errorf("%s: key %q given twice (= %q)", f[0], k, v)
		}
		seen[k] = true
		if err := check(v); err != nil {
			return fmt.Errorf("%s: key %q = %q: %v", f[0], k, v, err)
		}
	}
	for _, k := range spec.req {
		if !seen[k] {
			return fmt.Errorf("%s: key %q is missing", f[0], k)
		}
	}
	return nil
}

// TestTraceParseRejects: a script that says something the parser would
// otherwise ignore or read as zero fails to parse, naming the line, the
// key and the value.
func TestTraceParseRejects(t *testing.T) {
	for _, c := range []struct {
		name, script string
		want         []string
	}{
		{"unknown key", "core mode=push engine=D tp=0/1\n----\nok\n\nstep send=p1 tid=t1 blokcs=1,2\n", []string{"x.txt:5:", `unknown key "blokcs"`, `"1,2"`}},
		{"bad number", "# a comment\nstep send=p1 tid=t1 blocks=1,2 tokens=4o\n", []string{"x.txt:2:", `key "tokens"`, `"4o"`}},
		{"bad block id", "step send=p1 blocks=1,x\n", []string{"x.txt:1:", `key "blocks"`, `"1,x"`}},
		{"bad duration", "step send=p1 deadline=30\n", []string{"x.txt:1:", `key "deadline"`, `"30"`}},
		{"bad positional duration", "advance 5\n", []string{"x.txt:1:", `"5"`}},
		{"bad rank", "core mode=push engine=D tp=1\n", []string{"x.txt:1:", `key "tp"`, `"1"`}},
		{"bad enum", "notif from=P/0 kind=regg\n", []string{"x.txt:1:", `key "kind"`, `"regg"`}},
		{"key twice", "ended xfer=1 xfer=2\n", []string{"x.txt:1:", `key "xfer" given twice`}},
		{"not key=value", "ended 1\n", []string{"x.txt:1:", `"1" is not key=value`}},
		{"unknown command", "stpe send=p1\n", []string{"x.txt:1:", `unknown command "stpe"`}},
		{"missing positional", "advance\n", []string{"x.txt:1:", "0 arguments, want 1"}},
		{"missing key", "ended fail=boom\n", []string{"x.txt:1:", `key "xfer" is missing`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseTrace("x.txt", strings.NewReader(c.script))
			if err == nil {
				t.Fatalf("parseTrace(%q) = nil error, want one naming %q", c.script, c.want)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("parseTrace(%q) = %v, want an error containing %q", c.script, err, w)
				}
			}
		})
	}
}

func runTrace(t *testing.T, path string) {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	cases, err := parseTrace(path, f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}, exited: map[opKind]int{}}
	var rewritten strings.Builder
	for _, c := range cases {
		got := tc.run(t, c.cmd)
		if *rewrite {
			for _, l := range c.pre {
				if l != "" {
					rewritten.WriteString(l + "\n")
				}
			}
			fmt.Fprintf(&rewritten, "%s\n----\n%s\n\n", c.cmd, got)
			continue
		}
		if got != c.expected {
			t.Errorf("%s:%d: %s\ngot:\n%s\nwant:\n%s", path, c.line, c.cmd, got, c.expected)
		}
	}
	if *rewrite {
		if err := os.WriteFile(path, []byte(strings.TrimRight(rewritten.String(), "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// traceLayout is every engine's layout in the scripts: one model (2 KV
// heads of size 4, 2-byte elements), one full-attention group of 16
// blocks of 16 tokens at base, the heads split over tpSize ranks.
func traceLayout(tp, tpSize int, base uint64) topology.Layout {
	return topology.Layout{TPRank: tp, TPSize: tpSize, PPSize: 1, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2,
		KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: base, BlockLen: int64(2 * 16 * 4 * 2 * 2 / tpSize), NumBlocks: 16}}}
}

// newTestCore is a Worker's core alone, at time now: its backend panics
// if called and it has no resolver (its driver is the test).
func newTestCore(t testing.TB, engine string, mode Mode, l topology.Layout, now time.Time) *loopState {
	w, err := newWorker(WorkerConfig{EngineID: engine, Addr: engine + ":1", Mode: mode, Layout: l, CompatHash: "h",
		Backend: panicBackend{}, Resolver: noResolver{}, Lease: 30 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: NewMetrics()})
	if err != nil {
		t.Fatal(err)
	}
	w.st.init(w)
	w.st.now = now
	return &w.st
}

// traceCost is the post cost model of prepared=model cores: a pair costs
// half a descriptor, so a prepared post wins unless coalescing more than
// halves the count.
var traceCost = PostCost{Fixed: time.Microsecond, PerDesc: 2 * time.Microsecond, PreparedFixed: time.Microsecond, PerPair: time.Microsecond}

// panicBackend is the core's backend in the traces: the core must never
// call it.
type panicBackend struct{ Backend }

type noResolver struct{}

func (noResolver) Handshake(context.Context, string, string) (HandshakeResult, error) {
	panic("the core ran a handshake itself")
}

func args(fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		m[k] = v
	}
	return m
}

// atoi is strconv.Atoi of a number checkTraceCmd accepted.
func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		panic(fmt.Sprintf("a trace number parseTrace let through: %v", err))
	}
	return n
}

func traceIDs(s string) []topology.BlockID {
	var out []topology.BlockID
	for _, f := range strings.Split(s, ",") {
		if f == "" {
			continue
		}
		out = append(out, topology.BlockID(atoi(f)))
	}
	return out
}

func dur(t *testing.T, s string) time.Duration {
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("duration %q: %v", s, err)
	}
	return d
}

func (tc *traceCore) run(t *testing.T, line string) string {
	f := strings.Fields(line)
	a := args(f[1:])
	var out []string
	switch f[0] {
	case "core":
		rank, size, _ := strings.Cut(a["tp"], "/")
		r, n := atoi(rank), atoi(size)
		mode := ModePush
		if a["mode"] == "pull" {
			mode = ModePull
		}
		tc.st, tc.engine = newTestCore(t, a["engine"], mode, traceLayout(r, n, 1<<20), tc.now), a["engine"]
		switch a["prepared"] {
		case "always":
			tc.st.prepare = true
		case "model":
			tc.st.prepare, tc.st.cost, tc.st.costed = true, traceCost, true
		}
		return "ok"
	case "step":
		meta := &StepMeta{SchedulerClock: tc.now}
		deadline := tc.now.Add(30 * time.Second)
		if d, ok := a["deadline"]; ok {
			deadline = tc.now.Add(dur(t, d))
		}
		tokens := atoi(cmpOr(a["tokens"], "0"))
		switch {
		case a["recv"] != "":
			remoteTP := 1
			if v, ok := a["remote-tp"]; ok {
				remoteTP = atoi(v)
			}
			rr := RecvReq{ReqID: a["recv"], TransferID: a["tid"], Local: []topology.Span{{IDs: traceIDs(a["blocks"])}}, Deadline: deadline,
				Remote: RemoteRef{EngineID: a["remote"], Addr: a["remote"] + ":1", ReqID: a["preq"], TPSize: remoteTP, PPSize: 1, Tokens: tokens}}
			if rb, ok := a["remote-blocks"]; ok {
				rr.Remote.Blocks = []topology.Span{{IDs: traceIDs(rb)}}
			}
			if g, ok := a["remote-gen"]; ok {
				rr.Remote.Generation = uint64(atoi(g))
			}
			if a["aborted"] == "true" {
				// Aborted before it was scheduled: it holds no blocks.
				rr.Local, rr.Aborted = nil, true
			}
			meta.Recv = []RecvReq{rr}
		case a["send"] != "":
			meta.Send = []SendReq{{ReqID: a["send"], TransferID: a["tid"], Deadline: deadline, Tokens: tokens,
				Blocks: []topology.Span{{IDs: traceIDs(a["blocks"])}}}}
		case a["abort"] != "":
			meta.NotProcessed = []string{a["abort"]}
			meta.NotProcessedTransferIDs = map[string]string{a["abort"]: a["tid"]}
		}
		tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	case "handshake":
		h := &hsResult{engine: f[1]}
		if reason, ok := a["fail"]; ok {
			h.err = fmt.Errorf("%s", reason)
			if v, ok := a["answered"]; ok { // a spread engine's ranks that answered (PartialHandshakeError)
				n := atoi(cmpOr(a["tp"], "1"))
				for _, rs := range strings.Split(v, ",") {
					r := atoi(rs)
					agent := fmt.Sprintf("%s/%d", cmpOr(a["agents"], f[1]), r)
					h.res.Ranks = append(h.res.Ranks, RankInfo{EngineID: f[1], CompatHash: "h", Layout: traceLayout(r, n, 1<<30), Agent: []byte(agent)})
					h.names, h.loadErrs = append(h.names, PeerName(agent)), append(h.loadErrs, nil)
				}
				h.err = &PartialHandshakeError{Answered: h.res.Ranks, Err: h.err}
			}
		} else {
			n := atoi(cmpOr(a["tp"], "0"))
			gen := atoi(cmpOr(a["gen"], "1"))
			for r := range n {
				agent := fmt.Sprintf("%s/%d", f[1], r)
				if g := a["agents"]; g != "" {
					// One name for every rank, or one a rank (a,b,...).
					if names := strings.Split(g, ","); len(names) > 1 {
						g = names[min(r, len(names)-1)]
					}
					agent = fmt.Sprintf("%s/%d", g, r)
				}
				h.res.Ranks = append(h.res.Ranks, RankInfo{EngineID: f[1], CompatHash: cmpOr(a["hash"], "h"),
					Layout: traceLayout(r, n, 1<<30), Agent: []byte(agent)})
				if a["loaded"] != "false" { // the driver loaded the agents
					h.names = append(h.names, PeerName(agent))
					h.loadErrs = append(h.loadErrs, nil)
				}
			}
			h.res.Generation = uint64(gen)
			if v, ok := a["offset"]; ok { // the peer's clock minus ours
				h.res.ClockOffset = dur(t, v)
			}
		}
		h.probe = a["probe"] == "true"
		tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	case "notif":
		from, rank, _ := strings.Cut(a["from"], "/")
		r := atoi(rank)
		size := atoi(cmpOr(a["tp"], "1"))
		kinds := map[string]msgKind{"reg": msgReg, "done": msgDone, "fail": msgFail, "cancel": msgCancel, "ack": msgAck, "heartbeat": msgHeartbeat, "hold": msgHold}
		m := &msg{Kind: kinds[a["kind"]], Engine: from, Addr: from + ":1", TPRank: r, TPSize: size, PPSize: 1, TransferID: a["tid"],
			DReq: a["dreq"], PReq: a["preq"], Reason: a["reason"]}
		if s, ok := a["spans"]; ok {
			m.Spans = []topology.Span{{IDs: traceIDs(s)}}
		}
		if v, ok := a["ids"]; ok {
			m.IDs = strings.Split(v, ",")
		}
		for _, k := range FailureKinds() {
			if k.String() == a["failkind"] {
				m.FailKind = k
			}
		}
		if v, ok := a["until"]; ok { // a registration's limit, from the scripts' start
			m.Until = traceEpoch.Add(dur(t, v))
		}
		if v, ok := a["hold"]; ok { // a hold answer's deadline, from the scripts' start
			m.Holds = []time.Time{traceEpoch.Add(dur(t, v))}
		}
		n := Notif{From: PeerName(cmpOr(a["agent"], a["from"])), Msg: appendMsg(nil, m)}
		tc.st.Step(tc.now, input{kind: inNotifs, notifs: []Notif{n}})
	case "ended":
		id := atoi(a["xfer"])
		in := input{kind: inXferEnded, xfer: XferID(id), state: XferDone}
		if reason, ok := a["fail"]; ok {
			in.state, in.err = XferFailed, fmt.Errorf("%w: %s", ErrXferFailed, reason)
			if a["refused"] == "true" {
				in.err = fmt.Errorf("%w: %w: %s", ErrXferFailed, ErrNotGranted, reason)
			}
		}
		tc.st.Step(tc.now, in)
	case "advance":
		tc.now = tc.now.Add(dur(t, f[1]))
		tc.st.Step(tc.now, input{kind: inTimers})
	case "fail":
		k := map[string]opKind{"notify": opNotify, "post": opPost}[f[1]]
		tc.fail[k]++
		if a["exited"] == "true" {
			tc.exited[k]++
		}
		return "ok"
	default:
		t.Fatalf("unknown command %q", line)
	}
	out = tc.drive(out, "")
	if len(out) == 0 {
		return "(nothing)"
	}
	return strings.Join(out, "\n")
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// drive plays the driver: it prints the ops the core asked for and hands
// back their results (each succeeds unless a "fail" is pending for its
// kind), then prints the rest of the core's effects and its outcomes.
func (tc *traceCore) drive(out []string, indent string) []string {
	st := tc.st
	carryOut(st, nil, nil, func(round int, o *op) error {
		k := o.kind
		if k == opPostPrepared || k == opPostLayout {
			k = opPost
		}
		if tc.onOp != nil {
			tc.onOp(o)
		}
		line := indent + strings.Repeat("  ", round) + tc.describe(o)
		var err error
		if tc.fail[k] > 0 {
			tc.fail[k]--
			err = fmt.Errorf("injected %s failure", map[opKind]string{opNotify: "notify", opPost: "post"}[k])
			line += " -> fails"
			if tc.exited[k] > 0 {
				tc.exited[k]--
				err = fmt.Errorf("%w: %w: %w: injected: peer %s: its process exited", ErrXferFailed, ErrPeerLost, ErrPeerExited, o.peer)
				line += " (its process exited)"
			}
		}
		out = append(out, line)
		return err
	})
	fx := &st.fx
	for _, a := range fx.asks {
		what := "handshake"
		if a.probe {
			what = "probe"
		}
		out = append(out, fmt.Sprintf("%s %s at %s", what, a.engine, a.addr))
	}
	for _, id := range fx.releases {
		out = append(out, fmt.Sprintf("release #%d", id))
	}
	abandoned := slices.Clone(fx.abandon)
	for _, id := range abandoned {
		out = append(out, fmt.Sprintf("abandon #%d", id))
	}
	for _, p := range fx.invalidate {
		out = append(out, fmt.Sprintf("forget peer %s", p))
	}
	fx.asks, fx.releases, fx.abandon, fx.invalidate, fx.unprepare = fx.asks[:0], fx.releases[:0], fx.abandon[:0], fx.invalidate[:0], fx.unprepare[:0]
	for _, id := range abandoned {
		// Released at once: the request reports with the rest.
		st.Step(tc.now, input{kind: inReleased, xfer: id})
		out = tc.drive(out, indent)
	}
	for _, o := range st.out.Sending {
		out = append(out, "outcome send "+describeOutcome(o))
	}
	for _, o := range st.out.Recving {
		out = append(out, "outcome recv "+describeOutcome(o))
	}
	if len(st.out.InvalidBlocks) > 0 {
		out = append(out, fmt.Sprintf("invalid blocks %v", st.out.InvalidBlocks))
	}
	st.out = Finished{}
	return out
}

func describeOutcome(o Outcome) string {
	s := o.ReqID + " " + o.Result.String()
	if o.Kind != FailureNone {
		s += " (" + o.Kind.String() + ")"
	}
	if o.Reason != "" {
		s += ": " + o.Reason
	}
	return s
}

// describe prints an op: notifications decoded, posts by their size.
func (tc *traceCore) describe(o *op) string {
	switch o.kind {
	case opNotify:
		return "notify " + string(o.peer) + " " + describeMsg(o.msg)
	case opPrepare:
		return fmt.Sprintf("prepare list %d of %q: %d entries", o.prep, o.peer, len(o.entries))
	case opPostPrepared:
		verb := "write"
		if o.xop == hotpath.OpRead {
			verb = "read"
		}
		s := fmt.Sprintf("post #%d %s prepared %d and %d: %d pairs", o.id, verb, o.local, o.remote, o.to-o.from)
		if o.msg != nil {
			s += ", then " + describeMsg(o.msg)
		}
		return s
	case opPost, opPostLayout:
		verb := "write"
		if o.xop == hotpath.OpRead {
			verb = "read"
		}
		var descs []hotpath.Desc
		if o.kind == opPostLayout {
			descs = tc.st.fx.lays.Expand(nil, tc.st.fx.lays.Spans[o.from:o.to])
		} else {
			descs = tc.st.fx.descs[o.from:o.to]
		}
		var bytes uint64
		for _, d := range descs {
			bytes += d.Len
		}
		s := fmt.Sprintf("post #%d %s %s: %d descs, %d bytes", o.id, verb, o.peer, len(descs), bytes)
		if o.msg != nil {
			s += ", then " + describeMsg(o.msg)
		}
		return s
	}
	return fmt.Sprintf("op %d", o.kind)
}

func describeMsg(b []byte) string {
	m, err := decodeMsg(b)
	if err != nil {
		return "malformed: " + err.Error()
	}
	s := m.Kind.String()
	for _, kv := range [][2]string{{"tid", m.TransferID}, {"dreq", m.DReq}, {"preq", m.PReq}} {
		if kv[1] != "" {
			s += " " + kv[0] + "=" + kv[1]
		}
	}
	if len(m.Spans) > 0 {
		s += fmt.Sprintf(" spans=%v", m.Spans[0].IDs)
	}
	if len(m.IDs) > 0 {
		s += " ids=" + strings.Join(m.IDs, ",")
	}
	if m.Reason != "" {
		s += fmt.Sprintf(" reason=%q", m.Reason)
	}
	if m.FailKind != FailureNone {
		s += " kind=" + m.FailKind.String()
	}
	if !m.Until.IsZero() {
		s += " until=" + m.Until.Sub(traceEpoch).String()
	}
	for _, h := range m.Holds {
		s += " hold=" + h.Sub(traceEpoch).String()
	}
	return s
}

// traceEpoch is the scripts' start: times in them are offsets from it.
var traceEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
