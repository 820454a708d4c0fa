package kvsim

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// setup builds a P TP 2 -> D TP 1 pair, fills P and transfers, returning
// the D rank, its snapshot and the request.
func setup(t *testing.T) (*Rank, []byte, *Request, [][]*Rank) {
	t.Helper()
	m := &Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindMamba}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2,
		MambaConv: []int64{16, 8}, MambaSSM: 32}
	pe := &Engine{ID: 1, TP: 2, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}
	de := &Engine{ID: 2, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutNHD, Packing: topology.SplitKV, Blocks: 8}
	pr, err := Build(m, pe)
	if err != nil {
		t.Fatal(err)
	}
	dr, err := Build(m, de)
	if err != nil {
		t.Fatal(err)
	}
	req := &Request{Tokens: 40,
		P: []topology.Span{{IDs: []topology.BlockID{1, 2, 3}}, {IDs: []topology.BlockID{5}}},
		D: []topology.Span{{IDs: []topology.BlockID{6, 0, 4}}, {IDs: []topology.BlockID{2}}}}
	for _, r := range pr[0] {
		r.Scramble(uint64(r.Layout.TPRank + 1))
		r.Fill(req.P)
	}
	d := dr[0][0]
	d.Scramble(99)
	before := d.Snapshot()
	if _, _, _, err := Transfer(pr, dr[0], req, hotpath.Options{Op: hotpath.OpWrite}, topology.PlanOptions{MaxSegments: 1024}, false); err != nil {
		t.Fatal(err)
	}
	return d, before, req, pr
}

func TestCheckPassesAfterACorrectTransfer(t *testing.T) {
	d, before, req, _ := setup(t)
	if err := d.Check(before, req, 16, 16); err != nil {
		t.Fatal(err)
	}
	if err := d.CheckRequest(req, 16, 16); err != nil {
		t.Fatalf("CheckRequest: %v", err)
	}
}

// TestCheckCatchesEveryFault: a corrupted byte, a byte written twice and a
// stray write outside the request's blocks each fail the check loudly.
func TestCheckCatchesEveryFault(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault func(d *Rank, pr [][]*Rank)
		want  string
	}{
		{"corrupted transferred byte", func(d *Rank, _ [][]*Rank) {
			o := int(d.Layout.Regions[0].Base-d.Base) + 6*int(d.Layout.Regions[0].BlockLen) + 3
			d.Mem[o] ^= 0xff
		}, "transferred byte"},
		{"byte written twice", func(d *Rank, pr [][]*Rank) {
			a := d.Layout.Regions[0].Base + 6*uint64(d.Layout.Regions[0].BlockLen)
			if err := Copy(d, a, d, a, 1); err != nil {
				t.Fatal(err)
			}
		}, "written 2 times"},
		{"stray write into a block outside the request", func(d *Rank, pr [][]*Rank) {
			a := d.Layout.Regions[0].Base + 7*uint64(d.Layout.Regions[0].BlockLen)
			src := pr[0][0]
			if err := Copy(d, a, src, src.Layout.Regions[0].Base, 8); err != nil {
				t.Fatal(err)
			}
		}, "untouched byte"},
		{"stray write into the guard gap between regions", func(d *Rank, pr [][]*Rank) {
			r := d.Layout.Regions[0]
			a := r.Base + uint64(r.BlockLen)*uint64(r.NumBlocks) + 10
			d.Mem[a-d.Base]++
		}, "between regions"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, before, req, pr := setup(t)
			tc.fault(d, pr)
			err := d.Check(before, req, 16, 16)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Check() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestResolveBounds(t *testing.T) {
	d, _, _, _ := setup(t)
	if _, _, err := d.Resolve(d.Base-1, 4); err == nil {
		t.Error("Resolve below the arena succeeded")
	}
	if _, _, err := d.Resolve(d.Base+uint64(len(d.Mem))-2, 4); err == nil {
		t.Error("Resolve past the arena's end succeeded")
	}
	if _, _, err := d.Resolve(d.Base, uint64(len(d.Mem))); err != nil {
		t.Errorf("Resolve of the whole arena = %v", err)
	}
}

// A salted request's bytes check only under its own salt: another
// request's KV (same tokens, other salt) in its blocks is caught.
func TestSaltSeparatesRequests(t *testing.T) {
	d, before, req, pr := setup(t)
	if err := d.CheckRequest(&Request{Tokens: req.Tokens, P: req.P, D: req.D, Salt: 3}, 16, 16); err == nil {
		t.Fatal("unsalted bytes passed a check under salt 3")
	}
	for _, r := range pr[0] {
		r.FillSalt(req.P, 3)
	}
	copy(d.Mem, before)
	for i := range d.Mem {
		d.writes[i] = 0
	}
	salted := &Request{Tokens: req.Tokens, P: req.P, D: req.D, Salt: 3}
	if _, _, _, err := Transfer(pr, []*Rank{d}, salted, hotpath.Options{Op: hotpath.OpWrite}, topology.PlanOptions{MaxSegments: 1024}, false); err != nil {
		t.Fatal(err)
	}
	if err := d.Check(before, salted, 16, 16); err != nil {
		t.Fatalf("salted transfer: %v", err)
	}
	if err := d.CheckRequest(req, 16, 16); err == nil || !strings.Contains(err.Error(), "transferred byte") {
		t.Fatalf("salt-3 bytes checked as salt 0: %v", err)
	}
}
