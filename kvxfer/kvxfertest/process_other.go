//go:build !linux

package kvxfertest

import "os/exec"

// dieWithParent: without Linux's parent-death signal, an agent ends when
// its connection to the test breaks.
func dieWithParent(*exec.Cmd) {}
