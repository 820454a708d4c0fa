package netxfer

import (
	"fmt"
	"io"
	"net"
	"runtime/debug"
)

// An engine's memory is a file mapped shared (kvxferd maps the engine's
// shared-memory file): the engine may shrink the file under the mapping,
// and Go code that then touches the pages past its end faults (SIGBUS),
// which kills the process unless the goroutine has panic-on-fault set.
// Every Go copy into or out of mapped memory runs under faultGuard: the
// fault fails that transfer (and its connection), and the daemon, with
// every other engine's requests, carries on. Copies the kernel makes (a
// plain TCP socket's writev and readv) fail with EFAULT instead.

// faultGuard is deferred, with what debug.SetPanicOnFault(true) returned,
// by a function that touches mapped memory: it restores the setting and
// turns a memory fault into *err. Any other panic goes on.
func faultGuard(old bool, err *error) {
	debug.SetPanicOnFault(old)
	r := recover()
	if r == nil {
		return
	}
	if f, ok := r.(interface{ Addr() uintptr }); ok {
		*err = fmt.Errorf("%w: memory fault at %#x (a memory file shrank under its mapping): %v", ErrXferFailed, f.Addr(), r)
		return
	}
	panic(r)
}

// copyGuarded copies src[i] into dst[i] (faultGuard).
func copyGuarded(dst, src [][]byte) (err error) {
	defer faultGuard(debug.SetPanicOnFault(true), &err)
	for i := range dst {
		copy(dst[i], src[i])
	}
	return nil
}

// writeGuarded writes bufs to w (faultGuard): over TLS, the encryption
// reads the memory in Go.
func writeGuarded(bufs *net.Buffers, w io.Writer) (err error) {
	defer faultGuard(debug.SetPanicOnFault(true), &err)
	_, err = bufs.WriteTo(w)
	return err
}
