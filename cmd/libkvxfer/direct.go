package main

/*
#include <stdlib.h>
#include <stddef.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

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

var directs struct {
	sync.Mutex
	next int64
	m    map[int64]*server.DirectStream
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
	running.Lock()
	p := running.p
	running.Unlock()
	if p == nil {
		putErr(errBuf, errCap, errors.New("kvxfer: no in-process server runs (kvxfer_start it first)"))
		return 0
	}
	d := p.OpenDirect()
	directs.Lock()
	defer directs.Unlock()
	if directs.m == nil {
		directs.m = map[int64]*server.DirectStream{}
	}
	directs.next++
	directs.m[directs.next] = d
	return C.longlong(directs.next)
}

//export kvxferGoStreamPut
func kvxferGoStreamPut(id C.longlong, msg *C.char, n C.size_t, errBuf *C.char, errCap C.size_t) C.int {
	d, err := directOf(id)
	if err == nil {
		if uint64(n) > server.MaxDirectMessage {
			err = fmt.Errorf("kvxfer: a message of %d bytes (at most %d)", uint64(n), server.MaxDirectMessage)
		} else {
			err = d.Put(C.GoBytes(unsafe.Pointer(msg), C.int(n)))
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

//export kvxferGoStreamTake
func kvxferGoStreamTake(id C.longlong, waitMicros C.longlong, out **C.char, outLen *C.size_t, code *C.int,
	errBuf *C.char, errCap C.size_t) C.int {
	d, err := directOf(id)
	if err != nil {
		putErr(errBuf, errCap, err)
		return statusFail
	}
	wait := time.Duration(waitMicros) * time.Microsecond
	if waitMicros < 0 {
		wait = -1
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
	running.Lock()
	p := running.p
	running.Unlock()
	if p == nil {
		putErr(errBuf, errCap, errors.New("kvxfer: no in-process server runs (kvxfer_start it first)"))
		return statusFail
	}
	if uint64(n) > server.MaxDirectMessage {
		putErr(errBuf, errCap, fmt.Errorf("kvxfer: a request of %d bytes (at most %d)", uint64(n), server.MaxDirectMessage))
		return statusFail
	}
	b, c, msg := p.CallDirect(C.GoString(method), C.GoBytes(unsafe.Pointer(req), C.int(n)), time.Duration(max(waitMicros, 0))*time.Microsecond)
	if c != 0 {
		*code = C.int(c)
		putErr(errBuf, errCap, errors.New(msg))
		return statusStatus
	}
	*out = (*C.char)(C.CBytes(b))
	*outLen = C.size_t(len(b))
	return statusOK
}
