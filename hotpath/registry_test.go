package hotpath_test

import (
	"errors"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

func TestRegistryPlanComputedOnce(t *testing.T) {
	src, dst := pairOf(t, eng(1, 2, 16, 16, topology.LayoutHND, topology.PackedKV), eng(2, 1, 16, 16, topology.LayoutHND, topology.PackedKV), 4, fa)
	reg := hotpath.NewRegistry()
	key := hotpath.PlanKey{Peer: "d-engine", Generation: 1, SrcTPRank: 0, DstTPRank: 0}
	builds := 0
	build := func() (*topology.Plan, error) {
		builds++
		return topology.NewPlan(src, dst, topology.PlanOptions{})
	}
	first, err := reg.Plan(key, build)
	if err != nil {
		t.Fatal(err)
	}
	for range 50 {
		if p, err := reg.Plan(key, build); err != nil || p != first {
			t.Fatalf("Plan = %p, %v; want the first plan %p", p, err, first)
		}
	}
	if builds != 1 {
		t.Fatalf("plan built %d times, want 1", builds)
	}
}

func TestRegistryFailedBuildNotCached(t *testing.T) {
	reg := hotpath.NewRegistry()
	key := hotpath.PlanKey{Peer: "p", Generation: 1}
	boom := errors.New("boom")
	if _, err := reg.Plan(key, func() (*topology.Plan, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("Plan = %v, want boom", err)
	}
	want := &topology.Plan{}
	got, err := reg.Plan(key, func() (*topology.Plan, error) { return want, nil })
	if err != nil || got != want {
		t.Fatalf("Plan after failure = %p, %v, want the new plan", got, err)
	}
}

func TestRegistryInvalidation(t *testing.T) {
	src, _ := pairOf(t, eng(1, 1, 16, 16, topology.LayoutHND, topology.PackedKV), eng(2, 1, 16, 16, topology.LayoutHND, topology.PackedKV), 4, fa)
	reg := hotpath.NewRegistry()
	rk := func(peer string, gen uint64) hotpath.RankKey { return hotpath.RankKey{Peer: peer, Generation: gen} }
	pk := func(peer string, gen uint64) hotpath.PlanKey { return hotpath.PlanKey{Peer: peer, Generation: gen} }
	plan := func() (*topology.Plan, error) { return &topology.Plan{}, nil }

	bad := *src
	bad.TPSize = 0
	if err := reg.StoreLayout(rk("x", 1), &bad); err == nil {
		t.Fatal("StoreLayout(invalid) = nil, want an error")
	}
	if _, ok := reg.Layout(rk("x", 1)); ok {
		t.Fatal("an invalid layout was stored")
	}

	for _, peer := range []string{"a", "b"} {
		for gen := uint64(1); gen <= 2; gen++ {
			if err := reg.StoreLayout(rk(peer, gen), src); err != nil {
				t.Fatal(err)
			}
			if _, err := reg.Plan(pk(peer, gen), plan); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Re-storing a layout drops that generation's plans only.
	p1, _ := reg.Plan(pk("a", 1), plan)
	if err := reg.StoreLayout(rk("a", 2), src); err != nil {
		t.Fatal(err)
	}
	if p, _ := reg.Plan(pk("a", 1), plan); p != p1 {
		t.Fatal("StoreLayout(a gen 2) dropped a gen 1 plan")
	}
	if n := reg.DropGeneration("a", 2); n != 2 {
		t.Fatalf("DropGeneration(a, 2) removed %d entries, want 2 (gen 1 layout and plan)", n)
	}
	if _, ok := reg.Layout(rk("a", 2)); !ok {
		t.Fatal("DropGeneration(a, 2) removed the current generation")
	}
	if n := reg.DropPeer("b"); n != 4 {
		t.Fatalf("DropPeer(b) removed %d entries, want 4", n)
	}
	if _, ok := reg.Layout(rk("b", 1)); ok {
		t.Fatal("DropPeer(b) left a layout")
	}
	if n := reg.DropPeer("b"); n != 0 {
		t.Fatalf("second DropPeer(b) removed %d, want 0", n)
	}
}
