package kvxfer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// The producer's request indexes (by transfer id; by base id, oldest
// first) stay what a plain model of them says over random requests held
// and forgotten, several to a base id and to a transfer id.
func TestSendIndexes(t *testing.T) {
	now := time.Unix(1000, 0)
	st := newTestCore(t, "P", ModePull, traceLayout(0, 1, 1<<20), now)
	rng := rand.New(rand.NewPCG(5, 6))
	base := map[string][]string{} // base id -> request ids, oldest first
	tid := map[string]string{}    // transfer id -> request id
	var held []string
	for op := range 5000 {
		if rng.IntN(2) == 0 || len(held) == 0 {
			id := fmt.Sprintf("r%d-%08x", rng.IntN(4), op) // base r0..r3
			if rng.IntN(3) == 0 {
				id = fmt.Sprintf("r%d", rng.IntN(4)) // its own base
			}
			if st.sends[id] != nil {
				continue
			}
			req := SendReq{ReqID: id, TransferID: fmt.Sprintf("t%d", rng.IntN(6))}
			if rng.IntN(4) == 0 {
				req.TransferID = ""
			}
			st.newSend(&req, now.Add(time.Hour))
			held = append(held, id)
			b := BaseRequestID(id)
			base[b] = append(base[b], id)
			if _, taken := tid[req.TransferID]; req.TransferID != "" && !taken {
				tid[req.TransferID] = id
			}
		} else {
			i := rng.IntN(len(held))
			id := held[i]
			held = slices.Delete(held, i, i+1)
			s := st.sends[id]
			st.forgetSend(s)
			b := BaseRequestID(id)
			base[b] = slices.DeleteFunc(base[b], func(x string) bool { return x == id })
			if len(base[b]) == 0 {
				delete(base, b)
			}
			if tid[s.req.TransferID] == id {
				delete(tid, s.req.TransferID)
			}
		}
		if len(st.sendBase) != len(base) || len(st.sendByTID) != len(tid) {
			t.Fatalf("op %d: %d base ids and %d transfer ids indexed, want %d and %d", op, len(st.sendBase), len(st.sendByTID), len(base), len(tid))
		}
		for b, want := range base {
			var got []string
			var prev *sendReq
			for s := st.sendBase[b]; s != nil; s = s.nextBase {
				if s.prevBase != prev {
					t.Fatalf("op %d: base %s: %s's prevBase is not the request before it", op, b, s.req.ReqID)
				}
				got, prev = append(got, s.req.ReqID), s
			}
			if !slices.Equal(got, want) {
				t.Fatalf("op %d: base %s lists %v, want %v", op, b, got, want)
			}
		}
		for k, id := range tid {
			if s := st.sendByTID[k]; s == nil || s.req.ReqID != id {
				t.Fatalf("op %d: transfer id %s indexes %v, want %s", op, k, s, id)
			}
		}
	}
}
