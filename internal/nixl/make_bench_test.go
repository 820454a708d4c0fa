package nixl

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
)

// makeRig is two agents in this process, a region on each, and prepared
// lists of makeEntries entries of makeLen bytes at a stride of 2*makeLen
// (no two entries contiguous) over both regions.
type makeRig struct {
	a, b          *Agent
	peer          string
	src, dst      []byte
	local, remote Prepped
	// runLocal and runRemote are lists of makeEntries contiguous entries
	// (the kind "runs": consecutive indices, which NIXL may merge).
	runLocal, runRemote Prepped
}

const (
	makeEntries = 1 << 15
	makeLen     = 64
)

func newMakeRig(tb testing.TB) *makeRig {
	tb.Helper()
	suffix := fmt.Sprint(rand.Uint64())
	r := &makeRig{src: make([]byte, 2*makeLen*makeEntries), dst: make([]byte, 2*makeLen*makeEntries)}
	for i, name := range []string{"a-", "b-"} {
		ag, err := Open(name+suffix, "UCX", nil)
		if errors.Is(err, ErrUnavailable) {
			tb.Skipf("NIXL is not available here: %v", err)
		}
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { _ = ag.Close() })
		mem := r.src
		if i == 1 {
			r.b, mem = ag, r.dst
		} else {
			r.a = ag
		}
		if err := ag.Register([][3]uint64{{addr(mem), uint64(len(mem)), 0}}); err != nil {
			tb.Fatal(err)
		}
	}
	tb.Cleanup(func() { runtime.KeepAlive(r.src); runtime.KeepAlive(r.dst) })
	md, err := r.b.Metadata()
	if err != nil {
		tb.Fatal(err)
	}
	if r.peer, err = r.a.LoadPeer(md); err != nil {
		tb.Fatal(err)
	}
	le, re := make([][3]uint64, makeEntries), make([][3]uint64, makeEntries)
	for i := range le {
		le[i] = [3]uint64{addr(r.src) + uint64(i)*2*makeLen, makeLen, 0}
		re[i] = [3]uint64{addr(r.dst) + uint64(i)*2*makeLen, makeLen, 0}
	}
	if r.local, err = r.a.Prepare("", le); err != nil {
		tb.Fatal(err)
	}
	if r.remote, err = r.a.Prepare(r.peer, re); err != nil {
		tb.Fatal(err)
	}
	for i := range le {
		le[i][0], re[i][0] = addr(r.src)+uint64(i)*makeLen, addr(r.dst)+uint64(i)*makeLen
	}
	if r.runLocal, err = r.a.Prepare("", le); err != nil {
		tb.Fatal(err)
	}
	if r.runRemote, err = r.a.Prepare(r.peer, re); err != nil {
		tb.Fatal(err)
	}
	return r
}

// lists returns n scattered descriptors (every 7th entry, wrapping) and
// the same transfer as index pairs.
func (r *makeRig) lists(n int) ([][3]uint64, [][2]int32) {
	ds, ps := make([][3]uint64, n), make([][2]int32, n)
	for i := range n {
		e := (i * 7) % makeEntries
		ds[i] = [3]uint64{addr(r.src) + uint64(e)*2*makeLen, addr(r.dst) + uint64(e)*2*makeLen, makeLen}
		ps[i] = [2]int32{int32(e), int32(e)}
	}
	return ds, ps
}

func (r *makeRig) make(kind string, ds [][3]uint64, ps [][2]int32, notif []byte) (Xfer, error) {
	switch kind {
	case "onthefly":
		return r.a.Make(true, r.peer, ds, notif)
	case "runs":
		return r.a.MakePrepared(true, r.runLocal, r.runRemote, ps[:len(ps):len(ps)], notif)
	}
	return r.a.MakePrepared(true, r.local, r.remote, ps, notif)
}

// runPairs returns n consecutive index pairs from 0: one run of
// contiguous entries in the "runs" lists.
func runPairs(n int) [][2]int32 {
	ps := make([][2]int32, n)
	for i := range ps {
		ps[i] = [2]int32{int32(i), int32(i)}
	}
	return ps
}

// wait waits out a posted transfer.
func (r *makeRig) wait(tb testing.TB, x Xfer) {
	for {
		done, err := r.a.State(x)
		if err != nil {
			tb.Fatal(err)
		}
		if done {
			return
		}
	}
}

var makeSizes = []int{1, 16, 128, 1024, 4096, 16384}

// BenchmarkMake measures the creation of a transfer request alone (made,
// then released untimed; never posted) by descriptor or index-pair count,
// for NIXL's two request kinds: onthefly is create_xfer_req over fresh
// descriptor lists (Agent.Make: what Agent.Post creates), prepared is
// make_xfer_req over index pairs into prepared lists (Agent.MakePrepared),
// runs is prepared with consecutive pairs into lists of contiguous
// entries (one run).
func BenchmarkMake(b *testing.B) {
	for _, kind := range []string{"onthefly", "prepared", "runs"} {
		for _, n := range makeSizes {
			b.Run(fmt.Sprintf("%s/n=%d", kind, n), func(b *testing.B) {
				r := newMakeRig(b)
				ds, ps := r.lists(n)
				if kind == "runs" {
					ps = runPairs(n)
				}
				notif := []byte("done:0123456789abcdef")
				b.ReportAllocs()
				for b.Loop() {
					x, err := r.make(kind, ds, ps, notif)
					if err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					if err := r.a.Release(x); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/desc")
			})
		}
	}
}

// BenchmarkStart measures posting a made request (Agent.Start:
// post_xfer_req) of n 64-byte descriptors, made and, after the transfer,
// released untimed.
func BenchmarkStart(b *testing.B) {
	for _, kind := range []string{"onthefly", "prepared", "runs"} {
		for _, n := range makeSizes {
			b.Run(fmt.Sprintf("%s/n=%d", kind, n), func(b *testing.B) {
				r := newMakeRig(b)
				ds, ps := r.lists(n)
				if kind == "runs" {
					ps = runPairs(n)
				}
				notif := []byte("done:0123456789abcdef")
				b.ReportAllocs()
				for b.Loop() {
					b.StopTimer()
					x, err := r.make(kind, ds, ps, notif)
					if err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
					if err := r.a.Start(x); err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					r.wait(b, x)
					if err := r.a.Release(x); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/desc")
			})
		}
	}
}
