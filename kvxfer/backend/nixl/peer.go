package nixl

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"sync"
	"syscall"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Peer liveness for the NIXL backend.
//
// UCX's shared-memory transports have no peer-failure handling (they need
// ucx_error_handling_mode=none), so UCX cannot tell a NIXL agent that a
// peer on the same host died: measured with the nixl-cu12 1.5.1 wheel
// (UCX 1.23) and a peer killed with SIGKILL, a WRITE or READ that UCX
// carries over its shared-memory FIFOs (UCX_TLS=posix or sysv) stays in
// progress forever, and a notification to the dead peer is reported sent.
// Only CMA notices (process_vm_writev fails with ESRCH), and CMA addresses
// the peer by pid alone: after the pid is reused, a WRITE would land in an
// unrelated process.
//
// So a NIXL agent's metadata carries its process's identity (pid, start
// time, pid namespace, boot id) ahead of NIXL's own blob. A peer that
// loads it on the same host and in the same pid namespace holds a pidfd
// of that exact process (the start time is checked after opening it, so a
// reused pid is never mistaken for the peer) and asks it before every
// post and notification, and while a transfer to the peer is in progress:
// once the process has exited, posts and notifications to the peer fail,
// and transfers in progress to it fail instead of hanging. An agent in
// this very process is alive while it is open. Peers on other hosts, or in
// another pid namespace, are left to UCX (over TCP or RDMA, UCX's default
// error handling reports their loss). A peer whose agent was closed while
// its process lives on is not detected this way; NIXL itself marks such a
// peer disconnected when the closing agent says goodbye.

// procID identifies a process: its pid means something to a peer only on
// the same host (Boot) and in the same pid namespace (PidNS); Start
// tells the process from a later one with the same pid.
type procID struct {
	Pid   uint32
	Start uint64 // clock ticks after boot (/proc/<pid>/stat, field 22)
	PidNS uint64 // inode of /proc/self/ns/pid
	Boot  [16]byte
}

// metaMagic starts a Backend's metadata: procID, then NIXL's blob.
const metaMagic = "kvxnixl\x01"

const metaHeader = len(metaMagic) + 4 + 8 + 8 + 16

func wrapMeta(id procID, nixlMeta []byte) []byte {
	b := make([]byte, 0, metaHeader+len(nixlMeta))
	b = append(b, metaMagic...)
	b = binary.LittleEndian.AppendUint32(b, id.Pid)
	b = binary.LittleEndian.AppendUint64(b, id.Start)
	b = binary.LittleEndian.AppendUint64(b, id.PidNS)
	b = append(b, id.Boot[:]...)
	return append(b, nixlMeta...)
}

// unwrapMeta splits metadata into the process identity, when there is
// one, and NIXL's blob (metadata without our header is NIXL's as it is).
func unwrapMeta(meta []byte) (procID, bool, []byte) {
	if len(meta) < metaHeader || string(meta[:len(metaMagic)]) != metaMagic {
		return procID{}, false, meta
	}
	b := meta[len(metaMagic):]
	id := procID{Pid: binary.LittleEndian.Uint32(b), Start: binary.LittleEndian.Uint64(b[4:]), PidNS: binary.LittleEndian.Uint64(b[12:])}
	copy(id.Boot[:], b[20:36])
	return id, true, meta[metaHeader:]
}

// A Backend's metadata ends with a check of everything before it: the
// CRC-32C of those bytes (little-endian), then sealMagic. NIXL and UCX
// trust the metadata they parse (a changed byte of UCX's address killed
// the process: an assertion, SIGABRT), so damaged metadata is refused
// before NIXL sees it. NIXL ignores bytes behind its blob, so a peer built
// before the check loads sealed metadata as it is, and metadata without
// the check (from such a peer) is loaded unchecked.
const sealMagic = "kvxcrc\x00\x01"

const sealLen = 4 + len(sealMagic)

var sealTable = crc32.MakeTable(crc32.Castagnoli)

// sealMeta appends the check to m.
func sealMeta(m []byte) []byte {
	m = binary.LittleEndian.AppendUint32(m, crc32.Checksum(m, sealTable))
	return append(m, sealMagic...)
}

// unsealMeta returns m without its check, or m as it is where it has
// none; an error where the check fails.
func unsealMeta(m []byte) ([]byte, error) {
	if len(m) < sealLen || string(m[len(m)-len(sealMagic):]) != sealMagic {
		return m, nil
	}
	body := m[:len(m)-sealLen]
	if got, want := crc32.Checksum(body, sealTable), binary.LittleEndian.Uint32(m[len(body):]); got != want {
		return nil, fmt.Errorf("%w: %d bytes whose CRC-32C is %#08x, not the %#08x they carry: damaged on the way", kvxfer.ErrBadMetadata, len(m), got, want)
	}
	return body, nil
}

// openNixl counts the open NixlBackends of this process by agent name:
// a peer agent in this process is alive while it is open.
var openNixl struct {
	sync.Mutex
	names map[string]int
}

func nixlOpened(name string) {
	openNixl.Lock()
	defer openNixl.Unlock()
	if openNixl.names == nil {
		openNixl.names = map[string]int{}
	}
	openNixl.names[name]++
}

func nixlClosed(name string) {
	openNixl.Lock()
	defer openNixl.Unlock()
	if openNixl.names[name]--; openNixl.names[name] <= 0 {
		delete(openNixl.names, name)
	}
}

func nixlIsOpen(name string) bool {
	openNixl.Lock()
	defer openNixl.Unlock()
	return openNixl.names[name] > 0
}

// peerLife watches one peer's process.
type peerLife struct {
	name  kvxfer.PeerName
	pid   uint32
	local bool // the peer is an agent of this process
	fd    int  // pidfd of the peer's process; -1 without one
	dead  bool
}

// watchPeer returns a watch of the peer named name, whose process is id,
// or nil when id is not a process this one can watch (another host or
// pid namespace, or no pidfd here).
func watchPeer(name kvxfer.PeerName, id procID) *peerLife {
	self, ok := selfProc()
	if !ok || id.Boot != self.Boot || id.PidNS != self.PidNS || id.Pid == 0 {
		return nil
	}
	p := &peerLife{name: name, pid: id.Pid, fd: -1}
	if id.Pid == self.Pid {
		if id.Start != self.Start {
			p.dead = true // an earlier process with our pid
		}
		p.local = true
		return p
	}
	fd, err := openPidfd(int(id.Pid))
	if errors.Is(err, syscall.ESRCH) {
		p.dead = true // no such process any more
		return p
	}
	if err != nil {
		// No pidfd for another reason (out of descriptors, refused): that
		// says nothing of the peer, whose exit fences what a consumer
		// waits on (kvxfer.ErrPeerExited); it is left to UCX.
		return nil
	}
	p.fd = fd
	// The pidfd names whatever process had the pid when it was opened:
	// the peer, when its start time is the one it published (the peer
	// existed before this call, so no later process can have had the pid
	// first); otherwise the peer is gone. Where the start time cannot be
	// read (/proc hides other users' processes: hidepid), the pidfd's
	// process having exited still proves the peer gone (it was the peer,
	// or one that took its pid after it); otherwise nothing is known.
	start, err := readStart(int(id.Pid))
	switch {
	case err == nil && start == id.Start:
	case err == nil || pidfdExited(fd):
		p.dead = true
		p.close()
	default:
		p.close()
		return nil
	}
	return p
}

// openPidfd and readStart are pidfdOpen and procStart (tests replace
// them).
var openPidfd, readStart = pidfdOpen, procStart

// gone reports whether the peer's process has exited (or, for an agent
// of this process, whether it was closed).
func (p *peerLife) gone() bool {
	switch {
	case p == nil:
		return false
	case p.dead:
	case p.local:
		p.dead = !nixlIsOpen(string(p.name))
	case p.fd >= 0:
		p.dead = pidfdExited(p.fd)
	}
	return p.dead
}

func (p *peerLife) err() error {
	if p.local {
		return fmt.Errorf("%w: %w: peer %s: the agent (in this process) was closed", kvxfer.ErrXferFailed, kvxfer.ErrPeerLost, p.name)
	}
	return fmt.Errorf("%w: %w: %w: peer %s: its process %d exited", kvxfer.ErrXferFailed, kvxfer.ErrPeerLost, kvxfer.ErrPeerExited, p.name, p.pid)
}

func (p *peerLife) close() {
	if p != nil && p.fd >= 0 {
		closeFD(p.fd)
		p.fd = -1
	}
}
