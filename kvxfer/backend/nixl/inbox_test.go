//go:build linux

package nixl

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Drained notifications are not held by the Backend any more: before,
// the inbox kept its backing array, and with it every message of the
// largest burst drained so far (here 64 MiB) for as long as the Backend
// lived, until later bursts happened to overwrite each slot.
func TestDrainNotifsKeepsNothing(t *testing.T) {
	a, b := newCloseEnd(t, 1<<16), newCloseEnd(t, 1<<16)
	peer := linked(t, a, b)
	const n = 64
	for i := range n {
		if err := a.b.Notify(peer, bytes.Repeat([]byte{byte(i)}, 1<<20)); err != nil {
			t.Fatal(err)
		}
	}
	var got []kvxfer.Notif
	for deadline := time.Now().Add(10 * time.Second); len(got) < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d notifications arrived", len(got), n)
		}
		got = b.b.DrainNotifs(got)
	}
	// (NIXL does not keep notifications in order across UCX's workers:
	// each arrives once, in any order.)
	seen := make([]bool, n)
	for i, x := range got {
		if len(x.Msg) != 1<<20 || int(x.Msg[0]) >= n || seen[x.Msg[0]] || x.From != a.b.Name() {
			t.Fatalf("notification %d: %d bytes of %d from %s (a repeat, or not one sent)", i, len(x.Msg), x.Msg[0], x.From)
		}
		seen[x.Msg[0]] = true
	}
	b.b.mu.Lock()
	held := 0
	for _, x := range b.b.mu.inbox[:cap(b.b.mu.inbox)] {
		held += len(x.Msg)
	}
	b.b.mu.Unlock()
	if held > 0 {
		t.Errorf("the Backend still holds %d bytes of drained notifications", held)
	}
}

// Map refuses memory whose end wraps past 2^64, as MapDevice does,
// naming base and length. Before, it was adopted, and a region in it
// passed Register's check on to UCX.
func TestMapWrappingRefused(t *testing.T) {
	a := newCloseEnd(t, 4096)
	base := ^uint64(0) - 100
	err := a.b.Map(base, make([]byte, 4096))
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%#x +4096", base)) {
		t.Fatalf("Map of [%#x, +4096) = %v, want refused naming it", base, err)
	}
	if err := a.b.Register([]kvxfer.MemRegion{{Addr: base, Len: 4096}}); err == nil || !strings.Contains(err.Error(), "not mapped") {
		t.Errorf("Register of it = %v, want not mapped", err)
	}
}
