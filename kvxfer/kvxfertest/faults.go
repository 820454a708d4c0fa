package kvxfertest

import (
	"errors"
	"sync"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// ErrInjected is the error of every injected failure.
var ErrInjected = errors.New("kvxfertest: injected fault")

// Faults arms failures in a fabric. Each arming counts: FailTransfers(2)
// fails the next two transfers posted anywhere in the fabric. It is safe
// for concurrent use.
type Faults struct {
	mu              sync.Mutex
	failRegister    int
	failLoadPeer    int
	failTransfer    int
	corruptTransfer int
	failNotify      int
	dropNotif       int
	delayNotif      int
	duplicateNotif  int
	reorderNotif    int
	stalled         map[kvxfer.PeerName]bool
	held            []heldNotif
}

type heldNotif struct {
	to *Agent
	n  kvxfer.Notif
}

func (f *Faults) arm(c *int, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	*c += n
}

// take consumes one armed fault of a kind and reports it as ErrInjected.
func (f *Faults) take(c *int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if *c <= 0 {
		return nil
	}
	*c--
	return ErrInjected
}

// FailRegister fails the next n Register calls.
func (f *Faults) FailRegister(n int) { f.arm(&f.failRegister, n) }

// FailHandshake fails the next n LoadPeer calls (the metadata exchange).
func (f *Faults) FailHandshake(n int) { f.arm(&f.failLoadPeer, n) }

// FailTransfers makes the next n posted transfers end failed, moving no
// bytes and delivering no notification.
func (f *Faults) FailTransfers(n int) { f.arm(&f.failTransfer, n) }

// CorruptTransfers makes the next n posted transfers flip the first byte
// they write, and still report done.
func (f *Faults) CorruptTransfers(n int) { f.arm(&f.corruptTransfer, n) }

// FailNotify fails the next n bare Notify calls.
func (f *Faults) FailNotify(n int) { f.arm(&f.failNotify, n) }

// DropNotifs silently drops the next n delivered notifications.
func (f *Faults) DropNotifs(n int) { f.arm(&f.dropNotif, n) }

// DelayNotifs holds the next n notifications until DeliverDelayed.
func (f *Faults) DelayNotifs(n int) { f.arm(&f.delayNotif, n) }

// DuplicateNotifs delivers the next n notifications twice.
func (f *Faults) DuplicateNotifs(n int) { f.arm(&f.duplicateNotif, n) }

// ReorderNotifs puts the next n notifications ahead of those already
// waiting in the receiver's inbox.
func (f *Faults) ReorderNotifs(n int) { f.arm(&f.reorderNotif, n) }

// Stall keeps transfers to peer in progress (no byte moves) until Unstall.
func (f *Faults) Stall(peer kvxfer.PeerName) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stalled[peer] = true
}

// Unstall lets transfers to peer run on their next State poll.
func (f *Faults) Unstall(peer kvxfer.PeerName) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.stalled, peer)
}

func (f *Faults) isStalled(peer kvxfer.PeerName) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stalled[peer]
}

func (f *Faults) hold(to *Agent, n kvxfer.Notif) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.held = append(f.held, heldNotif{to, n})
}

// DeliverDelayed delivers the notifications held by DelayNotifs, in the
// order they were held, and returns how many.
func (f *Faults) DeliverDelayed() int {
	f.mu.Lock()
	held := f.held
	f.held = nil
	f.mu.Unlock()
	for _, h := range held {
		h.to.mu.Lock()
		if !h.to.mu.closed {
			h.to.mu.inbox = append(h.to.mu.inbox, h.n)
		}
		h.to.mu.Unlock()
		h.to.signal()
	}
	return len(held)
}
