package kvxfer

import (
	"strings"
	"testing"
)

// A pull producer rank hears a consumer rank's completion notice before it
// ever handshook with the consumer engine (a pull producer hears from its
// consumers first), and the handshake that would say who speaks for that
// rank fails because another rank of the engine died (in the in-process
// placement each rank answers at a server of its own: the dead one's port
// refuses). The ranks that answered still say who speaks for them
// (PartialHandshakeError): the notice is admitted and the request ends
// done. Before, the notice was refused after three failed handshakes, and
// the producer held the blocks the live rank had read until its lease or
// deadline.
func TestNoticeAdmittedByTheRanksThatAnswered(t *testing.T) {
	c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	c.run(t, "core mode=pull engine=P tp=0/2")
	c.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=60s")
	var out strings.Builder
	out.WriteString(c.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-1 preq=p-1 tp=2"))
	// Bounded: 10 handshakes, a second apart (handshakeRetry).
	for i := 0; i < 10 && !strings.Contains(out.String(), "outcome send p-1"); i++ {
		out.WriteString(c.run(t, "handshake D tp=2 fail=rank_tp_1_refused answered=0"))
		out.WriteString(c.run(t, "advance 1s"))
	}
	if got := out.String(); !strings.Contains(got, "outcome send p-1 done") {
		t.Fatalf("consumer rank 0's done notice not admitted while rank 1 does not answer (want outcome send p-1 done):\n%s",
			got)
	}
	if n := c.st.metrics.Snapshot().Dropped["sender_mismatch"]; n != 0 {
		t.Errorf("%d notices refused as from an agent that does not speak for its sender", n)
	}
}

// A consumer rank's first handshake with a producer engine fails because
// one of its ranks does not answer (its process died): the request fails,
// and the producer rank that answered, which holds its blocks for it, is
// told at once. Before, no agent was loaded, the cancel never left, and the
// producer rank held the blocks until its lease or deadline.
func TestFailedRequestToldToTheRanksThatAnswered(t *testing.T) {
	// tp: our TP size (1: our one rank takes both producer ranks' heads,
	// and one of them answers).
	for _, tc := range []struct{ mode, tp string }{{"push", "2"}, {"pull", "2"}, {"push", "1"}, {"pull", "1"}} {
		t.Run(tc.mode+"-tp"+tc.tp, func(t *testing.T) {
			c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
			c.run(t, "core mode="+tc.mode+" engine=D tp=0/"+tc.tp)
			got := c.run(t, "step recv=d-1 remote=P remote-tp=2 tid=t1 preq=p-1 blocks=5,6 tokens=32 deadline=60s")
			got += "\n" + c.run(t, "handshake P tp=2 fail=rank_tp_1_refused answered=0")
			if !strings.Contains(got, "outcome recv d-1 failed") {
				t.Fatalf("d-1 did not fail on the failed handshake:\n%s", got)
			}
			if !strings.Contains(got, "notify P/0") {
				t.Fatalf("P's rank 0, which answered, was not told d-1 failed:\n%s", got)
			}
		})
	}
}

// A consumer rank of a pull producer, its agent loaded from a partial
// answer (another rank of its engine dead), restarts: a new agent speaks
// for it. The next partial answer names the new agent, which takes the
// old one's place, as a handshake answered in full would: its notices are
// admitted. Before, the agent loaded first was kept until a handshake
// answered in full: the new agent's done notice was refused as from an
// agent that does not speak for its rank, and the producer held the
// blocks it had read until its lease.
func TestPartialAnswerReplacesRestartedRank(t *testing.T) {
	c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	c.run(t, "core mode=pull engine=P tp=0/2")
	c.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=60s")
	out := c.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-1 preq=p-1 tp=2")
	out += c.run(t, "handshake D tp=2 fail=rank_tp_1_refused answered=0")
	if !strings.Contains(out, "outcome send p-1 done") {
		t.Fatalf("p-1 not done on the partial answer:\n%s", out)
	}
	c.run(t, "advance 2s")
	c.run(t, "step send=p-2 tid=t2 blocks=3,4 tokens=32 deadline=60s")
	var b strings.Builder
	b.WriteString(c.run(t, "notif from=D/0 agent=D2/0 kind=done tid=t2 dreq=d-2 preq=p-2 tp=2"))
	for i := 0; i < 10 && !strings.Contains(b.String(), "outcome send p-2"); i++ {
		b.WriteString(c.run(t, "handshake D tp=2 fail=rank_tp_1_refused answered=0 agents=D2"))
		b.WriteString(c.run(t, "advance 1s"))
	}
	if got := b.String(); !strings.Contains(got, "outcome send p-2 done") {
		t.Errorf("the restarted rank's done notice (agent D2/0) not admitted on partial answers naming it:\n%s", got)
	}
	if n := c.st.metrics.Snapshot().Dropped["sender_mismatch"]; n != 0 {
		t.Errorf("%d notices refused as from an agent that does not speak for its sender", n)
	}
}

// A consumer waiting on a producer rank whose agent, loaded in full
// before, is replaced in a partial answer (that rank restarted, another
// rank of its engine is dead) fails at once, naming the rank, as a full
// handshake's failChanged fails it; one waiting on the other ranks only
// is left to the liveness bound. Before, it waited on the dead agent.
func TestPartialAnswerFailsWaitersOnReplacedRank(t *testing.T) {
	c := registeredWithTwoRanks(t)
	var b strings.Builder
	// A message from rank 0's new agent asks who speaks for it.
	b.WriteString(c.run(t, "notif from=P/0 agent=P2/0 kind=heartbeat"))
	b.WriteString(c.run(t, "handshake P tp=2 fail=rank_tp_1_refused answered=0 agents=P2"))
	r := c.st.recvs["d-1"]
	if r == nil || !r.decided || !strings.Contains(r.outcome.Reason, "re-attached rank tp 0 pp 0") || !r.fenced.has(rankRef{}) {
		t.Errorf("d-1, registered with rank 0's old agent, not failed naming the replaced rank, that rank fenced: %+v\n%s", r, b.String())
	}
	// It reports once rank 1 (dead) confirmed its cancel, or the fence
	// timed out (FenceTimeout).
	for i := 0; i < 60 && !strings.Contains(b.String(), "outcome recv d-1"); i++ {
		b.WriteString(c.run(t, "advance 10s"))
	}
	if got := b.String(); !strings.Contains(got, "outcome recv d-1 failed") || !strings.Contains(got, "re-attached rank tp 0 pp 0") {
		t.Errorf("d-1's outcome: want failed, naming the replaced rank:\n%s", got)
	}
	if c.st.engines["P"].peers[rankRef{}] != "P2/0" {
		t.Errorf("rank 0's agent = %q, want P2/0", c.st.engines["P"].peers[rankRef{}])
	}
}

// A handshake while one of a push producer's ranks is re-attached (its
// new agent spoke, a new generation) fails the requests waiting on that
// rank, fencing it; the request's other rank did not change and may
// still be writing into its blocks, so it is asked to stop (a cancel) and
// the request reports once it confirms. Before, the cancel was skipped
// (the engine's handshake was still pending as the request failed): the
// request waited for that rank's own done, or the fence timeout (two
// leases), holding its blocks.
func TestChangedRankFailsAndCancelsTheUnchanged(t *testing.T) {
	c := registeredWithTwoRanks(t)
	var b strings.Builder
	// Rank 1's new agent speaks: who speaks for it is asked again, and
	// the answer names it (a new generation); rank 0 is as it was.
	b.WriteString(c.run(t, "notif from=P/1 agent=P2/1 kind=heartbeat tp=2"))
	b.WriteString(c.run(t, "handshake P tp=2 gen=2 agents=P,P2"))
	r := c.st.recvs["d-1"]
	if r == nil || !r.decided || !r.fenced.has(rankRef{tp: 1}) || r.fenced.has(rankRef{}) {
		t.Fatalf("d-1 after rank 1 was re-attached: %+v, want failed, rank 1 fenced, rank 0 not\n%s", r, b.String())
	}
	if got := b.String(); !strings.Contains(got, "notify P/0 cancel") {
		t.Fatalf("after rank 1 was re-attached:\n%s\nwant d-1's cancel to rank 0 (unchanged, perhaps still writing)", got)
	}
	got := c.run(t, "notif from=P/0 kind=ack tid=t1 dreq=d-1 preq=p-1 tp=2")
	if !strings.Contains(got, "outcome recv d-1 failed") {
		t.Errorf("rank 0 confirmed d-1's cancel:\n%s\nwant d-1 failed at once", got)
	}
}

// registeredWithTwoRanks is a push consumer rank whose request d-1 is
// registered with both ranks of producer P (generation 1), 2 s ago.
func registeredWithTwoRanks(t *testing.T) *traceCore {
	t.Helper()
	c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	c.run(t, "core mode=push engine=D tp=0/1")
	c.run(t, "step recv=d-1 remote=P remote-tp=2 tid=t1 preq=p-1 blocks=5,6 tokens=32 deadline=60s")
	if got := c.run(t, "handshake P tp=2 gen=1"); !strings.Contains(got, "notify P/0") || !strings.Contains(got, "notify P/1") {
		t.Fatalf("d-1 not registered with both producer ranks:\n%s", got)
	}
	c.run(t, "advance 2s")
	return c
}
