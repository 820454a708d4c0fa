package kvxfertest

import (
	"bytes"
	"errors"
	"sync"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// pair returns two connected agents p and d, each with one registered
// 4 KiB region, p's filled with a pattern.
func pair(t *testing.T) (*Fabric, *Agent, *Agent, kvxfer.MemRegion, kvxfer.MemRegion) {
	t.Helper()
	f := NewFabric()
	p, err := f.NewAgent("p")
	if err != nil {
		t.Fatal(err)
	}
	d, err := f.NewAgent("d")
	if err != nil {
		t.Fatal(err)
	}
	pr, dr := p.Alloc(4096, 0), d.Alloc(4096, 1)
	if err := p.Register([]kvxfer.MemRegion{pr}); err != nil {
		t.Fatal(err)
	}
	if err := d.Register([]kvxfer.MemRegion{dr}); err != nil {
		t.Fatal(err)
	}
	for i, b := 0, p.Bytes(pr.Addr, pr.Len); i < len(b); i++ {
		b[i] = byte(i*7 + 3)
	}
	connect(t, p, d)
	connect(t, d, p)
	return f, p, d, pr, dr
}

func connect(t *testing.T, a, b *Agent) {
	t.Helper()
	meta, err := b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	name, err := a.LoadPeer(meta)
	if err != nil || name != b.Name() {
		t.Fatalf("LoadPeer = %q, %v, want %q", name, err, b.Name())
	}
}

func wait(t *testing.T, a *Agent, id kvxfer.XferID) (kvxfer.XferState, error) {
	t.Helper()
	st, err := a.State(id)
	if st == kvxfer.XferInProgress {
		t.Fatalf("transfer %d still in progress", id)
	}
	return st, err
}

func TestWriteLandsBeforeNotification(t *testing.T) {
	_, p, d, pr, dr := pair(t)
	descs := []hotpath.Desc{{Local: pr.Addr + 100, Remote: dr.Addr + 2000, Len: 300}, {Local: pr.Addr, Remote: dr.Addr, Len: 50}}
	id, err := p.Post(hotpath.OpWrite, d.Name(), descs, []byte("req-1:1"))
	if err != nil {
		t.Fatal(err)
	}
	// The notification is visible only with the bytes already in place.
	notifs := d.DrainNotifs(nil)
	if len(notifs) != 1 || string(notifs[0].Msg) != "req-1:1" || notifs[0].From != p.Name() {
		t.Fatalf("DrainNotifs = %+v, want one req-1:1 from p", notifs)
	}
	for _, ds := range descs {
		if !bytes.Equal(d.Bytes(ds.Remote, ds.Len), p.Bytes(ds.Local, ds.Len)) {
			t.Fatalf("bytes of %+v differ after the notification", ds)
		}
	}
	if st, err := wait(t, p, id); st != kvxfer.XferDone || err != nil {
		t.Fatalf("State = %v, %v, want done", st, err)
	}
	if err := p.Release(id); err != nil {
		t.Fatal(err)
	}
	if _, err := p.State(id); !errors.Is(err, kvxfer.ErrUnknownXfer) {
		t.Fatalf("State after Release = %v, want ErrUnknownXfer", err)
	}
}

func TestReadPullsRemoteBytes(t *testing.T) {
	_, p, d, pr, dr := pair(t)
	id, err := d.Post(hotpath.OpRead, p.Name(), []hotpath.Desc{{Local: dr.Addr + 8, Remote: pr.Addr + 16, Len: 64}}, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := wait(t, d, id); st != kvxfer.XferDone {
		t.Fatalf("State = %v", st)
	}
	if !bytes.Equal(d.Bytes(dr.Addr+8, 64), p.Bytes(pr.Addr+16, 64)) {
		t.Fatal("READ did not copy the remote bytes")
	}
	if n := p.DrainNotifs(nil); len(n) != 1 {
		t.Fatalf("the READ's notification reached P %d times, want 1", len(n))
	}
}

// TestBoundsChecked: a descriptor outside registered memory on either
// side is refused at Post and moves nothing.
func TestBoundsChecked(t *testing.T) {
	_, p, d, pr, dr := pair(t)
	unregistered := d.Alloc(64, 0)
	for _, tc := range []struct {
		name string
		desc hotpath.Desc
	}{
		{"remote past the region's end", hotpath.Desc{Local: pr.Addr, Remote: dr.Addr + 4000, Len: 200}},
		{"local before the region", hotpath.Desc{Local: pr.Addr - 8, Remote: dr.Addr, Len: 16}},
		{"remote allocated but not registered", hotpath.Desc{Local: pr.Addr, Remote: unregistered.Addr, Len: 8}},
		{"length wraps the address space", hotpath.Desc{Local: pr.Addr, Remote: dr.Addr + 1, Len: ^uint64(0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := append([]byte(nil), d.Bytes(dr.Addr, dr.Len)...)
			_, err := p.Post(hotpath.OpWrite, d.Name(), []hotpath.Desc{{Local: pr.Addr, Remote: dr.Addr, Len: 8}, tc.desc}, nil)
			if !errors.Is(err, kvxfer.ErrOutOfBounds) {
				t.Fatalf("Post = %v, want ErrOutOfBounds", err)
			}
			if !bytes.Equal(before, d.Bytes(dr.Addr, dr.Len)) {
				t.Fatal("a refused batch moved bytes")
			}
		})
	}
}

func TestPeerErrors(t *testing.T) {
	f, p, d, pr, dr := pair(t)
	if _, err := p.LoadPeer([]byte("garbage")); !errors.Is(err, kvxfer.ErrBadMetadata) {
		t.Fatalf("LoadPeer(garbage) = %v, want ErrBadMetadata", err)
	}
	lonely, _ := f.NewAgent("lonely")
	if _, err := lonely.Post(hotpath.OpWrite, d.Name(), nil, nil); !errors.Is(err, kvxfer.ErrUnknownPeer) {
		t.Fatalf("Post to an unloaded peer = %v, want ErrUnknownPeer", err)
	}
	// Invalidating a peer fails its transfers that have not run.
	f.Faults().Stall(d.Name())
	id, err := p.Post(hotpath.OpWrite, d.Name(), []hotpath.Desc{{Local: pr.Addr, Remote: dr.Addr, Len: 8}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.InvalidatePeer(d.Name()); err != nil {
		t.Fatal(err)
	}
	f.Faults().Unstall(d.Name())
	if st, err := p.State(id); st != kvxfer.XferFailed || !errors.Is(err, kvxfer.ErrXferFailed) {
		t.Fatalf("State after InvalidatePeer = %v, %v, want failed", st, err)
	}
	if _, err := p.Post(hotpath.OpWrite, d.Name(), nil, nil); !errors.Is(err, kvxfer.ErrUnknownPeer) {
		t.Fatalf("Post after InvalidatePeer = %v, want ErrUnknownPeer", err)
	}
}

func TestFaults(t *testing.T) {
	one := func(pr, dr kvxfer.MemRegion) []hotpath.Desc {
		return []hotpath.Desc{{Local: pr.Addr, Remote: dr.Addr, Len: 32}}
	}
	t.Run("failed registration", func(t *testing.T) {
		f := NewFabric()
		a, _ := f.NewAgent("a")
		f.Faults().FailRegister(1)
		r := a.Alloc(16, 0)
		if err := a.Register([]kvxfer.MemRegion{r}); !errors.Is(err, ErrInjected) {
			t.Fatalf("Register = %v, want ErrInjected", err)
		}
		if err := a.Register([]kvxfer.MemRegion{r}); err != nil {
			t.Fatalf("second Register = %v, want nil (one fault armed)", err)
		}
	})
	t.Run("failed handshake", func(t *testing.T) {
		f, p, d, _, _ := pair(t)
		f.Faults().FailHandshake(1)
		meta, _ := d.LocalMetadata()
		if _, err := p.LoadPeer(meta); !errors.Is(err, ErrInjected) {
			t.Fatalf("LoadPeer = %v, want ErrInjected", err)
		}
	})
	t.Run("failed transfer moves nothing and notifies nobody", func(t *testing.T) {
		f, p, d, pr, dr := pair(t)
		f.Faults().FailTransfers(1)
		id, err := p.Post(hotpath.OpWrite, d.Name(), one(pr, dr), []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if st, err := p.State(id); st != kvxfer.XferFailed || !errors.Is(err, ErrInjected) && !errors.Is(err, kvxfer.ErrXferFailed) {
			t.Fatalf("State = %v, %v, want failed", st, err)
		}
		if d.Bytes(dr.Addr, 1)[0] != 0 || len(d.DrainNotifs(nil)) != 0 {
			t.Fatal("a failed transfer moved bytes or notified")
		}
	})
	t.Run("corrupted transfer", func(t *testing.T) {
		f, p, d, pr, dr := pair(t)
		f.Faults().CorruptTransfers(1)
		id, _ := p.Post(hotpath.OpWrite, d.Name(), one(pr, dr), nil)
		if st, _ := p.State(id); st != kvxfer.XferDone {
			t.Fatalf("State = %v, want done (corruption is silent)", st)
		}
		if bytes.Equal(d.Bytes(dr.Addr, 32), p.Bytes(pr.Addr, 32)) {
			t.Fatal("the corrupted transfer delivered intact bytes")
		}
	})
	t.Run("stalled peer", func(t *testing.T) {
		f, p, d, pr, dr := pair(t)
		f.Faults().Stall(d.Name())
		id, _ := p.Post(hotpath.OpWrite, d.Name(), one(pr, dr), []byte("n"))
		if st, _ := p.State(id); st != kvxfer.XferInProgress || len(d.DrainNotifs(nil)) != 0 {
			t.Fatalf("State while stalled = %v, want in progress and no notification", st)
		}
		f.Faults().Unstall(d.Name())
		if st, _ := p.State(id); st != kvxfer.XferDone || len(d.DrainNotifs(nil)) != 1 {
			t.Fatalf("State after Unstall = %v, want done with one notification", st)
		}
	})
	t.Run("dropped, duplicated, delayed and reordered notifications", func(t *testing.T) {
		f, p, d, _, _ := pair(t)
		fl := f.Faults()
		fl.DropNotifs(1)
		_ = p.Notify(d.Name(), []byte("a")) // dropped
		fl.DuplicateNotifs(1)
		_ = p.Notify(d.Name(), []byte("b")) // twice
		fl.DelayNotifs(1)
		_ = p.Notify(d.Name(), []byte("c")) // held
		fl.ReorderNotifs(1)
		_ = p.Notify(d.Name(), []byte("d")) // jumps the queue
		got := msgs(d.DrainNotifs(nil))
		if got != "d,b,b" {
			t.Fatalf("notifications = %s, want d,b,b", got)
		}
		if n := fl.DeliverDelayed(); n != 1 || msgs(d.DrainNotifs(nil)) != "c" {
			t.Fatalf("DeliverDelayed = %d, want the held c", n)
		}
		fl.FailNotify(1)
		if err := p.Notify(d.Name(), []byte("e")); !errors.Is(err, ErrInjected) {
			t.Fatalf("Notify = %v, want ErrInjected", err)
		}
	})
}

func msgs(ns []kvxfer.Notif) string {
	var b []byte
	for i, n := range ns {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, n.Msg...)
	}
	return string(b)
}

func TestCloseIsIdempotent(t *testing.T) {
	f, p, d, pr, dr := pair(t)
	f.Faults().Stall(d.Name())
	id, _ := p.Post(hotpath.OpWrite, d.Name(), []hotpath.Desc{{Local: pr.Addr, Remote: dr.Addr, Len: 8}}, nil)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close = %v, want nil", err)
	}
	if _, err := p.State(id); !errors.Is(err, kvxfer.ErrClosed) {
		t.Fatalf("State after Close = %v, want ErrClosed", err)
	}
	if _, err := p.Post(hotpath.OpWrite, d.Name(), nil, nil); !errors.Is(err, kvxfer.ErrClosed) {
		t.Fatalf("Post after Close = %v, want ErrClosed", err)
	}
	// The peer's transfers to a closed agent fail instead of hanging.
	f.Faults().Unstall(p.Name())
	id2, err := d.Post(hotpath.OpWrite, p.Name(), []hotpath.Desc{{Local: dr.Addr, Remote: pr.Addr, Len: 8}}, nil)
	if err == nil {
		if st, _ := d.State(id2); st != kvxfer.XferFailed {
			t.Fatalf("transfer to a closed peer = %v, want failed", st)
		}
	} else if !errors.Is(err, kvxfer.ErrClosed) && !errors.Is(err, kvxfer.ErrOutOfBounds) {
		t.Fatalf("Post to a closed peer = %v", err)
	}
}

// TestConcurrentTransfers hammers one pair from several goroutines in both
// directions; run with -race.
func TestConcurrentTransfers(t *testing.T) {
	_, p, d, pr, dr := pair(t)
	workers, per := 8, 200
	if testing.Short() {
		workers, per = 4, 50
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < per; i++ {
				off := uint64((w*per + i) % 64 * 64)
				a, peer, local, remote := p, d.Name(), pr.Addr+off, dr.Addr+off
				if i%2 == 1 {
					a, peer, local, remote = d, p.Name(), dr.Addr+off, pr.Addr+off
				}
				id, err := a.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: local, Remote: remote, Len: 64}}, []byte("x"))
				if err != nil {
					t.Error(err)
					return
				}
				if st, err := a.State(id); st != kvxfer.XferDone || err != nil {
					t.Errorf("State = %v, %v", st, err)
					return
				}
				if err := a.Release(id); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := len(p.DrainNotifs(nil)) + len(d.DrainNotifs(nil)); n != workers*per {
		t.Fatalf("%d notifications, want %d", n, workers*per)
	}
}
