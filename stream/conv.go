package stream

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// ErrInvalid wraps every error about a malformed message; kvxferd answers
// it with InvalidArgument.
var ErrInvalid = errors.New("stream: invalid message")

// Invalid is an error about a malformed message (it wraps ErrInvalid);
// format names the field.
func Invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// The proto enums number their values like topology's and kvxfer's, so a
// checked cast converts them.

// FitInt converts field's value v to an int, refusing values outside
// int32's range with an error naming the field.
func FitInt(name string, v int64) (int, error) { return fitField(field{list: name, i: -1}, v) }

// fitField is FitInt for a field of a list entry, its name formatted only
// for an error (no allocation per field).
func fitField(f field, v int64) (int, error) {
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, Invalid("%v = %d out of range", f, v)
	}
	return int(v), nil
}

// LayoutFromProto converts and validates a layout.
func LayoutFromProto(field string, p *pb.KvLayout) (topology.Layout, error) {
	if p == nil {
		return topology.Layout{}, Invalid("%s is missing", field)
	}
	l := topology.Layout{TPRank: int(p.TpRank), TPSize: int(p.TpSize), PPRank: int(p.PpRank), PPSize: int(p.PpSize),
		TotalKVHeads: int(p.TotalKvHeads), HeadSize: int(p.HeadSize), ElemBytes: int(p.ElemBytes),
		KVLayout: topology.KVLayout(p.Order), Packing: topology.KVPacking(p.Packing),
		LogicalBlockSize: int(p.LogicalBlockSize), KernelBlockSize: int(p.KernelBlockSize), RegionOffset: int(p.RegionOffset)}
	if p.Order < 1 || p.Order > 2 {
		return l, Invalid("%s.order = %v, want HND or NHD", field, p.Order)
	}
	if p.Packing < 1 || p.Packing > 3 {
		return l, Invalid("%s.packing = %v, want packed, split or separate", field, p.Packing)
	}
	for i, r := range p.Regions {
		f := fmt.Sprintf("%s.regions[%d]", field, i)
		if r.Kind < 1 || r.Kind > 4 {
			return l, Invalid("%s.kind = %v unknown", f, r.Kind)
		}
		w, err := FitInt(f+".window", r.Window)
		if err != nil {
			return l, err
		}
		nb, err := FitInt(f+".num_blocks", r.NumBlocks)
		if err != nil {
			return l, err
		}
		l.Regions = append(l.Regions, topology.Region{Kind: topology.Kind(r.Kind), Window: w, Base: r.Base, BlockLen: r.BlockLen,
			NumBlocks: nb, DeviceID: r.DeviceId, ConvBytes: r.ConvBytes, SSMBytes: r.SsmBytes})
	}
	for i, g := range p.Groups {
		f := fmt.Sprintf("%s.groups[%d]", field, i)
		if g.Kind < 1 || g.Kind > 4 {
			return l, Invalid("%s.kind = %v unknown", f, g.Kind)
		}
		w, err := FitInt(f+".window", g.Window)
		if err != nil {
			return l, err
		}
		grp := topology.Group{Kind: topology.Kind(g.Kind), Window: w}
		for _, r := range g.Regions {
			grp.Regions = append(grp.Regions, int(r))
		}
		l.Groups = append(l.Groups, grp)
	}
	if err := l.Validate(); err != nil {
		return l, fmt.Errorf("%w: %s: %w", ErrInvalid, field, err)
	}
	return l, nil
}

// LayoutToProto converts a layout.
func LayoutToProto(l *topology.Layout) *pb.KvLayout {
	p := &pb.KvLayout{TpRank: int32(l.TPRank), TpSize: int32(l.TPSize), PpRank: int32(l.PPRank), PpSize: int32(l.PPSize),
		TotalKvHeads: int32(l.TotalKVHeads), HeadSize: int32(l.HeadSize), ElemBytes: int32(l.ElemBytes),
		Order: pb.KvLayoutOrder(l.KVLayout), Packing: pb.KvPacking(l.Packing),
		LogicalBlockSize: int32(l.LogicalBlockSize), KernelBlockSize: int32(l.KernelBlockSize), RegionOffset: int32(l.RegionOffset)}
	for _, r := range l.Regions {
		p.Regions = append(p.Regions, &pb.Region{Kind: pb.CacheKind(r.Kind), Window: int64(r.Window), Base: r.Base, BlockLen: r.BlockLen,
			NumBlocks: int64(r.NumBlocks), DeviceId: r.DeviceID, ConvBytes: r.ConvBytes, SsmBytes: r.SSMBytes})
	}
	for _, g := range l.Groups {
		pg := &pb.CacheGroup{Kind: pb.CacheKind(g.Kind), Window: int64(g.Window)}
		for _, r := range g.Regions {
			pg.Regions = append(pg.Regions, int32(r))
		}
		p.Groups = append(p.Groups, pg)
	}
	return p
}

func spansToProto(ss []topology.Span) []*pb.Span {
	out := make([]*pb.Span, len(ss))
	for i, s := range ss {
		ids := make([]int32, len(s.IDs))
		for j, b := range s.IDs {
			ids[j] = int32(b)
		}
		out[i] = &pb.Span{Start: int64(s.Start), BlockIds: ids}
	}
	return out
}

func timeFrom(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

func timeTo(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// StepFromProto converts a step's metadata; errors name the field. A
// step's block lists share two allocations (one for its spans, one for
// their ids), so the conversion allocates per step, not per request. An
// entry it cannot read fails the whole conversion (StepEntriesFromProto
// leaves it out instead).
func StepFromProto(p *pb.StepMeta) (*kvxfer.StepMeta, error) {
	m, refused, err := StepEntriesFromProto(p)
	if err != nil {
		return nil, err
	}
	if len(refused) > 0 {
		return nil, refused[0].Err
	}
	return m, nil
}

// EntryRefusal is a step entry StepEntriesFromProto could not read: the
// kvxfer.Refusal for Worker.StepRefusing, and the error naming its field
// and value (it wraps ErrInvalid).
type EntryRefusal struct {
	kvxfer.Refusal
	Err error
}

// StepEntriesFromProto converts a step's metadata, leaving out each entry
// it cannot read (a missing entry, remote or span, a number out of range)
// and returning it as a refusal that names its request, field and value:
// one malformed entry loses nothing else of the step (its other entries,
// its aborts). Only a missing step is an error.
func StepEntriesFromProto(p *pb.StepMeta) (*kvxfer.StepMeta, []EntryRefusal, error) {
	if p == nil {
		return nil, nil, Invalid("step is missing")
	}
	var (
		a       spanArena
		refused []EntryRefusal
	)
	refuse := func(role kvxfer.Role, id string, local []topology.Span, label string, err error) {
		refused = append(refused, EntryRefusal{Refusal: kvxfer.Refusal{Role: role, ReqID: id, Local: local, Field: label,
			Reason: strings.TrimPrefix(err.Error(), ErrInvalid.Error()+": ")}, Err: err})
	}
	a.size(p)
	m := &kvxfer.StepMeta{Step: p.Step, SchedulerClock: timeFrom(p.SchedulerClockUnixNanos), NotProcessed: p.NotProcessed,
		NotProcessedTransferIDs: p.NotProcessedTransferIds, Preempted: p.Preempted}
	if len(p.Recv) > 0 {
		m.Recv = make([]kvxfer.RecvReq, 0, len(p.Recv))
	}
	for i, r := range p.Recv {
		if r == nil {
			refuse(kvxfer.RoleConsumer, "", nil, "recv_req", Invalid("%s is missing", field{"step.recv", i, ""}))
			continue
		}
		local, err := a.spans(field{"step.recv", i, ".local"}, r.Local)
		if err != nil {
			refuse(kvxfer.RoleConsumer, r.RequestId, nil, "recv_req.local", err)
			continue
		}
		if r.Remote == nil {
			refuse(kvxfer.RoleConsumer, r.RequestId, local, "recv_req.remote", Invalid("%s.remote is missing", field{"step.recv", i, ""}))
			continue
		}
		blocks, err := a.spans(field{"step.recv", i, ".remote.blocks"}, r.Remote.Blocks)
		if err != nil {
			refuse(kvxfer.RoleConsumer, r.RequestId, local, "recv_req.remote.blocks", err)
			continue
		}
		tok, err := fitField(field{"step.recv", i, ".remote.tokens"}, r.Remote.Tokens)
		if err != nil {
			refuse(kvxfer.RoleConsumer, r.RequestId, local, "recv_req.remote.tokens", err)
			continue
		}
		own, err := fitField(field{"step.recv", i, ".tokens"}, r.Tokens)
		if err != nil {
			refuse(kvxfer.RoleConsumer, r.RequestId, local, "recv_req.tokens", err)
			continue
		}
		m.Recv = append(m.Recv, kvxfer.RecvReq{ReqID: r.RequestId, TransferID: r.TransferId, Local: local, Aborted: r.Aborted,
			Deadline: timeFrom(r.DeadlineUnixNanos), Tokens: own,
			Remote: kvxfer.RemoteRef{EngineID: r.Remote.EngineId, Addr: r.Remote.Addr, ReqID: r.Remote.RequestId,
				TPSize: int(r.Remote.TpSize), PPSize: int(r.Remote.PpSize), Blocks: blocks, Tokens: tok, Expiry: timeFrom(r.Remote.ExpiryUnixNanos),
				Generation: r.Remote.Generation}})
	}
	conv := func(name, label string, role kvxfer.Role, in []*pb.SendRequest) []kvxfer.SendReq {
		if len(in) == 0 {
			return nil
		}
		out := make([]kvxfer.SendReq, 0, len(in))
		for i, s := range in {
			if s == nil {
				refuse(role, "", nil, label, Invalid("%s is missing", field{name, i, ""}))
				continue
			}
			blocks, err := a.spans(field{name, i, ".blocks"}, s.Blocks)
			if err != nil {
				refuse(role, s.RequestId, nil, label+".blocks", err)
				continue
			}
			tok, err := fitField(field{name, i, ".tokens"}, s.Tokens)
			if err != nil {
				refuse(role, s.RequestId, nil, label+".tokens", err)
				continue
			}
			out = append(out, kvxfer.SendReq{ReqID: s.RequestId, TransferID: s.TransferId, Deadline: timeFrom(s.DeadlineUnixNanos), Blocks: blocks, Tokens: tok})
		}
		return out
	}
	m.Send = conv("step.send", "send_req", kvxfer.RoleProducer, p.Send)
	m.Prefill = conv("step.prefill", "prefill", 0, p.Prefill)
	m.AwaitEnd = p.AwaitEnd
	if len(p.Await) > 0 {
		// No outcome waits on an entry of await: one the worker cannot
		// use (no request, no remote) is counted there and dropped.
		m.Await = make([]kvxfer.AwaitReq, 0, len(p.Await))
		for _, r := range p.Await {
			rm := r.GetRemote()
			m.Await = append(m.Await, kvxfer.AwaitReq{ReqID: r.GetRequestId(), TransferID: r.GetTransferId(),
				Remote: kvxfer.RemoteRef{EngineID: rm.GetEngineId(), Addr: rm.GetAddr(), ReqID: rm.GetRequestId(),
					TPSize: int(rm.GetTpSize()), PPSize: int(rm.GetPpSize()), Expiry: timeFrom(rm.GetExpiryUnixNanos()),
					Generation: rm.GetGeneration()}})
		}
	}
	return m, refused, nil
}

// field names a field of a list entry (list[i]sub), or, with i < 0, the
// field list; formatted only for an error.
type field struct {
	list string
	i    int
	sub  string
}

func (f field) String() string {
	if f.i < 0 {
		return f.list
	}
	return fmt.Sprintf("%s[%d]%s", f.list, f.i, f.sub)
}

// spanArena holds a step's spans and block ids, each in one allocation;
// what it hands out is capped at its own length (appending to one span's
// ids never reaches the next one's).
type spanArena struct {
	list []topology.Span
	ids  []topology.BlockID
}

// size allocates for every block list of p.
func (a *spanArena) size(p *pb.StepMeta) {
	var spans, ids int
	count := func(ss []*pb.Span) {
		spans += len(ss)
		for _, s := range ss {
			ids += len(s.GetBlockIds())
		}
	}
	for _, r := range p.Recv {
		count(r.GetLocal())
		count(r.GetRemote().GetBlocks())
	}
	for _, s := range p.Send {
		count(s.GetBlocks())
	}
	for _, s := range p.Prefill {
		count(s.GetBlocks())
	}
	a.list = make([]topology.Span, 0, spans)
	a.ids = make([]topology.BlockID, 0, ids)
}

// spans converts ps (nil for none) into the arena; f names the list in
// errors. A zero arena grows as it goes.
func (a *spanArena) spans(f field, ps []*pb.Span) ([]topology.Span, error) {
	if len(ps) == 0 {
		return nil, nil
	}
	first := len(a.list)
	for j, s := range ps {
		if s == nil {
			return nil, Invalid("%v[%d] is missing", f, j)
		}
		if s.Start < math.MinInt32 || s.Start > math.MaxInt32 {
			return nil, Invalid("%v[%d].start = %d out of range", f, j, s.Start)
		}
		k := len(a.ids)
		for _, b := range s.BlockIds {
			a.ids = append(a.ids, topology.BlockID(b))
		}
		a.list = append(a.list, topology.Span{Start: int(s.Start), IDs: a.ids[k:len(a.ids):len(a.ids)]})
	}
	return a.list[first:len(a.list):len(a.list)], nil
}

// StepToProto converts a step's metadata into a message of its own (one
// StepEncoder's).
func StepToProto(m *kvxfer.StepMeta) *pb.StepMeta { return new(StepEncoder).Encode(m) }

// keepCap bounds what an encoder keeps between messages, in entries of
// each of its slices: memory for a bigger message is made for it alone.
const keepCap = 1 << 14

// reuse returns s resliced to n entries when it holds them and is not
// bigger than it need be (keepCap or n), else a new slice of n.
func reuse[T any](s []T, n int) []T {
	if cap(s) < n || cap(s) > max(n, keepCap) {
		return make([]T, n)
	}
	return s[:n]
}

// StepEncoder converts steps' metadata to kvxfer.v1 into memory it keeps
// from one step to the next: past the first steps (the biggest so far,
// up to keepCap requests), encoding allocates nothing. The message Encode
// returns, and every list in it, is the encoder's: valid until the next
// Encode, and read-only (the caller may send it, and must be done with
// it, before the next Encode). A StepEncoder is not safe for concurrent
// use; its zero value is ready.
type StepEncoder struct {
	msg      pb.StepMeta
	recvs    []pb.RecvRequest
	remotes  []pb.RemoteRef
	recvPtrs []*pb.RecvRequest
	sends    []pb.SendRequest
	sendPtrs []*pb.SendRequest
	spans    protoSpans
}

// Encode converts m; see StepEncoder for how long the result is valid.
func (e *StepEncoder) Encode(m *kvxfer.StepMeta) *pb.StepMeta {
	p := &e.msg
	p.Step, p.SchedulerClockUnixNanos, p.NotProcessed, p.NotProcessedTransferIds = m.Step, timeTo(m.SchedulerClock), m.NotProcessed, m.NotProcessedTransferIDs
	p.Preempted = m.Preempted
	p.Recv, p.Send, p.Prefill = nil, nil, nil
	// The messages, their pointers, the spans and the block ids each come
	// out of one slice sized first.
	a := &e.spans
	a.reset()
	for i := range m.Recv {
		a.count(m.Recv[i].Local)
		a.count(m.Recv[i].Remote.Blocks)
	}
	for i := range m.Send {
		a.count(m.Send[i].Blocks)
	}
	for i := range m.Prefill {
		a.count(m.Prefill[i].Blocks)
	}
	a.alloc()
	if n := len(m.Recv); n > 0 {
		e.recvs, e.remotes, e.recvPtrs = reuse(e.recvs, n), reuse(e.remotes, n), reuse(e.recvPtrs, n)
		for i := range m.Recv {
			r := &m.Recv[i]
			rm := &e.remotes[i]
			rm.EngineId, rm.Addr, rm.RequestId = r.Remote.EngineID, r.Remote.Addr, r.Remote.ReqID
			rm.TpSize, rm.PpSize, rm.Tokens, rm.ExpiryUnixNanos = int32(r.Remote.TPSize), int32(r.Remote.PPSize), int64(r.Remote.Tokens), timeTo(r.Remote.Expiry)
			rm.Generation = r.Remote.Generation
			rm.Blocks = a.spans(r.Remote.Blocks)
			q := &e.recvs[i]
			q.RequestId, q.TransferId, q.Aborted, q.DeadlineUnixNanos, q.Tokens = r.ReqID, r.TransferID, r.Aborted, timeTo(r.Deadline), int64(r.Tokens)
			q.Local, q.Remote = a.spans(r.Local), rm
			e.recvPtrs[i] = q
		}
		p.Recv = e.recvPtrs
	}
	if n := len(m.Send) + len(m.Prefill); n > 0 {
		e.sends, e.sendPtrs = reuse(e.sends, n), reuse(e.sendPtrs, n)
		k := 0
		conv := func(in []kvxfer.SendReq) []*pb.SendRequest {
			if len(in) == 0 {
				return nil
			}
			from := k
			for i := range in {
				s := &in[i]
				q := &e.sends[k]
				q.RequestId, q.TransferId, q.DeadlineUnixNanos, q.Tokens = s.ReqID, s.TransferID, timeTo(s.Deadline), int64(s.Tokens)
				q.Blocks = a.spans(s.Blocks)
				e.sendPtrs[k] = q
				k++
			}
			return e.sendPtrs[from:k:k]
		}
		p.Send, p.Prefill = conv(m.Send), conv(m.Prefill)
	}
	p.Await, p.AwaitEnd = nil, m.AwaitEnd
	if len(m.Await) > 0 {
		// Rare (a request's arrival): made for the message alone.
		p.Await = make([]*pb.RecvRequest, len(m.Await))
		for i := range m.Await {
			w := &m.Await[i]
			p.Await[i] = &pb.RecvRequest{RequestId: w.ReqID, TransferId: w.TransferID, Remote: &pb.RemoteRef{EngineId: w.Remote.EngineID,
				Addr: w.Remote.Addr, RequestId: w.Remote.ReqID, TpSize: int32(w.Remote.TPSize), PpSize: int32(w.Remote.PPSize),
				ExpiryUnixNanos: timeTo(w.Remote.Expiry), Generation: w.Remote.Generation}}
		}
	}
	return p
}

// protoSpans hands out a message's spans and block ids from slices sized
// once per message and kept (reset, count every list, alloc, then spans
// for each list in turn).
type protoSpans struct {
	nspans, nids int
	spanv        []pb.Span
	ptrs         []*pb.Span
	ids          []int32
	// next span and pointer to hand out
	next int
}

func (a *protoSpans) reset() { a.nspans, a.nids, a.next = 0, 0, 0 }

func (a *protoSpans) count(ss []topology.Span) {
	a.nspans += len(ss)
	for _, s := range ss {
		a.nids += len(s.IDs)
	}
}

func (a *protoSpans) alloc() {
	a.spanv, a.ptrs = reuse(a.spanv, a.nspans), reuse(a.ptrs, a.nspans)
	a.ids = reuse(a.ids, a.nids)[:0]
}

// spans converts ss into the arena: each list of ids capped, so that
// appending to one never reaches the next.
func (a *protoSpans) spans(ss []topology.Span) []*pb.Span {
	if len(ss) == 0 {
		return nil
	}
	out := a.ptrs[a.next : a.next+len(ss) : a.next+len(ss)]
	for i, s := range ss {
		from := len(a.ids)
		for _, b := range s.IDs {
			a.ids = append(a.ids, int32(b))
		}
		sp := &a.spanv[a.next+i]
		sp.Start, sp.BlockIds = int64(s.Start), a.ids[from:len(a.ids):len(a.ids)]
		out[i] = sp
	}
	a.next += len(ss)
	return out
}

// FinishedToProto converts a rank's finished sets into a message of its
// own (one FinishedEncoder's): a few allocations per set, none per
// outcome.
func FinishedToProto(f *kvxfer.Finished) *pb.Finished { return new(FinishedEncoder).Encode(f) }

// FinishedEncoder converts a rank's finished sets to kvxfer.v1 into
// memory it keeps from one set to the next: past the first sets (the
// biggest so far, up to keepCap outcomes), encoding allocates nothing.
// The message Encode returns is the encoder's, as StepEncoder's is: valid
// until the next Encode; the caller may set its Stats. Not safe for
// concurrent use; its zero value is ready.
type FinishedEncoder struct {
	msg      pb.Finished
	outcomes []pb.Outcome
	ptrs     []*pb.Outcome
	ids      []int32
}

// Encode converts f; see FinishedEncoder for how long the result is
// valid.
func (e *FinishedEncoder) Encode(f *kvxfer.Finished) *pb.Finished {
	p := &e.msg
	p.Sending, p.Recving, p.InvalidBlockIds, p.Stats = nil, nil, nil, nil
	if n := len(f.Sending) + len(f.Recving); n > 0 {
		e.outcomes, e.ptrs = reuse(e.outcomes, n), reuse(e.ptrs, n)
		k := 0
		conv := func(os []kvxfer.Outcome) []*pb.Outcome {
			if len(os) == 0 {
				return nil
			}
			from := k
			for i := range os {
				o := &os[i]
				m := &e.outcomes[k]
				m.RequestId, m.Result, m.Reason, m.FailureKind = o.ReqID, pb.Outcome_Result(o.Result), o.Reason, pb.FailureKind(o.Kind)
				e.ptrs[k] = m
				k++
			}
			return e.ptrs[from:k:k]
		}
		p.Sending, p.Recving = conv(f.Sending), conv(f.Recving)
	}
	if n := len(f.InvalidBlocks); n > 0 {
		e.ids = reuse(e.ids, n)
		for i, b := range f.InvalidBlocks {
			e.ids[i] = int32(b)
		}
		p.InvalidBlockIds = e.ids
	}
	return p
}

// FinishedFromProto converts finished sets (client side).
func FinishedFromProto(p *pb.Finished) (kvxfer.Finished, error) {
	var f kvxfer.Finished
	conv := func(name string, ps []*pb.Outcome) ([]kvxfer.Outcome, error) {
		if len(ps) == 0 {
			return nil, nil
		}
		out := make([]kvxfer.Outcome, 0, len(ps))
		for i, o := range ps {
			if o == nil || o.Result < 1 || o.Result > 4 {
				return nil, Invalid("finished.%s[%d].result unknown", name, i)
			}
			if o.FailureKind < 0 || o.FailureKind > 255 {
				return nil, Invalid("finished.%s[%d].failure_kind %d out of range", name, i, o.FailureKind)
			}
			out = append(out, kvxfer.Outcome{ReqID: o.RequestId, Result: kvxfer.Result(o.Result), Reason: o.Reason,
				Kind: kvxfer.FailureKind(o.FailureKind)})
		}
		return out, nil
	}
	var err error
	if f.Sending, err = conv("sending", p.GetSending()); err != nil {
		return f, err
	}
	if f.Recving, err = conv("recving", p.GetRecving()); err != nil {
		return f, err
	}
	if ids := p.GetInvalidBlockIds(); len(ids) > 0 {
		f.InvalidBlocks = make([]topology.BlockID, len(ids))
		for i, b := range ids {
			f.InvalidBlocks[i] = topology.BlockID(b)
		}
	}
	return f, nil
}

// ParamsFromProto converts and validates a request's transfer params (nil
// stays nil); errors name the field.
func ParamsFromProto(p *pb.TransferParams) (*kvxfer.TransferParams, error) {
	if p == nil {
		return nil, nil
	}
	blocks, err := new(spanArena).spans(field{list: "params.remote_block_ids", i: -1}, p.RemoteBlockIds)
	if err != nil {
		return nil, err
	}
	if p.Mode < 0 || p.Mode > 2 {
		return nil, Invalid("params.mode = %v unknown", p.Mode)
	}
	for _, f := range [...]struct{ name, v string }{{"params.transfer_id", p.TransferId}, {"params.remote_engine_id", p.RemoteEngineId},
		{"params.remote_request_id", p.RemoteRequestId}, {"params.remote_addr", p.RemoteAddr}} {
		if err := checkID(f.name, f.v); err != nil {
			return nil, err
		}
	}
	tok, err := FitInt("params.remote_num_tokens", p.RemoteNumTokens)
	if err != nil {
		return nil, err
	}
	return &kvxfer.TransferParams{TransferID: p.TransferId, DoRemotePrefill: p.DoRemotePrefill, DoRemoteDecode: p.DoRemoteDecode,
		RemoteEngineID: p.RemoteEngineId, RemoteAddr: p.RemoteAddr, RemoteRequestID: p.RemoteRequestId, RemoteBlockIDs: blocks,
		RemoteTPSize: int(p.RemoteTpSize), RemotePPSize: int(p.RemotePpSize), RemoteNumTokens: tok,
		RemoteBlocksExpiry: timeFrom(p.RemoteBlocksExpiryUnixNanos), Mode: kvxfer.Mode(p.Mode), RemoteGeneration: p.RemoteGeneration}, nil
}

// ParamsToProto converts a request's transfer params (nil stays nil).
func ParamsToProto(p *kvxfer.TransferParams) *pb.TransferParams {
	if p == nil {
		return nil
	}
	return &pb.TransferParams{TransferId: p.TransferID, DoRemotePrefill: p.DoRemotePrefill, DoRemoteDecode: p.DoRemoteDecode,
		RemoteEngineId: p.RemoteEngineID, RemoteAddr: p.RemoteAddr, RemoteRequestId: p.RemoteRequestID, RemoteBlockIds: spansToProto(p.RemoteBlockIDs),
		RemoteTpSize: int32(p.RemoteTPSize), RemotePpSize: int32(p.RemotePPSize), RemoteNumTokens: int64(p.RemoteNumTokens),
		RemoteBlocksExpiryUnixNanos: timeTo(p.RemoteBlocksExpiry), Mode: pb.Mode(p.Mode), RemoteGeneration: p.RemoteGeneration}
}

// checkID refuses an id or address longer than kvxfer.MaxIDBytes (the
// longest a rank takes in a step, or a peer in a message), naming the
// field and its length and quoting only the start of the value: an error
// never echoes a whole megabyte back.
func checkID(name, v string) error {
	if len(v) <= kvxfer.MaxIDBytes {
		return nil
	}
	return Invalid("%s = %.32q... has %d bytes, want at most %d", name, v, len(v), kvxfer.MaxIDBytes)
}

// RequestFromProto converts and validates an engine request; errors name
// the field.
func RequestFromProto(r *pb.EngineRequest) (*kvxfer.Request, error) {
	if r == nil || r.RequestId == "" {
		return nil, Invalid("request.request_id is empty")
	}
	if err := checkID("request.request_id", r.RequestId); err != nil {
		return nil, err
	}
	prompt, err := FitInt("request.prompt_tokens", r.PromptTokens)
	if err != nil {
		return nil, err
	}
	if prompt < 0 {
		return nil, Invalid("request.prompt_tokens = %d, want >= 0", prompt)
	}
	p, err := ParamsFromProto(r.Params)
	if err != nil {
		return nil, err
	}
	return &kvxfer.Request{ID: r.RequestId, PromptTokens: prompt, Params: p}, nil
}

// BlocksFromProto converts a request's block ids, one list per KV cache
// group.
func BlocksFromProto(bl []*pb.BlockList) [][]topology.BlockID {
	out := make([][]topology.BlockID, len(bl))
	for g, b := range bl {
		for _, id := range b.GetBlockIds() {
			out[g] = append(out[g], topology.BlockID(id))
		}
	}
	return out
}
