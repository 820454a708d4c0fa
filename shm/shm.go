package shm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
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
	file  *os.File
}

// File returns the mapped file, open (read-write) until Close or Remove:
// Bytes is its range [0, len(Bytes)). kvxferd hands a read-only reopening
// of it to a peer daemon of the same user on the same host, which then
// copies straight out of it (netxfer's same-host path).
func (m *Mapping) File() *os.File { return m.file }

// ErrRefused is the error of a file MapOwned will not map. Its message
// is the same whatever the reason (missing, a symlink, outside the
// directory, not a regular file, another user's), so it reveals nothing
// about files the caller does not own.
var ErrRefused = errors.New("refused")

// Map maps bytes [0, size) of the file at path, shared and read-write,
// applying kvxferd's rules (see the package doc) with the caller's
// effective uid and groups as the owner: MapAs(dir, path, size, that
// Cred). With dir empty (a program mapping a path it chose itself) only
// the size and the file's type are checked. An engine may call it to map
// a file it made earlier.
func Map(dir, path string, size uint64) (*Mapping, error) {
	if dir != "" {
		c := Cred{UID: uint32(os.Geteuid()), Groups: []uint32{uint32(os.Getegid())}}
		if gs, err := os.Getgroups(); err == nil {
			for _, g := range gs {
				c.Groups = append(c.Groups, uint32(g))
			}
		}
		return MapAs(dir, path, size, c)
	}
	if size == 0 || size > MaxSize {
		return nil, fmt.Errorf("shm: map %s: size %d, want 1..2^46", path, size)
	}
	clean := filepath.Clean(path)
	pfd, err := unix.Open(clean, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: map %s: %w", path, err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return nil, fmt.Errorf("shm: map %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("shm: map %s: not a regular file", path)
	}
	fd, err := unix.Open(clean, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: map %s: %w", path, err)
	}
	defer unix.Close(fd)
	return mapFD(fd, path, clean, size, &st)
}

// Cred is whom a file is mapped for: a uid, and the groups it is in (its
// primary group and its supplementary groups; kvxferd takes them from the
// engine's unix socket, SO_PEERCRED and SO_PEERGROUPS).
type Cred struct {
	UID    uint32
	Groups []uint32
}

// MapOwned maps bytes [0, size) of the file at path, shared and
// read-write, as kvxferd does for an engine of uid owner whose groups it
// does not know: MapAs(dir, path, size, Cred{UID: owner}) (a directory
// on the way searchable by its group only is refused).
func MapOwned(dir, path string, size uint64, owner uint32) (*Mapping, error) {
	return MapAs(dir, path, size, Cred{UID: owner})
}

// MapAs maps bytes [0, size) of the file at path, shared and read-write,
// as kvxferd does for an engine of credentials c. It maps only a regular
// file owned by c.UID that lies beneath dir with no symlink on the way
// (openat2 with RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS, or a walk of
// every component with O_NOFOLLOW where openat2 is missing), through
// directories c may search (each directory beneath dir is opened and its
// owner, group and mode checked against c: a daemon running as root
// reaches no file its engine could not). The file is checked before it is
// opened read-write (a FIFO or a device is never opened), and the
// read-write open, from the same directory, is checked to be the same
// file. Anything else is an ErrRefused error that says the same for every
// reason; once the file is known to be the owner's, errors are specific
// (e.g. the file is shorter than size).
func MapAs(dir, path string, size uint64, c Cred) (*Mapping, error) {
	owner := c.UID
	if size == 0 || size > MaxSize {
		return nil, fmt.Errorf("shm: map %s: size %d, want 1..2^46", path, size)
	}
	refused := fmt.Errorf("shm: map %s: %w (want a regular file owned by uid %d beneath %s, no symlinks)", path, ErrRefused, owner, dir)
	if dir == "" {
		return nil, refused
	}
	cdir, clean := filepath.Clean(dir), filepath.Clean(path)
	rel, err := filepath.Rel(cdir, clean)
	if err != nil || !filepath.IsAbs(clean) || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return nil, refused
	}
	dfd, err := unix.Open(cdir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, refused
	}
	defer unix.Close(dfd)
	// The directories beneath dir, one at a time: each must be one c may
	// search.
	parts := strings.Split(rel, "/")
	parent := dfd
	defer func() {
		if parent != dfd {
			unix.Close(parent)
		}
	}()
	for _, p := range parts[:len(parts)-1] {
		next, err := openBeneath(parent, p, unix.O_PATH|unix.O_DIRECTORY)
		if err != nil {
			return nil, refused
		}
		if parent != dfd {
			unix.Close(parent)
		}
		parent = next
		var st unix.Stat_t
		if err := unix.Fstat(parent, &st); err != nil || !searchable(&st, c) {
			return nil, refused
		}
	}
	name := parts[len(parts)-1]
	pfd, err := openBeneath(parent, name, unix.O_PATH)
	if err != nil {
		return nil, refused
	}
	var st unix.Stat_t
	err = unix.Fstat(pfd, &st)
	unix.Close(pfd)
	if err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != owner {
		return nil, refused
	}
	fd, err := openBeneath(parent, name, unix.O_RDWR|unix.O_NONBLOCK|unix.O_NOCTTY)
	if err != nil {
		return nil, refused
	}
	defer unix.Close(fd)
	var st2 unix.Stat_t
	if err := unix.Fstat(fd, &st2); err != nil || st2.Dev != st.Dev || st2.Ino != st.Ino {
		return nil, refused // replaced between the two opens
	}
	return mapFD(fd, path, clean, size, &st2)
}

// searchable reports whether a process of credentials c may search (pass
// through) the directory of stat st, by its mode bits: the owner's when c
// owns it, else the group's when c is in its group, else everyone's. uid
// 0 searches any directory. (ACLs are not read: a directory whose ACL
// grants more than its mode bits is refused.)
func searchable(st *unix.Stat_t, c Cred) bool {
	switch {
	case c.UID == 0:
		return true
	case st.Uid == c.UID:
		return st.Mode&unix.S_IXUSR != 0
	case slices.Contains(c.Groups, st.Gid):
		return st.Mode&unix.S_IXGRP != 0
	}
	return st.Mode&unix.S_IXOTH != 0
}

// walkOnly makes openBeneath walk the components even where openat2
// exists (tests of the fallback).
var walkOnly bool

// openBeneath opens rel (relative, cleaned) beneath the directory dfd
// with flags, following no symlink and never leaving the directory.
func openBeneath(dfd int, rel string, flags int) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC | unix.O_NOFOLLOW),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS}
	if !walkOnly {
		fd, err := unix.Openat2(dfd, rel, &how)
		if err != unix.ENOSYS {
			return fd, err
		}
	}
	// No openat2 (Linux < 5.6): walk the components, none a symlink.
	parts := strings.Split(rel, "/")
	cur := dfd
	for i, p := range parts {
		if p == "" || p == "." || p == ".." {
			if cur != dfd {
				unix.Close(cur)
			}
			return -1, unix.EACCES
		}
		f := unix.O_PATH | unix.O_DIRECTORY
		if i == len(parts)-1 {
			f = flags
		}
		next, err := unix.Openat(cur, p, f|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
		if cur != dfd {
			unix.Close(cur)
		}
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// mapFD maps [0, size) of the open regular file fd (st its stat).
func mapFD(fd int, path, clean string, size uint64, st *unix.Stat_t) (*Mapping, error) {
	if uint64(st.Size) < size {
		return nil, fmt.Errorf("shm: map %s: file has %d bytes, the layout declares %d", path, st.Size, size)
	}
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: mmap %s (%d bytes): %w", path, size, err)
	}
	kept, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		_ = unix.Munmap(b)
		return nil, fmt.Errorf("shm: map %s: keep the file open: %w", path, err)
	}
	return &Mapping{Path: clean, Bytes: b, file: os.NewFile(uintptr(kept), clean)}, nil
}

// Close unmaps the file; the file stays. It is idempotent. Bytes must not
// be used afterwards.
func (m *Mapping) Close() error {
	if m.Bytes == nil {
		return nil
	}
	err := unix.Munmap(m.Bytes)
	m.Bytes = nil
	if m.file != nil {
		err = errors.Join(err, m.file.Close())
		m.file = nil
	}
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
