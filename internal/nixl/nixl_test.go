package nixl

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/proctime"
)

// open returns an agent, or skips when NIXL is not installed here.
func open(t *testing.T, name string) *Agent {
	t.Helper()
	a, err := Open(name, "UCX", nil)
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = a.Close() })
	return a
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

func TestWriteBetweenAgents(t *testing.T) {
	suffix := fmt.Sprint(rand.Uint64())
	a, b := open(t, "a-"+suffix), open(t, "b-"+suffix)
	src, dst := make([]byte, 1<<20), make([]byte, 1<<20)
	for i := range src {
		src[i] = byte(i * 7)
	}
	if err := a.Register([][3]uint64{{addr(src), uint64(len(src)), 0}}); err != nil {
		t.Fatal(err)
	}
	if err := b.Register([][3]uint64{{addr(dst), uint64(len(dst)), 0}}); err != nil {
		t.Fatal(err)
	}
	meta, err := b.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	peer, err := a.LoadPeer(meta)
	if err != nil || peer != b.Name() {
		t.Fatalf("LoadPeer = %q, %v", peer, err)
	}
	descs := [][3]uint64{{addr(src), addr(dst) + 4096, 8192}, {addr(src) + 65536, addr(dst), 4096}}
	var x Xfer
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
		x, err = a.Post(true, peer, descs, []byte("landed"))
		if err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("Post: %v", err)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
		done, err := a.State(x)
		if err != nil {
			t.Fatalf("State: %v", err)
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("transfer not done in 20 s")
		}
	}
	if !bytes.Equal(dst[4096:4096+8192], src[:8192]) || !bytes.Equal(dst[:4096], src[65536:65536+4096]) {
		t.Error("bytes differ")
	}
	var got []Notif
	for deadline := time.Now().Add(20 * time.Second); len(got) == 0 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if got, err = b.Drain(got); err != nil {
			t.Fatal(err)
		}
	}
	if len(got) != 1 || string(got[0].Msg) != "landed" || got[0].From != a.Name() {
		t.Errorf("notifications = %+v", got)
	}
	if err := a.Release(x); err != nil {
		t.Error(err)
	}
}

// BenchmarkIdleAgent: the CPU an agent with nothing to do costs, with the
// progress thread spinning (delay 0) and pausing 100 µs between rounds
// (the default). Each op is 100 ms of idling; cpu-% is the process's CPU
// time over that wall time.
func BenchmarkIdleAgent(b *testing.B) {
	for _, d := range []time.Duration{0, DefaultProgressDelay} {
		b.Run(fmt.Sprintf("delay=%v", d), func(b *testing.B) {
			a, err := OpenConfig(Config{Name: fmt.Sprint("idle-", rand.Uint64()), Plugin: "UCX", ProgressDelay: d})
			if errors.Is(err, ErrUnavailable) {
				b.Skipf("NIXL is not available here: %v", err)
			}
			if err != nil {
				b.Fatal(err)
			}
			defer a.Close()
			time.Sleep(100 * time.Millisecond) // let it settle
			proctime.BenchIdle(b)
		})
	}
}
