package kvsim

import (
	"errors"
	"fmt"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// Request is one request's blocks on both engines, per cache group.
type Request struct {
	// Tokens is the source's token count (0: bounded by the lists only).
	Tokens int
	P, D   []topology.Span
	// Salt shifts the pattern's token index by Salt<<24 (see FillSalt),
	// so requests with different salts hold different bytes at the same
	// token and a transfer that lands one request's KV in another's
	// blocks is caught.
	Salt int
}

// blockGeom computes byte offsets inside an attention block with explicit
// strides derived from the dimension order of a layout.
type blockGeom struct {
	sH, sT, sKV int // strides in vectors of headBytes
	headBytes   int
}

func geomOf(l *topology.Layout) blockGeom {
	h := l.TotalKVHeads / l.TPSize
	if l.TPSize >= l.TotalKVHeads {
		h = 1
	}
	n := l.KernelBlockSize
	g := blockGeom{headBytes: l.HeadSize * l.ElemBytes}
	// Dimension order, outermost first; the innermost is the vector.
	type dim struct {
		stride *int
		size   int
	}
	var dims []dim
	tokenDims := []dim{{&g.sH, h}, {&g.sT, n}}
	if l.KVLayout == topology.LayoutNHD {
		tokenDims = []dim{{&g.sT, n}, {&g.sH, h}}
	}
	switch l.Packing {
	case topology.PackedKV:
		dims = append(tokenDims, dim{&g.sKV, 2})
	case topology.SplitKV:
		dims = append([]dim{{&g.sKV, 2}}, tokenDims...)
	default:
		dims = tokenDims
	}
	stride := 1
	for i := len(dims) - 1; i >= 0; i-- {
		*dims[i].stride = stride
		stride *= dims[i].size
	}
	return g
}

func (g blockGeom) off(h, t, kv int) int {
	return (h*g.sH + t*g.sT + kv*g.sKV) * g.headBytes
}

// globalHead is the model head held at local head h of a rank.
func globalHead(l *topology.Layout, h int) int {
	if l.TPSize >= l.TotalKVHeads {
		return l.TPRank * l.TotalKVHeads / l.TPSize
	}
	return l.TPRank*(l.TotalKVHeads/l.TPSize) + h
}

// visitFn is called for every byte of a rank's request blocks in one
// group's region: fn(offset in Mem, token or pair index, head, kv, byte
// index).
type visitFn func(o, token, head, kv, j int)

func (r *Rank) visit(g, ri int, span topology.Span, fn visitFn) {
	r.visitVec(g, ri, span, func(o, token, head, kv, j0, n int) {
		for j := range n {
			fn(o+j, token, head, kv, j0+j)
		}
	})
}

// vecFn is called for every contiguous vector of a rank's request blocks
// in one group's region: bytes o..o+n-1 of Mem are bytes j0..j0+n-1 of the
// (token or pair index, head, kv) vector.
type vecFn func(o, token, head, kv, j0, n int)

func (r *Rank) visitVec(g, ri int, span topology.Span, fn vecFn) {
	l := &r.Layout
	reg := &l.Regions[ri]
	base := int(reg.Base - r.Base)
	switch reg.Kind {
	case topology.KindFullAttention, topology.KindSlidingWindow:
		geo := geomOf(l)
		ppl := l.LogicalBlockSize / l.KernelBlockSize
		heads := l.TotalKVHeads / l.TPSize
		if l.TPSize >= l.TotalKVHeads {
			heads = 1
		}
		kvs := []int{0, 1}
		if l.Packing == topology.SeparateKV {
			kvs = []int{r.KV[ri]}
		}
		for i, id := range span.IDs {
			for k := 0; k < ppl; k++ {
				kb := int(id)*ppl + k
				tok0 := span.Start + (i*ppl+k)*l.KernelBlockSize
				for t := 0; t < l.KernelBlockSize; t++ {
					for h := 0; h < heads; h++ {
						for _, kv := range kvs {
							inBlockKV := kv
							if l.Packing == topology.SeparateKV {
								inBlockKV = 0
							}
							o := base + kb*int(reg.BlockLen) + geo.off(h, t, inBlockKV)
							fn(o, tok0+t, globalHead(l, h), kv, 0, geo.headBytes)
						}
					}
				}
			}
		}
	case topology.KindMLA:
		ppl := l.LogicalBlockSize / l.KernelBlockSize
		bpt := int(reg.BlockLen) / l.KernelBlockSize
		for i, id := range span.IDs {
			for k := 0; k < ppl; k++ {
				kb := int(id)*ppl + k
				tok0 := span.Start + (i*ppl+k)*l.KernelBlockSize
				for t := 0; t < l.KernelBlockSize; t++ {
					fn(base+kb*int(reg.BlockLen)+t*bpt, tok0+t, 0, 0, 0, bpt)
				}
			}
		}
	case topology.KindMamba:
		for i, id := range span.IDs {
			o := base + int(id)*int(reg.BlockLen)
			parts := append(append([]int64(nil), reg.ConvBytes...), reg.SSMBytes)
			for p, size := range parts {
				fn(o, i, p, 0, l.TPRank*int(size), int(size))
				o += int(size)
			}
		}
	}
}

// Fill writes the pattern into a source rank's request blocks.
func (r *Rank) Fill(spans []topology.Span) { r.FillSalt(spans, 0) }

// FillSalt writes the pattern of a request with the given salt (see
// Request.Salt) into a source rank's request blocks.
func (r *Rank) FillSalt(spans []topology.Span, salt int) {
	shift := salt << 24
	for g, grp := range r.Layout.GroupList() {
		for _, ri := range grp.Regions {
			layer := r.Layer[ri]
			r.visitVec(g, ri, spans[g], func(o, token, head, kv, j0, n int) {
				seed := vecSeed(layer, token+shift, head, kv)
				dst := r.Mem[o : o+n]
				for j := range dst {
					dst[j] = byteOf(seed, j0+j)
				}
			})
		}
	}
}

// Snapshot returns a copy of the rank's memory.
func (r *Rank) Snapshot() []byte { return append([]byte(nil), r.Mem...) }

// Check verifies a destination rank after a transfer from an engine with
// source kernel block size srcKernel and source logical block size
// srcLogical: every byte of a token both lists hold (below req.Tokens)
// holds the pattern and was written exactly once; bytes of the last unit
// past req.Tokens hold the pattern or their old value and were written at
// most once; every other byte equals before and was never written.
func (r *Rank) Check(before []byte, req *Request, srcKernel, srcLogical int) error {
	return r.check(before, []*Request{req}, srcKernel, srcLogical, true)
}

// CheckRequest checks only the bytes req must have received (every token
// both lists hold, below req.Tokens) against the pattern; other bytes are
// not looked at. It suits a rank whose other blocks keep changing.
func (r *Rank) CheckRequest(req *Request, srcKernel, srcLogical int) error {
	return r.check(nil, []*Request{req}, srcKernel, srcLogical, false)
}

// CheckValues is Check for bytes that moved through something other than
// Copy (a backend), so write counts are unknown, and for several requests
// at once: every byte of every request is checked against the pattern and
// every byte of no request against before.
func (r *Rank) CheckValues(before []byte, reqs []*Request, srcKernel, srcLogical int) error {
	return r.check(before, reqs, srcKernel, srcLogical, false)
}

func (r *Rank) check(before []byte, reqs []*Request, srcKernel, srcLogical int, counts bool) error {
	l := &r.Layout
	only := before == nil
	const (
		untouched = iota
		must
		may
	)
	var want []byte
	var class []uint8
	var errs []error
	if !only {
		want = append([]byte(nil), before...)
		class = make([]uint8, len(r.Mem))
	}
	// mark records what byte o must hold; with only, it checks it at once
	// (cost proportional to the request, not to the rank's memory).
	mark := func(o int, c uint8, v byte) {
		if !only {
			class[o], want[o] = c, v
			return
		}
		if c == must && r.Mem[o] != v && len(errs) < 8 {
			errs = append(errs, fmt.Errorf("dst tp %d pp %d %s: transferred byte = %#02x, want %#02x", l.TPRank, l.PPRank, r.where(o), r.Mem[o], v))
		}
	}
	for _, req := range reqs {
		shift := req.Salt << 24
		for g, grp := range l.GroupList() {
			ps, ds := req.P[g], req.D[g]
			var lo, mustHi, mayHi int
			var s0, d0, n int
			if grp.Kind == topology.KindMamba {
				var err error
				s0, d0, n, err = topology.TrimSSM(len(ps.IDs), len(ds.IDs))
				if err != nil {
					return err
				}
			} else {
				unit := min(srcKernel, l.KernelBlockSize)
				pEnd := ps.Start + len(ps.IDs)*srcLogical
				dEnd := ds.Start + len(ds.IDs)*l.LogicalBlockSize
				lo, mustHi = max(ps.Start, ds.Start), min(pEnd, dEnd)
				mayHi = mustHi
				if req.Tokens > 0 {
					mustHi = min(mustHi, req.Tokens)
					mayHi = min(mayHi, (req.Tokens+unit-1)/unit*unit)
				}
			}
			for _, ri := range grp.Regions {
				layer := r.Layer[ri]
				if only {
					// Values only, a vector at a time: cost proportional to
					// the request.
					r.visitVec(g, ri, ds, func(o, token, head, kv, j0, size int) {
						if len(errs) >= 8 {
							return
						}
						vt := token
						if grp.Kind == topology.KindMamba {
							if token < d0 || token >= d0+n {
								return
							}
							vt = s0 + token - d0
						} else if token < lo || token >= mustHi {
							return
						}
						seed := vecSeed(layer, vt+shift, head, kv)
						for j, got := range r.Mem[o : o+size] {
							if v := byteOf(seed, j0+j); got != v {
								errs = append(errs, fmt.Errorf("dst tp %d pp %d %s: transferred byte = %#02x, want %#02x", l.TPRank, l.PPRank, r.where(o+j), got, v))
								return
							}
						}
					})
					continue
				}
				r.visit(g, ri, ds, func(o, token, head, kv, j int) {
					if grp.Kind == topology.KindMamba {
						// token is the D list index; head is the part.
						if token >= d0 && token < d0+n {
							mark(o, must, Value(layer, s0+token-d0+shift, head, kv, j))
						}
						return
					}
					switch {
					case token >= lo && token < mustHi:
						mark(o, must, Value(layer, token+shift, head, kv, j))
					case token >= lo && token < mayHi:
						mark(o, may, Value(layer, token+shift, head, kv, j))
					}
				})
			}
		}
	}
	if only {
		return errors.Join(errs...)
	}
	for o := range r.Mem {
		got, w := r.Mem[o], r.writes[o]
		if !counts { // only values are known: take the counts as right
			w = 0
			if class[o] == must {
				w = 1
			}
		}
		var bad string
		switch class[o] {
		case must:
			if got != want[o] || w != 1 {
				bad = fmt.Sprintf("transferred byte = %#02x written %d times, want %#02x written once", got, w, want[o])
			}
		case may:
			if (got != want[o] && got != before[o]) || w > 1 {
				bad = fmt.Sprintf("tail byte = %#02x written %d times, want %#02x or %#02x at most once", got, w, want[o], before[o])
			}
		default:
			if got != before[o] || w != 0 {
				bad = fmt.Sprintf("untouched byte = %#02x written %d times, want %#02x never written", got, w, before[o])
			}
		}
		if bad != "" {
			errs = append(errs, fmt.Errorf("dst tp %d pp %d %s: %s", l.TPRank, l.PPRank, r.where(o), bad))
			if len(errs) == 8 {
				errs = append(errs, errors.New("(more errors elided)"))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// where describes an offset of Mem for error messages.
func (r *Rank) where(o int) string {
	a := r.Base + uint64(o)
	for i := range r.Layout.Regions {
		reg := &r.Layout.Regions[i]
		if a >= reg.Base && a < reg.Base+uint64(reg.BlockLen)*uint64(reg.NumBlocks) {
			rel := a - reg.Base
			return fmt.Sprintf("region %d (layer %d) block %d byte %d", i, r.Layer[i], rel/uint64(reg.BlockLen), rel%uint64(reg.BlockLen))
		}
	}
	return fmt.Sprintf("offset %d (between regions)", o)
}

// Transfer moves req's KV from every source rank to every destination rank
// the way a deployment would: for OpWrite each source rank plans and
// posts to its TargetRanks (push); for OpRead each destination rank plans
// and posts to its TargetRanks (pull). It copies through Copy and returns
// the notifications each destination and source rank received (one per
// connected pair per source stage, bytes or not) and the descriptor count.
//
// When reference is set it uses hotpath.AppendReference instead of a
// Builder.
func Transfer(src [][]*Rank, dst []*Rank, req *Request, opts hotpath.Options, popts topology.PlanOptions, reference bool) (notifsAtDst, notifsAtSrc map[[2]int]int, descs int, err error) {
	b, err := hotpath.NewBuilder(opts)
	if err != nil {
		return nil, nil, 0, err
	}
	notifsAtDst = map[[2]int]int{}
	notifsAtSrc = map[[2]int]int{}
	hreq := &hotpath.Request{Tokens: req.Tokens, Src: req.P, Dst: req.D}
	var buf []hotpath.Desc
	pair := func(p, d *Rank) error {
		plan, err := topology.NewPlan(&p.Layout, &d.Layout, popts)
		if err != nil {
			return err
		}
		if reference {
			buf, err = hotpath.AppendReference(buf[:0], plan, hreq, opts.Op)
		} else {
			buf, err = b.AppendDescs(buf[:0], plan, hreq)
		}
		if err != nil {
			return err
		}
		descs += len(buf)
		for _, ds := range buf {
			if opts.Op == hotpath.OpWrite {
				err = Copy(d, ds.Remote, p, ds.Local, ds.Len)
			} else {
				err = Copy(d, ds.Local, p, ds.Remote, ds.Len)
			}
			if err != nil {
				return fmt.Errorf("desc %+v: %w", ds, err)
			}
		}
		notifsAtDst[[2]int{d.Layout.TPRank, 0}]++
		notifsAtSrc[[2]int{p.Layout.TPRank, p.Layout.PPRank}]++
		return nil
	}
	for _, stage := range src {
		tpSrc, tpDst := stage[0].Layout.TPSize, dst[0].Layout.TPSize
		if opts.Op == hotpath.OpWrite {
			for _, p := range stage {
				targets, err := topology.TargetRanks(nil, tpSrc, tpDst, p.Layout.TPRank)
				if err != nil {
					return nil, nil, 0, err
				}
				for _, d := range targets {
					if err := pair(p, dst[d]); err != nil {
						return nil, nil, 0, err
					}
				}
			}
		} else {
			for _, d := range dst {
				sources, err := topology.TargetRanks(nil, tpDst, tpSrc, d.Layout.TPRank)
				if err != nil {
					return nil, nil, 0, err
				}
				for _, p := range sources {
					if err := pair(stage[p], d); err != nil {
						return nil, nil, 0, err
					}
				}
			}
		}
	}
	return notifsAtDst, notifsAtSrc, descs, nil
}
