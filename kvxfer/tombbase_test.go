package kvxfer

import (
	"strings"
	"testing"
)

// A consumer request that names its producer request by base id (no
// transfer id) is paired by base at one of its ranks; the pair fails
// before its other rank registers. That rank's registration, arriving
// late, names the same base: it is about the request the tombstone
// remembers (whose id has that base), so it is dropped and the rank told
// the failure. Before, the tombstone's producer id (a-aaaa0001) was compared
// with the name (a) as if they were two requests: the tombstone was
// thrown away as an earlier request's, and the registration paired by
// base with the next producer request of that base (a-aaaa0002), whose KV was
// then written into that consumer rank's blocks while the rank, told the
// pair failed, handed them back: another request's KV, and WRITEs
// landing in blocks the consumer freed.
func TestLateRankRegistrationByBaseAfterPairFailed(t *testing.T) {
	{
		{
			tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
			tc.run(t, "core mode=push engine=P tp=0/1")
			var all []string
			add := func(s string) string { all = append(all, s); return s }
			add(tc.run(t, "step send=a-aaaa0001 blocks=1 tokens=16"))
			add(tc.run(t, "notif from=D/0 tp=2 kind=reg dreq=a-dddd0001 preq=a spans=5"))
			if got := add(tc.run(t, "handshake D tp=2")); !strings.Contains(got, "post") {
				t.Fatalf("handshake: %q, want a-aaaa0001's WRITE into D/0 (paired by base)\n%s", got, strings.Join(all, "\n"))
			}
			if got := add(tc.run(t, "ended xfer=1 fail=boom")); !strings.Contains(got, "outcome send a-aaaa0001 failed") {
				t.Fatalf("the WRITE failed: %q, want a-aaaa0001 failed", got)
			}
			add(tc.run(t, "step send=a-aaaa0002 blocks=2 tokens=16"))
			got := add(tc.run(t, "notif from=D/1 tp=2 kind=reg dreq=a-dddd0001 preq=a spans=6"))
			if strings.Contains(got, "post") {
				t.Errorf("D/1 registers a-dddd0001 (by base a) after its pair with a-aaaa0001 failed: %q, want nothing written (a-aaaa0002 is another request)", got)
			}
			if !strings.Contains(got, "notify D/1 fail") {
				t.Errorf("D/1 registers a-dddd0001 after its pair failed: %q, want it told the failure", got)
			}
			if s := tc.st.sends.get("a-aaaa0002"); s == nil || s.match != nil {
				t.Errorf("a-aaaa0002 after a-dddd0001's late registration: %+v, want held, unpaired", s)
			}
			if t.Failed() {
				t.Logf("trace:\n%s", strings.Join(all, "\n"))
			}
		}
	}
}

// A consumer rank that cancels by base id after the producer's WRITE into
// it landed and the pair ended (the completion notice lost or late) is
// answered with the completion notice again, as one that names the
// producer request by its id is: the tombstone is that request's. Before,
// the name (a) was taken for another request than the tombstone's
// (a-aaaa0001): the rank was answered a bare acknowledgement and failed
// a request whose KV had landed.
func TestCancelByBaseAfterDoneAnsweredDone(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=push engine=P tp=0/1")
	var all []string
	add := func(s string) string { all = append(all, s); return s }
	add(tc.run(t, "step send=a-aaaa0001 blocks=1 tokens=16"))
	add(tc.run(t, "notif from=D/0 kind=reg dreq=a-dddd0001 preq=a spans=5"))
	add(tc.run(t, "handshake D tp=1"))
	if got := add(tc.run(t, "ended xfer=1")); !strings.Contains(got, "outcome send a-aaaa0001 done") {
		t.Fatalf("the WRITE landed: %q, want a-aaaa0001 done\n%s", got, strings.Join(all, "\n"))
	}
	got := add(tc.run(t, "notif from=D/0 kind=cancel dreq=a-dddd0001 preq=a"))
	if !strings.Contains(got, "done dreq=a-dddd0001") {
		t.Errorf("D/0 cancels a-dddd0001 (by base a) after the WRITE into it landed: %q, want the completion notice again\n%s", got, strings.Join(all, "\n"))
	}
}
