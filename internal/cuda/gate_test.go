package cuda

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// The cross-process gate test: a child process (the producer) imports
// the parent's destination and gate area through their IPC handles and
// launches gated copies into the destination, back to back, until its
// stdin closes; the parent (the consumer) shuts the gate while they run,
// waits until no CTA is counted in, and checks that its memory no longer
// changes. Two processes, two CUDA contexts time-sliced on one GPU: what a
// consumer ending a grant relies on.

const gateChildEnv = "KVXFER_CUDA_GATE_CHILD"

const (
	gateLayers, gateLayer, gateBlock = 8, 1 << 20, 4 << 10
	gateBytes                        = gateLayers * gateLayer
)

// gateChild: args "dstHandle gateHandle want" in hex/decimal; prints
// "go" once its first launch is queued, then each launch's result
// ("ok" or "shut") until stdin closes.
func gateChild(arg string) error {
	f := strings.Fields(arg)
	if len(f) != 3 {
		return fmt.Errorf("args %q", arg)
	}
	var hs [2]Handle
	for i := range hs {
		raw, err := hex.DecodeString(f[i])
		if err != nil || len(raw) != 64 {
			return fmt.Errorf("handle %q", f[i])
		}
		copy(hs[i][:], raw)
	}
	var want uint32
	if _, err := fmt.Sscan(f[2], &want); err != nil {
		return err
	}
	d, src, done, err := patternSource(gateBytes)
	if err != nil {
		return err
	}
	defer done()
	dst, err := d.Import(hs[0])
	if err != nil {
		return err
	}
	defer d.Unmap(dst)
	gates, err := d.Import(hs[1])
	if err != nil {
		return err
	}
	defer d.Unmap(gates)
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	var regs []Region
	for l := range uint64(gateLayers) {
		regs = append(regs, Region{dst + l*gateLayer, src + l*gateLayer})
	}
	var ents []Entry
	for i := range uint64(gateLayer / gateBlock) {
		ents = append(ents, Entry{i * gateBlock, (gateLayer/gateBlock - 1 - i) * gateBlock, gateBlock})
	}
	w := bufio.NewWriter(os.Stdout)
	for n := 0; ; n++ {
		b, err := d.NewBatch(len(ents))
		if err != nil {
			return err
		}
		if !b.AddLayout(regs, ents) || !b.Gate(gates, want) {
			return errors.New("cannot stage a gated launch")
		}
		c, err := b.Post()
		if err != nil {
			return err
		}
		if n == 0 {
			fmt.Fprintln(w, "go")
			w.Flush()
		}
		if err := c.Wait(); err != nil {
			return err
		}
		if c.Shut() {
			fmt.Fprintln(w, "shut")
		} else {
			fmt.Fprintln(w, "ok")
		}
		select {
		case <-stop:
			return w.Flush()
		default:
		}
	}
}

// TestGateBetweenProcesses: the consumer's shut, across processes.
func TestGateBetweenProcesses(t *testing.T) {
	d := openGPU(t)
	dst, gates := allocPair(t, d, gateBytes)
	if err := d.CopyIn(gates, make([]byte, GateSize)); err != nil {
		t.Fatal(err)
	}
	const want = 41
	var w [4]byte
	binary.LittleEndian.PutUint32(w[:], want)
	if err := d.CopyIn(gates, w[:]); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyIn(dst, bytes.Repeat([]byte{0xee}, gateBytes)); err != nil {
		t.Fatal(err)
	}
	hd, err := d.Export(dst)
	if err != nil {
		t.Fatal(err)
	}
	hg, err := d.Export(gates)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s %d", gateChildEnv, hex.EncodeToString(hd[:]), hex.EncodeToString(hg[:]), want))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "go" {
		stdin.Close()
		_ = cmd.Wait()
		t.Fatalf("the child did not start launching: %q\n%s", lines.Text(), stderr.String())
	}
	time.Sleep(20 * time.Millisecond) // launches running
	binary.LittleEndian.PutUint32(w[:], 0)
	if err := d.SideCopyIn(gates, w[:]); err != nil { // as a consumer shuts a gate
		t.Fatal(err)
	}
	var cnt [GateShards * 4]byte
	for deadline := time.Now().Add(10 * time.Second); ; {
		if err := d.SideCopyOut(cnt[:], gates+GateActiveOff); err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(cnt[:], make([]byte, len(cnt))) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("CTAs of the child still counted in a shut gate after 10 s")
		}
	}
	drained := make([]byte, gateBytes)
	if err := d.CopyOut(drained, dst); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // the child launches on, into a shut gate
	stdin.Close()
	var ok, shut int
	for lines.Scan() {
		switch lines.Text() {
		case "ok":
			ok++
		case "shut":
			shut++
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child: %v\n%s", err, stderr.String())
	}
	after := make([]byte, gateBytes)
	if err := d.CopyOut(after, dst); err != nil {
		t.Fatal(err)
	}
	if i := firstDiff(after, drained); i >= 0 {
		t.Fatalf("byte %d of the consumer's memory changed after its gate drained", i)
	}
	if ok == 0 || shut == 0 {
		t.Fatalf("the child's launches: %d copied, %d shut; want both (some before the shut, some after)", ok, shut)
	}
	t.Logf("the child's launches: %d copied before the shut, %d found the gate shut; nothing landed after the drain", ok, shut)
}
