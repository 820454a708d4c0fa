package server_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

func mustAuth(t testing.TB, secret string) *peerauth.Authenticator {
	t.Helper()
	a, err := peerauth.New([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// gRPC over the credentials: the same secret works; another secret, or no
// authentication, fails on both sides with the reason.
func TestGRPCCredentials(t *testing.T) {
	auth := mustAuth(t, "0123456789abcdef-grpc")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.Creds(server.PeerCredentials(auth, "server")))
	healthpb.RegisterHealthServer(g, health.NewServer())
	go func() { _ = g.Serve(ln) }()
	defer g.Stop()
	check := func(creds grpc.DialOption) error {
		cc, err := grpc.NewClient(ln.Addr().String(), creds)
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	if err := check(grpc.WithTransportCredentials(server.PeerCredentials(mustAuth(t, "0123456789abcdef-grpc"), "c"))); err != nil {
		t.Errorf("same secret: %v", err)
	}
	before := auth.Failures()
	if err := check(grpc.WithTransportCredentials(server.PeerCredentials(mustAuth(t, "0123456789abcdef-other"), "c"))); err == nil ||
		!strings.Contains(err.Error(), "its proof does not match our secret") {
		t.Errorf("another secret: %v", err)
	}
	if err := check(grpc.WithTransportCredentials(insecure.NewCredentials())); err == nil {
		t.Error("no authentication: the call went through")
	}
	deadline := time.Now().Add(10 * time.Second)
	for auth.Failures() < before+2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if auth.Failures() < before+2 {
		t.Errorf("server failures = %d, want 2 more than %d", auth.Failures(), before)
	}
}
