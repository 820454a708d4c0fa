package kvxfertest

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/agentrpc"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
)

// ProcessHarness is a Harness whose every agent runs in a child process
// of its own (AgentCommand, internal/agentrpc), so the suite checks
// two backends in two processes, neither of them the test's. An agent's
// memory is a shared-memory file mapped in its process and in the
// test's: the suite reads and writes the bytes directly, descriptors name
// the agent process's addresses. Closing an agent ends its process.
type ProcessHarness struct {
	// Command returns the command serving one agent: AgentCommand with
	// its backend flags, and the environment the agent needs (for NIXL:
	// UCX_TLS). The harness appends -socket, -shm and -size.
	Command func() *exec.Cmd
	// CloseHangsAfterCrash, when set, says why closing an agent whose
	// peer crashed with a transfer in flight is known not to return:
	// PeerKilled then logs such a hang (and kills the agent) instead of
	// failing.
	CloseHangsAfterCrash string
}

// New implements Harness.
func (h ProcessHarness) New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	a := h.Start(t, n)
	return a, a.Info().Region, a.Mem
}

// ProcAgent is an agent in a child process. Close closes its backend and
// waits for the process to exit (killing it if it does not in 10 s); Kill
// ends it at once with SIGKILL.
type ProcAgent struct {
	*agentrpc.Client
	// Mem is the agent's memory, mapped in the test's process.
	Mem    []byte
	cmd    *exec.Cmd
	exited chan struct{}
	out    *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// shmDir is where agents' memory files go: /dev/shm where there is one.
func shmDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

// Start starts an agent process with n bytes of memory and connects to
// it. Everything it made (process, files, connection) goes in t.Cleanup.
func (h ProcessHarness) Start(t *testing.T, n int) *ProcAgent {
	t.Helper()
	m, err := shm.Create(shmDir(), fmt.Sprintf("kvxfertest-%d-%x", os.Getpid(), rand.Uint64()), uint64(n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Remove() })
	// A short directory: a unix socket's path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "kvxa")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "a.sock")
	cmd := h.Command()
	cmd.Args = append(cmd.Args, "-socket", sock, "-shm", m.Path, "-size", strconv.Itoa(n))
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	// A race-detector build sleeps 1 s on exit unless told not to; the
	// command's own GORACE (later in the list) wins.
	cmd.Env = append([]string{"GORACE=atexit_sleep_ms=0"}, cmd.Env...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	dieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a := &ProcAgent{Mem: m.Bytes, cmd: cmd, exited: make(chan struct{}), out: out}
	go func() { _ = cmd.Wait(); close(a.exited) }()
	t.Cleanup(func() {
		a.Kill() // after Close (cleanups run last first): only a process that did not exit
		if t.Failed() || os.Getenv("KVXFERTEST_AGENT_LOG") != "" {
			t.Logf("agent %d (%s): %v; output:\n%s", cmd.Process.Pid, cmd.Path, cmd.ProcessState, out)
		}
	})
	var conn net.Conn
	for deadline := time.Now().Add(30 * time.Second); ; {
		if conn, err = net.Dial("unix", sock); err == nil {
			break
		}
		select {
		case <-a.exited:
			t.Fatalf("agent process exited before serving: %v\n%s", cmd.ProcessState, out)
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent process not serving after 30 s: %v\n%s", err, out)
		}
	}
	c, err := agentrpc.NewClient(conn)
	if err != nil {
		conn.Close()
		t.Fatalf("agent: %v\n%s", err, out)
	}
	a.Client = c
	t.Cleanup(func() { _ = a.Close() })
	return a
}

// Pid returns the agent process's id.
func (a *ProcAgent) Pid() int { return a.cmd.Process.Pid }

// Exited is closed once the agent's process has exited.
func (a *ProcAgent) Exited() <-chan struct{} { return a.exited }

// Output returns what the agent process printed so far.
func (a *ProcAgent) Output() string { return a.out.String() }

// Close implements kvxfer.Backend: the agent closes its backend, and its
// process exits.
func (a *ProcAgent) Close() error { return a.CloseWithin(10 * time.Second) }

// ErrCloseHung is CloseWithin's error for an agent that did not close.
var ErrCloseHung = errors.New("kvxfertest: agent did not close in time")

// CloseWithin is Close, except that an agent whose backend's Close has
// not returned, or whose process has not exited, after d is killed, and
// the error is ErrCloseHung.
func (a *ProcAgent) CloseWithin(d time.Duration) error {
	deadline := time.Now().Add(d)
	closed := make(chan error, 1)
	go func() { closed <- a.Client.Close() }()
	var err error
	select {
	case err = <-closed:
	case <-time.After(time.Until(deadline)):
		a.Kill() // the connection breaks: Client.Close returns
		<-closed
		return fmt.Errorf("%w: agent %d: its backend's Close had not returned after %v", ErrCloseHung, a.Pid(), d)
	}
	select {
	case <-a.exited:
	case <-time.After(time.Until(deadline)):
		a.Kill()
		return fmt.Errorf("%w: agent %d had not exited %v after Close", ErrCloseHung, a.Pid(), d)
	}
	return err
}

// Kill ends the agent's process with SIGKILL (a crash: no goodbye to its
// peers) and waits for it to exit.
func (a *ProcAgent) Kill() {
	select {
	case <-a.exited:
		return
	default:
	}
	_ = a.cmd.Process.Kill()
	<-a.exited
}

var _ kvxfer.Backend = (*ProcAgent)(nil)

// PeerKilled checks a backend against a peer whose process dies without
// a goodbye (SIGKILL), which the suite's PeerLoss (a Close) does not
// cover: a transfer in flight at the crash ends (done or failed) instead
// of hanging; afterwards a notification to the peer fails within 10 s of
// retries, and a WRITE and a READ are refused or fail, each within 30 s.
func PeerKilled(t *testing.T, h ProcessHarness) {
	const size = 16 << 20
	a, b := h.Start(t, size), h.Start(t, size)
	for _, x := range []*ProcAgent{a, b} {
		if err := x.Register([]kvxfer.MemRegion{x.Info().Region}); err != nil {
			t.Fatalf("Register: %v", err)
		}
	}
	peer := load(t, a, b)
	load(t, b, a)
	ar, br := a.Info().Region, b.Info().Region
	pattern(a.Mem, 11)
	id, err := a.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: ar.Addr, Remote: br.Addr, Len: 4096}}, []byte("first"))
	if err != nil {
		t.Fatalf("first WRITE: %v", err)
	}
	if s, err := waitXfer(t, a, id); s != kvxfer.XferDone {
		t.Fatalf("first WRITE = %v, %v; want done", s, err)
	}
	// A transfer in flight when the peer dies.
	var descs []hotpath.Desc
	for off := uint64(0); off < size; off += 1 << 20 {
		descs = append(descs, hotpath.Desc{Local: ar.Addr + off, Remote: br.Addr + off, Len: 1 << 20})
	}
	id, err = a.Post(hotpath.OpWrite, peer, descs, []byte("in flight"))
	b.Kill()
	if err == nil {
		s, err := waitXfer(t, a, id)
		t.Logf("WRITE in flight at the crash: %v, %v", s, err)
		if s == kvxfer.XferInProgress {
			t.Error("a WRITE in flight when the peer was killed is still in progress after 30 s")
		}
	}
	var nerr error
	for deadline := time.Now().Add(10 * time.Second); nerr == nil && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		nerr = a.Notify(peer, []byte("anyone?"))
	}
	if nerr == nil {
		t.Error("Notify to a killed peer still succeeds after 10 s")
	} else {
		t.Logf("Notify: %v", nerr)
	}
	for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
		id, err := a.Post(op, peer, []hotpath.Desc{{Local: ar.Addr, Remote: br.Addr, Len: 4096}}, []byte("x"))
		if err != nil {
			t.Logf("%v refused: %v", op, err)
			continue
		}
		s, err := waitXfer(t, a, id)
		t.Logf("%v: %v, %v", op, s, err)
		if s != kvxfer.XferFailed || err == nil {
			t.Errorf("%v to a killed peer = %v, %v; want failed with a reason", op, s, err)
		}
	}
	// The survivor closes (the transfer in flight at the crash was never
	// released: Close releases everything). A close takes milliseconds;
	// a known hang is not waited for long.
	wait := 5 * time.Second
	if h.CloseHangsAfterCrash != "" {
		wait = 2 * time.Second
	}
	if err := a.CloseWithin(wait); errors.Is(err, ErrCloseHung) && h.CloseHangsAfterCrash != "" {
		t.Logf("known: %v (%s)", err, h.CloseHangsAfterCrash)
	} else if err != nil {
		t.Errorf("closing the surviving agent: %v", err)
	}
}
