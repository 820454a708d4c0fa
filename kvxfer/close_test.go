package kvxfer_test

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A producer Worker closed (its engine's stream lost) while its WRITE
// still reads the engine's blocks: Close returns, and the request
// reports, only once the WRITE ended; the consumer is told, and every
// request ends once per side. Before, the close abandoned the WRITE at
// once and reported the blocks free while the backend still read them.
func TestCloseFencesInFlightWrites(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x, q := stalledWrite(t, nil)
		if in := x.p.agents[0][0].InFlight(); in == 0 {
			t.Fatal("no WRITE in flight")
		}
		closed := make(chan struct{})
		go func() {
			if err := x.p.workers[0][0].Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			close(closed)
		}()
		time.Sleep(2 * time.Second)
		synctest.Wait()
		select {
		case <-closed:
			t.Fatal("Close returned while a WRITE still read the engine's blocks")
		default:
		}
		x.out.collect(t, x.p)
		if got := x.sendResult(q); len(got) != 0 {
			t.Fatalf("P reported %+v while its WRITE was in flight", got)
		}
		x.fab.Faults().Unstall(x.d.agents[0][0].Name())
		<-closed
		x.settle()
		if in := x.p.agents[0][0].InFlight(); in != 0 {
			t.Errorf("%d WRITEs in flight after Close returned", in)
		}
		if got := x.sendResult(q); len(got) != 1 || got[0].Result != kvxfer.ResultFailed || got[0].Kind != kvxfer.FailureClosed {
			t.Errorf("P outcomes %+v, want one failed (worker_closed)", got)
		}
		time.Sleep(time.Minute)
		x.settle()
		if got := x.recvResult(q); len(got) != 1 {
			t.Errorf("D outcomes %+v, want one", got)
		}
	})
}

// A close whose transfers never end abandons them after CloseTimeout:
// Close is bounded, and every request still reports once.
func TestCloseFenceIsBounded(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x, q := stalledWrite(t, func(side string, c *kvxfer.WorkerConfig) { c.CloseTimeout = 3 * time.Second })
		start := time.Now()
		if err := x.p.workers[0][0].Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if took := time.Since(start); took < 3*time.Second || took > 4*time.Second {
			t.Errorf("Close took %v (fake clock), want CloseTimeout", took)
		}
		x.out.collect(t, x.p)
		if got := x.sendResult(q); len(got) != 1 || got[0].Result != kvxfer.ResultFailed {
			t.Errorf("P outcomes %+v, want one failed", got)
		}
		x.fab.Faults().Unstall(x.d.agents[0][0].Name())
	})
}

// stalledWrite is a push pair (its configs tweaked) whose producer posted
// request r1's WRITE into a consumer agent that stalls: it stays in
// flight until the test unstalls the agent.
func stalledWrite(t *testing.T, tweak func(side string, c *kvxfer.WorkerConfig)) (*pair, *xreq) {
	t.Helper()
	x := newPair(t, kvxfer.ModePush, 1, 1, tweak)
	q := x.req("r1", 40, 0)
	x.recvD(q)
	x.settle()
	x.fab.Faults().Stall(x.d.agents[0][0].Name())
	x.sendP(q)
	x.settle()
	return x, q
}
