// Package proxy is `kvxferd proxy`: an OpenAI-compatible HTTP router in
// front of prefill (P) and decode (D) vLLM servers whose engines move KV
// with kvxfer. It serves POST /v1/completions and /v1/chat/completions
// (plain and "stream": true, relayed chunk by chunk), GET /v1/models
// (forwarded to a D), /health and /metrics (Prometheus, a registry of its
// own).
//
// # Modes
//
// Pull (sequential): P gets the client's body with max_tokens 1 (and
// max_completion_tokens 1 for chat when present), stream false, no
// stream_options and
//
//	"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}
//
// P's response carries a kv_transfer_params object; D gets the client's
// original body with kv_transfer_params set to that object, byte for byte,
// and D's response goes to the client.
//
// Push (concurrent, the default): P and D are dispatched at once under one
// random transfer id T. P gets the pull body with "mode": "push" added to
// its kv_transfer_params; D gets the original body with
//
//	"kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": T,
//	    "mode": "push", "remote_engine_id": E, "remote_host": H, "remote_port": N, "tp_size": TP}
//
// where E, H, N and TP are the P server's engine id, kvxferd host and port
// and tensor-parallel size from its -prefill spec. If P fails before D's
// first response byte, D's request is cancelled (vLLM aborts it) and the
// client gets 502; after that, D's stream is cut.
//
// # Usage
//
// Build a Config, call New and serve the Proxy as an http.Handler; Close
// it after the http.Server has shut down, so that it waits for the
// requests in flight and drops idle upstream connections. Main is the
// command, with flags (see ParsePrefill for a P server's spec).
//
// Every request logs one structured line (request and transfer ids, the P
// and D chosen, their statuses, P's time, D's time to first byte, the
// total and the outcome) and is counted under kvxfer_proxy_*.
package proxy
