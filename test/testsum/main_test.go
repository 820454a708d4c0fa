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
	if strings.Contains(got, "=== RUN   TestA") {
		t.Errorf("a passing test's output was printed:\n%s", got)
	}
	if s.failed != 1 || s.passed != 1 || len(s.skips) != 1 || len(s.failedPkgs) != 1 {
		t.Errorf("counts: passed %d failed %d skips %d failed packages %v", s.passed, s.failed, len(s.skips), s.failedPkgs)
	}
}
