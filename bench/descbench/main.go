// Command descbench prints kvxfer's descriptor hot-path report: for each
// realistic model shape (bench/shapes) it times the optimised builder and
// a memory-write baseline that writes the same number of descriptors with
// no mapping logic, and shows descriptors per request, the coalescing
// ratio (reference descriptors per emitted descriptor), ns per descriptor,
// throughput, the share of the baseline reached and allocations.
//
// The recorded benchstat numbers live in bench/RESULTS.md; this command is
// the quick look.
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/bench/shapes"
	"github.com/kvxfer/kvxfer/hotpath"
)

func main() {
	filter := flag.String("shape", "", "only shapes whose name contains this substring")
	quick := flag.Bool("quick", false, "time each shape for 10ms instead of 60ms")
	flag.Parse()
	if err := run(*filter, *quick); err != nil {
		fmt.Fprintln(os.Stderr, "descbench:", err)
		os.Exit(1)
	}
}

// timeIt runs f until d has elapsed and returns ns per call and heap
// allocations per call.
func timeIt(d time.Duration, f func()) (ns, allocs float64) {
	f() // warm up: size scratch and output slices
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	n := 0
	start := time.Now()
	for time.Since(start) < d {
		for i := 0; i < 16; i++ {
			f()
		}
		n += 16
	}
	el := time.Since(start)
	runtime.ReadMemStats(&ms1)
	return float64(el.Nanoseconds()) / float64(n), float64(ms1.Mallocs-ms0.Mallocs) / float64(n)
}

func run(filter string, quick bool) error {
	all, err := shapes.All()
	if err != nil {
		return err
	}
	d := 60 * time.Millisecond
	if quick {
		d = 10 * time.Millisecond
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "shape\tdescs\tcoalesce\tns/desc\tMdesc/s\tbaseline ns/desc\t% of baseline\t% of uncoalesced baseline\tus/request\tallocs\t")
	worst := 100.0
	for _, s := range all {
		if filter != "" && !strings.Contains(s.Name, filter) {
			continue
		}
		b, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
		if err != nil {
			return err
		}
		ref, err := hotpath.AppendReference(nil, s.Plan, s.Req, hotpath.OpWrite)
		if err != nil {
			return err
		}
		dst := make([]hotpath.Desc, 0, len(ref))
		dst, err = b.AppendDescs(dst, s.Plan, s.Req)
		if err != nil {
			return err
		}
		n := len(dst)
		ns, allocs := timeIt(d, func() { dst, _ = b.AppendDescs(dst[:0], s.Plan, s.Req) })
		base := make([]hotpath.Desc, 0, n)
		bns, _ := timeIt(d, func() { base = shapes.WriteBaseline(base[:0], n, 4096) })
		pct := 100 * bns / ns
		worst = min(worst, pct)
		rbase := make([]hotpath.Desc, 0, len(ref))
		rns, _ := timeIt(d, func() { rbase = shapes.WriteBaseline(rbase[:0], len(ref), 4096) })
		fmt.Fprintf(tw, "%s\t%d\t%.0fx\t%.2f\t%.0f\t%.2f\t%.0f%%\t%.0f%%\t%.1f\t%.0f\t\n",
			s.Name, n, float64(len(ref))/float64(n), ns/float64(n), float64(n)/ns*1e3, bns/float64(n), pct, 100*rns/ns, ns/1e3, allocs)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Printf("\ncoalesce = reference (uncoalesced) descriptors per emitted descriptor; %% of baseline = baseline time / builder time\n"+
		"for the same number of descriptors (the memory-write limit); %% of uncoalesced baseline compares with writing the\n"+
		"reference's uncoalesced list. Lowest share of the same-count baseline this run: %.0f%%.\n", worst)
	return nil
}
