// drive loads libkvxfer with dlopen and drives its C ABI as an engine
// written in C would (TestCABI). It prints what it checks and exits 0 only
// when every check holds.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvxfer.h"

#define CHECK(cond, ...) do { if (!(cond)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); return 1; } } while (0)

// release_later releases the stream *arg after 300 ms (a hang-up that
// ends a take waiting on it).
static void (*release_fn)(long long);
static void *release_later(void *arg) {
	struct timespec ts = {0, 300 * 1000 * 1000};
	nanosleep(&ts, NULL);
	release_fn(*(long long *)arg);
	return NULL;
}

// free_port returns a loopback TCP port nothing listens on (0: none).
static int free_port(void) {
	int s = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = {0};
	socklen_t n = sizeof a;
	a.sin_family = AF_INET;
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	int port = 0;
	if (s >= 0 && bind(s, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(s, (struct sockaddr *)&a, &n) == 0) port = ntohs(a.sin_port);
	if (s >= 0) close(s);
	return port;
}

static double now_s(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
	if (argc != 2) return 2;
	void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib, "dlopen: %s", dlerror());
	int (*start)(const char *, char *, size_t) = (int (*)(const char *, char *, size_t))dlsym(lib, "kvxfer_start");
	int (*stop)(void) = (int (*)(void))dlsym(lib, "kvxfer_stop");
	const char *(*version)(void) = (const char *(*)(void))dlsym(lib, "kvxfer_version");
	const char *(*last_error)(void) = (const char *(*)(void))dlsym(lib, "kvxfer_last_error");
	CHECK(start && stop && version && last_error, "missing symbols");
	printf("version %s\n", version());

	const char *cfg = "{\"insecure_peers\": true, \"log_level\": \"error\"}";
	char ep[256], ep2[256], tiny[4];
	int rc = start(cfg, ep, sizeof ep);
	CHECK(rc == KVXFER_OK, "start = %d: %s", rc, last_error());
	CHECK(strncmp(ep, "unix-abstract:", 14) == 0, "endpoint %s", ep);
	rc = start(cfg, ep2, sizeof ep2);
	CHECK(rc == KVXFER_OK && strcmp(ep, ep2) == 0, "second start = %d, %s (want %s)", rc, ep2, ep);
	rc = start(cfg, tiny, sizeof tiny);
	CHECK(rc == KVXFER_ERANGE && strstr(last_error(), "needs"), "start into 4 bytes = %d: %s", rc, last_error());
	rc = start("{\"log_level\": \"warn\"}", ep2, sizeof ep2);
	CHECK(rc == KVXFER_ESTARTED, "start with another configuration = %d: %s", rc, last_error());

	pid_t pid = fork();
	if (pid == 0) {
		int r1 = start(cfg, ep2, sizeof ep2);
		int (*chk)(const char *) = (int (*)(const char *))dlsym(lib, "kvxfer_check_config");
		int ok = r1 == KVXFER_EFORK && strstr(last_error(), "forked child") != NULL && stop() == KVXFER_EFORK &&
			chk && chk(cfg) == KVXFER_EFORK;
		_exit(ok ? 0 : 1);
	}
	int st = 0;
	CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "forked child: status %d", st);

	CHECK(stop() == KVXFER_OK, "stop: %s", last_error());
	CHECK(stop() == KVXFER_OK, "second stop: %s", last_error());

	// A child forked without exec closes its copies of the server's
	// listening sockets at once: while it lives, the server stops and
	// starts again on the same peer port.
	int port = free_port();
	CHECK(port > 0, "no free port");
	char pcfg[256];
	snprintf(pcfg, sizeof pcfg, "{\"insecure_peers\": true, \"log_level\": \"error\", \"peer_listen\": \"127.0.0.1:%d\"}", port);
	rc = start(pcfg, ep2, sizeof ep2);
	CHECK(rc == KVXFER_OK, "start on peer port %d = %d: %s", port, rc, last_error());
	int ready[2];
	CHECK(pipe(ready) == 0, "pipe");
	pid = fork();
	if (pid == 0) {
		// Running: the fork handlers have run (the parent waits for this:
		// under load a child may not be scheduled for a while).
		ssize_t w = write(ready[1], "r", 1);
		(void)w;
		struct timespec ts = {30, 0}; // killed long before
		nanosleep(&ts, NULL);
		_exit(0);
	}
	CHECK(pid > 0, "fork");
	char r;
	CHECK(read(ready[0], &r, 1) == 1, "the forked child never ran");
	close(ready[0]);
	close(ready[1]);
	CHECK(stop() == KVXFER_OK, "stop with a forked child alive: %s", last_error());
	rc = start(pcfg, ep2, sizeof ep2);
	int again = rc;
	char why[512];
	snprintf(why, sizeof why, "%s", last_error());
	kill(pid, SIGKILL);
	waitpid(pid, &st, 0);
	CHECK(again == KVXFER_OK, "start again on peer port %d with a forked child alive = %d: %s", port, again, why);
	CHECK(stop() == KVXFER_OK, "stop: %s", last_error());
	printf("forked child closed the listeners\n");
	rc = start("{\"no_such_key\": 1}", ep2, sizeof ep2);
	CHECK(rc == KVXFER_ECONFIG && strstr(last_error(), "no_such_key"), "bad key = %d: %s", rc, last_error());
	CHECK(last_error()[0] != 0, "last_error empty");
	// A configuration checked without starting anything.
	int (*check)(const char *) = (int (*)(const char *))dlsym(lib, "kvxfer_check_config");
	CHECK(check, "missing kvxfer_check_config");
	CHECK(check(cfg) == KVXFER_OK && last_error()[0] == 0, "check good config: %s", last_error());
	rc = check("{\"drain_timeout\": 5}");
	CHECK(rc == KVXFER_ECONFIG && strstr(last_error(), "drain_timeout"), "check bad value = %d: %s", rc, last_error());
	rc = check("{\"log_level\": \"loud\"}");
	CHECK(rc == KVXFER_ECONFIG && strstr(last_error(), "loud"), "check bad log level = %d: %s", rc, last_error());
	rc = start(cfg, ep2, sizeof ep2); // nothing started by the checks: a start takes any configuration
	CHECK(rc == KVXFER_OK, "start after checks = %d: %s", rc, last_error());
	CHECK(stop() == KVXFER_OK, "stop: %s", last_error());
	// Direct streams (C ABI 2).
	long long (*sopen)(void) = (long long (*)(void))dlsym(lib, "kvxfer_stream_open");
	int (*sput)(long long, const void *, size_t) = (int (*)(long long, const void *, size_t))dlsym(lib, "kvxfer_stream_put");
	int (*stake)(long long, long long, void **, size_t *, int *) =
		(int (*)(long long, long long, void **, size_t *, int *))dlsym(lib, "kvxfer_stream_take");
	void (*srelease)(long long) = (void (*)(long long))dlsym(lib, "kvxfer_stream_release");
	void (*sfree)(void *) = (void (*)(void *))dlsym(lib, "kvxfer_free");
	CHECK(sopen && sput && stake && srelease && sfree, "missing stream symbols");
	CHECK(sopen() == 0 && strstr(last_error(), "no in-process server"), "a stream with no server: %s", last_error());
	rc = start(NULL, ep2, sizeof ep2);
	CHECK(rc == KVXFER_OK && strcmp(ep, ep2) != 0, "restart = %d, %s: %s", rc, ep2, last_error());
	CHECK(last_error()[0] == 0, "last_error after success = %s", last_error());
	long long s = sopen();
	CHECK(s > 0, "stream open: %s", last_error());
	rc = sput(s, "\xff\xff\xff", 3);
	CHECK(rc == KVXFER_EFAIL && strstr(last_error(), "does not parse"), "garbage put = %d: %s", rc, last_error());
	void *msg = NULL;
	size_t len = 0;
	int code = -1;
	rc = stake(s, 1000, &msg, &len, &code);
	CHECK(rc == KVXFER_EAGAIN && msg == NULL, "take before any hello = %d", rc);
	// An empty ConnectRequest (no hello): the server ends the stream, InvalidArgument (3).
	rc = sput(s, "", 0);
	CHECK(rc == KVXFER_OK, "empty put = %d: %s", rc, last_error());
	rc = stake(s, 10000000, &msg, &len, &code);
	CHECK(rc == KVXFER_EENDED && code == 3 && strstr(last_error(), "hello"), "take after no hello = %d, code %d: %s", rc, code,
		last_error());
	srelease(s);
	rc = stake(s, 0, &msg, &len, &code);
	CHECK(rc == KVXFER_EFAIL && strstr(last_error(), "no stream"), "take on a released stream = %d: %s", rc, last_error());
	sfree(NULL);
	// A wait past what Go's time.Duration holds (18446744073709552 us, 584
	// thousand years) is a wait without limit, not a product that wraps to
	// 384 ns: the take waits for the stream's end (a release 300 ms later).
	long long w = sopen();
	CHECK(w > 0, "stream open: %s", last_error());
	release_fn = srelease;
	pthread_t th;
	CHECK(pthread_create(&th, NULL, release_later, &w) == 0, "pthread_create");
	double t0 = now_s();
	rc = stake(w, 18446744073709552LL, &msg, &len, &code);
	double took = now_s() - t0;
	pthread_join(th, NULL);
	CHECK(rc == KVXFER_EENDED && took >= 0.25, "take waiting 18446744073709552 us = %d after %.3f s, want KVXFER_EENDED after the release at 0.3 s",
		rc, took);
	// A scheduler call without gRPC: an unknown method is Unimplemented (12).
	int (*call)(const char *, const void *, size_t, long long, void **, size_t *, int *) =
		(int (*)(const char *, const void *, size_t, long long, void **, size_t *, int *))dlsym(lib, "kvxfer_call");
	CHECK(call, "missing kvxfer_call");
	rc = call("NoSuchMethod", "", 0, 0, &msg, &len, &code);
	CHECK(rc == KVXFER_ESTATUS && code == 12 && strstr(last_error(), "NoSuchMethod"), "unknown method = %d, code %d: %s", rc, code,
		last_error());
	// BuildMeta of an engine with no scheduler: a status, not a crash.
	rc = call("BuildMeta", "", 0, 1000000, &msg, &len, &code);
	CHECK(rc == KVXFER_ESTATUS && code != 0, "BuildMeta of no engine = %d, code %d: %s", rc, code, last_error());
	// A forked child of the process that runs the server: every direct
	// stream and call entry refused (KVXFER_EFORK, or 0 from open), the
	// void ones (close_send, release) returning without touching Go. They
	// wrote the fork's message (some 250 bytes) into an 8-byte stack
	// buffer: the child died by SIGSEGV.
	long long f = sopen();
	CHECK(f > 0, "stream open: %s", last_error());
	void (*sclose)(long long) = (void (*)(long long))dlsym(lib, "kvxfer_stream_close_send");
	CHECK(sclose, "missing kvxfer_stream_close_send");
	pid = fork();
	if (pid == 0) {
		int ok = 1;
		sclose(f);
		srelease(f);
		srelease(f + 1);
		ok = ok && sopen() == 0 && strstr(last_error(), "forked child") != NULL;
		ok = ok && sput(f, "", 0) == KVXFER_EFORK && strstr(last_error(), "forked child") != NULL;
		ok = ok && stake(f, 0, &msg, &len, &code) == KVXFER_EFORK;
		ok = ok && call("Step", "", 0, 0, &msg, &len, &code) == KVXFER_EFORK && strstr(last_error(), "forked child") != NULL;
		_exit(ok ? 0 : 1);
	}
	CHECK(pid > 0, "fork");
	CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "forked child calling the stream entries: %s %d (want exit 0)",
		WIFSIGNALED(st) ? "killed by signal" : "exit status", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
	rc = sput(f, "", 0); // the parent's stream is the parent's still
	CHECK(rc == KVXFER_OK, "put after the child = %d: %s", rc, last_error());
	srelease(f);
	printf("forked child refused by the stream entries\n");
	CHECK(stop() == KVXFER_OK, "stop: %s", last_error());
	printf("ok\n");
	return 0;
}
