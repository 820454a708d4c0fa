package kvxfertest

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/agentrpc"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/shm"
)

// agentArg is the first argument of an agent process: AgentCommand puts
// it there, ServeAgentIfChild looks for it.
const agentArg = "kvxfertest-agent"

// AgentCommand returns the command that runs one agent for a
// ProcessHarness: this executable (a test binary whose TestMain calls
// ServeAgentIfChild first) with the agent's flags args: -backend builtin
// (TCP on 127.0.0.1, default) or nixl, -nixl-params key=value,..., -name.
// The harness appends -socket, -shm and -size.
func AgentCommand(args ...string) *exec.Cmd {
	self, err := os.Executable()
	if err != nil {
		self = os.Args[0]
	}
	return exec.Command(self, append([]string{agentArg}, args...)...)
}

// ServeAgentIfChild makes this process an agent when AgentCommand
// launched it (its first argument says so): it serves the agent until the
// client hangs up, then exits. Otherwise it returns at once. A test binary
// whose harnesses use AgentCommand calls it first thing in TestMain.
func ServeAgentIfChild() {
	if len(os.Args) < 2 || os.Args[1] != agentArg {
		return
	}
	if err := serveAgent(os.Args[2:]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// serveAgent is an agent process: one backend agent, its memory a
// shared-memory file the caller created (-shm, -size), served with
// internal/agentrpc to the one client that connects to -socket. It
// returns when the client hangs up (the client's Close, or the client's
// process ending), so a test that closes the agent loses a real peer
// process.
func serveAgent(args []string) error {
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	socket := fs.String("socket", "", "unix socket to serve the agent on (one client)")
	shmPath := fs.String("shm", "", "shared-memory file holding the agent's memory")
	size := fs.Uint64("size", 0, "bytes of -shm to map")
	backend := fs.String("backend", "builtin", "builtin (TCP on 127.0.0.1) or nixl")
	nixlParams := fs.String("nixl-params", "", "NIXL UCX backend parameters: key=value,...")
	name := fs.String("name", "", "agent name (default: from the pid)")
	sameHost := fs.Bool("same-host", false, "builtin: adopt -shm with its file, so WRITEs between agents take the same-host path (default: TCP)")
	accept := fs.Duration("accept-timeout", 30*time.Second, "how long to wait for the client")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *socket == "" || *shmPath == "" {
		return errors.New("agent: -socket and -shm are required")
	}
	params, err := nixl.ParseParams(*nixlParams)
	if err != nil {
		return fmt.Errorf("agent: -nixl-params: %w", err)
	}
	if *name == "" {
		*name = fmt.Sprintf("kvxfertest-agent-%d-%d", os.Getpid(), time.Now().UnixNano())
	}
	m, err := shm.Map("", *shmPath, *size)
	if err != nil {
		return err
	}
	defer m.Close()
	base := uint64(uintptr(unsafe.Pointer(&m.Bytes[0])))
	var be interface {
		kvxfer.Backend
		Map(base uint64, mem []byte) error
	}
	// Each constructor's result is checked before it becomes be: a failed
	// one is a nil pointer, which in be would not be nil.
	switch *backend {
	case "builtin":
		// The direct copy is for agents of one process; here every peer
		// is another process, so the TCP path is what runs.
		b, err := tcp.New(tcp.Config{Name: *name, Conns: 3, DisableLocal: true, DisableSameHost: !*sameHost,
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		if err != nil {
			return err
		}
		be = b
	case "nixl":
		b, err := nixl.New(nixl.Config{Name: *name, Params: params})
		if err != nil {
			return err
		}
		be = b
	default:
		return fmt.Errorf("agent: -backend = %q, want builtin or nixl", *backend)
	}
	defer be.Close()
	if fm, ok := be.(interface {
		MapFile(base uint64, mem []byte, f *os.File, off int64) error
	}); ok && *sameHost {
		err = fm.MapFile(base, m.Bytes, m.File(), 0)
	} else {
		err = be.Map(base, m.Bytes)
	}
	if err != nil {
		return err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: *socket, Net: "unix"})
	if err != nil {
		return err
	}
	_ = ln.SetDeadline(time.Now().Add(*accept))
	conn, err := ln.Accept()
	ln.Close() // removes the socket file
	if err != nil {
		return fmt.Errorf("agent: no client: %w", err)
	}
	return agentrpc.Serve(conn, be, agentrpc.Info{Pid: os.Getpid(),
		Region: kvxfer.MemRegion{Addr: base, Len: *size, Kind: kvxfer.MemDRAM}})
}
