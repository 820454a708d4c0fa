package kvxfer

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// The producer's request table against a plain map: random inserts,
// removals and lookups, ids hashed for real or onto a few shared hashes
// (whole-hash collisions, which the real seed makes all but impossible),
// a table grown to tens of thousands and shrunk back, every request
// reachable and the table iterating exactly what it holds after each
// operation.
func TestSendTable(t *testing.T) {
	for _, byTID := range []bool{false, true} {
		t.Run(fmt.Sprint("byTID=", byTID), func(t *testing.T) {
			tab := newSendTable(byTID)
			rng := rand.New(rand.NewPCG(7, 8))
			model := map[string]*sendReq{}
			hashes := map[string]uint64{}
			check := func(op int) {
				t.Helper()
				if tab.len() != len(model) {
					t.Fatalf("op %d: len %d, want %d", op, tab.len(), len(model))
				}
				seen := 0
				for s := range tab.all() {
					if model[tab.key(s)] != s {
						t.Fatalf("op %d: iterates %q, not held", op, tab.key(s))
					}
					seen++
				}
				if seen != len(model) {
					t.Fatalf("op %d: iterated %d, want %d", op, seen, len(model))
				}
				for k, s := range model {
					if got := tab.getH(k, hashes[k]); got != s {
						t.Fatalf("op %d: %q finds %p, want %p", op, k, got, s)
					}
				}
			}
			insert := func(k string, fake bool) {
				s := &sendReq{}
				if byTID {
					s.req.TransferID = k
				} else {
					s.req.ReqID = k
				}
				h := tab.hash(k)
				if fake {
					h = uint64(rng.IntN(4)) << 60 // same home slot, same hash
				}
				tab.insert(s, h)
				model[k], hashes[k] = s, h
			}
			remove := func(k string) {
				tab.remove(model[k], hashes[k])
				delete(model, k)
				delete(hashes, k)
			}
			for op := range 20000 {
				k := fmt.Sprintf("r%d", rng.IntN(400))
				switch {
				case model[k] == nil && rng.IntN(3) > 0:
					insert(k, rng.IntN(5) == 0)
				case model[k] != nil && rng.IntN(2) == 0:
					remove(k)
				default:
					if h, ok := hashes[k]; ok {
						if tab.getH(k, h) != model[k] {
							t.Fatalf("op %d: lookup of %q", op, k)
						}
					} else if s := tab.get(k); s != nil {
						t.Fatalf("op %d: finds %q, not held", op, k)
					}
				}
				if op%50 == 0 {
					check(op)
				}
			}
			check(-1)
			// Grow past the shrink threshold, then empty it mostly.
			for i := range 50000 {
				k := fmt.Sprintf("bulk%d", i)
				insert(k, false)
			}
			check(-2)
			grown := len(tab.slots)
			for k := range model {
				if len(model) <= 100 {
					break
				}
				remove(k)
			}
			check(-3)
			if len(tab.slots) >= grown || len(tab.slots) > shrinkSendSlots {
				t.Errorf("table of %d slots after shrinking from %d to %d requests, want at most %d", len(tab.slots), grown, len(model), shrinkSendSlots)
			}
			for k := range model {
				remove(k)
			}
			check(-4)
		})
	}
}

// Removing a request the table does not hold is a bug of the core's, not
// something to step over.
func TestSendTableRemoveMissingPanics(t *testing.T) {
	tab := newSendTable(false)
	a, b := &sendReq{req: SendReq{ReqID: "a"}}, &sendReq{req: SendReq{ReqID: "b"}}
	tab.insert(a, tab.hash("a"))
	defer func() {
		if recover() == nil {
			t.Fatal("remove of a request not held did not panic")
		}
	}()
	tab.remove(b, tab.hash("b"))
}
