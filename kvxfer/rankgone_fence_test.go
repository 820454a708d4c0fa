package kvxfer

import (
	"strings"
	"testing"
	"time"
)

// A push consumer request decided (failed or expired) while one producer
// rank's process had just died, before liveness judged that rank gone:
// with the data-plane grants, the rank judged gone is fenced then, and the
// request reports with the outcome it had, at once, instead of holding
// its blocks until its fence timed out (2 x Lease) for a confirmation the
// dead rank cannot send. Before, the decided request was no longer
// watched (waitsOn) nor fenced (failWaiting skipped it), and reported
// only at its fence timeout (a minute by default).
func TestDecidedRequestFencedWhenRankGone(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lease time.Duration
		// decide: what decides the request before the rank is judged gone.
		deadline, want string
	}{
		{"deadline", 0, "3s", "outcome recv d-1 expired (expired)"},
		{"heartbeats", 3 * time.Second, "60s", "outcome recv d-1 failed (notification_failed)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
			c.run(t, "core mode=push engine=D tp=0/1")
			c.st.guarded = true
			if tc.lease > 0 {
				c.st.cfg.Lease = tc.lease
			}
			c.run(t, "step recv=d-1 remote=P remote-tp=2 tid=t1 preq=p-1 blocks=5,6 tokens=32 deadline="+tc.deadline)
			c.run(t, "handshake P tp=2")
			c.run(t, "notif from=P/0 tp=2 kind=done tid=t1 dreq=d-1 preq=p-1")
			var out strings.Builder
			// P's rank 1 died: its heartbeats fail, probes go unanswered,
			// rank 0 still speaks. Bounded: 20 steps of 500ms.
			for i := 0; i < 20 && !strings.Contains(out.String(), "outcome recv d-1"); i++ {
				c.fail[opNotify] = 1 << 20
				got := c.run(t, "advance 500ms")
				out.WriteString(got)
				if strings.Contains(got, "probe P") {
					out.WriteString(c.run(t, "handshake P fail=unreachable probe=true"))
				}
				out.WriteString(c.run(t, "notif from=P/0 tp=2 kind=done tid=t1 dreq=d-1 preq=p-1"))
			}
			got := out.String()
			if !strings.Contains(got, tc.want) {
				t.Fatalf("no %q within 10s (PeerTimeout 5s, fence timeout %v):\n%s", tc.want, c.st.cfg.FenceTimeout, got)
			}
			if strings.Contains(got, "fence timed out") {
				t.Fatalf("reported at its fence timeout, not fenced when rank 1 was judged gone:\n%s", got)
			}
		})
	}
}

// A producer rank's process died while a consumer rank's request waited
// on it, and a new request to the engine (its handshake no longer fresh)
// handshook again, which failed: the dead rank's port refuses. The
// request that waited on the old handshake's agents is still judged by
// liveness (the engine is still asked about, and a rank silent for
// PeerTimeout is gone) instead of waiting for its deadline. Before, a
// failed handshake stopped the probes (they ran only while the handshake
// was loaded), and the request waited for its deadline.
func TestFailedHandshakeKeepsLiveness(t *testing.T) {
	c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	c.run(t, "core mode=push engine=D tp=0/1")
	c.st.guarded = true
	c.run(t, "step recv=d-1 remote=P remote-tp=2 tid=t1 preq=p-1 blocks=5,6 tokens=32 deadline=60s")
	c.run(t, "handshake P tp=2")
	c.run(t, "notif from=P/0 tp=2 kind=done tid=t1 dreq=d-1 preq=p-1")
	var out strings.Builder
	out.WriteString(c.run(t, "advance 2s"))
	out.WriteString(c.run(t, "handshake P fail=unreachable probe=true"))
	c.fail[opNotify] = 2 // d-2's registrations: rank 1 refuses, and so (here) does rank 0
	out.WriteString(c.run(t, "step recv=d-2 remote=P remote-tp=2 tid=t2 preq=p-2 blocks=7 tokens=16 deadline=60s"))
	out.WriteString(c.run(t, "handshake P fail=unreachable"))
	out.WriteString(c.run(t, "handshake P fail=unreachable probe=true")) // asked as the registrations failed
	// Bounded: 20 steps of 500ms; P's rank 0 still speaks.
	for i := 0; i < 20 && !strings.Contains(out.String(), "outcome recv d-1"); i++ {
		got := c.run(t, "advance 500ms")
		out.WriteString(got + "\n")
		if strings.Contains(got, "probe P") {
			out.WriteString(c.run(t, "handshake P fail=unreachable probe=true") + "\n")
		}
		if strings.Contains(got, "handshake P at") {
			out.WriteString(c.run(t, "handshake P fail=unreachable") + "\n")
		}
		out.WriteString(c.run(t, "notif from=P/0 tp=2 kind=done tid=t1 dreq=d-1 preq=p-1") + "\n")
	}
	got := out.String()
	if !strings.Contains(got, "outcome recv d-1 failed (peer_gone)") {
		t.Fatalf("d-1 not failed (peer_gone) within 10s of its producer rank's death (PeerTimeout 5s):\n%s", got)
	}
}
