package nixl

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// wheel lays out a nixl-cu12 wheel of version v under a site-packages
// directory and returns its libnixl_capi.so.
func wheel(t *testing.T, site, dist, v string) string {
	t.Helper()
	libs := filepath.Join(site, "."+dist+".mesonpy.libs")
	for _, d := range []string{filepath.Join(libs, "plugins"), filepath.Join(site, dist+"-"+v+".dist-info")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	lib := filepath.Join(libs, "libnixl_capi.so")
	if err := os.WriteFile(lib, []byte("not really"), 0o644); err != nil {
		t.Fatal(err)
	}
	return lib
}

func TestLibraryVersion(t *testing.T) {
	site := t.TempDir()
	if got := LibraryVersion(wheel(t, site, "nixl_cu12", "1.5.1")); got != "1.5.1" {
		t.Errorf("wheel: version %q, want 1.5.1", got)
	}
	pre := t.TempDir()
	for _, d := range []string{"lib/pkgconfig"} {
		if err := os.MkdirAll(filepath.Join(pre, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(pre, "lib/pkgconfig/nixl.pc"), []byte("Name: nixl\nVersion: 0.9.0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := LibraryVersion(filepath.Join(pre, "lib", "libnixl_capi.so")); got != "0.9.0" {
		t.Errorf("prefix: version %q, want 0.9.0", got)
	}
	if got := LibraryVersion(filepath.Join(t.TempDir(), "libnixl_capi.so")); got != "" {
		t.Errorf("bare file: version %q, want none", got)
	}
}

// Versions whose C API is declared open; others, and one that cannot be
// told, are refused with an error naming the library, its version, the
// declared ones and the override, unless it is set.
func TestCheckVersion(t *testing.T) {
	for _, v := range []string{"1.5", "1.5.0", "1.5.1", "1.5.12"} {
		if err := checkVersion("/x/libnixl_capi.so", v, false); err != nil {
			t.Errorf("version %q refused: %v", v, err)
		}
	}
	for _, v := range []string{"1.6.0", "0.9.0", "1.50.0", "2.5.1", ""} {
		err := checkVersion("/x/libnixl_capi.so", v, false)
		if !errors.Is(err, ErrVersion) || !strings.Contains(err.Error(), "/x/libnixl_capi.so") ||
			!strings.Contains(err.Error(), "1.5") || !strings.Contains(err.Error(), "-nixl-any-version") ||
			(v != "" && !strings.Contains(err.Error(), "NIXL "+v)) {
			t.Errorf("version %q: %v, want ErrVersion naming the library, the versions and the override", v, err)
		}
		if err := checkVersion("/x/libnixl_capi.so", v, true); err != nil {
			t.Errorf("version %q with the override: %v", v, err)
		}
	}
}

// The library is found in the active virtual environment, never in a
// user's home; NIXL_CAPI_LIB wins and must exist.
func TestFindLibrary(t *testing.T) {
	home, venv := t.TempDir(), t.TempDir()
	wheel(t, filepath.Join(home, ".local/lib/python3.11/site-packages"), "nixl_cu12", "1.5.1")
	t.Setenv("HOME", home)
	t.Setenv("NIXL_CAPI_LIB", "")
	t.Setenv("NIXL_PREFIX", "")
	t.Setenv("VIRTUAL_ENV", venv)
	if p, err := FindLibrary(); err == nil && strings.HasPrefix(p, home) {
		t.Errorf("found %s in the user's home", p)
	}
	lib := wheel(t, filepath.Join(venv, "lib/python3.11/site-packages"), "nixl_cu12", "1.5.1")
	if p, err := FindLibrary(); err != nil || p != lib {
		t.Errorf("FindLibrary() = %q, %v; want the virtual environment's %s", p, err, lib)
	}
	t.Setenv("NIXL_CAPI_LIB", filepath.Join(venv, "missing.so"))
	if _, err := FindLibrary(); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "NIXL_CAPI_LIB") {
		t.Errorf("a missing NIXL_CAPI_LIB: %v", err)
	}
}

// ProcessEnv names what is unset, and nothing that is set.
func TestProcessEnv(t *testing.T) {
	lib := wheel(t, t.TempDir(), "nixl_cu12", "1.5.1")
	t.Setenv("NIXL_PLUGIN_DIR", "")
	t.Setenv("UCX_MEMTYPE_CACHE", "")
	got := ProcessEnv(lib)
	want := []string{"NIXL_PLUGIN_DIR=" + filepath.Join(filepath.Dir(lib), "plugins"), "UCX_MEMTYPE_CACHE=n"}
	if !slices.Equal(got, want) {
		t.Errorf("ProcessEnv = %q, want %q", got, want)
	}
	t.Setenv("NIXL_PLUGIN_DIR", "/elsewhere")
	t.Setenv("UCX_MEMTYPE_CACHE", "y")
	if got := ProcessEnv(lib); len(got) != 0 {
		t.Errorf("ProcessEnv with both set = %q, want nothing", got)
	}
}
