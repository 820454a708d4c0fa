package netxfer

import (
	"bytes"
	"net"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fuzzTarget is one agent serving every input of a fuzzing process: a
// 16 KiB mapping of which only the middle 4 KiB is registered.
var fuzzTarget struct {
	once sync.Once
	a    *Agent
	mem  []byte
	err  error
}

const (
	fuzzBase = 0x2000_0000
	fuzzReg  = fuzzBase + 4096
)

// FuzzFrames feeds arbitrary frames to an agent after a valid opening, on
// a TCP connection or a same-host one (whose opening also passes a fence
// and a memory file): the agent never panics, never writes outside its
// registered memory, and answers or hangs up within the frame timeout.
func FuzzFrames(f *testing.F) {
	// Seeds: a WRITE of 8 bytes into the region, a READ of them, a
	// notification, and the same-host frames naming the passed file.
	le := func(b []byte, vs ...uint64) []byte {
		for _, v := range vs {
			for i := 0; i < 8; i++ {
				b = append(b, byte(v>>(8*i)))
			}
		}
		return b
	}
	u32 := func(b []byte, vs ...uint32) []byte {
		for _, v := range vs {
			b = append(b, byte(v), byte(v>>8), byte(v>>16), byte(v>>24))
		}
		return b
	}
	write := u32(le([]byte{tWrite}, 1), 0, 1, 1, 0)
	write = append(le(write, fuzzReg, 8), "ABCDEFGH"...)
	read := le(u32(le([]byte{tReadReq}, 2), 0, 1), fuzzReg, 8)
	local := le(u32(u32(le([]byte{tWriteLocal}, 3), 0, 1, 1, 0)), fuzzReg, 8)
	local = le(u32(local, 1), 0)
	for _, seed := range [][]byte{write, read, u32([]byte{tNotif}, 2), local} {
		f.Add(false, seed)
		f.Add(true, seed)
	}
	// Layout parts (same-host only: refused on TCP) into the region.
	lay := layoutTable([]wireBase{{fuzzReg, localRef{1, 0}}}, []DevEntry{{0, 0, 8}, {16, 8, 8}})
	layWrite := append(u32(u32(le([]byte{tWriteLayout}, 4), 0, 1, uint32(len(lay)), 0)), lay...)
	layRead := append(u32(le([]byte{tReadLayout}, 5), 0, uint32(len(lay)), 0), lay...)
	for _, seed := range [][]byte{layWrite, layRead} {
		f.Add(false, seed)
		f.Add(true, seed)
	}
	f.Add(true, le(u32([]byte{tChunk}, 9), 0, 4096))
	f.Add(true, []byte{tChunkDev})
	// Gate frames (a peer's gate: its area, its memory, a gate of one
	// span, its shut).
	area := append(u32([]byte{tGateArea}, 1), make([]byte, 80)...)
	gchunk := append(le(u32([]byte{tGateChunk}, 1), fuzzReg, 4096), make([]byte, 80)...)
	gopen := le(u32(append(u32([]byte{tGateOpen}, 1, 0, 1, 1), 'k'), 1, 1, 1), fuzzReg)
	gopen = le(u32(gopen, 1), 0, 8)
	gshut := u32([]byte{tGateShut}, 1, 0, 1)
	f.Add(true, append(append(append(area, gchunk...), gopen...), gshut...))
	f.Add(true, u32([]byte{tGateOpen}, 1, 0, 1, 0, 1<<20))
	// A reader that acknowledges: its READ, its acknowledgement, one of
	// a part never answered.
	f.Add(true, append(append(append([]byte{tReadAcks}, read...), u32(le([]byte{tReadCopied}, 2), 0)...), u32(le([]byte{tReadCopied}, 7), 3)...))
	f.Add(true, append(append([]byte{tReadAcks}, layRead...), u32(le([]byte{tReadCopied}, 5), 0)...))
	f.Fuzz(func(t *testing.T, sameHost bool, frames []byte) {
		fuzzTarget.once.Do(func() {
			a, err := New(Config{Name: "fuzz-target", DisableLocal: true, FrameTimeout: 2 * time.Second})
			if err != nil {
				fuzzTarget.err = err
				return
			}
			mem := make([]byte, 16384)
			if err := a.Map(fuzzBase, mem); err != nil {
				fuzzTarget.err = err
				return
			}
			fuzzTarget.err = a.Register([]Region{{fuzzReg, 4096}})
			fuzzTarget.a, fuzzTarget.mem = a, mem
		})
		if fuzzTarget.err != nil {
			t.Fatal(fuzzTarget.err)
		}
		a := fuzzTarget.a
		var nc net.Conn
		var err error
		if sameHost {
			nc, err = net.Dial("unix", a.uaddr)
		} else {
			nc, err = net.Dial("tcp", a.Addr())
		}
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		if _, err := nc.Write(helloFrame("fuzzer")); err != nil {
			t.Fatal(err)
		}
		if sameHost {
			uc := nc.(*net.UnixConn)
			fd, page, err := newFence()
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Munmap(page)
			_, _, err = uc.WriteMsgUnix([]byte{tFence}, unix.UnixRights(fd), nil)
			unix.Close(fd)
			if err != nil {
				t.Fatal(err)
			}
			mfd, err := unix.MemfdCreate("fuzz-chunk", unix.MFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			_ = unix.Ftruncate(mfd, 4096)
			chunk := []byte{tChunk, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0}
			_, _, err = uc.WriteMsgUnix(chunk, unix.UnixRights(mfd), nil)
			unix.Close(mfd)
			if err != nil {
				t.Fatal(err)
			}
		}
		_, _ = nc.Write(frames)
		if cw, ok := nc.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		// The agent answers what it can and hangs up once the input ends
		// (EOF between frames, or mid-frame after the frame timeout).
		_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		var sink [4096]byte
		for {
			if _, err := nc.Read(sink[:]); err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Fatal("the agent kept a connection whose input ended for 10 s")
				}
				break
			}
		}
		a.memMu.RLock()
		outside := !bytes.Equal(fuzzTarget.mem[:4096], make([]byte, 4096)) || !bytes.Equal(fuzzTarget.mem[8192:], make([]byte, 8192))
		a.memMu.RUnlock()
		if outside {
			t.Fatal("bytes landed outside the registered region")
		}
	})
}
