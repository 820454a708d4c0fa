// Command libkvxfer is kvxfer's server as a C shared library: the
// in-process placement, where the server kvxferd runs lives inside the
// engine's own process, so that backends register the engine's memory
// natively (NIXL/UCX give GPU transports only to memory the registering
// process allocated). Build it with
//
//	go build -buildmode=c-shared -o libkvxfer.so ./cmd/libkvxfer
//
// and call it through kvxfer.h (Python: kvxfer.inprocess): kvxfer_start
// with a JSON configuration whose keys are kvxferd serve's flag names
// returns the gRPC endpoint the engine's per-rank kvxfer.v1 streams
// connect to; kvxfer_stop stops it. The endpoint is an abstract unix
// socket serving this process only (SO_PEERCRED pid), and there the
// engine may name its memory by address (SharedMemory.in_process). A
// rank's stream may also skip gRPC (direct.go, kvxfer_stream_*): the same
// kvxfer.v1 messages, marshalled, handed to the library and taken from
// it, served by the same server code.
//
// abi.c holds the C entry points: they refuse a forked child before
// entering Go, and own the per-thread error buffer Go writes into.
package main

/*
#include <stddef.h>

int kvxfer_fork_close_add(int fd, unsigned long long ino);
int kvxfer_host_ignores_sigpipe(void);
*/
import "C"

import (
	"errors"
	"fmt"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/forkclose"
)

// A child forked without exec closes the server's listening sockets at
// once (abi.c's fork handler): they are recorded as they open.
func init() {
	forkclose.SetHook(func(fd int, ino uint64) { C.kvxfer_fork_close_add(C.int(fd), C.ulonglong(ino)) })
	keepSIGPIPE()
}

// keepSIGPIPE keeps a broken stdout or stderr from killing an engine's
// process that ignores SIGPIPE (Python does: its writes fail with
// BrokenPipeError). The Go runtime of a c-shared library handles SIGPIPE
// from its start, whatever the process had, and kills the process with it
// when Go code's write to fd 1 or 2 fails with EPIPE (os/signal: a command
// line program's behaviour), unless SIGPIPE is ignored through os/signal;
// the server logs to stderr, so a Python engine whose stderr is a pipe
// nobody reads any more (its log collector exited) died with kvxfer and
// lives on without it. Where the process ignored SIGPIPE as it loaded the
// library, signal.Ignore puts that disposition back (Go's writes then
// fail with EPIPE, as the engine's do); a process that did not keeps the
// runtime's handler, and dies by it as by its own writes.
func keepSIGPIPE() {
	if C.kvxfer_host_ignores_sigpipe() != 0 {
		signal.Ignore(syscall.SIGPIPE)
	}
}

// version is the library's version; abi.c's KVXFER_VERSION says the same.
const version = "0.2.0 (kvxfer.v1; C ABI 2)"

// Status codes (kvxfer.h).
const (
	statusOK      = 0
	statusConfig  = 1
	statusStarted = 2
	statusRange   = 4
	statusFail    = 5
)

// running is the process's server, if started. Its lock is held through
// a start and a stop (which waits for the server's drain): current is the
// server the engine's calls and streams use, read without that lock, and
// cleared as a stop begins, so that they fail at once while it drains
// instead of waiting for it.
var running struct {
	sync.Mutex
	p *daemon.InProcess
}

var current atomic.Pointer[daemon.InProcess]

// errStarted is the error of a start with another configuration.
var errStarted = errors.New("kvxfer: the in-process server is running with another configuration (kvxfer_stop it first)")

// start starts the server, or returns the running one when config is the
// configuration it was started with.
func start(config string) (endpoint string, code int, err error) {
	running.Lock()
	defer running.Unlock()
	if p := running.p; p != nil && p.Stopped() {
		// It stopped by itself (a listener gone), and may be stopping
		// still: its ranks drain, moving bytes into the memory their
		// engine named. Start anew only once it let go (Stop waits for the
		// stop under way), so that no server of this library is left
		// running unseen by kvxfer_stop.
		running.p = nil
		current.CompareAndSwap(p, nil)
		if err := p.Stop(); err != nil {
			return "", statusFail, fmt.Errorf("kvxfer: the server that stopped by itself did not let go of its engines' memory "+
				"(it may still be touched; do not free it): %w", err)
		}
	}
	if p := running.p; p != nil {
		if p.Config() == config {
			return p.Endpoint(), statusOK, nil
		}
		return "", statusStarted, fmt.Errorf("%w: running with %q, asked for %q", errStarted, p.Config(), config)
	}
	p, err := daemon.StartInProcess([]byte(config))
	if err != nil {
		if errors.Is(err, daemon.ErrConfig) {
			return "", statusConfig, err
		}
		return "", statusFail, err
	}
	running.p = p
	current.Store(p)
	return p.Endpoint(), statusOK, nil
}

// stop stops the running server, if any.
func stop() error {
	running.Lock()
	defer running.Unlock()
	if running.p == nil {
		return nil
	}
	current.Store(nil)
	err := running.p.Stop()
	running.p = nil
	return err
}

// put copies s and a NUL into the C buffer buf of n bytes, if it fits.
func put(buf *C.char, n C.size_t, s string) bool {
	if buf == nil || uint64(n) < uint64(len(s))+1 {
		return false
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
	copy(dst, s)
	dst[len(s)] = 0
	return true
}

// putErr writes err's message into the C buffer buf of n bytes, cut to
// fit.
func putErr(buf *C.char, n C.size_t, err error) {
	if buf == nil || n == 0 {
		return
	}
	msg := err.Error()
	if uint64(len(msg)) >= uint64(n) {
		msg = msg[:n-1]
	}
	put(buf, n, msg)
}

//export kvxferGoStart
func kvxferGoStart(config *C.char, endpoint *C.char, capacity C.size_t, errBuf *C.char, errCap C.size_t) C.int {
	ep, code, err := start(C.GoString(config))
	if err != nil {
		putErr(errBuf, errCap, err)
		return C.int(code)
	}
	if !put(endpoint, capacity, ep) {
		putErr(errBuf, errCap, fmt.Errorf("kvxfer: the endpoint %q needs %d bytes, the buffer has %d", ep, len(ep)+1, capacity))
		return statusRange
	}
	return statusOK
}

//export kvxferGoCheckConfig
func kvxferGoCheckConfig(config *C.char, errBuf *C.char, errCap C.size_t) C.int {
	if err := daemon.CheckInProcessConfig([]byte(C.GoString(config))); err != nil {
		putErr(errBuf, errCap, err)
		return statusConfig
	}
	return statusOK
}

//export kvxferGoStop
func kvxferGoStop(errBuf *C.char, errCap C.size_t) C.int {
	if err := stop(); err != nil {
		putErr(errBuf, errCap, err)
		return statusFail
	}
	return statusOK
}

func main() {}
