package kvxfer

import "testing"

// Each traced message kind is named by whether it was sent or drained,
// and given the side of the rank that sent or drained it; heartbeats,
// layer tags and what is no message are not traced.
func TestHopOfMsg(t *testing.T) {
	tests := []struct {
		name string
		kind msgKind
		mode Mode
		// sent and drained: the event and side of each.
		sent, drained         string
		sentSide, drainedSide Role
	}{
		{"registration", msgReg, ModePush, HopRegSent, HopRegRecv, RoleConsumer, RoleProducer},
		{"push completion", msgDone, ModePush, HopDoneSent, HopDoneRecv, RoleProducer, RoleConsumer},
		{"pull completion", msgDone, ModePull, HopDoneSent, HopDoneRecv, RoleConsumer, RoleProducer},
		{"push failure", msgFail, ModePush, HopFailSent, HopFailRecv, RoleProducer, RoleConsumer},
		{"pull failure", msgFail, ModePull, HopFailSent, HopFailRecv, RoleConsumer, RoleProducer},
		{"cancel", msgCancel, ModePush, HopCancelSent, HopCancelRecv, RoleConsumer, RoleProducer},
		{"ack", msgAck, ModePush, HopAckSent, HopAckRecv, RoleProducer, RoleConsumer},
		{"heartbeat", msgHeartbeat, ModePush, "", "", 0, 0},
		{"tag", msgTag, ModePush, "", "", 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := appendMsg(nil, &msg{Kind: tt.kind, Engine: "e", TPSize: 1, PPSize: 1, DReq: "d"})
			if h, s := hopOfMsg(b, tt.mode, true); h != tt.sent || s != tt.sentSide {
				t.Errorf("hopOfMsg(%v, %v, sent) = %q, %v, want %q, %v", tt.kind, tt.mode, h, s, tt.sent, tt.sentSide)
			}
			if h, s := hopOfMsg(b, tt.mode, false); h != tt.drained || s != tt.drainedSide {
				t.Errorf("hopOfMsg(%v, %v, drained) = %q, %v, want %q, %v", tt.kind, tt.mode, h, s, tt.drained, tt.drainedSide)
			}
		})
	}
	for _, b := range [][]byte{nil, {'K'}, {'X', wireVersion, byte(msgReg)}} {
		if h, _ := hopOfMsg(b, ModePush, true); h != "" {
			t.Errorf("hopOfMsg(%q) = %q, want none", b, h)
		}
	}
}

// ResolveIDs reads the request's ids from the event's message, keeping
// those the point knew; a message that does not decode changes nothing.
func TestResolveIDs(t *testing.T) {
	b := appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 1, PPSize: 1, TransferID: "t-1", DReq: "d-1", PReq: "p-1"})
	e := HopEvent{Hop: HopDoneRecv, PReq: "known", msg: b}
	e.ResolveIDs()
	if e.DReq != "d-1" || e.PReq != "known" || e.TransferID != "t-1" || e.msg != nil {
		t.Errorf("ResolveIDs: %+v, want d-1, known, t-1 and the message let go", e)
	}
	e = HopEvent{Hop: HopDoneRecv, DReq: "x", msg: b[:len(b)-2]}
	e.ResolveIDs()
	if e.DReq != "x" || e.PReq != "" || e.TransferID != "" {
		t.Errorf("ResolveIDs of a truncated message: %+v, want it unchanged", e)
	}
	e = HopEvent{Hop: HopOutcome, DReq: "d"}
	e.ResolveIDs() // no message: nothing to do
	if e.DReq != "d" {
		t.Errorf("ResolveIDs without a message: %+v", e)
	}
}
