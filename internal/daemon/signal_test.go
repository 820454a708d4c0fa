package daemon_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// A second SIGTERM or SIGINT while kvxferd shuts down gracefully forces it
// out at once (an operator's second Ctrl-C), instead of being swallowed
// until the drain ends (here -drain-timeout 60s, held open by an engine
// connection that does not end: a health Watch).
func TestSecondSignalForcesExit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			dir := t.TempDir()
			self, err := os.Executable()
			if err != nil {
				t.Fatal(err)
			}
			sock, ready := filepath.Join(dir, "k.sock"), filepath.Join(dir, "ready")
			cmd := exec.Command(self, "serve", "-socket", sock, "-peer-listen", "127.0.0.1:0", "-metrics-listen", "",
				"-shm-dir", dir, "-ready-file", ready, "-drain-timeout", "60s", "-insecure-peers", "-log-level", "warn")
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			defer func() {
				_ = cmd.Process.Kill()
				<-exited
			}()
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if _, err := os.Stat(ready); err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("not ready in 20 s")
				}
			}
			cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			w, err := healthpb.NewHealthClient(cc).Watch(ctx, &healthpb.HealthCheckRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if r, err := w.Recv(); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
				t.Fatalf("watch: %v, %v", r, err)
			}
			_ = cmd.Process.Signal(sig)
			if r, err := w.Recv(); err != nil || r.Status != healthpb.HealthCheckResponse_NOT_SERVING {
				t.Fatalf("watch after the first signal: %v, %v; want NOT_SERVING", r, err)
			}
			_ = cmd.Process.Signal(sig)
			select {
			case err := <-exited:
				exited <- err
				if err == nil {
					t.Error("forced exit reported success (exit status 0)")
				}
			case <-time.After(5 * time.Second):
				t.Fatal("kvxferd still running 5 s after a second signal")
			}
		})
	}
}

// SIGHUP neither stops kvxferd nor ends its serving: it is logged as
// ignored (kvxferd reloads nothing), and a SIGTERM after it still shuts
// down gracefully, status 0. Before, SIGHUP killed it at once (Go's
// default), without a word: no drain, its socket file left behind.
func TestSIGHUPIgnored(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	dir := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	sock, ready := filepath.Join(dir, "k.sock"), filepath.Join(dir, "ready")
	cmd := exec.Command(self, "serve", "-socket", sock, "-peer-listen", "127.0.0.1:0", "-metrics-listen", "",
		"-shm-dir", dir, "-ready-file", ready, "-insecure-peers", "-log-level", "warn")
	logs, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	logged := func() string { b, _ := os.ReadFile(logs.Name()); return string(b) }
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		<-exited
	}()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not ready in 20 s")
		}
	}
	_ = cmd.Process.Signal(syscall.SIGHUP)
	select {
	case err := <-exited:
		exited <- err
		t.Fatalf("kvxferd exited at SIGHUP: %v; logs:\n%s", err, logged())
	case <-time.After(500 * time.Millisecond):
	}
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if r, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health after SIGHUP: %v, %v; want SERVING", r, err)
	}
	if !strings.Contains(logged(), "SIGHUP ignored") {
		t.Errorf("SIGHUP not logged; logs:\n%s", logged())
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		exited <- err
		if err != nil {
			t.Errorf("exit after SIGTERM: %v, want status 0", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("kvxferd still running 20 s after SIGTERM")
	}
}
