package kvxfer

import (
	"strings"
	"testing"
)

// An in-process producer engine (each rank answers at a server of its
// own) loses one rank's process: probes fail with a partial answer (the
// live rank answers, with the agent loaded for it). A consumer rank
// waiting on the live producer rank alone is not failed as if the engine
// were gone; one waiting on the dead rank fails within the liveness bound
// as before, naming that rank; so does one whose producer rank answers
// with another agent (it restarted: the one the request waits on is
// gone). Before, a partial answer counted as none: all failed once
// PeerTimeout passed, "producer engine P ... is gone".
func TestProbePartialAnswerKeepsLiveRank(t *testing.T) {
	for _, tc := range []struct {
		name, core, agents string
		fails              string // the reason d-1 fails with; "": it waits
	}{
		{"own rank answers", "core mode=push engine=D tp=0/2", "", ""},
		{"own rank dead", "core mode=push engine=D tp=1/2", "", "rank tp 1 pp 0 silent"},
		{"own rank restarted", "core mode=push engine=D tp=0/2", " agents=P2", "is gone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
			c.run(t, tc.core)
			c.run(t, "step recv=d-1 remote=P remote-tp=2 tid=t1 preq=p-1 blocks=5,6 tokens=32 deadline=60s")
			if got := c.run(t, "handshake P tp=2"); !strings.Contains(got, "reg tid=t1") {
				t.Fatalf("d-1 not registered:\n%s", got)
			}
			var b strings.Builder
			// Probes every 2s, rank 1 refused: well past PeerTimeout (10s),
			// within the request's deadline.
			for range 12 {
				b.WriteString(c.run(t, "advance 2s") + "\n")
				b.WriteString(c.run(t, "handshake P tp=2 fail=rank_tp_1_refused answered=0 probe=true"+tc.agents) + "\n")
			}
			got := b.String()
			if tc.fails == "" && (strings.Contains(got, "dreq=d-1") || strings.Contains(got, "outcome recv d-1")) {
				t.Errorf("d-1 failed while its producer rank 0 answers:\n%s", got)
			}
			if tc.fails != "" && (!strings.Contains(got, "cancel tid=t1 dreq=d-1") || !strings.Contains(got, tc.fails)) {
				t.Errorf("d-1 not failed with %q within the liveness bound:\n%s", tc.fails, got)
			}
			if tc.fails == "" && c.st.recvs["d-1"] != nil && c.st.recvs["d-1"].decided {
				t.Errorf("d-1 decided %+v, want it waiting on its live producer rank", c.st.recvs["d-1"].outcome)
			}
		})
	}
}
