package server

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// PeerAuthInfo is what an authenticated gRPC connection knows of its peer:
// the name the client gave (on the server's side). The exchange protects
// who may connect, not the bytes after it: the security level is
// NoSecurity.
type PeerAuthInfo struct {
	credentials.CommonAuthInfo
	Name string
}

// AuthType implements credentials.AuthInfo.
func (PeerAuthInfo) AuthType() string { return "kvxfer-psk" }

// PeerCredentials returns the gRPC transport credentials of the Peer
// service and of the resolver that calls it: they run a's exchange
// (purpose "grpc") on every connection, naming this side name when it
// dials. An insecure Authenticator gives insecure credentials. A refused
// connection is logged to slog.Default (PeerCredentialsLogged: to log).
func PeerCredentials(a *peerauth.Authenticator, name string) credentials.TransportCredentials {
	return PeerCredentialsLogged(a, name, nil)
}

// PeerCredentialsLogged is PeerCredentials logging refused connections to
// log (nil: slog.Default): the daemon's, rate-limited.
func PeerCredentialsLogged(a *peerauth.Authenticator, name string, log *slog.Logger) credentials.TransportCredentials {
	if !a.Enabled() {
		return insecure.NewCredentials()
	}
	return &grpcCreds{a: a, name: name, log: log}
}

type grpcCreds struct {
	a    *peerauth.Authenticator
	name string
	log  *slog.Logger
}

// logOr is log, or slog.Default when it is nil.
func logOr(log *slog.Logger) *slog.Logger {
	if log == nil {
		return slog.Default()
	}
	return log
}

func (c *grpcCreds) ClientHandshake(ctx context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	timeout := c.a.Limit()
	if d, ok := ctx.Deadline(); ok {
		if t := time.Until(d); t > 0 && t < timeout {
			timeout = t
		}
	}
	if err := c.a.ClientWithin(conn, "grpc", c.name, timeout); err != nil {
		return nil, nil, err
	}
	return conn, PeerAuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}, nil
}

func (c *grpcCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	name, err := c.a.Server(conn, "grpc")
	if err != nil {
		logOr(c.log).Warn("kvxferd: refused a Peer service connection", "from", conn.RemoteAddr().String(), "err", err)
		return nil, nil, err
	}
	return conn, PeerAuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}, Name: name}, nil
}

func (c *grpcCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "kvxfer-psk"}
}

func (c *grpcCreds) Clone() credentials.TransportCredentials {
	return &grpcCreds{a: c.a, name: c.name, log: c.log}
}

func (c *grpcCreds) OverrideServerName(string) error { return nil }

// LoggedServerCredentials wraps credentials (mutual TLS) so that every
// connection refused as a server is logged with its address and reason, as
// PeerCredentials' are, and every failed handshake, on either side, is
// counted by failed (when set), as PeerCredentials' exchanges are; log is
// where (nil: slog.Default).
func LoggedServerCredentials(c credentials.TransportCredentials, failed func(), log *slog.Logger) credentials.TransportCredentials {
	return loggedCreds{c, failed, log}
}

type loggedCreds struct {
	credentials.TransportCredentials
	failed func()
	log    *slog.Logger
}

func (l loggedCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, ai, err := l.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		if l.failed != nil {
			l.failed()
		}
		logOr(l.log).Warn("kvxferd: refused a Peer service connection", "from", conn.RemoteAddr().String(), "err", fmt.Errorf("TLS: %w", err))
	}
	return c, ai, err
}

func (l loggedCreds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, ai, err := l.TransportCredentials.ClientHandshake(ctx, authority, conn)
	if err != nil && ctx.Err() == nil && l.failed != nil {
		l.failed() // not a dial given up
	}
	return c, ai, err
}

func (l loggedCreds) Clone() credentials.TransportCredentials {
	return loggedCreds{l.TransportCredentials.Clone(), l.failed, l.log}
}
