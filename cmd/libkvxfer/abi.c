// The C ABI (kvxfer.h): thin wrappers that refuse a forked child before
// entering Go, and keep each thread's last error in C memory. Go writes
// into buffers this file owns; nothing here is freed by Go or the caller.

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvxfer.h"
#include "_cgo_export.h"

// KVXFER_VERSION: main.go's version must say the same (TestVersion).
#define KVXFER_VERSION "0.2.0 (kvxfer.v1; C ABI 2)"

static pid_t kvxfer_load_pid;

// Each thread's last error: a buffer per thread under a pthread key (not
// __thread, whose static TLS a library dlopen'd late may not get), freed
// when the thread exits.
#define KVXFER_ERR_CAP 2048
static pthread_key_t kvxfer_err_key;
static char kvxfer_err_fallback[KVXFER_ERR_CAP]; // if malloc fails
static const char kvxfer_no_error[] = "";

// The server's listening sockets (fd and inode, as internal/forkclose
// records them), which a child forked without exec closes at once: the
// kernel has no close-on-fork, and a child's copies would keep the ports
// bound while it lives (a server started again on them would fail). A
// slot is free with fd -1; an entry whose socket closed since is stale
// and harmless: the child closes fd only where it is still a socket of
// that inode. Slots are read and written with atomics: fork copies them
// at an instant, and a half-written one matches no socket.
#define KVXFER_FORK_SLOTS 1024
static struct {
	int fd;
	unsigned long long ino;
} kvxfer_fork_fds[KVXFER_FORK_SLOTS];

static int kvxfer_fork_live(int fd, unsigned long long ino) {
	struct stat st;
	return fd >= 0 && fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && (unsigned long long)st.st_ino == ino;
}

// kvxfer_fork_close_add records a listening socket (Go: forkclose's hook),
// in a free slot or one whose socket closed since. 0, or -1 when every
// slot holds a live socket.
int kvxfer_fork_close_add(int fd, unsigned long long ino) {
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; // writers only: the child reads without it
	pthread_mutex_lock(&mu);
	int at = -1;
	for (int i = 0; i < KVXFER_FORK_SLOTS && at < 0; i++) {
		int f = __atomic_load_n(&kvxfer_fork_fds[i].fd, __ATOMIC_ACQUIRE);
		unsigned long long n = __atomic_load_n(&kvxfer_fork_fds[i].ino, __ATOMIC_ACQUIRE);
		if (f < 0 || !kvxfer_fork_live(f, n) || (f == fd && n == ino)) at = i;
	}
	if (at >= 0) {
		__atomic_store_n(&kvxfer_fork_fds[at].fd, -1, __ATOMIC_RELEASE);
		__atomic_store_n(&kvxfer_fork_fds[at].ino, ino, __ATOMIC_RELEASE);
		__atomic_store_n(&kvxfer_fork_fds[at].fd, fd, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&mu);
	return at >= 0 ? 0 : -1;
}

// kvxfer_forked_child runs in a child forked without exec (pthread_atfork):
// fstat and close only (async-signal-safe).
static void kvxfer_forked_child(void) {
	for (int i = 0; i < KVXFER_FORK_SLOTS; i++) {
		int f = __atomic_load_n(&kvxfer_fork_fds[i].fd, __ATOMIC_ACQUIRE);
		unsigned long long n = __atomic_load_n(&kvxfer_fork_fds[i].ino, __ATOMIC_ACQUIRE);
		if (kvxfer_fork_live(f, n)) close(f);
		kvxfer_fork_fds[i].fd = -1;
	}
}

// Whether the process ignored SIGPIPE as it loaded the library (Python
// does), before the Go runtime put its handler in place: a constructor of
// priority 101 runs before those without one, the Go runtime's included.
static int kvxfer_sigpipe_was_ignored;

__attribute__((constructor(101))) static void kvxfer_host_signals(void) {
	struct sigaction sa;
	kvxfer_sigpipe_was_ignored =
		sigaction(SIGPIPE, NULL, &sa) == 0 && !(sa.sa_flags & SA_SIGINFO) && sa.sa_handler == SIG_IGN;
}

int kvxfer_host_ignores_sigpipe(void) { return kvxfer_sigpipe_was_ignored; }

__attribute__((constructor)) static void kvxfer_loaded(void) {
	kvxfer_load_pid = getpid();
	pthread_key_create(&kvxfer_err_key, free);
	for (int i = 0; i < KVXFER_FORK_SLOTS; i++) kvxfer_fork_fds[i].fd = -1;
	pthread_atfork(NULL, NULL, kvxfer_forked_child);
}

static char *kvxfer_err_buf(void) {
	char *b = pthread_getspecific(kvxfer_err_key);
	if (!b) {
		b = calloc(1, KVXFER_ERR_CAP);
		if (!b || pthread_setspecific(kvxfer_err_key, b)) {
			free(b);
			return kvxfer_err_fallback;
		}
	}
	return b;
}

// kvxfer_forked reports whether this is a forked child of the process
// that loaded the library, and then writes why into err, one of
// kvxfer_err_buf's buffers (KVXFER_ERR_CAP bytes): every entry point,
// those without a status included, takes its buffer from there.
static int kvxfer_forked(char *err) {
	if (getpid() == kvxfer_load_pid) return 0;
	snprintf(err, KVXFER_ERR_CAP,
		"kvxfer: called in a forked child (pid %d) of the process that loaded libkvxfer (pid %d): "
		"the Go runtime does not survive fork; start kvxfer in a process that exec'd (multiprocessing 'spawn'), not a forked one",
		(int)getpid(), (int)kvxfer_load_pid);
	return 1;
}

int kvxfer_start(const char *config_json, char *endpoint, size_t cap) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return KVXFER_EFORK;
	return kvxferGoStart((char *)(config_json ? config_json : ""), endpoint, cap, err, KVXFER_ERR_CAP);
}

int kvxfer_check_config(const char *config_json) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return KVXFER_EFORK;
	return kvxferGoCheckConfig((char *)(config_json ? config_json : ""), err, KVXFER_ERR_CAP);
}

int kvxfer_stop(void) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return KVXFER_EFORK;
	return kvxferGoStop(err, KVXFER_ERR_CAP);
}

const char *kvxfer_version(void) { return KVXFER_VERSION; }

const char *kvxfer_last_error(void) {
	char *b = pthread_getspecific(kvxfer_err_key);
	return b ? b : kvxfer_no_error;
}

long long kvxfer_stream_open(void) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return 0;
	return kvxferGoStreamOpen(err, KVXFER_ERR_CAP);
}

int kvxfer_stream_put(long long stream, const void *msg, size_t len) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return KVXFER_EFORK;
	if (!msg && len) {
		snprintf(err, KVXFER_ERR_CAP, "kvxfer: a NULL message of %zu bytes", len);
		return KVXFER_EFAIL;
	}
	return kvxferGoStreamPut(stream, (char *)msg, len, err, KVXFER_ERR_CAP);
}

int kvxfer_stream_take(long long stream, long long wait_us, void **msg, size_t *len, int *code) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return KVXFER_EFORK;
	if (!msg || !len || !code) {
		snprintf(err, KVXFER_ERR_CAP, "kvxfer: kvxfer_stream_take needs msg, len and code");
		return KVXFER_EFAIL;
	}
	*msg = NULL;
	*len = 0;
	*code = 0;
	return kvxferGoStreamTake(stream, wait_us, (char **)msg, len, code, err, KVXFER_ERR_CAP);
}

void kvxfer_stream_close_send(long long stream) {
	// The fork's message in the thread's buffer: a local one of a few
	// bytes took some 250 (the child died by SIGSEGV).
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return;
	kvxferGoStreamCloseSend(stream);
}

void kvxfer_stream_release(long long stream) {
	// The fork's message in the thread's buffer: a local one of a few
	// bytes took some 250 (the child died by SIGSEGV).
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return;
	kvxferGoStreamRelease(stream);
}

void kvxfer_free(void *p) { free(p); }

int kvxfer_call(const char *method, const void *req, size_t len, long long wait_us, void **resp, size_t *resp_len, int *code) {
	char *err = kvxfer_err_buf();
	err[0] = 0;
	if (kvxfer_forked(err)) return KVXFER_EFORK;
	if (!method || (!req && len) || !resp || !resp_len || !code) {
		snprintf(err, KVXFER_ERR_CAP, "kvxfer: kvxfer_call needs method, req (or len 0), resp, resp_len and code");
		return KVXFER_EFAIL;
	}
	*resp = NULL;
	*resp_len = 0;
	*code = 0;
	return kvxferGoCall((char *)method, (char *)req, len, wait_us, (char **)resp, resp_len, code, err, KVXFER_ERR_CAP);
}
