/*
 * libkvxfer: kvxfer's server inside the engine's own process (the
 * in-process placement). Build: go build -buildmode=c-shared -o libkvxfer.so ./cmd/libkvxfer
 *
 * The engine starts the server once per process with a JSON configuration
 * (keys: kvxferd serve's flag names) and connects its per-rank kvxfer.v1
 * gRPC streams to the endpoint it returns. Only this process may use that
 * endpoint; memory in hello.memory may be named by address (in_process).
 *
 * Every function is safe to call from any thread. In a child forked from
 * the process that loaded the library, every function fails with
 * KVXFER_EFORK (the Go runtime does not survive fork); start the server
 * in the child only after exec. Such a child closes its copies of the
 * server's listening sockets as it is forked (pthread_atfork), so that
 * the parent may start a server on the same ports again while it lives. The library changes no environment
 * variable and installs no handler for the signals the engine uses.
 */
#ifndef KVXFER_H
#define KVXFER_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. */
#define KVXFER_OK 0
#define KVXFER_ECONFIG 1   /* the configuration is not valid JSON, or a key or value is bad */
#define KVXFER_ESTARTED 2  /* started already with another configuration (stop it first) */
#define KVXFER_EFORK 3     /* called in a forked child of the process that loaded the library */
#define KVXFER_ERANGE 4    /* the endpoint does not fit in cap bytes (with its NUL) */
#define KVXFER_EFAIL 5     /* the server could not start or stop (listeners, backend, ...); a bad call */
#define KVXFER_EAGAIN 6    /* kvxfer_stream_take: nothing came within the wait */
#define KVXFER_EENDED 7    /* the stream ended (kvxfer_stream_take: its gRPC status code in *code) */
#define KVXFER_ESTATUS 8   /* kvxfer_call: the call failed; its gRPC status code in *code */

/*
 * kvxfer_start starts the server from config_json (NULL or "" or "{}":
 * the defaults) and writes the gRPC target engines connect to
 * ("unix-abstract:NAME" or "unix:PATH", NUL-terminated) into endpoint.
 * Idempotent: with the same configuration as the running server it
 * writes that server's endpoint and returns KVXFER_OK. Where the server
 * stopped by itself (a listener gone), it first waits for that stop to
 * finish (its ranks drained), then starts a new one; KVXFER_EFAIL if that
 * server did not let go of its engines' memory (do not free it).
 */
int kvxfer_start(const char *config_json, char *endpoint, size_t cap);

/*
 * kvxfer_check_config checks config_json as kvxfer_start reads it (every
 * key known, every value of its flag's type and range, the keys together
 * consistent) and starts nothing: KVXFER_OK, or KVXFER_ECONFIG with the
 * key and the value named in kvxfer_last_error. An engine checks its
 * configuration as it is built, before the work that precedes its
 * server's start (a model's load).
 */
int kvxfer_check_config(const char *config_json);

/*
 * kvxfer_stop stops the server gracefully: transfers in flight finish
 * (within the configuration's drain-timeout, then 5 s more at most),
 * every rank's stream ends, and no memory named by address is touched
 * after it returns KVXFER_OK. Where a rank has still not let go of its
 * memory 40 s after the drain (a transport that does not end a transfer),
 * it returns an error saying so (kvxfer_last_error): that memory may
 * still be touched and must not be freed. Idempotent: KVXFER_OK when none
 * runs.
 */
int kvxfer_stop(void);

/*
 * Direct streams and calls (C ABI 2): a rank's WorkerService.Connect stream without
 * gRPC, for an engine in this process that would rather not cross gRPC's
 * threads (Python's gRPC moves each message through three threads: 0.2 to
 * 0.5 ms each way). The same kvxfer.v1 messages, marshalled: the engine
 * puts ConnectRequests (hello first) and takes ConnectResponses (ready
 * first), as on the gRPC stream.
 *
 * kvxfer_stream_open opens one on the running server: its id, or 0 (see
 * kvxfer_last_error; at most 65536 streams are held until released). kvxfer_stream_put hands it one marshalled
 * ConnectRequest (KVXFER_EENDED once it ended or close_send was called;
 * KVXFER_EFAIL for one over 4 MiB or that does not parse, the stream going
 * on; kvxfer_call answers such a request KVXFER_ESTATUS, InvalidArgument).
 * kvxfer_stream_take waits up to wait_us microseconds (negative: without
 * limit) for the next ConnectResponse: KVXFER_OK with *msg (free it with
 * kvxfer_free) and *len; KVXFER_EAGAIN when none came; KVXFER_EENDED once
 * the stream ended and every message before its end was taken, with its
 * gRPC status code in *code (0: a clean end) and its message in
 * kvxfer_last_error. kvxfer_stream_close_send ends what the engine sends
 * (a half-close: after its bye). kvxfer_stream_release forgets the stream,
 * ending it first if it runs (a hang-up). Stopping the server ends every
 * stream.
 */
long long kvxfer_stream_open(void);
int kvxfer_stream_put(long long stream, const void *msg, size_t len);
int kvxfer_stream_take(long long stream, long long wait_us, void **msg, size_t *len, int *code);
void kvxfer_stream_close_send(long long stream);
void kvxfer_stream_release(long long stream);
void kvxfer_free(void *p);

/*
 * kvxfer_call makes one SchedulerService call (method: its name, as "Step")
 * on the running server without gRPC: req is the marshalled request;
 * KVXFER_OK with the marshalled response in *resp (free it with
 * kvxfer_free) and *resp_len, or KVXFER_ESTATUS with the call's gRPC status
 * code in *code and its message in kvxfer_last_error. wait_us bounds the
 * call as a deadline would (0: none).
 */
int kvxfer_call(const char *method, const void *req, size_t len, long long wait_us, void **resp, size_t *resp_len, int *code);

/* kvxfer_version is the library's version (a static string). */
const char *kvxfer_version(void);

/*
 * kvxfer_last_error is the message of the calling thread's last failed
 * call (static per thread, valid until its next call; "" if none).
 */
const char *kvxfer_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVXFER_H */
