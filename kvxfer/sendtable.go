package kvxfer

import (
	"hash/maphash"
	"iter"
)

// sendTable indexes the producer's requests by one of their ids: the
// request id, or (byTID) the transfer id. It is the core's busiest table,
// touched four or five times by every request, so it is a map built for
// that use: open addressing with linear probing over (hash, record)
// slots, each id hashed once per request (the record keeps its hashes),
// a lookup and an insert sharing that hash, a removal finding the record
// by pointer and shifting the slots after it back (no tombstones). Its
// seed is random per table, so ids chosen by a peer cannot aim at one
// probe run.
type sendTable struct {
	seed  maphash.Seed
	slots []sendSlot // empty, or a power of two long
	n     int
	byTID bool
}

type sendSlot struct {
	h uint64
	s *sendReq
}

// minSendSlots is the smallest table. A table of up to shrinkSendSlots
// keeps its size (a step's requests come and go together: growing again
// every step would cost more than the slots); a bigger one halves when
// under a sixteenth full.
const (
	minSendSlots    = 64
	shrinkSendSlots = 8192
)

func newSendTable(byTID bool) sendTable {
	return sendTable{seed: maphash.MakeSeed(), byTID: byTID}
}

func (t *sendTable) key(s *sendReq) string {
	if t.byTID {
		return s.req.TransferID
	}
	return s.req.ReqID
}

func (t *sendTable) hash(k string) uint64 { return maphash.String(t.seed, k) }

func (t *sendTable) len() int { return t.n }

// get returns the request with id k, or nil.
func (t *sendTable) get(k string) *sendReq {
	if t.n == 0 {
		return nil
	}
	return t.getH(k, t.hash(k))
}

// getH is get with k's hash.
func (t *sendTable) getH(k string, h uint64) *sendReq {
	if t.n == 0 {
		return nil
	}
	mask := uint64(len(t.slots) - 1)
	for i := h & mask; ; i = (i + 1) & mask {
		sl := &t.slots[i]
		if sl.s == nil {
			return nil
		}
		if sl.h == h && t.key(sl.s) == k {
			return sl.s
		}
	}
}

// insert adds s, whose id hashes to h and is not in t.
func (t *sendTable) insert(s *sendReq, h uint64) {
	if 2*(t.n+1) > len(t.slots) {
		t.resize(max(minSendSlots, 2*len(t.slots)))
	}
	t.place(sendSlot{h: h, s: s})
	t.n++
}

func (t *sendTable) place(e sendSlot) {
	mask := uint64(len(t.slots) - 1)
	i := e.h & mask
	for t.slots[i].s != nil {
		i = (i + 1) & mask
	}
	t.slots[i] = e
}

// remove drops s, whose id hashes to h; s must be in t.
func (t *sendTable) remove(s *sendReq, h uint64) {
	mask := uint64(len(t.slots) - 1)
	i := h & mask
	for t.slots[i].s != s {
		if t.slots[i].s == nil {
			panic("kvxfer: sendTable.remove of a request it does not hold")
		}
		i = (i + 1) & mask
	}
	// Backward shift: each later slot of the probe run moves into the
	// hole when the hole lies between its home slot and it.
	for j := i; ; {
		j = (j + 1) & mask
		e := t.slots[j]
		if e.s == nil {
			break
		}
		if (j-e.h&mask)&mask >= (j-i)&mask {
			t.slots[i] = e
			i = j
		}
	}
	t.slots[i] = sendSlot{}
	t.n--
	if len(t.slots) > shrinkSendSlots && 16*t.n < len(t.slots) {
		t.resize(len(t.slots) / 2)
	}
}

func (t *sendTable) resize(n int) {
	old := t.slots
	t.slots = make([]sendSlot, n)
	for _, e := range old {
		if e.s != nil {
			t.place(e)
		}
	}
}

// all yields every request held, in no particular order; the table must
// not change meanwhile.
func (t *sendTable) all() iter.Seq[*sendReq] {
	return func(yield func(*sendReq) bool) {
		for _, e := range t.slots {
			if e.s != nil && !yield(e.s) {
				return
			}
		}
	}
}
