package daemon

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/kvxfer"
	kvnixl "github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
)

// collector exports every rank's kvxfer.Metrics at scrape time (those of
// ranks attached, and of ranks detached a while: server.RankStats):
// the metric set of vLLM's NIXL connector (SPEC §10), under kvxfer_ names,
// plus kvxfer's own.
type collector struct {
	srv  *server.Server
	auth *peerauth.Authenticator

	xferTime, postTime, bytes, descs, amplification, handshake            *prometheus.Desc
	failedXfers, failedNotifs, expired, handshakeFailures                 *prometheus.Desc
	outcomes, failures, badInput, dropped, refusedAccess                  *prometheus.Desc
	gates                                                                 *prometheus.Desc
	refused, authFailures, sameHost, workerPanics, gpuFallback, gateCheck *prometheus.Desc
	nixlReleasedInFlight, nixlRemade                                      *prometheus.Desc
	open, inFlight, pendingRegs                                           *prometheus.Desc
}

func newCollector(srv *server.Server, auth *peerauth.Authenticator) *collector {
	l := []string{"engine", "tp_rank", "pp_rank"}
	d := func(name, help string, extra ...string) *prometheus.Desc {
		return prometheus.NewDesc("kvxfer_"+name, help, append(append([]string(nil), l...), extra...), nil)
	}
	return &collector{srv: srv, auth: auth,
		authFailures: prometheus.NewDesc("kvxfer_peer_auth_failures_total",
			"Connections between daemons (Peer service and data plane, either side) whose authentication failed.", nil, nil),
		xferTime:          d("xfer_time_seconds", "Time of successful transfers, post to completion (vllm:nixl_xfer_time_seconds)."),
		postTime:          d("post_time_seconds", "Time to build and post a transfer's descriptors (vllm:nixl_post_time_seconds)."),
		bytes:             d("bytes_transferred", "Bytes per successful transfer (vllm:nixl_bytes_transferred)."),
		descs:             d("num_descriptors", "Descriptors per successful transfer (vllm:nixl_num_descriptors)."),
		amplification:     d("descriptor_amplification", "Descriptors per block moved, per transfer."),
		handshake:         d("handshake_seconds", "Latency of successful handshakes with peer engines."),
		failedXfers:       d("num_failed_transfers_total", "Transfers that failed to post or complete (vllm:nixl_num_failed_transfers)."),
		failedNotifs:      d("num_failed_notifications_total", "Notifications that could not be sent (vllm:nixl_num_failed_notifications)."),
		expired:           d("num_kv_expired_reqs_total", "Requests whose lease or deadline passed (vllm:nixl_num_kv_expired_reqs)."),
		handshakeFailures: d("handshake_failures_total", "Handshakes with peer engines that failed."),
		workerPanics: prometheus.NewDesc("kvxfer_worker_panics_total",
			"Ranks whose worker hit an internal error (a panic, logged with its stack): each failed its requests and ended its stream; the daemon's other ranks carried on.", nil, nil),
		sameHost: prometheus.NewDesc("kvxfer_same_host_parts_total",
			"Transfer parts (WRITEs from peer daemons on this host, READs of them) this daemon copied straight out of a peer engine's memory file into its engines' memory (the built-in backend's same-host path).", nil, nil),
		gpuFallback: prometheus.NewDesc("kvxfer_gpu_copy_fallback_total",
			"Same-host GPU copies (one per transfer part) made piece by piece because the copy kernel did not load on their GPU (logged once; a driver older than CUDA 12 cannot load its PTX).", nil, nil),
		gateCheck: prometheus.NewDesc("kvxfer_gpu_gate_check_failures_total",
			"GPUs whose gated copy kernel failed its check (a gated launch through an open and a shut gate, once per GPU when first used): their one-sided WRITEs go two-sided (logged).", nil, nil),
		nixlReleasedInFlight: prometheus.NewDesc("kvxfer_nixl_released_in_flight_total",
			"NIXL transfers released while still in flight: a transfer given up is waited for before its release (NIXL's release does not stop UCX moving its bytes), and released anyway after 30 s; its bytes may still have landed in blocks reused since.", nil, nil),
		nixlRemade: prometheus.NewDesc("kvxfer_nixl_connections_remade_total",
			"NIXL connections to peer agents made again after the transport found them broken (NIXL refuses every later post and notification to such a peer until it is loaded anew; logged).", nil, nil),
		outcomes: d("outcomes_total", "Terminal outcomes by side and result.", "side", "result"),
		failures: d("failures_total", "Failed and expired outcomes by side and failure kind.", "side", "kind"),
		badInput: d("bad_input_total", "Inputs rejected, by field.", "field"),
		dropped:  d("dropped_messages_total", "Peer messages dropped, by reason.", "reason"),
		open:     d("requests_open", "Requests a rank holds now, by side (producer: held for a consumer; consumer: receiving).", "side"),
		inFlight: d("transfers_in_flight", "Transfers a rank has posted that have not ended."),
		pendingRegs: d("registrations_pending", "Consumer registrations a producer rank holds that wait for their request "+
			"(push: a consumer registered before the producer's engine finished the request)."),
		refusedAccess: d("data_plane_refused_total", "Peer transfers refused by the data-plane grants, by direction and verdict "+
			"(write_late, write_deny, read_late, read_deny; deny drops the connection; write_aborted, read_aborted: cut short when their grant ended; read_retried).", "verdict"),
		gates: d("gates_total", "Push grants offered to producers one-sided (same-host GPU WRITEs launched by the producer through a gate), "+
			"by outcome (opened; failed: served two-sided instead).", "outcome"),
		refused: prometheus.NewDesc("kvxfer_refused_total",
			"Engine calls, streams and peer addresses the daemon refused, by reason (permission, engine_reserved, engine_unreserved, rank_attached, memory, memory_address, bad_hello, bad_request, other_process, socket_mode, hello_timeout, streams, streams_per_uid, memory_entries, memory_entries_per_uid, schedulers, schedulers_per_uid, engine_conns, engine_conns_per_uid, calls, calls_per_uid, scheduler_requests, peer_not_allowed, peer_conns_per_addr, peer_conns, data_conns_per_addr, data_conns, peer_calls_per_conn, peer_calls, metrics_conns_per_addr, metrics_conns, bad_handshake, bad_step, bad_message).",
			[]string{"reason"}, nil),
	}
}

// Describe sends nothing: the collector is unchecked (its label values
// come and go with ranks).
func (c *collector) Describe(chan<- *prometheus.Desc) {}

func hist(ch chan<- prometheus.Metric, d *prometheus.Desc, s kvxfer.HistogramSnapshot, labels []string) {
	buckets := map[float64]uint64{}
	cum := s.Cumulative()
	for i, b := range s.Bounds {
		buckets[b] = cum[i]
	}
	ch <- prometheus.MustNewConstHistogram(d, s.Count, s.Sum, buckets, labels...)
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	if c.auth != nil {
		ch <- prometheus.MustNewConstMetric(c.authFailures, prometheus.CounterValue, float64(c.auth.Failures()))
	}
	ch <- prometheus.MustNewConstMetric(c.sameHost, prometheus.CounterValue, float64(c.srv.SameHostParts()))
	ch <- prometheus.MustNewConstMetric(c.gpuFallback, prometheus.CounterValue, float64(cuda.CopyFallbacks()))
	ch <- prometheus.MustNewConstMetric(c.gateCheck, prometheus.CounterValue, float64(cuda.GateCheckFailures()))
	ch <- prometheus.MustNewConstMetric(c.nixlReleasedInFlight, prometheus.CounterValue, float64(kvnixl.ReleasedInFlight()))
	ch <- prometheus.MustNewConstMetric(c.nixlRemade, prometheus.CounterValue, float64(kvnixl.RemadeConnections()))
	ch <- prometheus.MustNewConstMetric(c.workerPanics, prometheus.CounterValue, float64(c.srv.WorkerPanics()))
	for reason, n := range c.srv.Refusals() {
		ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(n), reason)
	}
	for engine, workers := range c.srv.Workers() {
		for _, w := range workers {
			l := w.Layout()
			st, err := w.State()
			if err != nil {
				continue
			}
			labels := []string{engine, strconv.Itoa(l.TPRank), strconv.Itoa(l.PPRank)}
			gauge := func(d *prometheus.Desc, v int, extra ...string) {
				ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), append(append([]string(nil), labels...), extra...)...)
			}
			gauge(c.open, st.Sends, "producer")
			gauge(c.open, st.Recvs, "consumer")
			gauge(c.inFlight, st.Handles)
			gauge(c.pendingRegs, st.PendingRegs)
		}
	}
	// Counters by rank, of its workers attached now and before (a rank
	// detached is kept a while: what its worker counted as it closed is
	// exported, and its counters never go back).
	for _, rs := range c.srv.RankStats() {
		labels := []string{rs.Engine, strconv.Itoa(rs.TPRank), strconv.Itoa(rs.PPRank)}
		s := rs.Stats
		hist(ch, c.xferTime, s.TransferSeconds, labels)
		hist(ch, c.postTime, s.PostSeconds, labels)
		hist(ch, c.bytes, s.Bytes, labels)
		hist(ch, c.descs, s.Descriptors, labels)
		hist(ch, c.amplification, s.Amplification, labels)
		hist(ch, c.handshake, s.HandshakeSeconds, labels)
		counter := func(d *prometheus.Desc, v uint64, extra ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append(append([]string(nil), labels...), extra...)...)
		}
		counter(c.failedXfers, s.FailedTransfers)
		counter(c.failedNotifs, s.FailedNotifications)
		counter(c.expired, s.ExpiredRequests)
		counter(c.handshakeFailures, s.HandshakeFailures)
		for _, side := range []kvxfer.Role{kvxfer.RoleProducer, kvxfer.RoleConsumer} {
			for _, r := range []kvxfer.Result{kvxfer.ResultDone, kvxfer.ResultFailed, kvxfer.ResultExpired, kvxfer.ResultAborted} {
				counter(c.outcomes, s.Outcomes[side][r], side.String(), r.String())
			}
			for _, k := range kvxfer.FailureKinds()[1:] {
				counter(c.failures, s.Failures[side][k], side.String(), k.String())
			}
		}
		for k, v := range s.BadInput {
			counter(c.badInput, v, k)
		}
		for k, v := range s.Dropped {
			counter(c.dropped, v, k)
		}
		for k, v := range s.RefusedAccess {
			counter(c.refusedAccess, v, k)
		}
		for k, v := range s.Gates {
			counter(c.gates, v, k)
		}
	}
}
