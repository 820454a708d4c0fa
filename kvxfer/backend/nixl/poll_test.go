package nixl

import (
	"testing"
	"time"
)

// The poll loop's pauses: PollInterval while a transfer is in flight or
// a Worker awaits within hotPoll of activity, four of them while it
// awaits within a second, a millisecond while it awaits longer or within
// a second of activity, 10 ms idle; never shorter than PollInterval.
func TestPollAfter(t *testing.T) {
	const us = time.Microsecond
	for _, tc := range []struct {
		interval          time.Duration
		inFlight, awaited bool
		since, want       time.Duration
	}{
		{50 * us, true, false, time.Hour, 50 * us},
		{50 * us, true, true, time.Hour, 50 * us},
		{50 * us, false, true, 0, 50 * us},
		{50 * us, false, true, hotPoll - 1, 50 * us},
		{50 * us, false, true, hotPoll, 200 * us},
		{50 * us, false, true, time.Second - 1, 200 * us},
		{50 * us, false, true, time.Second, time.Millisecond},
		{50 * us, false, true, time.Hour, time.Millisecond},
		{50 * us, false, false, 0, time.Millisecond},
		{50 * us, false, false, time.Second, time.Millisecond},
		{50 * us, false, false, time.Second + 1, idlePoll},
		{400 * us, false, true, hotPoll, time.Millisecond},
		{2 * time.Millisecond, false, true, hotPoll, 2 * time.Millisecond},
		{2 * time.Millisecond, false, false, 0, 2 * time.Millisecond},
	} {
		if got := pollAfter(tc.interval, tc.inFlight, tc.awaited, tc.since); got != tc.want {
			t.Errorf("pollAfter(%v, in flight %v, awaited %v, %v since activity) = %v, want %v",
				tc.interval, tc.inFlight, tc.awaited, tc.since, got, tc.want)
		}
	}
}
