package topology

import (
	"errors"
	"strings"
	"testing"
)

// TestLaterPipelineStageAtRegionZeroRefused: a pipeline stage after the
// first holds the model's later layers, so its regions start past the
// earlier stages' (RegionOffset > 0; regions pair with D's by global
// index). A stage that says RegionOffset 0 (as the vLLM connector sent for
// every stage) would have its layers land in D's first layers, silently
// overwriting stage 0's KV; it must be refused, naming the fields.
func TestLaterPipelineStageAtRegionZeroRefused(t *testing.T) {
	src := tinyLayout(1, 0, 16, 16, 4, LayoutHND, PackedKV)
	src.PPSize, src.PPRank = 2, 1
	err := src.Validate()
	if !errors.Is(err, ErrInvalidLayout) || !strings.Contains(err.Error(), "RegionOffset = 0") || !strings.Contains(err.Error(), "PPRank = 1") {
		t.Fatalf("Validate() = %v, want ErrInvalidLayout naming RegionOffset = 0 and PPRank = 1", err)
	}
	dst := tinyLayout(1, 0, 16, 16, 4, LayoutHND, PackedKV)
	dst.Regions = append(dst.Regions, dst.Regions[0])
	dst.Regions[1].Base += 1 << 20
	dst.Groups = nil
	if p, err := NewPlan(src, dst, PlanOptions{}); err == nil {
		t.Fatalf("NewPlan() pairs stage 1's region %d with dst region %d (stage 0's layer), want a refusal",
			p.Groups[0].Regions[0].Src, p.Groups[0].Regions[0].Dst)
	}
	// The first stage, and a later stage past the earlier regions, pass.
	src.RegionOffset = 1
	if err := src.Validate(); err != nil {
		t.Fatalf("Validate() of stage 1 at RegionOffset 1 = %v", err)
	}
	if _, err := NewPlan(src, dst, PlanOptions{}); err != nil {
		t.Fatalf("NewPlan() of stage 1 at RegionOffset 1 = %v", err)
	}
}
