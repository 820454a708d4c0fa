//go:build linux

package nixl

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// linked loads b's metadata into a and returns b's name there.
func linked(t *testing.T, a, b closeEnd) kvxfer.PeerName {
	t.Helper()
	meta, err := b.b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	p, err := a.b.LoadPeer(meta)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// A prepared list released while a PostPrepared of it is under way: the
// Backend is safe for concurrent use, so the release waits for the post
// (or the post finds the list gone); NIXL must never get a list handle
// already freed. Before, PostPrepared looked its lists up, let go of the
// Backend, and handed NIXL their handles, which a ReleasePrepared
// between the two had freed (a use after free inside NIXL).
func TestReleasePreparedDuringPost(t *testing.T) {
	a, b := newCloseEnd(t, 1<<16), newCloseEnd(t, 1<<16)
	for i := range a.mem {
		a.mem[i] = byte(i*3 + 1)
	}
	peer := linked(t, a, b)
	local, err := a.b.Prepare("", []hotpath.Entry{{Addr: a.r.Addr, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := a.b.Prepare(peer, []hotpath.Entry{{Addr: b.r.Addr, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan error, 1)
	var early bool
	testHookPostPrepared = func() {
		go func() { released <- a.b.ReleasePrepared(local) }()
		select {
		case err := <-released:
			early = true
			released <- err
		case <-time.After(200 * time.Millisecond): // waits for the post: as it should
		}
	}
	defer func() { testHookPostPrepared = nil }()
	id, postErr := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{Local: 0, Remote: 0}}, nil)
	if early {
		t.Fatalf("ReleasePrepared freed the list while a PostPrepared of it was under way (the post then got %v)", postErr)
	}
	if err := <-released; err != nil {
		t.Errorf("ReleasePrepared: %v", err)
	}
	if postErr != nil {
		t.Fatalf("PostPrepared: %v", postErr)
	}
	if s, err := settled(t, a.b, id); s != kvxfer.XferDone {
		t.Fatalf("the WRITE ended %v, %v", s, err)
	}
	if !bytes.Equal(b.mem[:4096], a.mem[:4096]) {
		t.Error("the WRITE did not land")
	}
	_ = a.b.Release(id)
	if _, err := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{Local: 0, Remote: 0}}, nil); err == nil {
		t.Error("a released list was posted")
	}
}

// Calls after Close return ErrClosed (kvxfer.Backend), the prepared
// lists' too. Before, PostPrepared and ReleasePrepared after Close said
// only that the lists were unknown.
func TestPreparedAfterClose(t *testing.T) {
	a, b := newCloseEnd(t, 1<<16), newCloseEnd(t, 1<<16)
	peer := linked(t, a, b)
	local, err := a.b.Prepare("", []hotpath.Entry{{Addr: a.r.Addr, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := a.b.Prepare(peer, []hotpath.Entry{{Addr: b.r.Addr, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{Local: 0, Remote: 0}}, nil); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("PostPrepared after Close = %v, want ErrClosed", err)
	}
	if err := a.b.ReleasePrepared(local); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("ReleasePrepared after Close = %v, want ErrClosed", err)
	}
	if _, err := a.b.Prepare("", []hotpath.Entry{{Addr: a.r.Addr, Len: 4096}}); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("Prepare after Close = %v, want ErrClosed", err)
	}
}

// A local list prepared over memory that is then deregistered can no
// longer be posted: NIXL's list keeps the registration it was prepared
// with, freed by the deregistration, and a transfer would read or write
// memory no longer registered (kvxfer.Backend: never outside registered
// memory). Before, such a post was made and the WRITE reported done,
// even after the memory was registered again. Lists over memory still
// registered go on working, and a list prepared after the memory is
// registered again works.
func TestDeregisterStalesPrepared(t *testing.T) {
	a, b := newCloseEnd(t, 1<<16), newCloseEnd(t, 1<<16)
	peer := linked(t, a, b)
	other := make([]byte, 1<<16)
	or := kvxfer.MemRegion{Addr: uint64(uintptr(unsafe.Pointer(&other[0]))), Len: uint64(len(other)), Kind: kvxfer.MemDRAM}
	if err := a.b.Map(or.Addr, other); err != nil {
		t.Fatal(err)
	}
	if err := a.b.Register([]kvxfer.MemRegion{or}); err != nil {
		t.Fatal(err)
	}
	prep := func(peer kvxfer.PeerName, addr uint64) kvxfer.PrepID {
		t.Helper()
		id, err := a.b.Prepare(peer, []hotpath.Entry{{Addr: addr + 4096, Len: 4096}})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	stale, kept, remote := prep("", a.r.Addr), prep("", or.Addr), prep(peer, b.r.Addr)
	write := func(local kvxfer.PrepID) error {
		t.Helper()
		id, err := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{Local: 0, Remote: 0}}, nil)
		if err != nil {
			return err
		}
		defer func() { _ = a.b.Release(id) }()
		if s, err := settled(t, a.b, id); s != kvxfer.XferDone {
			t.Fatalf("WRITE of list %d ended %v, %v", local, s, err)
		}
		return nil
	}
	if err := a.b.Deregister([]kvxfer.MemRegion{a.r}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		err := write(stale)
		if !errors.Is(err, kvxfer.ErrNotRegistered) || !strings.Contains(err.Error(), fmt.Sprintf("%#x", a.r.Addr+4096)) {
			t.Fatalf("WRITE of a list over deregistered memory = %v, want ErrNotRegistered naming the entry", err)
		}
		if err := write(kept); err != nil {
			t.Fatalf("WRITE of a list over memory still registered: %v", err)
		}
		// Registered again: the list stays stale, a new one works.
		if err := a.b.Register([]kvxfer.MemRegion{a.r}); err != nil {
			t.Fatal(err)
		}
	}
	if err := write(prep("", a.r.Addr)); err != nil {
		t.Fatalf("WRITE of a list prepared after registering again: %v", err)
	}
	if err := a.b.ReleasePrepared(stale); err != nil {
		t.Errorf("ReleasePrepared of a stale list: %v", err)
	}
}
