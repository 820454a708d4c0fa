// Package testport picks loopback TCP ports for servers a test starts
// in another process (etcd) or binds later by address: ports below the
// kernel's ephemeral range, so that no outgoing connection of any
// process on the host (the tests of other packages run beside these) can
// be given one as its source port between the pick and the bind, which
// is what a port picked by listening on :0 and closing is open to.
package testport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// fallbackLow is where the ephemeral range starts when the kernel does
// not say (Linux's default).
const fallbackLow = 32768

// lowest is the least port picked: above the well-known and most
// registered ones.
const lowest = 10000

// Free returns "127.0.0.1:PORT" for a port below the ephemeral range that
// nothing listens on now. It fails t after many tries.
func Free(t testing.TB) string {
	t.Helper()
	hi := ephemeralLow()
	if hi <= lowest+100 {
		// An unusual range: fall back to the kernel's choice.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}
	for range 1000 {
		addr := fmt.Sprintf("127.0.0.1:%d", lowest+rand.IntN(hi-lowest))
		if ln, err := net.Listen("tcp", addr); err == nil {
			ln.Close()
			return addr
		}
	}
	t.Fatalf("no free loopback port in [%d, %d)", lowest, hi)
	return ""
}

// ephemeralLow is the first port of the kernel's ephemeral range.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return fallbackLow
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return fallbackLow
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return fallbackLow
	}
	return n
}
