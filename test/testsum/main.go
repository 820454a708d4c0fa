// Command testsum reads `go test -json` on stdin and prints what a person
// needs from it: each package's ok/FAIL line, the whole output of every
// failed test (and of a package that failed outside a test), and at the
// end the counts of passed, failed and skipped tests with every skip and
// its reason. It exits 1 when a test or package failed, or when a test
// skipped that must not: its line (`package test: reason`) matches
// -forbid-skip, or, with -allow-skip, does not match it (CI: only the
// tests that need a GPU may skip).
//
//	go test -json ./... | go run ./test/testsum [-skips FILE] [-forbid-skip REGEXP] [-allow-skip REGEXP] [-require-run REGEXP]
//
// test/run pipes the Go suite through it; .ci/run reads its skip list.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"
)

// event is one line of test2json's output.
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

type key struct{ pkg, test string }

// skip is one skipped test and the reason it gave (its last output line
// before the skip, which holds t.Skip's message).
type skip struct {
	key
	reason string
}

type summary struct {
	out            map[key][]string // output so far, per test ("" test: the package's own)
	passedNames    []string
	passed, failed int
	skips          []skip
	failedTests    []key
	failedPkgs     []string
	// said holds each failed top-level test's failure messages, in
	// order: the first line of each t.Error/t.Fatal (and of a panic),
	// so that the run's last lines say why without its logs.
	said map[key][]string
}

func newSummary() *summary { return &summary{out: map[key][]string{}, said: map[key][]string{}} }

// messageLine matches the first line of a test's message (t.Log's too):
// four spaces, the file and line, the text.
var messageLine = regexp.MustCompile(`^ {4}(\S+_test\.go:\d+: .*)`)

// sayings picks the lines of a failed test's output that say why it
// failed: each message's first line, less those that only head a log
// (they end in "log:" or "output:"), and a panic's; at most 300 bytes
// each.
func sayings(lines []string) []string {
	var out []string
	for _, l := range lines {
		l = strings.TrimRight(l, "\n")
		var said string
		if m := messageLine.FindStringSubmatch(l); m != nil {
			said = m[1]
			if strings.HasSuffix(said, "log:") || strings.HasSuffix(said, "output:") {
				continue
			}
		} else if strings.HasPrefix(l, "panic: ") {
			said = l
		} else {
			continue
		}
		if len(said) > 300 {
			said = said[:300] + "..."
		}
		out = append(out, said)
	}
	return out
}

// add takes one event; it prints package lines and failed tests' output to w.
func (s *summary) add(w io.Writer, e event) {
	k := key{e.Package, e.Test}
	switch e.Action {
	case "output":
		s.out[k] = append(s.out[k], e.Output)
		if e.Test == "" && e.Package == "" {
			// Build errors come without a package.
			fmt.Fprint(w, e.Output)
		}
	case "build-output":
		fmt.Fprint(w, e.Output)
	case "pass":
		if e.Test == "" {
			fmt.Fprintf(w, "ok   %s %.1fs\n", e.Package, e.Elapsed)
		} else if !strings.Contains(e.Test, "/") {
			s.passed++
			s.passedNames = append(s.passedNames, e.Test)
		}
		delete(s.out, k)
	case "skip":
		if e.Test == "" {
			fmt.Fprintf(w, "--   %s (no tests)\n", e.Package)
		} else {
			s.skips = append(s.skips, skip{k, reasonOf(s.out[k])})
		}
		delete(s.out, k)
	case "fail":
		if e.Test == "" {
			fmt.Fprintf(w, "FAIL %s %.1fs\n", e.Package, e.Elapsed)
			s.failedPkgs = append(s.failedPkgs, e.Package)
			if len(s.out[k]) > 0 {
				fmt.Fprint(w, strings.Join(s.out[k], ""))
			}
			// Tests that never ended (a timeout's panic, a crash): their
			// output holds the stacks that say where they hung.
			var open []key
			for o := range s.out {
				if o.pkg == e.Package && o.test != "" {
					open = append(open, o)
				}
			}
			slices.SortFunc(open, func(a, b key) int { return strings.Compare(a.test, b.test) })
			for _, o := range open {
				lines := s.out[o]
				if len(lines) > 400 {
					lines = lines[len(lines)-400:]
				}
				fmt.Fprintf(w, "--- %s: did not end; its last output:\n%s", o.test, strings.Join(lines, ""))
				delete(s.out, o)
			}
		} else {
			// A subtest's output is part of its parent's: print the
			// innermost failure's and the top-level test's once.
			s.failedTests = append(s.failedTests, k)
			top, _, _ := strings.Cut(e.Test, "/")
			tk := key{e.Package, top}
			s.said[tk] = append(s.said[tk], sayings(s.out[k])...)
			if !strings.Contains(e.Test, "/") {
				s.failed++
			}
			fmt.Fprint(w, strings.Join(s.out[k], ""))
		}
		delete(s.out, k)
	}
}

// reasonOf finds t.Skip's message in a skipped test's output: the last
// line that is not the "--- SKIP" line itself.
func reasonOf(lines []string) string {
	for i := len(lines) - 1; i >= 0; i-- {
		l := strings.TrimSpace(lines[i])
		if l == "" || strings.HasPrefix(l, "--- SKIP") || strings.HasPrefix(l, "=== ") {
			continue
		}
		return l
	}
	return "(no reason given)"
}

func (s *summary) report(w io.Writer) {
	sort.Slice(s.skips, func(i, j int) bool {
		if s.skips[i].pkg != s.skips[j].pkg {
			return s.skips[i].pkg < s.skips[j].pkg
		}
		return s.skips[i].test < s.skips[j].test
	})
	fmt.Fprintf(w, "\n%d tests passed, %d failed, %d tests or subtests skipped\n", s.passed, s.failed, len(s.skips))
	// Skips grouped by top-level test and reason: a table of 36 subtests
	// skipped for one reason is one line.
	type group struct{ pkg, test, reason string }
	var order []group
	n := map[group]int{}
	for _, sk := range s.skips {
		top, _, _ := strings.Cut(sk.test, "/")
		g := group{sk.pkg, top, sk.reason}
		if n[g] == 0 {
			order = append(order, g)
		}
		n[g]++
	}
	for _, g := range order {
		what := g.test
		if n[g] > 1 || what != "" && !slices.ContainsFunc(s.skips, func(sk skip) bool { return sk.pkg == g.pkg && sk.test == g.test }) {
			what = fmt.Sprintf("%s (%d subtests)", g.test, n[g])
		}
		fmt.Fprintf(w, "  SKIP %s %s: %s\n", strings.TrimPrefix(g.pkg, "github.com/kvxfer/kvxfer/"), what, g.reason)
	}
	for _, p := range s.failedPkgs {
		fmt.Fprintf(w, "  FAIL %s\n", p)
		// Why each of its tests failed, at the very end of the run's
		// output, where a cut log still shows it.
		var tests []key
		for k := range s.said {
			if k.pkg == p {
				tests = append(tests, k)
			}
		}
		slices.SortFunc(tests, func(a, b key) int { return strings.Compare(a.test, b.test) })
		for _, k := range tests {
			var said []string
			for _, l := range s.said[k] {
				if !slices.Contains(said, l) {
					said = append(said, l)
				}
			}
			if len(said) > 8 {
				said = append(said[:8:8], fmt.Sprintf("(and %d more)", len(said)-8))
			}
			fmt.Fprintf(w, "    %s:\n      %s\n", k.test, strings.Join(said, "\n      "))
		}
	}
}

// skipLines returns each skip as `package test: reason`.
func (s *summary) skipLines() []string {
	var lines []string
	for _, sk := range s.skips {
		lines = append(lines, fmt.Sprintf("%s %s: %s", sk.pkg, sk.test, sk.reason))
	}
	return lines
}

// skipRules say which skips fail the run: those forbid matches, and,
// when allow is set, those it does not match.
type skipRules struct {
	forbid, allow *regexp.Regexp
}

func newSkipRules(forbid, allow string) (skipRules, error) {
	var r skipRules
	var err error
	if forbid != "" {
		if r.forbid, err = regexp.Compile(forbid); err != nil {
			return r, fmt.Errorf("-forbid-skip: %w", err)
		}
	}
	if allow != "" {
		if r.allow, err = regexp.Compile(allow); err != nil {
			return r, fmt.Errorf("-allow-skip: %w", err)
		}
	}
	return r, nil
}

// forbidden returns the skip lines the rules refuse.
func (r skipRules) forbidden(lines []string) []string {
	var out []string
	for _, l := range lines {
		if r.forbid != nil && r.forbid.MatchString(l) || r.allow != nil && !r.allow.MatchString(l) {
			out = append(out, l)
		}
	}
	return out
}

func (r skipRules) String() string {
	var s []string
	if r.forbid != nil {
		s = append(s, fmt.Sprintf("-forbid-skip %q matches", r.forbid))
	}
	if r.allow != nil {
		s = append(s, fmt.Sprintf("-allow-skip %q does not match", r.allow))
	}
	return strings.Join(s, ", or ")
}

func main() {
	skipsFile := flag.String("skips", "", "write the skipped tests here, one `package test: reason` per line")
	require := flag.String("require-run", "", "fail unless a test whose name matches this regexp passed")
	forbid := flag.String("forbid-skip", "", "fail when a skipped test's `package test: reason` line matches this regexp")
	allow := flag.String("allow-skip", "", "fail when a skipped test's `package test: reason` line does not match this regexp")
	flag.Parse()
	rules, err := newSkipRules(*forbid, *allow)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsum:", err)
		os.Exit(2)
	}
	s := newSummary()
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	start := time.Now()
	for sc.Scan() {
		var e event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			// Not test2json (go vet's or the build's own lines): pass on.
			fmt.Println(sc.Text())
			continue
		}
		s.add(os.Stdout, e)
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "testsum:", err)
		os.Exit(2)
	}
	s.report(os.Stdout)
	fmt.Printf("(%s)\n", time.Since(start).Round(time.Second))
	code := 0
	if s.failed > 0 || len(s.failedPkgs) > 0 {
		code = 1
	}
	lines := s.skipLines()
	if forbidden := rules.forbidden(lines); len(forbidden) > 0 {
		fmt.Printf("testsum: %d tests skipped that must not (%s):\n  %s\n",
			len(forbidden), rules, strings.Join(forbidden[:min(len(forbidden), 20)], "\n  "))
		code = 1
	}
	if *require != "" {
		rr := regexp.MustCompile(*require)
		if !slices.ContainsFunc(s.passedNames, rr.MatchString) {
			fmt.Printf("testsum: no test matching -require-run %q passed\n", *require)
			code = 1
		}
	}
	if *skipsFile != "" {
		if err := os.WriteFile(*skipsFile, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "testsum:", err)
			code = 1
		}
	}
	os.Exit(code)
}
