package peerauth

import (
	"context"
	"net"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// AuthInfo is what an authenticated gRPC connection knows of its peer:
// the name the client gave (on the server's side). The exchange protects
// who may connect, not the bytes after it: the security level is
// NoSecurity.
type AuthInfo struct {
	credentials.CommonAuthInfo
	Name string
}

// AuthType implements credentials.AuthInfo.
func (AuthInfo) AuthType() string { return "kvxfer-psk" }

// TransportCredentials returns gRPC transport credentials that run the
// exchange (purpose "grpc") on every connection, naming this side name
// when it dials. An insecure Authenticator returns insecure credentials.
func (a *Authenticator) TransportCredentials(name string) credentials.TransportCredentials {
	if a.insecure {
		return insecure.NewCredentials()
	}
	return &grpcCreds{a: a, name: name}
}

type grpcCreds struct {
	a    *Authenticator
	name string
}

func (c *grpcCreds) ClientHandshake(ctx context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	timeout := c.a.timeout()
	if d, ok := ctx.Deadline(); ok {
		if t := time.Until(d); t > 0 && t < timeout {
			timeout = t
		}
	}
	if err := c.a.client(conn, "grpc", c.name, timeout); err != nil {
		return nil, nil, err
	}
	return conn, AuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}, nil
}

func (c *grpcCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	name, err := c.a.Server(conn, "grpc")
	if err != nil {
		return nil, nil, err
	}
	return conn, AuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}, Name: name}, nil
}

func (c *grpcCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "kvxfer-psk"}
}

func (c *grpcCreds) Clone() credentials.TransportCredentials {
	return &grpcCreds{a: c.a, name: c.name}
}

func (c *grpcCreds) OverrideServerName(string) error { return nil }
