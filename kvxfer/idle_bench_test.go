package kvxfer_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"

	"github.com/kvxfer/kvxfer/internal/proctime"
)

// BenchmarkNixlIdle: the CPU a nixl.Backend with nothing to do costs (its
// NIXL agent's progress thread and its own polling for notifications),
// after two seconds without activity. Each op is 100 ms of idling; cpu-%
// is the process's CPU time over that wall time.
func BenchmarkNixlIdle(b *testing.B) {
	be, err := nixl.New(nixl.Config{Name: fmt.Sprint("idle-", rand.Uint64()), Params: kvxfertest.NixlParams()})
	if errors.Is(err, nixl.ErrUnavailable) {
		b.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	time.Sleep(2 * time.Second)
	proctime.BenchIdle(b)
}
