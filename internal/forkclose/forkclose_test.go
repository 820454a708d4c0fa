package forkclose

import (
	"net"
	"syscall"
	"testing"
)

// Listener hands the hook a listening socket's fd and inode, and nothing
// without a hook.
func TestListenerRecorded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	Listener(ln) // no hook: nothing
	var got []int
	var inos []uint64
	SetHook(func(fd int, ino uint64) { got, inos = append(got, fd), append(inos, ino) })
	defer SetHook(nil)
	Listener(ln)
	Listener(struct{}{}) // not a socket: passed over
	if len(got) != 1 {
		t.Fatalf("hook called %d times, want once", len(got))
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(got[0], &st); err != nil || st.Ino != inos[0] || st.Mode&syscall.S_IFMT != syscall.S_IFSOCK {
		t.Fatalf("fd %d: inode %d (%v), mode %o; want the listener's socket, inode %d", got[0], st.Ino, err, st.Mode, inos[0])
	}
}
