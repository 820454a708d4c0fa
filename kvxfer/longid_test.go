package kvxfer_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A request id (or transfer id, or the peer's engine id, address or
// request id) longer than a peer message may carry (kvxfer.MaxIDBytes)
// was taken in, and the messages naming it were refused by the peer's
// decoder: a push request waited for its lease and deadline and expired
// with "the producer never confirmed", a pull producer held its blocks
// for its whole lease after the READ, and no error named the field. Such
// an entry is refused at once, naming its field and counted
// (Metrics.BadInput); the step's other requests go on and complete.
func TestLongIDsRefused(t *testing.T) {
	long := strings.Repeat("x", kvxfer.MaxIDBytes+1)
	for _, tc := range []struct {
		name, field string
		p           func(*kvxfer.SendReq)
		d           func(*kvxfer.RecvReq)
	}{
		{"recv req_id", "recv_req.req_id", nil, func(r *kvxfer.RecvReq) { r.ReqID = long }},
		{"recv transfer_id", "recv_req.transfer_id", nil, func(r *kvxfer.RecvReq) { r.TransferID = long }},
		{"recv remote.req_id", "recv_req.remote.req_id", nil, func(r *kvxfer.RecvReq) { r.Remote.ReqID = long }},
		{"recv remote.engine_id", "recv_req.remote.engine_id", nil, func(r *kvxfer.RecvReq) { r.Remote.EngineID = long }},
		{"recv remote.addr", "recv_req.remote.addr", nil, func(r *kvxfer.RecvReq) { r.Remote.Addr = long }},
		{"send req_id", "send_req.req_id", func(s *kvxfer.SendReq) { s.ReqID = long }, nil},
		{"send transfer_id", "send_req.transfer_id", func(s *kvxfer.SendReq) { s.TransferID = long }, nil},
	} {
		for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
			t.Run(tc.name+"/"+mode.String(), func(t *testing.T) {
				inSynctest(t, func(t *testing.T) {
					x := newPair(t, mode, 1, 1, nil)
					good, bad := x.req("good", 40, 0), x.req("bad", 40, 0)
					now := time.Now()
					pm := &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{good.send(now.Add(30 * time.Second)), bad.send(now.Add(30 * time.Second))}}
					dm := &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{good.recv(mode, x.p, now.Add(time.Minute)), bad.recv(mode, x.p, now.Add(time.Minute))}}
					side, w := "P", x.p.workers[0][0]
					if tc.p != nil {
						tc.p(&pm.Send[1])
					} else {
						tc.d(&dm.Recv[1])
						side, w = "D", x.d.workers[0][0]
					}
					perr, derr := x.p.workers[0][0].Step(pm), x.d.workers[0][0].Step(dm)
					err := perr
					if side == "D" {
						err = derr
					}
					if err == nil || !strings.Contains(err.Error(), "want at most") {
						t.Errorf("%s Step with a %d-byte %s: %v, want an error naming the field and the bound", side, len(long), tc.field, err)
					}
					x.settle() // no time passes: what is refused fails at once
					var got []kvxfer.Outcome
					if side == "P" {
						got = x.out.send[pm.Send[1].ReqID]
					} else {
						got = x.out.recv[dm.Recv[1].ReqID]
					}
					if len(got) != 1 || got[0].Result != kvxfer.ResultFailed || !strings.Contains(got[0].Reason, "want at most") {
						t.Errorf("%s outcome of the entry with a long %s = %.300v, want one failed at once naming the bound", side, tc.field, got)
					}
					if n := w.Metrics().Snapshot().BadInput[tc.field]; n != 1 {
						t.Errorf("BadInput[%q] = %d, want 1", tc.field, n)
					}
					// The good request is untouched.
					wantResult(t, "P good", x.sendResult(good), kvxfer.ResultDone, "")
					wantResult(t, "D good", x.recvResult(good), kvxfer.ResultDone, "")
				})
			})
		}
	}
}
