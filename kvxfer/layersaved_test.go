package kvxfer_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// LayerSaved for a layer the rank does not hold is bad input from the
// engine: an error naming the field and its value, returned to the
// caller (as Step's are), counted once; the worker carries on, and a
// layer it holds is still taken.
func TestLayerSavedLayerNotHeldIsAnError(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(side string, c *kvxfer.WorkerConfig) { c.Layerwise = side == "P" })
		w := x.p.workers[0][0]
		for _, layer := range []int{-1, 2, 1 << 20} {
			err := w.LayerSaved(7, layer)
			if err == nil || !strings.Contains(err.Error(), "layer") || !strings.Contains(err.Error(), strconv.Itoa(layer)) {
				t.Errorf("LayerSaved(7, %d) = %v, want an error naming the layer and its value", layer, err)
			}
		}
		x.settle()
		if n := w.Metrics().Snapshot().BadInput["layer_saved.layer"]; n != 3 {
			t.Errorf("layer_saved.layer counted %d times, want 3", n)
		}
		for layer := range 2 {
			if err := w.LayerSaved(7, layer); err != nil {
				t.Errorf("LayerSaved(7, %d) = %v, want nil (a layer the rank holds)", layer, err)
			}
		}
	})
}
