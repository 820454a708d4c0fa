package nixl

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// selfProc is this process's identity, or false where /proc cannot tell
// it (then the metadata carries none and peers do not watch this one).
var selfProc = sync.OnceValues(func() (procID, bool) {
	start, err := procStart(os.Getpid())
	if err != nil {
		return procID{}, false
	}
	st, err := os.Stat("/proc/self/ns/pid")
	if err != nil {
		return procID{}, false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return procID{}, false
	}
	raw, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return procID{}, false
	}
	boot, err := hex.DecodeString(string(bytes.ReplaceAll(bytes.TrimSpace(raw), []byte("-"), nil)))
	if err != nil || len(boot) != 16 {
		return procID{}, false
	}
	id := procID{Pid: uint32(os.Getpid()), Start: start, PidNS: sys.Ino}
	copy(id.Boot[:], boot)
	// A pidfd is what watches a peer: without one (Linux before 5.3),
	// publish nothing.
	fd, err := pidfdOpen(os.Getpid())
	if err != nil {
		return procID{}, false
	}
	closeFD(fd)
	return id, true
})

// procStart returns a process's start time in clock ticks after boot
// (field 22 of /proc/<pid>/stat; the fields after the command name,
// which may hold spaces and parentheses, start at field 3).
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("kvxfer: /proc stat: no command name")
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 {
		return 0, fmt.Errorf("kvxfer: /proc/%d/stat: %d fields", pid, len(f)+2)
	}
	return strconv.ParseUint(string(f[19]), 10, 64)
}

func pidfdOpen(pid int) (int, error) { return unix.PidfdOpen(pid, 0) }

// pidfdExited reports whether the process of a pidfd has exited (its
// pidfd polls readable once the whole thread group is gone).
func pidfdExited(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(p, 0)
		if err == unix.EINTR {
			continue
		}
		// POLLIN alone says it exited (POLLNVAL, POLLERR would say
		// nothing of the process).
		return err == nil && n > 0 && p[0].Revents&unix.POLLIN != 0
	}
}

func closeFD(fd int) { _ = unix.Close(fd) }
