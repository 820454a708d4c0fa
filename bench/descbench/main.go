// Command descbench prints kvxfer's descriptor hot-path report: for each
// realistic model shape (bench/shapes) it times the optimised builder and
// a memory-write baseline that writes the same number of descriptors with
// no mapping logic, and shows descriptors per request, the coalescing
// ratio (reference descriptors per emitted descriptor), ns per descriptor,
// throughput, the share of the baseline reached and allocations.
//
// The recorded benchstat numbers live in bench/RESULTS.md; this command is
// the quick look. With -from it times nothing and instead summarises a
// file of `go test -bench` output (BenchmarkAppendDescs, BenchmarkBaseline
// and BenchmarkBaselineUncoalesced over the same shapes) as the markdown
// table recorded in bench/RESULTS.md, taking the median of each metric.
//
// Usage:
//
//	go run ./bench/descbench [-shape substring] [-quick]
//	go run ./bench/descbench -from bench/results/hotpath-bench.txt
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/bench/shapes"
	"github.com/kvxfer/kvxfer/hotpath"
)

func main() {
	filter := flag.String("shape", "", "only shapes whose name contains this substring")
	quick := flag.Bool("quick", false, "time each shape for 10ms instead of 60ms")
	from := flag.String("from", "", "summarise this file of go test -bench output instead of timing")
	flag.Parse()
	var err error
	if *from != "" {
		err = summarise(*from, *filter)
	} else {
		err = run(*filter, *quick)
	}
	if err != nil {
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
	all = slices.DeleteFunc(all, func(s *shapes.Shape) bool { return !strings.Contains(s.Name, filter) })
	if len(all) == 0 {
		return fmt.Errorf("no shape name contains %q", filter)
	}
	d := 60 * time.Millisecond
	if quick {
		d = 10 * time.Millisecond
	}
	fmt.Printf("descbench: %s %s/%s, %d CPUs; %v per measurement\n\n", runtime.Version(), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), d)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "shape\tdescs\tunits\tcoalesce\tns/desc\tMpairs/s\tus/request\tbaseline ns/desc\t% of baseline\t% of uncoalesced baseline\tallocs\t")
	worstFrag, worstFresh := 1e9, 1e9
	for _, s := range all {
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
		rbase := make([]hotpath.Desc, 0, len(ref))
		rns, _ := timeIt(d, func() { rbase = shapes.WriteBaseline(rbase[:0], len(ref), 4096) })
		pct, rpct := 100*bns/ns, 100*rns/ns
		if s.Fragmented {
			worstFrag = min(worstFrag, pct)
		} else {
			// Coalesced fresh lists are measured against writing the
			// uncoalesced list (see the note printed below).
			worstFresh = min(worstFresh, max(pct, rpct))
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.0fx\t%.2f\t%.0f\t%.2f\t%.2f\t%.0f%%\t%.0f%%\t%.0f\t\n",
			s.Name, n, len(ref), float64(len(ref))/float64(n), ns/float64(n), float64(n)/ns*1e3, ns/1e3,
			bns/float64(n), pct, rpct, allocs)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Print(`
descs = descriptor pairs the builder emits; units = the reference's (uncoalesced) count; coalesce = units/descs.
Mpairs/s = descriptor pairs built per second. % of baseline = time to write the same number of descriptors
with no mapping logic (shapes.WriteBaseline, the memory-write limit) / builder time; % of uncoalesced
baseline = the same for writing the reference's list (the honest comparison for coalesced fresh ids, where
the builder must still read every block id to emit a handful of descriptors).
`)
	if worstFrag < 1e9 {
		fmt.Printf("Lowest share this run: fragmented %.0f%% of the same-count baseline", worstFrag)
	}
	if worstFresh < 1e9 {
		if worstFrag < 1e9 {
			fmt.Print("; ")
		} else {
			fmt.Print("Lowest share this run: ")
		}
		fmt.Printf("fresh %.0f%% of the larger of the two baselines", worstFresh)
	}
	fmt.Println(" (goal: 50%; timings on a loaded machine are noisy, see bench/RESULTS.md).")
	return nil
}

// benchLine matches one result line of the hot-path benchmarks.
var benchLine = regexp.MustCompile(`^Benchmark(AppendDescs|BaselineUncoalesced|Baseline)/(\S+?)(-\d+)?\s+\d+\s+(.*)$`)

// summarise prints the markdown summary table of a benchmark output file:
// per shape, the median of every metric over the file's runs.
func summarise(path, filter string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	// metrics[bench][shape][unit] lists the values seen.
	metrics := map[string]map[string]map[string][]float64{}
	var order []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		m := benchLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		bench, shape := m[1], m[2]
		if filter != "" && !strings.Contains(shape, filter) {
			continue
		}
		if metrics[bench] == nil {
			metrics[bench] = map[string]map[string][]float64{}
		}
		if metrics[bench][shape] == nil {
			metrics[bench][shape] = map[string][]float64{}
			if bench == "AppendDescs" {
				order = append(order, shape)
			}
		}
		fields := strings.Fields(m[4])
		for i := 0; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				return fmt.Errorf("%s: %q: %w", path, sc.Text(), err)
			}
			metrics[bench][shape][fields[i+1]] = append(metrics[bench][shape][fields[i+1]], v)
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if len(order) == 0 {
		return fmt.Errorf("%s: no BenchmarkAppendDescs results", path)
	}
	med := func(bench, shape, unit string) float64 {
		v := slices.Clone(metrics[bench][shape][unit])
		if len(v) == 0 {
			return 0
		}
		slices.Sort(v)
		if len(v)%2 == 1 {
			return v[len(v)/2]
		}
		return (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	runs := len(metrics["AppendDescs"][order[0]]["ns/op"])
	fmt.Printf("Medians of %d runs per benchmark from %s.\n\n", runs, path)
	fmt.Println("| shape | descs/op | units/op | coalescing | builder ns/op | ns/desc | Mpairs/s | baseline (same count) ns/op | % of it | baseline (uncoalesced) ns/op | % of it | allocs/op |")
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	type miss struct {
		shape string
		pct   float64
	}
	var misses []miss
	met := 0
	for _, shape := range order {
		ns := med("AppendDescs", shape, "ns/op")
		descs := med("AppendDescs", shape, "descs/op")
		units := med("AppendDescs", shape, "units/op")
		base := med("Baseline", shape, "ns/op")
		ubase := med("BaselineUncoalesced", shape, "ns/op")
		pct, upct := 100*base/ns, 100*ubase/ns
		fmt.Printf("| %s | %.0f | %.0f | %.0fx | %s | %.2f | %.0f | %s | %.0f%% | %s | %.0f%% | %.0f |\n",
			shape, descs, units, units/descs, thousands(ns), ns/descs, descs/ns*1e3,
			thousands(base), pct, thousands(ubase), upct, med("AppendDescs", shape, "allocs/op"))
		// The goal reads against the same-count baseline; for coalesced
		// fresh lists (a handful of descriptors for hundreds of ids) the
		// comparison is with writing the uncoalesced list.
		goal := pct
		if !strings.HasSuffix(shape, "/frag") && units > descs {
			goal = upct
		}
		if goal >= 50 {
			met++
		} else {
			misses = append(misses, miss{shape, goal})
		}
	}
	fmt.Printf("\n%d of %d shapes reach 50%% of the baseline (same count; uncoalesced for coalesced fresh shapes).\n", met, len(order))
	for _, m := range misses {
		fmt.Printf("- miss: %s at %.0f%%\n", m.shape, m.pct)
	}
	return nil
}

// thousands formats a non-negative number rounded to an integer with
// comma separators.
func thousands(v float64) string {
	s := strconv.FormatInt(int64(v+0.5), 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
