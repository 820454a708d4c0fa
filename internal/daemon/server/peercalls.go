package server

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// Default bounds on the calls in flight on the Peer listener.
const (
	DefaultMaxPeerCallsPerConn = 128
	DefaultMaxPeerCalls        = 4096
)

// peerCalls counts the calls in flight on the Peer listener, by
// connection (its remote address) and in all.
type peerCalls struct {
	mu           sync.Mutex
	perConn, max int
	total        int
	by           map[string]int
	refuse       func(reason string)
}

// BoundPeerCalls returns the Peer server's option (grpc.InTapHandle)
// that bounds the calls in flight, of every method (handshakes, health
// checks and watches), per connection (perConn) and in all (max; each 0:
// the defaults). Peer connections are bounded per address and in all,
// not the streams over each: an authenticated peer could otherwise open
// any number of health watches over one connection, each a goroutine and
// buffers in the daemon until it ends them. A call past a bound is
// refused as its headers arrive, before its handler starts
// (ResourceExhausted, naming the flag; counted as peer_calls_per_conn or
// peer_calls), and the connection's other calls carry on. A call counts
// until it ends.
func (s *Server) BoundPeerCalls(perConn, max int) grpc.ServerOption {
	if perConn <= 0 {
		perConn = DefaultMaxPeerCallsPerConn
	}
	if max <= 0 {
		max = DefaultMaxPeerCalls
	}
	pc := &peerCalls{perConn: perConn, max: max, by: map[string]int{}, refuse: s.limits.refuse}
	return grpc.InTapHandle(pc.admit)
}

func (pc *peerCalls) admit(ctx context.Context, info *tap.Info) (context.Context, error) {
	conn := "?"
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		conn = p.Addr.String()
	}
	pc.mu.Lock()
	switch {
	case pc.total >= pc.max:
		pc.mu.Unlock()
		pc.refuse("peer_calls")
		return ctx, status.Errorf(codes.ResourceExhausted, "%s: %d calls in flight on the Peer listener, the daemon's most (kvxferd -max-peer-calls)",
			info.FullMethodName, pc.max)
	case pc.by[conn] >= pc.perConn:
		pc.mu.Unlock()
		pc.refuse("peer_calls_per_conn")
		return ctx, status.Errorf(codes.ResourceExhausted, "%s: %d calls in flight on this connection (%s), the most one may have (kvxferd -max-peer-calls-per-conn)",
			info.FullMethodName, pc.perConn, conn)
	}
	pc.total++
	pc.by[conn]++
	pc.mu.Unlock()
	context.AfterFunc(ctx, func() {
		pc.mu.Lock()
		defer pc.mu.Unlock()
		pc.total--
		if pc.by[conn]--; pc.by[conn] <= 0 {
			delete(pc.by, conn)
		}
	})
	return ctx, nil
}
