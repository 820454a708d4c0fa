package registry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// ClientConfig says how to reach etcd.
type ClientConfig struct {
	// Endpoints are etcd's client URLs, comma-separated: host:port,
	// http://host:port or https://host:port.
	Endpoints string
	// CA verifies etcd's certificate; Cert and Key are this process's
	// client certificate (PEM files). Any of them turns TLS on.
	CA, Cert, Key string
	// Insecure allows plain-text endpoints that are not on loopback.
	Insecure bool
}

// Validate checks c, naming the flag of a bad value (-etcd, -etcd-ca,
// -etcd-cert, -etcd-key).
func (c *ClientConfig) Validate() error {
	eps, err := c.endpoints()
	if err != nil {
		return err
	}
	if (c.Cert == "") != (c.Key == "") {
		return errors.New("-etcd-cert and -etcd-key: a client certificate needs both")
	}
	// An http:// endpoint is plain text even with -etcd-ca: etcd's client
	// drops the TLS credentials for it. So each endpoint's scheme, not
	// the flags, says whether it is encrypted.
	for _, ep := range eps {
		u, _ := url.Parse(ep)
		if u.Scheme == "https" {
			continue
		}
		if ip := net.ParseIP(u.Hostname()); (ip == nil || !ip.IsLoopback()) && u.Hostname() != "localhost" && !c.Insecure {
			if c.tls() {
				return fmt.Errorf("-etcd endpoint %q: http:// is plain text, -etcd-ca or not, to a host that is not on loopback; "+
					"write https:// (or host:port), or give -etcd-insecure to accept that anyone on the path may read and forge the registry", ep)
			}
			return fmt.Errorf("-etcd endpoint %q: plain text to a host that is not on loopback; give -etcd-ca (and -etcd-cert, -etcd-key) "+
				"for TLS, or -etcd-insecure to accept that anyone on the path may read and forge the registry", ep)
		}
	}
	// etcd's client takes one transport for all its endpoints, that of
	// the first one's scheme: after an http:// endpoint an https:// one
	// would be spoken to in plain text, its certificate never checked.
	for _, ep := range eps[1:] {
		if scheme(ep) != scheme(eps[0]) {
			return fmt.Errorf("-etcd endpoints %q and %q: http:// and https:// mixed; etcd's client speaks the first one's to all of them "+
				"(plain text to an https:// endpoint, or TLS to an http:// one): give every endpoint one scheme", eps[0], ep)
		}
	}
	return nil
}

func scheme(ep string) string { s, _, _ := strings.Cut(ep, "://"); return s }

func (c *ClientConfig) tls() bool { return c.CA != "" || c.Cert != "" }

// endpoints parses Endpoints into URLs.
func (c *ClientConfig) endpoints() ([]string, error) {
	var out []string
	for _, ep := range strings.Split(c.Endpoints, ",") {
		if ep = strings.TrimSpace(ep); ep == "" {
			continue
		}
		raw := ep
		if !strings.Contains(ep, "://") {
			scheme := "http://"
			if c.tls() {
				scheme = "https://"
			}
			ep = scheme + ep
		}
		if _, rest, _ := strings.Cut(ep, "://"); strings.Contains(rest, "@") {
			// Before, user:password@ was dropped without a word (etcd's
			// client takes no credentials from its endpoints, and kvxfer
			// uses no etcd password), and the endpoint, password included,
			// was logged as given at start. The error quotes none of it.
			return nil, fmt.Errorf("-etcd endpoint %q: user info (user:password@) is not used: kvxfer authenticates to etcd with "+
				"a client certificate (-etcd-cert, -etcd-key); remove it, and keep passwords off the command line", "...@"+rest[strings.LastIndex(rest, "@")+1:])
		}
		u, err := url.Parse(ep)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Port() == "" || u.Hostname() == "" || (u.Path != "" && u.Path != "/") {
			return nil, fmt.Errorf("-etcd endpoint %q: want host:port, http://host:port or https://host:port", raw)
		}
		if u.Scheme == "https" && !c.tls() {
			return nil, fmt.Errorf("-etcd endpoint %q: https needs -etcd-ca", raw)
		}
		out = append(out, u.Scheme+"://"+u.Host)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-etcd = %q: no endpoint", c.Endpoints)
	}
	return out, nil
}

// Dial returns a client of etcd. It does not wait for etcd: calls fail
// (and are retried by their callers) until it answers.
func Dial(c ClientConfig) (*clientv3.Client, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	eps, _ := c.endpoints()
	cfg := clientv3.Config{Endpoints: eps, DialKeepAliveTime: 2 * time.Second, DialKeepAliveTimeout: 2 * time.Second,
		Logger: zap.NewNop(), RejectOldCluster: false}
	tc, err := c.TLSConfig()
	if err != nil {
		return nil, err
	}
	cfg.TLS = tc
	cl, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("-etcd: %w", err)
	}
	return cl, nil
}

// explainEvery bounds how often a Registrar or a View explains its
// failures (each explanation dials every endpoint).
const explainEvery = 10 * time.Second

// Explain says why etcd's client cannot connect, which its errors do not:
// a call that finds no connection waits for one until its time runs out,
// and says only that ("context deadline exceeded"), whether etcd is down,
// its certificate is of another CA (-etcd-ca), it refused the client's
// certificate, or it speaks TLS to a plain-text client or plain text to a
// TLS one. Explain dials each endpoint as the client would, within ctx and
// a second each, and returns each one's failure; nil when one of them
// takes the connection (the cause is elsewhere).
func (c ClientConfig) Explain(ctx context.Context) error {
	eps, err := c.endpoints()
	if err != nil {
		return err
	}
	tc, err := c.TLSConfig()
	if err != nil {
		return err
	}
	var errs []error
	for _, ep := range eps {
		err := c.explainOne(ctx, ep, tc)
		if err == nil {
			return nil
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (c ClientConfig) explainOne(ctx context.Context, ep string, tc *tls.Config) error {
	u, _ := url.Parse(ep)
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", u.Host)
	if err != nil {
		return fmt.Errorf("etcd endpoint %s: %w", ep, err)
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	_ = conn.SetDeadline(deadline)
	if u.Scheme == "http" {
		// A server that completes a TLS handshake is etcd with TLS on.
		tlsConn := tls.Client(conn, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}) //nolint:gosec // only asks whether it speaks TLS
		if tlsConn.HandshakeContext(ctx) == nil {
			return fmt.Errorf("etcd endpoint %s speaks TLS, and this client plain text: write https:// and give -etcd-ca (etcd's CA)", ep)
		}
		return nil
	}
	cfg := tc.Clone()
	cfg.ServerName = u.Hostname()
	tlsConn := tls.Client(conn, cfg)
	if err := tlsConn.HandshakeContext(ctx); err != nil {
		// A plain-text server answers a ClientHello with bytes that are
		// no TLS record, or hangs up (etcd's does).
		var rh tls.RecordHeaderError
		if errors.As(err, &rh) || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return fmt.Errorf("etcd endpoint %s: TLS handshake: %w (it speaks plain text? write http://, or turn TLS on in etcd)", ep, err)
		}
		return fmt.Errorf("etcd endpoint %s: TLS handshake: %w (-etcd-ca, -etcd-cert, -etcd-key)", ep, err)
	}
	// A server that refuses the client's certificate says so after the
	// handshake (TLS 1.3): a short read brings its alert; one that takes
	// the client waits for a request.
	_ = conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := tlsConn.Read(make([]byte, 1)); err != nil {
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			return fmt.Errorf("etcd endpoint %s: refused this client's certificate: %w (-etcd-cert, -etcd-key)", ep, err)
		}
	}
	return nil
}

// TLSConfig is the TLS configuration of c's connections to etcd, its
// files read (nil: plain text), or what is wrong with one, naming its
// flag: Dial's, and libkvxfer's check of a configuration before its
// start.
func (c ClientConfig) TLSConfig() (*tls.Config, error) {
	if !c.tls() {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.CA != "" {
		pem, err := os.ReadFile(c.CA)
		if err != nil {
			return nil, fmt.Errorf("-etcd-ca: %w", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-etcd-ca %s: no PEM certificate in it", c.CA)
		}
	}
	if c.Cert != "" {
		cert, err := tls.LoadX509KeyPair(c.Cert, c.Key)
		if err != nil {
			return nil, fmt.Errorf("-etcd-cert %s, -etcd-key %s: %w", c.Cert, c.Key, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
