package hotpath

import (
	"fmt"

	"github.com/kvxfer/kvxfer/topology"
)

// AppendReference is the plain reference implementation of
// Builder.AppendDescs: it expands every list to kernel ids and then to
// units with the topology helpers, and emits one descriptor per segment per
// unit per region, with no coalescing. It allocates freely. The optimised
// builder must move exactly the same bytes, paired the same way; fuzz and
// differential tests hold it to that.
func AppendReference(dst []Desc, p *topology.Plan, req *Request, op Op) ([]Desc, error) {
	if len(req.Src) != len(p.Groups) || len(req.Dst) != len(p.Groups) {
		return dst, fmt.Errorf("%w: groups: src %d, dst %d, plan %d", ErrInvalidRequest, len(req.Src), len(req.Dst), len(p.Groups))
	}
	start := len(dst)
	for g := range p.Groups {
		gp := &p.Groups[g]
		if err := checkIDs(req.Src[g].IDs, gp.SrcLimit, "src", g); err != nil {
			return dst[:start], err
		}
		if err := checkIDs(req.Dst[g].IDs, gp.DstLimit, "dst", g); err != nil {
			return dst[:start], err
		}
		s0, d0, n, err := gp.Align(req.Src[g], req.Dst[g], req.Tokens)
		if err != nil {
			return dst[:start], fmt.Errorf("%w: group %d: %w", ErrInvalidRequest, g, err)
		}
		sFine := topology.MapToFine(nil, topology.ExpandKernel(nil, req.Src[g].IDs, gp.SrcPPL), gp.SrcUnits, -1)
		dFine := topology.MapToFine(nil, topology.ExpandKernel(nil, req.Dst[g].IDs, gp.DstPPL), gp.DstUnits, -1)
		for _, rp := range gp.Regions {
			for k := 0; k < n; k++ {
				fs, fd := int64(sFine[s0+k]), int64(dFine[d0+k])
				su, du := int64(gp.SrcUnits), int64(gp.DstUnits)
				sa := rp.SrcBase + uint64((fs/su)*rp.SrcBlockLen+(fs%su)*rp.SrcSlotStride)
				da := rp.DstBase + uint64((fd/du)*rp.DstBlockLen+(fd%du)*rp.DstSlotStride)
				for _, sg := range rp.Segs {
					dst = append(dst, Desc{
						Local: sa + uint64(sg.SrcOff), Remote: da + uint64(sg.DstOff), Len: uint64(sg.Len),
						LocalDev: rp.SrcDev, RemoteDev: rp.DstDev,
					})
				}
			}
		}
	}
	if op == OpRead {
		for i := start; i < len(dst); i++ {
			d := &dst[i]
			d.Local, d.Remote = d.Remote, d.Local
			d.LocalDev, d.RemoteDev = d.RemoteDev, d.LocalDev
		}
	}
	return dst, nil
}
