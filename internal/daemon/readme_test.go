package daemon

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/proxy"
)

// The README's promises about kvxferd's flags and metrics, checked
// against the binary's own (internal/proxy's readme_test.go checks the
// proxy's metrics).

// readme is the repository's README.md with its whitespace runs made one
// space (a phrase may break across lines there).
func readme(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(strings.Fields(string(b)), " ")
}

// flagToken is a flag as the README writes one: -name, not inside a word,
// a path or a longer flag.
var flagToken = regexp.MustCompile(`(?:^|[^A-Za-z0-9_./-])-([a-z][a-z0-9-]*[a-z0-9])`)

// notKvxferdFlags are the README's -words that are no kvxferd flag: go's
// (-race, -tags, -buildmode, -deps), test/soak's -duration, and the
// random suffix of vLLM's request ids (-xxxxxxxx).
var notKvxferdFlags = map[string]bool{"race": true, "tags": true, "buildmode": true, "deps": true, "duration": true, "xxxxxxxx": true}

// proxyFlags are kvxferd proxy's flag names, from its -h.
func proxyFlags(t *testing.T) map[string]bool {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = w
	err = proxy.MainWithFleet([]string{"-h"}, nil)
	os.Stderr = stderr
	w.Close()
	out, _ := io.ReadAll(r)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("kvxferd proxy -h: %v", err)
	}
	names := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(string(out), -1) {
		names[m[1]] = true
	}
	if len(names) < 5 {
		t.Fatalf("kvxferd proxy -h lists %d flags:\n%s", len(names), out)
	}
	return names
}

// Every flag of kvxferd serve and kvxferd proxy is named in the README,
// and every flag the README names is one of theirs.
func TestREADMENamesEveryFlag(t *testing.T) {
	doc := readme(t)
	named := map[string]bool{}
	for _, m := range flagToken.FindAllStringSubmatch(doc, -1) {
		named[m[1]] = true
	}
	have := proxyFlags(t)
	serve := flagSet(&config{})
	serve.VisitAll(func(f *flag.Flag) {
		if !named[f.Name] {
			t.Errorf("kvxferd serve -%s is not in the README", f.Name)
		}
		have[f.Name] = true
	})
	for name := range proxyFlags(t) {
		if !named[name] {
			t.Errorf("kvxferd proxy -%s is not in the README", name)
		}
	}
	for name := range named {
		if !have[name] && !notKvxferdFlags[name] {
			t.Errorf("the README names -%s, a flag neither kvxferd serve nor kvxferd proxy has", name)
		}
	}
}

// The defaults the README states are the flags' own.
func TestREADMEFlagDefaults(t *testing.T) {
	doc := readme(t)
	fs := flagSet(&config{})
	for _, tc := range []struct{ flag, def, phrase string }{
		{"drain-timeout", "30s", "`-drain-timeout` (30 s)"},
		{"nixl-poll-interval", "50µs", "`-nixl-poll-interval` (50 µs)"},
		{"nixl-progress-delay", "100µs", "`-nixl-progress-delay` (100 µs"},
		{"socket-mode", "0600", "`-socket-mode`, 0600 by default"},
		{"hello-timeout", "10s", "`-hello-timeout` (10 s"},
		{"max-streams", "4096", "`-max-streams` 4096"},
		{"max-streams-per-uid", "1024", "`-max-streams-per-uid` 1024"},
		{"max-engine-conns-per-uid", "1024", "`-max-engine-conns-per-uid` 1024"},
		{"max-engine-conns", "4096", "`-max-engine-conns` 4096"},
		{"max-calls-per-uid", "0", "`-max-calls-per-uid`, twice `-max-streams-per-uid`: 2048"},
		{"max-calls", "0", "`-max-calls`, twice `-max-streams`: 8192"},
		{"max-memory-entries", "0", "`-max-memory-entries`: a quarter of the open-file limit, at most 16,384"},
		{"max-peer-conns-per-addr", "64", "`-max-peer-conns-per-addr` 64"},
		{"max-peer-conns", "4096", "`-max-peer-conns` 4096"},
		{"max-peer-calls-per-conn", "128", "`-max-peer-calls-per-conn` 128"},
		{"max-peer-calls", "4096", "`-max-peer-calls` 4096"},
		{"max-requests", "65536", "`-max-requests` (65,536)"},
		{"peer-timeout", "5s", "`-peer-timeout` (5 s by default"},
		{"conns", "4", "`-conns` (4:"},
		{"lease", "30s", "`-lease` (30 s:"},
		{"log-level", "info", "`-log-level` (`info`"},
		{"etcd-ttl", "5s", "`-etcd-ttl` (5 s)"},
		{"etcd-max-engines", "10000", "`-etcd-max-engines` entries (10,000"},
		{"etcd-role", "both", "`-etcd-role`: producer, consumer or both"},
	} {
		f := fs.Lookup(tc.flag)
		switch {
		case f == nil:
			t.Errorf("-%s: no such flag", tc.flag)
		case f.DefValue != tc.def:
			t.Errorf("-%s defaults to %q, the README says %q (%s)", tc.flag, f.DefValue, tc.def, tc.phrase)
		case !strings.Contains(doc, tc.phrase):
			t.Errorf("the README no longer says %q", tc.phrase)
		}
	}
	// libkvxfer's defaults that differ from kvxferd's, as the README
	// lists them.
	if !strings.Contains(doc, "`peer-listen` `127.0.0.1:0`, no metrics endpoint, `drain-timeout` 5s") {
		t.Error("the README no longer lists libkvxfer's defaults")
	}
	want := map[string]string{"peer-listen": "127.0.0.1:0", "metrics-listen": "", "drain-timeout": "5s", "own-process-only": "true"}
	if !reflect.DeepEqual(inProcessDefaults, want) {
		t.Errorf("libkvxfer's defaults = %v, the README says %v", inProcessDefaults, want)
	}
}

// metricRef is a metric the README names, kvxfer_NAME{labels}, where
// labels are label names (side,kind) or one label="value".
var metricRef = regexp.MustCompile(`\bkvxfer_([a-z_]+)(?:\{([^}]*)\})?`)

// descs are the names of the metrics kvxferd exports, with their label
// names: the collector's and the registry's.
func descs(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	add := func(d *prometheus.Desc) {
		s := d.String()
		name := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(s)
		labels := regexp.MustCompile(`variableLabels: \{([^}]*)\}`).FindStringSubmatch(s)
		if name == nil || labels == nil {
			t.Fatalf("cannot read %s", s)
		}
		out[name[1]] = strings.Split(labels[1], ",")
	}
	c := reflect.ValueOf(newCollector(nil, nil)).Elem()
	for i := 0; i < c.NumField(); i++ {
		// The collector's fields are unexported: read by address.
		if f := c.Field(i); f.Type() == reflect.TypeFor[*prometheus.Desc]() {
			add((*prometheus.Desc)(unsafe.Pointer(f.Pointer())))
		}
	}
	ch := make(chan *prometheus.Desc, 64)
	for _, col := range registry.NewMetrics(nil).Collectors() {
		col.Describe(ch)
	}
	close(ch)
	for d := range ch {
		add(d)
	}
	return out
}

// goLiterals are the string literals of the module's Go code (tests
// left out): where label values come from.
func goLiterals(t *testing.T) map[string]bool {
	t.Helper()
	lit := regexp.MustCompile(`"([A-Za-z0-9_.]+)"`)
	out := map[string]bool{}
	err := filepath.WalkDir("../..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "python" || strings.HasPrefix(d.Name(), ".")) && path != "../.." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range lit.FindAllStringSubmatch(string(b), -1) {
			out[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Every kvxferd metric the README names is exported, with the label
// names it gives, and every label value it names is one the code emits
// (a literal of its own, or one the limits compose: X+"_per_uid",
// X+"_conns", X+"_conns_per_addr").
func TestREADMEMetricsExist(t *testing.T) {
	doc := readme(t)
	have := descs(t)
	lits := goLiterals(t)
	emitted := func(v string) bool {
		if lits[v] {
			return true
		}
		for _, suffix := range []string{"_per_uid", "_conns_per_addr", "_conns"} {
			if x, ok := strings.CutSuffix(v, suffix); ok && lits[x] {
				return true
			}
		}
		return false
	}
	// The C ABI's functions (kvxfer_start...) share the prefix.
	cabi := regexp.MustCompile(`\bkvxfer_[a-z_]+\(`)
	header, err := os.ReadFile("../../cmd/libkvxfer/kvxfer.h")
	if err != nil {
		t.Fatal(err)
	}
	funcs := map[string]bool{}
	for _, m := range cabi.FindAllString(string(header), -1) {
		funcs[strings.TrimSuffix(m, "(")] = true
	}
	seen := map[string]bool{}
	for _, m := range metricRef.FindAllStringSubmatch(doc, -1) {
		name := "kvxfer_" + m[1]
		if funcs[name] || strings.HasPrefix(name, "kvxfer_proxy_") || name == "kvxfer_registry_" || seen[m[0]] {
			continue
		}
		seen[m[0]] = true
		labels, ok := have[name]
		if !ok {
			t.Errorf("the README names %s, which kvxferd does not export", m[0])
			continue
		}
		if m[2] == "" {
			continue
		}
		for _, l := range strings.Split(m[2], ",") {
			key, value, isValue := strings.Cut(l, "=")
			if !contains(labels, key) {
				t.Errorf("the README names %s: %s has no label %q (its labels: %v)", m[0], name, key, labels)
			}
			if isValue && !emitted(strings.Trim(value, `"`)) {
				t.Errorf("the README names %s: no code emits %s", m[0], value)
			}
		}
	}
	if len(seen) < 20 {
		names := make([]string, 0, len(seen))
		for n := range seen {
			names = append(names, n)
		}
		sort.Strings(names)
		t.Errorf("found only %d metrics in the README: %v", len(seen), names)
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}
