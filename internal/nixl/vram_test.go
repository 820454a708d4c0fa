package nixl

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/cuda"
)

// TestVRAMWrite: NIXL (UCX) WRITEs GPU memory into GPU memory between two
// agents, with a notification. It needs NIXL and a GPU; it skips
// otherwise.
func TestVRAMWrite(t *testing.T) {
	d, err := cuda.Open(0)
	if errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	suffix := fmt.Sprint(rand.Uint64())
	mk := func(name string) *Agent {
		a, err := OpenVRAM(name+suffix, "UCX", nil)
		if errors.Is(err, ErrUnavailable) {
			t.Skipf("NIXL is not available here: %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = a.Close() })
		return a
	}
	a, b := mk("vram-a-"), mk("vram-b-")
	const n = 16 << 20
	src, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(src)
	dst, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(dst)
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i*17 + i>>11)
	}
	if err := d.CopyIn(src, want); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyIn(dst, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([][3]uint64{{src, n, 0}}); err != nil {
		t.Fatal(err)
	}
	if err := b.Register([][3]uint64{{dst, n, 0}}); err != nil {
		t.Fatal(err)
	}
	meta, err := b.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	peer, err := a.LoadPeer(meta)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	x, err := a.Post(true, peer, [][3]uint64{{src, dst, n}}, []byte("vram"))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		done, err := a.State(x)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("VRAM WRITE not done in 30 s")
		}
	}
	el := time.Since(start)
	got := make([]byte, n)
	if err := d.CopyOut(got, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("destination VRAM differs")
	}
	var notifs []Notif
	for deadline := time.Now().Add(10 * time.Second); len(notifs) == 0 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		notifs, _ = b.Drain(notifs)
	}
	if len(notifs) != 1 || string(notifs[0].Msg) != "vram" {
		t.Errorf("notifications = %+v", notifs)
	}
	t.Logf("NIXL UCX VRAM -> VRAM: %d MiB in %v (%.1f GB/s)", n>>20, el, float64(n)/el.Seconds()/1e9)
	_ = a.Release(x)
}

// TestMain lets TestIPCImportedVRAMWrite start this binary as the engine.
func TestMain(m *testing.M) {
	if os.Getenv("KVXFER_NIXL_ENGINE") != "" {
		os.Exit(engineChild())
	}
	os.Exit(m.Run())
}

const ipcN = 16 << 20

func ipcPattern() []byte {
	b := make([]byte, ipcN)
	for i := range b {
		b[i] = byte(i*29 + i>>13)
	}
	return b
}

// engineChild plays an engine: its KV lives in its own GPU memory, which
// it shares as a CUDA IPC handle (printed in hex), and keeps until stdin
// closes.
func engineChild() int {
	d, err := cuda.Open(0)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer d.Close()
	p, err := d.Alloc(ipcN)
	if err == nil {
		err = d.CopyIn(p, ipcPattern())
	}
	var h cuda.Handle
	if err == nil {
		h, err = d.Export(p)
	}
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println(hex.EncodeToString(h[:]))
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = d.Free(p)
	return 0
}

// TestIPCImportedVRAMWrite is the production path for GPU memory: an
// engine process shares its KV as a CUDA IPC handle; this process (the
// daemon) imports it, registers it with NIXL as VRAM, and WRITEs it into
// another agent's VRAM; every byte is checked.
func TestIPCImportedVRAMWrite(t *testing.T) {
	d, err := cuda.Open(0)
	if errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := Library(); err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVXFER_NIXL_ENGINE=1")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("engine: %v", err)
	}
	raw, err := hex.DecodeString(strings.TrimSpace(line))
	if err != nil || len(raw) != 64 {
		t.Fatalf("engine said %q", line)
	}
	var h cuda.Handle
	copy(h[:], raw)
	src, err := d.Import(h)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Unmap(src)
	suffix := fmt.Sprint(rand.Uint64())
	a, err := OpenVRAM("ipc-a-"+suffix, "UCX", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := OpenVRAM("ipc-b-"+suffix, "UCX", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	dst, err := d.Alloc(ipcN)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(dst)
	if err := d.CopyIn(dst, make([]byte, ipcN)); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([][3]uint64{{src, ipcN, 0}}); err != nil {
		t.Fatalf("register the imported VRAM: %v", err)
	}
	if err := b.Register([][3]uint64{{dst, ipcN, 0}}); err != nil {
		t.Fatal(err)
	}
	meta, _ := b.Metadata()
	peer, err := a.LoadPeer(meta)
	if err != nil {
		t.Fatal(err)
	}
	// Scattered 64 KiB blocks, reversed: what a KV transfer looks like.
	var descs [][3]uint64
	const blk = 64 << 10
	for i := range ipcN / blk {
		descs = append(descs, [3]uint64{src + uint64(i*blk), dst + uint64((ipcN/blk-1-i)*blk), blk})
	}
	x, err := a.Post(true, peer, descs, []byte("kv"))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		done, err := a.State(x)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not done in 30 s")
		}
	}
	got := make([]byte, ipcN)
	if err := d.CopyOut(got, dst); err != nil {
		t.Fatal(err)
	}
	want := ipcPattern()
	for i := range ipcN / blk {
		j := ipcN/blk - 1 - i
		if !bytes.Equal(got[j*blk:(j+1)*blk], want[i*blk:(i+1)*blk]) {
			t.Fatalf("block %d landed wrong", i)
		}
	}
	t.Logf("%d MiB of an engine process's VRAM, imported through CUDA IPC, written by NIXL into VRAM as %d blocks", ipcN>>20, len(descs))
	_ = a.Release(x)
}
