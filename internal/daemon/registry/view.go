package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultMaxEntries bounds a View when ViewConfig.MaxEntries is zero.
const DefaultMaxEntries = 10000

// progressEvery is how often a View asks etcd for its watch's progress,
// to find out that etcd's revision went back (View.loop).
const progressEvery = 3 * time.Second

// ChangeKind is what happened to an engine in the registry.
type ChangeKind uint8

const (
	// Join: the engine has an entry now and had none.
	Join ChangeKind = iota + 1
	// Leave: the engine's last entry is gone (its lease ended, or it
	// deregistered).
	Leave
	// Generation: the engine's current entry changed generation or
	// address (it restarted and registered again: a rejoin), or a rank
	// came to be served by another entry or generation (a per-rank
	// server of the in-process placement that restarted or joined).
	Generation
	// RankGone: an entry of the engine went (its lease ended, or it
	// left) and no other entry serves its ranks, while other entries
	// still serve other ranks: one of the per-rank servers of an
	// in-process engine is gone, and the engine cannot move KV of those
	// ranks. Entry is the entry that went.
	RankGone
)

func (k ChangeKind) String() string {
	switch k {
	case Join:
		return "join"
	case Leave:
		return "leave"
	case Generation:
		return "generation"
	case RankGone:
		return "rank_gone"
	}
	return fmt.Sprintf("ChangeKind(%d)", uint8(k))
}

// Change is one engine's change. Entry is its current entry (the
// latest generation of its entries); for Leave, the one it had; for
// RankGone, the one that went.
type Change struct {
	Kind   ChangeKind
	Engine string
	Entry  Entry
}

// ViewConfig configures a View. Zero fields mean the defaults.
type ViewConfig struct {
	Client *clientv3.Client // required
	Prefix string           // default DefaultPrefix
	// MaxEntries bounds the entries the view holds (default
	// DefaultMaxEntries); past it new keys are refused, each counted
	// once while it stays out (kvxfer_registry_refused_total{reason=
	// "max_entries"}, not again at a new listing or a value put again)
	// and logged; kvxfer_registry_refused_entries says how many are out.
	MaxEntries int
	// OnChange, when set, is called on the view's goroutine with each
	// change, in order; it must not block.
	OnChange func(Change)
	Logger   *slog.Logger // default slog.Default()
	Metrics  *Metrics     // default: unregistered metrics
	// Explain is RegistrarConfig.Explain, for the view's failures.
	Explain func(context.Context) error
}

// View is a process's view of the registry: it lists the entries, then
// watches them, and keeps the last view while etcd is unreachable (the
// watch resumes where it was once etcd answers; a compacted or cancelled
// watch lists again, with backoff). It is safe for concurrent use.
type View struct {
	cfg     ViewConfig
	log     *slog.Logger
	done    chan struct{}
	stopped chan struct{}
	once    sync.Once
	cancel  context.CancelFunc
	mu      struct {
		sync.RWMutex
		byKey   map[string]Entry
		engines map[string]map[string]Entry // engine -> key -> entry
		changed chan struct{}               // closed and replaced at each change
		synced  bool                        // listed once
		// refused are the keys left out for want of room (at the last
		// list, or put since while the view was full): when room is
		// made, the view lists again to take them in (nothing else
		// would bring them: a registrar puts an entry once per lease).
		// Each is counted once (kvxfer_registry_refused_total), not
		// again at each list or put while it stays out. At most
		// MaxEntries are named; refusedUnnamed counts the others (a
		// list's, past that bound), and a key among them may be
		// counted again.
		refused        map[string]struct{}
		refusedUnnamed int
		// bad are the keys holding a malformed value, and its
		// revision: each such value is counted and logged once, not
		// again at each list (etcd back, a compacted watch). At most
		// MaxEntries; past that a bad value may be counted again.
		bad map[string]int64
	}
}

// NewView starts a View; it fills once etcd answers.
func NewView(cfg ViewConfig) (*View, error) {
	if cfg.Client == nil {
		return nil, errors.New("registry: ViewConfig.Client is nil")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	v := &View{cfg: cfg, log: cfg.Logger, done: make(chan struct{}), stopped: make(chan struct{})}
	v.mu.byKey, v.mu.engines, v.mu.changed, v.mu.bad = map[string]Entry{}, map[string]map[string]Entry{}, make(chan struct{}), map[string]int64{}
	v.mu.refused = map[string]struct{}{}
	ctx, cancel := context.WithCancel(context.Background())
	v.cancel = cancel
	go v.loop(ctx)
	return v, nil
}

// Close stops the view's goroutine and returns once it has exited. It is
// idempotent.
func (v *View) Close() {
	v.once.Do(func() {
		close(v.done)
		v.cancel()
		<-v.stopped
	})
}

// Lookup returns engine's current entry: of its entries (several while
// the lease of a daemon it left, or that died, runs on), the one whose key
// etcd created last. Generations of different daemons are not comparable
// (each daemon's count starts from its own clock), so an engine that
// moved to a daemon started before the one it left is found at its new
// address at once.
func (v *View) Lookup(engine string) (Entry, bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return current(v.mu.engines[engine])
}

// maxLookupNow bounds the entries LookupNow reads for one engine (one per
// daemon it registered from whose lease still runs).
const maxLookupNow = 64

// LookupNow is Lookup, asking etcd itself when the view has no entry for
// engine: the view follows etcd through a watch, a few milliseconds
// behind, and an engine that has just joined (a producer back after a
// restart, a request naming it routed at once) would be refused for that
// lag. It reads the engine's entries (at most maxLookupNow, each decoded
// as the view does), within ctx; found says whether it has one. The view
// itself is left to its watch.
func (v *View) LookupNow(ctx context.Context, engine string) (e Entry, found bool, err error) {
	if e, ok := v.Lookup(engine); ok {
		return e, true, nil
	}
	if !validEngineID(engine) {
		return Entry{}, false, nil // no key holds it
	}
	resp, err := v.cfg.Client.Get(ctx, EnginesPrefix(v.cfg.Prefix)+engine+"/", clientv3.WithPrefix(), clientv3.WithLimit(maxLookupNow))
	if err != nil {
		return Entry{}, false, err
	}
	set := map[string]Entry{}
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		e, err := Decode(v.cfg.Prefix, k, kv.Value)
		if err != nil {
			continue // the view counts and logs it when its watch brings it
		}
		e.created = kv.CreateRevision
		set[k] = e
	}
	e, found = current(set)
	return e, found, nil
}

// Engines returns every engine's current entry, ordered by engine id.
func (v *View) Engines() []Entry {
	v.mu.RLock()
	defer v.mu.RUnlock()
	out := make([]Entry, 0, len(v.mu.engines))
	for _, id := range slices.Sorted(maps.Keys(v.mu.engines)) {
		if e, ok := current(v.mu.engines[id]); ok {
			out = append(out, e)
		}
	}
	return out
}

// Routable returns, of each engine every rank of which is served (each
// (tp, pp) of its current entry's TPSize x PPSize listed by one of its
// entries), its current entry with Ranks listing every rank's server in
// rank order: what a router hands to consumers (Peer is then rank 0's
// server, the base of the per-rank port scheme). An engine a rank of
// which has no server (its per-rank server's lease ended, or it has not
// published yet) is left out: no transfer of it could end.
func (v *View) Routable() []Entry {
	v.mu.RLock()
	defer v.mu.RUnlock()
	out := make([]Entry, 0, len(v.mu.engines))
	for _, id := range slices.Sorted(maps.Keys(v.mu.engines)) {
		entries := v.mu.engines[id]
		e, ok := current(entries)
		if !ok {
			continue
		}
		rs := rankServers(entries)
		tps, pps := max(e.TPSize, 1), max(e.PPSize, 1)
		ranks := make([]Rank, 0, tps*pps)
		for pp := range pps {
			for tp := range tps {
				if r, ok := rs[[2]int{tp, pp}]; ok {
					ranks = append(ranks, Rank{TP: tp, PP: pp, Peer: r.peer})
				}
			}
		}
		if len(ranks) < tps*pps {
			continue
		}
		e.Ranks = ranks
		out = append(out, e)
	}
	return out
}

// Changed returns a channel closed at the view's next change.
func (v *View) Changed() <-chan struct{} {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return v.mu.changed
}

// Synced reports whether the view has listed the registry once.
func (v *View) Synced() bool {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return v.mu.synced
}

func current(entries map[string]Entry) (Entry, bool) {
	var best Entry
	var bestKey string
	for k, e := range entries {
		if bestKey == "" || newer(&e, k, &best, bestKey) {
			best, bestKey = e, k
		}
	}
	return best, bestKey != ""
}

// newer says whether entry a (at key ak) takes precedence over b (at bk):
// the one etcd created last, then the higher generation, then the lower
// key.
func newer(a *Entry, ak string, b *Entry, bk string) bool {
	return a.created > b.created || a.created == b.created && (a.Generation > b.Generation || a.Generation == b.Generation && ak < bk)
}

// rankServer is the entry that serves one rank of an engine.
type rankServer struct {
	key  string
	gen  uint64
	peer string
}

// rankServers maps each rank (tp, pp) of an engine's entries to the entry
// that serves it: of those listing it, the one current would pick. An
// engine served by one daemon has one entry for all its ranks; one whose
// ranks are served each by its own server (the in-process placement) has
// one entry per rank, each under its own lease, and what happens to any
// of them (a restart, a lease that ends) is the engine's change even when
// another rank's entry is the current one.
func rankServers(entries map[string]Entry) map[[2]int]rankServer {
	out := make(map[[2]int]rankServer, len(entries))
	best := make(map[[2]int]string, len(entries))
	for k, e := range entries {
		for _, r := range e.Ranks {
			rk := [2]int{r.TP, r.PP}
			if bk, ok := best[rk]; ok {
				b := entries[bk]
				if !newer(&e, k, &b, bk) {
					continue
				}
			}
			best[rk] = k
			out[rk] = rankServer{key: k, gen: e.Generation, peer: r.Peer}
		}
	}
	return out
}

func (v *View) loop(ctx context.Context) {
	defer close(v.stopped)
	m := v.cfg.Metrics
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var backoff time.Duration
	var ex explainer
	wait := func(op string, err error) bool {
		m.errors.WithLabelValues(op).Inc()
		backoff = min(max(2*backoff, 100*time.Millisecond), maxBackoff)
		v.log.Warn("kvxfer registry: etcd call failed; keeping the last view and retrying",
			append([]any{"op", op, "err", err, "retry_in", backoff, "jittered", true}, ex.why(ctx, v.cfg.Explain, err)...)...)
		timer.Reset(jittered(backoff))
		select {
		case <-v.done:
			return false
		case <-timer.C:
			return true
		}
	}
	prefix := EnginesPrefix(v.cfg.Prefix)
	for {
		rev, err := v.list(ctx, prefix)
		if err != nil {
			if ctx.Err() != nil || !wait("get", err) {
				return
			}
			continue
		}
		wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := v.cfg.Client.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		// etcd's revision never goes back unless etcd lost or was given
		// other data (a member restarted on an empty data directory, a
		// restored backup): the client's watch then resumes at a revision
		// the new store has not reached and stays silent, and the view
		// would keep engines that are gone and never see new ones. Asking
		// for the watch's progress now and then brings etcd's revision,
		// and one lower than seen before lists again.
		progress := time.NewTicker(progressEvery)
		seen, listed := rev, time.Now()
		var werr error
		relist := false
	watching:
		for {
			select {
			case resp, open := <-wch:
				if !open {
					break watching
				}
				if err := resp.Err(); err != nil {
					werr = err
					break watching
				}
				if resp.Header.Revision < seen {
					werr = fmt.Errorf("etcd's revision went back from %d to %d (its data was lost or replaced): listing again", seen, resp.Header.Revision)
					break watching
				}
				seen = resp.Header.Revision
				backoff = 0
				// A full view lists again once room is made for what it
				// refused, at most once per progressEvery: a fleet past
				// the bound that churns would otherwise list it all at
				// every leave.
				if v.apply(resp.Events) {
					relist = true
				}
				if relist && time.Since(listed) >= progressEvery {
					break watching
				}
			case <-progress.C:
				if relist {
					break watching
				}
				_ = v.cfg.Client.RequestProgress(wctx) // a failure: the watch's own error says more
			}
		}
		progress.Stop()
		wcancel()
		if ctx.Err() != nil {
			return
		}
		if relist {
			continue
		}
		if werr == nil {
			werr = errors.New("watch closed")
		}
		if !wait("watch", werr) {
			return
		}
	}
}

// list replaces the view with what etcd holds, and returns its revision.
func (v *View) list(ctx context.Context, prefix string) (int64, error) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := v.cfg.Client.Get(cctx, prefix, clientv3.WithPrefix(), clientv3.WithLimit(int64(v.cfg.MaxEntries)))
	if err != nil {
		return 0, err
	}
	// A limited listing leaves out the keys past the bound, without
	// naming them: their names (keys only, at the same revision, at
	// most MaxEntries) say which were refused before, and are not
	// counted again.
	refused := map[string]struct{}{}
	unnamed := 0
	if resp.More && len(resp.Kvs) > 0 {
		rest, err := v.cfg.Client.Get(cctx, string(resp.Kvs[len(resp.Kvs)-1].Key)+"\x00", clientv3.WithRange(clientv3.GetPrefixRangeEnd(prefix)),
			clientv3.WithRev(resp.Header.Revision), clientv3.WithKeysOnly(), clientv3.WithLimit(int64(v.cfg.MaxEntries)))
		if err != nil {
			return 0, err
		}
		for _, kv := range rest.Kvs {
			refused[string(kv.Key)] = struct{}{}
		}
		unnamed = max(int(resp.Count)-len(resp.Kvs)-len(refused), 0)
	}
	now := map[string]*mvccpb.KeyValue{}
	for _, kv := range resp.Kvs {
		now[string(kv.Key)] = kv
	}
	var changes []Change
	v.mu.Lock()
	// Keys named now and not before are new, unless they were among
	// those left unnamed before (past the bound on names).
	fresh := unnamed
	for k := range refused {
		if _, ok := v.mu.refused[k]; !ok {
			fresh++
		}
	}
	newly := max(fresh-v.mu.refusedUnnamed, 0)
	if newly > 0 {
		v.cfg.Metrics.refused.WithLabelValues("max_entries").Add(float64(newly))
	}
	if n := len(refused) + unnamed; n > 0 {
		v.log.Warn("kvxfer registry: more entries than the view holds; the rest are ignored", "max_entries", v.cfg.MaxEntries,
			"ignored", n, "newly", newly)
	}
	v.mu.refused, v.mu.refusedUnnamed = refused, unnamed
	for k := range v.mu.byKey {
		if _, ok := now[k]; !ok {
			changes = v.setLocked(changes, k, nil)
		}
	}
	for k := range v.mu.bad {
		if _, ok := now[k]; !ok {
			delete(v.mu.bad, k)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(now)) {
		changes = v.putLocked(changes, k, now[k].Value, now[k].CreateRevision, now[k].ModRevision)
	}
	v.mu.synced = true
	v.refusedGaugeLocked()
	v.notifyLocked()
	v.mu.Unlock()
	v.emit(changes)
	return resp.Header.Revision, nil
}

// apply applies a watch's events; true when the view should list again
// (it has room for keys it refused).
func (v *View) apply(events []*clientv3.Event) bool {
	var changes []Change
	v.mu.Lock()
	for _, ev := range events {
		k := string(ev.Kv.Key)
		if ev.Type == clientv3.EventTypeDelete {
			_, isBad := v.mu.bad[k]
			_, held := v.mu.byKey[k]
			delete(v.mu.bad, k)
			if _, ok := v.mu.refused[k]; ok {
				delete(v.mu.refused, k)
			} else if !isBad && !held && v.mu.refusedUnnamed > 0 {
				v.mu.refusedUnnamed-- // one the list left out without naming it
			}
			changes = v.setLocked(changes, k, nil)
		} else {
			changes = v.putLocked(changes, k, ev.Kv.Value, ev.Kv.CreateRevision, ev.Kv.ModRevision)
		}
	}
	if len(events) > 0 {
		v.refusedGaugeLocked()
		v.notifyLocked()
	}
	relist := len(v.mu.refused)+v.mu.refusedUnnamed > 0 && len(v.mu.byKey) < v.cfg.MaxEntries
	v.mu.Unlock()
	v.emit(changes)
	return relist
}

// putLocked decodes and stores key's value (of revision modified); a
// bad one is counted and logged (once per value) and dropped (as if
// deleted).
func (v *View) putLocked(changes []Change, key string, value []byte, created, modified int64) []Change {
	e, err := Decode(v.cfg.Prefix, key, value)
	e.created = created
	if err != nil {
		if rev, seen := v.mu.bad[key]; !seen || rev != modified {
			v.cfg.Metrics.badEntries.WithLabelValues(Field(err)).Inc()
			v.log.Warn("kvxfer registry: entry refused", "key", key, "err", err)
			if seen || len(v.mu.bad) < v.cfg.MaxEntries {
				v.mu.bad[key] = modified
			}
		}
		delete(v.mu.refused, key)
		return v.setLocked(changes, key, nil)
	}
	delete(v.mu.bad, key)
	if old, ok := v.mu.byKey[key]; ok && old.created == e.created && old.Generation == e.Generation && slices.Equal(old.Ranks, e.Ranks) &&
		old.Role == e.Role && old.URL == e.URL && old.Mode == e.Mode && old.CompatHash == e.CompatHash {
		return changes
	}
	if _, ok := v.mu.byKey[key]; !ok && len(v.mu.byKey) >= v.cfg.MaxEntries {
		// Counted and logged once while it stays out: a value put again
		// over a refused key (a registrar's read-back, a new
		// generation) is the same refusal.
		if _, ok := v.mu.refused[key]; !ok {
			v.cfg.Metrics.refused.WithLabelValues("max_entries").Inc()
			v.log.Warn("kvxfer registry: view full; entry ignored", "key", key, "max_entries", v.cfg.MaxEntries)
			if len(v.mu.refused) < v.cfg.MaxEntries {
				v.mu.refused[key] = struct{}{}
			} else {
				v.mu.refusedUnnamed++
			}
		}
		return changes
	}
	delete(v.mu.refused, key)
	return v.setLocked(changes, key, &e)
}

// setLocked stores (e) or removes (nil) key's entry and appends the
// engine's change, if any.
func (v *View) setLocked(changes []Change, key string, e *Entry) []Change {
	var engine string
	if e != nil {
		engine = e.EngineID
	} else if old, ok := v.mu.byKey[key]; ok {
		engine = old.EngineID
	} else {
		return changes
	}
	set := v.mu.engines[engine]
	before, had := current(set)
	// Each rank's server counts, not the current entry alone: an engine
	// whose ranks are served each by its own server (the in-process
	// placement) has an entry per rank.
	ranksBefore := rankServers(set)
	gone, wasSet := v.mu.byKey[key]
	if e != nil {
		if set == nil {
			set = map[string]Entry{}
			v.mu.engines[engine] = set
		}
		set[key], v.mu.byKey[key] = *e, *e
	} else {
		delete(set, key)
		delete(v.mu.byKey, key)
		if len(set) == 0 {
			delete(v.mu.engines, engine)
		}
	}
	after, has := current(set)
	m := v.cfg.Metrics
	switch {
	case !had && has:
		m.engines.WithLabelValues(after.Role).Inc()
		return append(changes, Change{Kind: Join, Engine: engine, Entry: after})
	case had && !has:
		m.engines.WithLabelValues(before.Role).Dec()
		return append(changes, Change{Kind: Leave, Engine: engine, Entry: before})
	case had && has:
		if before.Role != after.Role {
			m.engines.WithLabelValues(before.Role).Dec()
			m.engines.WithLabelValues(after.Role).Inc()
		}
		ranksAfter := rankServers(set)
		if e == nil && wasSet {
			for _, r := range gone.Ranks {
				if _, ok := ranksAfter[[2]int{r.TP, r.PP}]; !ok {
					return append(changes, Change{Kind: RankGone, Engine: engine, Entry: gone})
				}
			}
		}
		if !maps.Equal(ranksBefore, ranksAfter) {
			return append(changes, Change{Kind: Generation, Engine: engine, Entry: after})
		}
		if before.Generation != after.Generation || before.Peer() != after.Peer() {
			return append(changes, Change{Kind: Generation, Engine: engine, Entry: after})
		}
		if before.URL != after.URL || before.Role != after.Role || before.Mode != after.Mode || before.CompatHash != after.CompatHash {
			return append(changes, Change{Kind: Generation, Engine: engine, Entry: after})
		}
	}
	return changes
}

// refusedGaugeLocked sets kvxfer_registry_refused_entries: the keys
// left out now.
func (v *View) refusedGaugeLocked() {
	v.cfg.Metrics.refusedNow.WithLabelValues("max_entries").Set(float64(len(v.mu.refused) + v.mu.refusedUnnamed))
}

func (v *View) notifyLocked() {
	close(v.mu.changed)
	v.mu.changed = make(chan struct{})
}

func (v *View) emit(changes []Change) {
	for _, c := range changes {
		v.cfg.Metrics.events.WithLabelValues(c.Kind.String()).Inc()
		v.log.Info("kvxfer registry: fleet change", "change", c.Kind.String(), "engine", c.Engine, "generation", c.Entry.Generation,
			"peer", c.Entry.Peer(), "role", c.Entry.Role)
		if v.cfg.OnChange != nil {
			v.cfg.OnChange(c)
		}
	}
}
