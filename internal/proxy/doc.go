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
// # Refusals, bad requests and dead servers
//
// A P or D that refuses a request itself (HTTP 4xx but 408: a bad
// parameter, an unknown model, a prompt too long) has its answer relayed
// to the client as it is (outcome "rejected", upstream error kind
// "rejected"), whichever of P and D answered first. The proxy itself
// refuses with 400, naming the field and value, a body that is not a
// JSON object, not valid UTF-8 (or escapes an unpaired surrogate), or
// asks for several sequences (n or best_of above 1, use_beam_search) or
// several prompts (a batch in prompt or prompt_embeds): vLLM runs each as
// an engine request of its own carrying the one transfer id. P's
// body drops the client's min_tokens (vLLM refuses it above P's
// max_tokens 1); D's keeps it.
//
// An upstream whose connection fails (no response: refused, reset) is
// left out of the picks for 1 s, doubling to 30 s while it keeps
// failing, unless every candidate is; then it is tried again, and its
// first response brings it back (kvxfer_proxy_upstream_up).
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
