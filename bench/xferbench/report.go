package main

import (
	"fmt"
	"io"
	"slices"
)

// ratioGoals are the built-in backend's goals against raw TCP (issue 16):
// at least 0.9x with 1 MiB and 4 KiB pieces, 0.7x with 512 B.
func ratioGoal(piece int) float64 {
	if piece < 4<<10 {
		return 0.7
	}
	return 0.9
}

// summary is a sample's median and range.
type summary struct{ med, lo, hi float64 }

func summarise(xs []float64) summary {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	med := s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return summary{med, s[0], s[n-1]}
}

// report prints the bandwidth table and the built-in backend's ratios,
// each ratio taken within a round (the contenders ran back to back) and
// then summarised over the rounds.
func report(w io.Writer, cases []xcase, run []contender, gbps [][][]float64) {
	fmt.Fprintln(w, "| size | piece | contender | GB/s median | min-max |")
	fmt.Fprintln(w, "| ---: | ---: | --- | ---: | ---: |")
	for ci, c := range cases {
		for k, ct := range run {
			s := summarise(gbps[ci][k])
			fmt.Fprintf(w, "| %s | %s | %s | %.2f | %.2f-%.2f |\n", fmtSize(c.total), fmtSize(c.piece), ct.name, s.med, s.lo, s.hi)
		}
	}
	b := slices.IndexFunc(run, func(c contender) bool { return c.name == "builtin" })
	if b < 0 || len(run) < 2 {
		return
	}
	fmt.Fprintln(w)
	head, rule := "| size | piece |", "| ---: | ---: |"
	for k, ct := range run {
		if k != b {
			head += " builtin/" + ct.name + " median (min-max) |"
			rule += " ---: |"
		}
	}
	raw := slices.IndexFunc(run, func(c contender) bool { return c.name == "rawtcp" })
	if raw >= 0 {
		head += " goal vs rawtcp |"
		rule += " --- |"
	}
	fmt.Fprintln(w, head)
	fmt.Fprintln(w, rule)
	for ci, c := range cases {
		line := fmt.Sprintf("| %s | %s |", fmtSize(c.total), fmtSize(c.piece))
		var vsRaw summary
		for k := range run {
			if k == b {
				continue
			}
			r := make([]float64, len(gbps[ci][b]))
			for i := range r {
				r[i] = gbps[ci][b][i] / gbps[ci][k][i]
			}
			s := summarise(r)
			if k == raw {
				vsRaw = s
			}
			line += fmt.Sprintf(" %.2f (%.2f-%.2f) |", s.med, s.lo, s.hi)
		}
		if raw >= 0 {
			goal := ratioGoal(c.piece)
			verdict := "met"
			if vsRaw.med < goal {
				verdict = "missed"
			}
			line += fmt.Sprintf(" >= %.1f: %s |", goal, verdict)
		}
		fmt.Fprintln(w, line)
	}
}
