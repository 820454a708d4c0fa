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
 * in the child only after exec. The library changes no environment
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
#define KVXFER_EFAIL 5     /* the server could not start or stop (listeners, backend, ...) */

/*
 * kvxfer_start starts the server from config_json (NULL or "" or "{}":
 * the defaults) and writes the gRPC target engines connect to
 * ("unix-abstract:NAME" or "unix:PATH", NUL-terminated) into endpoint.
 * Idempotent: with the same configuration as the running server it
 * writes that server's endpoint and returns KVXFER_OK.
 */
int kvxfer_start(const char *config_json, char *endpoint, size_t cap);

/*
 * kvxfer_stop stops the server gracefully: transfers in flight finish
 * (within the configuration's drain-timeout, then 5 s more at most),
 * every rank's stream ends, and no memory named by address is touched
 * after it returns. Idempotent: KVXFER_OK when none runs.
 */
int kvxfer_stop(void);

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
