//go:build linux

package nixl

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// postInFlight posts a WRITE of all of a's memory into b's, over TCP so
// that it is still in flight when Post returns (over shared memory UCX's
// CMA moves it within the post), and returns its id.
func postInFlight(t *testing.T, a, b closeEnd) kvxfer.XferID {
	t.Helper()
	return postInFlightOp(t, a, b, hotpath.OpWrite, nil)
}

// postInFlightOp is postInFlight for op: a WRITE from a's memory, a READ
// from b's (its source filled with a pattern first), notif its
// notification.
func postInFlightOp(t *testing.T, a, b closeEnd, op hotpath.Op, notif []byte) kvxfer.XferID {
	t.Helper()
	src := a.mem
	if op == hotpath.OpRead {
		src = b.mem
	}
	for i := range src {
		src[i] = byte(i*7 + 3)
	}
	meta, err := b.b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	peer, err := a.b.LoadPeer(meta)
	if err != nil {
		t.Fatal(err)
	}
	var ds []hotpath.Desc
	for off := uint64(0); off < uint64(len(a.mem)); off += 4096 {
		ds = append(ds, hotpath.Desc{Local: a.r.Addr + off, Remote: b.r.Addr + off, Len: 4096})
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		id, err := a.b.Post(op, peer, ds, notif)
		if err == nil {
			return id
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
}

// A transfer the Worker gives up is released before its request is
// reported, after which the engine reuses its blocks: once Release
// returns, no byte of it may land any more. NIXL's own release of a
// transfer in flight returns at once while UCX goes on moving its bytes
// (before: the whole destination changed after Release returned).
func TestReleaseInFlightStops(t *testing.T) {
	t.Setenv("UCX_TLS", "tcp")
	t.Setenv("UCX_NET_DEVICES", "lo")
	const size = 64 << 20
	a, b := newCloseEnd(t, size), newCloseEnd(t, size)
	id := postInFlight(t, a, b)
	s, _ := a.b.State(id)
	if err := a.b.Release(id); err != nil {
		t.Fatalf("Release: %v", err)
	}
	snap := bytes.Clone(b.mem)
	if s != kvxfer.XferInProgress {
		t.Logf("the WRITE ended before Release (%v): this run checks a finished transfer only", s)
	}
	if changed := changedPages(b.mem, snap); changed > 0 {
		t.Fatalf("%d pages of the destination changed after Release returned", changed)
	}
	if !bytes.Equal(b.mem, a.mem) {
		t.Fatal("Release waited for the WRITE, which did not land whole")
	}
}

// A transfer that does not end within releaseWait is released all the
// same, counted, and Release says so.
func TestReleaseInFlightGivesUp(t *testing.T) {
	t.Setenv("UCX_TLS", "tcp")
	t.Setenv("UCX_NET_DEVICES", "lo")
	defer func(d time.Duration) { releaseWait = d }(releaseWait)
	releaseWait = 0
	const size = 64 << 20
	a, b := newCloseEnd(t, size), newCloseEnd(t, size)
	id := postInFlight(t, a, b)
	before := ReleasedInFlight()
	err := a.b.Release(id)
	if err == nil {
		if ReleasedInFlight() != before {
			t.Fatal("counted as released in flight, with no error")
		}
		t.Log("the WRITE ended before Release could give up on it: only the count was checked")
		return
	}
	if !strings.Contains(err.Error(), "still in flight") || ReleasedInFlight() != before+1 {
		t.Fatalf("Release = %v, released in flight %d (was %d)", err, ReleasedInFlight(), before)
	}
	time.Sleep(time.Second) // UCX's bytes still on their way before the agents close
}
