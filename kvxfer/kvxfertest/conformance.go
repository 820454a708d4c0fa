package kvxfertest

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// Harness makes backends for the conformance suite.
type Harness interface {
	// New returns a new backend agent with n bytes of memory it can
	// register (not registered yet), and those bytes. The suite closes
	// the backend.
	New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte)
}

// Conformance runs the backend conformance suite: what every Backend
// (fake, built-in, NIXL) must do for the connector to be correct.
func Conformance(t *testing.T, h Harness) {
	t.Run("RegisterDeregister", func(t *testing.T) { confRegister(t, h) })
	t.Run("MetadataRoundTrip", func(t *testing.T) { confMetadata(t, h) })
	t.Run("WriteThenNotify", func(t *testing.T) { confWriteRead(t, h, hotpath.OpWrite) })
	t.Run("ReadThenNotify", func(t *testing.T) { confWriteRead(t, h, hotpath.OpRead) })
	t.Run("Bounds", func(t *testing.T) { confBounds(t, h) })
	t.Run("PeerLoss", func(t *testing.T) { confPeerLoss(t, h) })
	t.Run("Concurrent", func(t *testing.T) { confConcurrent(t, h) })
	t.Run("Large", func(t *testing.T) { confLarge(t, h) })
	t.Run("NotificationBurst", func(t *testing.T) { confBurst(t, h) })
	t.Run("CloseIdempotent", func(t *testing.T) { confClose(t, h) })
}

type end struct {
	b   kvxfer.Backend
	r   kvxfer.MemRegion
	mem []byte
}

func pairUp(t *testing.T, h Harness, n int) (a, b end) {
	t.Helper()
	mk := func() end {
		be, r, mem := h.New(t, n)
		t.Cleanup(func() { _ = be.Close() })
		if err := be.Register([]kvxfer.MemRegion{r}); err != nil {
			t.Fatalf("Register: %v", err)
		}
		return end{be, r, mem}
	}
	a, b = mk(), mk()
	return a, b
}

func load(t *testing.T, from, to kvxfer.Backend) kvxfer.PeerName {
	t.Helper()
	meta, err := to.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	name, err := from.LoadPeer(meta)
	if err != nil {
		t.Fatalf("LoadPeer: %v", err)
	}
	return name
}

// waitXfer polls a transfer until it leaves in-progress (bounded).
func waitXfer(t *testing.T, be kvxfer.Backend, id kvxfer.XferID) (kvxfer.XferState, error) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := be.State(id)
		if s != kvxfer.XferInProgress || time.Now().After(deadline) {
			return s, err
		}
		select {
		case <-be.Events():
		case <-time.After(time.Millisecond):
		}
	}
}

// waitNotifs drains until n notifications arrived (bounded).
func waitNotifs(t *testing.T, be kvxfer.Backend, n int, check func(kvxfer.Notif)) []kvxfer.Notif {
	t.Helper()
	var got []kvxfer.Notif
	deadline := time.Now().Add(30 * time.Second)
	for len(got) < n && time.Now().Before(deadline) {
		before := len(got)
		got = be.DrainNotifs(got)
		if check != nil {
			for _, x := range got[before:] {
				check(x)
			}
		}
		if len(got) < n {
			select {
			case <-be.Events():
			case <-time.After(time.Millisecond):
			}
		}
	}
	return got
}

func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
}

func confRegister(t *testing.T, h Harness) {
	be, r, _ := h.New(t, 1<<16)
	defer be.Close()
	if err := be.Register([]kvxfer.MemRegion{r}); err != nil {
		t.Fatalf("Register: %v", err)
	}
	if err := be.Deregister([]kvxfer.MemRegion{r}); err != nil {
		t.Fatalf("Deregister: %v", err)
	}
	if err := be.Deregister([]kvxfer.MemRegion{r}); !errors.Is(err, kvxfer.ErrNotRegistered) {
		t.Errorf("second Deregister = %v, want ErrNotRegistered", err)
	}
	outside := kvxfer.MemRegion{Addr: r.Addr + r.Len + 1<<20, Len: 4096, Kind: r.Kind}
	if err := be.Register([]kvxfer.MemRegion{outside}); err == nil {
		t.Error("registering memory the backend was never given succeeded")
	}
}

func confMetadata(t *testing.T, h Harness) {
	a, b := pairUp(t, h, 4096)
	name := load(t, a.b, b.b)
	if name == "" {
		t.Error("LoadPeer returned an empty name")
	}
	if again := load(t, a.b, b.b); again != name {
		t.Errorf("loading the same metadata twice gave %q then %q", name, again)
	}
	if _, err := a.b.LoadPeer([]byte("not metadata")); err == nil {
		t.Error("LoadPeer accepted garbage")
	}
	if err := a.b.InvalidatePeer(name); err != nil {
		t.Errorf("InvalidatePeer: %v", err)
	}
	if _, err := a.b.Post(hotpath.OpWrite, name, nil, nil); err == nil {
		t.Error("Post to an invalidated peer succeeded")
	}
}

// confWriteRead: bytes land before the notification is seen, in both
// directions, over scattered descriptors.
func confWriteRead(t *testing.T, h Harness, op hotpath.Op) {
	a, b := pairUp(t, h, 1<<20)
	peer := load(t, a.b, b.b)
	load(t, b.b, a.b)
	pattern(a.mem, 1)
	pattern(b.mem, 2)
	var descs []hotpath.Desc
	for i := range 100 {
		descs = append(descs, hotpath.Desc{Local: a.r.Addr + uint64(i)*8192, Remote: b.r.Addr + uint64(99-i)*8192 + 128, Len: 3000})
	}
	src, dst := a.mem, b.mem
	if op == hotpath.OpRead {
		src, dst = b.mem, a.mem
	}
	want := bytes.Clone(dst)
	for _, d := range descs {
		lo, ro := d.Local-a.r.Addr, d.Remote-b.r.Addr
		if op == hotpath.OpWrite {
			copy(want[ro:ro+d.Len], src[lo:lo+d.Len])
		} else {
			copy(want[lo:lo+d.Len], src[ro:ro+d.Len])
		}
	}
	id, err := a.b.Post(op, peer, descs, []byte("landed"))
	if err != nil {
		t.Fatalf("Post: %v", err)
	}
	if op == hotpath.OpWrite {
		// The peer sees the notification only after every byte.
		got := waitNotifs(t, b.b, 1, func(kvxfer.Notif) {
			if !bytes.Equal(b.mem, want) {
				t.Error("notification seen before every byte landed")
			}
		})
		if len(got) != 1 || string(got[0].Msg) != "landed" {
			t.Fatalf("notifications = %+v, want one 'landed'", got)
		}
	}
	if s, err := waitXfer(t, a.b, id); s != kvxfer.XferDone || err != nil {
		t.Fatalf("State = %v, %v; want done", s, err)
	}
	if !bytes.Equal(dst, want) {
		t.Fatal("destination bytes differ")
	}
	if op == hotpath.OpRead {
		if got := waitNotifs(t, b.b, 1, nil); len(got) != 1 || string(got[0].Msg) != "landed" {
			t.Errorf("READ notification at the source = %+v", got)
		}
	}
	if err := a.b.Release(id); err != nil {
		t.Errorf("Release: %v", err)
	}
	if _, err := a.b.State(id); err == nil {
		t.Error("State after Release succeeded")
	}
}

func confBounds(t *testing.T, h Harness) {
	a, b := pairUp(t, h, 1<<16)
	peer := load(t, a.b, b.b)
	pattern(a.mem, 3)
	before := bytes.Clone(b.mem)
	for _, d := range []hotpath.Desc{
		{Local: a.r.Addr, Remote: b.r.Addr + b.r.Len - 8, Len: 64},
		{Local: a.r.Addr, Remote: b.r.Addr - 64, Len: 32},
		{Local: a.r.Addr, Remote: ^uint64(0) - 8, Len: 64},
	} {
		id, err := a.b.Post(hotpath.OpWrite, peer, []hotpath.Desc{d}, []byte("x"))
		if err == nil {
			if s, _ := waitXfer(t, a.b, id); s != kvxfer.XferFailed {
				t.Errorf("out-of-bounds WRITE %+v ended %v, want failed", d, s)
			}
		}
	}
	if _, err := a.b.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: a.r.Addr + a.r.Len, Remote: b.r.Addr, Len: 1}}, nil); err == nil {
		t.Error("a WRITE from outside local registered memory was posted")
	}
	if !bytes.Equal(b.mem, before) {
		t.Error("an out-of-bounds WRITE changed the destination")
	}
	if got := b.b.DrainNotifs(nil); len(got) != 0 {
		t.Errorf("refused transfers delivered %d notifications", len(got))
	}
}

func confPeerLoss(t *testing.T, h Harness) {
	a, b := pairUp(t, h, 1<<16)
	peer := load(t, a.b, b.b)
	_ = b.b.Close()
	id, err := a.b.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: a.r.Addr, Remote: b.r.Addr, Len: 4096}}, []byte("x"))
	if err != nil {
		return // refused at once: fine
	}
	if s, err := waitXfer(t, a.b, id); s != kvxfer.XferFailed || err == nil {
		t.Errorf("WRITE to a closed peer = %v, %v; want failed with a reason", s, err)
	}
}

func confConcurrent(t *testing.T, h Harness) {
	const g, each, size = 8, 32, 1024
	a, b := pairUp(t, h, g*each*size)
	peer := load(t, a.b, b.b)
	pattern(a.mem, 5)
	var wg sync.WaitGroup
	errs := make(chan error, g*each)
	for w := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				off := uint64((w*each + i) * size)
				id, err := a.b.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: a.r.Addr + off, Remote: b.r.Addr + off, Len: size}}, []byte(fmt.Sprint(w, "/", i)))
				if err != nil {
					errs <- err
					continue
				}
				deadline := time.Now().Add(30 * time.Second)
				for {
					s, err := a.b.State(id)
					if s == kvxfer.XferDone {
						break
					}
					if s == kvxfer.XferFailed || err != nil || time.Now().After(deadline) {
						errs <- fmt.Errorf("transfer %d/%d: %v, %v", w, i, s, err)
						break
					}
					time.Sleep(100 * time.Microsecond)
				}
				_ = a.b.Release(id)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if !bytes.Equal(a.mem, b.mem) {
		t.Error("bytes differ after concurrent transfers")
	}
	if got := waitNotifs(t, b.b, g*each, nil); len(got) != g*each {
		t.Errorf("%d notifications, want %d", len(got), g*each)
	}
}

func confLarge(t *testing.T, h Harness) {
	size := 32 << 20
	if testing.Short() {
		size = 4 << 20
	}
	a, b := pairUp(t, h, size)
	peer := load(t, a.b, b.b)
	pattern(a.mem, 9)
	var descs []hotpath.Desc
	for off := 0; off < size; off += 1 << 20 {
		descs = append(descs, hotpath.Desc{Local: a.r.Addr + uint64(off), Remote: b.r.Addr + uint64(off), Len: 1 << 20})
	}
	id, err := a.b.Post(hotpath.OpWrite, peer, descs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := waitXfer(t, a.b, id); s != kvxfer.XferDone {
		t.Fatalf("State = %v, %v", s, err)
	}
	if !bytes.Equal(a.mem, b.mem) {
		t.Error("bytes differ")
	}
}

func confBurst(t *testing.T, h Harness) {
	a, b := pairUp(t, h, 4096)
	peer := load(t, a.b, b.b)
	const n = 1000
	for i := range n {
		if err := a.b.Notify(peer, []byte(fmt.Sprint(i))); err != nil {
			t.Fatalf("Notify %d: %v", i, err)
		}
	}
	got := waitNotifs(t, b.b, n, nil)
	seen := map[string]bool{}
	for _, x := range got {
		seen[string(x.Msg)] = true
	}
	if len(got) != n || len(seen) != n {
		t.Errorf("%d notifications (%d distinct), want %d", len(got), len(seen), n)
	}
}

func confClose(t *testing.T, h Harness) {
	be, _, _ := h.New(t, 4096)
	if err := be.Close(); err != nil {
		t.Fatal(err)
	}
	if err := be.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
	if _, err := be.Post(hotpath.OpWrite, "x", nil, nil); err == nil {
		t.Error("Post after Close succeeded")
	}
}
