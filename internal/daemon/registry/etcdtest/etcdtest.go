// Package etcdtest runs a real etcd server (Debian's etcd-server package,
// the etcd binary on PATH or at $KVXFER_ETCD) for tests, on loopback
// ports of its own.
package etcdtest

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/testport"
)

// Binary returns the etcd binary's path, or why there is none.
func Binary() (string, error) {
	if p := os.Getenv("KVXFER_ETCD"); p != "" {
		return p, nil
	}
	p, err := exec.LookPath("etcd")
	if err != nil {
		return "", errors.New("no etcd binary (apt-get install etcd-server, or set KVXFER_ETCD): the registry tests need a real etcd")
	}
	return p, nil
}

// Server is a running etcd.
type Server struct {
	t          testing.TB
	bin, dir   string
	client     string // host:port
	peer       string
	cmd        *exec.Cmd
	exited     chan struct{}
	log        *os.File
	extraFlags []string
}

// Start runs an etcd whose data lives in a temporary directory, and
// returns once it serves; it is killed when the test ends. The test is
// skipped, with the reason, when there is no etcd binary. extra flags go
// to etcd as they are (TLS, for example).
func Start(t testing.TB, extra ...string) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Skip(err.Error())
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir(), extraFlags: extra}
	t.Cleanup(s.Kill)
	// A port found free may be taken by another process (the tests of
	// other packages run beside these) before etcd binds it: etcd then
	// exits at once, and starts again on new ports.
	for attempt := 1; ; attempt++ {
		s.client, s.peer = pickPort(t), pickPort(t)
		why := s.start()
		if why == "" {
			return s
		}
		if !strings.Contains(why, "address already in use") || attempt == maxStarts {
			t.Fatalf("etcd exited at start (attempt %d):\n%s", attempt, why)
		}
		_ = os.RemoveAll(filepath.Join(s.dir, "data"))
	}
}

// maxStarts bounds Start's attempts on fresh ports.
const maxStarts = 5

// Endpoint is etcd's client address (host:port).
func (s *Server) Endpoint() string { return s.client }

// Dir is etcd's data directory.
func (s *Server) Dir() string { return s.dir }

// pickPort picks the ports Start gives etcd (a variable for tests).
var pickPort = freePort

// freePort is a loopback port below the ephemeral range (testport).
func freePort(t testing.TB) string { return testport.Free(t) }

// Restart starts etcd again (after Kill) on the same ports and data.
func (s *Server) Restart() {
	s.t.Helper()
	if why := s.start(); why != "" {
		s.t.Fatalf("etcd exited at start:\n%s", why)
	}
}

// start runs etcd on s's ports and data and returns once it serves; or,
// when etcd exited at start instead, what it logged then.
func (s *Server) start() string {
	s.t.Helper()
	scheme := "http"
	for _, f := range s.extraFlags {
		if strings.HasPrefix(f, "--cert-file") {
			scheme = "https"
		}
	}
	var err error
	s.log, err = os.OpenFile(filepath.Join(s.dir, "etcd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		s.t.Fatal(err)
	}
	from, _ := s.log.Seek(0, io.SeekEnd) // this start's lines begin here
	args := []string{"--name", "kvxfer-test", "--data-dir", filepath.Join(s.dir, "data"),
		"--listen-client-urls", scheme + "://" + s.client, "--advertise-client-urls", scheme + "://" + s.client,
		"--listen-peer-urls", "http://" + s.peer, "--initial-advertise-peer-urls", "http://" + s.peer,
		"--initial-cluster", "kvxfer-test=http://" + s.peer, "--log-level", "warn"}
	s.cmd = exec.Command(s.bin, append(args, s.extraFlags...)...)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start etcd: %v", err)
	}
	s.exited = make(chan struct{})
	cmd, exited := s.cmd, s.exited
	go func() { _ = cmd.Wait(); close(exited) }()
	if scheme == "https" {
		s.waitPort()
		return ""
	}
	cl := &http.Client{Timeout: time.Second}
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		select {
		case <-exited:
			b, _ := os.ReadFile(s.log.Name())
			s.log.Close()
			s.cmd = nil
			return string(b[min(int(from), len(b)):])
		default:
		}
		resp, err := cl.Get("http://" + s.client + "/health")
		if err == nil {
			ok := resp.StatusCode == http.StatusOK
			resp.Body.Close()
			if ok {
				return ""
			}
		}
	}
	b, _ := os.ReadFile(s.log.Name())
	s.t.Fatalf("etcd did not become healthy in 15 s:\n%s", b)
	return ""
}

func (s *Server) waitPort() {
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if c, err := net.Dial("tcp", s.client); err == nil {
			c.Close()
			time.Sleep(500 * time.Millisecond) // its leader election
			return
		}
	}
	s.t.Fatal("etcd did not listen in 15 s")
}

// Kill SIGKILLs etcd and waits for it to exit (no-op when not running).
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.exited
	s.cmd = nil
	s.log.Close()
}

// Log returns etcd's log so far.
func (s *Server) Log() string {
	b, err := os.ReadFile(filepath.Join(s.dir, "etcd.log"))
	if err != nil {
		return fmt.Sprint(err)
	}
	return string(b)
}
