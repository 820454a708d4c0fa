package netxfer

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"slices"
)

// Layout transfers. A KV cache transfer moves the same blocks in every
// layer: L layers of n blocks are L·n pieces, but only L + n numbers
// (each layer's base pair, each block's offset pair) say which. PostLayout
// takes a transfer in that form and, where its local memory is GPU memory
// and the peer is on this host (the same-host path), sends it in that form
// too (tWriteLayout: a table of L + n entries, not L·n), so that neither
// side's CPU walks the pieces: the receiver checks each layer's span
// against its memory once and each block once against its grants
// (LayoutFence), and hands both lists to its GPU as one launch
// (LayoutBatch; internal/cuda's copy kernel computes each piece's
// addresses). Anywhere else (host memory, TCP, agents of one process, a
// READ) the layout is expanded into its pieces and posted as Post does.

// Layout is a transfer of every entry at every base pair: for base b and
// entry e, e.Len bytes between b.Local+e.Local and b.Remote+e.Remote.
type Layout struct {
	Bases   []BasePair
	Entries []LayoutEntry
}

// BasePair is a layout's pair of base addresses (a layer's, in KV terms).
type BasePair struct{ Local, Remote uint64 }

// LayoutEntry is a piece of a layout at offsets from each base pair (a
// block's, in KV terms).
type LayoutEntry struct{ Local, Remote, Len uint64 }

// LayoutSpan is one layout of a part as a Guard sees it: for each of
// Bases (addresses in the agent's memory) and each of Entries (offset and
// length from a base), the range [base+Addr, +Len).
type LayoutSpan struct {
	Bases   []uint64
	Entries []Region
}

// LayoutFence is a Fence that admits a layout part without its pieces
// being listed: it must decide exactly what Admit would for the ranges
// the layouts expand to (every entry at every base), in the time it
// takes to check each base and each entry rather than each pair. Agents
// whose fence is not one expand the layouts and call Admit.
type LayoutFence interface {
	Fence
	// AdmitLayout returns Allow and a ticket for Done, or the verdict on
	// the first piece refused (layout, base and entry indices; -1s: the
	// part as a whole).
	AdmitLayout(peer string, op Op, spans []LayoutSpan, tag []byte, abort func()) (v Verdict, lay, base, entry int, ticket uint64)
}

// DevRegion is a base pair of a layout staged on a GPU: device addresses
// in this process.
type DevRegion struct{ Dst, Src uint64 }

// DevEntry is an entry of a layout staged on a GPU: Len bytes from
// offset Src of each region's source to offset Dst of its destination.
type DevEntry struct{ Dst, Src, Len uint64 }

// LayoutBatch is a DevBatch that also takes layouts as they are (the
// copy kernel's regions and entries), so that staging one costs its bases
// plus its entries, not their product.
type LayoutBatch interface {
	DevBatch
	// AddLayout stages every entry at every region; false: no room,
	// nothing staged.
	AddLayout(regions []DevRegion, entries []DevEntry) bool
}

const (
	// tWriteLayout: a WRITE part as layouts (same-host, GPU memory):
	// the header as tWriteLocal with ndesc the table's length in bytes,
	// then the table: nlay u32 | nlay×(nbase u32, nent u32,
	// nbase×(remote u64, chunk u32, off u64), nent×(remote u64, local u64,
	// len u64)). A base's source is off (from its chunk's start, modulo
	// 2^64) plus each entry's local offset.
	tWriteLayout = 12
	// tWriteLayoutTable: as tWriteLayout, the table replaced by pos u64:
	// where it starts in the descriptor area's ring.
	tWriteLayoutTable = 13
	// tReadLayout: a READ part as layouts (same-host, into GPU memory):
	// xfer u64, part u32, table bytes u32, notif u32 | notif | the table
	// as tWriteLayout's (remote: the server's memory; chunk and off 0;
	// local: the client's, which the server ignores). The server answers
	// tReadLayoutLocal, or as it answers a READ of the pieces.
	tReadLayout = 14
	// tReadLayoutLocal: where each base's span lies in the server's
	// memory files: xfer u64, part u32, nlay u32 | nlay×(nbase u32,
	// nbase×(chunk u32, off u64)), off from the chunk's start to the
	// base (modulo 2^64).
	tReadLayoutLocal = 22

	layoutBaseSize  = 20
	layoutEntrySize = 24
	// maxLayouts bounds the layouts of one part; a part's pieces (bases
	// times entries, summed) are bounded by maxDescs, as a table's.
	maxLayouts     = 1 << 12
	maxLayoutTable = 4 + maxLayouts*8 + maxDescs*layoutEntrySize
	// maxLayoutOff bounds offsets and lengths on the wire (an agent's
	// memory is at most 2^46 bytes a chunk).
	maxLayoutOff = 1 << 47
)

// layoutPieces counts the pieces of lays, false past maxDescs.
func layoutPieces(lays []Layout) (int, bool) {
	if len(lays) > maxLayouts {
		return 0, false
	}
	n := 0
	for _, l := range lays {
		if len(l.Bases) > maxDescs || len(l.Entries) > maxDescs {
			return 0, false
		}
		n += len(l.Bases) * len(l.Entries)
		if n > maxDescs {
			return 0, false
		}
	}
	return n, true
}

// ExpandLayouts appends the descriptors lays stand for, base by base, to
// dst (entries of no bytes left out).
func ExpandLayouts(dst []Desc, lays []Layout) []Desc {
	for _, l := range lays {
		for _, b := range l.Bases {
			for _, e := range l.Entries {
				if e.Len > 0 {
					dst = append(dst, Desc{Local: b.Local + e.Local, Remote: b.Remote + e.Remote, Len: e.Len})
				}
			}
		}
	}
	return dst
}

// span returns the offsets [lo, hi) the entries of no bytes aside cover
// on one side (local: true for Local), and false when one is past
// maxLayoutOff; lo == hi when no entry has bytes.
func span(es []LayoutEntry, local bool) (lo, hi uint64, ok bool) {
	lo = ^uint64(0)
	for _, e := range es {
		if e.Len == 0 {
			continue
		}
		off := e.Remote
		if local {
			off = e.Local
		}
		if off > maxLayoutOff || e.Len > maxLayoutOff {
			return 0, 0, false
		}
		lo, hi = min(lo, off), max(hi, off+e.Len)
	}
	if hi == 0 {
		return 0, 0, true
	}
	return lo, hi, true
}

// spans is span of es's local and remote offsets in one walk, false
// when either side has an offset past maxLayoutOff.
func spans(es []LayoutEntry) (local, remote [2]uint64, ok bool) {
	llo, rlo := ^uint64(0), ^uint64(0)
	var lhi, rhi uint64
	for _, e := range es {
		if e.Len == 0 {
			continue
		}
		if e.Local > maxLayoutOff || e.Remote > maxLayoutOff || e.Len > maxLayoutOff {
			return local, remote, false
		}
		llo, lhi = min(llo, e.Local), max(lhi, e.Local+e.Len)
		rlo, rhi = min(rlo, e.Remote), max(rhi, e.Remote+e.Len)
	}
	if lhi == 0 {
		llo = 0
	}
	if rhi == 0 {
		rlo = 0
	}
	return [2]uint64{llo, lhi}, [2]uint64{rlo, rhi}, true
}

// PostLayout posts a transfer of layouts (see Layout): as Post of
// ExpandLayouts(nil, lays), and on the same-host path from GPU memory in
// the layouts' own form (to a peer that takes it: layoutsMark). Each base's local span (its entries' extent) is
// checked before PostLayout returns.
func (a *Agent) PostLayout(op Op, name string, lays []Layout, notif []byte) (XferID, error) {
	if _, ok := layoutPieces(lays); !ok {
		return 0, fmt.Errorf("netxfer: post layouts: more than %d layouts or %d pieces", maxLayouts, maxDescs)
	}
	if op != Write && op != Read {
		return 0, fmt.Errorf("netxfer: post op %d", op)
	}
	if len(notif) > maxNotif {
		return 0, fmt.Errorf("netxfer: post: %d notification bytes exceed %d", len(notif), maxNotif)
	}
	p, err := a.peer(name)
	if err != nil {
		return 0, err
	}
	if p.local != nil || !p.layouts || !a.layoutOnDevice(lays) {
		return a.PostOwned(op, name, ExpandLayouts(nil, lays), notif)
	}
	x := &xfer{op: op, peer: p, notif: slices.Clone(notif), state: InProgress, device: true, layouts: make([]Layout, len(lays))}
	for i, l := range lays {
		x.layouts[i] = Layout{Bases: slices.Clone(l.Bases), Entries: slices.Clone(l.Entries)}
	}
	a.mu.Lock()
	a.recordLocked(x)
	a.mu.Unlock()
	if a.startOneSided(x) {
		return x.id, nil
	}
	if err := a.goStart(x); err != nil {
		return 0, err
	}
	return x.id, nil
}

// layoutOnDevice reports whether every base's local span lies in one
// registered region of GPU memory (false: the layouts go as pieces,
// which checks each).
func (a *Agent) layoutOnDevice(lays []Layout) bool {
	a.memMu.RLock()
	defer a.memMu.RUnlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return false
	}
	var c regionCursor
	bytes := false
	for _, l := range lays {
		ls, _, ok := spans(l.Entries)
		if !ok {
			return false
		}
		lo, hi := ls[0], ls[1]
		if lo == hi {
			continue
		}
		for _, b := range l.Bases {
			at := b.Local + lo
			if at < b.Local || !c.inside(a, at, hi-lo) {
				return false
			}
			ch := a.chunkLocked(at)
			if ch == nil || ch.dev == nil || at-ch.base+(hi-lo) > ch.size {
				return false
			}
			bytes = true
		}
	}
	return bytes
}

// layoutTableLen is the bytes of lays' table in a layout part: their
// count, then per layout its counts, bases and entries.
func layoutTableLen(lays []Layout) int {
	n := 4
	for _, l := range lays {
		n += 8 + layoutBaseSize*len(l.Bases) + layoutEntrySize*len(l.Entries)
	}
	return n
}

// appendLayoutEntries appends a layout part's entries: the receiver's
// offset, the sender's, the length.
func appendLayoutEntries(h []byte, es []LayoutEntry) []byte {
	for _, e := range es {
		h = binary.LittleEndian.AppendUint64(h, e.Remote)
		h = binary.LittleEndian.AppendUint64(h, e.Local)
		h = binary.LittleEndian.AppendUint64(h, e.Len)
	}
	return h
}

// sendLayoutLocal sends a layout WRITE on a same-host connection; false
// (nothing sent) if a base's memory cannot be passed (the caller sends
// the pieces instead).
func (a *Agent) sendLayoutLocal(c *conn, x *xfer) (bool, error) {
	tl := layoutTableLen(x.layouts)
	if tl > maxLayoutTable {
		return false, nil
	}
	h := make([]byte, 0, 25+len(x.notif)+tl)
	h = appendWriteHeader(h, tWriteLayout, x, 0, tl)
	hl := len(h)
	a.memMu.RLock()
	defer a.memMu.RUnlock()
	a.mu.Lock()
	var m refMaker
	h = binary.LittleEndian.AppendUint32(h, uint32(len(x.layouts)))
	for _, l := range x.layouts {
		lo, hi, _ := span(l.Entries, true)
		h = binary.LittleEndian.AppendUint32(h, uint32(len(l.Bases)))
		h = binary.LittleEndian.AppendUint32(h, uint32(len(l.Entries)))
		for _, b := range l.Bases {
			var ref localRef
			if hi > lo {
				r, ok := m.ref(a, b.Local+lo, hi-lo)
				if !ok {
					a.mu.Unlock()
					return false, nil
				}
				ref = localRef{r.chunk, r.off - lo}
			}
			h = binary.LittleEndian.AppendUint64(h, b.Remote)
			h = binary.LittleEndian.AppendUint32(h, ref.chunk)
			h = binary.LittleEndian.AppendUint64(h, ref.off)
		}
		h = appendLayoutEntries(h, l.Entries)
	}
	need := m.need
	a.mu.Unlock()
	return true, c.sendPart(need, h, hl, tWriteLayoutTable)
}

// wireLayout is a layout part's layout as the receiver parsed it.
type wireLayout struct {
	bases  []wireBase
	ents   []DevEntry // Dst: the remote (this agent's) offset, Src: the sender's
	dspan  [2]uint64  // [lo, hi) of the entries' offsets here
	sspan  [2]uint64  // and in the sender's memory
	pieces int
}

type wireBase struct {
	dst uint64 // this agent's base
	ref localRef
}

// layoutScratch is a connection's reused parse of layout parts.
type layoutScratch struct {
	lays  []wireLayout
	spans []LayoutSpan
	regs  []DevRegion
	offs  []Region
	addrs []uint64
}

// parseLayouts parses a layout table into s.lay (reusing its buffers).
func (s *localServer) parseLayouts(tab []byte) ([]wireLayout, error) {
	bad := func(what string, args ...any) ([]wireLayout, error) {
		return nil, fmt.Errorf("%w: layout table: %s", ErrProtocol, fmt.Sprintf(what, args...))
	}
	if len(tab) < 4 {
		return bad("%d bytes", len(tab))
	}
	n := binary.LittleEndian.Uint32(tab)
	tab = tab[4:]
	if n > maxLayouts {
		return bad("%d layouts, over %d", n, maxLayouts)
	}
	lays := s.lay.lays[:0]
	pieces := 0
	for i := range int(n) {
		if len(tab) < 8 {
			return bad("layout %d: truncated", i)
		}
		nb, ne := binary.LittleEndian.Uint32(tab), binary.LittleEndian.Uint32(tab[4:])
		tab = tab[8:]
		if uint64(len(tab)) < uint64(nb)*layoutBaseSize+uint64(ne)*layoutEntrySize {
			return bad("layout %d: %d bases and %d entries, %d bytes left", i, nb, ne, len(tab))
		}
		if nb > 0 && ne > 0 && uint64(nb)*uint64(ne) > uint64(maxDescs-pieces) {
			return bad("layout %d: %d bases x %d entries: more than %d pieces in the part", i, nb, ne, maxDescs)
		}
		if len(lays) < cap(lays) {
			lays = lays[:len(lays)+1]
		} else {
			lays = append(lays, wireLayout{})
		}
		l := &lays[len(lays)-1]
		l.bases, l.ents = l.bases[:0], l.ents[:0]
		for range nb {
			l.bases = append(l.bases, wireBase{dst: binary.LittleEndian.Uint64(tab),
				ref: localRef{binary.LittleEndian.Uint32(tab[8:]), binary.LittleEndian.Uint64(tab[12:])}})
			tab = tab[layoutBaseSize:]
		}
		l.dspan, l.sspan = [2]uint64{^uint64(0), 0}, [2]uint64{^uint64(0), 0}
		for j := range ne {
			e := DevEntry{Dst: binary.LittleEndian.Uint64(tab), Src: binary.LittleEndian.Uint64(tab[8:]), Len: binary.LittleEndian.Uint64(tab[16:])}
			tab = tab[layoutEntrySize:]
			if e.Dst > maxLayoutOff || e.Src > maxLayoutOff || e.Len > maxLayoutOff {
				return bad("layout %d entry %d: offsets %d and %d, %d bytes (over 2^47)", i, j, e.Dst, e.Src, e.Len)
			}
			if e.Len == 0 {
				continue
			}
			l.ents = append(l.ents, e)
			l.dspan = [2]uint64{min(l.dspan[0], e.Dst), max(l.dspan[1], e.Dst+e.Len)}
			l.sspan = [2]uint64{min(l.sspan[0], e.Src), max(l.sspan[1], e.Src+e.Len)}
		}
		if len(l.ents) == 0 {
			l.dspan, l.sspan = [2]uint64{}, [2]uint64{}
		}
		l.pieces = len(l.bases) * len(l.ents)
		pieces += l.pieces
	}
	if len(tab) != 0 {
		return bad("%d bytes past its layouts", len(tab))
	}
	s.lay.lays = lays
	return lays, nil
}

// expandLayouts appends the ranges (in this agent's memory) and refs (in
// the sender's) of the pieces of lays.
func expandLayouts(ranges []Region, refs []localRef, lays []wireLayout) ([]Region, []localRef) {
	for i := range lays {
		l := &lays[i]
		for _, b := range l.bases {
			for _, e := range l.ents {
				ranges = append(ranges, Region{b.dst + e.Dst, e.Len})
				refs = append(refs, localRef{b.ref.chunk, b.ref.off + e.Src})
			}
		}
	}
	return ranges, refs
}

// readLayouts reads a layout part's table of n bytes (inline, or from the
// descriptor area when inArea) and parses it, counting the part.
func (a *Agent) readLayouts(s *localServer, r *scatterReader, hdr []byte, n int, inArea bool) ([]wireLayout, error) {
	tab, err := a.readTable(s, r, hdr, n, inArea)
	if err != nil {
		return nil, err
	}
	lays, err := s.parseLayouts(tab)
	if err != nil {
		return nil, err
	}
	a.layoutParts.Add(1)
	return lays, nil
}

// serveWriteLayout lands one layout WRITE part (tWriteLayout).
func (a *Agent) serveWriteLayout(s *localServer, r *scatterReader, w *bufio.Writer, from string, hdr []byte, inArea bool) error {
	h, err := readWriteHeader(r, hdr)
	if err != nil {
		return err
	}
	a.wire(WirePartRead, XferID(h.id), h.part)
	if h.n > maxLayoutTable || h.parts != 1 {
		return fmt.Errorf("%w: a layout part of %d table bytes, part %d of %d", ErrProtocol, h.n, h.part, h.parts)
	}
	lays, err := a.readLayouts(s, r, hdr, int(h.n), inArea)
	if err != nil {
		return err
	}
	if err := a.landingRoom(session{from, s.inc}, h); err != nil {
		return err
	}
	// Admitted as layouts where the fence can (each base, each entry),
	// else piece by piece.
	var v Verdict
	var ticket uint64
	var berr error
	// Expanded pieces reuse the connection's buffers (kept up to
	// keepScratch pieces, as the tables of pieces are).
	if cap(s.ranges) > keepScratch || cap(s.refs) > keepScratch {
		s.ranges, s.refs = nil, nil
	}
	ranges, refs := s.ranges[:0], s.refs[:0]
	expanded := false
	if f, ok := a.layoutFence(); ok {
		var li, bi, ei int
		v, li, bi, ei, ticket = f.AdmitLayout(from, Write, s.layoutSpans(lays), h.notif, nil)
		if v != Allow {
			a.refusals[min(v, Deny)].Add(1)
			berr = fmt.Errorf("%w: write into layout %d base %d entry %d of %s by %s", ErrNotGranted, li, bi, ei, a.cfg.Name, from)
			if li < 0 || li >= len(lays) || bi < 0 || bi >= len(lays[li].bases) || ei < 0 || ei >= len(lays[li].ents) {
				berr = fmt.Errorf("%w: a layout part of %s by %s, for a request its grants are not for", ErrNotGranted, a.cfg.Name, from)
			}
		}
	} else {
		ranges, refs = expandLayouts(ranges, refs, lays)
		expanded = true
		v, ticket, berr = a.admitGuard(from, Write, ranges, h.notif, nil)
	}
	if v == Deny {
		return berr
	}
	return a.landLocal(s, w, from, h, v, ticket, berr, func() (bool, []DevCopy, error) {
		return a.deviceLayout(s, lays)
	}, func() ([]Region, []localRef) {
		if !expanded {
			ranges, refs = expandLayouts(ranges, refs, lays)
		}
		s.ranges, s.refs = ranges, refs
		return ranges, refs
	})
}

// layoutFence returns the agent's guard as a LayoutFence, or true with
// nil when there is no guard (nothing to admit).
func (a *Agent) layoutFence() (LayoutFence, bool) {
	b := a.guard.Load()
	if b == nil {
		return openFence{}, true
	}
	f, ok := b.g.(LayoutFence)
	return f, ok
}

// openFence admits everything (an agent without a guard).
type openFence struct{}

func (openFence) Check(string, Op, uint64, uint64) Verdict { return Allow }
func (openFence) Admit(string, Op, []Region, []byte, func()) (Verdict, int, uint64) {
	return Allow, -1, 0
}
func (openFence) AdmitLayout(string, Op, []LayoutSpan, []byte, func()) (Verdict, int, int, int, uint64) {
	return Allow, -1, -1, -1, 0
}
func (openFence) Done(uint64) {}

// deviceLayout posts a layout part whose every base lies in this agent's
// GPU memory on one device that takes layouts, and in a peer's GPU memory
// imported there, as one batch of its layouts as they are. Each base's
// span (its entries' extent) is checked against the memory it lies in:
// every piece lies within it. It reports false, having posted nothing,
// for any other part (the caller expands it and takes the general
// path, which says what is wrong with it, if anything). Callers hold
// memMu for reading.
func (a *Agent) deviceLayout(s *localServer, lays []wireLayout) (bool, []DevCopy, error) {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return false, nil, ErrClosed
	}
	var c regionCursor
	var dev BatchDevice
	var lb LayoutBatch
	giveUp := func() (bool, []DevCopy, error) {
		a.mu.Unlock()
		if lb != nil {
			lb.Discard()
		}
		return false, nil, nil
	}
	for i := range lays {
		l := &lays[i]
		if len(l.ents) == 0 || len(l.bases) == 0 {
			continue
		}
		regs := s.lay.regs[:0]
		dn, sn := l.dspan[1]-l.dspan[0], l.sspan[1]-l.sspan[0]
		for _, b := range l.bases {
			at := b.dst + l.dspan[0]
			if at < b.dst || at+dn < at || !c.inside(a, at, dn) {
				return giveUp()
			}
			ch := a.chunkLocked(at)
			if ch == nil || ch.dev == nil || at-ch.base+dn > ch.size {
				return giveUp()
			}
			bd, ok := ch.dev.(BatchDevice)
			if !ok || dev != nil && bd != dev {
				return giveUp()
			}
			d := s.devs[b.ref.chunk]
			if d == nil {
				return giveUp()
			}
			from, ok := d.at(ch.dev)
			if !ok {
				return giveUp()
			}
			s0 := b.ref.off + l.sspan[0]
			if s0 < b.ref.off || s0 > d.size || sn > d.size-s0 {
				return giveUp()
			}
			if dev == nil {
				dev = bd
				nb, err := dev.NewBatch(len(lays[i].ents))
				if err != nil {
					a.mu.Unlock()
					return true, nil, fmt.Errorf("%w: GPU copy of a layout: %w", ErrXferFailed, err)
				}
				if lb, ok = nb.(LayoutBatch); !ok {
					nb.Discard()
					return giveUp()
				}
			}
			regs = append(regs, DevRegion{Dst: b.dst, Src: from + b.ref.off})
		}
		s.lay.regs = regs
		if !lb.AddLayout(regs, l.ents) {
			a.mu.Unlock()
			lb.Discard()
			return true, nil, fmt.Errorf("%w: GPU copy: a batch refused layout %d (%d bases, %d entries)", ErrXferFailed, i, len(regs), len(l.ents))
		}
	}
	a.mu.Unlock()
	if lb == nil {
		return false, nil, nil // no bytes on a GPU: the general path
	}
	cp, err := lb.Post()
	if err != nil {
		return true, nil, fmt.Errorf("%w: GPU copy of a layout: %w", ErrXferFailed, err)
	}
	return true, []DevCopy{cp}, nil
}

// sendReadLayout sends a layout READ on a same-host connection (false,
// nothing sent, when its table is too long: the caller sends the pieces);
// the server answers as layouts or piece by piece.
func (a *Agent) sendReadLayout(c *conn, x *xfer) (bool, error) {
	tl := layoutTableLen(x.layouts)
	if tl > maxLayoutTable {
		return false, nil
	}
	h := make([]byte, 0, 21+len(x.notif)+tl)
	h = append(h, tReadLayout)
	h = binary.LittleEndian.AppendUint64(h, uint64(x.id))
	h = binary.LittleEndian.AppendUint32(h, 0)
	h = binary.LittleEndian.AppendUint32(h, uint32(tl))
	h = binary.LittleEndian.AppendUint32(h, uint32(len(x.notif)))
	h = append(h, x.notif...)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(x.layouts)))
	for _, l := range x.layouts {
		h = binary.LittleEndian.AppendUint32(h, uint32(len(l.Bases)))
		h = binary.LittleEndian.AppendUint32(h, uint32(len(l.Entries)))
		for _, b := range l.Bases {
			h = binary.LittleEndian.AppendUint64(h, b.Remote)
			h = binary.LittleEndian.AppendUint32(h, 0)
			h = binary.LittleEndian.AppendUint64(h, 0)
		}
		h = appendLayoutEntries(h, l.Entries)
	}
	return true, c.writeFrame(h)
}

// serveReadLayout answers a layout READ part (tReadLayout): admitted as
// layouts where the guard can, each base's span checked against this
// agent's memory, and answered with where each base lies in its memory
// files (tReadLayoutLocal); where a span lies in memory without a file,
// piece by piece, as serveRead answers.
func (a *Agent) serveReadLayout(s *localServer, r *scatterReader, w *bufio.Writer, from string, hdr []byte) error {
	if err := readFull(r, hdr[:20]); err != nil {
		return err
	}
	id := binary.LittleEndian.Uint64(hdr[:8])
	part := binary.LittleEndian.Uint32(hdr[8:12])
	n := binary.LittleEndian.Uint32(hdr[12:16])
	nl := binary.LittleEndian.Uint32(hdr[16:20])
	if n > maxLayoutTable || nl > maxNotif || part != 0 {
		return fmt.Errorf("%w: a layout read part %d of %d table bytes, notification %d bytes", ErrProtocol, part, n, nl)
	}
	tag := make([]byte, nl)
	if err := readFull(r, tag); err != nil {
		return err
	}
	if nl == 0 {
		tag = nil
	}
	lays, err := a.readLayouts(s, r, hdr, int(n), false)
	if err != nil {
		return err
	}
	if cap(s.ranges) > keepScratch {
		s.ranges = nil
	}
	ranges := s.ranges[:0]
	var v Verdict
	var ticket uint64
	var berr error
	var hr *heldRead
	var abort func()
	if s.acks {
		hr, abort = a.readAbort(s, nil)
	}
	if f, ok := a.layoutFence(); ok {
		var li, bi, ei int
		v, li, bi, ei, ticket = f.AdmitLayout(from, Read, s.layoutSpans(lays), tag, abort)
		if v != Allow {
			a.refusals[min(v, Deny)].Add(1)
			berr = fmt.Errorf("%w: read of layout %d base %d entry %d of %s by %s", ErrNotGranted, li, bi, ei, a.cfg.Name, from)
		}
	} else {
		ranges, _ = expandLayouts(ranges, nil, lays)
		v, ticket, berr = a.admitGuard(from, Read, ranges, tag, abort)
	}
	if v == Deny {
		return berr
	}
	defer func() {
		if !s.isHeld(hr) { // else it ends with the client's acknowledgement
			a.releaseGuard(ticket) // after the answer went out
		}
	}()
	a.memMu.RLock()
	defer a.memMu.RUnlock()
	k := partKey{XferID(id), part}
	if berr == nil {
		// Where the bytes lie, for the client to copy, to a client that
		// acknowledges its copies; to another, the bytes themselves.
		if hr != nil {
			if h, need, ok := a.layoutRefs(lays, id, part); ok {
				return a.sendLocalAnswer(s, w, h, need, k, hr, ticket)
			}
		}
		// Not every span lies in one memory file: piece by piece.
		if len(ranges) == 0 {
			ranges, _ = expandLayouts(ranges, nil, lays)
		}
		s.ranges = ranges
		s.dst, berr = a.targets(s.dst[:0], ranges)
		clear(s.dst)
		if berr == nil && hr != nil {
			if done, err := a.answerReadLocal(s, w, k, ranges, hr, ticket); done {
				return err
			}
		}
		if berr == nil {
			var bufs [][]byte
			if bufs, berr = a.resolve(nil, ranges); berr == nil {
				if err := answer(w, tReadResp, id, part, nil); err != nil {
					return err
				}
				if err := w.Flush(); err != nil {
					return err
				}
				nb := net.Buffers(bufs)
				_, err := nb.WriteTo(s.c)
				return err
			}
		}
	}
	return answerReadRefused(w, v, id, part, berr)
}

// layoutSpans is lays as a LayoutFence sees them (in s's scratch).
func (s *localServer) layoutSpans(lays []wireLayout) []LayoutSpan {
	sp := s.lay.spans[:0]
	addrs, offs := s.lay.addrs[:0], s.lay.offs[:0]
	for i := range lays {
		l := &lays[i]
		a0 := len(addrs)
		for _, b := range l.bases {
			addrs = append(addrs, b.dst)
		}
		o0 := len(offs)
		for _, e := range l.ents {
			offs = append(offs, Region{e.Dst, e.Len})
		}
		sp = append(sp, LayoutSpan{Bases: addrs[a0:len(addrs):len(addrs)], Entries: offs[o0:len(offs):len(offs)]})
	}
	s.lay.spans, s.lay.addrs, s.lay.offs = sp, addrs, offs
	return sp
}

// layoutRefs returns the tReadLayoutLocal answer for lays (bases in this
// agent's memory; each base's span checked to lie in registered memory
// and in one memory file) and the files it names; false where a span
// does not (the caller answers piece by piece). Callers hold memMu for
// reading.
func (a *Agent) layoutRefs(lays []wireLayout, id uint64, part uint32) ([]byte, []*chunk, bool) {
	n := 17
	for i := range lays {
		n += 4 + localRefSize*len(lays[i].bases)
	}
	h := make([]byte, 0, n)
	h = append(h, tReadLayoutLocal)
	h = binary.LittleEndian.AppendUint64(h, id)
	h = binary.LittleEndian.AppendUint32(h, part)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(lays)))
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return nil, nil, false
	}
	var c regionCursor
	var m refMaker
	for i := range lays {
		l := &lays[i]
		h = binary.LittleEndian.AppendUint32(h, uint32(len(l.bases)))
		dn := l.dspan[1] - l.dspan[0]
		for _, b := range l.bases {
			var ref localRef
			if dn > 0 {
				at := b.dst + l.dspan[0]
				if at < b.dst || at+dn < at || !c.inside(a, at, dn) {
					return nil, nil, false
				}
				r, ok := m.ref(a, at, dn)
				if !ok {
					return nil, nil, false
				}
				ref = localRef{r.chunk, r.off - l.dspan[0]}
			}
			h = binary.LittleEndian.AppendUint32(h, ref.chunk)
			h = binary.LittleEndian.AppendUint64(h, ref.off)
		}
	}
	return h, m.need, true
}

// readLayoutLocal lands a tReadLayoutLocal answer: the layouts copied out
// of the server's memory (passed on this connection) into the
// transfer's GPU memory here as one batch of the layouts as they are
// (deviceLayout, as a layout WRITE's receiver does), or piece by piece
// where that cannot be (landRead).
func (c *conn) readLayoutLocal(hdr []byte) error {
	if err := readFull(c.r, hdr[:16]); err != nil {
		return err
	}
	id := XferID(binary.LittleEndian.Uint64(hdr[:8]))
	part := binary.LittleEndian.Uint32(hdr[8:12])
	nlay := binary.LittleEndian.Uint32(hdr[12:16])
	if nlay > maxLayouts {
		return fmt.Errorf("%w: a layout read answer of %d layouts", ErrProtocol, nlay)
	}
	refs := make([][]localRef, nlay)
	bases := 0
	for i := range refs {
		if err := readFull(c.r, hdr[:4]); err != nil {
			return err
		}
		nb := int(binary.LittleEndian.Uint32(hdr[:4]))
		if bases += nb; bases > maxDescs {
			return fmt.Errorf("%w: a layout read answer of more than %d bases", ErrProtocol, maxDescs)
		}
		tab := make([]byte, localRefSize*nb)
		if err := readFull(c.r, tab); err != nil {
			return err
		}
		refs[i] = make([]localRef, nb)
		for j := range refs[i] {
			e := tab[localRefSize*j:]
			refs[i][j] = localRef{binary.LittleEndian.Uint32(e), binary.LittleEndian.Uint64(e[4:])}
		}
	}
	x := c.take(partKey{id, part})
	if x == nil {
		c.ackRead(id, part) // released or failed meanwhile: nothing to copy
		return nil
	}
	lays, err := c.in.answeredLayouts(x.layouts, refs)
	if err != nil {
		return c.lost(x, err)
	}
	return c.landRead(x, part, lays, func() ([]Region, []localRef) { return expandLayouts(nil, nil, lays) })
}

// answeredLayouts is a layout READ's layouts as a WRITE's receiver sees
// them (in s's scratch): bases here and where the server says they lie,
// entries by their offsets here and there. An answer that does not match
// what was asked is a protocol error.
func (s *localServer) answeredLayouts(asked []Layout, refs [][]localRef) ([]wireLayout, error) {
	if len(asked) != len(refs) {
		return nil, fmt.Errorf("%w: a layout read answer of %d layouts for a transfer of %d", ErrProtocol, len(refs), len(asked))
	}
	lays := s.lay.lays[:0]
	for i, l := range asked {
		if len(refs[i]) != len(l.Bases) {
			return nil, fmt.Errorf("%w: layout %d answered with %d bases, asked with %d", ErrProtocol, i, len(refs[i]), len(l.Bases))
		}
		if len(lays) < cap(lays) {
			lays = lays[:len(lays)+1]
		} else {
			lays = append(lays, wireLayout{})
		}
		w := &lays[len(lays)-1]
		w.bases, w.ents = w.bases[:0], w.ents[:0]
		for j, b := range l.Bases {
			w.bases = append(w.bases, wireBase{dst: b.Local, ref: refs[i][j]})
		}
		w.dspan, w.sspan = [2]uint64{^uint64(0), 0}, [2]uint64{^uint64(0), 0}
		for _, e := range l.Entries {
			if e.Len == 0 {
				continue
			}
			w.ents = append(w.ents, DevEntry{Dst: e.Local, Src: e.Remote, Len: e.Len})
			// Offsets and lengths are under 2^47 (layoutOnDevice): no
			// span wraps.
			w.dspan = [2]uint64{min(w.dspan[0], e.Local), max(w.dspan[1], e.Local+e.Len)}
			w.sspan = [2]uint64{min(w.sspan[0], e.Remote), max(w.sspan[1], e.Remote+e.Len)}
		}
		if len(w.ents) == 0 {
			w.dspan, w.sspan = [2]uint64{}, [2]uint64{}
		}
		w.pieces = len(w.bases) * len(w.ents)
	}
	s.lay.lays = lays
	return lays, nil
}
