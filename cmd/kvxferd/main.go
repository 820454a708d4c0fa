// Command kvxferd is kvxfer's daemon: it serves engine ranks over a unix
// socket (kvxfer.v1 WorkerService), handshakes with peer daemons over TCP
// (PeerService), moves KV bytes with the built-in or the NIXL backend, and
// exports Prometheus metrics.
//
//	kvxferd [serve] [flags]   run the daemon (flags also read from KVXFERD_<FLAG>)
//	kvxferd demo [flags]      run a P and a D daemon with simulated engines
//
// A hidden `kvxferd agent` serves one backend agent over a unix socket to
// a test (agent.go): the cross-process conformance tests run two of them.
package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/kvxfer/kvxfer/internal/daemon"
)

func main() {
	args := os.Args[1:]
	cmd := "serve"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "serve":
		err = daemon.Main(args)
	case "demo":
		err = demoMain(args)
	case "agent": // hidden: one backend agent served to a test (agent.go)
		err = agentMain(args)
	default:
		err = fmt.Errorf("unknown command %q (want serve or demo)", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvxferd:", err)
		os.Exit(1)
	}
}
