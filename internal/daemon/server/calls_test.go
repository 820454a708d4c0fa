package server_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// gRPC takes any number of streams over one connection: an engine whose
// unary calls never send their request held a goroutine each in the
// daemon, without bound. The calls of one uid in flight are bounded
// (MaxCallsPerUID) whatever the method, a call past it is refused at once
// (ResourceExhausted naming -max-calls-per-uid, counted as
// calls_per_uid), and one that ends makes room. (The real daemon's wiring,
// against another user's flood: test.TestAnotherUserCannotFloodCalls.)
func TestCallsPerUIDBounded(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runCallsPerUIDBounded) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runCallsPerUIDBounded(t *testing.T) {
	const bound = 4
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) { c.MaxCallsPerUID = bound })
	cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// bound unary calls whose request never comes: the daemon waits for
	// each in a goroutine of its own.
	stalled := make([]context.CancelFunc, bound)
	for i := range stalled {
		sctx, scancel := context.WithCancel(ctx)
		stalled[i] = scancel
		defer scancel()
		if _, err := cc.NewStream(sctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, "/kvxfer.v1.SchedulerService/Step"); err != nil {
			t.Fatal(err)
		}
	}
	sc := pb.NewSchedulerServiceClient(cc)
	var refused error
	// The stalled calls' headers reach the daemon before this one's: up
	// to 10 s (100 tries 10 ms apart, about a second, could run out on a
	// loaded machine before they had).
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if _, refused = sc.CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: "E"}); status.Code(refused) == codes.ResourceExhausted {
			break
		}
	}
	if status.Code(refused) != codes.ResourceExhausted || !strings.Contains(refused.Error(), "-max-calls-per-uid") {
		t.Fatalf("a call past %d stalled ones: %v, want ResourceExhausted naming -max-calls-per-uid", bound, refused)
	}
	if r := d.srv.Refusals(); r["calls_per_uid"] < 1 {
		t.Errorf("refusals = %v, want calls_per_uid counted", r)
	}
	// One stalled call ends: its room is given back.
	stalled[0]()
	var err2 error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if _, err2 = sc.CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: "E"}); status.Code(err2) != codes.ResourceExhausted {
			break
		}
	}
	if status.Code(err2) != codes.NotFound { // the call ran: no scheduler E
		t.Errorf("a call after a stalled one ended: %v, want it to run (NotFound: no scheduler E)", err2)
	}
}
