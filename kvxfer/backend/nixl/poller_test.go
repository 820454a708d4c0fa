package nixl

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// testParams are the plugin parameters the NIXL tests use
// (KVXFER_NIXL_PARAMS, as kvxfertest.NixlParams reads them).
func testParams() map[string]string {
	out := map[string]string{}
	for _, kv := range strings.Split(os.Getenv("KVXFER_NIXL_PARAMS"), ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			out[k] = v
		}
	}
	return out
}

// One poller serves every Backend of the process: three Backends in a
// ring each see the notification the one before sent them, at their own
// pace (one awaits, one idles, one has just been active); once the last
// is closed the poller's loop ends.
func TestPollerServesEveryBackend(t *testing.T) {
	var bes [3]*Backend
	for i := range bes {
		be, err := New(Config{Name: fmt.Sprint("ring-", i, "-", rand.Uint64()), Params: testParams()})
		if errors.Is(err, ErrUnavailable) {
			t.Skipf("NIXL is not available here: %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		defer be.Close()
		bes[i] = be
	}
	bes[0].Awaiting(true)
	defer bes[0].Awaiting(false)
	for i, be := range bes {
		meta, err := bes[(i+1)%3].LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := be.LoadPeer(meta); err != nil {
			t.Fatal(err)
		}
	}
	for round := range 3 {
		for i, be := range bes {
			msg := fmt.Sprintf("%d from %d", round, i)
			to := bes[(i+1)%3].Name()
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				err := be.Notify(to, []byte(msg))
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("notify %s: %v", to, err) // the first may find UCX still connecting
				}
			}
		}
		for i, be := range bes {
			want := fmt.Sprintf("%d from %d", round, (i+2)%3)
			select {
			case <-be.Events():
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: backend %d saw no notification within 10 s", round, i)
			}
			got := be.DrainNotifs(nil)
			for len(got) == 0 { // the event may have come from the round before
				select {
				case <-be.Events():
				case <-time.After(10 * time.Second):
					t.Fatalf("round %d: backend %d saw no notification within 10 s", round, i)
				}
				got = be.DrainNotifs(nil)
			}
			if len(got) != 1 || string(got[0].Msg) != want {
				t.Fatalf("round %d: backend %d drained %+v, want %q", round, i, got, want)
			}
		}
	}
	for _, be := range bes {
		if err := be.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		polls.mu.Lock()
		running, n := polls.running, len(polls.set)
		polls.mu.Unlock()
		if !running && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the poller still runs (%d Backends) 5 s after the last one closed", n)
		}
	}
}

// The one poller serves every Backend of the process without waiting for
// any: while a post of many descriptors holds one Backend's agent (for
// most of a second here), a notification to another Backend is seen at
// once. Before, the poller's round of the busy Backend waited for the
// post to end, and every other Backend of the process (the other ranks
// of a kvxferd) went unpolled as long: the notification was seen only
// after the post (844 ms for a 865 ms post).
func TestPollerNotHeldUpByBusyBackend(t *testing.T) {
	const size = 32 << 20
	a1, b1 := newCloseEnd(t, size), newCloseEnd(t, size)
	a2, b2 := newCloseEnd(t, 4096), newCloseEnd(t, 4096)
	load := func(from, to *Backend) kvxfer.PeerName {
		meta, err := to.LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		p, err := from.LoadPeer(meta)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	p1, p2 := load(a1.b, b1.b), load(a2.b, b2.b)
	// The second pair talks once first (UCX connects on first use).
	for deadline := time.Now().Add(10 * time.Second); a2.b.Notify(p2, []byte("hello")) != nil; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first notification was never sent")
		}
	}
	for deadline := time.Now().Add(10 * time.Second); len(b2.b.DrainNotifs(nil)) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first notification never came")
		}
	}
	var ds []hotpath.Desc
	for off := uint64(0); off < size; off += 128 {
		ds = append(ds, hotpath.Desc{Local: a1.r.Addr + off, Remote: b1.r.Addr + off, Len: 64})
	}
	posted := make(chan time.Duration, 1)
	go func() {
		t0 := time.Now()
		id, err := a1.b.Post(hotpath.OpWrite, p1, ds, nil)
		posted <- time.Since(t0)
		if err == nil {
			_ = a1.b.Release(id)
		}
	}()
	time.Sleep(50 * time.Millisecond) // the post holds a1's agent now
	select {
	case <-b2.b.Events(): // an earlier one
	default:
	}
	t0 := time.Now()
	if err := a2.b.Notify(p2, []byte("x")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b2.b.Events():
		t.Logf("notification seen after %v, the other Backend's post still under way", time.Since(t0))
		<-posted
	case took := <-posted:
		seen := "not yet"
		select {
		case <-b2.b.Events():
			seen = time.Since(t0).String()
		case <-time.After(5 * time.Second):
		}
		if took < 200*time.Millisecond {
			t.Logf("the post took %v, the notification was seen %s: too short to tell this run", took, seen)
			return
		}
		t.Errorf("a notification to one Backend was seen only after another Backend's post of %d descriptors ended "+
			"(the post took %v; seen after %v)", len(ds), took, seen)
	}
}

type closeEnd struct {
	b   *Backend
	r   kvxfer.MemRegion
	mem []byte
}

func newCloseEnd(t *testing.T, n int) closeEnd {
	t.Helper()
	be, err := New(Config{Name: fmt.Sprint(t.Name(), "-", rand.Uint64()), Params: testParams()})
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = be.Close() })
	mem := make([]byte, n)
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if err := be.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	r := kvxfer.MemRegion{Addr: base, Len: uint64(n), Kind: kvxfer.MemDRAM}
	if err := be.Register([]kvxfer.MemRegion{r}); err != nil {
		t.Fatal(err)
	}
	return closeEnd{be, r, mem}
}
