package kvxfer

import (
	"encoding/hex"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
)

// TestCoreSimLayerwisePreemptRandom runs FuzzCores' simulator on random
// layer-wise inputs weighted towards preemptions, saved layers and
// finishes (KVXFER_CORESIM_N inputs, default 300): every check of
// FuzzCores holds (one outcome per request and rank, no WRITE reading
// blocks its request released except a preempted attempt's, every byte
// a consumer reports done is its producer request's, each once).
func TestCoreSimLayerwisePreemptRandom(t *testing.T) {
	n := 300
	if v, err := strconv.Atoi(os.Getenv("KVXFER_CORESIM_N")); err == nil {
		n = v
	}
	seed := uint64(1)
	if v, err := strconv.ParseUint(os.Getenv("KVXFER_CORESIM_SEED"), 10, 64); err == nil {
		seed = v
	}
	rng := rand.New(rand.NewPCG(seed, 2))
	got := map[string]int{}
	defer func() { t.Logf("exercised %v", got) }()
	for i := range n {
		in := coreSimLayerInput(rng)
		if h := os.Getenv("KVXFER_CORESIM_IN"); h != "" {
			in, _ = hex.DecodeString(h)
		}
		ok := t.Run("", func(t *testing.T) {
			s := newCoreSim(t, in)
			s.stats = map[string]int{}
			s.restarts = simMaxRestarts // FuzzCores restarts engines
			defer func() {
				for k, v := range s.stats {
					got[k] += v
				}
			}()
			for !s.done() {
				s.event()
			}
			s.drain()
			s.checkAll()
		})
		if !ok {
			t.Fatalf("input %d: %x", i, in)
		}
	}
}

// coreSimLayerInput is a random layer-wise input of FuzzCores' second
// format.
func coreSimLayerInput(rng *rand.Rand) []byte {
	tp, grants, reqs := rng.IntN(3), rng.IntN(2) == 1, 1+rng.IntN(4)
	in := []byte{simHeader(simLayer, tp, grants, reqs)}
	for range reqs {
		in = append(in, byte(rng.IntN(256)))
	}
	// Events: steps (0), saves (14), preemptions (18) and landings (7)
	// more often than the rest.
	common := []byte{0, 0, 0, 14, 14, 14, 18, 18, 7, 7, 2, 2, 9, 9, 12, 17}
	for range 30 + rng.IntN(100) {
		if rng.IntN(10) == 0 {
			in = append(in, byte(rng.IntN(19)))
		} else {
			in = append(in, common[rng.IntN(len(common))])
		}
		// Its arguments: a step's side (0: P) more often than not.
		in = append(in, byte(rng.IntN(256)), byte(rng.IntN(3)))
	}
	return in
}
