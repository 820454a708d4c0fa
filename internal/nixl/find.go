package nixl

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// SupportedVersions are the NIXL releases (major.minor) whose C API this
// package declares (shim.go's own declarations, checked against them; the
// C API's signatures changed between releases, and calling a library
// whose functions take other arguments is undefined behaviour, not an
// error). OpenConfig refuses other versions unless Config.AnyVersion.
var SupportedVersions = []string{"1.5"}

// ErrVersion: the library's version is not one whose C API this package
// declares, or cannot be told.
var ErrVersion = errors.New("nixl: unsupported library version")

// FindLibrary locates libnixl_capi.so: NIXL_CAPI_LIB (a file), then
// NIXL_PREFIX (lib/, lib64/ or lib/x86_64-linux-gnu/ under it), then the
// nixl-cu12 / nixl-cu13 / nixl Python wheels in the active virtual
// environment ($VIRTUAL_ENV) and the system's site- and dist-packages. No
// user's home is searched: a wheel installed elsewhere is named with
// NIXL_CAPI_LIB.
func FindLibrary() (string, error) {
	const lib = "libnixl_capi.so"
	var tried []string
	try := func(p string) bool {
		tried = append(tried, p)
		st, err := os.Stat(p)
		return err == nil && !st.IsDir()
	}
	if p := os.Getenv("NIXL_CAPI_LIB"); p != "" {
		if try(p) {
			return p, nil
		}
		return "", fmt.Errorf("%w: NIXL_CAPI_LIB=%s: no such file", ErrUnavailable, p)
	}
	if pre := os.Getenv("NIXL_PREFIX"); pre != "" {
		for _, d := range []string{"lib", "lib64", "lib/x86_64-linux-gnu"} {
			if p := filepath.Join(pre, d, lib); try(p) {
				return p, nil
			}
		}
	}
	var pats []string
	if v := os.Getenv("VIRTUAL_ENV"); v != "" {
		pats = append(pats, filepath.Join(v, "lib/python3*/site-packages"))
	}
	pats = append(pats, "/usr/local/lib/python3*/site-packages", "/usr/local/lib/python3*/dist-packages",
		"/usr/lib/python3*/site-packages", "/usr/lib/python3/dist-packages")
	for _, pat := range pats {
		dirs, _ := filepath.Glob(pat)
		for _, d := range dirs {
			for _, sub := range []string{".nixl_cu12.mesonpy.libs", ".nixl_cu13.mesonpy.libs", ".nixl.mesonpy.libs"} {
				if p := filepath.Join(d, sub, lib); try(p) {
					return p, nil
				}
			}
		}
	}
	return "", fmt.Errorf("%w: %s not found (set NIXL_CAPI_LIB or NIXL_PREFIX, or pip install nixl-cu12 into $VIRTUAL_ENV); tried %d places",
		ErrUnavailable, lib, len(tried))
}

// LibraryVersion tells the release of the NIXL library at path, from
// what was installed with it: a Python wheel's dist-info directory beside
// its bundled libraries (site-packages/.nixl_cu12.mesonpy.libs/ and
// site-packages/nixl_cu12-1.5.1.dist-info/), or NIXL's pkg-config file
// (lib/pkgconfig/nixl.pc). It returns "" when neither is there.
func LibraryVersion(path string) string {
	dir := filepath.Dir(path)
	if name, ok := strings.CutSuffix(filepath.Base(dir), ".mesonpy.libs"); ok {
		dist := strings.TrimPrefix(name, ".")
		m, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), dist+"-*.dist-info"))
		if len(m) == 1 {
			v := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(m[0]), dist+"-"), ".dist-info")
			if v != "" {
				return v
			}
		}
	}
	for _, pc := range []string{filepath.Join(dir, "pkgconfig", "nixl.pc"), filepath.Join(dir, "..", "lib", "pkgconfig", "nixl.pc")} {
		f, err := os.Open(pc)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "Version:"); ok {
				f.Close()
				return strings.TrimSpace(v)
			}
		}
		f.Close()
	}
	return ""
}

// checkVersion refuses a library version whose major.minor is not in
// SupportedVersions, and one that cannot be told, unless any is set.
func checkVersion(path, version string, any bool) error {
	if any {
		return nil
	}
	if version == "" {
		return fmt.Errorf("%w: cannot tell the version of %s (no Python wheel metadata or pkg-config file beside it); "+
			"this build declares NIXL's C API of %s: install one of those, or open it anyway (kvxferd -nixl-any-version)",
			ErrVersion, path, strings.Join(SupportedVersions, ", "))
	}
	for _, s := range SupportedVersions {
		if version == s || strings.HasPrefix(version, s+".") {
			return nil
		}
	}
	return fmt.Errorf("%w: %s is NIXL %s; this build declares NIXL's C API of %s (pip install 'nixl-cu12==1.5.*'), "+
		"or open it anyway (kvxferd -nixl-any-version: undefined behaviour where the C API changed)",
		ErrVersion, path, version, strings.Join(SupportedVersions, ", "))
}

// ProcessEnv returns the environment a process should have before it
// loads the NIXL library at path, as KEY=VALUE for the variables not set
// already: NIXL_PLUGIN_DIR (the plugins a wheel bundles beside the
// library; NIXL reads it when it loads) and UCX_MEMTYPE_CACHE=n (UCX's
// memory-type cache learns GPU memory from the allocation calls it
// intercepts, and takes memory imported from a CUDA IPC handle, an
// engine's KV cache, for host memory; verified on an H100). This package
// never changes the environment itself: kvxferd applies these at start,
// and another process sets them before its first Open.
func ProcessEnv(path string) []string {
	var out []string
	if os.Getenv("NIXL_PLUGIN_DIR") == "" {
		if st, err := os.Stat(filepath.Join(filepath.Dir(path), "plugins")); err == nil && st.IsDir() {
			out = append(out, "NIXL_PLUGIN_DIR="+filepath.Join(filepath.Dir(path), "plugins"))
		}
	}
	if os.Getenv("UCX_MEMTYPE_CACHE") == "" {
		out = append(out, "UCX_MEMTYPE_CACHE=n")
	}
	return out
}
