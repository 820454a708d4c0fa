//go:build linux

package nixl

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

func TestMetaEnvelope(t *testing.T) {
	id := procID{Pid: 1234, Start: 987654321, PidNS: 4026531836, Boot: [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}}
	blob := []byte("nixl's own metadata")
	got, ok, raw := unwrapMeta(wrapMeta(id, blob))
	if !ok || got != id || !bytes.Equal(raw, blob) {
		t.Errorf("round trip = %+v, %v, %q", got, ok, raw)
	}
	for _, m := range [][]byte{nil, []byte("not ours"), []byte(metaMagic)} {
		if _, ok, raw := unwrapMeta(m); ok || !bytes.Equal(raw, m) {
			t.Errorf("unwrapMeta(%q) = %v, %q; want NIXL's blob as it is", m, ok, raw)
		}
	}
}

func TestSelfProc(t *testing.T) {
	self, ok := selfProc()
	if !ok {
		t.Skip("no /proc or no pidfds here")
	}
	if self.Pid != uint32(os.Getpid()) || self.Start == 0 || self.PidNS == 0 || self.Boot == ([16]byte{}) {
		t.Errorf("selfProc = %+v", self)
	}
}

// A peer process is watched through a pidfd: alive until it exits; a
// reused pid, a pid that is gone, or a process from another namespace or
// host is never mistaken for the peer.
func TestWatchPeerProcess(t *testing.T) {
	self, ok := selfProc()
	if !ok {
		t.Skip("no /proc or no pidfds here")
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep(1)")
	}
	cmd := exec.Command(sleep, "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	pid := cmd.Process.Pid
	start, err := procStart(pid)
	if err != nil {
		t.Fatal(err)
	}
	peer := self
	peer.Pid, peer.Start = uint32(pid), start

	w := watchPeer("p", peer)
	if w == nil || w.gone() {
		t.Fatalf("watch of a live peer = %+v", w)
	}
	defer w.close()
	reused := peer
	reused.Start++ // the pid now names another process
	if r := watchPeer("p", reused); r == nil || !r.gone() || r.fd != -1 {
		t.Errorf("watch of a reused pid = %+v, want gone with no pidfd", r)
	}
	for _, other := range []procID{
		{Pid: peer.Pid, Start: start, PidNS: self.PidNS + 1, Boot: self.Boot},
		{Pid: peer.Pid, Start: start, PidNS: self.PidNS, Boot: [16]byte{1}},
	} {
		if r := watchPeer("p", other); r != nil {
			t.Errorf("watch of a process in another namespace or boot = %+v, want none", r)
		}
	}

	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for !w.gone() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if !w.gone() {
		t.Fatal("a killed peer process is not gone")
	}
	if err := w.err(); err == nil || !bytes.Contains([]byte(err.Error()), []byte("exited")) {
		t.Errorf("err = %v", err)
	}
	if r := watchPeer("p", peer); r == nil || !r.gone() {
		t.Errorf("watch of an exited peer = %+v, want gone", r)
	}
}

// Only the peer's absence proves it gone: a pidfd refused for another
// reason than ESRCH (out of descriptors), or a start time /proc does not
// show (hidepid) while the pidfd's process lives, leaves the peer
// unwatched, not dead. A dead verdict fences what a consumer waits on
// (kvxfer.ErrPeerExited): before, either made a live peer dead.
func TestWatchPeerUnknownIsNotGone(t *testing.T) {
	self, ok := selfProc()
	if !ok {
		t.Skip("no /proc or no pidfds here")
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep(1)")
	}
	cmd := exec.Command(sleep, "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	start, err := procStart(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	peer := self
	peer.Pid, peer.Start = uint32(cmd.Process.Pid), start
	t.Cleanup(func() { openPidfd, readStart = pidfdOpen, procStart })

	openPidfd = func(int) (int, error) { return -1, syscall.EMFILE }
	if w := watchPeer("p", peer); w != nil {
		t.Errorf("watch without a pidfd (EMFILE) = %+v, want none", w)
	}
	openPidfd = pidfdOpen
	readStart = func(int) (uint64, error) { return 0, os.ErrNotExist }
	if w := watchPeer("p", peer); w != nil {
		t.Errorf("watch of a live peer whose start time /proc hides = %+v, want none", w)
	}
	openPidfd = func(int) (int, error) { return -1, syscall.ESRCH }
	if w := watchPeer("p", peer); w == nil || !w.gone() || !errors.Is(w.err(), kvxfer.ErrPeerExited) {
		t.Errorf("watch of a pid nothing has (ESRCH) = %+v, want gone (ErrPeerExited)", w)
	}
	openPidfd = pidfdOpen
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if w := watchPeer("p", peer); w == nil || !w.gone() {
		t.Errorf("watch of an exited peer whose start time /proc hides = %+v, want gone", w)
	}
}

// A peer agent of this very process is alive while it is open.
func TestWatchPeerLocal(t *testing.T) {
	self, ok := selfProc()
	if !ok {
		t.Skip("no /proc or no pidfds here")
	}
	nixlOpened("local-agent")
	w := watchPeer("local-agent", self)
	if w == nil || !w.local || w.gone() {
		t.Fatalf("watch of an open local agent = %+v", w)
	}
	nixlClosed("local-agent")
	if !w.gone() {
		t.Error("a closed local agent is not gone")
	}
	earlier := self
	earlier.Start--
	if r := watchPeer("local-agent", earlier); r == nil || !r.gone() {
		t.Errorf("watch of an earlier process with our pid = %+v, want gone", r)
	}
}

// Metadata damaged on its way (any one byte changed) is refused before
// NIXL reads it. Before, NIXL and UCX parsed it as it came: some damage
// was loaded as a peer, and some killed the process (UCX: "Assertion
// `*addr_version == UCP_OBJECT_VERSION_V2' failed", SIGABRT in
// kx_load_md). Metadata without the check (from a peer built before it)
// still loads; NIXL ignores the check's bytes behind its blob, so a peer
// built before it loads ours.
func TestDamagedMetadataRefused(t *testing.T) {
	a, b := newCloseEnd(t, 1<<16), newCloseEnd(t, 1<<16)
	meta, err := b.b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	// (A change in the check's marker, its last bytes, leaves metadata
	// taken for a peer's without the check: intact, it loads.)
	for i := range len(meta) - len(sealMagic) {
		m := bytes.Clone(meta)
		m[i] ^= 0x5a
		if name, err := a.b.LoadPeer(m); err == nil {
			t.Fatalf("metadata with byte %d of %d changed was loaded as peer %q", i, len(meta), name)
		} else if !errors.Is(err, kvxfer.ErrBadMetadata) {
			t.Fatalf("metadata with byte %d changed: %v, want ErrBadMetadata", i, err)
		}
	}
	body, err := unsealMeta(meta)
	if err != nil || len(body) != len(meta)-sealLen {
		t.Fatalf("LocalMetadata carries no check (%v)", err)
	}
	for _, m := range [][]byte{meta, body} {
		name, err := a.b.LoadPeer(m)
		if err != nil || name != b.b.Name() {
			t.Fatalf("LoadPeer = %q, %v", name, err)
		}
		if err := a.b.InvalidatePeer(name); err != nil {
			t.Fatal(err)
		}
	}
	// What a peer built before the check does: hand NIXL all of it.
	if _, _, raw := unwrapMeta(meta); true { // NIXL's blob and the check
		if _, err := b.b.a.LoadPeer(raw); err == nil {
			t.Fatal("b loaded its own metadata")
		}
		if name, err := a.b.a.LoadPeer(raw); err != nil || name != string(b.b.Name()) {
			t.Fatalf("NIXL given the metadata with its check: %q, %v", name, err)
		}
	}
}
