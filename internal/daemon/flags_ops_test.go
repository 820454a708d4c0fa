package daemon

import (
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// A word on the command line that is no flag is refused, naming it: the
// flag package stops at the first one, so "-insecure-peers true -socket
// /x" (a bool flag takes no separate value) dropped -socket and every
// flag after it without a word, and kvxferd served on the defaults.
func TestStrayArgumentRefused(t *testing.T) {
	for _, args := range [][]string{
		{"-no-same-host", "true", "-socket", "/tmp/kvxferd-ops.sock"},
		{"-socket", "/tmp/kvxferd-ops.sock", "extra"},
	} {
		c, err := parseFlags(args)
		if err == nil {
			t.Errorf("%q accepted (socket %q): want an error naming the stray argument", args, c.socket)
			continue
		}
		if !strings.Contains(err.Error(), "unexpected argument") {
			t.Errorf("%q: %v, want an error naming the stray argument", args, err)
		}
	}
}

// A KVXFERD_ variable that names no flag is refused, naming it: a typo
// (KVXFERD_PEER_SECRET for KVXFERD_PEER_SECRET_FILE) was ignored, and the
// daemon started on the default (a random secret no peer shares).
// KVXFERD_PROXY_* are kvxferd proxy's and left alone.
func TestUnknownEnvironmentRefused(t *testing.T) {
	t.Setenv("KVXFERD_PROXY_MODE", "pull")
	if _, err := parseFlags(nil); err != nil {
		t.Fatalf("KVXFERD_PROXY_MODE set: %v, want it left to kvxferd proxy", err)
	}
	t.Setenv("KVXFERD_PEER_SECRET", "/etc/kvxfer.secret")
	_, err := parseFlags(nil)
	if err == nil || !strings.Contains(err.Error(), "KVXFERD_PEER_SECRET") {
		t.Errorf("KVXFERD_PEER_SECRET set: %v, want an error naming the variable", err)
	}
}

// -socket-mode 0 is refused: no user could connect, and kvxferd served
// 0600 instead without a word.
func TestSocketModeZeroRefused(t *testing.T) {
	if _, err := parseFlags([]string{"-socket-mode", "0"}); err == nil || !strings.Contains(err.Error(), "-socket-mode = 0") {
		t.Errorf("-socket-mode 0: %v, want an error naming the flag and value", err)
	}
}

// -socket-mode is read in octal, as its help says and chmod reads it:
// 660 is 0660 (before, it was read as decimal 660, 01224, and refused),
// and -h shows the default as 0600 (before: 384).
func TestSocketModeIsOctal(t *testing.T) {
	for in, want := range map[string]uint{"660": 0o660, "0660": 0o660, "0o666": 0o666, "600": 0o600} {
		c, err := parseFlags([]string{"-socket-mode", in})
		if err != nil || uint(c.socketMode) != want {
			t.Errorf("-socket-mode %s: %v, %v; want %#o", in, c, err, want)
		}
	}
	for _, bad := range []string{"384", "0x1b6", "", "rw"} {
		if _, err := parseFlags([]string{"-socket-mode", bad}); err == nil || !strings.Contains(err.Error(), "socket-mode") {
			t.Errorf("-socket-mode %q: %v, want an error naming the flag", bad, err)
		}
	}
	var usage strings.Builder
	fs := flagSet(&config{})
	fs.SetOutput(&usage)
	fs.PrintDefaults()
	if !strings.Contains(usage.String(), "(default 0600)") {
		t.Errorf("-h does not show -socket-mode's default as 0600:\n%s", usage.String())
	}
}

// -peer-timeout below 50ms is refused: a consumer asks about a producer
// every -peer-timeout/5 but never more often than every 10ms, each probe
// given at least 10ms, so below 50ms the flag no longer meant what it
// says: one probe not answered within 10ms (a loaded host, a GC pause)
// failed every request waiting on a healthy producer (peer_gone).
// Negative (never) and 50ms and up are taken.
func TestPeerTimeoutTooShortRefused(t *testing.T) {
	for _, bad := range []string{"1ns", "10ms", "49ms"} {
		if _, err := parseFlags([]string{"-peer-timeout", bad}); err == nil || !strings.Contains(err.Error(), "-peer-timeout = ") {
			t.Errorf("-peer-timeout %s: %v, want an error naming the flag and value", bad, err)
		}
	}
	for _, ok := range []string{"-1s", "50ms", "5s"} {
		if _, err := parseFlags([]string{"-peer-timeout", ok}); err != nil {
			t.Errorf("-peer-timeout %s: %v", ok, err)
		}
	}
}

// A -ready-file kvxferd cannot write fails the start with an error naming
// the flag (it said only "open DIR/ready.tmp: no such file or
// directory"), and what started is stopped: no socket, no goroutine left.
func TestReadyFileErrorNamesFlag(t *testing.T) {
	before := runtime.NumGoroutine()
	c := testConfig(t)
	c.readyFile = filepath.Join(t.TempDir(), "missing", "ready")
	in, err := start(c, slog.New(slog.NewTextHandler(io.Discard, nil)), false)
	if err == nil {
		in.shutdown()
		t.Fatal("started with a -ready-file in a missing directory")
	}
	if !strings.Contains(err.Error(), "-ready-file") {
		t.Errorf("unwritable -ready-file: %v, want an error naming -ready-file", err)
	}
	if _, err := os.Stat(c.socket); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// -socket "" and a relative -shm-dir are refused naming the flag: the
// first failed as "chmod : no such file or directory", the second served
// and refused every engine's memory file (a path beneath a relative
// directory is never absolute). A -shm-dir that is no directory fails
// the start naming the flag, not every engine's hello.
func TestSocketAndShmDirChecked(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-socket", ""}, "-socket"},
		{[]string{"-shm-dir", "shm"}, `-shm-dir = "shm"`},
		{[]string{"-shm-dir", ""}, `-shm-dir = ""`},
	} {
		if _, err := parseFlags(tc.args); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
	before := runtime.NumGoroutine()
	c := testConfig(t)
	c.shmDir = filepath.Join(t.TempDir(), "missing")
	in, err := start(c, slog.New(slog.NewTextHandler(io.Discard, nil)), false)
	if err == nil {
		in.shutdown()
		t.Fatal("started with a -shm-dir that does not exist")
	}
	if !strings.Contains(err.Error(), "-shm-dir") {
		t.Errorf("missing -shm-dir: %v, want an error naming -shm-dir", err)
	}
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// A listener that cannot be opened fails the start naming its flag and
// value (a port in use, a socket in a directory that does not exist):
// before, "peer listener: listen tcp ...", "metrics listener: ..." and
// "engine socket: listen unix ..." named none.
func TestListenErrorsNameFlag(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	for _, tc := range []struct {
		name string
		set  func(c *config)
		want string
	}{
		{"peer port in use", func(c *config) { c.peerListen = taken.Addr().String() }, "-peer-listen " + taken.Addr().String()},
		{"metrics port in use", func(c *config) { c.metricsListen = taken.Addr().String() }, "-metrics-listen " + taken.Addr().String()},
		{"socket directory missing", func(c *config) { c.socket = filepath.Join(c.shmDir, "missing", "k.sock") }, "-socket "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := testConfig(t)
			c.insecurePeers = true
			tc.set(c)
			in, err := start(c, slog.New(slog.NewTextHandler(io.Discard, nil)), false)
			if err == nil {
				in.shutdown()
				t.Fatal("started")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("start: %v, want an error naming %q", err, tc.want)
			}
		})
	}
}

// -ready-file names the address of a daemon serving now: a stopped
// daemon's is removed as it shuts down, and an earlier run's (a daemon
// killed) as the next run opens its socket, even if that run then fails.
// Before, both stayed, naming an address no longer served, and whoever
// waited for the file after a restart went on at once.
func TestReadyFileRemovedWhenNotServing(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	c := testConfig(t)
	c.insecurePeers = true
	c.readyFile = filepath.Join(t.TempDir(), "ready")
	in, err := start(c, log, false)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(c.readyFile); err != nil || string(b) != in.advertise {
		t.Fatalf("-ready-file while serving: %q, %v; want %q", b, err, in.advertise)
	}
	in.shutdown()
	if b, err := os.ReadFile(c.readyFile); err == nil {
		t.Errorf("-ready-file after shutdown: %q, want it removed", b)
	}

	// An earlier run's file, then a start that fails after its socket
	// opened (its metrics port is taken).
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	if err := os.WriteFile(c.readyFile, []byte("127.0.0.1:1"), 0o600); err != nil {
		t.Fatal(err)
	}
	c.metricsListen = taken.Addr().String()
	if in, err := start(c, log, false); err == nil {
		in.shutdown()
		t.Fatal("started with its metrics port taken")
	}
	if b, err := os.ReadFile(c.readyFile); err == nil {
		t.Errorf("an earlier run's -ready-file after a failed start: %q, want it removed", b)
	}
}

// A -log-level that is none is refused naming the value and the levels it
// takes: before, "-log-level: slog: level string \"verbose\": unknown name".
func TestLogLevelRefusedNamingLevels(t *testing.T) {
	err := Main([]string{"-log-level", "verbose", "-socket", filepath.Join(t.TempDir(), "k.sock")})
	if err == nil || !strings.Contains(err.Error(), `-log-level = "verbose"`) || !strings.Contains(err.Error(), "debug, info, warn or error") {
		t.Errorf("Main(-log-level verbose) = %v, want an error naming the value and the levels", err)
	}
}
