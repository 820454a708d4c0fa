package netxfer

import (
	"slices"
	"sync"
	"testing"
	"time"
)

// WireTrace sees every WRITE part of a transfer pass its four points, in
// order, with the sender's transfer id, on the same-host path and over
// TCP; a READ reports none of them.
func TestWireTrace(t *testing.T) {
	for _, path := range []struct {
		name string
		cfg  Config
	}{{"samehost", Config{Conns: 3}}, {"tcp", Config{Conns: 3, DisableSameHost: true}}} {
		t.Run(path.name, func(t *testing.T) {
			type stamp struct {
				ev   WireEvent
				part uint32
				at   time.Time
			}
			var mu sync.Mutex
			got := map[XferID][]stamp{}
			cfg := path.cfg
			cfg.WireTrace = func(ev WireEvent, id XferID, part uint32) {
				mu.Lock()
				got[id] = append(got[id], stamp{ev, part, time.Now()})
				mu.Unlock()
			}
			a, b, _, _ := localPair(t, 1<<20, cfg)
			id, err := a.Post(Write, b.Name(), scattered(30, 4096), []byte("n"))
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, id); s != Done {
				t.Fatalf("write: %v, %v", s, err)
			}
			rid, err := a.Post(Read, b.Name(), scattered(30, 4096), nil)
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, rid); s != Done {
				t.Fatalf("read: %v, %v", s, err)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(got[rid]) > 0 {
				t.Errorf("the READ reported %v", got[rid])
			}
			order := []WireEvent{WirePartSent, WirePartRead, WireAnswerSent, WireAnswerRead}
			for part := range uint32(3) {
				var evs []WireEvent
				var last time.Time
				for _, s := range got[id] {
					if s.part != part {
						continue
					}
					if s.at.Before(last) {
						t.Errorf("part %d: %v came before the event it follows", part, s.ev)
					}
					evs, last = append(evs, s.ev), s.at
				}
				if !slices.Equal(evs, order) {
					t.Errorf("part %d of the WRITE reported %v, want %v", part, evs, order)
				}
			}
			if len(got) != 1 {
				t.Errorf("events for %d transfers, want the WRITE's only: %v", len(got), got)
			}
		})
	}
}
