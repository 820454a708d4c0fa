package tcp_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

func TestConformanceNetTCP(t *testing.T) { kvxfertest.Conformance(t, kvxfertest.TCPHarness{}) }
func TestConformanceNetDirect(t *testing.T) {
	kvxfertest.Conformance(t, kvxfertest.TCPHarness{Direct: true})
}
