package server

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// cutLink is a dialer over a link that can drop everything: while cut, a
// connection attempt hangs until its deadline (its SYNs lost, as TCP's
// are in a partition, even after the link heals), and the connections it
// made before are broken.
type cutLink struct {
	cut     atomic.Bool
	mu      sync.Mutex
	conns   []net.Conn
	started chan struct{} // a dial began while cut
}

func (l *cutLink) dial(ctx context.Context, addr string) (net.Conn, error) {
	if l.cut.Load() {
		select {
		case l.started <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return nil, ctx.Err()
	}
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, c)
		l.mu.Unlock()
	}
	return c, err
}

func (l *cutLink) partition() {
	l.cut.Store(true)
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
}

// A handshake right after a partition heals reaches the peer: the cached
// connection, stuck in an attempt begun during the partition, is not
// what it waits on (it used to fail within a second, naming the dial's
// i/o timeout, while the peer was back and its handshake had 5 s). A peer
// that refuses connections still fails a handshake fast.
func TestHandshakeAfterPartitionHeals(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterPeerServiceServer(srv, pb.UnimplementedPeerServiceServer{})
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	addr := ln.Addr().String()
	link := &cutLink{started: make(chan struct{}, 1)}
	r := NewPeerResolver(ResolverConfig{dial: link.dial})
	defer r.Close()
	// reached: the peer answered (it serves no handshake: Unimplemented).
	ask := func(timeout time.Duration) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		t0 := time.Now()
		_, _, _, _, err := r.handshakeOne(ctx, "E", addr)
		return time.Since(t0), err
	}
	if _, err := ask(5 * time.Second); status.Code(err) != codes.Unimplemented {
		t.Fatalf("handshake over a good link: %v, want the peer's Unimplemented", err)
	}
	link.partition()
	for range 2 { // liveness probes during the partition
		if _, err := ask(2500 * time.Millisecond); err == nil || status.Code(err) == codes.Unimplemented {
			t.Fatalf("handshake during the partition: %v, want it failed", err)
		}
	}
	// Heal while an attempt begun during the partition hangs.
	select {
	case <-link.started:
	case <-time.After(5 * time.Second):
	}
	select {
	case <-link.started:
	case <-time.After(5 * time.Second):
		t.Log("no connection attempt under way at the heal")
	}
	link.cut.Store(false)
	if took, err := ask(5 * time.Second); status.Code(err) != codes.Unimplemented {
		t.Errorf("handshake right after the partition healed: %v after %v, want the peer reached", err, took.Round(time.Millisecond))
	}
	// A peer that is gone (nothing listens) fails fast, not after the
	// handshake's whole timeout.
	srv.Stop()
	if took, err := ask(5 * time.Second); status.Code(err) != codes.Unavailable || took > 3*time.Second {
		t.Errorf("handshake with a peer that refuses: %v after %v, want Unavailable within one connection attempt", err, took.Round(time.Millisecond))
	}
}
