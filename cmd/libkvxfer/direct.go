package main

/*
#include <stdlib.h>
#include <stddef.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"
	"unsafe"

	"google.golang.org/grpc/codes"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
)

// Direct streams (kvxfer.h, kvxfer_stream_*): a rank's worker stream
// served without gRPC, the engine handing the library its kvxfer.v1
// ConnectRequests marshalled and taking the ConnectResponses back.

// More status codes (kvxfer.h).
const (
	statusAgain  = 6 // nothing within the wait
	statusEnded  = 7 // the stream ended
	statusStatus = 8 // kvxfer_call: the call failed with a gRPC status
)

// maxDirects bounds the streams the library holds for the process (open
// and not yet released): past it kvxfer_stream_open refuses.
var maxDirects = 1 << 16 // a variable for tests

var directs struct {
	sync.Mutex
	next int64
	m    map[int64]*server.DirectStream
}

// runningServer is the process's in-process server, or why there is none
// (one that stops is none: a call fails at once, not after the stop's
// drain).
func runningServer() (*daemon.InProcess, error) {
	if p := current.Load(); p != nil && !p.Stopped() {
		return p, nil
	}
	return nil, errors.New("kvxfer: no in-process server runs (kvxfer_start it first; a server that is stopping serves no new call)")
}

// engineBytes is the n bytes at p, which the engine owns, without a copy:
// the server decodes them before the call returns (and refuses a length
// over server.MaxDirectMessage, counting it). Such a length is not taken
// at its word: the slice is server.MaxDirectMessage+1 bytes, which the
// server refuses unread; the engine's n itself may be past what a slice
// can hold (a size_t that wrapped), which made unsafe.Slice panic and
// took the engine's process down.
func engineBytes(p *C.char, n C.size_t) []byte {
	if n == 0 {
		return nil
	}
	if uint64(n) > server.MaxDirectMessage {
		n = server.MaxDirectMessage + 1
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(p)), int(n))
}

// tooLarge is the error of a message of n bytes, past what the library
// takes (the server's, refusing engineBytes' stand-in, names that one's
// length).
func tooLarge(n C.size_t) error {
	return fmt.Errorf("kvxfer: a message of %d bytes (at most %d)", uint64(n), server.MaxDirectMessage)
}

func directOf(id C.longlong) (*server.DirectStream, error) {
	directs.Lock()
	defer directs.Unlock()
	if d := directs.m[int64(id)]; d != nil {
		return d, nil
	}
	return nil, fmt.Errorf("kvxfer: no stream %d (released, or never opened)", int64(id))
}

//export kvxferGoStreamOpen
func kvxferGoStreamOpen(errBuf *C.char, errCap C.size_t) C.longlong {
	p, err := runningServer()
	if err != nil {
		putErr(errBuf, errCap, err)
		return 0
	}
	directs.Lock()
	defer directs.Unlock()
	if len(directs.m) >= maxDirects {
		putErr(errBuf, errCap, fmt.Errorf("kvxfer: %d streams open (kvxfer_stream_release those that ended)", len(directs.m)))
		return 0
	}
	if directs.m == nil {
		directs.m = map[int64]*server.DirectStream{}
	}
	d := p.OpenDirect()
	directs.next++
	directs.m[directs.next] = d
	return C.longlong(directs.next)
}

//export kvxferGoStreamPut
func kvxferGoStreamPut(id C.longlong, msg *C.char, n C.size_t, errBuf *C.char, errCap C.size_t) C.int {
	d, err := directOf(id)
	if err == nil {
		if err = d.Put(engineBytes(msg, n)); err != nil && uint64(n) > server.MaxDirectMessage {
			err = tooLarge(n)
		}
	}
	switch {
	case err == nil:
		return statusOK
	case errors.Is(err, server.ErrDirectEnded):
		putErr(errBuf, errCap, err)
		return statusEnded
	default:
		putErr(errBuf, errCap, err)
		return statusFail
	}
}

// micros is a wait of n microseconds, n >= 0, from the engine, or 0 for
// one longer than a time.Duration holds (292 years): n*1000 would wrap,
// 18446744073709552 us to 384 ns, a wait the engine meant as forever
// ending at once.
func micros(n C.longlong) time.Duration {
	if int64(n) > math.MaxInt64/int64(time.Microsecond) {
		return 0
	}
	return time.Duration(n) * time.Microsecond
}

//export kvxferGoStreamTake
func kvxferGoStreamTake(id C.longlong, waitMicros C.longlong, out **C.char, outLen *C.size_t, code *C.int,
	errBuf *C.char, errCap C.size_t) C.int {
	d, err := directOf(id)
	if err != nil {
		putErr(errBuf, errCap, err)
		return statusFail
	}
	wait := micros(waitMicros)
	if waitMicros < 0 || wait == 0 && waitMicros > 0 {
		wait = -1 // no limit
	}
	b, ok, ended, c, msg := d.Take(wait)
	switch {
	case ok:
		*out = (*C.char)(C.CBytes(b))
		*outLen = C.size_t(len(b))
		return statusOK
	case ended:
		*code = C.int(c)
		putErr(errBuf, errCap, errors.New(msg))
		return statusEnded
	default:
		return statusAgain
	}
}

//export kvxferGoStreamCloseSend
func kvxferGoStreamCloseSend(id C.longlong) {
	if d, err := directOf(id); err == nil {
		d.CloseSend()
	}
}

//export kvxferGoStreamRelease
func kvxferGoStreamRelease(id C.longlong) {
	directs.Lock()
	d := directs.m[int64(id)]
	delete(directs.m, int64(id))
	directs.Unlock()
	if d != nil {
		d.Cancel()
	}
}

//export kvxferGoCall
func kvxferGoCall(method *C.char, req *C.char, n C.size_t, waitMicros C.longlong, out **C.char, outLen *C.size_t, code *C.int,
	errBuf *C.char, errCap C.size_t) C.int {
	p, err := runningServer()
	if err != nil {
		putErr(errBuf, errCap, err)
		return statusFail
	}
	b, c, msg := p.CallDirect(C.GoString(method), engineBytes(req, n), micros(max(waitMicros, 0)))
	if c != 0 && uint64(n) > server.MaxDirectMessage && c == codes.InvalidArgument {
		msg = tooLarge(n).Error()
	}
	if c != 0 {
		*code = C.int(c)
		putErr(errBuf, errCap, errors.New(msg))
		return statusStatus
	}
	*out = (*C.char)(C.CBytes(b))
	*outLen = C.size_t(len(b))
	return statusOK
}
