package main

import (
	"fmt"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A length past what the library takes (server.MaxDirectMessage), however
// large, is refused with an error naming it, and counted (bad_message);
// the engine's process goes on. On the old code the library made a Go
// slice of the engine's length before the server's check: a length past
// what a slice holds (a size_t that wrapped, say) panicked in unsafe.Slice
// and took the engine's whole process down.
func TestHugeLengthRefused(t *testing.T) {
	if _, code, err := start(`{"insecure_peers": true, "log_level": "error"}`); err != nil {
		t.Fatalf("start: %d %v", code, err)
	}
	t.Cleanup(func() { _ = stop() })
	p, err := runningServer()
	if err != nil {
		t.Fatal(err)
	}
	id := kvxferGoStreamOpen(nil, 0)
	if id == 0 {
		t.Fatal("no stream")
	}
	defer kvxferGoStreamRelease(id)
	// The engine's memory, outside Go's heap as an engine's is.
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	msg := (*_Ctype_char)(unsafe.Pointer(&buf[0]))
	errBuf := make([]byte, 512)
	errOf := func() string {
		s := string(errBuf)
		return s[:strings.IndexByte(s, 0)]
	}
	for _, n := range []uint64{1 << 50, 1<<63 + 5, ^uint64(0)} {
		before := p.Refusals()["bad_message"]
		clear(errBuf)
		if st := kvxferGoStreamPut(id, msg, _Ctype_size_t(n), (*_Ctype_char)(unsafe.Pointer(&errBuf[0])), _Ctype_size_t(len(errBuf))); st != statusFail ||
			!strings.Contains(errOf(), fmt.Sprint(n)) {
			t.Errorf("put of %d bytes: status %d (%q), want statusFail naming the length", n, st, errOf())
		}
		clear(errBuf)
		var out *_Ctype_char
		var outLen _Ctype_size_t
		var code _Ctype_int
		if st := kvxferGoCall((*_Ctype_char)(unsafe.Pointer(&[]byte("Step\x00")[0])), msg, _Ctype_size_t(n), 0, &out, &outLen, &code,
			(*_Ctype_char)(unsafe.Pointer(&errBuf[0])), _Ctype_size_t(len(errBuf))); st != statusStatus || !strings.Contains(errOf(), fmt.Sprint(n)) {
			t.Errorf("call of %d bytes: status %d (%q), want statusStatus naming the length", n, st, errOf())
		}
		if got := p.Refusals()["bad_message"]; got != before+2 {
			t.Errorf("%d bytes: bad_message refusals %d, want %d", n, got, before+2)
		}
	}
}
