package netxfer

import (
	"errors"
	"fmt"
)

// ErrNotGranted: a peer named memory its grants do not cover.
var ErrNotGranted = errors.New("netxfer: no grant for the range")

// Verdict is a Guard's answer about one range a peer names.
type Verdict uint8

const (
	// Allow: the peer may move the range's bytes.
	Allow Verdict = iota + 1
	// Late: refused, but an honest peer can ask this (a grant it held has
	// ended): the part fails and the connection is kept.
	Late
	// Deny: refused, and the connection is dropped.
	Deny
)

// Guard decides which peer may move which bytes of the agent's registered
// memory: op Write for a peer's WRITE into it, Read for a peer's READ of
// it. It is called from the agent's connection goroutines, once per range
// of every incoming frame, before a byte moves; it must be quick and safe
// for concurrent use.
type Guard interface {
	Check(peer string, op Op, addr, n uint64) Verdict
}

// A Fence is a Guard that also knows which admitted parts still move
// bytes, so that ending what allowed them can wait for them. The agent
// admits every incoming part (and every direct or same-host copy)
// through Admit before a byte moves, with the notification its transfer
// carries (tag; nil: none), and calls Done once its last byte has moved
// or it failed. Meanwhile the fence may call abort (once, from another
// goroutine): the part then stops moving bytes and fails.
type Fence interface {
	Guard
	// Admit returns Allow and a ticket for Done, or the verdict on the
	// first range refused and its index (-1: the part as a whole).
	Admit(peer string, op Op, ranges []Region, tag []byte, abort func()) (v Verdict, refused int, ticket uint64)
	Done(ticket uint64)
}

type guardBox struct{ g Guard }

// SetGuard installs the agent's guard. An agent takes one: a second
// call fails. Without a guard, every peer may move any registered bytes.
func (a *Agent) SetGuard(g Guard) error {
	if g == nil {
		return errors.New("netxfer: SetGuard(nil)")
	}
	if !a.guard.CompareAndSwap(nil, &guardBox{g}) {
		return fmt.Errorf("netxfer: agent %s already has a guard (one per agent: give each Worker its own backend)", a.cfg.Name)
	}
	return nil
}

// admitGuard admits a part through the guard: as checkGuard, and with a
// Fence the part is noted as moving until releaseGuard(ticket), abort
// cutting it short if what allowed it ends meanwhile.
func (a *Agent) admitGuard(peer string, op Op, ranges []Region, tag []byte, abort func()) (Verdict, uint64, error) {
	b := a.guard.Load()
	if b == nil {
		return Allow, 0, nil
	}
	f, ok := b.g.(Fence)
	if !ok {
		v, err := a.checkGuard(peer, op, ranges)
		return v, 0, err
	}
	v, i, ticket := f.Admit(peer, op, ranges, tag, abort)
	if v == Allow {
		return Allow, ticket, nil
	}
	if i < 0 || i >= len(ranges) {
		a.refusals[min(v, Deny)].Add(1)
		return v, 0, fmt.Errorf("%w: a part of %d ranges of %s by %s, for a request its grants are not for", ErrNotGranted, len(ranges), a.cfg.Name, peer)
	}
	return v, 0, a.refused(peer, op, v, i, ranges[i])
}

// releaseGuard ends an admission (0: none).
func (a *Agent) releaseGuard(ticket uint64) {
	if ticket == 0 {
		return
	}
	if f, ok := a.guard.Load().g.(Fence); ok {
		f.Done(ticket)
	}
}

// refused counts a refusal and says what was refused.
func (a *Agent) refused(peer string, op Op, v Verdict, i int, r Region) error {
	what := "write into"
	if op == Read {
		what = "read of"
	}
	a.refusals[min(v, Deny)].Add(1)
	return fmt.Errorf("%w: %s range %d [%#x, +%d) of %s by %s", ErrNotGranted, what, i, r.Addr, r.Len, a.cfg.Name, peer)
}

// checkGuard asks the guard about every range; it returns Allow, or the
// verdict on the first range refused with an error naming it.
func (a *Agent) checkGuard(peer string, op Op, ranges []Region) (Verdict, error) {
	b := a.guard.Load()
	if b == nil {
		return Allow, nil
	}
	for i, r := range ranges {
		if v := b.g.Check(peer, op, r.Addr, r.Len); v != Allow {
			return v, a.refused(peer, op, v, i, r)
		}
	}
	return Allow, nil
}

// Refusals returns how many incoming frames (and direct copies) the guard
// refused: late (the connection kept) and denied (the connection dropped).
func (a *Agent) Refusals() (late, denied uint64) {
	return a.refusals[Late].Load(), a.refusals[Deny].Load()
}
