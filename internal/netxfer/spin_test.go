package netxfer

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// unixPair returns the two ends of a connected stream socket pair.
func unixPair(t *testing.T) (a, b *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// A same-host connection's reader spins for what comes soon after its
// last activity (bytes and the descriptors sent with them arrive
// intact), blocks once the spin is over (and still gets what comes
// later), and ends at once on the peer's hang-up or a deadline.
func TestFDReaderSpins(t *testing.T) {
	r, w := unixPair(t)
	f := newFDReader(r, 200*time.Millisecond)
	if f.spin == 0 {
		t.Fatal("no spin")
	}
	buf := make([]byte, 64)

	// Within the spin: the bytes and a descriptor, found spinning.
	memfd, err := unix.MemfdCreate("spin-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(memfd)
	f.touch()
	go func() {
		time.Sleep(2 * time.Millisecond)
		_, _, _ = w.WriteMsgUnix([]byte("abc"), unix.UnixRights(memfd), nil)
	}()
	n, err := f.Read(buf)
	if err != nil || string(buf[:n]) != "abc" {
		t.Fatalf("read %q, %v; want abc", buf[:n], err)
	}
	if got := f.spun.Load(); got != 1 {
		t.Fatalf("%d reads found their bytes spinning, want 1", got)
	}
	fd, err := f.take()
	if err != nil {
		t.Fatalf("the descriptor sent with the bytes: %v", err)
	}
	unix.Close(fd)

	// Past the spin: the read blocks, and gets what comes later.
	f.last.Store(int64(time.Since(spinEpoch) - time.Second))
	go func() {
		time.Sleep(5 * time.Millisecond)
		_, _ = w.Write([]byte("later"))
	}()
	if n, err = f.Read(buf); err != nil || string(buf[:n]) != "later" {
		t.Fatalf("read %q, %v; want later", buf[:n], err)
	}
	if got := f.spun.Load(); got != 1 {
		t.Fatalf("a read past the spin found its bytes spinning (%d)", got)
	}

	// A deadline in the past ends a spinning read at once.
	f.touch()
	_ = r.SetReadDeadline(time.Unix(1, 0))
	start := time.Now()
	if _, err = f.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past its deadline: %v", err)
	}
	if d := time.Since(start); d > 150*time.Millisecond {
		t.Fatalf("a read past its deadline took %v", d)
	}
	_ = r.SetReadDeadline(time.Time{})

	// The peer's hang-up ends a spinning read with EOF.
	f.touch()
	go func() {
		time.Sleep(2 * time.Millisecond)
		_ = w.Close()
	}()
	if _, err = f.Read(buf); err != io.EOF {
		t.Fatalf("read after the peer hung up: %v, want EOF", err)
	}
}

// The same-host tests again, every agent spinning (SpinWait 1 ms; the
// 2-core machines CI runs on do not spin by default): transfers, READs,
// fences, hang-ups, layouts over a device.
func TestSameHostSpinning(t *testing.T) {
	testSpinWait = time.Millisecond
	t.Cleanup(func() { testSpinWait = 0 })
	spunReads.Store(0)
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"Write", TestSameHostWrite}, {"ReadUnmap", TestSameHostReadUnmap}, {"ReadFence", TestSameHostReadFence},
		{"Guard", TestSameHostGuard}, {"Fence", TestSameHostFence}, {"HungUp", TestHungUp},
		{"SenderHungUp", TestSameHostSenderHungUp}, {"Unmap", TestSameHostUnmap},
		{"PostLayoutDevice", TestPostLayoutDevice}, {"PostLayoutHost", TestPostLayoutHost},
		{"LayoutSourceOutOfBounds", TestLayoutSourceOutOfBounds},
	} {
		t.Run(tc.name, tc.f)
	}
	if spunReads.Load() == 0 {
		t.Fatal("no read of any connection found its bytes spinning")
	}
}
