// Command kvxferd is kvxfer's daemon: it serves engine ranks over a unix
// socket (kvxfer.v1 WorkerService), handshakes with peer daemons over TCP
// (PeerService), moves KV bytes with the built-in or the NIXL backend, and
// exports Prometheus metrics.
//
//	kvxferd [serve] [flags]   run the daemon (flags also read from KVXFERD_<FLAG>)
//	kvxferd proxy [flags]     an OpenAI-compatible router over P and D vLLM
//	                          servers, push or pull (flags also read from
//	                          KVXFERD_PROXY_<FLAG>)
//
// It links no simulated engine and no test code: the demo is a command of
// its own (cmd/kvxfer-demo), and `kvxferd demo` says so.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/proxy"
)

func main() {
	err := run(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return // the flag set printed the usage
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvxferd:", err)
		os.Exit(1)
	}
}

// run runs the command named by args[0] (serve by default).
func run(args []string) error {
	cmd := "serve"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "serve":
		return daemon.Main(args)
	case "demo":
		// The demo simulates engines, which kvxferd does not link.
		return errors.New("the demo is a command of its own: go run ./cmd/kvxfer-demo (in kvxfer's source tree; same flags)")
	case "proxy":
		err := proxy.MainWithFleet(args, daemon.ProxyFleet)
		if err != nil && !errors.Is(err, flag.ErrHelp) {
			err = fmt.Errorf("proxy: %w", err)
		}
		return err
	default:
		return fmt.Errorf("unknown command %q (want serve or proxy)", cmd)
	}
}
