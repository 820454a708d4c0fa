package shm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// What Create makes, the daemon's Map accepts: both mappings share the
// file's memory, and the file has the mode and size the rules want.
func TestCreateMapShares(t *testing.T) {
	dir := t.TempDir()
	old := syscall.Umask(0o277) // a umask that would take the owner's write bit
	a, err := Create(dir, "kv", 1<<16)
	syscall.Umask(old)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	st, err := os.Stat(filepath.Join(dir, "kv"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode() != Mode || st.Size() != 1<<16 {
		t.Errorf("created file: mode %v, size %d; want %v, %d", st.Mode(), st.Size(), Mode, 1<<16)
	}
	if a.Path != filepath.Join(dir, "kv") || len(a.Bytes) != 1<<16 {
		t.Errorf("Create() = path %s, %d bytes; want %s, %d", a.Path, len(a.Bytes), filepath.Join(dir, "kv"), 1<<16)
	}
	b, err := Map(dir, a.Path, 1<<16) // as kvxferd maps it
	if err != nil {
		t.Fatalf("Map of a created file = %v, want it accepted", err)
	}
	defer b.Close()
	a.Bytes[100] = 42
	b.Bytes[200] = 7
	if b.Bytes[100] != 42 || a.Bytes[200] != 7 {
		t.Error("two mappings of one file do not share memory")
	}
	if _, err := Map(dir, a.Path, 1<<16+1); err == nil || !strings.Contains(err.Error(), "file has 65536 bytes, the layout declares 65537") {
		t.Errorf("Map with a size past the file = %v, want it refused", err)
	}
	if err := b.Close(); err != nil || b.Close() != nil {
		t.Error("Close is not idempotent")
	}
	if err := a.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.Path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("file after Remove: %v, want it gone", err)
	}
	if err := a.Remove(); err != nil {
		t.Errorf("second Remove = %v, want nil", err)
	}
}

func TestMapRefuses(t *testing.T) {
	dir := t.TempDir()
	m, err := Create(dir, "kv", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ro"), make([]byte, 4096), 0o400); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, dir, path string
		size            uint64
		want            string
	}{
		{"too small", dir, filepath.Join(dir, "kv"), 8192, "declares 8192"},
		{"outside dir", other, filepath.Join(dir, "kv"), 4096, "refused"},
		{"escape", dir, filepath.Join(dir, "..", "x"), 4096, "refused"},
		{"missing", dir, filepath.Join(dir, "nope"), 4096, "refused"},
		{"zero", dir, filepath.Join(dir, "kv"), 0, "size 0"},
		{"too large", dir, filepath.Join(dir, "kv"), MaxSize + 1, "want 1..2^46"},
		{"directory", filepath.Dir(dir), dir, 4096, "refused"},
		{"relative", dir, "kv", 4096, "refused"},
		// Root's file, mapped by uid 65534: not the caller's.
		{"not writable", dir, filepath.Join(dir, "ro"), 4096, "refused"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "not writable" && os.Geteuid() == 0 {
				// Root may write any file: map it as an unprivileged user.
				mapAsNobody(t, tc.dir, tc.path, tc.size, tc.want)
				return
			}
			if _, err := Map(tc.dir, tc.path, tc.size); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Map(%s, %s, %d) error = %v, want %q", tc.dir, tc.path, tc.size, err, tc.want)
			}
		})
	}
}

func TestCreateRefuses(t *testing.T) {
	dir := t.TempDir()
	m, err := Create(dir, "kv", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := Create(dir, "kv", 4096); !errors.Is(err, fs.ErrExist) {
		t.Errorf("Create over an existing file = %v, want fs.ErrExist", err)
	}
	for _, name := range []string{"", ".", "..", "a/b", "../kv2", "x\x00"} {
		if _, err := Create(dir, name, 4096); err == nil || !strings.Contains(err.Error(), "one path element") {
			t.Errorf("Create(%q) = %v, want a refusal naming the name", name, err)
		}
	}
	if _, err := Create(dir, "big", 0); err == nil || !strings.Contains(err.Error(), "size 0") {
		t.Errorf("Create of 0 bytes = %v, want refused", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("files left in dir: %v, want only kv", entries)
	}
}

func TestPageAlign(t *testing.T) {
	p := uint64(os.Getpagesize())
	for in, want := range map[uint64]uint64{0: 0, 1: p, p - 1: p, p: p, p + 1: 2 * p, 3 * p: 3 * p} {
		if got := PageAlign(in); got != want {
			t.Errorf("PageAlign(%d) = %d, want %d", in, got, want)
		}
	}
}

// mapAsNobody runs Map(dir, path, size) in this test binary re-executed as
// uid/gid 65534 (setpriv) and checks its error contains want.
func mapAsNobody(t *testing.T, dir, path string, size uint64, want string) {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv is needed to drop root for this case: %v", err)
	}
	for d := dir; d != "/" && d != "."; d = filepath.Dir(d) { // let nobody reach the file
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", os.Args[0], "-test.run=^TestMapAsChild$")
	cmd.Env = append(os.Environ(), "SHM_TEST_MAP_DIR="+dir, "SHM_TEST_MAP_PATH="+path, "SHM_TEST_MAP_SIZE="+strconv.FormatUint(size, 10))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), want) {
		t.Errorf("Map(%s, %s, %d) as uid 65534: %v\n%s\nwant an error with %q", dir, path, size, err, out, want)
	}
}

// TestMapAsChild is mapAsNobody's child: it prints Map's error.
func TestMapAsChild(t *testing.T) {
	dir, ok := os.LookupEnv("SHM_TEST_MAP_DIR")
	if !ok {
		return // run only as mapAsNobody's child
	}
	size, _ := strconv.ParseUint(os.Getenv("SHM_TEST_MAP_SIZE"), 10, 64)
	if m, err := Map(dir, os.Getenv("SHM_TEST_MAP_PATH"), size); err != nil {
		fmt.Println("Map error:", err)
	} else {
		m.Close()
		fmt.Println("Map succeeded")
	}
}

// MapOwned maps only a regular file of the owner beneath the directory,
// reached through no symlink; every refusal reads the same, so it reveals
// nothing about files that are not the owner's. Both ways of opening
// (openat2, and the component walk where openat2 is missing) are checked.
func TestMapOwnedRefuses(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("files of another owner need root to make (chown); CI runs as root")
	}
	for _, walk := range []bool{false, true} {
		t.Run(fmt.Sprintf("walk=%v", walk), func(t *testing.T) {
			walkOnly = walk
			defer func() { walkOnly = false }()
			dir := t.TempDir()
			outside := t.TempDir()
			mine := filepath.Join(dir, "mine") // uid 65534's
			if err := os.WriteFile(mine, make([]byte, 8192), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(mine, 65534, 65534); err != nil {
				t.Fatal(err)
			}
			theirs := filepath.Join(dir, "theirs") // root's
			if err := os.WriteFile(theirs, make([]byte, 8192), 0o600); err != nil {
				t.Fatal(err)
			}
			secret := filepath.Join(outside, "secret")
			if err := os.WriteFile(secret, make([]byte, 8192), 0o600); err != nil {
				t.Fatal(err)
			}
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			must(os.Symlink(theirs, filepath.Join(dir, "link")))
			must(os.Symlink(mine, filepath.Join(dir, "link-to-mine")))
			must(os.Symlink(outside, filepath.Join(dir, "dirlink")))
			must(os.Mkdir(filepath.Join(dir, "sub"), 0o755))
			must(os.Symlink(dir, filepath.Join(dir, "sub", "up")))
			must(unix.Mkfifo(filepath.Join(dir, "fifo"), 0o666))
			must(os.Chown(filepath.Join(dir, "fifo"), 65534, 65534))
			must(unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
			must(os.Chown(filepath.Join(dir, "null"), 65534, 65534))
			for _, p := range []string{
				theirs,                                                     // another user's file beneath the dir
				filepath.Join(dir, "link"),                                 // a symlink to it
				filepath.Join(dir, "link-to-mine"),                         // a symlink even to the owner's own file
				filepath.Join(dir, "dirlink", "secret"),                    // through a symlinked directory
				filepath.Join(dir, "sub", "up", "theirs"),                  // through a symlink deeper down
				filepath.Join(dir, "..", filepath.Base(outside), "secret"), // out with ..
				secret,                     // outside the dir
				filepath.Join(dir, "nope"), // missing
				filepath.Join(dir, "fifo"), // a FIFO (opening it read-write must not block)
				filepath.Join(dir, "null"), // a device
				filepath.Join(dir, "sub"),  // a directory
			} {
				_, err := MapOwned(dir, p, 4096, 65534)
				want := fmt.Sprintf("shm: map %s: refused (want a regular file owned by uid 65534 beneath %s, no symlinks)", p, dir)
				if !errors.Is(err, ErrRefused) || err.Error() != want {
					t.Errorf("MapOwned(%s) = %v\nwant %s", p, err, want)
				}
			}
			// The owner's own file maps, and the memory is the file's.
			m, err := MapOwned(dir, mine, 4096, 65534)
			if err != nil {
				t.Fatal(err)
			}
			copy(m.Bytes, "kv")
			m.Close()
			if b, _ := os.ReadFile(mine); string(b[:2]) != "kv" {
				t.Errorf("the mapping does not share the file's bytes")
			}
			// Once the file is the owner's, errors say what is wrong.
			if _, err := MapOwned(dir, mine, 16384, 65534); err == nil || !strings.Contains(err.Error(), "file has 8192 bytes, the layout declares 16384") {
				t.Errorf("MapOwned past the owner's file's end = %v", err)
			}
		})
	}
}

// A file of the owner's in a directory beneath dir that the owner cannot
// search (another user's 0700 directory) is refused: the daemon (root)
// must not reach for an engine what the engine's own uid could not. A
// directory the owner may search (its own, or one every user may search,
// or one whose group it is in) is fine.
func TestMapOwnedRefusesUnsearchableDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("directories of another owner need root to make (chown); CI runs as root")
	}
	for _, walk := range []bool{false, true} {
		t.Run(fmt.Sprintf("walk=%v", walk), func(t *testing.T) {
			walkOnly = walk
			defer func() { walkOnly = false }()
			dir := t.TempDir()
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			mk := func(sub string, uid, gid int, mode os.FileMode) string {
				d := filepath.Join(dir, sub)
				must(os.Mkdir(d, mode))
				must(os.Chmod(d, mode))
				must(os.Chown(d, uid, gid))
				f := filepath.Join(d, "kv")
				must(os.WriteFile(f, make([]byte, 8192), 0o600))
				must(os.Chown(f, 65534, 65534))
				return f
			}
			for _, p := range []string{
				mk("root-private", 0, 0, 0o700),       // root's, no search for others
				mk("root-readonly", 0, 0, 0o744),      // readable but not searchable
				mk("group-other", 0, 4242, 0o710),     // a group 65534 is not in
				mk("own-noexec", 65534, 65534, 0o670), // its own, with its bits off
			} {
				m, err := MapOwned(dir, p, 4096, 65534)
				if err == nil {
					m.Close()
				}
				want := fmt.Sprintf("shm: map %s: refused (want a regular file owned by uid 65534 beneath %s, no symlinks)", p, dir)
				if !errors.Is(err, ErrRefused) || err.Error() != want {
					t.Errorf("MapOwned(%s) = %v\nwant %s", p, err, want)
				}
			}
			for _, p := range []string{
				mk("own", 65534, 65534, 0o700), // its own directory
				mk("world", 0, 0, 0o711),       // searchable by all
				mk("sticky", 0, 0, 0o1777),     // like /dev/shm
			} {
				m, err := MapOwned(dir, p, 4096, 65534)
				if err != nil {
					t.Errorf("MapOwned(%s) = %v, want it mapped", p, err)
					continue
				}
				m.Close()
			}
		})
	}
}

// A directory beneath dir that the owner may search only through one of
// its groups is searchable when MapAs is told the groups, and not by
// MapOwned, which knows the uid only.
func TestMapAsGroupSearch(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("directories of another owner need root to make (chown); CI runs as root")
	}
	dir := t.TempDir()
	d := filepath.Join(dir, "group")
	if err := os.Mkdir(d, 0o710); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(d, 0, 4242); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(d, "kv")
	if err := os.WriteFile(p, make([]byte, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if m, err := MapAs(dir, p, 4096, Cred{UID: 65534, Groups: []uint32{65534, 4242}}); err != nil {
		t.Errorf("MapAs(%s) in group 4242 = %v, want it mapped", p, err)
	} else {
		m.Close()
	}
	if _, err := MapAs(dir, p, 4096, Cred{UID: 65534, Groups: []uint32{65534}}); !errors.Is(err, ErrRefused) {
		t.Errorf("MapAs(%s) not in group 4242 = %v, want refused", p, err)
	}
	if _, err := MapOwned(dir, p, 4096, 65534); !errors.Is(err, ErrRefused) {
		t.Errorf("MapOwned(%s) = %v, want refused (groups unknown)", p, err)
	}
}
