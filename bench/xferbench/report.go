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

// sameHostGoal is the same-host path's goal against a contender at a
// piece size (issue 16): at least 1.5x NIXL over CMA with 1 MiB pieces
// and 5x with 512 B, and 0.5x memcpy with 1 MiB pieces.
func sameHostGoal(other string, piece int) (float64, bool) {
	switch {
	case other == "nixl" && piece == 1<<20:
		return 1.5, true
	case other == "nixl" && piece == 512:
		return 5, true
	case other == "memcpy" && piece == 1<<20:
		return 0.5, true
	}
	return 0, false
}

// report prints the bandwidth table and the ratios of the built-in
// backend and of its same-host path to the others, each ratio taken
// within a round (the contenders ran back to back) and then summarised
// over the rounds.
func report(w io.Writer, cases []xcase, run []contender, gbps [][][]float64) {
	fmt.Fprintln(w, "| size | piece | contender | GB/s median | min-max |")
	fmt.Fprintln(w, "| ---: | ---: | --- | ---: | ---: |")
	for ci, c := range cases {
		for k, ct := range run {
			s := summarise(gbps[ci][k])
			fmt.Fprintf(w, "| %s | %s | %s | %.2f | %.2f-%.2f |\n", fmtSize(c.total), fmtSize(c.piece), ct.name, s.med, s.lo, s.hi)
		}
	}
	ratios(w, cases, run, gbps, "builtin", func(other string, piece int) (float64, bool) {
		return ratioGoal(piece), other == "rawtcp"
	})
	ratios(w, cases, run, gbps, "samehost", sameHostGoal)
}

// ratios prints subject's ratios to every other contender, with a
// verdict where goal names one.
func ratios(w io.Writer, cases []xcase, run []contender, gbps [][][]float64, subject string, goal func(other string, piece int) (float64, bool)) {
	b := slices.IndexFunc(run, func(c contender) bool { return c.name == subject })
	if b < 0 || len(run) < 2 {
		return
	}
	fmt.Fprintln(w)
	head, rule := "| size | piece |", "| ---: | ---: |"
	for k, ct := range run {
		if k != b {
			head += " " + subject + "/" + ct.name + " median (min-max) |"
			rule += " ---: |"
		}
	}
	head += " goals |"
	rule += " --- |"
	fmt.Fprintln(w, head)
	fmt.Fprintln(w, rule)
	for ci, c := range cases {
		line := fmt.Sprintf("| %s | %s |", fmtSize(c.total), fmtSize(c.piece))
		verdicts := ""
		for k, ct := range run {
			if k == b {
				continue
			}
			r := make([]float64, len(gbps[ci][b]))
			for i := range r {
				r[i] = gbps[ci][b][i] / gbps[ci][k][i]
			}
			s := summarise(r)
			line += fmt.Sprintf(" %.2f (%.2f-%.2f) |", s.med, s.lo, s.hi)
			if g, ok := goal(ct.name, c.piece); ok {
				verdict := "met"
				if s.med < g {
					verdict = "missed"
				}
				verdicts += fmt.Sprintf(" vs %s >= %.1f: %s;", ct.name, g, verdict)
			}
		}
		fmt.Fprintln(w, line+verdicts+" |")
	}
}
