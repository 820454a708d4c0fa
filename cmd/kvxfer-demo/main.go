// Command kvxfer-demo runs kvxfer end to end on one machine: a P and a D
// kvxferd as separate processes (this binary re-executed as each daemon),
// simulated engines attached to them (internal/simengine: Go clients of
// kvxfer.v1 with block allocators, schedulers and KV caches in shared
// memory filled with a deterministic pattern), a few hundred requests per
// scenario (push and pull, TP1 and TP2 producers), every transferred byte
// verified.
//
//	go run ./cmd/kvxfer-demo [-requests 200] [-seed 1] [-backend builtin|nixl]
//
// It is a command of its own so that kvxferd links no simulator.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
)

func main() {
	daemontest.ServeIfChild() // the demo's daemons are this binary
	err := run(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return // the flag set printed the usage
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvxfer-demo:", err)
		os.Exit(1)
	}
}
