// Package etcdtest runs a real etcd server (Debian's etcd-server package,
// the etcd binary on PATH or at $KVXFER_ETCD) for tests, on loopback
// ports of its own.
package etcdtest

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
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
	s := &Server{t: t, bin: bin, dir: t.TempDir(), client: freePort(t), peer: freePort(t), extraFlags: extra}
	s.Restart()
	t.Cleanup(s.Kill)
	return s
}

// Endpoint is etcd's client address (host:port).
func (s *Server) Endpoint() string { return s.client }

// Dir is etcd's data directory.
func (s *Server) Dir() string { return s.dir }

func freePort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Restart starts etcd again (after Kill) on the same ports and data.
func (s *Server) Restart() {
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
		return
	}
	cl := &http.Client{Timeout: time.Second}
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		select {
		case <-exited:
			b, _ := os.ReadFile(s.log.Name())
			s.t.Fatalf("etcd exited at start:\n%s", b)
		default:
		}
		resp, err := cl.Get("http://" + s.client + "/health")
		if err == nil {
			ok := resp.StatusCode == http.StatusOK
			resp.Body.Close()
			if ok {
				return
			}
		}
	}
	b, _ := os.ReadFile(s.log.Name())
	s.t.Fatalf("etcd did not become healthy in 15 s:\n%s", b)
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
