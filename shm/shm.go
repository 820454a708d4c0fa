package shm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

const (
	// DefaultDir is where kvxferd maps engines' files from unless it runs
	// with -shm-dir.
	DefaultDir = "/dev/shm"
	// Mode is the permission of the files Create makes: read-write for
	// their owner only.
	Mode fs.FileMode = 0o600
	// MaxSize bounds the bytes of one mapping.
	MaxSize = 1 << 46
)

// Mapping is one mapped file. Its Bytes alias the file's memory: what the
// engine writes there, the daemon reads, and the other way round. Bytes
// may be used from any goroutine until Close or Remove, which must not
// run concurrently with each other or with uses of Bytes.
type Mapping struct {
	Path  string
	Bytes []byte
}

// Map maps bytes [0, size) of the file at path, shared and read-write,
// applying kvxferd's rules (see the package doc): size in 1..MaxSize, path
// beneath dir (unchecked when dir is empty), a regular file the caller
// may read and write, at least size bytes long. kvxferd calls it with its
// -shm-dir for every SharedMemory entry of a hello; an engine may call it
// to map a file it made earlier.
func Map(dir, path string, size uint64) (*Mapping, error) {
	if size == 0 || size > MaxSize {
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

// Close unmaps the file; the file stays. It is idempotent. Bytes must not
// be used afterwards.
func (m *Mapping) Close() error {
	if m.Bytes == nil {
		return nil
	}
	err := unix.Munmap(m.Bytes)
	m.Bytes = nil
	return err
}

// Remove unmaps the file and deletes it. It is idempotent: a file gone
// already is not an error. A daemon that mapped the file keeps its
// mapping until it unmaps it.
func (m *Mapping) Remove() error {
	err := m.Close()
	if rerr := os.Remove(m.Path); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
		err = errors.Join(err, fmt.Errorf("shm: remove: %w", rerr))
	}
	return err
}

// Create makes a new file name of size bytes directly in dir, with Mode
// whatever the umask, and maps it: a file kvxferd maps when dir is its
// -shm-dir. name is one path element; an existing file is never replaced
// (the error matches fs.ErrExist). On error nothing is left behind.
func Create(dir, name string, size uint64) (*Mapping, error) {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return nil, fmt.Errorf("shm: create: name %q, want one path element", name)
	}
	if size == 0 || size > MaxSize {
		return nil, fmt.Errorf("shm: create %s: size %d, want 1..2^46", name, size)
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, Mode)
	if err != nil {
		return nil, fmt.Errorf("shm: create: %w", err)
	}
	err = f.Chmod(Mode) // the umask may have taken bits away
	if err == nil {
		err = f.Truncate(int64(size))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("shm: create %s: %w", path, err)
	}
	m, err := Map(dir, path, size)
	if err != nil {
		os.Remove(path)
	}
	return m, err
}

// PageAlign rounds size up to a multiple of the system's page size.
func PageAlign(size uint64) uint64 {
	p := uint64(os.Getpagesize())
	return (size + p - 1) / p * p
}
