// Package daemontest runs kvxferd daemons as child processes, for tests,
// the demo (cmd/kvxfer-demo) and the P/D simulator (bench/pdsim): Start
// re-executes this binary as "serve" (which ServeIfChild, called first
// in main or TestMain, hands to daemon.Main), and Proc injects a
// daemon's faults: a crash (Kill), a freeze (Signal with SIGSTOP), a
// network namespace whose links a test cuts (StartIn), a descriptor limit
// (StartWrapped). kvxferd links none of it.
package daemontest

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// Proc is a kvxferd running as a child process.
type Proc struct {
	// Name is the daemon's name; Sock its engine socket; Peer the
	// address of its Peer service; Log the file its output goes to.
	Name, Sock, Peer, Log string
	cmd                   *exec.Cmd
	killed                bool
	// exited is closed when the process has exited (waitErr its Wait's
	// error): a daemon that exits while starting is seen at once.
	exited  chan struct{}
	waitErr error
}

// ServeIfChild makes this process the daemon when Start launched it (its
// first argument is "serve"): it runs daemon.Main and exits. Otherwise it
// returns at once. A program or test binary that starts daemons with Start
// calls it first thing in main or TestMain.
func ServeIfChild() {
	if len(os.Args) < 2 || os.Args[1] != "serve" {
		return
	}
	if err := daemon.Main(os.Args[2:]); err != nil {
		fmt.Fprintln(os.Stderr, "kvxferd:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Start runs "<this executable> serve" as a child process with its engine
// socket, log and ready file in dir, the given backend, peers on loopback,
// metrics off and the peer secret of dir (SecretFile: daemons started in
// one dir peer with each other), and waits until it serves. The
// executable calls ServeIfChild first (or hands a first argument "serve"
// to daemon.Main itself, as kvxferd does). extra flags are appended; with -insecure-peers,
// -peer-secret-file or -tls-* among them, no secret of dir is used.
func Start(dir, name, backend string, extra ...string) (*Proc, error) {
	return StartIn("", dir, name, backend, extra...)
}

// StartIn is Start inside network namespace netns ("": this one), run
// through "ip netns exec" (root only): daemons of a test on hosts it
// models, joined by links it can cut.
func StartIn(netns, dir, name, backend string, extra ...string) (*Proc, error) {
	var wrap []string
	if netns != "" {
		wrap = []string{"ip", "netns", "exec", netns}
	}
	return StartWrapped(wrap, dir, name, backend, extra...)
}

// StartWrapped is Start with the daemon run through the command wrap
// (e.g. "prlimit --nofile=300": a daemon short of descriptors).
func StartWrapped(wrap []string, dir, name, backend string, extra ...string) (*Proc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	if !slices.ContainsFunc(extra, func(a string) bool {
		return strings.Contains(a, "insecure-peers") || strings.Contains(a, "peer-secret-file") || strings.HasPrefix(strings.TrimLeft(a, "-"), "tls-")
	}) {
		secret, err := SecretFile(dir)
		if err != nil {
			return nil, err
		}
		extra = append([]string{"-peer-secret-file", secret}, extra...)
	}
	d := &Proc{Name: name, Sock: filepath.Join(dir, name+".sock"), Log: filepath.Join(dir, name+".log")}
	ready := filepath.Join(dir, name+".ready")
	logf, err := os.Create(d.Log)
	if err != nil {
		return nil, err
	}
	args := append([]string{"serve", "-socket", d.Sock, "-peer-listen", "127.0.0.1:0", "-metrics-listen", "",
		"-shm-dir", dir, "-ready-file", ready, "-drain-timeout", "5s", "-log-level", "warn", "-backend", backend}, extra...)
	if len(wrap) > 0 {
		args = append(append(slices.Clone(wrap[1:]), self), args...)
		self = wrap[0]
	}
	d.cmd = exec.Command(self, args...)
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	err = d.cmd.Start()
	logf.Close()
	if err != nil {
		return nil, err
	}
	d.exited = make(chan struct{})
	go func() { d.waitErr = d.cmd.Wait(); close(d.exited) }()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	limit := time.After(20 * time.Second)
	for {
		if b, err := os.ReadFile(ready); err == nil {
			d.Peer = string(b)
			return d, nil
		}
		select {
		case <-tick.C:
			continue
		case <-d.exited:
			return nil, fmt.Errorf("daemon %s exited while starting (%v); its log %s ends:\n%s", name, d.waitErr, d.Log, logTail(d.Log))
		case <-limit:
		}
		_ = d.Stop()
		return nil, fmt.Errorf("daemon %s did not become ready in 20 s; its log %s ends:\n%s", name, d.Log, logTail(d.Log))
	}
}

// logTail is the last 4 KiB of the log file path (what a daemon that
// failed to start said), or why it cannot be read.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return string(b)
}

// SecretFile returns dir's peer secret file (dir/peer.secret), making it
// with a random secret, readable by its owner only, the first time.
func SecretFile(dir string) (string, error) {
	path := filepath.Join(dir, "peer.secret")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, os.ErrExist) {
		return path, nil
	}
	if err != nil {
		return "", err
	}
	_, err = f.WriteString(base64.StdEncoding.EncodeToString(peerauth.RandomSecret()) + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return path, err
}

// Pid is the daemon's process id.
func (d *Proc) Pid() int { return d.cmd.Process.Pid }

// Signal sends sig to the daemon (SIGSTOP, SIGCONT: a daemon frozen for
// a while).
func (d *Proc) Signal(sig os.Signal) error { return d.cmd.Process.Signal(sig) }

// Freeze sends SIGSTOP and waits until every thread of the daemon has
// stopped (state T in /proc/PID/task/*/stat), up to 10 s. A stop is not
// in force when kill(2) returns: on a loaded host the daemon's threads
// run on for milliseconds, enough to take in and act on a step sent the
// moment Signal returns, which is what a test that freezes the daemon
// means to keep from it. Off Linux (no /proc) it waits 100 ms instead.
func (d *Proc) Freeze() error {
	if err := d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return err
	}
	pid := d.cmd.Process.Pid
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/task", pid)); err != nil {
		time.Sleep(100 * time.Millisecond)
		return nil
	}
	var running []string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if running = runningThreads(pid); len(running) == 0 {
			return nil
		}
	}
	return fmt.Errorf("daemon %s (pid %d): threads %v not stopped 10 s after SIGSTOP", d.Name, pid, running)
}

// runningThreads lists pid's threads that are not stopped, each as
// "TID:STATE" (none: every thread is stopped, or the process is gone).
func runningThreads(pid int) []string {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	var running []string
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // the thread ended
		}
		// "TID (COMM) STATE ...": COMM may hold spaces and parentheses.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || i+2 >= len(s) {
			continue
		}
		if st := s[i+2]; st != 'T' && st != 't' {
			running = append(running, filepath.Base(filepath.Dir(f))+":"+string(st))
		}
	}
	return running
}

// Kill sends SIGKILL and waits for the process to go (a crash).
func (d *Proc) Kill() error {
	if d.killed {
		return nil
	}
	d.killed = true
	_ = d.cmd.Process.Kill()
	<-d.exited
	return nil
}

// Stop sends SIGTERM and waits for a graceful exit (20 s, then SIGKILL).
func (d *Proc) Stop() error {
	if d.killed {
		return nil
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
		return d.waitErr
	case <-time.After(20 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.exited
		return fmt.Errorf("daemon %s ignored SIGTERM for 20 s", d.Name)
	}
}
