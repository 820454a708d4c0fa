package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/envflag"
)

// The fleet registry (kvxferd -etcd, off by default): the daemon
// publishes the engines it serves in etcd under a lease, and watches the
// other engines' entries, so that its consumers resolve producers by id
// and learn at once when one's lease ends or it registers again. See
// README's "Fleets on etcd" for the failure model.

// etcdConfig is the registry's part of the daemon's configuration.
type etcdConfig struct {
	client     registry.ClientConfig
	prefix     string
	ttl        time.Duration
	role, url  string
	maxEngines int
	// given are the -etcd-* flags given a value (noteGiven).
	given []string
}

func etcdFlags(fs *flag.FlagSet, c *etcdConfig) {
	fs.StringVar(&c.client.Endpoints, "etcd", "", "etcd endpoints, comma-separated (host:port, http:// or https://): publish the engines served here "+
		"in a fleet registry under a lease, and resolve and watch peer engines through it (unset: no registry)")
	fs.StringVar(&c.client.CA, "etcd-ca", "", "CA (PEM) of etcd's certificate: TLS to etcd")
	fs.StringVar(&c.client.Cert, "etcd-cert", "", "client certificate (PEM) for etcd, with -etcd-key")
	fs.StringVar(&c.client.Key, "etcd-key", "", "the key of -etcd-cert (PEM)")
	fs.BoolVar(&c.client.Insecure, "etcd-insecure", false, "allow plain-text -etcd endpoints off loopback (anyone on the path may read and forge the registry; "+
		"peer authentication still decides who moves KV)")
	fs.StringVar(&c.prefix, "etcd-prefix", registry.DefaultPrefix, "key prefix of the registry in etcd")
	fs.DurationVar(&c.ttl, "etcd-ttl", registry.DefaultTTL, "lease of this daemon's entries: an engine whose daemon dies leaves the fleet within it")
	fs.StringVar(&c.role, "etcd-role", registry.RoleBoth, "role published for the engines served here: producer, consumer or both (routers pair producers with consumers)")
	fs.StringVar(&c.url, "etcd-url", "", "serving URL (the engine's OpenAI server) published for the engines served here, for routers")
	fs.IntVar(&c.maxEngines, "etcd-max-engines", registry.DefaultMaxEntries, "registry entries this daemon's view holds at most")
}

func (c *etcdConfig) validate() error {
	if c.client.Endpoints == "" {
		return nil
	}
	if err := c.client.Validate(); err != nil {
		return err
	}
	if c.ttl < 2*time.Second || c.ttl%time.Second != 0 {
		return fmt.Errorf("-etcd-ttl = %v, want whole seconds, at least 2s", c.ttl)
	}
	if c.role != registry.RoleProducer && c.role != registry.RoleConsumer && c.role != registry.RoleBoth {
		return fmt.Errorf("-etcd-role = %q, want producer, consumer or both", c.role)
	}
	if c.url != "" && registry.CheckURL(c.url) != nil {
		return fmt.Errorf("-etcd-url = %q, want %s (what a registry entry holds)", c.url, registry.URLWant)
	}
	if c.maxEngines <= 0 {
		return fmt.Errorf("-etcd-max-engines = %d, want > 0", c.maxEngines)
	}
	return nil
}

// ignored names the registry's flags given (on the command line or in
// the environment, whatever their value: one given its default counts)
// while -etcd is not set: no registry starts without it, and they do
// nothing (an -etcd left out of a deployment, or misspelt, would
// otherwise go unnoticed until an engine is not found by id).
func (c *etcdConfig) ignored() []string {
	if c.client.Endpoints != "" {
		return nil
	}
	return c.given
}

// noteGiven records which of the registry's flags fs was given, once
// parsed (ignored).
func (c *etcdConfig) noteGiven(fs *flag.FlagSet) {
	c.given = envflag.Given(fs, func(name string) bool { return strings.HasPrefix(name, "etcd-") })
}

// checkAdvertise checks -peer-advertise, the address published for the
// engines served here (the listener's when not advertised: an IP and a
// port), against what a registry entry holds: one the entries refuse
// would keep every engine of the daemon out of the registry.
func (c *etcdConfig) checkAdvertise(advertise string) error {
	if c.client.Endpoints == "" || advertise == "" || registry.CheckPeer(advertise) == nil {
		return nil
	}
	return fmt.Errorf("-peer-advertise = %q with -etcd: want %s, what a registry entry holds", advertise, registry.PeerWant)
}

// fleet is a started registry.
type fleet struct {
	c         *etcdConfig
	log       *slog.Logger
	advertise string
	cl        *clientv3.Client
	view      *registry.View
	reg       *registry.Registrar
	metrics   *registry.Metrics
	srv       atomic.Pointer[server.Server]
	wake      chan struct{} // 1-slot: the served engines changed
	done      chan struct{}
	stopped   chan struct{}
}

// startFleet connects to etcd (without waiting for it) and starts the
// view and the registrar; attach hands it the server once there is one.
func startFleet(c *etcdConfig, advertise string, log *slog.Logger) (*fleet, error) {
	if _, _, err := net.SplitHostPort(advertise); err != nil {
		return nil, fmt.Errorf("-etcd: peer address %q: %w", advertise, err)
	}
	cl, err := registry.Dial(c.client)
	if err != nil {
		return nil, err
	}
	f := &fleet{c: c, log: log, advertise: advertise, cl: cl, metrics: registry.NewMetrics(nil),
		wake: make(chan struct{}, 1), done: make(chan struct{}), stopped: make(chan struct{})}
	f.view, err = registry.NewView(registry.ViewConfig{Client: cl, Prefix: c.prefix, MaxEntries: c.maxEngines, Logger: log,
		Metrics: f.metrics, OnChange: f.changed, Explain: c.client.Explain})
	if err != nil {
		cl.Close()
		return nil, err
	}
	f.reg, err = registry.NewRegistrar(registry.RegistrarConfig{Client: cl, Prefix: c.prefix, TTL: c.ttl, Logger: log, Metrics: f.metrics, Explain: c.client.Explain})
	if err != nil {
		f.view.Close()
		cl.Close()
		return nil, err
	}
	go f.publish()
	log.Info("kvxferd: fleet registry on etcd", "endpoints", c.client.Endpoints, "prefix", c.prefix, "ttl", c.ttl, "tls", c.client.CA != "" || c.client.Cert != "")
	return f, nil
}

// changed hands a peer engine's change to the server's ranks (the
// view's goroutine; it does not block).
func (f *fleet) changed(ch registry.Change) {
	srv := f.srv.Load()
	if srv == nil {
		return
	}
	switch ch.Kind {
	case registry.Leave:
		srv.PeerGone(ch.Engine, fmt.Sprintf("its registry entry is gone (lease of %s ended or it left)", ch.Entry.Peer()))
	case registry.RankGone:
		// One of the engine's per-rank servers is gone (the in-process
		// placement): what waits on the engine cannot complete without
		// that rank, and a probe could not tell (the handshake asks every
		// rank's server, and one that does not answer is no verdict with
		// probes off).
		srv.PeerGone(ch.Engine, fmt.Sprintf("its registry entry for %s at %s is gone (that server's lease ended or it left), and no other entry serves it",
			rankNames(ch.Entry.Ranks), ch.Entry.Peer()))
	case registry.Generation:
		srv.PeerGeneration(ch.Engine, ch.Entry.Generation)
	}
}

// rankNames names ranks for a log line or a failure's reason: "rank tp 1
// pp 0", or "ranks tp 0 pp 0, tp 1 pp 0" (at most 4, then how many more).
func rankNames(rs []registry.Rank) string {
	var b strings.Builder
	b.WriteString("rank")
	if len(rs) != 1 {
		b.WriteString("s")
	}
	for i, r := range rs {
		if i == 4 {
			fmt.Fprintf(&b, " and %d more", len(rs)-i)
			break
		}
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, " tp %d pp %d", r.TP, r.PP)
	}
	return b.String()
}

// lookup is the server's PeerLookup: an engine's address from the view,
// or from etcd itself when the view has none yet (it has just joined),
// within ctx (the handshake's) and lookupTimeout.
func (f *fleet) lookup(ctx context.Context, engine string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	e, ok, err := f.view.LookupNow(ctx, engine)
	switch {
	case err != nil:
		return "", fmt.Errorf("engine %q: not in this daemon's view of the fleet registry (-etcd), and etcd could not be asked: %w", engine, err)
	case !ok:
		return "", fmt.Errorf("engine %q: not in the fleet registry (-etcd), and the transfer params name no address", engine)
	}
	return e.Peer(), nil
}

// lookupTimeout bounds a lookup's read from etcd (within the handshake's
// own timeout, 5 s by default).
var lookupTimeout = 2 * time.Second // (a test's own: fleet_test)

// enginesChanged is the server's OnEnginesChanged.
func (f *fleet) enginesChanged() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// publish keeps the registrar's entries those of the served engines.
// An engine whose entry does not validate (an id no key may hold, a
// compatibility hash too long) is left out, logged and counted once per
// generation; the others are published all the same.
func (f *fleet) publish() {
	defer close(f.stopped)
	refused := map[string]uint64{} // engine id -> the generation refused
	for {
		select {
		case <-f.done:
			return
		case <-f.wake:
		}
		srv := f.srv.Load()
		if srv == nil {
			continue
		}
		var entries []registry.Entry
		served := map[string]bool{}
		for _, pe := range srv.Published() {
			served[pe.EngineID] = true
			e := registry.Entry{EngineID: pe.EngineID, Role: f.c.role, Mode: pe.Mode, CompatHash: pe.CompatHash,
				TPSize: pe.TPSize, PPSize: pe.PPSize, Generation: pe.Generation, URL: f.c.url}
			for _, r := range pe.Ranks {
				e.Ranks = append(e.Ranks, registry.Rank{TP: r[0], PP: r[1], Peer: f.advertise})
			}
			if _, err := e.Encode(registry.Key(f.c.prefix, e.EngineID, e.Peer())); err != nil {
				if g, ok := refused[e.EngineID]; !ok || g != e.Generation {
					refused[e.EngineID] = e.Generation
					f.metrics.BadEntry(err)
					f.log.Error("kvxferd: registry: an engine's entry is invalid; it is not published (peers find it by its address only), the others are",
						"engine", e.EngineID, "err", err)
				}
				continue
			}
			entries = append(entries, e)
		}
		for id := range refused {
			if !served[id] {
				delete(refused, id)
			}
		}
		if err := f.reg.Set(entries); err != nil {
			var be *registry.BadEntryError
			if errors.As(err, &be) {
				f.metrics.BadEntry(be)
			}
			f.log.Error("kvxferd: registry: an engine's entry is invalid; not published", "err", err)
		}
	}
}

// attach starts publishing srv's engines and telling its ranks about
// peers.
func (f *fleet) attach(srv *server.Server) {
	f.srv.Store(srv)
	f.enginesChanged()
}

// close deletes this daemon's entries (revoking the lease) and stops.
func (f *fleet) close() {
	close(f.done)
	<-f.stopped
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := f.reg.Close(ctx); err != nil {
		f.log.Warn("kvxferd: registry", "err", err)
	}
	f.view.Close()
	_ = f.cl.Close()
}
