package netxfer

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

type guardFunc func(peer string, op Op, addr, n uint64) Verdict

func (f guardFunc) Check(peer string, op Op, addr, n uint64) Verdict { return f(peer, op, addr, n) }

// A guarded agent moves only the bytes its guard allows, for the peer it
// allows them to: a late range fails the transfer (ErrNotGranted) and
// keeps the connection, a denied one also drops the connection; nothing
// refused lands or leaves, and allowed transfers carry on. The same holds
// for the direct copy between agents of one process.
func TestGuard(t *testing.T) {
	const page = 4096
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			a, b, am, bm := pairOf(t, 16*page, direct)
			fill(am, 1)
			fill(bm, 2)
			var mu sync.Mutex
			var asked []string
			// Pages 0-3: a may write; 4-7: a may read; 8-11: late for
			// both; the rest: denied. Only a has grants.
			err := b.SetGuard(guardFunc(func(peer string, op Op, addr, n uint64) Verdict {
				mu.Lock()
				asked = append(asked, peer)
				mu.Unlock()
				p := (addr - base) / page
				last := (addr + n - 1 - base) / page
				switch {
				case peer != a.Name():
					return Deny
				case last < 4 && op == Write, p >= 4 && last < 8 && op == Read:
					return Allow
				case p >= 8 && last < 12:
					return Late
				}
				return Deny
			}))
			if err != nil {
				t.Fatal(err)
			}
			if err := b.SetGuard(guardFunc(nil)); err == nil {
				t.Fatal("a second SetGuard succeeded; want one guard per agent")
			}
			post := func(op Op, remote uint64, n uint64) error {
				t.Helper()
				_ = b.Drain(nil) // orders our reads before the server's writes, likewise
				id, err := a.Post(op, b.Name(), []Desc{{Local: base + 12*page, Remote: remote, Len: n}}, nil)
				if err != nil {
					return err
				}
				st, err := wait(t, a, id)
				// The server takes b.mu after landing bytes: taking it here
				// orders its writes before our reads for the race detector
				// (the TCP answer does not).
				_ = b.Drain(nil)
				if st == Done {
					return nil
				}
				if err == nil {
					t.Fatalf("state %v without an error", st)
				}
				return err
			}
			before := bytes.Clone(bm)
			if err := post(Write, base+page, 2*page); err != nil {
				t.Fatalf("granted WRITE: %v", err)
			}
			copy(before[page:3*page], am[12*page:14*page])
			if !bytes.Equal(bm, before) {
				t.Fatal("granted WRITE: the bytes did not land")
			}
			if err := post(Read, base+4*page, page); err != nil {
				t.Fatalf("granted READ: %v", err)
			}
			if !bytes.Equal(am[12*page:13*page], bm[4*page:5*page]) {
				t.Fatal("granted READ: the bytes did not arrive")
			}
			mine := bytes.Clone(am)
			for _, c := range []struct {
				name   string
				op     Op
				remote uint64
				n      uint64
				drop   bool
			}{
				{"write read-only pages", Write, base + 4*page, page, true},
				{"write across a grant's end", Write, base + 3*page, 2 * page, true},
				{"write late pages", Write, base + 8*page, page, false},
				{"read write-only pages", Read, base, page, true},
				{"read late pages", Read, base + 9*page, 2 * page, false},
				{"read ungranted pages", Read, base + 14*page, page, true},
			} {
				_, denied0 := b.Refusals()
				err := post(c.op, c.remote, c.n)
				if !errors.Is(err, ErrNotGranted) && (!c.drop || direct) {
					t.Errorf("%s: err = %v, want ErrNotGranted", c.name, err)
				}
				if err == nil {
					t.Errorf("%s: succeeded", c.name)
				}
				if !bytes.Equal(bm, before) || !bytes.Equal(am, mine) {
					t.Fatalf("%s: bytes moved", c.name)
				}
				if _, denied := b.Refusals(); c.drop != (denied > denied0) {
					t.Errorf("%s: denied refusals %d -> %d, want a denial %v", c.name, denied0, denied, c.drop)
				}
				if !direct && c.drop && !strings.Contains(fmt.Sprint(err), "lost") {
					// The connection it came on is dropped: the client
					// sees it go, not an answer.
					t.Errorf("%s: err = %v, want the connection lost", c.name, err)
				}
				// Allowed transfers carry on (redialing where needed).
				if err := post(Write, base, page); err != nil {
					t.Fatalf("after %s: granted WRITE: %v", c.name, err)
				}
				copy(before[:page], am[12*page:13*page])
			}
			if late, denied := b.Refusals(); late != 2 || denied != 4 {
				t.Errorf("refusals: %d late, %d denied, want 2 and 4", late, denied)
			}
			for _, p := range asked {
				if p != a.Name() {
					t.Errorf("guard asked about peer %q, want only %q", p, a.Name())
				}
			}
			// Notifications are not memory: they pass.
			if err := a.Notify(b.Name(), []byte("hi")); err != nil {
				t.Fatal(err)
			}
			if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "hi" {
				t.Fatalf("notifications = %+v", n)
			}
		})
	}
}
