package server_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// Worker streams opening while the server begins to drain: each is
// either counted before Drain waits (and drained) or refused, never
// counted under Drain's wait (a WaitGroup's Add racing its Wait at zero:
// -race caught it in a daemon's shutdown). Drain returns once every
// counted stream ended.
func TestStreamsOpeningAsDrainBegins(t *testing.T) {
	for round := range 20 {
		d := startDaemon(t, t.TempDir())
		cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
					if err != nil {
						return
					}
					_, _ = st.Recv() // the server refuses (draining), or waits for a hello until cancel
				}
			}()
		}
		time.Sleep(time.Duration(round%5) * time.Millisecond)
		dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
		go func() { time.Sleep(50 * time.Millisecond); cancel() }() // the streams counted end
		if err := d.srv.Drain(dctx); err != nil {
			t.Fatalf("round %d: Drain: %v", round, err)
		}
		dcancel()
		cancel()
		wg.Wait()
		cc.Close()
	}
}
