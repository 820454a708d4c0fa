//go:build linux

package nixl

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// devEnd is newCloseEnd with its memory registered as device dev's.
func devEnd(t *testing.T, dev int32) closeEnd {
	t.Helper()
	be, err := New(Config{Name: fmt.Sprint(t.Name(), "-dev", dev, "-", rand.Uint64()), Params: testParams()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = be.Close() })
	mem := make([]byte, 1<<16)
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if err := be.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	r := kvxfer.MemRegion{Addr: base, Len: uint64(len(mem)), Dev: dev, Kind: kvxfer.MemDRAM}
	if err := be.Register([]kvxfer.MemRegion{r}); err != nil {
		t.Fatal(err)
	}
	return closeEnd{be, r, mem}
}

// Post hands NIXL each descriptor's device ids (hotpath.Desc's LocalDev
// and RemoteDev), as Register and Prepare do: NIXL finds the registered
// memory of a descriptor by device and address. Before, Post named device
// 0 for every descriptor, so memory registered as another device's (the
// KV cache of a rank on GPU 1 and up: WorkerConfig regions carry their
// DeviceID) could be moved by PostPrepared but never by Post: "no
// specified or potential backend had the required registrations".
func TestPostDeviceIDs(t *testing.T) {
	a, b := devEnd(t, 1), devEnd(t, 2)
	for i := range a.mem {
		a.mem[i] = byte(i*5 + 1)
	}
	peer := linked(t, a, b)
	for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
		clear(b.mem)
		if op == hotpath.OpRead {
			copy(b.mem, a.mem)
			clear(a.mem[:8192])
		}
		ds := []hotpath.Desc{
			{Local: a.r.Addr, Remote: b.r.Addr, Len: 4096, LocalDev: 1, RemoteDev: 2},
			{Local: a.r.Addr + 4096, Remote: b.r.Addr + 4096, Len: 4096, LocalDev: 1, RemoteDev: 2},
		}
		id, err := a.b.Post(op, peer, ds, nil)
		if err != nil {
			t.Fatalf("%v between devices 1 and 2: %v", op, err)
		}
		if s, err := settled(t, a.b, id); s != kvxfer.XferDone {
			t.Fatalf("%v ended %v, %v", op, s, err)
		}
		_ = a.b.Release(id)
		if !bytes.Equal(a.mem[:8192], b.mem[:8192]) {
			t.Errorf("%v did not land", op)
		}
	}
	// A descriptor naming a device its memory is not registered on is
	// refused.
	for _, d := range []hotpath.Desc{
		{Local: a.r.Addr, Remote: b.r.Addr, Len: 4096, LocalDev: 0, RemoteDev: 2},
		{Local: a.r.Addr, Remote: b.r.Addr, Len: 4096, LocalDev: 1, RemoteDev: 1},
	} {
		if id, err := a.b.Post(hotpath.OpWrite, peer, []hotpath.Desc{d}, nil); err == nil {
			s, _ := settled(t, a.b, id)
			_ = a.b.Release(id)
			if s != kvxfer.XferFailed {
				t.Errorf("a WRITE of %+v was made (%v)", d, s)
			}
		}
	}
}
