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
	"sync"
	"testing"
)

// fallbackLow is where the ephemeral range starts when the kernel does
// not say (Linux's default).
const fallbackLow = 32768

// lowest is the least port picked: above the well-known and most
// registered ones.
const lowest = 10000

// given holds the ports Free has returned in this process: each is
// returned once, so that two servers of a test (or of tests beside it)
// never pick the same port before either binds it, the second then
// failing to start.
var given sync.Map

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
		port := lowest + rand.IntN(hi-lowest)
		if !reserve(port, 1) {
			continue
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		if ln, err := net.Listen("tcp", addr); err == nil {
			ln.Close()
			return addr
		}
	}
	t.Fatalf("no free loopback port in [%d, %d)", lowest, hi)
	return ""
}

// Run returns the first of n consecutive loopback ports below the
// ephemeral range that nothing listens on now and Free or Run has not
// returned before in this process (a server per rank on a base port plus
// the rank). It fails t after many tries.
func Run(t testing.TB, n int) int {
	t.Helper()
	hi := ephemeralLow()
	if hi <= lowest+100+n {
		t.Fatalf("no room for %d ports below the ephemeral range (it starts at %d)", n, hi)
	}
	for range 1000 {
		base := lowest + rand.IntN(hi-lowest-n)
		if !reserve(base, n) {
			continue
		}
		var ls []net.Listener
		for i := range n {
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if err != nil {
				break
			}
			ls = append(ls, ln)
		}
		for _, ln := range ls {
			ln.Close()
		}
		if len(ls) == n {
			return base
		}
	}
	t.Fatalf("no %d consecutive free loopback ports in [%d, %d)", n, lowest, hi)
	return 0
}

// reserve marks ports base..base+n-1 given, if none of them was; it
// reports whether it did.
func reserve(base, n int) bool {
	for i := range n {
		if _, taken := given.LoadOrStore(base+i, true); taken {
			for j := range i {
				given.Delete(base + j)
			}
			return false
		}
	}
	return true
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
