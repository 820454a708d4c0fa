//go:build !linux

package finesleep

import "time"

func sleep(d time.Duration) { time.Sleep(d) }

func tighten() func() { return func() {} }
