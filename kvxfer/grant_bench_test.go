package kvxfer

import (
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// BenchmarkCheckAccess: one check of a 16-block run (kernel blocks two per
// logical block), as a frame's range costs it.
func BenchmarkCheckAccess(b *testing.B) {
	l, gb := accessLayout()
	tab := newAccessTable(l, gb, ModePush, NewMetrics())
	tab.grantWrite(1, []PeerName{"p"}, spansOf([]topology.BlockID{0, 1, 2, 3, 4, 5, 6, 7}, nil), "")
	b.ReportAllocs()
	for range b.N {
		if tab.CheckAccess("p", hotpath.OpWrite, 0x10000, 16*256) != AccessAllow {
			b.Fatal("refused")
		}
	}
}
