//go:build linux

package nixl

import (
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"golang.org/x/sys/unix"
)

// captureLogs runs f with the process's fd 1 and 2 (where UCX and NIXL
// log) going to a pipe, and returns what was written there.
func captureLogs(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		got <- b
	}()
	var saved [2]int
	for i, fd := range []int{1, 2} {
		if saved[i], err = unix.Dup(fd); err != nil {
			t.Fatal(err)
		}
		if err := unix.Dup2(int(w.Fd()), fd); err != nil {
			t.Fatal(err)
		}
	}
	func() {
		defer func() {
			for i, fd := range []int{1, 2} {
				_ = unix.Dup2(saved[i], fd)
				_ = unix.Close(saved[i])
			}
			_ = w.Close()
		}()
		f()
	}()
	out := <-got
	_ = r.Close()
	_, _ = os.Stderr.Write(out) // still shown
	return string(out)
}

// Close releases what the Backend still holds in NIXL: a transfer in
// flight (its request, and UCX's requests under it) and prepared lists.
// Before, Close destroyed the agent under them: UCX reported its requests
// never returned ("was not returned to mpool ucp_requests"), and the
// transfer and lists could not be released any more (ErrClosed, or
// nothing at all for a list), so their memory leaked with every Backend
// closed while a transfer ran.
func TestCloseReleasesInFlight(t *testing.T) {
	// Over TCP a large WRITE is still in flight when Post returns (over
	// shared memory UCX's CMA moves it within the post).
	t.Setenv("UCX_TLS", "tcp")
	t.Setenv("UCX_NET_DEVICES", "lo")
	const size = 32 << 20
	a, b := newCloseEnd(t, size), newCloseEnd(t, size)
	id := postInFlightOp(t, a, b, hotpath.OpWrite, []byte("done"))
	peer := b.b.Name()
	if _, err := a.b.Prepare("", []hotpath.Entry{{Addr: a.r.Addr, Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.b.Prepare(peer, []hotpath.Entry{{Addr: b.r.Addr, Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	if s, _ := a.b.State(id); s != kvxfer.XferInProgress {
		// (Its handle and the lists are still held: Close must release
		// them all the same.)
		t.Logf("the WRITE ended before Close (%v): only a finished transfer is released this run", s)
	}
	var closeErr error
	logged := captureLogs(t, func() {
		closeErr = a.b.Close()
		time.Sleep(500 * time.Millisecond) // UCX reports leftovers from its threads
	})
	if closeErr != nil {
		t.Errorf("Close = %v", closeErr)
	}
	if strings.Contains(logged, "not returned to mpool") {
		t.Errorf("Close left UCX requests of the transfer in flight unreleased:\n%s", logged)
	}
	a.b.mu.Lock()
	held := len(a.b.mu.xfers)
	a.b.mu.Unlock()
	if held != 0 {
		t.Errorf("%d transfers still held after Close (their NIXL requests can no longer be freed)", held)
	}
	if n := a.b.PreparedLists(); n != 0 {
		t.Errorf("%d prepared lists still held after Close", n)
	}
	if _, err := a.b.State(id); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("State after Close = %v, want ErrClosed", err)
	}
	if err := a.b.Release(id); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("Release after Close = %v, want ErrClosed", err)
	}
}
