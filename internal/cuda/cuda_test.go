package cuda

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// TestMain runs the child side of the IPC test when asked.
func TestMain(m *testing.M) {
	if arg := os.Getenv(gateChildEnv); arg != "" {
		if err := gateChild(arg); err != nil {
			fmt.Fprintln(os.Stderr, "gate child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if h := os.Getenv("KVXFER_CUDA_CHILD"); h != "" {
		if err := child(h); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

const ipcBytes = 8 << 20

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131 + i>>9)
	}
	return b
}

// patternSource opens device 0 and allocates n bytes of it holding
// pattern(n): a child process's source; done frees and closes them.
func patternSource(n int) (d *Device, src uint64, done func(), err error) {
	if d, err = Open(0); err != nil {
		return nil, 0, nil, err
	}
	if src, err = d.Alloc(n); err != nil {
		d.Close()
		return nil, 0, nil, err
	}
	done = func() { _ = d.Free(src); d.Close() }
	if err = d.CopyIn(src, pattern(n)); err != nil {
		done()
		return nil, 0, nil, err
	}
	return d, src, done, nil
}

// child: its own VRAM, filled with the pattern, is copied device to device
// into the parent's VRAM imported through the IPC handle.
func child(hexHandle string) error {
	raw, err := hex.DecodeString(hexHandle)
	if err != nil || len(raw) != 64 {
		return fmt.Errorf("handle %q", hexHandle)
	}
	var h Handle
	copy(h[:], raw)
	d, src, done, err := patternSource(ipcBytes)
	if err != nil {
		return err
	}
	defer done()
	dst, err := d.Import(h)
	if err != nil {
		return err
	}
	if err := d.CopyDevice(dst, src, ipcBytes); err != nil {
		return err
	}
	return d.Unmap(dst)
}

// A VRAM -> VRAM transfer between two processes through CUDA IPC import.
func TestIPCImportBetweenProcesses(t *testing.T) {
	d, err := Open(0)
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	dst, err := d.Alloc(ipcBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(dst)
	if err := d.CopyIn(dst, make([]byte, ipcBytes)); err != nil {
		t.Fatal(err)
	}
	h, err := d.Export(dst)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVXFER_CUDA_CHILD="+hex.EncodeToString(h[:]))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := make([]byte, ipcBytes)
	if err := d.CopyOut(got, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pattern(ipcBytes)) {
		t.Fatal("the parent's VRAM does not hold what the child copied into it")
	}
	t.Logf("%d MiB moved VRAM -> VRAM from a child process into ours through a CUDA IPC import", ipcBytes>>20)
}

func TestUnavailableWithoutGPU(t *testing.T) {
	if _, err := Open(0); err != nil && !errors.Is(err, ErrUnavailable) {
		var ce *Error
		if !errors.As(err, &ce) {
			t.Errorf("Open error %v is neither ErrUnavailable nor a driver Error", err)
		}
	}
}

// TestImportOwnHandle: a handle this process exported imports as the
// memory itself (CUDA opens a handle only in another process), counted:
// each Import's Unmap closes nothing, one more is the driver's (and
// fails: the memory is not an import); once the memory is freed its
// handle is the driver's to refuse.
func TestImportOwnHandle(t *testing.T) {
	d := openGPU(t)
	p, err := d.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	h, err := d.Export(p)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		q, err := d.Import(h)
		if err != nil || q != p {
			t.Fatalf("Import of our own handle: %#x, %v; want %#x", q, err, p)
		}
	}
	if err := d.CopyIn(p, pattern(1<<20)); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := d.Unmap(p); err != nil {
			t.Fatalf("Unmap %d of our own memory: %v", i, err)
		}
	}
	if err := d.Unmap(p); err == nil {
		t.Fatal("a third Unmap of two Imports of our own memory succeeded")
	}
	got := make([]byte, 1<<20)
	if err := d.CopyOut(got, p); err != nil || !bytes.Equal(got, pattern(1<<20)) {
		t.Fatalf("our memory after its Imports were unmapped: %v", err)
	}
	if err := d.Free(p); err != nil {
		t.Fatal(err)
	}
	if q, err := d.Import(h); err == nil {
		t.Fatalf("the handle of freed memory imported as %#x", q)
	}
}
