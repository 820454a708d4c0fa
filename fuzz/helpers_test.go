package fuzz_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/topology"
)

func kinds(k ...topology.Kind) []topology.Kind { return k }

const (
	fa  = topology.KindFullAttention
	swa = topology.KindSlidingWindow
	mla = topology.KindMLA
	mmb = topology.KindMamba
)

var eng = kvsim.SmallEngine

func mustBuilder(t *testing.T, o hotpath.Options) *hotpath.Builder {
	t.Helper()
	b, err := hotpath.NewBuilder(o)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// checkAgainstReference panics unless the optimised descriptors move
// exactly the reference's bytes (a fuzz failure).
func checkAgainstReference(out []hotpath.Desc, p *topology.Plan, req *hotpath.Request, opts hotpath.Options) {
	if err := hotpath.VerifyAgainstReference(out, p, req, opts); err != nil {
		panic(err)
	}
}
