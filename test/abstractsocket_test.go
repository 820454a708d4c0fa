package test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

func init() {
	// Open a scheduler of the attacker's own on the daemon's abstract
	// engine socket.
	attacks["abstract-socket"] = func(ctx context.Context, p func(string, error)) {
		cc, err := grpc.NewClient("unix-abstract:"+os.Getenv("KVXFER_ABSTRACT"), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			p("dial", err)
			return
		}
		defer cc.Close()
		_, err = pb.NewSchedulerServiceClient(cc).OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{
			EngineId: fmt.Sprintf("nobody-%d", os.Getpid()), Mode: pb.Mode_MODE_PUSH, TpSize: 1, PpSize: 1, LogicalBlockSize: 16,
			Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}})
		p("open", err)
	}
}

// An abstract engine socket (-socket @name) has no file, so -socket-mode
// was never applied to it: with the default 0600 ("only kvxferd's user")
// every local user, and every container of the network namespace, reached
// the engine services. kvxferd applies the mode to each connection's
// credentials itself: 0600 refuses another user's connection (counted:
// socket_mode), 0666 takes it, and kvxferd's own user is served either
// way.
func TestAbstractSocketHonorsTheMode(t *testing.T) {
	for _, tc := range []struct {
		mode string
		want codes.Code
	}{{"0600", codes.Unavailable}, {"0666", codes.OK}} {
		t.Run(tc.mode, func(t *testing.T) {
			dir := world(t)
			name := fmt.Sprintf("kvxfer-sec-%d-%s", os.Getpid(), tc.mode)
			d, err := daemontest.Start(dir, "d", "builtin", "-socket", "@"+name, "-socket-mode", tc.mode)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Stop() })
			out := asNobody(t, "abstract-socket", "KVXFER_ABSTRACT="+name)
			refused(t, out, tc.want, "open")
			// kvxferd's own user (this test's) is served.
			cc, err := grpc.NewClient("unix-abstract:"+name, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := pb.NewSchedulerServiceClient(cc).OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{
				EngineId: "own", Mode: pb.Mode_MODE_PUSH, TpSize: 1, PpSize: 1, LogicalBlockSize: 16,
				Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}}); err != nil {
				t.Errorf("kvxferd's own user on its abstract socket: %v", err)
			}
		})
	}
}
