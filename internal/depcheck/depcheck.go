// Package depcheck enforces kvxfer's dependency direction (DESIGN.md,
// STYLE.md): which packages each package may import, who may import gRPC,
// and who may use cgo. Its test runs the rules over `go list -deps`.
package depcheck

import (
	"fmt"
	"sort"
	"strings"
)

// Module is kvxfer's module path.
const Module = "github.com/kvxfer/kvxfer"

// Package is what the rules need to know about one package.
type Package struct {
	ImportPath string   // full import path
	Deps       []string // transitive dependencies (go list -deps)
	Imports    []string // direct imports
	Cgo        bool     // has CgoFiles
	Standard   bool
}

// Rule restricts what the non-standard dependencies of the package Prefix
// may be. Allowed entries are module-relative paths ("topology") or full
// paths of third-party modules; an entry ending in "/..." allows a
// subtree.
type Rule struct {
	Name    string
	Prefix  string // module-relative package path
	Allowed []string
	// Direct checks only the package's own imports, not its transitive
	// dependencies: for packages whose allowed third-party modules (gRPC)
	// pull in dependencies of their own.
	Direct bool
}

// Rules are kvxfer's dependency rules, one per package of DESIGN.md's
// table; a rule applies as soon as its package exists. cmd/, bench/,
// test/ and fuzz/ may import anything and have no rule here; they and
// every package not listed are checked only by the global rules (gRPC,
// cgo, cmd/bench, and what Production commands link).
var Rules = []Rule{
	{Name: "topology imports only the standard library", Prefix: "topology"},
	{Name: "internal/invariants imports only the standard library", Prefix: "internal/invariants"},
	{Name: "hotpath imports topology and invariants", Prefix: "hotpath",
		Allowed: []string{"topology", "internal/invariants"}},
	{Name: "internal/kvsim imports topology and hotpath", Prefix: "internal/kvsim",
		Allowed: []string{"topology", "hotpath", "internal/invariants", "github.com/puzpuzpuz/xsync/v4/..."}},
	{Name: "internal/netxfer imports std, x/sys, peerauth, finesleep and forkclose", Prefix: "internal/netxfer",
		Allowed: []string{"golang.org/x/sys/...", "internal/peerauth", "internal/finesleep", "internal/forkclose"}},
	{Name: "internal/finesleep imports std and x/sys", Prefix: "internal/finesleep",
		Allowed: []string{"golang.org/x/sys/..."}},
	{Name: "internal/forkclose imports only the standard library", Prefix: "internal/forkclose"},
	{Name: "internal/peerauth imports only the standard library", Prefix: "internal/peerauth"},
	{Name: "internal/lograte imports only the standard library", Prefix: "internal/lograte"},
	{Name: "internal/nixl imports only the standard library and C", Prefix: "internal/nixl"},
	{Name: "internal/cuda imports only the standard library and C", Prefix: "internal/cuda"},
	// The connector core links no backend, no cgo and no transport: an
	// engine that wants only the Scheduler links nothing else.
	{Name: "kvxfer (the core) imports topology and hotpath only", Prefix: "kvxfer",
		Allowed: []string{"topology", "hotpath", "internal/invariants"}},
	{Name: "kvxfer/backend/tcp imports kvxfer and the built-in transport", Prefix: "kvxfer/backend/tcp",
		Allowed: []string{"kvxfer", "topology", "hotpath", "internal/invariants", "internal/netxfer", "internal/peerauth",
			"internal/finesleep", "internal/forkclose", "github.com/puzpuzpuz/xsync/v4/...", "golang.org/x/sys/..."}},
	{Name: "kvxfer/backend/nixl imports kvxfer and NIXL's binding", Prefix: "kvxfer/backend/nixl",
		Allowed: []string{"kvxfer", "topology", "hotpath", "internal/invariants", "internal/nixl", "internal/finesleep",
			"github.com/puzpuzpuz/xsync/v4/...", "golang.org/x/sys/..."}},
	{Name: "kvxfer/kvxfertest imports kvxfer and its backends", Prefix: "kvxfer/kvxfertest",
		Allowed: []string{"kvxfer", "kvxfer/backend/...", "topology", "hotpath", "internal/...", "shm", "github.com/puzpuzpuz/xsync/v4/...", "golang.org/x/sys/..."}},
	{Name: "internal/agentrpc imports kvxfer", Prefix: "internal/agentrpc",
		Allowed: []string{"kvxfer", "topology", "hotpath", "internal/...", "github.com/puzpuzpuz/xsync/v4/...", "golang.org/x/sys/..."}},
	// The hop trace's writer: the core hands it events through
	// kvxfer.HopTracer and reads no clock of its own.
	{Name: "internal/hoptrace imports kvxfer and x/sys", Prefix: "internal/hoptrace",
		Allowed: []string{"kvxfer", "topology", "hotpath", "internal/invariants", "golang.org/x/sys/..."}},
	// shm is public so engines outside the module (and their tests) can
	// make the files kvxferd maps: it must stay a leaf they can import
	// without kvxfer or gRPC.
	{Name: "shm imports std and x/sys", Prefix: "shm",
		Allowed: []string{"golang.org/x/sys/..."}},
	// Direct: Prometheus brings dependencies of its own (protobuf, procfs).
	{Name: "internal/lint/typednil imports x/tools' analysis framework", Prefix: "internal/lint/typednil",
		Allowed: []string{"golang.org/x/tools/..."}},
	{Name: "internal/proxy imports std and Prometheus", Prefix: "internal/proxy", Direct: true,
		Allowed: []string{"internal/envflag", "github.com/prometheus/client_golang/..."}},
	// The protocol and the Go client: what an engine written in Go links.
	// The daemon's side of the protocol is internal/daemon/server.
	{Name: "stream (protocol, conversions, Go client) imports kvxfer and gRPC", Prefix: "stream", Direct: true,
		Allowed: []string{"kvxfer", "topology", "stream/...",
			"google.golang.org/grpc/...", "google.golang.org/protobuf/...", "google.golang.org/genproto/..."}},
	// kvxferd's side of the protocol: the daemon (internal/daemon) wires
	// the NIXL backend in, the server links only its default backend.
	{Name: "internal/daemon/server imports kvxfer, stream and gRPC", Prefix: "internal/daemon/server", Direct: true,
		Allowed: []string{"kvxfer", "kvxfer/backend/tcp", "topology", "hotpath", "internal/cuda", "internal/peerauth", "shm", "stream/...",
			"google.golang.org/grpc/...", "google.golang.org/protobuf/...", "google.golang.org/genproto/...",
			"github.com/klauspost/compress/...", "github.com/puzpuzpuz/xsync/v4",
			"golang.org/x/sys/unix"}}, // the unix socket's peer credentials (SO_PEERCRED)
}

// ruleFor returns the rule for a module-relative package path.
func ruleFor(rel string) (Rule, bool) {
	for _, r := range Rules {
		if rel == r.Prefix {
			return r, true
		}
	}
	return Rule{}, false
}

func allowed(dep string, list []string) bool {
	for _, a := range list {
		if first, _, _ := strings.Cut(a, "/"); !strings.Contains(first, ".") {
			a = Module + "/" + a // module-relative entry
		}
		if sub, ok := strings.CutSuffix(a, "/..."); ok {
			if dep == sub || strings.HasPrefix(dep, sub+"/") {
				return true
			}
		} else if dep == a {
			return true
		}
	}
	return false
}

// TestOnly lists the subtrees that exist for tests, the demo and the
// simulator: simulated engines, the test agent and its RPC, test doubles
// and harnesses, daemons run as child processes with their fault hooks.
var TestOnly = []string{"internal/simengine", "internal/kvsim", "internal/agentrpc", "internal/leakcheck",
	"internal/daemon/daemontest", "internal/daemon/registry/etcdtest", "internal/peerauth/pkitest", "kvxfer/kvxfertest"}

// Production lists the commands kvxfer ships: they link no TestOnly
// package (issue 15: kvxferd links neither the simulator nor the test
// agent).
var Production = []string{"cmd/kvxferd", "cmd/libkvxfer"}

// grpcAllowed lists the subtrees that may depend on gRPC.
// internal/daemon (and its server) serves kvxfer.v1; internal/simengine
// is the simulated engines' client of it (demo, simulator).
var grpcAllowed = []string{"stream", "cmd", "internal/daemon", "internal/simengine", "bench", "test", "fuzz"}

// cgoAllowed lists the packages that may use cgo: the C bindings, and
// libkvxfer's C ABI (the in-process placement).
var cgoAllowed = []string{"internal/nixl", "internal/cuda", "cmd/libkvxfer"}

func under(rel string, roots []string) bool {
	for _, r := range roots {
		if rel == r || strings.HasPrefix(rel, r+"/") {
			return true
		}
	}
	return false
}

// Check returns one violation per line, sorted, for the given packages
// (the module's own packages; standard and third-party ones are skipped).
func Check(pkgs []Package) []string {
	var out []string
	for _, p := range pkgs {
		rel, ok := strings.CutPrefix(p.ImportPath, Module+"/")
		if !ok || p.Standard {
			continue
		}
		if r, ok := ruleFor(rel); ok {
			deps := p.Deps
			if r.Direct {
				deps = p.Imports
			}
			for _, d := range deps {
				if isStd(d) || d == p.ImportPath || allowed(d, r.Allowed) {
					continue
				}
				out = append(out, fmt.Sprintf("%s: imports %s (rule %q)", rel, d, r.Name))
			}
		}
		if !under(rel, grpcAllowed) {
			for _, d := range p.Deps {
				if d == "google.golang.org/grpc" || strings.HasPrefix(d, "google.golang.org/grpc/") {
					out = append(out, fmt.Sprintf("%s: imports %s (only stream/, cmd/, internal/daemon, internal/simengine, bench/, test/ and fuzz/ may use gRPC)", rel, d))
					break
				}
			}
		}
		if under(rel, Production) {
			for _, d := range p.Deps {
				if drel, ok := strings.CutPrefix(d, Module+"/"); ok && under(drel, TestOnly) {
					out = append(out, fmt.Sprintf("%s: links %s (a production command links no test, demo or simulator code)", rel, drel))
				}
			}
		}
		if p.Cgo && !under(rel, cgoAllowed) {
			out = append(out, fmt.Sprintf("%s: uses cgo (only internal/nixl, internal/cuda and cmd/libkvxfer may)", rel))
		}
		for _, d := range p.Imports {
			drel, ok := strings.CutPrefix(d, Module+"/")
			if !ok || !under(drel, []string{"cmd", "bench"}) {
				continue
			}
			if under(rel, []string{"bench"}) && under(drel, []string{"bench"}) {
				continue // the harness may share its own subpackages
			}
			out = append(out, fmt.Sprintf("%s: imports %s (nothing imports cmd/ or bench/)", rel, d))
		}
	}
	sort.Strings(out)
	return out
}

// isStd reports whether dep is a standard-library package (or cgo's
// pseudo-package C, which the cgo rule covers): its first path element has
// no dot.
func isStd(dep string) bool {
	first, _, _ := strings.Cut(dep, "/")
	return !strings.Contains(first, ".")
}
