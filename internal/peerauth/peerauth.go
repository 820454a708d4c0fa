// Package peerauth authenticates kvxferd daemons to each other with a
// shared secret, on every connection between them: the gRPC Peer service
// (server.PeerCredentials: gRPC transport credentials over it) and every
// data-plane connection of the built-in backend.
//
// # Protocol
//
// When a connection opens, before anything else crosses it:
//
//  1. client → server: "KVXA", version 1, the purpose (one byte of length,
//     then the bytes: "grpc" or "data"), the client's name (one byte of
//     length, then the bytes) and a fresh 32-byte random nonce Nc;
//  2. server → client: "KVXA", version 1, a fresh 32-byte nonce Ns and
//     HMAC-SHA256(secret, "kvxfer peer auth v1 server" ‖ T), where T is
//     everything message 1 held followed by Ns;
//  3. client → server: HMAC-SHA256(secret, "kvxfer peer auth v1 client" ‖ T);
//  4. server → client: one byte, 1 accepted, 0 refused.
//
// Each side checks the other's MAC (in constant time) before it sends
// anything that depends on the secret being shared: the server proves
// first, over the client's fresh nonce; the client then proves over the
// server's. A recorded exchange is useless later (the other side's nonce
// is new each time), a MAC cannot be reflected (the two labels differ),
// and the purpose and the client's name are bound into both MACs, so
// neither can be changed on the way. Every length is bounded before
// anything is allocated, and the whole exchange runs under a deadline.
//
// # What it protects, and what not
//
// Only daemons holding the secret can open connections to each other:
// nobody else can read a handshake's layouts and addresses, read or write
// registered KV memory, or send notifications. The bytes that follow the
// exchange are not encrypted nor integrity-protected (that would cost the
// data plane its bandwidth): an attacker on the path between two daemons
// could still read or alter them. Where the network between hosts is not
// trusted, use mutual TLS (kvxferd -tls-cert, -tls-key, -tls-ca) instead.
package peerauth

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	magic    = "KVXA"
	version  = 1
	nonceLen = 32
	macLen   = sha256.Size
	// MinSecret is the fewest bytes a secret may have.
	MinSecret = 16
	// maxField bounds the purpose and the name.
	maxField = 255
	// DefaultTimeout bounds a whole exchange.
	DefaultTimeout = 10 * time.Second
)

// ErrAuth is the error of a failed authentication, on either side.
var ErrAuth = errors.New("peer authentication failed")

// Authenticator runs the exchange for one daemon. It is safe for
// concurrent use. The zero value is not usable: use New or Insecure.
type Authenticator struct {
	secret   []byte
	insecure bool
	// Timeout bounds one exchange (default DefaultTimeout).
	Timeout  time.Duration
	failures atomic.Uint64
}

// New returns an Authenticator with secret (at least MinSecret bytes).
func New(secret []byte) (*Authenticator, error) {
	if len(secret) < MinSecret {
		return nil, fmt.Errorf("peerauth: the secret has %d bytes, want at least %d", len(secret), MinSecret)
	}
	return &Authenticator{secret: bytes.Clone(secret)}, nil
}

// Insecure returns an Authenticator that runs no exchange at all
// (kvxferd -insecure-peers): every connection is accepted.
func Insecure() *Authenticator { return &Authenticator{insecure: true} }

// Enabled reports whether connections are authenticated.
func (a *Authenticator) Enabled() bool { return !a.insecure }

// Failures returns how many exchanges failed, on either side, with those
// counted by CountFailure.
func (a *Authenticator) Failures() uint64 { return a.failures.Load() }

// CountFailure counts a failed authentication of another kind that runs
// in this exchange's place (mutual TLS, with an Insecure Authenticator):
// Failures includes it.
func (a *Authenticator) CountFailure() { a.failures.Add(1) }

// RandomSecret returns 32 random bytes, a secret no other daemon holds.
func RandomSecret() []byte {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return b
}

// LoadSecret reads a secret file: a regular file (not a symlink) owned by
// this process's user and readable by its owner only (no group or other
// permission bits), holding at least MinSecret bytes once surrounding
// whitespace is trimmed. The error names the file and what is wrong.
func LoadSecret(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("peer secret file %s: a symlink; give the file itself", path)
		}
		return nil, fmt.Errorf("peer secret file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("peer secret file: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("peer secret file %s: not a regular file", path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("peer secret file %s: mode %#o lets other users read it; want it readable by its owner only (chmod 600)", path, perm)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		return nil, fmt.Errorf("peer secret file %s: owned by uid %d, want kvxferd's own user (uid %d)", path, sys.Uid, os.Geteuid())
	}
	b, err := io.ReadAll(io.LimitReader(f, 64<<10))
	if err != nil {
		return nil, fmt.Errorf("peer secret file: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) < MinSecret {
		return nil, fmt.Errorf("peer secret file %s: %d bytes, want at least %d (e.g. head -c 32 /dev/urandom | base64 > %s)", path, len(b), MinSecret, path)
	}
	return b, nil
}

// Limit returns the bound of one exchange.
func (a *Authenticator) Limit() time.Duration { return a.timeout() }

func (a *Authenticator) timeout() time.Duration {
	if a.Timeout > 0 {
		return a.Timeout
	}
	return DefaultTimeout
}

func (a *Authenticator) mac(label string, transcript []byte) []byte {
	h := hmac.New(sha256.New, a.secret)
	h.Write([]byte("kvxfer peer auth v1 " + label))
	h.Write(transcript)
	return h.Sum(nil)
}

func (a *Authenticator) fail(format string, args ...any) error {
	a.failures.Add(1)
	return fmt.Errorf("%w "+format, append([]any{ErrAuth}, args...)...)
}

// Client runs the client's side of the exchange on conn, for purpose
// ("grpc" or "data"), naming itself name. It returns nil once both sides
// proved they hold the same secret.
func (a *Authenticator) Client(conn net.Conn, purpose, name string) error {
	return a.ClientWithin(conn, purpose, name, a.timeout())
}

// ClientWithin is Client bounded by timeout instead of a.Timeout.
func (a *Authenticator) ClientWithin(conn net.Conn, purpose, name string, timeout time.Duration) error {
	if a.insecure {
		return nil
	}
	if len(purpose) > maxField || len(name) > maxField {
		return fmt.Errorf("peerauth: purpose %q or name of %d bytes, want at most %d", purpose, len(name), maxField)
	}
	peer := conn.RemoteAddr()
	_ = conn.SetDeadline(time.Now().Add(timeout))
	defer conn.SetDeadline(time.Time{})
	msg := make([]byte, 0, 4+1+2+len(purpose)+len(name)+nonceLen)
	msg = append(msg, magic...)
	msg = append(msg, version, byte(len(purpose)))
	msg = append(msg, purpose...)
	msg = append(msg, byte(len(name)))
	msg = append(msg, name...)
	nc := make([]byte, nonceLen)
	_, _ = rand.Read(nc)
	msg = append(msg, nc...)
	if _, err := conn.Write(msg); err != nil {
		return a.fail("with %s: %v", peer, err)
	}
	reply := make([]byte, 4+1+nonceLen+macLen)
	if _, err := io.ReadFull(conn, reply); err != nil {
		return a.fail("with %s: no answer to our hello (%v): is it a kvxferd peer port with authentication on?", peer, err)
	}
	if string(reply[:4]) != magic || reply[4] != version {
		return a.fail("with %s: not a kvxfer peer (its answer is not the exchange's)", peer)
	}
	transcript := append(msg, reply[5:5+nonceLen]...)
	if !hmac.Equal(reply[5+nonceLen:], a.mac("server", transcript)) {
		return a.fail("with %s: its proof does not match our secret (do both daemons use the same -peer-secret-file?)", peer)
	}
	if _, err := conn.Write(a.mac("client", transcript)); err != nil {
		return a.fail("with %s: %v", peer, err)
	}
	var ack [1]byte
	if _, err := io.ReadFull(conn, ack[:]); err != nil || ack[0] != 1 {
		return a.fail("with %s: it refused our proof", peer)
	}
	return nil
}

// Server runs the server's side of the exchange on conn, for purpose, and
// returns the name the client gave once both sides proved they hold the
// same secret. With an insecure Authenticator it reads nothing and
// returns "".
func (a *Authenticator) Server(conn net.Conn, purpose string) (string, error) {
	if a.insecure {
		return "", nil
	}
	peer := conn.RemoteAddr()
	_ = conn.SetDeadline(time.Now().Add(a.timeout()))
	defer conn.SetDeadline(time.Time{})
	msg := make([]byte, 6, 6+2*maxField+1+nonceLen)
	if _, err := io.ReadFull(conn, msg); err != nil {
		return "", a.fail("from %s: no hello (%v)", peer, err)
	}
	if string(msg[:4]) != magic || msg[4] != version {
		return "", a.fail("from %s: not a kvxfer peer (no authentication hello; is it running with -insecure-peers?)", peer)
	}
	p := make([]byte, int(msg[5])+1)
	if _, err := io.ReadFull(conn, p); err != nil {
		return "", a.fail("from %s: %v", peer, err)
	}
	msg = append(msg, p...)
	if got := string(p[:len(p)-1]); got != purpose {
		return "", a.fail("from %s: it authenticates for %q, this port serves %q", peer, got, purpose)
	}
	rest := make([]byte, int(p[len(p)-1])+nonceLen)
	if _, err := io.ReadFull(conn, rest); err != nil {
		return "", a.fail("from %s: %v", peer, err)
	}
	msg = append(msg, rest...)
	name := string(rest[:len(rest)-nonceLen])
	ns := make([]byte, nonceLen)
	_, _ = rand.Read(ns)
	transcript := append(msg, ns...)
	reply := make([]byte, 0, 5+nonceLen+macLen)
	reply = append(reply, magic...)
	reply = append(reply, version)
	reply = append(reply, ns...)
	reply = append(reply, a.mac("server", transcript)...)
	if _, err := conn.Write(reply); err != nil {
		return "", a.fail("from %s: %v", peer, err)
	}
	proof := make([]byte, macLen)
	if _, err := io.ReadFull(conn, proof); err != nil {
		return "", a.fail("from %s (%q): no proof (%v): does it use the same -peer-secret-file?", peer, name, err)
	}
	if !hmac.Equal(proof, a.mac("client", transcript)) {
		_, _ = conn.Write([]byte{0})
		return "", a.fail("from %s (%q): its proof does not match our secret (do both daemons use the same -peer-secret-file?)", peer, name)
	}
	if _, err := conn.Write([]byte{1}); err != nil {
		return "", a.fail("from %s: %v", peer, err)
	}
	return name, nil
}
