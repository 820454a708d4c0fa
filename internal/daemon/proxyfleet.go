package daemon

import (
	"log/slog"
	"net"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/proxy"
)

// ProxyFleet is `kvxferd proxy -etcd`'s fleet: the engines registered in
// etcd (kvxferd -etcd), as the proxy's instances. It does not wait for
// etcd; until etcd answers the fleet is empty, and while etcd is
// unreachable it is what was seen last.
func ProxyFleet(ff proxy.FleetFlags, log *slog.Logger) (proxy.Fleet, func(), error) {
	cc := registry.ClientConfig{Endpoints: ff.Endpoints, CA: ff.CA, Cert: ff.Cert, Key: ff.Key, Insecure: ff.Insecure}
	cl, err := registry.Dial(cc)
	if err != nil {
		return nil, nil, err
	}
	m := registry.NewMetrics(nil)
	v, err := registry.NewView(registry.ViewConfig{Client: cl, Prefix: ff.Prefix, Logger: log, Metrics: m, Explain: cc.Explain})
	if err != nil {
		cl.Close()
		return nil, nil, err
	}
	log.Info("kvxferd proxy: fleet from etcd", "endpoints", ff.Endpoints, "prefix", ff.Prefix)
	return viewFleet{v, m}, func() { v.Close(); cl.Close() }, nil
}

// viewFleet is a registry.View as a proxy.Fleet.
type viewFleet struct {
	v *registry.View
	m *registry.Metrics
}

var _ proxy.FleetCollectors = viewFleet{}

// Collectors are the registry's metrics (proxy.FleetCollectors).
func (f viewFleet) Collectors() []prometheus.Collector { return f.m.Collectors() }

func (f viewFleet) Changed() <-chan struct{} { return f.v.Changed() }

// Instances are the engines every rank of which is served: one a rank
// of which is gone moves no KV (View.Routable).
func (f viewFleet) Instances() []proxy.Instance { return Instances(f.v.Routable()) }

// Instances are registry entries as a proxy's instances.
func Instances(entries []registry.Entry) []proxy.Instance {
	out := make([]proxy.Instance, 0, len(entries))
	for _, e := range entries {
		in := proxy.Instance{ID: e.EngineID, URL: e.URL, Group: e.CompatHash, Mode: proxy.Mode(e.Mode), Engine: e.EngineID, TP: e.TPSize,
			Prefill: e.Role != registry.RoleConsumer, Decode: e.Role != registry.RoleProducer}
		if host, port, err := splitHostPort(e.Peer()); err == nil {
			in.KVHost, in.KVPort = host, port
		}
		out = append(out, in)
	}
	return out
}

func splitHostPort(hp string) (string, int, error) {
	host, ps, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(ps)
	return host, port, err
}
