package kvxfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// Peer messages travel as backend notifications between the workers of two
// engines. They are small, versioned and strictly decoded: a peer's bytes
// are input, and a malformed message is an error naming the field, never a
// panic.
//
// Layout: magic 'K', version, kind, then the fields of msg in order:
// strings as uvarint length + bytes, integers as varints, spans as a group
// count, then per group the start token, the id count and the ids as
// zig-zag deltas from the previous id. A failure kind (FailureKind) ends
// a fail or cancel message as one uvarint when it is not FailureNone;
// absent, the sender did not say (a peer of an earlier build). A
// registration's Until ends it as one varint of Unix nanoseconds when it
// is set; absent, the registration has no limit. The consumer's token
// count (Tokens) follows it as one uvarint when it is set, Until then
// always present (0 standing for no limit only there).
//
// Before Tokens, a push producer could not tell that its consumer took
// more tokens as loaded than it held (a router that gave D a longer
// prompt than P's): its WRITE left D's blocks past its tokens as they
// were, reported loaded.

const (
	wireMagic   = 'K'
	wireVersion = 1

	// Caps on what a peer may make us allocate.
	maxWireString = 1 << 10
	maxWireIDs    = 1 << 16
	maxWireGroups = 64
	maxWireBlocks = 1 << 22
	// maxWireTokens bounds a registration's token count (the scheduler's
	// bound on an engine's token counts).
	maxWireTokens = maxTokens
)

// msgKind is the kind of a peer message.
type msgKind uint8

const (
	// msgReg (push, D→P): D rank registers its blocks for a request.
	// An empty Spans list means D needs nothing (full prefix hit or an
	// abort before schedule): P frees its blocks for this D rank at once.
	msgReg msgKind = iota + 1
	// msgDone: a transfer's bytes landed. Push P→D rides on the WRITE;
	// pull D→P rides on the READ (or is sent bare when nothing moves).
	msgDone
	// msgHeartbeat (D→P): D still wants the requests named in IDs;
	// P extends their leases.
	msgHeartbeat
	// msgCancel (push, D→P): D gives up on a request; P must not WRITE
	// into its blocks and answers msgAck once nothing can land.
	msgCancel
	// msgAck (push, P→D): no WRITE from the sender into the request's
	// blocks is or will be in flight.
	msgAck
	// msgFail: the sender cannot complete the transfer and has nothing in
	// flight for it; Reason says why. The receiver fails the request at
	// once instead of waiting for a timeout.
	msgFail
	// msgTag (push, P→D): rides on a layer-wise WRITE that is not the
	// request's last, naming the request its bytes are for (the data
	// plane's grants admit it only into that request's blocks); the
	// receiver drops it once the bytes landed.
	msgTag
	// msgHold (pull, P→D): the answer to a heartbeat that asks for one
	// (Reason hbAskHold): for each request of the heartbeat the producer
	// rank still holds under a lease, its triple (transfer id, P id, D
	// id, as the heartbeat named it) in IDs and, in Holds, the deadline
	// it now holds the request's blocks to, on its own clock. A request
	// it no longer holds (or holds with no lease yet: still prefilling)
	// is left out. A consumer bounds its READs by it (and by the params'
	// expiry, whichever is later); without an answer (a producer of an
	// earlier build ignores the ask) by the params' expiry alone. One
	// that lists nothing (no IDs, no Holds) and names a request in
	// TransferID, PReq and DReq, with a Reason, answers a hold check's
	// question: the rank does not hold that request (it ended there), and
	// why; a consumer of an earlier build reads in it nothing held.
	msgHold
)

// hbAskHold is a pull heartbeat's Reason (a field producers of earlier
// builds ignore in a heartbeat): its sender reads msgHold, and asks the
// producer to answer with the deadlines it holds the requests to. A
// consumer of an earlier build does not ask, so it is never sent a kind
// it cannot decode.
const hbAskHold = "hold?"

func (k msgKind) String() string {
	switch k {
	case msgReg:
		return "reg"
	case msgDone:
		return "done"
	case msgHeartbeat:
		return "heartbeat"
	case msgCancel:
		return "cancel"
	case msgTag:
		return "tag"
	case msgAck:
		return "ack"
	case msgFail:
		return "fail"
	case msgHold:
		return "hold"
	}
	return fmt.Sprintf("msgKind(%d)", uint8(k))
}

// msg is one peer message. Which fields are set depends on Kind.
type msg struct {
	Kind msgKind
	// Engine, TPRank, TPSize, PPRank and PPSize describe the sender.
	Engine, Addr   string
	TPRank, TPSize int
	PPRank, PPSize int
	// TransferID, DReq and PReq name the request: the router's transfer
	// id, and its ids on D and on P (any may be empty when unknown).
	TransferID, DReq, PReq string
	// Spans are D's block lists (msgReg).
	Spans []topology.Span
	// IDs are the requests a heartbeat names (P ids, or transfer ids).
	IDs    []string
	Reason string
	// FailKind classifies a msgFail or msgCancel (FailureNone: unsaid).
	FailKind FailureKind
	// Tokens is how many tokens a registration's consumer takes as loaded
	// (RecvReq.Tokens; 0: unsaid).
	Tokens int
	// Until is when a registration (msgReg) stops being valid, on the
	// receiver's clock: the consumer's deadline for the request. A
	// producer drops one that reaches it, or waits for its request, past
	// then (zero: no limit). However late a registration is delivered,
	// it cannot make the producer WRITE into blocks the consumer gave up.
	Until time.Time
	// Holds are a msgHold's deadlines, one per triple of IDs, on the
	// sender's clock (each set).
	Holds []time.Time

	// from is the agent it came from, once admitted (not on the wire).
	from PeerName
	// blocks stands for Spans once a message kept for later drops them
	// (compact; not on the wire).
	blocks blocksSum
}

// failKind is the kind a failure notice gives the receiver's outcome:
// the sender's own, or FailurePeer when it named none (or one this
// build does not know).
func (m *msg) failKind() FailureKind {
	if m.FailKind == FailureNone || m.FailKind >= numFailureKinds {
		return FailurePeer
	}
	return m.FailKind
}

var errWire = errors.New("kvxfer: malformed peer message")

func appendStr(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// appendMsg encodes m onto b.
func appendMsg(b []byte, m *msg) []byte {
	b = slices.Grow(b, msgSizeBound(m))
	b = append(b, wireMagic, wireVersion, byte(m.Kind))
	b = appendStr(b, m.Engine)
	b = appendStr(b, m.Addr)
	for _, v := range [...]int{m.TPRank, m.TPSize, m.PPRank, m.PPSize} {
		b = binary.AppendVarint(b, int64(v))
	}
	b = appendStr(b, m.TransferID)
	b = appendStr(b, m.DReq)
	b = appendStr(b, m.PReq)
	b = binary.AppendUvarint(b, uint64(len(m.Spans)))
	for _, s := range m.Spans {
		b = binary.AppendVarint(b, int64(s.Start))
		b = binary.AppendUvarint(b, uint64(len(s.IDs)))
		prev := int64(0)
		for _, id := range s.IDs {
			b = binary.AppendVarint(b, int64(id)-prev)
			prev = int64(id)
		}
	}
	b = binary.AppendUvarint(b, uint64(len(m.IDs)))
	for _, id := range m.IDs {
		b = appendStr(b, id)
	}
	b = appendStr(b, m.Reason)
	if m.FailKind != FailureNone && (m.Kind == msgFail || m.Kind == msgCancel) {
		b = binary.AppendUvarint(b, uint64(m.FailKind))
	}
	if m.Kind == msgReg && (!m.Until.IsZero() || m.Tokens > 0) {
		until := int64(0)
		if !m.Until.IsZero() {
			until = m.Until.UnixNano()
		}
		b = binary.AppendVarint(b, until)
		if m.Tokens > 0 {
			b = binary.AppendUvarint(b, uint64(m.Tokens))
		}
	}
	if m.Kind == msgHold {
		b = binary.AppendUvarint(b, uint64(len(m.Holds)))
		for _, t := range m.Holds {
			b = binary.AppendVarint(b, t.UnixNano())
		}
	}
	return b
}

// msgSizeBound bounds m's encoding, so appendMsg grows its buffer once:
// a varint takes at most binary.MaxVarintLen64 bytes, a block id's delta
// at most 5 (ids are int32s).
func msgSizeBound(m *msg) int {
	const v = binary.MaxVarintLen64
	n := 3 + 4*v // header; tp and pp rank and size
	n += 6*v + len(m.Engine) + len(m.Addr) + len(m.TransferID) + len(m.DReq) + len(m.PReq) + len(m.Reason)
	n += v // spans count
	for _, sp := range m.Spans {
		n += 2*v + 5*len(sp.IDs)
	}
	n += v // ids count
	for _, id := range m.IDs {
		n += v + len(id)
	}
	n += v + v*len(m.Holds)
	return n + 3*v // fail kind, until, tokens
}

// reader decodes fields, remembering the first error.
type reader struct {
	b   []byte
	err error
	// whole, when set, is the bytes being read (b is its tail) as one
	// string: str returns pieces of it instead of a copy each.
	whole string
}

func (r *reader) fail(field string, format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: field %s: %s", errWire, field, fmt.Sprintf(format, args...))
	}
}

func (r *reader) uvarint(field string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 || n != uvarintLen(v) {
		r.fail(field, "bad uvarint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint(field string) int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 || n != uvarintLen(zigzag(v)) {
		r.fail(field, "bad varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

// integer reads a varint that must fit in [lo, hi].
func (r *reader) integer(field string, lo, hi int64) int {
	v := r.varint(field)
	if r.err == nil && (v < lo || v > hi) {
		r.fail(field, "%d out of range [%d, %d]", v, lo, hi)
		return 0
	}
	return int(v)
}

func (r *reader) str(field string) string {
	n := r.uvarint(field)
	if r.err != nil {
		return ""
	}
	if n > maxWireString || n > uint64(len(r.b)) {
		r.fail(field, "length %d exceeds %d or the %d bytes left", n, maxWireString, len(r.b))
		return ""
	}
	var s string
	if r.whole != "" {
		off := len(r.whole) - len(r.b)
		s = r.whole[off : off+int(n)]
	} else {
		s = string(r.b[:n])
	}
	r.b = r.b[n:]
	return s
}

// uvarintLen is the length of v's shortest encoding: decoding accepts only
// that one, so every message has exactly one encoding.
func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

func zigzag(v int64) uint64 { return uint64(v<<1) ^ uint64(v>>63) }

// decodeMsg decodes one peer message. Every error wraps errWire and names
// the field.
func decodeMsg(b []byte) (*msg, error) {
	if len(b) < 3 {
		return nil, fmt.Errorf("%w: %d bytes, want at least 3", errWire, len(b))
	}
	if b[0] != wireMagic {
		return nil, fmt.Errorf("%w: field magic: %#x, want %#x", errWire, b[0], wireMagic)
	}
	if b[1] != wireVersion {
		return nil, fmt.Errorf("%w: field version: %d, want %d", errWire, b[1], wireVersion)
	}
	m := &msg{Kind: msgKind(b[2])}
	if m.Kind < msgReg || m.Kind > msgHold {
		return nil, fmt.Errorf("%w: field kind: %d unknown", errWire, b[2])
	}
	r := &reader{b: b[3:]}
	if m.Kind != msgReg && m.Kind != msgHeartbeat && m.Kind != msgHold && len(b) <= 4<<10 {
		// A notice of one request (done, fail, cancel, ack): its strings
		// come from one copy of the message, which they keep alive; not
		// for registrations and heartbeats, whose block and id lists can
		// be large.
		r.whole = string(b[3:])
	}
	m.Engine = r.str("engine")
	m.Addr = r.str("addr")
	m.TPRank = r.integer("tp_rank", 0, 1<<16)
	m.TPSize = r.integer("tp_size", 1, 1<<16)
	m.PPRank = r.integer("pp_rank", 0, 1<<16)
	m.PPSize = r.integer("pp_size", 1, 1<<16)
	if r.err == nil && (m.TPRank >= m.TPSize || m.PPRank >= m.PPSize) {
		return nil, fmt.Errorf("%w: field tp_rank/pp_rank: %d/%d outside sizes %d/%d", errWire, m.TPRank, m.PPRank, m.TPSize, m.PPSize)
	}
	m.TransferID = r.str("transfer_id")
	m.DReq = r.str("d_req")
	m.PReq = r.str("p_req")
	ng := r.uvarint("spans")
	if r.err == nil && ng > maxWireGroups {
		r.fail("spans", "%d groups exceed %d", ng, maxWireGroups)
	}
	total := 0
	for g := uint64(0); r.err == nil && g < ng; g++ {
		start := r.integer("spans.start", 0, math.MaxInt32)
		n := r.uvarint("spans.ids")
		if r.err == nil && (n > maxWireBlocks || total+int(n) > maxWireBlocks || n > uint64(len(r.b))) {
			r.fail("spans.ids", "%d ids exceed the cap %d or the %d bytes left", n, maxWireBlocks, len(r.b))
		}
		if r.err != nil {
			break
		}
		total += int(n)
		ids := make([]topology.BlockID, n)
		prev := int64(0)
		for i := range ids {
			v := prev + r.varint("spans.ids")
			if r.err == nil && (v < 0 || v > math.MaxInt32) {
				r.fail("spans.ids", "id %d out of range", v)
			}
			ids[i] = topology.BlockID(v)
			prev = v
		}
		m.Spans = append(m.Spans, topology.Span{Start: start, IDs: ids})
	}
	nid := r.uvarint("ids")
	if r.err == nil && (nid > maxWireIDs || nid > uint64(len(r.b))) {
		r.fail("ids", "%d ids exceed %d or the %d bytes left", nid, maxWireIDs, len(r.b))
	}
	for i := uint64(0); r.err == nil && i < nid; i++ {
		m.IDs = append(m.IDs, r.str("ids"))
	}
	m.Reason = r.str("reason")
	if r.err == nil && len(r.b) > 0 && (m.Kind == msgFail || m.Kind == msgCancel) {
		// Kinds this build does not know (a newer peer's) are kept as
		// sent and read as FailurePeer (failKind); 0 is never encoded.
		if k := r.uvarint("fail_kind"); r.err == nil && (k == 0 || k > 255) {
			r.fail("fail_kind", "%d out of range [1, 255]", k)
		} else {
			m.FailKind = FailureKind(k)
		}
	}
	if r.err == nil && len(r.b) > 0 && m.Kind == msgReg {
		v := r.varint("until")
		switch {
		case r.err != nil:
		case v == 0 && len(r.b) == 0:
			r.fail("until", "0: an unset limit is not encoded (but before a token count)")
		case v != 0:
			m.Until = time.Unix(0, v)
		}
		if r.err == nil && len(r.b) > 0 {
			if t := r.uvarint("tokens"); r.err == nil && (t == 0 || t > maxWireTokens) {
				r.fail("tokens", "%d out of range [1, %d]", t, maxWireTokens)
			} else {
				m.Tokens = int(t)
			}
		}
	}
	if m.Kind == msgHold {
		n := r.uvarint("holds")
		if r.err == nil && (len(m.IDs)%3 != 0 || n != uint64(len(m.IDs)/3)) {
			r.fail("holds", "%d deadlines for %d ids, want one per triple", n, len(m.IDs))
		}
		for i := uint64(0); r.err == nil && i < n; i++ {
			if v := r.varint("holds"); r.err == nil && v <= 0 {
				r.fail("holds", "%d: a deadline must be set", v)
			} else {
				m.Holds = append(m.Holds, time.Unix(0, v))
			}
		}
	}
	if r.err != nil {
		return nil, r.err
	}
	if len(r.b) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes", errWire, len(r.b))
	}
	if m.Engine == "" {
		return nil, fmt.Errorf("%w: field engine: empty", errWire)
	}
	return m, nil
}
