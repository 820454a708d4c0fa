package testport

import (
	"net"
	"strconv"
	"testing"
)

// Free's ports lie below the ephemeral range and can be bound.
func TestFree(t *testing.T) {
	low := ephemeralLow()
	for range 20 {
		addr := Free(t)
		_, p, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(p)
		if low > lowest+100 && (n < lowest || n >= low) {
			t.Fatalf("port %d outside [%d, %d)", n, lowest, low)
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatalf("Free gave %s, which cannot be bound: %v", addr, err)
		}
		ln.Close()
	}
}

// Free and Run never give a port twice in a process, even when it is free
// again: two servers of a test that each picked a port before either
// bound it would otherwise collide.
func TestNeverTwice(t *testing.T) {
	seen := map[int]bool{}
	add := func(p int) {
		if seen[p] {
			t.Fatalf("port %d given twice", p)
		}
		seen[p] = true
	}
	for range 2000 {
		_, p, _ := net.SplitHostPort(Free(t))
		n, _ := strconv.Atoi(p)
		add(n)
	}
	for range 200 {
		base := Run(t, 4)
		for i := range 4 {
			add(base + i)
		}
		for i := range 4 {
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				t.Fatalf("Run gave %d..%d; %d cannot be bound: %v", base, base+3, base+i, err)
			}
			ln.Close()
		}
	}
}
