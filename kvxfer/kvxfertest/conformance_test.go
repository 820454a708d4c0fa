package kvxfertest_test

import (
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

type fakeHarness struct {
	fab *kvxfertest.Fabric
	n   int
}

func (h *fakeHarness) New(t *testing.T, size int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	h.n++
	a, err := h.fab.NewAgent(fmt.Sprint("agent-", h.n))
	if err != nil {
		t.Fatal(err)
	}
	r := a.Alloc(size, 0)
	return a, r, a.Bytes(r.Addr, r.Len)
}

func TestConformanceFake(t *testing.T) {
	kvxfertest.Conformance(t, &fakeHarness{fab: kvxfertest.NewFabric()})
}
