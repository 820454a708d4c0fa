package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
)

// TestMain lets the benchmark start this test binary as its child.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
			fmt.Fprintln(os.Stderr, "xferbench child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The quick path on a tiny case: two processes, every contender that can
// run here, each transfer's bytes checked; the table and the ratios
// printed; nothing left running.
func TestQuickRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	before := runtime.NumGoroutine()
	names := []string{"builtin", "rawtcp", "memcpy"}
	if lib, err := capi.FindLibrary(); err == nil {
		names = append(names, "nixl")
		t.Logf("NIXL: %s", lib)
	} else {
		t.Logf("without the nixl contender: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errs bytes.Buffer
	args := []string{"-sizes", "1MiB", "-pieces", "4KiB", "-rounds", "1", "-contenders", strings.Join(names, ",")}
	if err := run(ctx, args, &out, &errs); err != nil {
		t.Fatalf("xferbench %s: %v\n%s\n%s", strings.Join(args, " "), err, out.String(), errs.String())
	}
	want := []string{"| builtin/rawtcp median (min-max) |", "1 rounds in"}
	for _, n := range names {
		want = append(want, "| 1 MiB | 4 KiB | "+n+" | ")
	}
	for _, w := range want {
		if !strings.Contains(out.String(), w) {
			t.Errorf("output lacks %q:\n%s", w, out.String())
		}
	}
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// verify catches every way a transfer can go wrong that the benchmark
// must not count: a stale byte, a piece in the wrong slot, a write into a
// gap.
func TestVerify(t *testing.T) {
	c := xcase{total: 64 << 10, piece: 512}
	src, dst := make([]byte, c.span()), make([]byte, c.span())
	land := func(seed uint64) {
		fill(src, c, seed)
		markGaps(dst, c)
		for i := range c.n() {
			copy(c.dst(dst, i), c.src(src, i))
		}
	}
	for _, tc := range []struct {
		name  string
		spoil func()
		ok    bool
	}{
		{name: "landed", spoil: func() {}, ok: true},
		{name: "one byte wrong", spoil: func() { dst[c.dstOff(77)+300] ^= 1 }},
		{name: "stale: an earlier transfer's bytes", spoil: func() { land(1) }},
		{name: "two pieces swapped", spoil: func() {
			a, b := bytes.Clone(c.dst(dst, 3)), bytes.Clone(c.dst(dst, 4))
			copy(c.dst(dst, 3), b)
			copy(c.dst(dst, 4), a)
		}},
		{name: "a write into the first gap", spoil: func() { dst[5] = 0 }},
		{name: "a write into the last gap", spoil: func() { dst[2*(c.n()-1)*c.piece] = 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			land(2)
			tc.spoil()
			if err := verify(dst, c, 2); (err == nil) != tc.ok {
				t.Errorf("verify = %v, want ok %v", err, tc.ok)
			}
		})
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{"512", 512}, {"512B", 512}, {"4K", 4 << 10}, {"4KiB", 4 << 10}, {"1MiB", 1 << 20}, {"64M", 64 << 20}, {"0", 0}, {"x", 0}, {"-4K", 0},
	} {
		got, err := parseSize(tc.in)
		if (err != nil) != (tc.want == 0) || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v, want %d", tc.in, got, err, tc.want)
		}
	}
}
