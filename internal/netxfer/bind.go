package netxfer

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"time"
)

// errHelloIO marks a hello that ended because its connection did (the
// client closed it or went silent): not a failed proof.
var errHelloIO = errors.New("connection ended during the hello")

// Bound names.
//
// Grants (Guard) and notifications name the peer agent they come from or
// are for, and the secret's exchange (peerauth) or a CA's certificate
// proves only that a connection's client is one of the daemons trusted
// alike: neither names an agent. So that one such daemon cannot speak as
// another's agent (use its grants, send its notifications, or be dialed
// in its place), every agent holds a key pair of its own, made when it
// starts, and its name ends with its public key's tag: Name + "~" + 32 hex
// digits of SHA-256(public key). A name of that form is bound: over TCP,
// a connection names it only with a versionBound hello, in which the
// client proves it holds the name's key, and the server, the key of the
// name the client dialed:
//
//  1. client → server: magic, versionBound, the client's name, the
//     server's name (the agent the client means to reach), the client's
//     incarnation (each after its u16 length), the client's public key
//     and a fresh 32-byte nonce;
//  2. server → client: its public key, a fresh 32-byte nonce, and its
//     signature over boundServer ‖ message 1 ‖ its key ‖ its nonce;
//  3. client → server: its signature over boundClient ‖ message 1 ‖ the
//     server's key ‖ the server's nonce;
//  4. server → client: helloOK.
//
// Each side checks that the key it was shown has the tag of the name it
// stands for and that the signature is over this exchange's fresh nonce
// (a recorded one is useless, and the two labels keep a signature from
// being reflected). The server also checks that it is the agent meant, so
// a daemon that makes another dial it cannot relay that exchange to a
// third agent. A name without the tag (an agent of a build from before
// bound names) is taken as its hello gives it, as before; a bound name in
// any other hello is refused. The same-host socket proves nothing more:
// both its ends run as kvxferd's own user (SO_PEERCRED), who is trusted
// whole. What follows the hello is protected as the transport protects it
// (TLS, or not at all): an attacker on the path can still take over a
// connection of the plain TCP data plane, as the README says.
const (
	versionBound = 3
	// boundTagLen is the length of a bound name's tag: "~" and 32 hex
	// digits (128 bits of the key's hash).
	boundTagLen = 1 + 32
	boundServer = "kvxfer netxfer bound hello v1 server"
	boundClient = "kvxfer netxfer bound hello v1 client"
)

// keyTag is the tag a bound name of the holder of pub ends with.
func keyTag(pub ed25519.PublicKey) string {
	h := sha256.Sum256(pub)
	return "~" + hex.EncodeToString(h[:16])
}

// isBound reports whether name is a bound name (ends with a key's tag).
func isBound(name string) bool {
	if len(name) <= boundTagLen || name[len(name)-boundTagLen] != '~' {
		return false
	}
	for _, c := range []byte(name[len(name)-boundTagLen+1:]) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// holds reports whether pub is the key of the bound name name.
func holds(name string, pub []byte) bool {
	return len(pub) == ed25519.PublicKeySize && isBound(name) && name[len(name)-boundTagLen:] == keyTag(pub)
}

// bindName gives a its key pair and its bound name (New).
func (a *Agent) bindName() {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		panic(fmt.Sprintf("netxfer: no key pair: %v", err)) // crypto/rand does not fail
	}
	a.pub, a.priv = pub, priv
	a.cfg.Name += keyTag(pub)
}

// boundHello is message 1 of the exchange to the agent named target.
func (a *Agent) boundHello(target string) []byte {
	hello := append([]byte(magic), versionBound)
	for _, s := range []string{a.cfg.Name, target, a.inc} {
		hello = binary.LittleEndian.AppendUint16(hello, uint16(len(s)))
		hello = append(hello, s...)
	}
	hello = append(hello, a.pub...)
	nonce := make([]byte, nonceLen)
	_, _ = rand.Read(nonce)
	return append(hello, nonce...)
}

const nonceLen = 32

// signed is label ‖ the parts, what a signature of the exchange covers.
func signed(label string, parts ...[]byte) []byte {
	var b bytes.Buffer
	b.WriteString(label)
	for _, p := range parts {
		b.Write(p)
	}
	return b.Bytes()
}

// boundDial runs the client's side of the exchange on nc (TCP, after TLS
// and the secret's exchange) with the peer named p.name.
func (p *peer) boundDial(nc net.Conn) error {
	a := p.owner
	hello := a.boundHello(p.name)
	_ = nc.SetDeadline(time.Now().Add(a.cfg.DialTimeout))
	defer nc.SetDeadline(time.Time{})
	if _, err := nc.Write(hello); err != nil {
		return fmt.Errorf("%w: hello to %s: %w", ErrXferFailed, p.name, err)
	}
	reply := make([]byte, ed25519.PublicKeySize+nonceLen+ed25519.SignatureSize)
	if err := readFull(nc, reply); err != nil {
		return fmt.Errorf("%w: the agent listening at %s did not prove it is %s (a new process there, or not the agent meant): %v", ErrXferFailed, p.addr, p.name, err)
	}
	pub, rest := reply[:ed25519.PublicKeySize], reply[ed25519.PublicKeySize:]
	ns, sig := rest[:nonceLen], rest[nonceLen:]
	if !holds(p.name, pub) || !ed25519.Verify(pub, signed(boundServer, hello, pub, ns), sig) {
		a.bindFailures.Add(1)
		if a.cfg.Auth != nil {
			a.cfg.Auth.CountFailure() // kvxfer_peer_auth_failures_total
		}
		return fmt.Errorf("%w: the agent listening at %s does not hold the key of %s: not the agent meant", ErrXferFailed, p.addr, p.name)
	}
	if _, err := nc.Write(ed25519.Sign(a.priv, signed(boundClient, hello, pub, ns))); err != nil {
		return fmt.Errorf("%w: hello to %s: %w", ErrXferFailed, p.name, err)
	}
	var ok [1]byte
	if err := readFull(nc, ok[:]); err != nil || ok[0] != helloOK {
		return fmt.Errorf("%w: %s (%s) refused our proof: %v", ErrXferFailed, p.name, p.addr, cmpErr(err, "bad answer to hello"))
	}
	return nil
}

// boundServe runs the server's side of the exchange on nc, after r read
// hdr[:7] (magic, versionBound and the client's name's length) and the
// client's name. It returns the client's incarnation, or why the hello is
// refused.
func (a *Agent) boundServe(nc net.Conn, r *scatterReader, hdr7, name []byte) (string, error) {
	if a.priv == nil {
		return "", fmt.Errorf("bound hello, and this agent has no key")
	}
	hello := append(append([]byte(nil), hdr7...), name...)
	var fields [2][]byte
	var l [2]byte
	for i := range fields {
		if err := readFull(r, l[:]); err != nil {
			return "", fmt.Errorf("%w: %w", errHelloIO, err)
		}
		n := binary.LittleEndian.Uint16(l[:])
		if n > maxName {
			return "", fmt.Errorf("hello field of %d bytes", n)
		}
		fields[i] = make([]byte, n)
		if err := readFull(r, fields[i]); err != nil {
			return "", fmt.Errorf("%w: %w", errHelloIO, err)
		}
		hello = append(append(hello, l[:]...), fields[i]...)
	}
	keyNonce := make([]byte, ed25519.PublicKeySize+nonceLen)
	if err := readFull(r, keyNonce); err != nil {
		return "", fmt.Errorf("%w: %w", errHelloIO, err)
	}
	hello = append(hello, keyNonce...)
	pub := keyNonce[:ed25519.PublicKeySize]
	if target := string(fields[0]); target != a.cfg.Name {
		return "", fmt.Errorf("its hello is for agent %q, this is %q: meant for another agent (one that listened at this address before, or relayed)", target, a.cfg.Name)
	}
	if !holds(string(name), pub) {
		return "", fmt.Errorf("the key it shows is not the key of the name it gives")
	}
	ns := make([]byte, nonceLen)
	_, _ = rand.Read(ns)
	reply := append(append(append([]byte(nil), a.pub...), ns...), ed25519.Sign(a.priv, signed(boundServer, hello, a.pub, ns))...)
	if _, err := nc.Write(reply); err != nil {
		return "", fmt.Errorf("%w: %w", errHelloIO, err)
	}
	sig := make([]byte, ed25519.SignatureSize)
	if err := readFull(r, sig); err != nil {
		return "", fmt.Errorf("%w: no proof: %w", errHelloIO, err)
	}
	if !ed25519.Verify(ed25519.PublicKey(pub), signed(boundClient, hello, a.pub, ns), sig) {
		return "", fmt.Errorf("its proof does not hold: it does not hold the key of the name it gives")
	}
	if _, err := nc.Write([]byte{helloOK}); err != nil {
		return "", fmt.Errorf("%w: %w", errHelloIO, err)
	}
	return string(fields[1]), nil
}

// refuseHello counts and logs a hello refused for its name's proof.
func (a *Agent) refuseHello(nc net.Conn, name []byte, err error) {
	if errors.Is(err, errHelloIO) {
		a.log.Debug("netxfer: a connection ended during its hello", "from", nc.RemoteAddr(), "peer", string(name), "err", err)
		return
	}
	a.bindFailures.Add(1)
	if a.cfg.Auth != nil {
		a.cfg.Auth.CountFailure() // kvxfer_peer_auth_failures_total
	}
	a.log.Warn("netxfer: refused a connection", "from", nc.RemoteAddr(), "peer", string(name), "reason", err)
}

// BindFailures returns how many connections failed a bound name's proof,
// dialed or served (each is also a peer authentication failure).
func (a *Agent) BindFailures() uint64 { return a.bindFailures.Load() }
