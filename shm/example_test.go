package shm_test

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvxfer/kvxfer/shm"
)

// Example creates an engine's KV cache file, writes to it, and maps it the
// way kvxferd does when the engine's hello names it.
func Example() {
	dir, _ := os.MkdirTemp("", "kvxfer-shm-example") // kvxferd's -shm-dir; shm.DefaultDir in production
	defer os.RemoveAll(dir)

	// The engine: a page-aligned file for 8 blocks of 256 bytes.
	size := shm.PageAlign(8 * 256)
	kv, err := shm.Create(dir, "engine-P-tp0", size)
	if err != nil {
		panic(err)
	}
	defer kv.Remove()
	copy(kv.Bytes[2*256:], "KV of block 2")

	// kvxferd, given path and size in the hello.
	daemon, err := shm.Map(dir, kv.Path, size)
	if err != nil {
		panic(err)
	}
	defer daemon.Close()
	fmt.Printf("%s: %q\n", filepath.Base(daemon.Path), daemon.Bytes[2*256:2*256+13])

	// A hello that declares more than the file holds is refused.
	_, err = shm.Map(dir, kv.Path, size+1)
	fmt.Println(err != nil)
	// Output:
	// engine-P-tp0: "KV of block 2"
	// true
}
