package kvxfer_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// netHarness makes built-in backends over loopback TCP (the in-process
// direct copy off, so the TCP path is what is checked) or with it on.
type netHarness struct{ direct bool }

func (h netHarness) New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	b, err := kvxfer.NewNetBackend(kvxfer.NetConfig{DisableLocal: !h.direct, Conns: 3, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	mem := make([]byte, n)
	const base = 1 << 40
	if err := b.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	return b, kvxfer.MemRegion{Addr: base, Len: uint64(n), Kind: kvxfer.MemDRAM}, mem
}

func TestConformanceNetTCP(t *testing.T)    { kvxfertest.Conformance(t, netHarness{}) }
func TestConformanceNetDirect(t *testing.T) { kvxfertest.Conformance(t, netHarness{direct: true}) }
