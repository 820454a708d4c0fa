package shm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCreateMapShares(t *testing.T) {
	dir := t.TempDir()
	a, err := Create(dir, "kv", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Map(dir, filepath.Join(dir, "kv"), 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a.Bytes[100] = 42
	if b.Bytes[100] != 42 {
		t.Error("two mappings of one file do not share memory")
	}
	if err := b.Close(); err != nil || b.Close() != nil {
		t.Error("Close is not idempotent")
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
	tests := []struct {
		name, dir, path string
		size            uint64
		want            string
	}{
		{"too small", dir, filepath.Join(dir, "kv"), 8192, "declares 8192"},
		{"outside dir", other, filepath.Join(dir, "kv"), 4096, "not under"},
		{"escape", dir, filepath.Join(dir, "..", "x"), 4096, "not under"},
		{"missing", dir, filepath.Join(dir, "nope"), 4096, "no such file"},
		{"zero", dir, filepath.Join(dir, "kv"), 0, "size 0"},
		{"directory", filepath.Dir(dir), dir, 4096, "directory"},
	}
	for _, tc := range tests {
		if _, err := Map(tc.dir, tc.path, tc.size); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Map error = %v, want %q", tc.name, err, tc.want)
		}
	}
	if _, err := Create(dir, "kv", 4096); !os.IsExist(errUnwrap(err)) && err == nil {
		t.Error("Create over an existing file succeeded")
	}
}

func errUnwrap(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}
