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
	"samehost-read":   "kvxfer same-host, READ (pull) as a layout",
	"nixl":            "kvxfer NIXL (UCX default threads)",
	"nixl4":           "kvxfer NIXL (UCX num_threads=4)",
	"nixl8":           "kvxfer NIXL (UCX num_threads=8, split 64)",
	"nixl4-read":      "kvxfer NIXL (UCX num_threads=4), READ (pull)",
	"nixl-gpu":        "kvxfer NIXL, kvxfer's GPU defaults (num_threads=4, split_batch_size=64)",
	splitName:         "NIXL Python API (num_threads=4, split_batch_size=64)",
	pythonName:        "NIXL Python API (num_threads=4)",
	pushName:          "NIXL Python API, push round trip (D notifies, P WRITEs + notifies, D sees it)",
	readName:          "NIXL Python API (num_threads=4), READ (pull)",
	"contig":          "device copy, contiguous (the limit)",
	"kernel":          "kvxfer copy kernel, one launch (one process)",
	"kernel-layout":   "kvxfer copy kernel, one launch of a layout (one process)",
	"kernel-gated":    "kvxfer gated copy kernel, one launch of a layout through an open gate (one process)",
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

// goalCases are issue 25's same-host goals (32 layers): GB/s a case's
// median must reach.
var goalCases = []struct {
	c    xcase
	gbps float64
}{
	{xcase{Piece: 64 << 10, Blocks: 256, Layers: 32}, 600},
	{xcase{Piece: 4 << 10, Blocks: 256, Layers: 32}, 300},
	{xcase{Piece: 64 << 10, Blocks: 8, Layers: 32}, 100},
}

// reportGoals prints, for the goal cases this run measured, the
// same-host path's medians two-sided and one-sided (through a gate, the
// default for a push on one GPU) against the goals; and the NIXL
// contenders' medians as a ratio to NIXL's Python API where both ran
// (issue 24 compares kvxfer in process to it: pytest-inprocess's ratio is
// that goal's; this is the binding's share of it).
func reportGoals(w io.Writer, cfg config, res map[string]map[xcase]result) {
	median := func(n string, c xcase) (float64, bool) {
		r, ok := res[n][c]
		if !ok || r.err != "" || len(r.gbps) == 0 {
			return 0, false
		}
		m, _, _ := spread(r.gbps)
		return m, true
	}
	var rows []string
	for _, g := range goalCases {
		two, ok2 := median("samehost", g.c)
		one, ok1 := median("samehost-gate", g.c)
		if !ok1 && !ok2 {
			continue
		}
		cellOf := func(x float64, ok bool) string {
			if !ok {
				return "not run"
			}
			verdict := "met"
			if x < g.gbps {
				verdict = "not met"
			}
			return fmt.Sprintf("%s (%s)", num(x), verdict)
		}
		rows = append(rows, fmt.Sprintf("| %s | >= %s | %s | %s |", g.c, num(g.gbps), cellOf(two, ok2), cellOf(one, ok1)))
	}
	if len(rows) > 0 {
		fmt.Fprintf(w, "\nIssue 25's same-host goals (medians, GB/s; a push on one GPU goes one-sided by default)\n\n")
		fmt.Fprintln(w, "| case | goal | two-sided (samehost) | one-sided (samehost-gate) |\n| --- | --- | --- | --- |")
		for _, r := range rows {
			fmt.Fprintln(w, r)
		}
	}
	rows = rows[:0]
	for _, c := range cfg.cases {
		py, ok := median(pythonName, c)
		if !ok {
			continue
		}
		row := fmt.Sprintf("| %s | %s |", c, num(py))
		have := false
		for _, n := range []string{"nixl4", "nixl-gpu", splitName} {
			if x, ok := median(n, c); ok {
				row += fmt.Sprintf(" %.2fx |", x/py)
				have = true
			} else {
				row += " - |"
			}
		}
		if have {
			rows = append(rows, row)
		}
	}
	if len(rows) > 0 {
		fmt.Fprintf(w, "\nNIXL contenders against NIXL's Python API (num_threads=4), ratio of medians\n\n")
		fmt.Fprintln(w, "| case | NIXL Python API, GB/s | kvxfer NIXL num_threads=4 | kvxfer NIXL GPU defaults (split) | NIXL Python API with the split |\n| --- | --- | --- | --- | --- |")
		for _, r := range rows {
			fmt.Fprintln(w, r)
		}
	}
}
