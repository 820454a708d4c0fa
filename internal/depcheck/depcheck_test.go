package depcheck

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const m = Module + "/"

func TestCheckRules(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reason string
		pkgs   []Package
		want   []string
	}{
		{
			name: "topology with only std is clean",
			pkgs: []Package{{ImportPath: m + "topology", Deps: []string{"fmt", "errors"}}},
		},
		{
			name: "topology importing xsync is flagged",
			pkgs: []Package{{ImportPath: m + "topology", Deps: []string{"fmt", "github.com/puzpuzpuz/xsync/v4"}}},
			want: []string{`topology: imports github.com/puzpuzpuz/xsync/v4 (rule "topology imports only the standard library")`},
		},
		{
			name: "hotpath may import topology but not xsync or kvxfer",
			pkgs: []Package{{ImportPath: m + "hotpath", Deps: []string{m + "topology", "github.com/puzpuzpuz/xsync/v4", m + "kvxfer"}}},
			want: []string{
				`hotpath: imports ` + m + `kvxfer (rule "hotpath imports topology and invariants")`,
				`hotpath: imports github.com/puzpuzpuz/xsync/v4 (rule "hotpath imports topology and invariants")`,
			},
		},
		{
			name: "grpc outside stream is flagged",
			pkgs: []Package{
				{ImportPath: m + "stream", Deps: []string{"google.golang.org/grpc"}},
				{ImportPath: m + "kvxfer", Deps: []string{"google.golang.org/grpc/codes"}},
			},
			want: []string{
				`kvxfer: imports google.golang.org/grpc/codes (only stream/, cmd/, internal/daemon, internal/simengine, bench/, test/ and fuzz/ may use gRPC)`,
				`kvxfer: imports google.golang.org/grpc/codes (rule "kvxfer (the core) imports topology and hotpath only")`,
			},
		},
		{
			name:   "stream is checked on its own imports only",
			reason: "gRPC pulls in x/net, which stream itself must not import",
			pkgs: []Package{{ImportPath: m + "stream",
				Imports: []string{"context", "google.golang.org/grpc", m + "kvxfer", "golang.org/x/net/http2"},
				Deps:    []string{"context", "google.golang.org/grpc", "golang.org/x/net/http2", m + "kvxfer"}}},
			want: []string{`stream: imports golang.org/x/net/http2 (rule "stream (protocol, conversions, Go client) imports kvxfer and gRPC")`},
		},
		{
			name:   "stream holds no daemon side: no backend, shared memory, CUDA or compression",
			reason: "an engine's Go client links the protocol, not kvxferd's server (issue 15)",
			pkgs: []Package{
				{ImportPath: m + "stream", Imports: []string{"google.golang.org/grpc", m + "kvxfer", m + "stream/kvxferv1",
					m + "kvxfer/backend/tcp", m + "shm", m + "internal/cuda", "github.com/klauspost/compress/zstd"}},
				{ImportPath: m + "internal/daemon/server", Imports: []string{"google.golang.org/grpc", m + "stream", m + "kvxfer/backend/tcp",
					m + "shm", m + "internal/cuda", "github.com/klauspost/compress/zstd", m + "kvxfer/backend/nixl"}},
			},
			want: []string{
				`internal/daemon/server: imports ` + m + `kvxfer/backend/nixl (rule "internal/daemon/server imports kvxfer, stream and gRPC")`,
				`stream: imports github.com/klauspost/compress/zstd (rule "stream (protocol, conversions, Go client) imports kvxfer and gRPC")`,
				`stream: imports ` + m + `internal/cuda (rule "stream (protocol, conversions, Go client) imports kvxfer and gRPC")`,
				`stream: imports ` + m + `kvxfer/backend/tcp (rule "stream (protocol, conversions, Go client) imports kvxfer and gRPC")`,
				`stream: imports ` + m + `shm (rule "stream (protocol, conversions, Go client) imports kvxfer and gRPC")`,
			},
		},
		{
			name:   "kvxfertest has its own rule, not kvxfer's",
			reason: "rules match whole package paths, not prefixes",
			pkgs:   []Package{{ImportPath: m + "kvxfer/kvxfertest", Deps: []string{m + "kvxfer", m + "stream"}}},
			want:   []string{`kvxfer/kvxfertest: imports ` + m + `stream (rule "kvxfer/kvxfertest imports kvxfer and its backends")`},
		},
		{
			name:   "the core imports no backend, transport, cgo binding or x/sys; backends import the core",
			reason: "an engine that wants only the Scheduler links none of them (issue 15)",
			pkgs: []Package{
				{ImportPath: m + "kvxfer", Deps: []string{m + "hotpath", m + "kvxfer/backend/tcp", m + "internal/netxfer",
					m + "internal/nixl", "golang.org/x/sys/unix"}},
				{ImportPath: m + "kvxfer/backend/tcp", Deps: []string{m + "kvxfer", m + "internal/netxfer", m + "internal/peerauth", "golang.org/x/sys/unix"}},
				{ImportPath: m + "kvxfer/backend/nixl", Deps: []string{m + "kvxfer", m + "internal/nixl", m + "internal/netxfer"}},
			},
			want: []string{
				`kvxfer/backend/nixl: imports ` + m + `internal/netxfer (rule "kvxfer/backend/nixl imports kvxfer and NIXL's binding")`,
				`kvxfer: imports ` + m + `internal/netxfer (rule "kvxfer (the core) imports topology and hotpath only")`,
				`kvxfer: imports ` + m + `internal/nixl (rule "kvxfer (the core) imports topology and hotpath only")`,
				`kvxfer: imports ` + m + `kvxfer/backend/tcp (rule "kvxfer (the core) imports topology and hotpath only")`,
				`kvxfer: imports golang.org/x/sys/unix (rule "kvxfer (the core) imports topology and hotpath only")`,
			},
		},
		{
			name:   "internal/agentrpc may import kvxfer but not gRPC's stream",
			reason: "the test-agent RPC is net/rpc over kvxfer.Backend, nothing else",
			pkgs:   []Package{{ImportPath: m + "internal/agentrpc", Deps: []string{m + "kvxfer", m + "hotpath", m + "stream"}}},
			want:   []string{`internal/agentrpc: imports ` + m + `stream (rule "internal/agentrpc imports kvxfer")`},
		},
		{
			name:   "shm is a leaf: std and x/sys only",
			reason: "engines import it without kvxfer or gRPC",
			pkgs: []Package{
				{ImportPath: m + "shm", Deps: []string{"os", "golang.org/x/sys/unix", m + "kvxfer"}},
				{ImportPath: m + "internal/daemon/server", Imports: []string{m + "shm", m + "kvxfer"}},
				{ImportPath: m + "kvxfer/kvxfertest", Deps: []string{m + "shm", m + "kvxfer"}},
			},
			want: []string{`shm: imports ` + m + `kvxfer (rule "shm imports std and x/sys")`},
		},
		{
			name: "cgo only in nixl and cuda",
			pkgs: []Package{
				{ImportPath: m + "internal/nixl", Deps: []string{"C", "runtime/cgo"}, Cgo: true},
				{ImportPath: m + "hotpath", Cgo: true},
			},
			want: []string{`hotpath: uses cgo (only internal/nixl, internal/cuda and cmd/libkvxfer may)`},
		},
		{
			name: "nothing imports bench or cmd",
			pkgs: []Package{
				{ImportPath: m + "bench/descbench", Imports: []string{m + "bench/shapes"}},
				{ImportPath: m + "test", Imports: []string{m + "cmd/kvxferd"}},
			},
			want: []string{`test: imports ` + m + `cmd/kvxferd (nothing imports cmd/ or bench/)`},
		},
		{
			name:   "cmd/kvxferd may import anything but bench",
			reason: "the daemon wires every package together; only the global rules apply",
			pkgs: []Package{{ImportPath: m + "cmd/kvxferd",
				Imports: []string{m + "stream", m + "kvxfer", m + "internal/netxfer", "google.golang.org/grpc", m + "bench/shapes"},
				Deps:    []string{m + "stream", m + "kvxfer", m + "internal/netxfer", "google.golang.org/grpc", "golang.org/x/net/http2", m + "bench/shapes"}}},
			want: []string{`cmd/kvxferd: imports ` + m + `bench/shapes (nothing imports cmd/ or bench/)`},
		},
		{
			name:   "kvxferd links no simulator, test agent or other test code; the demo and tests may",
			reason: "issue 15: the production binary holds the daemon and the proxy only",
			pkgs: []Package{
				{ImportPath: m + "cmd/kvxferd", Deps: []string{m + "internal/daemon", m + "internal/daemon/server", m + "internal/simengine",
					m + "internal/kvsim", m + "internal/agentrpc", m + "internal/daemon/daemontest", m + "kvxfer/kvxfertest"}},
				{ImportPath: m + "cmd/kvxfer-demo", Deps: []string{m + "internal/daemon/daemontest", m + "internal/simengine", m + "internal/kvsim"}},
				{ImportPath: m + "test", Deps: []string{m + "internal/daemon/daemontest", m + "internal/simengine", m + "kvxfer/kvxfertest"}},
			},
			want: []string{
				`cmd/kvxferd: links internal/agentrpc (a production command links no test, demo or simulator code)`,
				`cmd/kvxferd: links internal/daemon/daemontest (a production command links no test, demo or simulator code)`,
				`cmd/kvxferd: links internal/kvsim (a production command links no test, demo or simulator code)`,
				`cmd/kvxferd: links internal/simengine (a production command links no test, demo or simulator code)`,
				`cmd/kvxferd: links kvxfer/kvxfertest (a production command links no test, demo or simulator code)`,
			},
		},
		{
			name: "packages outside the module are skipped",
			pkgs: []Package{{ImportPath: "example.com/x", Deps: []string{"google.golang.org/grpc"}}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Check(tc.pkgs); !slices.Equal(got, tc.want) {
				t.Fatalf("Check() =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestModuleDependencies runs the rules over the real module.
func TestModuleDependencies(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go command not found")
	}
	touchModuleFiles(t)
	cmd := exec.Command("go", "list", "-json=ImportPath,Deps,Imports,CgoFiles,Standard", Module+"/...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	var pkgs []Package
	for {
		var p struct {
			ImportPath string
			Deps       []string
			Imports    []string
			CgoFiles   []string
			Standard   bool
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, Package{ImportPath: p.ImportPath, Deps: p.Deps, Imports: p.Imports, Cgo: len(p.CgoFiles) > 0, Standard: p.Standard})
	}
	if len(pkgs) < 3 {
		t.Fatalf("go list found %d packages, want the module's packages", len(pkgs))
	}
	for _, v := range Check(pkgs) {
		t.Error(v)
	}
}

// TestProductionLinksNoTestCode checks the acceptance of issue 15 on the
// real build: `go list -deps ./cmd/kvxferd` names neither the simulator
// (internal/simengine, internal/kvsim) nor the test agent
// (internal/agentrpc), nor any other TestOnly package.
func TestProductionLinksNoTestCode(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go command not found")
	}
	touchModuleFiles(t)
	for _, cmdPath := range Production {
		out, err := exec.Command("go", "list", "-deps", Module+"/"+cmdPath).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", cmdPath, err)
		}
		deps := strings.Fields(string(out))
		if !slices.Contains(deps, Module+"/internal/daemon/server") {
			t.Fatalf("go list -deps %s lacks internal/daemon/server: not the daemon's dependencies?\n%s", cmdPath, out)
		}
		for _, d := range deps {
			if rel, ok := strings.CutPrefix(d, m); ok && under(rel, TestOnly) {
				t.Errorf("%s links %s", cmdPath, rel)
			}
		}
	}
	for _, must := range []string{"internal/simengine", "internal/kvsim", "internal/agentrpc"} {
		if !under(must, TestOnly) {
			t.Errorf("TestOnly lacks %s", must)
		}
	}
}

// touchModuleFiles opens every Go file of the module, so that the go
// command's test cache (which records the files a test opens) reruns this
// test whenever any package's imports may have changed.
func touchModuleFiles(t *testing.T) {
	t.Helper()
	root := filepath.Join("..", "..")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !d.IsDir() && (filepath.Ext(path) == ".go" || d.Name() == "go.mod") {
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			return f.Close()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
