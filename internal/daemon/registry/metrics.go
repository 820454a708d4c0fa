package registry

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the registry's Prometheus metrics. One Metrics may serve a
// Registrar and a View together; it is safe for concurrent use.
type Metrics struct {
	errors     *prometheus.CounterVec // op
	badEntries *prometheus.CounterVec // field
	refused    *prometheus.CounterVec // reason
	refusedNow *prometheus.GaugeVec   // reason
	events     *prometheus.CounterVec // kind
	registered prometheus.Gauge
	engines    *prometheus.GaugeVec // role
}

// NewMetrics returns the registry's metrics, registered with reg when it
// is not nil.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_registry_errors_total",
			Help: "Failed calls to etcd, by operation (grant, keepalive, put, delete, revoke, get, watch, check): each is logged and retried with backoff; what was known keeps serving."}, []string{"op"}),
		badEntries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_registry_bad_entries_total",
			Help: "Registry entries refused (malformed or inconsistent), by the field at fault; each is logged naming the key, the field and the value."}, []string{"field"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_registry_refused_total",
			Help: "Registry keys not taken in, by reason (max_entries: the view is full, -etcd-max-engines): each key once when it is left out, not again while it stays out (new listings, values put again over it); again if it was taken in since."}, []string{"reason"}),
		refusedNow: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvxfer_registry_refused_entries",
			Help: "Registry keys left out of this process's view now, by reason (max_entries: the view is full); they come in, by a new listing, once room is made."}, []string{"reason"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_registry_events_total",
			Help: "Fleet changes seen in the registry: join, leave (a lease ended or an engine left), generation (an engine rejoined) and rank_gone (one of an engine's per-rank servers left)."}, []string{"kind"}),
		registered: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvxfer_registry_registered",
			Help: "1 while this process's entries are in etcd under a live lease, else 0 (etcd unreachable, or nothing to publish)."}),
		engines: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvxfer_registry_engines",
			Help: "Engines in this process's view of the registry, by role."}, []string{"role"}),
	}
	for _, op := range []string{"grant", "keepalive", "put", "delete", "revoke", "get", "watch", "check"} {
		m.errors.WithLabelValues(op)
	}
	m.refused.WithLabelValues("max_entries")
	m.refusedNow.WithLabelValues("max_entries")
	for _, k := range []string{"join", "leave", "generation", "rank_gone"} {
		m.events.WithLabelValues(k)
	}
	if reg != nil {
		reg.MustRegister(m.errors, m.badEntries, m.refused, m.refusedNow, m.events, m.registered, m.engines)
	}
	return m
}

// Collectors are m's metrics, for a registry that m was not registered
// with.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.errors, m.badEntries, m.refused, m.refusedNow, m.events, m.registered, m.engines}
}

// BadEntry counts an entry refused by its field.
func (m *Metrics) BadEntry(err error) { m.badEntries.WithLabelValues(Field(err)).Inc() }
