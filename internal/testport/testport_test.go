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
