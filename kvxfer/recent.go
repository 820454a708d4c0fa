package kvxfer

import "time"

// recent remembers what ended lately, by key: each entry for a time (its
// sweep's ttl), at most a number of them (put's bound, the oldest
// forgotten first). A key put again is remembered as its latest entry.
// The consumer's ended push requests (reusedTransfer), the producer's
// push requests that ended paired (onReg) and those gone unpaired or
// ended in pull (abortedP, abortedT) are kept so.
type recent[V any] struct {
	m   map[string]recentEntry[V]
	q   []endedAt // the keys in the order they were put
	seq uint64    // puts so far: which entry of q is a key's latest
}

type recentEntry[V any] struct {
	at  time.Time
	seq uint64
	v   V
}

// endedAt is an entry of recent.q.
type endedAt struct {
	id  string
	at  time.Time
	seq uint64
}

// put remembers v under key at at, first forgetting the oldest entries
// past bound; it returns how many it forgot (before their time: the
// caller may count them).
func (r *recent[V]) put(key string, at time.Time, v V, bound int) (forgot int) {
	for len(r.q) >= bound {
		if r.forgetOldest() {
			forgot++
		}
	}
	if r.m == nil {
		r.m = map[string]recentEntry[V]{}
	}
	r.seq++
	r.m[key] = recentEntry[V]{at: at, seq: r.seq, v: v}
	r.q = append(r.q, endedAt{id: key, at: at, seq: r.seq})
	return forgot
}

// get returns what key was put with last, and when, if it is remembered.
func (r *recent[V]) get(key string) (V, time.Time, bool) {
	e, ok := r.m[key]
	return e.v, e.at, ok
}

// len is the entries remembered.
func (r *recent[V]) len() int { return len(r.m) }

// forgetOldest forgets the oldest entry, unless its key was put again
// since (a later entry of q is that one's, even put at the same time):
// it reports whether it forgot one.
func (r *recent[V]) forgetOldest() bool {
	e := r.q[0]
	r.q[0] = endedAt{}
	r.q = r.q[1:]
	x, ok := r.m[e.id]
	if ok = ok && x.seq == e.seq; ok {
		delete(r.m, e.id)
	}
	if len(r.q) == 0 {
		r.q = nil
	}
	return ok
}

// sweep forgets the entries older than ttl.
func (r *recent[V]) sweep(now time.Time, ttl time.Duration) {
	for len(r.q) > 0 && now.Sub(r.q[0].at) > ttl {
		r.forgetOldest()
	}
}
