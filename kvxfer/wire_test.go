package kvxfer

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

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
		{"heartbeat", msg{Kind: msgHeartbeat, Engine: "D", TPSize: 1, PPSize: 1, IDs: []string{"t", "p", "d", "", "p2", "d2"}}},
		{"fail", msg{Kind: msgFail, Engine: "P", TPRank: 3, TPSize: 4, PPRank: 1, PPSize: 2, DReq: "x", Reason: "WRITE failed"}},
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

// FuzzWire: decoding never panics, and what decodes re-encodes to the same
// bytes.
func FuzzWire(f *testing.F) {
	f.Add(appendMsg(nil, &msg{Kind: msgReg, Engine: "D", TPSize: 2, PPSize: 1, DReq: "d", Spans: []topology.Span{{Start: 3, IDs: []topology.BlockID{1, 2, 7}}}}))
	f.Add(appendMsg(nil, &msg{Kind: msgHeartbeat, Engine: "D", TPSize: 1, PPSize: 1, IDs: []string{"a", "b", "c"}}))
	f.Add([]byte("K\x01\x06"))
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
