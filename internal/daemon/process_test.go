package daemon_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
)

// TestMain lets daemontest.Start run this test binary as a kvxferd.
func TestMain(m *testing.M) {
	daemontest.ServeIfChild()
	os.Exit(m.Run())
}

// kvxferd -backend=nixl refuses a NIXL library of a release whose C API
// this build does not declare, naming the version and the override, and
// opens it with -nixl-any-version. The library is the real one, seen
// through a wheel layout that says 1.4.0; the daemon sets NIXL's
// environment itself (NIXL_PLUGIN_DIR is unset here).
func TestNixlVersionChecked(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	real, err := capi.FindLibrary()
	if err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	site := t.TempDir()
	libs := filepath.Dir(real)
	if err := os.Symlink(libs, filepath.Join(site, ".nixl_cu12.mesonpy.libs")); err != nil {
		t.Fatal(err)
	}
	if sib := filepath.Join(filepath.Dir(libs), "nixl_cu12.libs"); dirExists(sib) {
		if err := os.Symlink(sib, filepath.Join(site, "nixl_cu12.libs")); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(site, "nixl_cu12-1.4.0.dist-info"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("NIXL_CAPI_LIB", filepath.Join(site, ".nixl_cu12.mesonpy.libs", "libnixl_capi.so"))
	t.Setenv("NIXL_PLUGIN_DIR", "")
	t.Setenv("UCX_MEMTYPE_CACHE", "")

	dir := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, self, "serve", "-socket", filepath.Join(dir, "k.sock"), "-peer-listen", "127.0.0.1:0",
		"-metrics-listen", "", "-shm-dir", dir, "-insecure-peers", "-backend", "nixl").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "NIXL 1.4.0") || !strings.Contains(string(out), "-nixl-any-version") ||
		!strings.Contains(string(out), "1.5") {
		t.Fatalf("kvxferd with NIXL 1.4.0: %v\n%s\nwant a refusal naming 1.4.0, the declared 1.5 and -nixl-any-version", err, out)
	}
	d, err := daemontest.Start(dir, "any", "nixl", "-nixl-any-version", "-log-level", "info")
	if err != nil {
		b, _ := os.ReadFile(filepath.Join(dir, "any.log"))
		t.Fatalf("kvxferd -nixl-any-version: %v\n%s", err, b)
	}
	defer d.Stop()
	b, _ := os.ReadFile(d.Log)
	if !strings.Contains(string(b), "NIXL_PLUGIN_DIR=") || !strings.Contains(string(b), "version=1.4.0") {
		t.Errorf("the daemon's log does not show the NIXL environment it set and the version:\n%s", b)
	}
}

func dirExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// In a daemon: the runtime's own setting by default, automaxprocs under
// GODEBUG=containermaxprocs=0.
func TestDaemonMaxProcs(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	for _, tc := range []struct{ godebug, want string }{
		{"", `set_by="go runtime (container-aware)"`},
		{"containermaxprocs=0", `set_by="automaxprocs (containermaxprocs=0)"`},
	} {
		t.Setenv("GODEBUG", tc.godebug)
		dir := t.TempDir()
		d, err := daemontest.Start(dir, "m", "builtin", "-log-level", "info")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(d.Log)
		_ = d.Stop()
		if !strings.Contains(string(b), tc.want) {
			t.Errorf("GODEBUG=%q: the log lacks %s:\n%s", tc.godebug, tc.want, b)
		}
	}
}
