// sigpipe: a process whose stderr is a pipe nobody reads starts and stops
// the library's server (which logs to stderr). "ignore": the process
// ignores SIGPIPE as Python does, and lives on, as it does without the
// library; "default": it keeps SIGPIPE's default, and dies by it, as by
// its own writes.
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvxfer.h"

int main(int argc, char **argv) {
	if (argc != 3) {
		fprintf(stderr, "usage: sigpipe LIB ignore|default\n");
		return 2;
	}
	if (strcmp(argv[2], "ignore") == 0) signal(SIGPIPE, SIG_IGN);
	int p[2];
	if (pipe(p) != 0 || close(p[0]) != 0 || dup2(p[1], 2) < 0) {
		printf("pipe\n");
		return 2;
	}
	void *h = dlopen(argv[1], RTLD_NOW);
	if (!h) {
		printf("dlopen: %s\n", dlerror());
		return 2;
	}
	int (*start)(const char *, char *, size_t) = (int (*)(const char *, char *, size_t))dlsym(h, "kvxfer_start");
	int (*stop)(void) = (int (*)(void))dlsym(h, "kvxfer_stop");
	char ep[256];
	int rc = start("{\"insecure_peers\": true, \"log_level\": \"debug\"}", ep, sizeof ep);
	if (rc != KVXFER_OK) {
		printf("start: %d\n", rc);
		return 1;
	}
	if ((rc = stop()) != KVXFER_OK) {
		printf("stop: %d\n", rc);
		return 1;
	}
	printf("alive\n");
	return 0;
}
