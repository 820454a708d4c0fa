package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// The machine's wake-up cost: what one hop between two processes costs
// before any of kvxfer's work. The same-host path's hop table (a part's
// way to D, D's answer's way back) is read against it: a hop is at least
// the wake-up of a thread of the other process, and on a virtual machine
// whose idle CPUs halt, waking one costs tens of microseconds.

// wakeupTrips is how many round trips each of the two ways is timed over.
const wakeupTrips = 300

// wakeupIdle is the pause before each idle round trip: long enough for
// both processes' threads to have gone to sleep (and their CPUs idle).
const wakeupIdle = 500 * time.Microsecond

// wakeup times round trips of one byte over a unix socket to a child
// process that echoes it: one after a pause (both sides asleep) and one
// back to back (both awake), and returns their one-way medians (half a
// round trip).
func wakeup(ctx context.Context) (idle, busy time.Duration, err error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, 0, err
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "wakeup"), os.NewFile(uintptr(fds[1]), "wakeup-child")
	defer mine.Close()
	exe, err := os.Executable()
	if err != nil {
		theirs.Close()
		return 0, 0, err
	}
	cmd := exec.CommandContext(ctx, exe, "-wakeup-child")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second
	err = cmd.Start()
	theirs.Close()
	if err != nil {
		return 0, 0, fmt.Errorf("start the echo process: %w", err)
	}
	defer func() {
		mine.Close() // the child reads EOF and exits
		if werr := cmd.Wait(); err == nil && werr != nil {
			err = fmt.Errorf("the echo process: %w", werr)
		}
	}()
	b := make([]byte, 1)
	trip := func() (time.Duration, error) {
		t := time.Now()
		if _, err := mine.Write(b); err != nil {
			return 0, err
		}
		if _, err := io.ReadFull(mine, b); err != nil {
			return 0, err
		}
		return time.Since(t), nil
	}
	for range 20 { // warm up
		if _, err := trip(); err != nil {
			return 0, 0, err
		}
	}
	var idles, busies []time.Duration
	for range wakeupTrips {
		time.Sleep(wakeupIdle)
		d, err := trip()
		if err != nil {
			return 0, 0, err
		}
		idles = append(idles, d)
	}
	for range wakeupTrips {
		d, err := trip()
		if err != nil {
			return 0, 0, err
		}
		busies = append(busies, d)
	}
	idle, _, _ = spread(idles)
	busy, _, _ = spread(busies)
	return idle / 2, busy / 2, nil
}

// wakeupChild echoes every byte it reads on descriptor 3 until EOF.
func wakeupChild() error {
	f := os.NewFile(3, "wakeup")
	if f == nil {
		return errors.New("-wakeup-child: no descriptor 3")
	}
	defer f.Close()
	b := make([]byte, 1)
	for {
		if _, err := f.Read(b); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if _, err := f.Write(b); err != nil {
			return err
		}
	}
}

// us is d in microseconds.
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
