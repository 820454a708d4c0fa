package kvxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

func TestWireRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		m    msg
	}{
		{"reg", msg{Kind: msgReg, Engine: "D", Addr: "d:1", TPRank: 1, TPSize: 2, PPRank: 0, PPSize: 1, TransferID: "t", DReq: "d-1", PReq: "p-1",
			Spans: []topology.Span{{Start: 16, IDs: []topology.BlockID{5, 3, 9, 0}}, {Start: 0, IDs: nil}}}},
		{"empty reg releases", msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d-1"}},
		{"reg with a limit", msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d-1", Spans: []topology.Span{{IDs: []topology.BlockID{4}}},
			Until: time.Unix(0, 1_790_000_000_123_456_789)}},
		{"reg with a limit and tokens", msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d-1", Spans: []topology.Span{{IDs: []topology.BlockID{4}}},
			Until: time.Unix(0, 1_790_000_000_123_456_789), Tokens: 54}},
		{"reg with tokens, no limit", msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d-1", Spans: []topology.Span{{IDs: []topology.BlockID{4}}},
			Tokens: 1 << 40}},
		{"heartbeat", msg{Kind: msgHeartbeat, Engine: "D", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d", "", "p2", "d2"}}},
		{"fail", msg{Kind: msgFail, Engine: "P", TPRank: 3, TPSize: 4, PPRank: 1, PPSize: 2, DReq: "x", Reason: "WRITE failed"}},
		{"fail with kind", msg{Kind: msgFail, Engine: "P", TPSize: 1, PPSize: 1, DReq: "x", Reason: "WRITE failed", FailKind: FailureTransfer}},
		{"cancel with kind", msg{Kind: msgCancel, Engine: "D", TPSize: 1, PPSize: 1, DReq: "x", Reason: "expired", FailKind: FailureExpired}},
		{"fail with a newer build's kind", msg{Kind: msgFail, Engine: "P", TPSize: 1, PPSize: 1, FailKind: 200}},
		{"heartbeat asking for holds", msg{Kind: msgHeartbeat, Engine: "D", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d"}, Reason: hbAskHold}},
		{"hold", msg{Kind: msgHold, Engine: "P", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d", "", "p2", "d2"},
			Holds: []time.Time{time.Unix(0, 1_790_000_000_123_456_789), time.Unix(0, 1)}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := appendMsg(nil, &tc.m)
			got, err := decodeMsg(b)
			if err != nil {
				t.Fatalf("decodeMsg(appendMsg(%+v)) error: %v", tc.m, err)
			}
			want := tc.m
			for i := range want.Spans {
				if want.Spans[i].IDs == nil {
					want.Spans[i].IDs = []topology.BlockID{}
				}
			}
			if !reflect.DeepEqual(*got, want) {
				t.Errorf("decodeMsg(appendMsg(m)) = %+v, want %+v", *got, want)
			}
		})
	}
}

func TestWireRejects(t *testing.T) {
	good := appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 2, PPSize: 1, DReq: "d"})
	tests := []struct {
		name  string
		b     []byte
		field string
	}{
		{"short", []byte{'K'}, "at least 3"},
		{"magic", append([]byte{'X'}, good[1:]...), "field magic"},
		{"version", append([]byte{'K', 9}, good[2:]...), "field version"},
		{"kind", append([]byte{'K', 1, 77}, good[3:]...), "field kind"},
		{"truncated", good[:len(good)-1], "field reason"},
		{"trailing", append(bytes.Clone(good), 0), "trailing"},
		{"rank outside size", appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPRank: 2, TPSize: 2, PPSize: 1}), "tp_rank"},
		{"zero tp size", appendMsg(nil, &msg{Kind: msgDone, Engine: "P", PPSize: 1}), "field tp_size"},
		{"no engine", appendMsg(nil, &msg{Kind: msgDone, TPSize: 1, PPSize: 1}), "field engine"},
		{"negative id", appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, Spans: []topology.Span{{IDs: []topology.BlockID{-1}}}}), "spans.ids"},
		{"huge string", append([]byte{'K', 1, 1}, 0xff, 0xff, 0xff, 0x7f), "field engine"},
		{"fail kind zero", append(appendMsg(nil, &msg{Kind: msgFail, Engine: "P", TPSize: 1, PPSize: 1}), 0), "field fail_kind"},
		{"fail kind too big", binary.AppendUvarint(appendMsg(nil, &msg{Kind: msgFail, Engine: "P", TPSize: 1, PPSize: 1}), 256), "field fail_kind"},
		{"kind on a done", append(bytes.Clone(good), byte(FailureTransfer)), "trailing"},
		{"until zero", append(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d"}), 0), "field until"},
		{"until truncated", append(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d"}), 0x80), "field until"},
		{"until then more", append(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d", Until: time.Unix(5, 0), Tokens: 3}), 1), "trailing"},
		{"tokens zero", append(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d", Until: time.Unix(5, 0)}), 0), "field tokens"},
		{"tokens past the bound", binary.AppendUvarint(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d", Until: time.Unix(5, 0)}), maxWireTokens+1), "field tokens"},
		{"until on a done", binary.AppendVarint(bytes.Clone(good), 5), "trailing"},
		{"hold missing a deadline", appendMsg(nil, &msg{Kind: msgHold, Engine: "P", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d"}}), "field holds"},
		{"hold deadline unset", appendMsg(nil, &msg{Kind: msgHold, Engine: "P", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d"}, Holds: []time.Time{time.Unix(0, 0)}}), "field holds"},
		{"hold ids not triples", appendMsg(nil, &msg{Kind: msgHold, Engine: "P", TPSize: 1, PPSize: 1, IDs: []string{"t", "p"}, Holds: []time.Time{time.Unix(5, 0)}}), "field holds"},
		{"hold truncated", holdTruncated(), "field holds"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeMsg(tc.b)
			if err == nil || !errors.Is(err, errWire) || !strings.Contains(err.Error(), tc.field) {
				t.Errorf("decodeMsg(%q) error = %v, want errWire naming %q", tc.b, err, tc.field)
			}
		})
	}
}

func holdTruncated() []byte {
	b := appendMsg(nil, &msg{Kind: msgHold, Engine: "P", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d"}, Holds: []time.Time{time.Unix(5, 0)}})
	return b[:len(b)-1]
}

// FuzzWire: decoding never panics, and what decodes re-encodes to the same
// bytes.
func FuzzWire(f *testing.F) {
	f.Add(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 2, PPSize: 1, DReq: "d", Spans: []topology.Span{{Start: 3, IDs: []topology.BlockID{1, 2, 7}}}}))
	f.Add(appendMsg(nil, &msg{Kind: msgHeartbeat, Engine: "D", TPSize: 1, PPSize: 1, IDs: []string{"a", "b", "c"}}))
	f.Add([]byte("K\x01\x06"))
	f.Add(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 1, PPSize: 1, DReq: "d", Until: time.Unix(1_790_000_000, 7)}))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMsg(b)
		if err != nil {
			return
		}
		if again := appendMsg(nil, m); !bytes.Equal(again, b) {
			t.Fatalf("re-encoding %q gave %q", b, again)
		}
	})
}

// A failure notice's kind becomes the receiver's outcome kind; one that
// says none (an earlier build) or one this build does not know reads as
// FailurePeer. Only fail and cancel messages carry one.
func TestWireFailKind(t *testing.T) {
	for _, tc := range []struct {
		sent FailureKind
		want FailureKind
	}{{FailureNone, FailurePeer}, {FailureTransfer, FailureTransfer}, {FailureExpired, FailureExpired}, {200, FailurePeer}} {
		m, err := decodeMsg(appendMsg(nil, &msg{Kind: msgFail, Engine: "P", TPSize: 1, PPSize: 1, FailKind: tc.sent}))
		if err != nil {
			t.Fatal(err)
		}
		if got := m.failKind(); got != tc.want {
			t.Errorf("sent %v: failKind() = %v, want %v", tc.sent, got, tc.want)
		}
	}
	b := appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 1, PPSize: 1, FailKind: FailureTransfer})
	if m, err := decodeMsg(b); err != nil || m.FailKind != FailureNone {
		t.Errorf("a done notice carried a kind: %+v, %v", m, err)
	}
}

// Every kind has a name, distinct from the others; the names of the
// reference's failure types are kept.
func TestFailureKindNames(t *testing.T) {
	seen := map[string]FailureKind{}
	for _, k := range FailureKinds() {
		n := k.String()
		if n == "" || strings.HasPrefix(n, "FailureKind(") {
			t.Errorf("kind %d has no name", k)
		}
		if o, dup := seen[n]; dup {
			t.Errorf("kinds %d and %d share the name %q", o, k, n)
		}
		seen[n] = k
	}
	for _, n := range []string{"handshake_failed", "handshake_setup_failed", "push_reg_notif_failed", "transfer_setup_failed",
		"transfer_failed", "notification_failed", "expired"} {
		if _, ok := seen[n]; !ok {
			t.Errorf("no kind named %q (the reference's failure type)", n)
		}
	}
}

// appendMsg grows its buffer once: msgSizeBound is never short, however
// large the ids and spans.
func TestMsgSizeBound(t *testing.T) {
	big := make([]topology.BlockID, 1000)
	for i := range big {
		big[i] = topology.BlockID((i * 7919 % 1000) << 21) // large deltas, both signs
	}
	for _, m := range []msg{
		{Kind: msgReg, Engine: "D", TPSize: 1 << 16, TPRank: 1<<16 - 1, PPSize: 1, DReq: "d", Spans: []topology.Span{{Start: 1 << 30, IDs: big}, {}},
			Until: time.Unix(0, -1<<62)},
		{Kind: msgHeartbeat, Engine: "D", TPSize: 1, PPSize: 1, IDs: []string{"a", strings.Repeat("b", 300), ""}},
		{Kind: msgFail, Engine: "P", TPSize: 1, PPSize: 1, Reason: strings.Repeat("r", 1000), FailKind: 255},
	} {
		b := appendMsg(nil, &m)
		if bound := msgSizeBound(&m); len(b) > bound {
			t.Errorf("%v: %d bytes, bound %d", m.Kind, len(b), bound)
		}
		if n := testing.AllocsPerRun(10, func() { appendMsg(nil, &m) }); n != 1 && !raceOn {
			t.Errorf("%v: appendMsg allocated %v times, want 1", m.Kind, n)
		}
	}
}
