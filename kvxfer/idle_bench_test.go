package kvxfer_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"

	"github.com/kvxfer/kvxfer/internal/finesleep"
	"github.com/kvxfer/kvxfer/internal/proctime"
)

// BenchmarkNixlIdle: the CPU a nixl.Backend with nothing to do costs (its
// NIXL agent's progress thread and its own polling for notifications),
// after two seconds without activity. Each op is 100 ms of idling; cpu-%
// is the process's CPU time over that wall time.
func BenchmarkNixlIdle(b *testing.B) {
	be, err := nixl.New(nixl.Config{Name: fmt.Sprint("idle-", rand.Uint64()), Params: kvxfertest.NixlParams()})
	if errors.Is(err, nixl.ErrUnavailable) {
		b.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	time.Sleep(2 * time.Second)
	proctime.BenchIdle(b)
}

// nixlPair is two nixl.Backends of this process, each the other's peer.
func nixlPair(b *testing.B, poll time.Duration) (x, y *nixl.Backend) {
	var bes [2]*nixl.Backend
	for i := range bes {
		be, err := nixl.New(nixl.Config{Name: fmt.Sprint("lat-", i, "-", rand.Uint64()), Params: kvxfertest.NixlParams(), PollInterval: poll})
		if errors.Is(err, nixl.ErrUnavailable) {
			b.Skipf("NIXL is not available here: %v", err)
		}
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = be.Close() })
		bes[i] = be
	}
	for i, be := range bes {
		meta, err := be.LocalMetadata()
		if err != nil {
			b.Fatal(err)
		}
		if _, err := bes[1-i].LoadPeer(meta); err != nil {
			b.Fatal(err)
		}
	}
	return bes[0], bes[1]
}

// BenchmarkNixlNotifyLatency: a notification from one nixl.Backend to
// another whose Worker awaits peer messages (Awaiting), from Notify to
// the receiver's Events firing and the message drained: what each
// notification hop of a transfer over NIXL waits (a registration reaching
// P, the completion notice reaching D), the process otherwise idle.
func BenchmarkNixlNotifyLatency(b *testing.B) {
	for _, poll := range nixlPolls {
		b.Run(fmt.Sprint("poll=", poll), func(b *testing.B) { benchNotifyLatency(b, poll) })
	}
}

// nixlPolls are the PollIntervals the NIXL benchmarks try.
var nixlPolls = []time.Duration{nixl.DefaultPollInterval, 100 * time.Microsecond, 200 * time.Microsecond}

func benchNotifyLatency(b *testing.B, poll time.Duration) {
	x, y := nixlPair(b, poll)
	y.Awaiting(true)
	defer y.Awaiting(false)
	var got []kvxfer.Notif
	send := func() {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			err := x.Notify(y.Name(), []byte("n"))
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				b.Fatal(err) // the first may find UCX still connecting
			}
		}
	}
	wait := func() {
		for len(got) == 0 {
			select {
			case <-y.Events():
			case <-time.After(10 * time.Second):
				b.Fatal("no notification within 10 s")
			}
			got = y.DrainNotifs(got[:0])
		}
		got = got[:0]
	}
	send()
	wait()
	for b.Loop() {
		finesleep.Sleep(137 * time.Microsecond) // the receiver's poll mid-pause, as it is when a message comes
		send()
		wait()
	}
}

// BenchmarkNixlAwaitingCPU: the CPU a nixl.Backend costs while its Worker
// awaits peer messages and none comes (it polls at PollInterval). Each op
// is 100 ms; cpu-% is the process's CPU time over that wall time.
func BenchmarkNixlAwaitingCPU(b *testing.B) {
	for _, poll := range nixlPolls {
		b.Run(fmt.Sprint("poll=", poll), func(b *testing.B) { benchAwaitingCPU(b, poll) })
	}
}

func benchAwaitingCPU(b *testing.B, poll time.Duration) {
	be, err := nixl.New(nixl.Config{Name: fmt.Sprint("await-", rand.Uint64()), Params: kvxfertest.NixlParams(), PollInterval: poll})
	if errors.Is(err, nixl.ErrUnavailable) {
		b.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	be.Awaiting(true)
	defer be.Awaiting(false)
	time.Sleep(200 * time.Millisecond)
	proctime.BenchIdle(b)
}
