package netxfer

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"testing"
	"time"
)

// rawPeer dials b as an authenticated peer named name (auth: the secret
// b's agent checks, "" for none) and returns the connection, its
// answers read and dropped.
func rawPeer(t *testing.T, b *Agent, name, secret string) net.Conn {
	t.Helper()
	nc, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	if secret != "" {
		if err := auth(t, secret).Client(nc, "data", name); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := nc.Write(helloFrame(name)); err != nil {
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, 1<<16)
		for {
			if _, err := nc.Read(buf); err != nil {
				return
			}
		}
	}()
	return nc
}

// unfinishedWrite is part 0 of a 2-part WRITE of no bytes: it starts a
// landing the rest never finishes.
func unfinishedWrite(w []byte, id uint64) []byte {
	w = append(w, tWrite)
	w = binary.LittleEndian.AppendUint64(w, id)
	w = binary.LittleEndian.AppendUint32(w, 0) // part 0
	w = binary.LittleEndian.AppendUint32(w, 2) // of 2
	w = binary.LittleEndian.AppendUint32(w, 0) // no descriptors
	w = binary.LittleEndian.AppendUint32(w, 0) // no notification
	return w
}

func landingLen(b *Agent) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.mu.landing)
}

// One authenticated peer that starts multi-part WRITEs and never
// finishes them fills only its own share of the table of unfinished
// writes: another peer's multi-part WRITEs still land (its connections
// are not dropped for what the first peer did).
func TestUnfinishedWritesOfOnePeerSpareOthers(t *testing.T) {
	const s = "0123456789abcdef-shared"
	a, b, am, bm := authPair(t, 1<<16, auth(t, s), auth(t, s), 0)
	nc := rawPeer(t, b, "mallory", s)
	var w []byte
	for id := range maxLanding {
		w = unfinishedWrite(w, uint64(id+1))
	}
	if _, err := nc.Write(w); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for landingLen(b) < maxLanding && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := landingLen(b); n != maxLanding {
		t.Fatalf("mallory's unfinished writes = %d, want %d", n, maxLanding)
	}
	// a's WRITE of 4 pieces goes as 2 parts (Conns: 2).
	fill(am, 7)
	var descs []Desc
	for i := range 4 {
		off := uint64(i) << 14
		descs = append(descs, Desc{Local: base + off, Remote: base + off, Len: 1 << 14})
	}
	id, err := a.Post(Write, b.Name(), descs, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := wait(t, a, id)
	if st != Done {
		t.Fatalf("a's multi-part write while mallory holds unfinished ones: %v, %v", st, err)
	}
	if !bytes.Equal(am, bm) {
		t.Error("a's bytes did not land")
	}
	if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "done" {
		t.Errorf("notifications: %+v", n)
	}
}

// A multi-part WRITE whose peer's connections all end before its last
// part arrives will never finish: the receiver forgets it, instead of
// keeping it in the table of unfinished writes (bounded: past maxLanding
// of them, every multi-part WRITE would be refused) for ever.
func TestUnfinishedWritesForgottenWithTheirPeer(t *testing.T) {
	const s = "0123456789abcdef-shared"
	_, b, _, _ := authPair(t, 4096, auth(t, s), auth(t, s), 0)
	for round := range 3 {
		nc := rawPeer(t, b, "flaky", s)
		var w []byte
		for id := range 100 {
			w = unfinishedWrite(w, uint64(round*1000+id+1))
		}
		if _, err := nc.Write(w); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for landingLen(b) < 100 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		nc.Close() // the peer's only connection breaks mid-transfer
	}
	deadline := time.Now().Add(10 * time.Second)
	for landingLen(b) != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := landingLen(b); n != 0 {
		t.Errorf("unfinished writes of a peer with no connection left: %d, want 0", n)
	}
}

// A WRITE part whose connection breaks mid-payload never lands, and its
// sender fails the transfer: the receiver counts it failed, so the
// landing ends with its other parts even while the peer's other
// connections stay up (pooled, for as long as the peer lives).
func TestWritePartBrokenOffEndsItsLanding(t *testing.T) {
	const s = "0123456789abcdef-shared"
	_, b, _, _ := authPair(t, 1<<16, auth(t, s), auth(t, s), 0)
	x := rawPeer(t, b, "flaky", s) // stays up
	y := rawPeer(t, b, "flaky", s)
	if _, err := x.Write(unfinishedWrite(nil, 5)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for landingLen(b) != 1 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	var w []byte
	w = append(w, tWrite)
	w = binary.LittleEndian.AppendUint64(w, 5)
	w = binary.LittleEndian.AppendUint32(w, 1) // part 1
	w = binary.LittleEndian.AppendUint32(w, 2) // of 2
	w = binary.LittleEndian.AppendUint32(w, 1) // one descriptor
	w = binary.LittleEndian.AppendUint32(w, 0) // no notification
	w = binary.LittleEndian.AppendUint64(w, base)
	w = binary.LittleEndian.AppendUint64(w, 1<<15)
	w = append(w, make([]byte, 100)...) // of 32 KiB of payload
	if _, err := y.Write(w); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	y.Close()
	for landingLen(b) != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := landingLen(b); n != 0 {
		t.Errorf("unfinished writes after the part that would end it broke off: %d, want 0", n)
	}
}

// At the bound, a peer's multi-part WRITEs no part of which came for
// staleLanding are forgotten (their sender gave them up, so their other
// parts never come), making room for its new ones; recent ones are kept
// and still bound it.
func TestStaleLandingsForgottenAtTheBound(t *testing.T) {
	a, err := New(Config{Name: fmt.Sprintf("%s-%d", t.Name(), rand.Uint64()), DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ss := session{"p", "inc"}
	fill := func(age time.Duration) {
		a.mu.Lock()
		defer a.mu.Unlock()
		for i := range maxLanding {
			k := landKey{ss.peer, ss.inc, XferID(i + 1)}
			a.landingLocked(k, 2).last = time.Now().Add(-age)
		}
	}
	next := writeHeader{id: maxLanding + 1, parts: 2}
	fill(time.Second)
	if err := a.landingRoom(ss, next); err == nil {
		t.Fatal("a new multi-part WRITE past the bound of recent ones was let in")
	}
	fill(staleLanding + time.Minute)
	if err := a.landingRoom(ss, next); err != nil {
		t.Fatalf("the bound of WRITEs no part of which came for %v: %v", staleLanding+time.Minute, err)
	}
	a.mu.Lock()
	n := a.mu.landingBy[ss.peer]
	a.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d stale landings kept", n)
	}
}
