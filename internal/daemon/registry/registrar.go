package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultPrefix is the registry's key prefix in etcd when a config's
// Prefix is empty (kvxferd's -etcd-prefix default).
const DefaultPrefix = "/kvxfer"

// DefaultTTL is an entry's lease when RegistrarConfig.TTL is zero: a
// process that dies without deregistering leaves the fleet within it.
const DefaultTTL = 5 * time.Second

// maxBackoff bounds the wait between two attempts at etcd.
const maxBackoff = 2 * time.Second

// jittered is a retry's wait for a backoff of d: between d/2 and d, drawn
// at random, so that the daemons of a fleet cut off from etcd together do
// not all retry in the same instant once it is back.
func jittered(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// RegistrarConfig configures a Registrar. Zero fields mean the defaults.
type RegistrarConfig struct {
	Client *clientv3.Client // required
	Prefix string           // default DefaultPrefix
	// TTL is the lease the entries live under, kept alive every TTL/3
	// (default DefaultTTL; at least 2 s: etcd's lease granularity).
	TTL     time.Duration
	Logger  *slog.Logger // default slog.Default()
	Metrics *Metrics     // default: unregistered metrics
	// Explain, when set, says why etcd cannot be reached when a call
	// only ran out of time (ClientConfig.Explain): logged with the
	// failure, at most every explainEvery.
	Explain func(context.Context) error
}

func (c *RegistrarConfig) fill() error {
	if c.Client == nil {
		return errors.New("registry: RegistrarConfig.Client is nil")
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.TTL < 2*time.Second {
		return fmt.Errorf("registry: RegistrarConfig.TTL = %v, want at least 2s", c.TTL)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
	return nil
}

// Registrar keeps a process's entries in etcd under one lease: it
// grants the lease, puts the entries, keeps the lease alive, and when
// the lease is lost (etcd unreachable for longer than the TTL, or etcd
// lost it) grants a new one and puts the entries again, retrying with
// backoff (100 ms doubling to 2 s, jittered) meanwhile. Nothing waits for it: Set
// returns at once. It is safe for concurrent use.
type Registrar struct {
	cfg     RegistrarConfig
	log     *slog.Logger
	wake    chan struct{} // 1-slot: Set changed the entries
	done    chan struct{} // closed by Close
	stopped chan struct{} // closed when the loop has exited
	once    sync.Once
	cancel  context.CancelFunc // ends the loop's calls in flight (Close)
	mu      struct {
		sync.Mutex
		want map[string][]byte // key -> value
	}
	lease clientv3.LeaseID // the loop's, read by Close after it exited
}

// NewRegistrar starts a Registrar with nothing to publish yet.
func NewRegistrar(cfg RegistrarConfig) (*Registrar, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	r := &Registrar{cfg: cfg, log: cfg.Logger, wake: make(chan struct{}, 1), done: make(chan struct{}), stopped: make(chan struct{})}
	r.mu.want = map[string][]byte{}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go r.loop(ctx)
	return r, nil
}

// Set replaces the entries r publishes, each under Key(prefix,
// engine, peer). It returns at once; an entry that does not validate is
// an error and nothing changes.
func (r *Registrar) Set(entries []Entry) error {
	want := make(map[string][]byte, len(entries))
	for i := range entries {
		e := entries[i]
		k := Key(r.cfg.Prefix, e.EngineID, e.Peer())
		v, err := e.Encode(k)
		if err != nil {
			return err
		}
		want[k] = v
	}
	r.mu.Lock()
	r.mu.want = want
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
	return nil
}

// Close stops keeping the entries alive and deletes them (revoking the
// lease), within ctx. It is idempotent and returns once r's goroutine
// has exited.
func (r *Registrar) Close(ctx context.Context) error {
	var err error
	r.once.Do(func() {
		close(r.done)
		r.cancel()
		<-r.stopped
		if r.lease != 0 {
			if _, err = r.cfg.Client.Revoke(ctx, r.lease); err != nil {
				r.cfg.Metrics.errors.WithLabelValues("revoke").Inc()
				err = fmt.Errorf("registry: revoke lease %x (its entries go when it expires, within %v): %w", int64(r.lease), r.cfg.TTL, err)
			}
		}
		r.cfg.Metrics.registered.Set(0)
	})
	return err
}

// loop owns the lease and what was put under it.
func (r *Registrar) loop(ctx context.Context) {
	defer close(r.stopped)
	m := r.cfg.Metrics
	var (
		lease     clientv3.LeaseID
		ka        <-chan *clientv3.LeaseKeepAliveResponse
		kaCancel  context.CancelFunc = func() {}
		published                    = map[string][]byte{}
		backoff   time.Duration
		failing   bool
		// lost are leases found lost (no keepalive answered for a TTL)
		// but perhaps not gone: an etcd restarted on its data restores
		// them, renewed, with what was put under them. Once registered
		// again under a new lease (which holds the entries still wanted),
		// they are revoked: an entry of an engine that left meanwhile
		// would otherwise stay another TTL, its address resolved and
		// routed to. At most maxLost are kept; the rest just expire.
		lost []clientv3.LeaseID
		// answered is when etcd last answered a keepalive.
		answered time.Time
		// held are the keys wanted that this registrar has put once
		// (under any of its leases): from then on it puts such a key
		// again only where it is absent, holds no lease or holds one
		// of this registrar's, never over another lease's (a daemon
		// that replaced this one on its address: its entry is the
		// current one). A key first wanted takes over whatever is
		// there: the engine attached here now (the entry of a daemon
		// that died on this address runs out with its lease).
		held = map[string]bool{}
	)
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	// What was put is read back once per TTL: a key deleted or
	// overwritten by hand (etcdctl del, a malformed value put over it)
	// would otherwise stay gone, or stay without a lease after this
	// process dies, for as long as the lease lives: its engine out of
	// every peer's view while it serves.
	check := time.NewTicker(r.cfg.TTL)
	defer func() { kaCancel(); retry.Stop(); check.Stop(); r.lease = lease }()
	var ex explainer
	fail := func(op string, err error) {
		m.errors.WithLabelValues(op).Inc()
		backoff = min(max(2*backoff, 100*time.Millisecond), maxBackoff)
		r.log.Warn("kvxfer registry: etcd call failed; retrying (what is registered stays until its lease ends)",
			append([]any{"op", op, "err", err, "retry_in", backoff, "jittered", true}, ex.why(ctx, r.cfg.Explain, err)...)...)
		failing = true
		retry.Reset(jittered(backoff))
	}
	for {
		r.mu.Lock()
		want := r.mu.want
		r.mu.Unlock()
		mine := func(l int64) bool { return l == int64(lease) || slices.Contains(lost, clientv3.LeaseID(l)) }
		ok := r.sync(ctx, &lease, &ka, &kaCancel, published, want, held, mine, fail)
		if ok && len(lost) > 0 {
			lost = r.revokeLost(ctx, lost)
		}
		if ok {
			if failing {
				r.log.Info("kvxfer registry: registered again", "entries", len(want), "lease", fmt.Sprintf("%x", int64(lease)))
			}
			backoff, failing = 0, false
			m.registered.Set(btof(len(want) > 0))
		} else {
			m.registered.Set(0)
		}
		select {
		case <-r.done:
			return
		case <-r.wake:
		case <-retry.C:
		case <-check.C:
			// Only while etcd answers the keepalives (each TTL/3): with
			// etcd away the check would only hold up the loop.
			if lease != 0 && len(published) > 0 && time.Since(answered) < r.cfg.TTL/2 {
				if err := r.verify(ctx, lease, published); err != nil && ctx.Err() == nil {
					m.errors.WithLabelValues("check").Inc()
					r.log.Warn("kvxfer registry: etcd call failed; checking the entries again in a TTL", "op", "check", "err", err, "retry_in", r.cfg.TTL)
				}
			}
		case _, open := <-ka:
			if open {
				answered = time.Now()
			} else {
				// The lease is gone: etcd unreachable for a TTL, or it
				// lost or revoked it. Its entries are gone with it.
				m.errors.WithLabelValues("keepalive").Inc()
				r.log.Warn("kvxfer registry: lease lost; registering again", "lease", fmt.Sprintf("%x", int64(lease)))
				kaCancel()
				if len(lost) == maxLost {
					lost = lost[1:]
				}
				lost = append(lost, lease)
				lease, ka = 0, nil
				clear(published)
				m.registered.Set(0)
			}
		}
	}
}

// sync makes etcd hold want under a live lease (but a key held, that
// another lease holds now: put); false when a call failed (fail
// scheduled a retry). mine says whether a lease is this registrar's.
func (r *Registrar) sync(ctx context.Context, lease *clientv3.LeaseID, ka *<-chan *clientv3.LeaseKeepAliveResponse,
	kaCancel *context.CancelFunc, published, want map[string][]byte, held map[string]bool, mine func(int64) bool, fail func(string, error)) bool {
	cl := r.cfg.Client
	for k := range held {
		if _, ok := want[k]; !ok {
			delete(held, k)
		}
	}
	if len(want) == 0 && *lease == 0 {
		return true
	}
	if *lease == 0 {
		cctx, cancel := context.WithTimeout(ctx, r.cfg.TTL)
		g, err := cl.Grant(cctx, int64((r.cfg.TTL+time.Second-1)/time.Second))
		cancel()
		if err != nil {
			fail("grant", err)
			return false
		}
		kctx, kcancel := context.WithCancel(ctx)
		ch, err := cl.KeepAlive(kctx, g.ID)
		if err != nil {
			kcancel()
			fail("keepalive", err)
			return false
		}
		*lease, *ka, *kaCancel = g.ID, ch, kcancel
	}
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if v, ok := published[k]; ok && string(v) == string(want[k]) {
			continue
		}
		// Held from its first attempt on: a put whose answer was lost
		// (the connection cut after etcd applied it) may have put the
		// key, and one made again unconditionally would then go over a
		// replacement's entry put since. A first attempt that really
		// failed leaves the key to whatever holds it; the read-back puts
		// it once that is gone.
		takeover := !held[k]
		held[k] = true
		other, err := r.put(ctx, k, want[k], *lease, takeover, mine)
		if err != nil {
			fail("put", fmt.Errorf("%s: %w", k, err))
			return false
		}
		if other != 0 {
			// Left to it; the read-back (verify) puts it again once
			// that lease has ended and the key is gone.
			r.log.Warn("kvxfer registry: an entry this process put is held now under another lease (a daemon started since on this address); "+
				"left to it", "key", k, "lease", fmt.Sprintf("%x", int64(*lease)), "holder", fmt.Sprintf("%x", other))
		}
		published[k] = want[k]
	}
	for _, k := range slices.Sorted(maps.Keys(published)) {
		if _, ok := want[k]; ok {
			continue
		}
		// Only while the key is under this registrar's lease: a daemon
		// restarted on the same address (the same key) may have put its
		// own entry there meanwhile, and it is not this one's to delete.
		cctx, cancel := context.WithTimeout(ctx, r.cfg.TTL)
		_, err := cl.Txn(cctx).If(clientv3.Compare(clientv3.LeaseValue(k), "=", *lease)).Then(clientv3.OpDelete(k)).Commit()
		cancel()
		if err != nil {
			fail("delete", fmt.Errorf("%s: %w", k, err))
			return false
		}
		delete(published, k)
	}
	return true
}

// putTries bounds the attempts of a conditional put at a key that
// changes between its read and the put.
const putTries = 4

// put puts k = v under lease: whatever k holds when takeover, else only
// where k is absent, holds no lease (put by hand) or holds one of this
// registrar's (mine), in one transaction with what was read: a key held
// under another lease is left to it, and its lease is returned. A
// registrar that lost its lease while a daemon that replaced it on its
// address put the key under its own (the old one draining) would
// otherwise, once registered again, put its stale entry over the current
// one: its peers would resolve the engine to the daemon that is leaving.
func (r *Registrar) put(ctx context.Context, k string, v []byte, lease clientv3.LeaseID, takeover bool, mine func(int64) bool) (other int64, err error) {
	cl := r.cfg.Client
	if takeover {
		cctx, cancel := context.WithTimeout(ctx, r.cfg.TTL)
		defer cancel()
		_, err := cl.Put(cctx, k, string(v), clientv3.WithLease(lease))
		return 0, err
	}
	modified := int64(0) // absent
	for range putTries {
		cctx, cancel := context.WithTimeout(ctx, r.cfg.TTL)
		resp, err := cl.Txn(cctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", modified)).
			Then(clientv3.OpPut(k, string(v), clientv3.WithLease(lease))).Else(clientv3.OpGet(k)).Commit()
		cancel()
		if err != nil {
			return 0, err
		}
		if resp.Succeeded {
			return 0, nil
		}
		var kvs []*mvccpb.KeyValue
		if rr := resp.Responses[0].GetResponseRange(); rr != nil {
			kvs = rr.Kvs
		}
		switch {
		case len(kvs) == 0:
			modified = 0
		case kvs[0].Lease != 0 && !mine(kvs[0].Lease):
			return kvs[0].Lease, nil
		default:
			modified = kvs[0].ModRevision
		}
	}
	return 0, fmt.Errorf("the key changed at each of %d attempts to put it", putTries)
}

// explainer runs ClientConfig.Explain for a failure that says only that
// time ran out, at most every explainEvery.
type explainer struct{ last time.Time }

// why is the failure's cause as log attributes ("why", ...): none when
// err says it already (or explain is nil, or it explained lately).
func (x *explainer) why(ctx context.Context, explain func(context.Context) error, err error) []any {
	if explain == nil || !errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil || time.Since(x.last) < explainEvery {
		return nil
	}
	x.last = time.Now()
	if e := explain(ctx); e != nil {
		return []any{"why", e.Error()}
	}
	return []any{"why", "etcd's endpoints take connections: etcd is slow, or has no leader"}
}

// maxLost bounds the lost leases a registrar remembers to revoke.
const maxLost = 8

// revokeLost revokes leases found lost, once registered again (or with
// nothing to register): what is still wanted was put under the new
// lease, so only entries no longer wanted go with them. One etcd no
// longer has is gone already. It returns those left to revoke: at the
// first failure (etcd away: with nothing to register, nothing else said
// so), each call waiting at most TTL/3, the rest are kept for the next
// round (a lease expires by itself meanwhile).
func (r *Registrar) revokeLost(ctx context.Context, lost []clientv3.LeaseID) []clientv3.LeaseID {
	for i, l := range lost {
		cctx, cancel := context.WithTimeout(ctx, r.cfg.TTL/3)
		_, err := r.cfg.Client.Revoke(cctx, l)
		cancel()
		if err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			if ctx.Err() == nil {
				r.cfg.Metrics.errors.WithLabelValues("revoke").Inc()
				r.log.Warn("kvxfer registry: revoking a lost lease failed; trying again later (what is under it goes when it expires)",
					"lease", fmt.Sprintf("%x", int64(l)), "err", err, "within", r.cfg.TTL)
			}
			return lost[i:]
		}
	}
	return lost[:0]
}

// verifyBatch bounds the keys one check asks about (two comparisons
// each: etcd refuses a transaction of more than 128 by default).
const verifyBatch = 32

// verify reads back the keys published under lease: one that is gone, or
// holds another value under no lease or under this one, was deleted or
// overwritten by someone else (by hand), and is dropped from published
// so that sync puts it again. One held under another lease is left to
// it: a daemon started since on this address put it, and it is its
// (TestRegistrarDeletesOnlyItsOwnEntries).
func (r *Registrar) verify(ctx context.Context, lease clientv3.LeaseID, published map[string][]byte) error {
	keys := slices.Sorted(maps.Keys(published))
	for len(keys) > 0 {
		batch := keys[:min(len(keys), verifyBatch)]
		keys = keys[len(batch):]
		cmps := make([]clientv3.Cmp, 0, 2*len(batch))
		gets := make([]clientv3.Op, 0, len(batch))
		for _, k := range batch {
			cmps = append(cmps, clientv3.Compare(clientv3.LeaseValue(k), "=", lease), clientv3.Compare(clientv3.Value(k), "=", string(published[k])))
			gets = append(gets, clientv3.OpGet(k))
		}
		cctx, cancel := context.WithTimeout(ctx, r.cfg.TTL/3)
		resp, err := r.cfg.Client.Txn(cctx).If(cmps...).Else(gets...).Commit()
		cancel()
		if err != nil {
			return err
		}
		if resp.Succeeded {
			continue
		}
		for i, k := range batch {
			var kvs []*mvccpb.KeyValue
			if rr := resp.Responses[i].GetResponseRange(); rr != nil {
				kvs = rr.Kvs
			}
			var why string
			switch {
			case len(kvs) == 0:
				why = "deleted"
			case kvs[0].Lease != 0 && clientv3.LeaseID(kvs[0].Lease) != lease:
				continue // another daemon's now
			case string(kvs[0].Value) != string(published[k]):
				why = "overwritten"
			case kvs[0].Lease == 0:
				why = "detached from its lease"
			default:
				continue
			}
			r.log.Warn("kvxfer registry: an entry this process put was "+why+" by someone else; putting it again",
				"key", k, "lease", fmt.Sprintf("%x", int64(lease)))
			delete(published, k)
		}
	}
	return nil
}

func btof(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
