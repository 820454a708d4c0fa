package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
)

// labels name the contenders in the table.
var labels = map[string]string{
	"samehost":        "kvxfer same-host (netxfer, MapDevice), as a layout",
	"samehost-pieces": "kvxfer same-host (netxfer, MapDevice), as pieces",
	"samehost-x4":     "kvxfer same-host (netxfer, MapDevice), as a layout, 4 in flight",
	"samehost-gate":   "kvxfer same-host, one-sided through a gate (P launches into D's memory)",
	"nixl":            "kvxfer NIXL (UCX default threads)",
	"nixl4":           "kvxfer NIXL (UCX num_threads=4)",
	"nixl4-read":      "kvxfer NIXL (UCX num_threads=4), READ (pull)",
	"nixl-gpu":        "kvxfer NIXL, kvxfer's GPU defaults (num_threads=4, split_batch_size=64)",
	splitName:         "NIXL Python API (num_threads=4, split_batch_size=64)",
	pythonName:        "NIXL Python API (num_threads=4)",
	pushName:          "NIXL Python API, push round trip (D notifies, P WRITEs + notifies, D sees it)",
	readName:          "NIXL Python API (num_threads=4), READ (pull)",
	"contig":          "device copy, contiguous (the limit)",
	"kernel":          "kvxfer copy kernel, one launch (one process)",
	"kernel-layout":   "kvxfer copy kernel, one launch of a layout (one process)",
	"perpiece":        "per-piece async cuMemcpyDtoD, one event",
}

// report prints one markdown table: a row per contender and piece size,
// a column per block count; each cell the median GB/s and the range. It
// returns how many cells failed (an error, or wrong bytes).
func report(w io.Writer, cfg config, res map[string]map[xcase]result, why map[string]string) (failed int) {
	var pieces, blocks []int
	layers := cfg.cases[0].Layers
	for _, c := range cfg.cases {
		if !slices.Contains(pieces, c.Piece) {
			pieces = append(pieces, c.Piece)
		}
		if !slices.Contains(blocks, c.Blocks) {
			blocks = append(blocks, c.Blocks)
		}
	}
	fmt.Fprintf(w, "GB/s (10^9 B/s), median of %d (min-max), %d layers x n blocks, one piece per layer-block, scattered; every destination byte checked\n\n",
		cfg.reps, layers)
	head := []string{"contender", "piece"}
	for _, b := range blocks {
		head = append(head, fmt.Sprintf("%d blocks (%d pieces)", b, b*layers))
	}
	fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(head, " | "), strings.Repeat(" --- |", len(head)))
	var notes []string
	for _, n := range cfg.names {
		label := labels[n]
		if reason, ok := why[n]; ok {
			fmt.Fprintf(w, "| %s | all | did not run: %s |%s\n", label, oneLine(reason), strings.Repeat(" |", len(blocks)-1))
			failed++
			continue
		}
		for _, p := range pieces {
			row := []string{label, sizeName(p)}
			for _, b := range blocks {
				c := xcase{Piece: p, Blocks: b, Layers: layers}
				r, ok := res[n][c]
				switch {
				case !ok && pyModes[n] != "" && !cfg.pySmall && p < 64<<10:
					row = append(row, "skipped (-python-small=false)")
				case !ok:
					row = append(row, "not run")
				case r.err != "":
					failed++
					notes = append(notes, fmt.Sprintf("%s, %s: %s", label, c, r.err))
					row = append(row, fmt.Sprintf("FAILED [%d]", len(notes)))
				default:
					row = append(row, cell(r.gbps))
				}
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(row, " | "))
		}
	}
	for i, n := range notes {
		fmt.Fprintf(w, "\n[%d] %s", i+1, oneLine(n))
	}
	if len(notes) > 0 {
		fmt.Fprintln(w)
	}
	return failed
}

// cell is the median and the range of xs.
func cell(xs []float64) string {
	med, lo, hi := spread(xs)
	return fmt.Sprintf("%s (%s-%s)", num(med), num(lo), num(hi))
}

// spread is the median, least and greatest of xs (not empty).
func spread[T ~int64 | ~float64](xs []T) (med, lo, hi T) {
	s := slices.Clone(xs)
	slices.Sort(s)
	med = s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return med, s[0], s[len(s)-1]
}

// num prints a rate with three significant digits or so.
func num(x float64) string {
	switch {
	case x >= 100:
		return fmt.Sprintf("%.0f", x)
	case x >= 10:
		return fmt.Sprintf("%.1f", x)
	}
	return fmt.Sprintf("%.2f", x)
}

func oneLine(s string) string {
	s = strings.ReplaceAll(strings.TrimSpace(s), "\n", " ")
	return strings.ReplaceAll(s, "|", "/")
}
