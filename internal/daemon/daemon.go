// Package daemon is kvxferd's serve command: it serves engine ranks over
// a unix socket (kvxfer.v1 WorkerService), handshakes with peer daemons
// over TCP (PeerService), moves KV bytes with the built-in or the NIXL
// backend, and exports Prometheus metrics. Its server side of kvxfer.v1
// is package server; package daemontest runs it as a child process of
// any binary whose main hands "serve" to Main (the demo, the P/D
// simulator, tests).
package daemon

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/envflag"
	"github.com/kvxfer/kvxfer/internal/forkclose"
	"github.com/kvxfer/kvxfer/internal/hoptrace"
	"github.com/kvxfer/kvxfer/internal/lograte"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/automaxprocs/maxprocs"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/topology"
)

// config is the daemon's configuration.
type config struct {
	socketMode                                                                                          octalMode
	socket, peerListen, peerAdvertise, dataHost, metricsListen, shmDir, readyFile, logLevel, preconnect string
	backend, nixlParams, peerAllow, peerSecretFile, tlsCert, tlsKey, tlsCA, hopTrace                    string
	insecurePeers, nixlAnyVersion, noSameHost, ownProcessOnly                                           bool
	noGates                                                                                             bool
	helloTimeout                                                                                        time.Duration
	maxStreams, maxStreamsPerUID, maxPeerConns, maxPeerConnsTotal                                       int
	maxPeerCalls, maxPeerCallsPerConn                                                                   int
	maxEngineConns, maxEngineConnsPerUID                                                                int
	maxCalls, maxCallsPerUID                                                                            int
	maxMemEntries, maxMemEntriesPerUID                                                                  int
	drainTimeout, lease, nixlProgressDelay, nixlPoll, peerTimeout                                       time.Duration
	conns, maxSegments, maxRequests, rankPortBase, dataPortBase                                         int
	etcd                                                                                                etcdConfig
	// Engine ids reserved for uids (owners.go).
	engineOwner      ownerFlag
	engineOwnersFile string
	engineOwnersOnly bool
	// ownerRules are engineOwner's and engineOwnersFile's rules, read
	// (users resolved, the file read) once, by validate.
	ownerRules []server.EngineOwner
}

// octalMode is -socket-mode's value: permission bits, read in octal with
// or without a leading 0 or 0o (660 is 0660, as chmod reads it) and shown
// so (-h: "default 0600"). A plain uint flag read 660 as decimal (01224,
// refused as no permission bits) and showed its default as 384.
type octalMode uint

func (m *octalMode) String() string { return fmt.Sprintf("%#o", uint(*m)) }

func (m *octalMode) Set(s string) error {
	t := strings.TrimPrefix(strings.TrimPrefix(s, "0o"), "0O")
	v, err := strconv.ParseUint(t, 8, 32)
	if err != nil || t == "" {
		return fmt.Errorf("%q is no octal mode (e.g. 0600, 0660, 0666)", s)
	}
	*m = octalMode(v)
	return nil
}

// flagSet defines kvxferd serve's flags on c, with their defaults: the
// command line's, the environment's (KVXFERD_<FLAG>) and libkvxfer's
// JSON configuration's keys are these names.
func flagSet(c *config) *flag.FlagSet {
	fs := flag.NewFlagSet("kvxferd serve", flag.ContinueOnError)
	fs.StringVar(&c.socket, "socket", "/run/kvxferd.sock", "unix socket engines connect to")
	c.socketMode = 0o600
	fs.Var(&c.socketMode, "socket-mode", "permissions of -socket, in octal: 0600 lets only kvxferd's user connect; "+
		"0666 lets every local user run engines (each engine is identified by its uid and touches only what that uid owns); "+
		"an abstract -socket (@name) has no file, and kvxferd applies the mode to each connection's uid and groups itself")
	fs.StringVar(&c.peerListen, "peer-listen", "127.0.0.1:7600", "TCP address of the Peer service")
	fs.StringVar(&c.peerAdvertise, "peer-advertise", "", "address peers dial for the Peer service (default: the listener's)")
	fs.IntVar(&c.rankPortBase, "rank-port-base", 0, "serve one rank of an engine whose ranks are served each by its own server "+
		"(the in-process placement): rank (pp, tp) listens at this port + pp_rank*tp_size + tp_rank, on -peer-listen's host; "+
		"a rank attaches only on its own port, and peers handshake with each rank's port (0: every rank of an engine here)")
	fs.IntVar(&c.dataPortBase, "data-port-base", 0, "built-in backend: rank (pp, tp) of an engine listens for KV bytes at this port + "+
		"pp_rank*tp_size + tp_rank, so a firewall can name the ports (0: a port the system picks; with several engines on one daemon, "+
		"only one may use it)")
	fs.StringVar(&c.dataHost, "data-host", "127.0.0.1", "host the built-in backend listens on for KV bytes (one port per rank)")
	fs.IntVar(&c.conns, "conns", 4, "TCP connections per peer for KV bytes")
	fs.BoolVar(&c.noSameHost, "no-same-host", false, "built-in backend: move KV bytes to peers on this host over TCP too, not by a direct copy out of the engine's shared-memory file")
	fs.BoolVar(&c.noGates, "no-gates", false, "built-in backend: same-host GPU WRITEs always two-sided (the consumer's side copies); by default a push consumer offers each grant "+
		"to a producer on its GPU as a gate, and the producer launches the copy into the consumer's memory itself, one-sided")
	fs.StringVar(&c.metricsListen, "metrics-listen", "127.0.0.1:9600", `address of /metrics ("" to disable)`)
	fs.StringVar(&c.shmDir, "shm-dir", shm.DefaultDir, "directory engines' shared-memory files must live in (rules: package shm)")
	fs.DurationVar(&c.drainTimeout, "drain-timeout", 30*time.Second, "how long shutdown waits for transfers in flight")
	fs.DurationVar(&c.lease, "lease", 30*time.Second, "producer lease kept alive by consumer heartbeats")
	fs.DurationVar(&c.peerTimeout, "peer-timeout", 5*time.Second,
		"how long a producer engine that requests wait on may stay silent (its daemon not answering) before they fail (at least 50ms); negative: never")
	fs.StringVar(&c.readyFile, "ready-file", "", "write the Peer service address here once serving (removed when it stops)")
	fs.StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.IntVar(&c.maxRequests, "max-requests", kvxfer.DefaultMaxRequests,
		"requests a worker rank holds at once on each side (producer, consumer), and an engine's scheduler keeps in each of its sets (held, receiving, staged); one past it fails at once (transfer_setup_failed; a scheduler call: ResourceExhausted)")
	fs.IntVar(&c.maxSegments, "max-segments", topology.DefaultMaxSegments,
		"descriptors one block may need to land exactly in a peer's KV layout (HND on one side and NHD on the other needs one per token and head); "+
			"peers past it are refused at handshake. Set it alike on P and D")
	fs.StringVar(&c.peerSecretFile, "peer-secret-file", "", "file holding the secret peer daemons share (readable by its owner only; 16+ bytes): "+
		"every connection between daemons, Peer service and data plane, is authenticated with it. Unset: a random secret, so no other daemon can peer with this one")
	fs.StringVar(&c.tlsCert, "tls-cert", "", "this daemon's certificate (PEM) for mutual TLS between daemons, Peer service and data plane; "+
		"with -tls-key and -tls-ca, instead of -peer-secret-file (encrypts KV bytes: costs bandwidth, see bench/RESULTS.md)")
	fs.StringVar(&c.tlsKey, "tls-key", "", "the key of -tls-cert (PEM, readable by its owner only)")
	fs.StringVar(&c.tlsCA, "tls-ca", "", "the CA (PEM) that signed every peer daemon's certificate; peers' names are checked against the addresses dialed")
	fs.BoolVar(&c.insecurePeers, "insecure-peers", false, "turn peer authentication off: anyone who reaches the peer and data ports can read and write attached engines' KV caches")
	fs.StringVar(&c.peerAllow, "peer-allow", "", "peer daemons engines may name, comma-separated IPs, IP prefixes (10.0.0.0/8) and host names "+
		`(matched as written, not resolved); unset: any. Transfers naming another address fail with "not in kvxferd's -peer-allow list"`)
	fs.DurationVar(&c.helloTimeout, "hello-timeout", 10*time.Second, "how long a new worker stream may take to say hello")
	fs.IntVar(&c.maxStreams, "max-streams", 4096, "engine streams (worker and scheduler streams) open at once, all users; also bounds open schedulers")
	fs.IntVar(&c.maxStreamsPerUID, "max-streams-per-uid", 1024, "engine streams open at once per user (uid); also bounds one user's open schedulers")
	fs.IntVar(&c.maxEngineConns, "max-engine-conns", 4096, "connections open at once on the engine socket, all users (one past it is closed at once)")
	fs.IntVar(&c.maxEngineConnsPerUID, "max-engine-conns-per-uid", 1024, "connections open at once on the engine socket per user (uid)")
	fs.IntVar(&c.maxCalls, "max-calls", 0, "calls in flight at once on the engine socket (every method, streams included), all users (0: twice -max-streams)")
	fs.IntVar(&c.maxCallsPerUID, "max-calls-per-uid", 0, "calls in flight at once on the engine socket per user (uid), over any connections (0: twice -max-streams-per-uid)")
	fs.IntVar(&c.maxMemEntries, "max-memory-entries", 0, "hello.memory entries mapped at once (shared-memory files, CUDA IPC imports), all users; "+
		"0: a quarter of the open-file limit, at most 16384")
	fs.IntVar(&c.maxMemEntriesPerUID, "max-memory-entries-per-uid", 0, "hello.memory entries mapped at once per user (uid); 0: half of -max-memory-entries")
	fs.IntVar(&c.maxPeerConns, "max-peer-conns-per-addr", 64, "connections to the Peer service open at once from one IP; "+
		"and to each rank's built-in data port, those not yet authenticated")
	fs.IntVar(&c.maxPeerConnsTotal, "max-peer-conns", 4096, "connections to the Peer service open at once from all IPs; and to each rank's built-in data port")
	fs.IntVar(&c.maxPeerCallsPerConn, "max-peer-calls-per-conn", server.DefaultMaxPeerCallsPerConn, "calls in flight at once on one connection to the Peer service (handshakes, health checks and watches)")
	fs.IntVar(&c.maxPeerCalls, "max-peer-calls", server.DefaultMaxPeerCalls, "calls in flight at once on the Peer service, all connections")
	fs.StringVar(&c.preconnect, "preconnect", "", "peer engines every rank handshakes with at start: engine=host:port,...")
	fs.StringVar(&c.backend, "backend", "builtin", "transfer backend: builtin (TCP, direct copy in process) or nixl (NVIDIA NIXL, UCX)")
	fs.DurationVar(&c.nixlProgressDelay, "nixl-progress-delay", 100*time.Microsecond,
		"pause of NIXL's progress thread between rounds, per rank (0: it spins, a core per rank even when idle)")
	fs.DurationVar(&c.nixlPoll, "nixl-poll-interval", nixl.DefaultPollInterval,
		"how often a rank's NIXL backend polls for notifications and transfer ends while a transfer is in flight or its Worker "+
			"awaits a peer's answer (each hop of a transfer waits up to this long; each poll costs a thread wake-up, ~25 us of CPU on a small VM)")
	fs.BoolVar(&c.nixlAnyVersion, "nixl-any-version", false, "open a NIXL library whose version this build does not declare the C API of, "+
		"or cannot tell (undefined behaviour where the C API differs)")
	fs.StringVar(&c.nixlParams, "nixl-params", "", "NIXL UCX backend parameters: key=value,... (Debian's UCX 1.13 over shared memory: ucx_error_handling_mode=none)")
	fs.BoolVar(&c.ownProcessOnly, "own-process-only", false, "serve engine connections from this process only (SO_PEERCRED pid), "+
		"refusing the others: libkvxfer's in-process placement, whose abstract socket any local process could reach")
	fs.StringVar(&c.hopTrace, "hop-trace", "", "append a JSON line to this file as each request passes each point of its path "+
		"(step taken, registration, WRITE/READ posted and ended, notices, outcome published and sent), stamped with CLOCK_MONOTONIC ns, "+
		"for python/tests/hoptrace.py to time the hops; several processes may share the file. Off when unset (costs nothing then)")
	fs.Var(&c.engineOwner, "engine-owner", "reserve engine ids for a user, repeatable (one value may hold several, space-separated): PATTERN=USER, "+
		"PATTERN an engine id or a prefix and a final * (team-a-*; * alone: every id), USER a user name (resolved at start) or a uid. "+
		"Another uid's rank or scheduler under a reserved id is refused (PermissionDenied, counted as engine_reserved), root's too; "+
		"an id several rules match belongs to the most specific (an exact id, else the longest prefix); ids no rule matches stay first come, "+
		"first served across users (see -engine-owners-only)")
	fs.StringVar(&c.engineOwnersFile, "engine-owners", "", "file of -engine-owner rules, one PATTERN USER a line (# starts a comment), read at start; "+
		"a regular file of root's or kvxferd's user, writable by its owner only. With -engine-owner, both apply; a pattern named twice is refused")
	fs.BoolVar(&c.engineOwnersOnly, "engine-owners-only", false, "refuse every engine id no -engine-owner or -engine-owners rule matches "+
		"(counted as engine_unreserved): no id is first come, first served")
	etcdFlags(fs, &c.etcd)
	return fs
}

func parseFlags(args []string) (*config, error) {
	c := &config{}
	fs := flagSet(c)
	// Environment first (KVXFERD_<FLAG>; KVXFERD_PROXY_* are kvxferd
	// proxy's), flags override.
	if err := envflag.Load(fs, "KVXFERD_", "kvxferd serve", "peer-secret-file", "PROXY_"); err != nil {
		return nil, err
	}
	c.engineOwner.fromEnv = true // the command line's replace the environment's
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	c.etcd.noteGiven(fs)
	if fs.NArg() > 0 {
		// Parsing stops at the first word that is no flag: every flag
		// after it would be dropped without a word.
		return nil, fmt.Errorf("unexpected argument %q (flags only; a bool flag takes its value as -flag=false, not -flag false): "+
			"it and everything after it were not read", fs.Arg(0))
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// minPeerTimeout is -peer-timeout's least positive value: five probes of
// kvxfer's shortest interval (10ms).
const minPeerTimeout = 50 * time.Millisecond

// minHelloTimeout is -hello-timeout's least value.
const minHelloTimeout = 100 * time.Millisecond

// validate checks c's values, naming the flag of a bad one.
func (c *config) validate() error {
	if c.socketMode&^0o777 != 0 {
		return fmt.Errorf("-socket-mode = %#o, want permission bits only (e.g. 0600, 0660, 0666)", c.socketMode)
	}
	if c.socketMode == 0 {
		return errors.New("-socket-mode = 0: no user could connect; want e.g. 0600 (kvxferd's user only), 0660 or 0666")
	}
	if c.socket == "" || c.socket == "@" {
		return fmt.Errorf("-socket = %q, want a path (/run/kvxferd.sock) or an abstract name (@name)", c.socket)
	}
	if !filepath.IsAbs(c.shmDir) {
		// Engines name their memory files by absolute path, which is
		// never beneath a relative directory: every one would be refused.
		return fmt.Errorf("-shm-dir = %q, want an absolute directory (default %s)", c.shmDir, shm.DefaultDir)
	}
	if c.conns <= 0 {
		return fmt.Errorf("-conns = %d, want > 0", c.conns)
	}
	if err := c.addrs(); err != nil {
		return err
	}
	tls := c.tlsCert != "" || c.tlsKey != "" || c.tlsCA != ""
	if n := btoi(c.insecurePeers) + btoi(c.peerSecretFile != "") + btoi(tls); n > 1 {
		return errors.New("-insecure-peers, -peer-secret-file and -tls-*: choose one way to secure peers")
	}
	if tls && (c.tlsCert == "" || c.tlsKey == "" || c.tlsCA == "") {
		return errors.New("-tls-cert, -tls-key and -tls-ca: mutual TLS needs all three")
	}
	if c.peerAllow != "" {
		if _, err := server.ParseAllowList(c.peerAllow); err != nil {
			return fmt.Errorf("-peer-allow: %w", err)
		}
	}
	if c.helloTimeout <= 0 || c.maxStreams <= 0 || c.maxStreamsPerUID <= 0 || c.maxPeerConns <= 0 || c.maxPeerConnsTotal <= 0 ||
		c.maxEngineConns <= 0 || c.maxEngineConnsPerUID <= 0 {
		return fmt.Errorf("-hello-timeout %v, -max-streams %d, -max-streams-per-uid %d, -max-peer-conns-per-addr %d, -max-peer-conns %d, "+
			"-max-engine-conns %d, -max-engine-conns-per-uid %d: want each > 0",
			c.helloTimeout, c.maxStreams, c.maxStreamsPerUID, c.maxPeerConns, c.maxPeerConnsTotal, c.maxEngineConns, c.maxEngineConnsPerUID)
	}
	if c.helloTimeout < minHelloTimeout {
		// Shorter, a busy engine's hello (sent as its stream opens, then
		// carried across a loaded host) would be refused, every rank
		// with it: the daemon would serve no engine.
		return fmt.Errorf("-hello-timeout = %v, want at least %v (default 10s)", c.helloTimeout, minHelloTimeout)
	}
	if c.maxPeerCalls <= 0 || c.maxPeerCallsPerConn <= 0 {
		return fmt.Errorf("-max-peer-calls %d, -max-peer-calls-per-conn %d: want each > 0", c.maxPeerCalls, c.maxPeerCallsPerConn)
	}
	if c.maxCalls < 0 || c.maxCallsPerUID < 0 {
		return fmt.Errorf("-max-calls %d, -max-calls-per-uid %d: want each >= 0 (0: the default)", c.maxCalls, c.maxCallsPerUID)
	}
	if c.maxMemEntries < 0 || c.maxMemEntriesPerUID < 0 {
		return fmt.Errorf("-max-memory-entries %d, -max-memory-entries-per-uid %d: want each >= 0 (0: the default)", c.maxMemEntries, c.maxMemEntriesPerUID)
	}
	if c.rankPortBase < 0 || c.rankPortBase > 65535 {
		return fmt.Errorf("-rank-port-base = %d, want 0 (off) or a port", c.rankPortBase)
	}
	if c.rankPortBase != 0 {
		// The port peers reach this server at: rank-port-base plus the
		// index of the rank it serves (0: the system picks, a server that
		// serves the engine's scheduler side only).
		flag, addr := "-peer-listen", c.peerListen
		if c.peerAdvertise != "" {
			flag, addr = "-peer-advertise", c.peerAdvertise
		}
		if _, ps, err := net.SplitHostPort(addr); err == nil {
			if p, err := strconv.Atoi(ps); err == nil && p != 0 && p < c.rankPortBase {
				return fmt.Errorf("-rank-port-base = %d with %s %q: a rank's server listens at rank-port-base + pp_rank*tp_size + tp_rank, "+
					"not below it (no rank could attach here)", c.rankPortBase, flag, addr)
			}
		}
	}
	if c.dataPortBase < 0 || c.dataPortBase > 65535 {
		return fmt.Errorf("-data-port-base = %d, want 0 (off) or a port", c.dataPortBase)
	}
	if err := c.portsApart(); err != nil {
		return err
	}
	if c.drainTimeout <= 0 {
		return fmt.Errorf("-drain-timeout = %v, want > 0", c.drainTimeout)
	}
	if c.peerTimeout >= 0 && c.peerTimeout < minPeerTimeout {
		// A consumer probes every -peer-timeout/5, at most every 10ms,
		// each probe given at least 10ms: shorter, one slow answer
		// would fail every request on a healthy producer.
		return fmt.Errorf("-peer-timeout = %v, want at least %v (or negative: never)", c.peerTimeout, minPeerTimeout)
	}
	if c.maxRequests <= 0 {
		return fmt.Errorf("-max-requests = %d, want > 0", c.maxRequests)
	}
	if c.maxSegments <= 0 {
		return fmt.Errorf("-max-segments = %d, want > 0", c.maxSegments)
	}
	if _, err := c.peers(); err != nil {
		return err
	}
	if c.backend != "builtin" && c.backend != "nixl" {
		return fmt.Errorf("-backend = %q, want builtin or nixl", c.backend)
	}
	if _, err := c.params(); err != nil {
		return err
	}
	if c.lease < time.Second {
		return fmt.Errorf("-lease = %v, want at least 1s", c.lease)
	}
	if c.nixlProgressDelay < 0 || c.nixlProgressDelay > time.Second {
		return fmt.Errorf("-nixl-progress-delay = %v, want 0 to 1s", c.nixlProgressDelay)
	}
	if c.nixlPoll < 10*time.Microsecond || c.nixlPoll > 100*time.Millisecond {
		return fmt.Errorf("-nixl-poll-interval = %v, want 10us to 100ms", c.nixlPoll)
	}
	rules, err := c.engineOwners()
	if err != nil {
		return err
	}
	c.ownerRules = rules
	if err := c.etcd.validate(); err != nil {
		return err
	}
	return c.etcd.checkAdvertise(c.peerAdvertise)
}

// addrs checks the listeners' addresses and the advertised one: HOST:PORT
// each, the advertised one with a host and a port peers can dial (an
// address without is no configuration to find out about at listen time,
// or never: a server advertising one names its engines by it).
// checkListenHost refuses a host to listen on that is none: with a port,
// in brackets, or with characters no host name or IP address has ("" and
// the unspecified addresses listen on every address).
func checkListenHost(host string) error {
	if host == "" {
		return nil
	}
	if strings.Contains(host, ":") {
		if _, err := netip.ParseAddr(host); err != nil {
			return errors.New("want a host name or IP address, without a port or brackets")
		}
		return nil
	}
	if strings.ContainsFunc(host, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '-' || r == '_')
	}) {
		return errors.New("want a host name or IP address, without a port")
	}
	return nil
}

func (c *config) addrs() error {
	if err := checkListenHost(c.dataHost); err != nil {
		return fmt.Errorf("-data-host = %q: %w", c.dataHost, err)
	}
	for _, a := range []struct {
		flag, addr string
		dialed     bool
	}{{"-peer-listen", c.peerListen, false}, {"-metrics-listen", c.metricsListen, false}, {"-peer-advertise", c.peerAdvertise, true}} {
		if a.addr == "" && a.flag != "-peer-listen" {
			continue // off, or the listener's
		}
		host, port, err := net.SplitHostPort(a.addr)
		n, perr := strconv.Atoi(port)
		switch {
		case err != nil:
			return fmt.Errorf("%s = %q: %w", a.flag, a.addr, err)
		case perr != nil || n < 0 || n > 65535 || (a.dialed && n == 0):
			return fmt.Errorf("%s = %q: port %q, want %s", a.flag, a.addr, port, map[bool]string{false: "0 to 65535", true: "1 to 65535"}[a.dialed])
		case a.dialed && host == "":
			return fmt.Errorf("%s = %q: want the host peers dial, and its port", a.flag, a.addr)
		}
	}
	return nil
}

// portsApart checks that the built-in backend's first data port
// (-data-port-base, rank 0's) is not a port kvxferd listens on already on
// an overlapping address (-peer-listen, -metrics-listen, -rank-port-base):
// every engine's first rank would fail to attach.
func (c *config) portsApart() error {
	if c.dataPortBase == 0 || c.backend != "builtin" {
		return nil
	}
	type listener struct{ flag, host, port string }
	var ls []listener
	for _, l := range []struct{ flag, addr string }{{"-peer-listen", c.peerListen}, {"-metrics-listen", c.metricsListen}} {
		if host, port, err := net.SplitHostPort(l.addr); err == nil {
			ls = append(ls, listener{l.flag, host, port})
		}
	}
	if c.rankPortBase != 0 {
		if host, _, err := net.SplitHostPort(c.peerListen); err == nil {
			ls = append(ls, listener{"-rank-port-base", host, strconv.Itoa(c.rankPortBase)})
		}
	}
	for _, l := range ls {
		if l.port == strconv.Itoa(c.dataPortBase) && hostsOverlap(l.host, c.dataHost) {
			return fmt.Errorf("-data-port-base = %d: rank 0's data port is %s's port (%s), on -data-host %q: choose ports apart",
				c.dataPortBase, l.flag, net.JoinHostPort(l.host, l.port), c.dataHost)
		}
	}
	return nil
}

// hostsOverlap reports whether listeners on hosts a and b may take the
// same port's place: one host, or either the unspecified address.
func hostsOverlap(a, b string) bool {
	unspecified := func(h string) bool {
		ip := net.ParseIP(h)
		return h == "" || ip != nil && ip.IsUnspecified()
	}
	if unspecified(a) || unspecified(b) {
		return true
	}
	if ia, ib := net.ParseIP(a), net.ParseIP(b); ia != nil && ib != nil {
		return ia.Equal(ib)
	}
	return strings.EqualFold(a, b)
}

// progressDelay is nixl.Config.ProgressDelay for -nixl-progress-delay
// (whose 0 means spin).
func (c *config) progressDelay() time.Duration {
	if c.nixlProgressDelay == 0 {
		return -1
	}
	return c.nixlProgressDelay
}

// params parses -nixl-params.
func (c *config) params() (map[string]string, error) {
	p, err := nixl.ParseParams(c.nixlParams)
	if err != nil {
		return nil, fmt.Errorf("-nixl-params: %w", err)
	}
	return p, nil
}

// peers parses -preconnect.
func (c *config) peers() ([]kvxfer.PeerRef, error) {
	var out []kvxfer.PeerRef
	for _, item := range strings.Split(c.preconnect, ",") {
		if item = strings.TrimSpace(item); item == "" {
			continue
		}
		id, addr, ok := strings.Cut(item, "=")
		if !ok || id == "" || addr == "" {
			return nil, fmt.Errorf("-preconnect item %q, want engine=host:port", item)
		}
		out = append(out, kvxfer.PeerRef{EngineID: id, Addr: addr})
	}
	return out, nil
}

// Main runs the daemon with command-line flags (also read from
// KVXFERD_<FLAG>) until SIGTERM or SIGINT, then shuts down gracefully.
func Main(args []string) error {
	c, err := parseFlags(args)
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		// Before, "-log-level: slog: level string ...: unknown name",
		// without the levels it takes.
		return fmt.Errorf("-log-level = %q, want debug, info, warn or error", c.logLevel)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(log)
	setMaxProcs(log)
	ctx, stop := onSignals(c, log)
	defer stop()
	return serve(ctx, c, log)
}

// onSignals returns a context that ends at the first SIGTERM or SIGINT
// (a graceful shutdown); a second one while it runs exits at once, status
// 128+signal, without waiting for the drain. SIGHUP is logged and
// ignored: kvxferd reloads nothing. Before, SIGHUP (a reload sent by habit,
// `systemctl reload`, a closed terminal) killed it at once, Go's default,
// without a word: no drain, every transfer in flight lost, its socket
// file left behind.
func onSignals(c *config, log *slog.Logger) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	hups := make(chan os.Signal, 1)
	signal.Notify(hups, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-hups:
				log.Warn("kvxferd: SIGHUP ignored: kvxferd reloads nothing (flags are read at start: restart it to change them; " +
					"SIGTERM or SIGINT stops it gracefully)")
			case <-done:
				return
			}
		}
	}()
	go func() {
		select {
		case s := <-sigs:
			log.Info("kvxferd: signal: shutting down gracefully (send it again to exit at once)", "signal", s.String())
			cancel()
		case <-done:
			return
		}
		select {
		case s := <-sigs:
			log.Warn("kvxferd: second signal: exiting at once, transfers in flight not drained", "signal", s.String())
			if !abstract(c.socket) {
				_ = os.Remove(c.socket)
			}
			code := 1
			if n, ok := s.(syscall.Signal); ok {
				code = 128 + int(n)
			}
			os.Exit(code)
		case <-done:
		}
	}()
	return ctx, func() {
		signal.Stop(sigs)
		signal.Stop(hups)
		close(done)
		cancel()
	}
}

// setMaxProcs leaves GOMAXPROCS to the Go runtime, which follows the
// container's CPU limit itself (Go 1.25 and later), and calls automaxprocs
// only where that is turned off (GODEBUG=containermaxprocs=0, in the
// environment or built in): calling runtime.GOMAXPROCS would turn off the
// runtime's own updates when the limit changes.
func setMaxProcs(log *slog.Logger) {
	def := ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "DefaultGODEBUG" {
				def = s.Value
			}
		}
	}
	if !containerMaxProcsOff(def, os.Getenv("GODEBUG")) {
		log.Info("kvxferd: GOMAXPROCS", "value", runtime.GOMAXPROCS(0), "set_by", "go runtime (container-aware)")
		return
	}
	if _, err := maxprocs.Set(maxprocs.Logger(func(f string, a ...any) { log.Debug(fmt.Sprintf(f, a...)) })); err != nil {
		log.Warn("kvxferd: automaxprocs", "err", err)
	}
	log.Info("kvxferd: GOMAXPROCS", "value", runtime.GOMAXPROCS(0), "set_by", "automaxprocs (containermaxprocs=0)")
}

// containerMaxProcsOff reports whether the runtime's container-aware
// GOMAXPROCS is off, from the binary's default GODEBUG (build info) and
// the GODEBUG environment variable, the later setting of a key winning as
// the runtime reads them.
func containerMaxProcsOff(buildDefault, env string) bool {
	off := false
	for _, list := range []string{buildDefault, env} {
		for _, kv := range strings.Split(list, ",") {
			if k, v, ok := strings.Cut(strings.TrimSpace(kv), "="); ok && k == "containermaxprocs" {
				off = v == "0"
			}
		}
	}
	return off
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// peerSecurity is how the daemon secures its peer connections: mutual TLS
// (-tls-*), or else the shared-secret exchange (peerAuth).
type peerSecurity struct {
	auth           *peerauth.Authenticator // Insecure when TLS is used
	client, server *tls.Config
}

func (c *config) peerSecurity(log *slog.Logger) (peerSecurity, error) {
	if c.tlsCert != "" {
		client, srv, err := peerauth.LoadTLS(c.tlsCert, c.tlsKey, c.tlsCA)
		if err != nil {
			return peerSecurity{}, err
		}
		log.Info("kvxferd: peers use mutual TLS", "cert", c.tlsCert, "ca", c.tlsCA)
		return peerSecurity{auth: peerauth.Insecure(), client: client, server: srv}, nil
	}
	a, err := c.peerAuth(log)
	return peerSecurity{auth: a}, err
}

// grpcCreds are the Peer service's and the resolver's credentials.
func (p peerSecurity) grpcCreds(name string, log *slog.Logger) (serverCreds, clientCreds credentials.TransportCredentials) {
	if p.server != nil {
		return server.LoggedServerCredentials(credentials.NewTLS(p.server), p.auth.CountFailure, log),
			server.LoggedServerCredentials(credentials.NewTLS(p.client), p.auth.CountFailure, log)
	}
	c := server.PeerCredentialsLogged(p.auth, name, log)
	return c, c
}

// peerAuth is the daemon's peer authentication: with the shared secret of
// -peer-secret-file, off with -insecure-peers (warned at every start), or
// else a random secret no other daemon holds.
func (c *config) peerAuth(log *slog.Logger) (*peerauth.Authenticator, error) {
	switch {
	case c.insecurePeers:
		log.Warn("kvxferd: -insecure-peers: peer authentication is OFF; anyone who reaches the peer and data ports " +
			"can read handshakes and read or write attached engines' KV caches. Use -peer-secret-file outside an isolated test network")
		return peerauth.Insecure(), nil
	case c.peerSecretFile != "":
		secret, err := peerauth.LoadSecret(c.peerSecretFile)
		if err != nil {
			return nil, fmt.Errorf("-peer-secret-file: %w", err)
		}
		return peerauth.New(secret)
	default:
		log.Info("kvxferd: peer authentication with a random secret: no other daemon can peer with this one. " +
			"To let daemons transfer, give each the same -peer-secret-file (KVXFERD_PEER_SECRET_FILE), e.g. " +
			"head -c 32 /dev/urandom | base64 > kvxfer.secret; chmod 600 kvxfer.secret")
		return peerauth.New(peerauth.RandomSecret())
	}
}

// listenPeers opens the Peer service's listener (tests replace it).
var listenPeers = net.Listen

// openNixl opens a NIXL agent (tests replace it).
var openNixl = nixl.New

// backendFactory is server.Config.NewBackend for c: a NIXL agent with
// -backend=nixl, else the built-in backend (devices: this process's GPUs,
// for its same-host path). A backend that does not open is an error and
// no backend: never a nil pointer in a non-nil server.Backend, which the
// server would Close.
//
// The built-in backend's data port is bounded as the Peer service's port
// is: -max-peer-conns-per-addr connections from one IP not yet through
// their authentication, -max-peer-conns in all; refuse counts one past
// them (data_conns_per_addr, data_conns; nil: not counted).
func (c *config) backendFactory(auth *peerauth.Authenticator, sec peerSecurity, log *slog.Logger,
	devices func([16]byte) (tcp.Device, error), refuse func(string)) func(string, *topology.Layout, bool) (server.Backend, error) {
	return func(engine string, l *topology.Layout, vram bool) (server.Backend, error) {
		if c.backend == "nixl" {
			params, _ := c.params()
			name := fmt.Sprintf("%s-pp%d-tp%d-%d", engine, l.PPRank, l.TPRank, time.Now().UnixNano())
			b, err := openNixl(nixl.Config{Name: name, Params: params, VRAM: vram, ProgressDelay: c.progressDelay(), PollInterval: c.nixlPoll,
				AnyVersion: c.nixlAnyVersion})
			if err != nil {
				return nil, fmt.Errorf("-backend=nixl: agent %s: %w", name, err)
			}
			return b, nil
		}
		if vram && c.noSameHost {
			return nil, errors.New("GPU memory needs -backend=nixl, or the built-in backend's same-host path (without -no-same-host) between daemons of one host")
		}
		port := 0
		if c.dataPortBase != 0 {
			if port = server.RankPort(c.dataPortBase, l.TPSize, l.PPRank, l.TPRank); port > 65535 {
				return nil, fmt.Errorf("built-in backend: -data-port-base %d: rank tp %d pp %d would listen at port %d", c.dataPortBase, l.TPRank, l.PPRank, port)
			}
		}
		b, err := tcp.New(tcp.Config{Listen: net.JoinHostPort(c.dataHost, strconv.Itoa(port)), Conns: c.conns, Auth: auth, DisableSameHost: c.noSameHost,
			DisableGates: c.noGates, ClientTLS: sec.client, ServerTLS: sec.server, Logger: log, Devices: devices,
			MaxPendingPerAddr: c.maxPeerConns, MaxIncoming: c.maxPeerConnsTotal, Refused: refuse})
		if err != nil {
			return nil, fmt.Errorf("built-in backend: %w", err)
		}
		return b, nil
	}
}

// serve runs the daemon until ctx ends, then shuts down gracefully.
func serve(ctx context.Context, c *config, log *slog.Logger) error {
	in, err := start(c, log, false)
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case err := <-in.serveErr:
		// A listener failed: the daemon no longer serves. It stops and
		// says so in its exit status, so that a supervisor restarts it.
		log.Error("kvxferd: server stopped", "err", err)
		in.shutdown()
		return fmt.Errorf("server stopped: %w", err)
	}
	in.shutdown()
	return nil
}

// instance is a started server: what shutdown stops.
type instance struct {
	c         *config
	log       *slog.Logger
	srv       *server.Server
	eng, peer *grpc.Server
	hs        *health.Server
	httpSrv   *http.Server
	fleet     *fleet // -etcd's registry, or nil
	serveErr  chan error
	advertise string
	// cleanup undoes what start did, in reverse order.
	cleanup []func()
	// closeErr is the server's Close error (cleanup): its ranks had not
	// all ended within its wait.
	closeErr error
}

// abstract reports whether a unix socket name is in Linux's abstract
// namespace ("@name"): no file, no permissions, gone with its listener.
func abstract(socket string) bool { return strings.HasPrefix(socket, "@") }

// start serves c's listeners and returns once they serve (inProcess:
// libkvxfer's placement, which leaves the process's environment as it
// is). On an error, whatever it started is stopped.
func start(c *config, log *slog.Logger, inProcess bool) (_ *instance, err error) {
	// What peers and engines can make it log comes at most a few lines
	// of a kind at a time: they cannot flood it (each is counted too).
	log = lograte.Logger(log)
	in := &instance{c: c, log: log, serveErr: make(chan error, 3)}
	defer func() {
		if err != nil {
			in.undo()
		}
	}()
	sec, err := c.peerSecurity(log)
	if err != nil {
		return nil, err
	}
	auth := sec.auth
	shmDir := c.shmDir
	if shmDir == "" {
		shmDir = shm.DefaultDir // a config made without parseFlags: the server's default
	}
	if st, err := os.Stat(shmDir); err != nil || !st.IsDir() {
		// Every engine's memory file would be refused at its hello.
		if err == nil {
			err = errors.New("not a directory")
		}
		return nil, fmt.Errorf("-shm-dir %s: %w: engines' shared-memory files must live in an existing directory", shmDir, err)
	}
	var trace *hoptrace.Trace
	if c.hopTrace != "" {
		if trace, err = hoptrace.Open(c.hopTrace); err != nil {
			return nil, fmt.Errorf("-hop-trace: %w", err)
		}
		// Closed after the server (cleanups run last first), so every
		// worker's last events are in.
		in.cleanup = append(in.cleanup, func() {
			if err := trace.Close(); err != nil {
				log.Warn("kvxferd: -hop-trace", "err", err)
			}
			if n := trace.Dropped(); n > 0 {
				log.Warn("kvxferd: -hop-trace dropped events: the writer fell behind", "dropped", n)
			}
		})
		log.Info("kvxferd: hop trace on", "file", c.hopTrace)
	}
	peers, err := c.peers()
	if err != nil {
		return nil, err
	}
	peerLn, err := listenPeers("tcp", c.peerListen)
	if err != nil {
		return nil, fmt.Errorf("-peer-listen %s: %w", c.peerListen, err)
	}
	forkclose.Listener(peerLn)
	in.cleanup = append(in.cleanup, func() { peerLn.Close() })
	in.advertise = c.peerAdvertise
	if in.advertise == "" {
		in.advertise = peerLn.Addr().String()
		if h, _, err := net.SplitHostPort(in.advertise); err == nil && (h == "" || net.ParseIP(h).IsUnspecified()) {
			// The unspecified address names this host only to itself.
			log.Warn("kvxferd: -peer-listen is the unspecified address and -peer-advertise is not set: engines are named by "+
				in.advertise+", which peers on other hosts cannot dial; set -peer-advertise HOST:PORT", "peer_listen", c.peerListen)
		}
	}
	engLn, err := listenEngines(c)
	if err != nil {
		return nil, err
	}
	in.cleanup = append(in.cleanup, func() { engLn.Close() })
	if c.readyFile != "" {
		// An earlier run's file (of a daemon killed) names an address
		// no longer served: gone until this run serves, so that whoever
		// waits for it waits for this run. (Removed only once the
		// engine socket is ours: a second daemon on it, refused, leaves
		// the first one's file be.)
		_ = os.Remove(c.readyFile)
	}
	if !abstract(c.socket) {
		in.cleanup = append(in.cleanup, func() { os.Remove(c.socket) })
	}
	var allow func(string) error
	if c.peerAllow != "" {
		al, err := server.ParseAllowList(c.peerAllow)
		if err != nil {
			return nil, fmt.Errorf("-peer-allow: %w", err)
		}
		allow = al.Check
	}
	serverCreds, clientCreds := sec.grpcCreds(in.advertise, log)
	var onEngines func()
	var lookup func(context.Context, string) (string, error)
	if c.etcd.client.Endpoints != "" {
		if in.fleet, err = startFleet(&c.etcd, in.advertise, log); err != nil {
			return nil, err
		}
		in.cleanup = append(in.cleanup, in.fleet.close)
		onEngines, lookup = in.fleet.enginesChanged, in.fleet.lookup
	} else if names := c.etcd.ignored(); len(names) > 0 {
		log.Warn("kvxferd: registry flags given without -etcd are ignored: no fleet registry is used (give -etcd HOST:PORT, or drop them)",
			"flags", strings.Join(names, " "))
	}
	owners := c.ownerRules // (validate read them)
	if len(owners) > 0 {
		log.Info("kvxferd: engine ids reserved for users", "rules", len(owners), "engine_owners_only", c.engineOwnersOnly)
	}
	var srv *server.Server // GPUs for the built-in backend's same-host path, once started
	srv, err = server.New(server.Config{PeerAddr: in.advertise, RankPortBase: c.rankPortBase, ShmDir: c.shmDir, DrainTimeout: c.drainTimeout, Logger: log,
		AllowPeer: allow, HelloTimeout: c.helloTimeout, MaxStreams: c.maxStreams, MaxStreamsPerUID: c.maxStreamsPerUID,
		MaxEngineConns: c.maxEngineConns, MaxEngineConnsPerUID: c.maxEngineConnsPerUID, MaxCalls: c.maxCalls, MaxCallsPerUID: c.maxCallsPerUID, MaxRequests: c.maxRequests,
		MaxMemoryEntries: c.maxMemEntries, MaxMemoryEntriesPerUID: c.maxMemEntriesPerUID,
		OnEnginesChanged: onEngines, PeerLookup: lookup, EngineOwners: owners, EngineOwnersOnly: c.engineOwnersOnly,
		PeerCreds: clientCreds, PeerInsecure: !auth.Enabled() && sec.server == nil, PeerTLS: sec.server != nil,
		NewBackend: c.backendFactory(auth, sec, log, func(u [16]byte) (tcp.Device, error) { return srv.IPCDevice(u) },
			func(reason string) { srv.Refuse(reason) }),
		WorkerConfig: func(wc *kvxfer.WorkerConfig) {
			wc.Lease, wc.Preconnect, wc.MaxSegments, wc.PeerTimeout = c.lease, peers, c.maxSegments, c.peerTimeout
			wc.MaxRequests = c.maxRequests
			wc.Prepared = c.backend == "nixl" // NIXL: prepared lists, indices per transfer
			if trace != nil {
				wc.HopTrace = trace
			}
		},
	})
	if err != nil {
		return nil, err
	}
	in.srv = srv
	in.cleanup = append(in.cleanup, func() { in.closeErr = srv.Close() })
	if in.fleet != nil {
		in.fleet.attach(srv)
	}
	if c.backend == "nixl" {
		lib, err := setupNixl(c.nixlAnyVersion, log, inProcess)
		if err != nil {
			return nil, err
		}
		log.Info("kvxferd: NIXL backend", "library", lib, "version", capi.LibraryVersion(lib))
	}
	// Listeners by trust: engines on the unix socket (their uid from the
	// socket's credentials), peer daemons on TCP (PeerService and health
	// only).
	engCreds := server.EngineCredentials()
	if c.ownProcessOnly {
		engCreds = server.OwnProcessCredentials(func() { srv.Refuse("other_process") })
	}
	if abstract(c.socket) && !c.ownProcessOnly {
		// An abstract socket has no file to hold -socket-mode: the
		// credentials apply it.
		mode := os.FileMode(c.socketMode)
		if mode == 0 {
			mode = 0o600 // a config made without parseFlags: its default
		}
		engCreds = server.ModeCredentials(engCreds, mode, func() { srv.Refuse("socket_mode") })
	}
	in.eng = grpc.NewServer(grpc.Creds(srv.BoundEngineConns(engCreds)), srv.BoundCalls())
	srv.RegisterEngine(in.eng)
	in.hs = health.NewServer()
	healthpb.RegisterHealthServer(in.eng, in.hs)
	reflection.Register(in.eng)
	in.peer = grpc.NewServer(grpc.Creds(serverCreds), srv.BoundPeerCalls(c.maxPeerCallsPerConn, c.maxPeerCalls))
	srv.RegisterPeer(in.peer)
	healthpb.RegisterHealthServer(in.peer, in.hs)
	perAddr, total := c.maxPeerConns, c.maxPeerConnsTotal
	if perAddr <= 0 {
		perAddr = 64 // a config made without parseFlags: its default
	}
	if total <= 0 {
		total = 4096
	}
	if c.metricsListen != "" {
		reg := prometheus.NewRegistry()
		collectorsFor := []prometheus.Collector{newCollector(srv, auth), collectors.NewGoCollector()}
		if in.fleet != nil {
			collectorsFor = append(collectorsFor, in.fleet.metrics.Collectors()...)
		}
		if !inProcess { // the engine's process is not kvxfer's to describe
			collectorsFor = append(collectorsFor, collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		}
		reg.MustRegister(collectorsFor...)
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mln, err := net.Listen("tcp", c.metricsListen)
		if err != nil {
			return nil, fmt.Errorf("-metrics-listen %s: %w", c.metricsListen, err)
		}
		forkclose.Listener(mln)
		// Whoever reaches it holds a few connections at most (each
		// scrape builds the whole metric set in memory, one at a time
		// per connection), none idle for long, none stalled for ever.
		in.httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: time.Minute, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 16 << 10}
		lim := newLimitListener(mln, "metrics", metricsConnsPerAddr, metricsConns, srv.Refuse)
		go func() { _ = in.httpSrv.Serve(lim) }()
		log.Info("kvxferd: metrics", "addr", mln.Addr().String())
	}
	go func() {
		in.serveErr <- in.peer.Serve(newLimitListener(peerLn, "peer", perAddr, total, srv.Refuse))
	}()
	go func() { in.serveErr <- in.eng.Serve(engLn) }()
	in.hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	log.Info("kvxferd: serving", "socket", c.socket, "peer", in.advertise, "backend", c.backend, "peer_auth", auth.Enabled(), "peer_tls", sec.server != nil)
	if c.readyFile != "" {
		if err := os.WriteFile(c.readyFile+".tmp", []byte(in.advertise), 0o600); err != nil {
			in.shutdown()
			return nil, fmt.Errorf("-ready-file %s: %w (its directory must exist and be writable by kvxferd's user)", c.readyFile, err)
		}
		if err := os.Rename(c.readyFile+".tmp", c.readyFile); err != nil {
			_ = os.Remove(c.readyFile + ".tmp")
			in.shutdown()
			return nil, fmt.Errorf("-ready-file %s: %w", c.readyFile, err)
		}
	}
	return in, nil
}

// listenEngines opens the engines' unix socket: a file of mode
// -socket-mode (a stale one replaced), or an abstract name ("@name").
// Its errors, as the Peer and metrics listeners', name the flag: before,
// "engine socket: ...", "peer listener: ..." and "metrics listener: ..."
// left the operator to guess which flag to change.
func listenEngines(c *config) (net.Listener, error) {
	if abstract(c.socket) {
		ln, err := net.Listen("unix", c.socket)
		if err != nil {
			return nil, fmt.Errorf("-socket %s: %w", c.socket, err)
		}
		forkclose.Listener(ln)
		return ln, nil
	}
	if err := removeStaleSocket(c.socket); err != nil {
		return nil, err
	}
	old := syscall.Umask(0o177)
	engLn, err := net.Listen("unix", c.socket)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("-socket %s: %w (its directory must exist and be writable by kvxferd's user)", c.socket, err)
	}
	mode := os.FileMode(c.socketMode)
	if mode == 0 {
		mode = 0o600 // a config made without parseFlags: its default
	}
	if err := os.Chmod(c.socket, mode); err != nil {
		engLn.Close()
		return nil, fmt.Errorf("-socket %s: -socket-mode %#o: %w", c.socket, mode, err)
	}
	forkclose.Listener(engLn)
	return engLn, nil
}

// removeStaleSocket removes the socket at path if nothing listens on it
// (a daemon that died), and refuses to start where something does
// (another kvxferd: taking its name would leave it serving no new engine,
// and its exit would remove ours) or where path is not a socket (never a
// file removed by a mistyped -socket).
func removeStaleSocket(path string) error {
	st, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("-socket %s: %w", path, err)
	}
	if st.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("-socket %s: exists and is not a socket (%v): not removed; remove it or choose another -socket", path, st.Mode().Type())
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		conn.Close()
		return fmt.Errorf("-socket %s: another process serves it (another kvxferd?): stop it or choose another -socket", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("-socket %s: cannot tell whether it is stale: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("-socket %s: stale socket: %w", path, err)
	}
	return nil
}

// undo runs in's cleanups, last first.
func (in *instance) undo() {
	for i := len(in.cleanup) - 1; i >= 0; i-- {
		in.cleanup[i]()
	}
	in.cleanup = nil
}

// shutdown stops in gracefully: it stops taking new work, lets transfers
// in flight finish (reporting every outcome) and releases every region,
// within -drain-timeout and 5 s more.
func (in *instance) shutdown() {
	log := in.log
	log.Info("kvxferd: shutting down")
	in.hs.Shutdown()
	if in.c.readyFile != "" {
		// Before, a stopped daemon's -ready-file stayed, naming an
		// address no longer served: whoever waited for it after a
		// restart went on at once, to the old run's address.
		_ = os.Remove(in.c.readyFile)
	}
	dctx, cancel := context.WithTimeout(context.Background(), in.c.drainTimeout+5*time.Second)
	defer cancel()
	if err := in.srv.Drain(dctx); err != nil {
		log.Warn("kvxferd: drain", "err", err)
	}
	stopped := make(chan struct{})
	go func() { in.eng.GracefulStop(); in.peer.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-dctx.Done():
		in.eng.Stop()
		in.peer.Stop()
	}
	if in.httpSrv != nil {
		_ = in.httpSrv.Shutdown(dctx)
	}
	in.undo()
	log.Info("kvxferd: stopped")
}

// NixlLibrary prepares this process for NIXL as kvxferd -backend=nixl
// does, and opens a probe agent: it returns the library's path, or why
// NIXL cannot be used here (tests skip on it).
func NixlLibrary() (string, error) { return setupNixl(false, nil, false) }

// setupNixl is the daemon's process setup for NIXL: it finds NIXL's C
// library, sets the environment NIXL and UCX read when they load
// (capi.ProcessEnv: the wheel's plugin directory, UCX's memory-type cache
// off) where it is not set already, and opens a probe agent, which checks
// the library's version (anyVersion: -nixl-any-version).
func setupNixl(anyVersion bool, log *slog.Logger, inProcess bool) (string, error) {
	lib, err := capi.FindLibrary()
	if err != nil {
		return "", fmt.Errorf("-backend=nixl: %w", err)
	}
	for _, kv := range capi.ProcessEnv(lib) {
		k, v, _ := strings.Cut(kv, "=")
		if inProcess {
			// The engine's environment is the engine's: libkvxfer only
			// says what NIXL would want. Memory the process allocated
			// itself needs no UCX_MEMTYPE_CACHE=n (that is for imported
			// CUDA IPC memory).
			if log != nil {
				log.Warn("kvxfer: NIXL environment not set (the library changes no environment variable): set it before loading NIXL if NIXL needs it", "want", kv)
			}
			continue
		}
		if err := os.Setenv(k, v); err != nil {
			return "", fmt.Errorf("-backend=nixl: %s: %w", kv, err)
		}
		if log != nil {
			log.Info("kvxferd: NIXL environment", "set", kv)
		}
	}
	b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("kvxferd-probe-%d", time.Now().UnixNano()), AnyVersion: anyVersion})
	if err != nil {
		return "", fmt.Errorf("-backend=nixl: %w", err)
	}
	_ = b.Close()
	return lib, nil
}
