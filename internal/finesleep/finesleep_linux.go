//go:build linux

package finesleep

import (
	"errors"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

func sleep(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	for {
		var left unix.Timespec
		err := unix.Nanosleep(&ts, &left)
		if !errors.Is(err, unix.EINTR) {
			return // done (nanosleep fails only on EINTR and bad arguments)
		}
		ts = left // a signal came: sleep what was left
	}
}

// slack is the timer slack Tighten sets, in nanoseconds.
const slack = 1000

func tighten() func() {
	runtime.LockOSThread()
	old, err := unix.PrctlRetInt(unix.PR_GET_TIMERSLACK, 0, 0, 0, 0)
	if err != nil || unix.Prctl(unix.PR_SET_TIMERSLACK, slack, 0, 0, 0) != nil {
		return runtime.UnlockOSThread // the slack stays as it was
	}
	return func() {
		_ = unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(old), 0, 0, 0)
		runtime.UnlockOSThread()
	}
}
