package netxfer

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"testing"
	"time"
)

// fakeServer serves one connection of a client agent as answer says:
// it reads the hello and the frames before the first READ request
// (same-host: the fence and the descriptor area), then hands answer the
// request's transfer and part and the connection.
func fakeServer(t *testing.T, ln net.Listener, answer func(c net.Conn, id uint64, part uint32)) {
	t.Helper()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		r := bufio.NewReader(c)
		var h [7]byte
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return
		}
		if _, err := r.Discard(int(binary.LittleEndian.Uint16(h[5:7]))); err != nil {
			return
		}
		for {
			typ, err := r.ReadByte()
			if err != nil {
				return
			}
			switch typ {
			case tFence, tDescs: // the descriptor passed with it is dropped
			case tReadReq:
				var b [16]byte
				if _, err := io.ReadFull(r, b[:]); err != nil {
					return
				}
				if _, err := r.Discard(16 * int(binary.LittleEndian.Uint32(b[12:16]))); err != nil {
					return
				}
				answer(c, binary.LittleEndian.Uint64(b[:8]), binary.LittleEndian.Uint32(b[8:12]))
				return
			default:
				t.Errorf("fake server: frame type %d", typ)
				return
			}
		}
	}()
}

// besideFakeTCP is an agent (64 KiB of Go memory at base, one TCP
// connection per peer) whose peer "fake" is the listener returned, for
// fakeServer to answer as the test likes.
func besideFakeTCP(t *testing.T) (net.Listener, *Agent, []byte, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	a, mem := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true, Conns: 1})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	return ln, a, mem, name
}

// A READ whose answer breaks off mid-payload (the connection lost) fails,
// with the reason: it does not stay in progress for ever.
func TestReadAnswerBrokenOffFails(t *testing.T) {
	ln, a, _, name := besideFakeTCP(t)
	fakeServer(t, ln, func(c net.Conn, id uint64, part uint32) {
		var b [17]byte
		b[0] = tReadResp
		binary.LittleEndian.PutUint64(b[1:], id)
		binary.LittleEndian.PutUint32(b[9:], part)
		_, _ = c.Write(b[:])
		_, _ = c.Write(make([]byte, 1000)) // of 32 KiB
		time.Sleep(20 * time.Millisecond)
	})
	id, err := a.Post(Read, name, []Desc{{Local: base, Remote: base, Len: 1 << 15}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Failed {
		t.Fatalf("READ whose connection broke mid-answer: %v, %v; want Failed", st, err)
	}
}

// A READ whose same-host answer breaks the protocol (a piece count that
// is not its part's) fails: the connection is dropped, and the transfer
// with it, not left in progress.
func TestReadLocalBadAnswerFails(t *testing.T) {
	uaddr := fmt.Sprintf("@netxfer-fake-%d", rand.Uint64())
	ln, err := net.Listen("unix", uaddr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, err := New(Config{Name: fmt.Sprintf("%s-%d", t.Name(), rand.Uint64()), DisableLocal: true, Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	mem, f := memFile(t, 1<<16)
	if err := a.MapFile(base, mem, f, 0); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([]Region{{base, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n127.0.0.1:1\nunix " + uaddr))
	if err != nil {
		t.Fatal(err)
	}
	fakeServer(t, ln, func(c net.Conn, id uint64, part uint32) {
		var b [17]byte
		b[0] = tReadLocal
		binary.LittleEndian.PutUint64(b[1:], id)
		binary.LittleEndian.PutUint32(b[9:], part)
		binary.LittleEndian.PutUint32(b[13:], 0) // no pieces, for a part of one
		_, _ = c.Write(b[:])
		time.Sleep(20 * time.Millisecond)
	})
	id, err := a.Post(Read, name, []Desc{{Local: base, Remote: base, Len: 1 << 15}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Failed {
		t.Fatalf("READ answered with a bad piece count: %v, %v; want Failed", st, err)
	}
}
