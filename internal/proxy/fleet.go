package proxy

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// A fleet that changes: instead of fixed -prefill and -decode lists, the
// proxy may route over the instances a Fleet knows (kvxferd proxy -etcd:
// the engines registered in etcd), learning them as they come and
// forgetting them as they go. Only instances of one Group are paired (the
// same compatibility hash and mode), and the proxy's mode must be theirs;
// within a pair each side is the instance with the fewest requests in
// flight through this proxy (ties in turn). While the Fleet cannot reach
// its source, it keeps answering with what it saw last, and so does the
// proxy.

// Instance is one server a Fleet knows.
type Instance struct {
	// ID names the instance in the fleet (an engine id); unique.
	ID string
	// Prefill and Decode say which roles it serves (both: either).
	Prefill, Decode bool
	// URL is its OpenAI server's base URL.
	URL string
	// Group is its compatibility: instances pair only within a group.
	Group string
	// Mode is its transfer mode (push or pull).
	Mode Mode
	// Engine, KVHost, KVPort and TP are what D needs to reach a P's
	// kvxferd in push mode (Prefill's fields).
	Engine, KVHost string
	KVPort, TP     int
}

// Fleet is a changing set of instances. Implementations are safe for
// concurrent use.
type Fleet interface {
	// Instances returns the instances known now.
	Instances() []Instance
	// Changed returns a channel closed at the next change.
	Changed() <-chan struct{}
}

// DefaultMaxFleet bounds the instances the proxy routes over when
// Config.MaxFleet is zero.
const DefaultMaxFleet = 4096

// errNoPair is why a request finds no live, compatible P and D.
var errNoPair = errors.New("proxy: no live prefill and decode instances of one compatibility group")

// fleetUpstream is an upstream of the fleet, with its in-flight count.
type fleetUpstream struct {
	*upstream
	inst     Instance
	inflight atomic.Int64
}

// fleetTable is the fleet as one request sees it (replaced whole).
type fleetTable struct {
	prefill, decode []*fleetUpstream
	decodes         map[string]int // decode instances by group
}

// fleetRouter keeps the table current from a Fleet.
type fleetRouter struct {
	p       *Proxy
	src     Fleet
	max     int
	table   atomic.Pointer[fleetTable]
	cursor  [2]atomic.Uint64 // prefill, decode: where ties start
	done    chan struct{}
	stopped chan struct{}
	once    sync.Once
	byID    map[string]*fleetUpstream // the watcher's own
	// refused are the instances the last rebuild did not route to, and
	// why (the watcher's own): each is counted and logged once.
	refused map[Instance]string
	m       *fleetMetrics
}

type fleetMetrics struct {
	upstreams *prometheus.GaugeVec   // role
	changes   *prometheus.CounterVec // change: join, leave
	refused   *prometheus.CounterVec // reason
}

func newFleetMetrics(reg *prometheus.Registry) *fleetMetrics {
	m := &fleetMetrics{
		upstreams: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvxfer_proxy_fleet_upstreams",
			Help: "Instances of the fleet the proxy routes to now, by role (an instance of both roles counts in each)."}, []string{"role"}),
		changes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_proxy_fleet_changes_total",
			Help: "Instances the proxy learned (join) and forgot (leave)."}, []string{"change"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_proxy_fleet_refused_total",
			Help: "Fleet instances not routed to, by reason (mode: another transfer mode than the proxy's; no_url: no serving URL; bad_url; max_fleet: past Config.MaxFleet), each once while it stays as it is."}, []string{"reason"}),
	}
	for _, r := range []string{rolePrefill, roleDecode} {
		m.upstreams.WithLabelValues(r)
	}
	for _, c := range []string{"join", "leave"} {
		m.changes.WithLabelValues(c)
	}
	reg.MustRegister(m.upstreams, m.changes, m.refused)
	return m
}

// FleetCollectors is a Fleet that has metrics of its own (the registry's
// errors and refusals): the proxy exports them beside its own.
type FleetCollectors interface {
	Collectors() []prometheus.Collector
}

func newFleetRouter(p *Proxy, src Fleet, max int) *fleetRouter {
	f := &fleetRouter{p: p, src: src, max: max, done: make(chan struct{}), stopped: make(chan struct{}),
		byID: map[string]*fleetUpstream{}, m: newFleetMetrics(p.m.reg)}
	if fc, ok := src.(FleetCollectors); ok {
		p.m.reg.MustRegister(fc.Collectors()...)
	}
	f.table.Store(&fleetTable{decodes: map[string]int{}})
	changed := src.Changed()
	f.rebuild()
	go f.watch(changed)
	return f
}

func (f *fleetRouter) close() {
	f.once.Do(func() {
		close(f.done)
		<-f.stopped
	})
}

// watch rebuilds the table at each change of the fleet.
func (f *fleetRouter) watch(changed <-chan struct{}) {
	defer close(f.stopped)
	for {
		select {
		case <-f.done:
			return
		case <-changed:
		}
		changed = f.src.Changed()
		f.rebuild()
	}
}

// rebuild makes a new table from the fleet's instances, keeping the
// upstream (and its in-flight count) of an instance that did not change.
func (f *fleetRouter) rebuild() {
	t := &fleetTable{decodes: map[string]int{}}
	seen := map[string]bool{}
	log := f.p.log
	refused := map[Instance]string{}
	// refuse counts and logs an instance not routed to, once: not again
	// at each change of the fleet while it stays as it is.
	refuse := func(in Instance, reason string, logIt func()) {
		refused[in] = reason
		if f.refused[in] == reason {
			return
		}
		f.m.refused.WithLabelValues(reason).Inc()
		if logIt != nil {
			logIt()
		}
	}
	defer func() { f.refused = refused }()
	for _, in := range f.src.Instances() {
		switch {
		case in.Mode != f.p.cfg.Mode:
			refuse(in, "mode", nil)
			continue
		case in.URL == "":
			refuse(in, "no_url", nil)
			continue
		case len(seen) >= f.max:
			refuse(in, "max_fleet", func() {
				log.Warn("kvxferd proxy: fleet past its bound; instance ignored", "instance", in.ID, "max_fleet", f.max)
			})
			continue
		}
		u, err := checkURL(in.URL)
		if err != nil {
			refuse(in, "bad_url", func() { log.Warn("kvxferd proxy: fleet instance refused", "instance", in.ID, "err", err) })
			continue
		}
		in.URL = u
		if in.TP == 0 {
			in.TP = 1
		}
		fu := f.byID[in.ID]
		if fu == nil || fu.inst != in {
			if fu != nil {
				f.m.changes.WithLabelValues("leave").Inc()
			}
			fu = &fleetUpstream{inst: in, upstream: &upstream{base: in.URL, label: "fleet",
				prefill:  Prefill{URL: in.URL, Engine: in.Engine, KVHost: in.KVHost, KVPort: in.KVPort, TP: in.TP},
				inflight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "unregistered"}),
				health:   newHealth(f.p.cfg.now, prometheus.NewGauge(prometheus.GaugeOpts{Name: "unregistered"}))}}
			f.byID[in.ID] = fu
			f.m.changes.WithLabelValues("join").Inc()
			log.Info("kvxferd proxy: fleet instance joined", "instance", in.ID, "url", in.URL, "group", in.Group,
				"prefill", in.Prefill, "decode", in.Decode)
		}
		seen[in.ID] = true
		if in.Prefill {
			t.prefill = append(t.prefill, fu)
		}
		if in.Decode {
			t.decode = append(t.decode, fu)
			t.decodes[fu.group()]++
		}
	}
	for id := range f.byID {
		if !seen[id] {
			f.m.changes.WithLabelValues("leave").Inc()
			log.Info("kvxferd proxy: fleet instance left", "instance", id)
			delete(f.byID, id)
		}
	}
	f.m.upstreams.WithLabelValues(rolePrefill).Set(float64(len(t.prefill)))
	f.m.upstreams.WithLabelValues(roleDecode).Set(float64(len(t.decode)))
	f.table.Store(t)
}

// pick takes the instance of role with the fewest requests in flight:
// a prefill instance of a group that has a decode instance, or (with
// set) one of with's group.
func (f *fleetRouter) pick(role string, with *upstream) (*upstream, func(), error) {
	t := f.table.Load()
	list, cur := t.prefill, &f.cursor[0]
	if role == roleDecode {
		list, cur = t.decode, &f.cursor[1]
	}
	n := len(list)
	start := int(cur.Add(1) % uint64(max(n, 1)))
	var best *fleetUpstream
	// First the instances that are up (see health), then, if all are
	// down, any: one may have come back.
	for _, skipDown := range []bool{true, false} {
		for k := range n {
			c := list[(start+k)%n]
			switch {
			case with != nil && (c.group() != with.group || c.base == with.base):
				continue // another group, or the instance itself (one of both roles)
			case with == nil && role == rolePrefill && t.decodes[c.group()]-btoi(c.inst.Decode) <= 0:
				continue
			case skipDown && c.health.down():
				continue
			}
			if best == nil || c.inflight.Load() < best.inflight.Load() {
				best = c
			}
		}
		if best != nil {
			break
		}
	}
	if best == nil {
		if with != nil {
			return nil, nil, fmt.Errorf("%w (none of group %q for %s %s)", errNoPair, with.group, role, with.base)
		}
		return nil, nil, errNoPair
	}
	best.inflight.Add(1)
	u := *best.upstream
	u.role, u.group = role, best.group()
	return &u, func() { best.inflight.Add(-1) }, nil
}

func (fu *fleetUpstream) group() string { return string(fu.inst.Mode) + "/" + fu.inst.Group }

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
