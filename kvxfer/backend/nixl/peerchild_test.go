//go:build linux

package nixl

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// peerChildEnv makes the test binary a peer agent's process (see
// runPeerChild) instead of running the tests.
const peerChildEnv = "KVXFER_NIXL_TEST_PEER_CHILD"

func TestMain(m *testing.M) {
	if n := os.Getenv(peerChildEnv); n != "" {
		os.Exit(runPeerChild(n))
	}
	os.Exit(m.Run())
}

// runPeerChild is a peer in a process of its own: an agent with size
// bytes of memory registered, filled with a pattern. It prints its
// metadata (hex) and the memory's address on one line, closes its agent
// when its stdin says "close" (or ends), prints "closed" and exits.
func runPeerChild(n string) int {
	var size int
	if _, err := fmt.Sscan(n, &size); err != nil || size <= 0 {
		fmt.Fprintf(os.Stderr, "%s = %q: want a size in bytes\n", peerChildEnv, n)
		return 2
	}
	be, err := New(Config{Name: fmt.Sprint("peer-child-", os.Getpid()), Params: testParams()})
	if err != nil {
		fmt.Fprintln(os.Stderr, "New:", err)
		return 2
	}
	mem := make([]byte, size)
	for i := range mem {
		mem[i] = byte(i*7 + 3)
	}
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if err := be.Map(base, mem); err != nil {
		fmt.Fprintln(os.Stderr, "Map:", err)
		return 2
	}
	if err := be.Register([]kvxfer.MemRegion{{Addr: base, Len: uint64(size), Kind: kvxfer.MemDRAM}}); err != nil {
		fmt.Fprintln(os.Stderr, "Register:", err)
		return 2
	}
	meta, err := be.LocalMetadata()
	if err != nil {
		fmt.Fprintln(os.Stderr, "LocalMetadata:", err)
		return 2
	}
	fmt.Printf("%s %d\n", hex.EncodeToString(meta), base)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	err = be.Close()
	fmt.Println("closed")
	if err != nil {
		fmt.Fprintln(os.Stderr, "Close:", err)
		return 1
	}
	return 0
}

// peerChild is a peer agent in a child process (runPeerChild).
type peerChild struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *bufio.Reader
	stderr *strings.Builder
	meta   []byte
	addr   uint64
	done   chan error
}

// startPeerChild starts the test binary as a peer with size bytes
// registered and reads its metadata and address.
func startPeerChild(t *testing.T, size int) *peerChild {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := &peerChild{cmd: exec.Command(exe), stderr: new(strings.Builder), done: make(chan error, 1)}
	p.cmd.Env = append(os.Environ(), fmt.Sprint(peerChildEnv, "=", size))
	p.cmd.Stderr = p.stderr
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			t.Error("the peer's process did not end within 10 s of its kill")
		}
	})
	p.out = bufio.NewReader(stdout)
	line := make(chan string, 1)
	go func() {
		l, _ := p.out.ReadString('\n')
		line <- l
		_, _ = io.Copy(io.Discard, p.out) // "closed", then EOF
		p.done <- p.cmd.Wait()
	}()
	var l string
	select {
	case l = <-line:
	case <-time.After(30 * time.Second):
		t.Fatalf("the peer's process said nothing within 30 s (stderr: %s)", p.stderr)
	}
	var metaHex string
	if _, err := fmt.Sscan(l, &metaHex, &p.addr); err != nil {
		t.Fatalf("the peer's process said %q (stderr: %s): %v", l, p.stderr, err)
	}
	if p.meta, err = hex.DecodeString(metaHex); err != nil {
		t.Fatal(err)
	}
	return p
}

// close asks the peer to close its agent and waits (at most 30 s) for its
// process to end. A crash there (NIXL's destroy under a peer's READ over
// TCP, README) is logged, not failed: it is the peer's, and this test is
// about its READer.
func (p *peerChild) close(t *testing.T) {
	t.Helper()
	_, _ = io.WriteString(p.stdin, "close\n")
	_ = p.stdin.Close()
	select {
	case err := <-p.done:
		p.done <- err // for the cleanup
		switch stderr := p.stderr.String(); {
		case err == nil:
		case strings.Contains(stderr, "SIGSEGV") && strings.Contains(stderr, "kx_destroy"):
			t.Logf("the peer's process crashed destroying its agent (UCX, under a peer's READ over TCP: README): %v", err)
		default:
			t.Errorf("the peer's process failed: %v (stderr: %s)", err, tail(stderr))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the peer's process did not end within 30 s of its close")
	}
}

// tail is the end of a child's stderr, without UCX's mpool warnings.
func tail(s string) string {
	var keep []string
	for _, l := range strings.Split(s, "\n") {
		if l != "" && !strings.Contains(l, "mpool.c") {
			keep = append(keep, l)
		}
	}
	if len(keep) > 12 {
		keep = keep[:12]
	}
	return strings.Join(keep, "\n")
}
