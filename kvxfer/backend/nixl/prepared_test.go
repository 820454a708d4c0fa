//go:build linux

package nixl

import (
	"bytes"
	"errors"
	"testing"
	"time"

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
	id, postErr := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{0, 0}}, nil)
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
	if _, err := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{0, 0}}, nil); err == nil {
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
	if _, err := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{0, 0}}, nil); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("PostPrepared after Close = %v, want ErrClosed", err)
	}
	if err := a.b.ReleasePrepared(local); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("ReleasePrepared after Close = %v, want ErrClosed", err)
	}
	if _, err := a.b.Prepare("", []hotpath.Entry{{Addr: a.r.Addr, Len: 4096}}); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("Prepare after Close = %v, want ErrClosed", err)
	}
}
