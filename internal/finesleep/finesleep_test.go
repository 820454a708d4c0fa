package finesleep

import (
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Sleep pauses at least as long as asked, whatever the length.
func TestSleepAtLeast(t *testing.T) {
	for _, d := range []time.Duration{-time.Second, 0, time.Microsecond, 50 * time.Microsecond, 300 * time.Microsecond, 2 * time.Millisecond} {
		for range 5 {
			t0 := time.Now()
			Sleep(d)
			if got := time.Since(t0); got < d {
				t.Errorf("Sleep(%v) returned after %v", d, got)
			}
		}
	}
}

// A signal to the sleeping thread does not cut the sleep short: the rest
// is slept (nanosleep returns EINTR with what is left).
func TestSleepThroughSignals(t *testing.T) {
	tid := make(chan int, 1)
	took := make(chan time.Duration, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tid <- unix.Gettid()
		var longest time.Duration
		for range 40 {
			t0 := time.Now()
			Sleep(900 * time.Microsecond)
			if got := time.Since(t0); got < 900*time.Microsecond {
				longest = -got
				break
			}
		}
		took <- longest
	}()
	id, pid := <-tid, unix.Getpid()
	for {
		select {
		case got := <-took:
			if got < 0 {
				t.Fatalf("Sleep(900µs) returned after %v with signals coming", -got)
			}
			return
		default:
		}
		// SIGURG: the signal Go's runtime itself uses, ignored otherwise.
		_ = unix.Tgkill(pid, id, unix.SIGURG)
		time.Sleep(100 * time.Microsecond)
	}
}

// Tighten sets the thread's timer slack to 1 µs and undo sets it back.
func TestTighten(t *testing.T) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		before, err := unix.PrctlRetInt(unix.PR_GET_TIMERSLACK, 0, 0, 0, 0)
		if err != nil {
			t.Errorf("PR_GET_TIMERSLACK: %v", err)
			return
		}
		undo := Tighten()
		if got, _ := unix.PrctlRetInt(unix.PR_GET_TIMERSLACK, 0, 0, 0, 0); got != slack {
			t.Errorf("timer slack after Tighten = %d ns, want %d", got, slack)
		}
		undo()
		if got, _ := unix.PrctlRetInt(unix.PR_GET_TIMERSLACK, 0, 0, 0, 0); got != before {
			t.Errorf("timer slack after undo = %d ns, want %d as before", got, before)
		}
	}()
	<-done
}

// BenchmarkSleep: how long a 50 µs pause takes, the process otherwise
// idle: time.Sleep (the runtime's timers), Sleep, and Sleep on a
// Tighten-ed thread.
func BenchmarkSleep(b *testing.B) {
	const d = 50 * time.Microsecond
	b.Run("time.Sleep", func(b *testing.B) {
		for b.Loop() {
			time.Sleep(d)
		}
	})
	b.Run("Sleep", func(b *testing.B) {
		for b.Loop() {
			Sleep(d)
		}
	})
	b.Run("Sleep-tight", func(b *testing.B) {
		defer Tighten()()
		for b.Loop() {
			Sleep(d)
		}
	})
}
