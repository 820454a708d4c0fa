// Package shm maps an engine's shared-memory files (its KV cache in host
// memory) into kvxferd, read-write and shared, so the backend moves bytes
// straight in and out of the engine's cache.
package shm

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Mapping is one mapped file. Its Bytes alias the engine's memory.
type Mapping struct {
	Path  string
	Bytes []byte
}

// Map maps size bytes of the file at path. The path must be a regular
// file under dir (kvxferd: /dev/shm) at least size bytes long.
func Map(dir, path string, size uint64) (*Mapping, error) {
	if size == 0 || size > 1<<46 {
		return nil, fmt.Errorf("shm: map %s: size %d, want 1..2^46", path, size)
	}
	clean := filepath.Clean(path)
	if dir != "" {
		d := filepath.Clean(dir) + string(filepath.Separator)
		if !strings.HasPrefix(clean, d) {
			return nil, fmt.Errorf("shm: map %s: not under %s", path, dir)
		}
	}
	f, err := os.OpenFile(clean, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: map: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("shm: map: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("shm: map %s: not a regular file", path)
	}
	if uint64(st.Size()) < size {
		return nil, fmt.Errorf("shm: map %s: file has %d bytes, the layout declares %d", path, st.Size(), size)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: mmap %s (%d bytes): %w", path, size, err)
	}
	return &Mapping{Path: clean, Bytes: b}, nil
}

// Close unmaps the file. It is idempotent.
func (m *Mapping) Close() error {
	if m.Bytes == nil {
		return nil
	}
	err := unix.Munmap(m.Bytes)
	m.Bytes = nil
	return err
}

// Create makes a shared-memory file of size bytes under dir and maps it
// (what an engine does; used by the demo and tests).
func Create(dir, name string, size uint64) (*Mapping, error) {
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("shm: create: %w", err)
	}
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("shm: create %s: %w", path, err)
	}
	f.Close()
	m, err := Map(dir, path, size)
	if err != nil {
		os.Remove(path)
	}
	return m, err
}
