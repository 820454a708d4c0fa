package server_test

import (
	"strings"
	"testing"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A LayerSaved naming a layer the rank does not hold is the engine's
// mistake: kvxferd tells it (a step error naming the layer, not a dropped
// step), counts it, and the stream carries on. Before, it was dropped
// without a word to the engine.
func TestLayerSavedUnheldLayerTold(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	hello := directHello(t)
	hello.Layerwise = true
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready", m, ended, code, msg)
	}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_LayerSaved{LayerSaved: &pb.LayerSaved{Step: 3, Layer: 4097}}})); err != nil {
		t.Fatal(err)
	}
	for {
		m, ended, code, msg := take(t, ds)
		if ended {
			t.Fatalf("stream ended: %v %s", code, msg)
		}
		se := m.GetStepError()
		if se == nil {
			continue
		}
		if se.Dropped || se.Step != 3 || !strings.Contains(se.Message, "layer = 4097") {
			t.Errorf("StepError = %v, want step 3, not dropped, naming layer 4097", se)
		}
		break
	}
	ws := d.srv.Workers()["direct"]
	if len(ws) != 1 {
		t.Fatalf("workers of engine direct: %d", len(ws))
	}
	if n := ws[0].Metrics().Snapshot().BadInput["layer_saved.layer"]; n != 1 {
		t.Errorf("layer_saved.layer counted %d, want 1", n)
	}
	// The stream carries on: a step is taken.
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 4}}})); err != nil {
		t.Fatal(err)
	}
}

// A layer-wise later pipeline stage whose K and V have regions of their
// own says its first layer (hello.first_layer): the rank numbers its
// layers from it, so LayerSaved of its first layer is taken and of the
// layer before is refused, naming the layers it holds. Before, such a
// stage was numbered from its region offset halved, which an earlier
// stage's one-region MLA or Mamba layers make wrong (a WRITE of a layer
// before it was saved).
func TestLayerSavedFirstLayerOfSeparateStage(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	hello := directHello(t)
	hello.Layerwise = true
	l := hello.Layout
	l.PpRank, l.PpSize, l.RegionOffset, l.Packing = 1, 2, 3, pb.KvPacking_KV_PACKING_SEPARATE
	k := l.Regions[0]
	k.BlockLen, k.NumBlocks = 128, k.NumBlocks/2
	v := &pb.Region{Kind: k.Kind, Base: k.Base + uint64(k.BlockLen)*uint64(k.NumBlocks), BlockLen: k.BlockLen, NumBlocks: k.NumBlocks}
	l.Regions = []*pb.Region{k, v}
	hello.FirstLayer = 2 // the earlier stage: an MLA layer and an attention layer (1 + 2 regions)
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready", m, ended, code, msg)
	}
	for _, layer := range []int32{2, 1} {
		if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_LayerSaved{LayerSaved: &pb.LayerSaved{Step: 3, Layer: layer}}})); err != nil {
			t.Fatal(err)
		}
	}
	for {
		m, ended, code, msg := take(t, ds)
		if ended {
			t.Fatalf("stream ended: %v %s", code, msg)
		}
		se := m.GetStepError()
		if se == nil {
			continue
		}
		if !strings.Contains(se.Message, "layer = 1,") || !strings.Contains(se.Message, "layers 2..2") {
			t.Errorf("StepError = %v, want layer 1 refused, the rank holding layers 2..2", se)
		}
		break
	}
	ws := d.srv.Workers()["direct"]
	if len(ws) != 1 {
		t.Fatalf("workers of engine direct: %d", len(ws))
	}
	if n := ws[0].Metrics().Snapshot().BadInput["layer_saved.layer"]; n != 1 {
		t.Errorf("layer_saved.layer counted %d, want 1 (layer 1 only)", n)
	}
}
