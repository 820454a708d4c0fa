package netxfer

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// rawWrite is a client's frames after its hello: a WRITE of "XXXXXXXX" at
// base and a notification "forged".
func rawWrite() []byte {
	w := []byte{tWrite}
	w = binary.LittleEndian.AppendUint64(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 0)
	w = binary.LittleEndian.AppendUint32(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 0)
	w = binary.LittleEndian.AppendUint64(w, base)
	w = binary.LittleEndian.AppendUint64(w, 8)
	w = append(w, "XXXXXXXX"...)
	m := []byte("forged")
	w = append(w, tNotif)
	w = binary.LittleEndian.AppendUint32(w, uint32(len(m)))
	return append(w, m...)
}

// closedBy waits (bounded) for the server to close nc, reading what it
// sends; it fails the test if the server kept the connection open.
func closedBy(t *testing.T, nc net.Conn) []byte {
	t.Helper()
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(nc)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Error("the server kept the connection open")
	}
	return got
}

// A daemon holding the secret cannot speak as another daemon's agent on
// the data plane: a hello that gives the agent's (bound) name without
// proving its key is refused, in every form, and nothing it sends lands.
func TestBoundNameCannotBeClaimed(t *testing.T) {
	const s = "0123456789abcdef-shared"
	for _, secured := range []bool{true, false} {
		au := auth(t, s)
		if !secured {
			au = nil // -insecure-peers: names are bound all the same
		}
		victim, b, _, bm := authPair(t, 4096, au, au, 0)
		if !isBound(victim.Name()) || !isBound(b.Name()) {
			t.Fatalf("names %q, %q are not bound", victim.Name(), b.Name())
		}
		before := bytes.Clone(bm)
		_, otherPriv, _ := ed25519.GenerateKey(rand.Reader)
		otherPub := otherPriv.Public().(ed25519.PublicKey)
		hellos := map[string][]byte{
			"plain": helloFrame(victim.Name()),
			"ident": identHello(victim.Name(), b.uaddr, "x"),
			"bound, another key": func() []byte {
				h := append([]byte(magic), versionBound)
				for _, f := range []string{victim.Name(), b.Name(), "x"} {
					h = binary.LittleEndian.AppendUint16(h, uint16(len(f)))
					h = append(h, f...)
				}
				h = append(h, otherPub...)
				return append(h, make([]byte, nonceLen)...)
			}(),
		}
		for form, hello := range hellos {
			fails := b.BindFailures()
			nc, err := net.Dial("tcp", b.Addr())
			if err != nil {
				t.Fatal(err)
			}
			if secured {
				if err := au.Client(nc, "data", victim.Name()); err != nil {
					t.Fatal(err)
				}
			}
			_, _ = nc.Write(append(hello, rawWrite()...))
			if got := closedBy(t, nc); len(got) != 0 {
				t.Errorf("secured %v, %s hello: the server answered %q", secured, form, got)
			}
			nc.Close()
			if b.BindFailures() != fails+1 {
				t.Errorf("secured %v, %s hello: bind failures %d, want %d", secured, form, b.BindFailures(), fails+1)
			}
		}
		if !bytes.Equal(bm, before) {
			t.Errorf("secured %v: a client posing as %s wrote into memory", secured, victim.Name())
		}
		if n := b.Drain(nil); len(n) != 0 {
			t.Errorf("secured %v: forged notifications delivered: %+v", secured, n)
		}
		// The real agent still gets through.
		if err := victim.Notify(b.Name(), []byte("real")); err != nil {
			t.Fatal(err)
		}
		if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "real" || n[0].From != victim.Name() {
			t.Fatalf("secured %v: the real agent's notification: %+v", secured, n)
		}
	}
}

// An agent that dials another by its name sends nothing of a transfer to
// whoever listens at the address without holding that name's key: a
// daemon holding the secret that made it dial there learns no KV byte.
func TestImpostorServerGetsNoBytes(t *testing.T) {
	const s = "0123456789abcdef-shared"
	au := auth(t, s)
	a, b, am, _ := authPair(t, 4096, au, au, 0)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var heard []byte
	wg.Add(1)
	go func() {
		defer wg.Done()
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		if _, err := au.Server(nc, "data"); err != nil {
			return
		}
		// Whatever the dialer waits for, the impostor answers with bytes
		// of the right length, and confirms.
		go func() {
			_, _ = nc.Write(make([]byte, ed25519.PublicKeySize+nonceLen+ed25519.SignatureSize))
			_, _ = nc.Write([]byte{helloOK})
		}()
		_ = nc.SetReadDeadline(time.Now().Add(3 * time.Second))
		buf := make([]byte, 1<<16)
		for {
			n, err := nc.Read(buf)
			mu.Lock()
			heard = append(heard, buf[:n]...)
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	defer func() { ln.Close(); wg.Wait() }()
	// b's name at the impostor's address (as a forged handshake would
	// give it).
	name, err := a.LoadPeer([]byte(metaPrefix + b.Name() + "\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte("KVSECRET"), 512)
	copy(am, secret)
	id, err := a.Post(Write, name, []Desc{{Local: base, Remote: base, Len: uint64(len(secret))}}, []byte("done"))
	if err == nil {
		var st State
		if st, err = wait(t, a, id); st != Failed {
			t.Fatalf("a WRITE to an impostor: state %v", st)
		}
	}
	if !errors.Is(err, ErrXferFailed) {
		t.Errorf("a WRITE to an impostor: %v, want ErrXferFailed", err)
	}
	ln.Close()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if bytes.Contains(heard, []byte("KVSECRET")) || bytes.Contains(heard, []byte("done")) {
		t.Errorf("the impostor heard the transfer (%d bytes)", len(heard))
	}
	if a.BindFailures() == 0 {
		t.Error("the failed proof was not counted")
	}
}

// A daemon that makes another dial it cannot relay that connection to a
// third agent: the hello names the agent meant, and the third refuses it.
func TestRelayedHelloRefused(t *testing.T) {
	const s = "0123456789abcdef-shared"
	au := auth(t, s)
	a, c, am, cm := authPair(t, 4096, au, au, 0)
	_, r, _, _ := authPair(t, 64, au, au, 0) // the relaying daemon's agent
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	wg.Add(1)
	go func() { // forwards everything both ways to c
		defer wg.Done()
		in, err := ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", c.Addr())
		if err != nil {
			in.Close()
			return
		}
		mu.Lock()
		open = append(open, in, out)
		mu.Unlock()
		var fw sync.WaitGroup
		fw.Add(2)
		go func() { defer fw.Done(); _, _ = io.Copy(out, in); out.Close() }()
		go func() { defer fw.Done(); _, _ = io.Copy(in, out); in.Close() }()
		fw.Wait()
	}()
	defer func() {
		ln.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}()
	name, err := a.LoadPeer([]byte(metaPrefix + r.Name() + "\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	before := bytes.Clone(cm)
	fill(am, 7)
	fails := c.BindFailures()
	id, err := a.Post(Write, name, []Desc{{Local: base, Remote: base, Len: 4096}}, []byte("done"))
	if err == nil {
		if st, _ := wait(t, a, id); st != Failed {
			t.Fatalf("a WRITE relayed to another agent: state %v", st)
		}
	}
	if !bytes.Equal(cm, before) || len(c.Drain(nil)) != 0 {
		t.Error("a relayed connection wrote into the third agent")
	}
	if c.BindFailures() != fails+1 {
		t.Errorf("the third agent's bind failures: %d, want %d", c.BindFailures(), fails+1)
	}
}
