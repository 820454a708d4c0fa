package server_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A scheduler outlives the call that opened it (until CloseScheduler), so
// one user opening schedulers under fresh engine ids grew the daemon's
// memory without bound (and claimed engine ids without end). Schedulers
// are bounded per uid like streams (MaxStreamsPerUID): one more is
// refused (ResourceExhausted, counted), the open ones carry on, and one
// closed makes room.
func TestSchedulersPerUIDBounded(t *testing.T) {
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) { c.MaxStreamsPerUID = 3 })
	cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sc := pb.NewSchedulerServiceClient(cc)
	open := func(id string) error {
		_, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH,
			TpSize: 1, PpSize: 1, LogicalBlockSize: 16, Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}}}})
		return err
	}
	for i := range 3 {
		if err := open(fmt.Sprintf("S%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	// Opening an engine's scheduler again replaces it: no room taken.
	if err := open("S0"); err != nil {
		t.Fatalf("reopening S0: %v", err)
	}
	var refused error
	for i := 3; i < 100 && refused == nil; i++ {
		refused = open(fmt.Sprintf("S%d", i))
	}
	if status.Code(refused) != codes.ResourceExhausted || !strings.Contains(refused.Error(), "-max-streams-per-uid") {
		t.Fatalf("schedulers past MaxStreamsPerUID 3: %v, want ResourceExhausted naming -max-streams-per-uid", refused)
	}
	if r := d.srv.Refusals(); r["schedulers_per_uid"] < 1 {
		t.Errorf("refusals = %v, want schedulers_per_uid counted", r)
	}
	// The open ones carry on; closing one makes room.
	if _, err := sc.Step(ctx, &pb.StepRequest{EngineId: "S1"}); err != nil {
		t.Errorf("step of an open scheduler: %v", err)
	}
	if _, err := sc.CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: "S2"}); err != nil {
		t.Fatal(err)
	}
	if err := open("S9"); err != nil {
		t.Errorf("a scheduler after one closed: %v", err)
	}
}
