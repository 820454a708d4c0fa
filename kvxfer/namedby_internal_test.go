package kvxfer

import "testing"

// Consumer requests that registered for one transfer before its producer
// request came, of which one names the producer request by id too: it is
// written, and each other one is failed at once, counted (reg_taken);
// where none or several name it, every one is failed at once, counted
// (reg_ambiguous), the producer request with them
// (testdata/trace/one_transfer_two_consumers.txt says what each is told).
func TestOneTransferTwoConsumersCounted(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=push engine=P tp=0/1")
	st := tc.st
	for _, e := range []string{"D1", "D2"} {
		knowEngine(t, st, e, 1)
	}
	dropped := func(reason string) uint64 { return st.metrics.Snapshot().Dropped[reason] }
	tc.run(t, "notif from=D1/0 kind=reg tid=t-y dreq=d-1 preq=p-other spans=11")
	tc.run(t, "notif from=D2/0 kind=reg tid=t-y dreq=d-2 preq=p-y spans=12")
	tc.run(t, "notif from=D1/0 kind=reg tid=t-y dreq=d-3 spans=13")
	tc.run(t, "step send=p-y tid=t-y blocks=1 tokens=16")
	if n := dropped("reg_taken"); n != 2 || st.matched[regKey{engine: "D2", dreq: "d-2"}] == nil || len(st.regs) != 0 {
		t.Errorf("one of three naming p-y by id: reg_taken %d, d-2 paired %v, %d registrations waiting; want 2, paired, none",
			n, st.matched[regKey{engine: "D2", dreq: "d-2"}] != nil, len(st.regs))
	}
	tc.run(t, "notif from=D1/0 kind=reg tid=t-x dreq=d-4 preq=p-x spans=14")
	tc.run(t, "notif from=D2/0 kind=reg tid=t-x dreq=d-5 preq=p-x spans=15")
	if got := tc.run(t, "step send=p-x tid=t-x blocks=2 tokens=16"); dropped("reg_ambiguous") != 2 || len(st.regs) != 0 {
		t.Errorf("two naming p-x by id: reg_ambiguous %d, %d registrations waiting (%s); want 2, none", dropped("reg_ambiguous"), len(st.regs), got)
	}
}
