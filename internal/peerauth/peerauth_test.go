package peerauth

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func mustNew(t testing.TB, secret string) *Authenticator {
	t.Helper()
	a, err := New([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// exchange runs Client and Server over a loopback TCP pair.
func exchange(t *testing.T, client, server *Authenticator, cpurpose, spurpose, name string) (got string, cerr, serr error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type res struct {
		name string
		err  error
	}
	done := make(chan res, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- res{err: err}
			return
		}
		defer c.Close()
		n, err := server.Server(c, spurpose)
		done <- res{n, err}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cerr = client.Client(c, cpurpose, name)
	c.Close()
	r := <-done
	return r.name, cerr, r.err
}

func TestExchange(t *testing.T) {
	a, b := mustNew(t, "0123456789abcdef-one"), mustNew(t, "0123456789abcdef-two")
	if name, cerr, serr := exchange(t, a, mustNew(t, "0123456789abcdef-one"), "data", "data", "P-rank0"); cerr != nil || serr != nil || name != "P-rank0" {
		t.Fatalf("same secret: client %v, server %v, name %q", cerr, serr, name)
	}
	// Different secrets: both sides fail, each saying so.
	_, cerr, serr := exchange(t, a, b, "data", "data", "x")
	if !errors.Is(cerr, ErrAuth) || !strings.Contains(cerr.Error(), "its proof does not match our secret (do both daemons use the same -peer-secret-file?)") {
		t.Errorf("client with another secret: %v", cerr)
	}
	if !errors.Is(serr, ErrAuth) || !strings.Contains(serr.Error(), "same -peer-secret-file") {
		t.Errorf("server with another secret: %v", serr)
	}
	// A purpose the port does not serve.
	if _, _, serr := exchange(t, a, mustNew(t, "0123456789abcdef-one"), "grpc", "data", "x"); !errors.Is(serr, ErrAuth) || !strings.Contains(serr.Error(), `authenticates for "grpc"`) {
		t.Errorf("wrong purpose: %v", serr)
	}
	// An insecure client against a secured server, and the other way.
	if _, _, serr := exchange(t, Insecure(), a, "data", "data", "x"); !errors.Is(serr, ErrAuth) {
		t.Errorf("a client without authentication: server %v", serr)
	}
	if a.Failures() == 0 || b.Failures() == 0 {
		t.Errorf("failures counted: %d, %d", a.Failures(), b.Failures())
	}
}

// A server that is not a kvxfer peer (or one with authentication off)
// makes the client fail at once, saying so.
func TestClientAgainstAPlainServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_, _ = c.Write([]byte("HTTP/1.1 400 Bad Request\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"))
			time.Sleep(100 * time.Millisecond)
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := mustNew(t, "0123456789abcdef").Client(c, "data", "x"); !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "not a kvxfer peer") {
		t.Errorf("client against a plain server: %v", err)
	}
}

// A recorded exchange cannot be replayed: the server's nonce is new each
// time, so the client's recorded proof no longer matches.
func TestReplayRefused(t *testing.T) {
	secret := "0123456789abcdef-replay"
	client, server := mustNew(t, secret), mustNew(t, secret)
	// Record what the client sends in a genuine exchange.
	cc, sc := net.Pipe()
	var sent bytes.Buffer
	go func() { _, _ = server.Server(sc, "data"); sc.Close() }()
	rec := &recorder{Conn: cc, w: &sent}
	if err := client.Client(rec, "data", "P"); err != nil {
		t.Fatal(err)
	}
	cc.Close()
	// Replay those bytes to the server.
	cc2, sc2 := net.Pipe()
	done := make(chan error, 1)
	go func() { _, err := server.Server(sc2, "data"); sc2.Close(); done <- err }()
	go func() { _, _ = io.Copy(io.Discard, cc2) }()
	_, _ = cc2.Write(sent.Bytes())
	if err := <-done; !errors.Is(err, ErrAuth) {
		t.Errorf("replayed exchange: %v, want ErrAuth", err)
	}
	cc2.Close()
}

type recorder struct {
	net.Conn
	w io.Writer
}

func (r *recorder) Write(b []byte) (int, error) {
	r.w.Write(b)
	return r.Conn.Write(b)
}

// A peer that says nothing is cut off at the deadline.
func TestServerDeadline(t *testing.T) {
	a := mustNew(t, "0123456789abcdef")
	a.Timeout = 50 * time.Millisecond
	cc, sc := net.Pipe()
	defer cc.Close()
	start := time.Now()
	if _, err := a.Server(sc, "data"); !errors.Is(err, ErrAuth) {
		t.Errorf("silent client: %v", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("the silent client held the server %v", time.Since(start))
	}
}

func TestLoadSecret(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", "  0123456789abcdef0123\n", 0o600)
	if b, err := LoadSecret(good); err != nil || string(b) != "0123456789abcdef0123" {
		t.Errorf("LoadSecret(good) = %q, %v", b, err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{
		write("open", "0123456789abcdef0123", 0o644):  "lets other users read it",
		write("group", "0123456789abcdef0123", 0o640): "lets other users read it",
		write("short", "short\n", 0o600):              "want at least 16",
		link:                                          "a symlink",
		filepath.Join(dir, "missing"):                 "no such file",
		dir:                                           "not a regular file",
	} {
		if _, err := LoadSecret(p); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("LoadSecret(%s) = %v, want an error with %q", p, err, want)
		}
	}
	if _, err := New([]byte("short")); err == nil {
		t.Error("New(5 bytes) accepted")
	}
}

// FuzzServerHandshake: whatever a client sends, the server never panics,
// never reads past its bounds, and accepts nothing but a real exchange.
func FuzzServerHandshake(f *testing.F) {
	f.Add([]byte("KVXA\x01\x04data\x01P0123456789abcdef0123456789abcdef"))
	f.Add([]byte("KVXA\x01\xffdata"))
	f.Add([]byte("GET / HTTP/1.1\r\n"))
	a := mustNew(f, "0123456789abcdef-fuzz")
	a.Timeout = 100 * time.Millisecond
	f.Fuzz(func(t *testing.T, in []byte) {
		cc, sc := net.Pipe()
		go func() {
			_, _ = cc.Write(in)
			_, _ = io.Copy(io.Discard, cc)
		}()
		if _, err := a.Server(sc, "data"); err == nil {
			t.Fatalf("accepted %q", in)
		}
		sc.Close()
		cc.Close()
	})
}

// FuzzClientHandshake: whatever a server answers, the client never panics
// and accepts nothing but a real exchange.
func FuzzClientHandshake(f *testing.F) {
	f.Add([]byte("KVXA\x01" + strings.Repeat("n", 32) + strings.Repeat("m", 32) + "\x01"))
	f.Add([]byte{})
	a := mustNew(f, "0123456789abcdef-fuzz")
	a.Timeout = 100 * time.Millisecond
	f.Fuzz(func(t *testing.T, in []byte) {
		cc, sc := net.Pipe()
		go func() {
			_, _ = sc.Write(in)
			_, _ = io.Copy(io.Discard, sc)
		}()
		go func() { _, _ = io.Copy(io.Discard, sc) }()
		if err := a.Client(cc, "data", "P"); err == nil {
			t.Fatalf("accepted %q", in)
		}
		sc.Close()
		cc.Close()
	})
}
