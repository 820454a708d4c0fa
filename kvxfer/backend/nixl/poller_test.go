package nixl

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"
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
