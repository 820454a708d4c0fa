package proxy

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Every proxy metric the README names (kvxfer_proxy_...) is one the proxy
// exports, with the label names the README gives (internal/daemon's
// readme_test.go checks kvxferd's).
func TestREADMEProxyMetricsExist(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m, reg := newMetrics(), prometheus.NewRegistry()
	fm := newFleetMetrics(reg)
	ch := make(chan *prometheus.Desc, 64)
	for _, c := range []prometheus.Collector{m.requests, m.inflight, m.up, m.upstreamErrs, m.prefillTime, m.decodeTTFB, m.total,
		fm.upstreams, fm.changes, fm.refused} {
		c.Describe(ch)
	}
	close(ch)
	have := map[string]string{}
	for d := range ch {
		s := d.String()
		name := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(s)
		labels := regexp.MustCompile(`variableLabels: \{([^}]*)\}`).FindStringSubmatch(s)
		if name == nil || labels == nil {
			t.Fatalf("cannot read %s", s)
		}
		have[name[1]] = "," + labels[1] + ","
	}
	n := 0
	for _, ref := range regexp.MustCompile(`\b(kvxfer_proxy_[a-z_]+)(?:\{([^}]*)\})?`).FindAllStringSubmatch(string(b), -1) {
		n++
		labels, ok := have[ref[1]]
		if !ok {
			t.Errorf("the README names %s, which the proxy does not export", ref[0])
			continue
		}
		for _, l := range strings.Split(ref[2], ",") {
			if l != "" && !strings.Contains(labels, ","+l+",") {
				t.Errorf("the README names %s: %s has no label %q (its labels: %s)", ref[0], ref[1], l, labels)
			}
		}
	}
	if n < 4 {
		t.Errorf("found %d proxy metrics in the README, want at least 4", n)
	}
}
