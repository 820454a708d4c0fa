package server

import (
	"fmt"
	"testing"
	"time"
)

// What detached ranks leave behind is bounded: engine ids are the
// engines' to choose, so a rank's statistics are kept KeepDetachedStats
// after its detach, and at most MaxDetachedStats of them, the oldest
// going first; an attached rank's are never dropped, and a rank attached
// again carries on counting from what it had.
func TestRankStatsBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	var r rankStats
	r.now = func() time.Time { return now }
	live := rankKey{"live", 0, 0}
	r.acquire(live).ExpiredRequest()
	for i := range MaxDetachedStats + 10 {
		k := rankKey{fmt.Sprintf("e%d", i), 0, 0}
		r.acquire(k).ExpiredRequest()
		r.release(k)
		now = now.Add(time.Millisecond)
	}
	got := map[string]RankStats{}
	for _, s := range r.snapshot() {
		got[s.Engine] = s
	}
	if len(got) != MaxDetachedStats+1 || !got["live"].Attached {
		t.Fatalf("kept %d ranks (live attached: %v), want %d detached and the attached one", len(got), got["live"].Attached, MaxDetachedStats)
	}
	for i := range 10 {
		if _, ok := got[fmt.Sprintf("e%d", i)]; ok {
			t.Errorf("e%d kept: the oldest detached go first", i)
		}
	}
	// Attached again within the time kept: its counters go on.
	k := rankKey{"e20", 0, 0}
	r.acquire(k).ExpiredRequest()
	r.release(k)
	for _, s := range r.snapshot() {
		if s.Engine == "e20" && s.Stats.ExpiredRequests != 2 {
			t.Errorf("e20 attached again: ExpiredRequests = %d, want 2 (1 before, 1 now)", s.Stats.ExpiredRequests)
		}
	}
	now = now.Add(KeepDetachedStats)
	if s := r.snapshot(); len(s) != 1 || s[0].Engine != "live" || s[0].Stats.ExpiredRequests != 1 {
		t.Errorf("after KeepDetachedStats: %+v, want only the attached rank", s)
	}
}
