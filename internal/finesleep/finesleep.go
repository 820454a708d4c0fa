// Package finesleep sleeps for less than a millisecond.
//
// Go's timers (time.Sleep, time.Timer, time.Ticker) wake a process whose
// goroutines all wait no sooner than about a millisecond after they were
// due on Linux: the runtime then waits in epoll_pwait, whose timeout has
// millisecond resolution, so a 50 µs timer fires after 1.05-1.1 ms (Go
// 1.26, measured in bench/RESULTS.md). A poller that means to look every
// 50 µs looks every millisecond instead. Sleep blocks its thread in
// nanosleep(2) instead, whose timer is the kernel's high-resolution one:
// 50 µs take about 110 µs with the kernel's default timer slack (50 µs),
// about 77 µs once Tighten set the thread's slack to 1 µs.
//
// A sleeping goroutine holds its thread, like any blocking system call
// (the runtime hands the thread's processor to other goroutines), so
// Sleep suits a few dedicated pollers, not many goroutines.
package finesleep

import "time"

// Fine is the longest pause Sleep takes in nanosleep(2); longer ones go
// to time.Sleep, whose millisecond of lateness matters less there.
const Fine = time.Millisecond

// Sleep pauses the calling goroutine for at least d (nothing when d <= 0).
func Sleep(d time.Duration) {
	if d <= 0 {
		return
	}
	if d >= Fine {
		time.Sleep(d)
		return
	}
	sleep(d)
}

// Tighten locks the calling goroutine to its thread and sets the thread's
// timer slack to 1 µs, so that its short sleeps end on time; undo sets
// the slack back and unlocks. A goroutine that polls for its whole life
// may leave it locked: its thread then ends with it.
func Tighten() (undo func()) { return tighten() }
