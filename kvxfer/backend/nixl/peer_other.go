//go:build !linux

package nixl

import "errors"

// Without Linux's pidfds a NIXL agent publishes no process identity and
// watches no peer: peer loss is left to UCX.

func selfProc() (procID, bool) { return procID{}, false }

func procStart(int) (uint64, error) { return 0, errors.ErrUnsupported }

func pidfdOpen(int) (int, error) { return -1, errors.ErrUnsupported }

func pidfdExited(int) bool { return false }

func closeFD(int) {}
