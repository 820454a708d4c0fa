package test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// An authenticated peer cannot grow the daemon by calls over the
// connections it may open: gRPC takes any number of streams over one
// connection, and a health watch lives (a goroutine and buffers in the
// daemon) until its caller ends it. Past -max-peer-calls-per-conn on one
// connection, and -max-peer-calls on all, a call is refused at once
// (ResourceExhausted naming the flag, counted), the connection's other
// calls carry on, and a call that ends gives its place back.
func TestPeerCallsBounded(t *testing.T) {
	dir := world(t)
	metrics := freeAddr(t)
	d := startDaemon(t, dir, "d", "-metrics-listen", metrics, "-max-peer-calls-per-conn", "8", "-max-peer-calls", "12")
	v := attachVictim(t, d, dir, "victim")
	secret, err := peerauth.LoadSecret(filepath.Join(dir, "peer.secret"))
	if err != nil {
		t.Fatal(err)
	}
	auth, err := peerauth.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	dial := func() *grpc.ClientConn {
		t.Helper()
		c, err := grpc.NewClient(d.Peer, grpc.WithTransportCredentials(server.PeerCredentials(auth, "peer")))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// watch opens a health watch and reads its first answer: nil once the
	// daemon holds it, else the refusal.
	watch := func(c *grpc.ClientConn, wctx context.Context) error {
		w, err := healthpb.NewHealthClient(c).Watch(wctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			return err
		}
		_, err = w.Recv()
		return err
	}
	refusedWith := func(what string, err error, flag string) {
		t.Helper()
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s: %v, want ResourceExhausted naming %s", what, err, flag)
		}
	}
	c1 := dial()
	held1, release1 := context.WithCancel(ctx)
	for i := range 8 {
		if err := watch(c1, held1); err != nil {
			t.Fatalf("watch %d on one connection: %v", i, err)
		}
	}
	refusedWith("a 9th watch on the connection", watch(c1, ctx), "-max-peer-calls-per-conn")
	_, err = pb.NewPeerServiceClient(c1).Handshake(ctx, &pb.HandshakeRequest{EngineId: v.id})
	refusedWith("a handshake on the full connection", err, "-max-peer-calls-per-conn")
	// Another connection: four more, then the daemon's bound.
	c2 := dial()
	held2, release2 := context.WithCancel(ctx)
	defer release2()
	for i := range 4 {
		if err := watch(c2, held2); err != nil {
			t.Fatalf("watch %d on a second connection: %v", i, err)
		}
	}
	refusedWith("a 13th call in all", watch(c2, ctx), "-max-peer-calls")
	// The first connection's watches end: their places come back.
	release1()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := pb.NewPeerServiceClient(c1).Handshake(ctx, &pb.HandshakeRequest{EngineId: v.id})
		if err == nil && len(r.Payload) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a handshake once the watches ended: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	m := metricsOf(t, metrics)
	if m["kvxfer_refused_total"] < 3 {
		t.Errorf("kvxfer_refused_total = %v, want the 3 refusals counted", m["kvxfer_refused_total"])
	}
}
