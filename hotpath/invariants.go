package hotpath

import (
	"fmt"

	"github.com/kvxfer/kvxfer/topology"
)

// checkAgainstReference panics unless out (the optimised descriptors of
// one AppendDescs call, still in write orientation: source local) moves
// exactly the bytes AppendReference moves, paired the same way and in the
// same order: each optimised descriptor must be the concatenation of
// consecutive reference descriptors, contiguous on both sides, on the same
// devices, and within opts.MaxRunBytes unless it is a single reference
// descriptor. AppendDescs calls it before it swaps a READ's sides, and
// only when built with -tags invariants; opts.Op is ignored.
func checkAgainstReference(out []Desc, p *topology.Plan, req *Request, opts Options) {
	if err := VerifyAgainstReference(out, p, req, opts); err != nil {
		panic(err.Error())
	}
}

// VerifyAgainstReference returns an error unless out, the descriptors of
// one AppendDescs call for p and req in write orientation (source local),
// moves exactly the bytes AppendReference moves, paired the same way and
// in the same order: each descriptor is the concatenation of consecutive
// reference descriptors, contiguous on both sides, on the same devices,
// and within opts.MaxRunBytes unless it is a single reference descriptor
// (opts.Op is ignored). The -tags invariants build checks every
// AppendDescs call with it; tests and fuzzers call it directly.
func VerifyAgainstReference(out []Desc, p *topology.Plan, req *Request, opts Options) error {
	ref, err := AppendReference(nil, p, req, OpWrite)
	if err != nil {
		return fmt.Errorf("hotpath invariant: AppendDescs succeeded where AppendReference failed: %v", err)
	}
	i := 0
	for k, d := range out {
		if d.Len == 0 {
			return fmt.Errorf("hotpath invariant: descriptor %d %+v is empty", k, d)
		}
		var n uint64
		pieces := 0
		for n < d.Len {
			if i == len(ref) {
				return fmt.Errorf("hotpath invariant: descriptor %d %+v extends past the reference's %d descriptors", k, d, len(ref))
			}
			r := ref[i]
			if r.Local != d.Local+n || r.Remote != d.Remote+n || r.LocalDev != d.LocalDev || r.RemoteDev != d.RemoteDev || n+r.Len > d.Len {
				return fmt.Errorf("hotpath invariant: descriptor %d %+v at +%d does not continue with reference descriptor %d %+v", k, d, n, i, r)
			}
			n += r.Len
			i++
			pieces++
		}
		if opts.MaxRunBytes > 0 && pieces > 1 && d.Len > uint64(opts.MaxRunBytes) {
			return fmt.Errorf("hotpath invariant: descriptor %d merges %d units into %d bytes, over MaxRunBytes %d", k, pieces, d.Len, opts.MaxRunBytes)
		}
	}
	if i != len(ref) {
		return fmt.Errorf("hotpath invariant: optimised descriptors cover %d of the reference's %d", i, len(ref))
	}
	return nil
}
