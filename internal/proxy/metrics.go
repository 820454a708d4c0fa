package proxy

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Outcomes of a client request (the outcome label and the log field).
const (
	outcomeOK          = "ok"
	outcomeBadRequest  = "bad_request"    // the body is not a JSON object
	outcomeTooLarge    = "too_large"      // the body is over Config.MaxBody
	outcomeOverloaded  = "overloaded"     // Config.MaxConcurrent requests in flight
	outcomePrefillFail = "prefill_failed" // P failed (HTTP 5xx, connection, no kv_transfer_params)
	outcomeDecodeFail  = "decode_failed"  // D failed (connection, HTTP 5xx relayed, stream broken)
	outcomeRejected    = "rejected"       // P or D refused the request (HTTP 4xx but 408), its answer relayed
	outcomeCanceled    = "canceled"       // the client went away
	outcomeNoUpstream  = "no_upstream"    // a Fleet has no live, compatible P and D now
)

// Upstream error kinds (the kind label).
const (
	kindConnect  = "connect"  // dialling or sending failed, or the connection broke before a response
	kindTimeout  = "timeout"  // Config.Timeout ran out
	kindStatus   = "status"   // a non-2xx HTTP status but a refusal's
	kindRejected = "rejected" // HTTP 4xx but 408: the upstream refused the request itself (the client's to fix)
	kindProtocol = "protocol" // a response we cannot use: bad JSON, no kv_transfer_params, too large
	kindRead     = "read"     // the response body broke off
)

const (
	rolePrefill = "prefill"
	roleDecode  = "decode"
)

// metrics are the proxy's Prometheus metrics, in a registry of its own.
type metrics struct {
	reg          *prometheus.Registry
	requests     *prometheus.CounterVec   // mode, endpoint, outcome
	inflight     *prometheus.GaugeVec     // role, upstream
	up           *prometheus.GaugeVec     // role, upstream
	upstreamErrs *prometheus.CounterVec   // role, upstream, kind
	prefillTime  *prometheus.HistogramVec // mode
	decodeTTFB   *prometheus.HistogramVec // mode
	total        *prometheus.HistogramVec // mode, endpoint
}

func newMetrics() *metrics {
	// 1 ms to about 9 minutes: a one-token prefill to a long generation.
	buckets := prometheus.ExponentialBuckets(0.001, 2, 20)
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvxfer_proxy_requests_total", Help: "Client requests by mode, endpoint and outcome.",
		}, []string{"mode", "endpoint", "outcome"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvxfer_proxy_upstream_in_flight", Help: "Requests in flight per upstream server.",
		}, []string{"role", "upstream"}),
		up: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvxfer_proxy_upstream_up",
			Help: "1 while an upstream server is picked, 0 while it is left out after its connection failed (retried after 1 s, doubling to 30 s while it keeps failing).",
		}, []string{"role", "upstream"}),
		upstreamErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvxfer_proxy_upstream_errors_total", Help: "Failed upstream requests by upstream and kind.",
		}, []string{"role", "upstream", "kind"}),
		prefillTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvxfer_proxy_prefill_seconds", Help: "P request latency (sent to response read).", Buckets: buckets,
		}, []string{"mode"}),
		decodeTTFB: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvxfer_proxy_decode_ttfb_seconds", Help: "D time to first response byte (from sending D's request).", Buckets: buckets,
		}, []string{"mode"}),
		total: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvxfer_proxy_request_seconds", Help: "Client request latency, whole response relayed.", Buckets: buckets,
		}, []string{"mode", "endpoint"}),
	}
	m.reg.MustRegister(m.requests, m.inflight, m.up, m.upstreamErrs, m.prefillTime, m.decodeTTFB, m.total,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}
