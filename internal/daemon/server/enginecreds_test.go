package server_test

import (
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
)

// The engine credentials record the peer's groups (its primary group and
// the supplementary ones, SO_PEERGROUPS): kvxferd maps an engine's file
// only through directories those groups may search.
func TestEngineCredentialsRecordGroups(t *testing.T) {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	_, ai, err := server.EngineCredentials().ServerHandshake(sc)
	if err != nil {
		t.Fatal(err)
	}
	got := ai.(server.EngineAuthInfo)
	gs, err := os.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	want := []uint32{uint32(os.Getegid())}
	for _, g := range gs {
		want = append(want, uint32(g))
	}
	if got.GID != uint32(os.Getegid()) || len(got.Groups) == 0 || got.Groups[0] != got.GID {
		t.Fatalf("auth info %+v: want gid %d first in Groups", got, os.Getegid())
	}
	for _, g := range want {
		if !slices.Contains(got.Groups, g) {
			t.Errorf("Groups = %v, want %v (gid and supplementary groups)", got.Groups, want)
		}
	}
}

// An engine of another user with supplementary groups (setpriv, as root):
// the credentials have them all.
func TestEngineCredentialsRecordSupplementaryGroups(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running an engine as another user with other groups needs root (setpriv); CI runs as root")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed to run as another user: %v", err)
	}
	dir, err := os.MkdirTemp("", "kvxfer-creds-") // every user may reach it
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", filepath.Join(dir, "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if err := os.Chmod(ln.Addr().String(), 0o666); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(setpriv, "--reuid=65534", "--regid=65534", "--groups=4242,4243", os.Args[0], "-test.run=^TestEngineCredentialsChild$")
	cmd.Env = append(os.Environ(), "KVXFER_CREDS_SOCK="+ln.Addr().String())
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	_ = ln.(*net.UnixListener).SetDeadline(time.Now().Add(20 * time.Second))
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	_, ai, err := server.EngineCredentials().ServerHandshake(sc)
	if err != nil {
		t.Fatal(err)
	}
	got := ai.(server.EngineAuthInfo)
	if got.UID != 65534 || got.GID != 65534 {
		t.Fatalf("auth info %+v: want uid and gid 65534", got)
	}
	for _, g := range []uint32{65534, 4242, 4243} {
		if !slices.Contains(got.Groups, g) {
			t.Errorf("Groups = %v, want 65534, 4242 and 4243", got.Groups)
		}
	}
}

// TestEngineCredentialsChild is TestEngineCredentialsRecordSupplementaryGroups'
// engine: it connects and waits for the socket to close.
func TestEngineCredentialsChild(t *testing.T) {
	sock := os.Getenv("KVXFER_CREDS_SOCK")
	if sock == "" {
		return
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, _ = io.Copy(io.Discard, c)
}
