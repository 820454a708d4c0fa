package server_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// schedEngine is the child process of TestSchedulerOfGoneEngineReclaimed:
// an engine that opens its scheduler on the daemon at sock and exits
// without closing it (as one that crashed), printing the answer.
func schedEngine(arg string) int {
	sock, id, _ := strings.Cut(arg, ",")
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pb.NewSchedulerServiceClient(cc).OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id,
		Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}})
	fmt.Printf("open %s: %v\n", id, err)
	return 0
}

// The schedulers of engines whose process is gone (crashed: none called
// CloseScheduler) do not hold their uid's scheduler slots for ever: an
// engine opening its scheduler past the bound reclaims them. On the old
// code, after MaxStreamsPerUID engines with fresh ids (vLLM's default
// engine_id is a fresh UUID per start) had crashed, no engine of that uid
// could open a scheduler again until kvxferd restarted.
func TestSchedulerOfGoneEngineReclaimed(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) { c.MaxStreamsPerUID = 2 })
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range 4 {
		id := fmt.Sprintf("crashed-%d", i)
		cmd := exec.CommandContext(ctx, self, "-test.run=^$")
		cmd.Env = append(os.Environ(), "KVXFER_SCHED_ENGINE="+d.sock+","+id)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("engine %s: %v\n%s", id, err, out)
		}
		if want := fmt.Sprintf("open %s: <nil>", id); !strings.Contains(string(out), want) {
			t.Errorf("engine %s, after %d engines of its uid exited with their schedulers open: %s; want %q", id, i, out, want)
		}
	}
	if n := d.srv.Refusals()["schedulers_per_uid"]; n != 0 {
		t.Errorf("Refusals()[schedulers_per_uid] = %d, want 0", n)
	}
	// A live engine's scheduler is never taken: this process's two fill
	// the bound, and a third is refused.
	_, c, cctx := schedulerClientOn(t, d)
	for i := range 3 {
		_, err := c.OpenScheduler(cctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: fmt.Sprintf("live-%d", i),
			Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}})
		if i < 2 && err != nil {
			t.Fatalf("OpenScheduler(live-%d) = %v", i, err)
		}
		if i == 2 && (err == nil || !strings.Contains(err.Error(), "schedulers open")) {
			t.Errorf("OpenScheduler(live-2) past the bound with two live schedulers = %v, want refused", err)
		}
	}
}
