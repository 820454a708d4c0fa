package main

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestSummary(t *testing.T) {
	in := `{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"=== RUN   TestA\n"}
{"Action":"pass","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestB","Output":"=== RUN   TestB\n"}
{"Action":"output","Package":"p","Test":"TestB","Output":"    b_test.go:9: NIXL is not available here\n"}
{"Action":"output","Package":"p","Test":"TestB","Output":"--- SKIP: TestB (0.00s)\n"}
{"Action":"skip","Package":"p","Test":"TestB"}
{"Action":"output","Package":"p","Test":"TestC/sub","Output":"    c_test.go:3: boom\n"}
{"Action":"output","Package":"p","Test":"TestC/sub","Output":"    c_test.go:4: D log:\n"}
{"Action":"output","Package":"p","Test":"TestC/sub","Output":"        time=x level=WARN msg=noise\n"}
{"Action":"fail","Package":"p","Test":"TestC/sub"}
{"Action":"output","Package":"p","Test":"TestC","Output":"--- FAIL: TestC (0.00s)\n"}
{"Action":"fail","Package":"p","Test":"TestC"}
{"Action":"fail","Package":"p","Elapsed":1.5}
{"Action":"pass","Package":"q","Elapsed":0.1}`
	s := newSummary()
	var out strings.Builder
	for _, l := range strings.Split(in, "\n") {
		var e event
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Fatal(err)
		}
		s.add(&out, e)
	}
	s.report(&out)
	got := out.String()
	for _, want := range []string{"boom", "--- FAIL: TestC", "FAIL p 1.5s", "ok   q 0.1s",
		"1 tests passed, 1 failed, 1 tests or subtests skipped", "SKIP p TestB: b_test.go:9: NIXL is not available here"} {
		if !strings.Contains(got, want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
	// The run ends with why each test failed, without its logs.
	if _, tail, _ := strings.Cut(got, "  FAIL p\n"); tail != "    TestC:\n      c_test.go:3: boom\n" {
		t.Errorf("the summary's end after FAIL p is %q, want TestC's message alone", tail)
	}
	if strings.Contains(got, "=== RUN   TestA") {
		t.Errorf("a passing test's output was printed:\n%s", got)
	}
	if s.failed != 1 || s.passed != 1 || len(s.skips) != 1 || len(s.failedPkgs) != 1 {
		t.Errorf("counts: passed %d failed %d skips %d failed packages %v", s.passed, s.failed, len(s.skips), s.failedPkgs)
	}
}

// A skip fails the run when -forbid-skip matches its line or, with
// -allow-skip, when -allow-skip does not: CI allows only GPU skips, so a
// root-only or NIXL test that starts to skip cannot go unnoticed.
func TestSkipRules(t *testing.T) {
	lines := []string{
		"p/cuda TestOpen: cuda_test.go:71: no GPU here: cuda: unavailable",
		"p/nixl TestAgent: nixl_test.go:20: NIXL is not available here: no library",
		"p/shm TestMapOwnedRefuses: shm_test.go:182: files of another owner need root to make (chown); CI runs as root",
		"p/hotpath TestAppendDescsZeroAllocs: alloc_test.go:17: allocation counts are not meaningful under -race",
	}
	for _, c := range []struct {
		name, forbid, allow string
		want                []int // indices of lines refused
	}{
		{"no rules", "", "", nil},
		{"forbid NIXL", "NIXL is not available", "", []int{1}},
		{"allow GPU", "", ": no GPU here(:|$)", []int{1, 2, 3}},
		{"allow GPU and the race alloc proofs", "", `: no GPU here(:|$)|^\S+ Test\w*ZeroAllocs\w*: \S+ allocation counts are not meaningful under -race$`, []int{1, 2}},
		{"both", "GPU", "GPU|NIXL", []int{0, 2, 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, err := newSkipRules(c.forbid, c.allow)
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, i := range c.want {
				want = append(want, lines[i])
			}
			if got := r.forbidden(lines); strings.Join(got, "\n") != strings.Join(want, "\n") {
				t.Errorf("forbidden(-forbid-skip %q, -allow-skip %q) = %q, want %q", c.forbid, c.allow, got, want)
			}
		})
	}
	if _, err := newSkipRules("", "("); err == nil || !strings.Contains(err.Error(), "-allow-skip") {
		t.Errorf("newSkipRules with a bad -allow-skip = %v, want an error naming it", err)
	}
}

// A package that times out fails with its tests still running: their
// output (the timeout's stacks) is printed, so the log says where they
// hung.
func TestSummaryPrintsTestsThatNeverEnded(t *testing.T) {
	in := `{"Action":"run","Package":"p","Test":"TestHang"}
{"Action":"output","Package":"p","Test":"TestHang","Output":"=== RUN   TestHang\n"}
{"Action":"output","Package":"p","Test":"TestHang","Output":"panic: test timed out after 10m0s\n"}
{"Action":"output","Package":"p","Test":"TestHang","Output":"goroutine 7 [chan receive]:\n"}
{"Action":"output","Package":"p","Output":"FAIL\tp\t600.0s\n"}
{"Action":"fail","Package":"p","Elapsed":600}`
	s := newSummary()
	var out strings.Builder
	for _, l := range strings.Split(in, "\n") {
		var e event
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Fatal(err)
		}
		s.add(&out, e)
	}
	got := out.String()
	for _, want := range []string{"--- TestHang: did not end", "panic: test timed out", "goroutine 7 [chan receive]"} {
		if !strings.Contains(got, want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}
