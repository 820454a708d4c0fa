package kvxfertest

import (
	"bytes"
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

	"github.com/kvxfer/kvxfer/internal/agentrpc"
	"github.com/kvxfer/kvxfer/internal/shm"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// ProcessHarness is a Harness whose every agent runs in a child process
// of its own (`kvxferd agent`, internal/agentrpc), so the suite checks
// two backends in two processes, neither of them the test's. An agent's
// memory is a shared-memory file mapped in its process and in the
// test's: the suite reads and writes the bytes directly, descriptors name
// the agent process's addresses. Closing an agent ends its process.
type ProcessHarness struct {
	// Command returns the command serving one agent: `kvxferd agent`
	// with its backend flags, and the environment the agent needs (for
	// NIXL: UCX_TLS). The harness appends -socket, -shm and -size.
	Command func() *exec.Cmd
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
	t.Cleanup(func() { m.Close(); os.Remove(m.Path) })
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
func (a *ProcAgent) Close() error {
	err := a.Client.Close()
	select {
	case <-a.exited:
	case <-time.After(10 * time.Second):
		a.Kill()
		if err == nil {
			err = fmt.Errorf("kvxfertest: agent %d did not exit in 10 s after Close", a.Pid())
		}
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
