package server

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// PeerResolver handshakes with peer daemons over PeerService; it keeps one
// client connection per address, at most MaxConns of them, closing the
// least recently used idle one to make room. It implements
// kvxfer.Resolver and is safe for concurrent use.
type PeerResolver struct {
	dec *HandshakeDecoder
	cfg ResolverConfig
	mu  struct {
		sync.Mutex
		conns map[string]*peerConn
	}
}

type peerConn struct {
	cc       *grpc.ClientConn
	lastUsed time.Time
	inUse    int
	retired  bool // out of the cache: closed when no call uses it
}

var _ kvxfer.Resolver = (*PeerResolver)(nil)

// ResolverConfig configures a PeerResolver. Zero fields mean the
// defaults.
type ResolverConfig struct {
	// Creds authenticate this daemon to its peers, and them to it
	// (default: none, insecure credentials).
	Creds credentials.TransportCredentials
	// Insecure says Creds authenticate nothing (kvxferd -insecure-peers):
	// a handshake refused at the transport then says so, since a peer
	// that authenticates refuses such a daemon.
	Insecure bool
	// TLS says Creds are mutual TLS (kvxferd -tls-*): a handshake refused
	// at the transport then says which certificates to check.
	TLS bool
	// Allow, when set, is asked about every peer address before it is
	// dialed (addresses come from engines' transfer params); its error
	// refuses the handshake and is part of the handshake's error.
	Allow func(addr string) error
	// MaxConns bounds the peer addresses the resolver keeps a connection
	// to (default 256): engines name the addresses, so their number is
	// theirs to grow.
	MaxConns int
}

// NewPeerResolver returns a resolver with cfg (the zero ResolverConfig:
// no authentication, any address).
func NewPeerResolver(cfg ResolverConfig) *PeerResolver {
	if cfg.Creds == nil {
		cfg.Creds = insecure.NewCredentials()
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 256
	}
	r := &PeerResolver{dec: NewHandshakeDecoder(), cfg: cfg}
	r.mu.conns = map[string]*peerConn{}
	return r
}

// conn returns addr's connection, marked in use until done is called.
func (r *PeerResolver) conn(addr string) (pc *peerConn, done func(), err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	pc = r.mu.conns[addr]
	if pc == nil {
		if r.cfg.Allow != nil {
			if err := r.cfg.Allow(addr); err != nil {
				return nil, nil, err
			}
		}
		if len(r.mu.conns) >= r.cfg.MaxConns && !r.evictLocked() {
			return nil, nil, fmt.Errorf("%d peer connections in use, the most this daemon keeps", len(r.mu.conns))
		}
		// Reconnect within a second of a peer daemon coming back (gRPC's
		// default backoff grows to two minutes): a restarted peer is
		// handshaken again on the next request.
		c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(r.cfg.Creds),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxHandshake)),
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6,
				Jitter: 0.2, MaxDelay: time.Second}, MinConnectTimeout: 2 * time.Second}))
		if err != nil {
			return nil, nil, err
		}
		pc = &peerConn{cc: c}
		r.mu.conns[addr] = pc
	}
	pc.inUse++
	pc.lastUsed = time.Now()
	return pc, func() {
		r.mu.Lock()
		pc.inUse--
		if pc.retired && pc.inUse == 0 {
			_ = pc.cc.Close()
		}
		r.mu.Unlock()
	}, nil
}

// retire takes addr's connection pc out of the cache (the next handshake
// dials a new one) and closes it once no call uses it: a handshake that
// timed out may have gone into a connection that is dead without knowing
// it (a partition: TCP keeps retransmitting, further and further apart),
// and a peer that is back is reached at once over a new one.
func (r *PeerResolver) retire(addr string, pc *peerConn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.mu.conns[addr] == pc {
		delete(r.mu.conns, addr)
	}
	if !pc.retired {
		pc.retired = true
		if pc.inUse == 0 {
			_ = pc.cc.Close()
		}
	}
}

// evictLocked closes the least recently used connection not in use; false
// when every one is in use.
func (r *PeerResolver) evictLocked() bool {
	var oldest string
	var at time.Time
	for addr, pc := range r.mu.conns {
		if pc.inUse == 0 && (oldest == "" || pc.lastUsed.Before(at)) {
			oldest, at = addr, pc.lastUsed
		}
	}
	if oldest == "" {
		return false
	}
	_ = r.mu.conns[oldest].cc.Close()
	delete(r.mu.conns, oldest)
	return true
}

// Conns returns how many peer connections the resolver keeps.
func (r *PeerResolver) Conns() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.mu.conns)
}

// Handshake implements kvxfer.Resolver. The clock offset is the peer's
// clock minus the midpoint of the call.
func (r *PeerResolver) Handshake(ctx context.Context, engineID, addr string) (kvxfer.HandshakeResult, error) {
	pc, done, err := r.conn(addr)
	if err != nil {
		return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s at %s: %w", engineID, addr, err)
	}
	defer done()
	c := pc.cc
	req := &pb.HandshakeRequest{EngineId: engineID, AcceptZstd: true}
	t0 := time.Now()
	resp, err := pb.NewPeerServiceClient(c).Handshake(ctx, req)
	if status.Code(err) == codes.Unavailable && ctx.Err() == nil {
		// The connection may be waiting out its backoff after the peer
		// went away: if the peer is back (a restarted daemon), reconnect
		// now and ask again, waiting a moment for the connection.
		c.ResetConnectBackoff()
		wctx, cancel := context.WithTimeout(ctx, time.Second)
		t0 = time.Now()
		again, err2 := pb.NewPeerServiceClient(c).Handshake(wctx, req, grpc.WaitForReady(true))
		cancel()
		if err2 == nil || (status.Code(err2) != codes.Unavailable && status.Code(err2) != codes.DeadlineExceeded) {
			resp, err = again, err2
		} // else the first answer says more (why the connection fails)
	}
	t1 := time.Now()
	if status.Code(err) == codes.DeadlineExceeded {
		r.retire(addr, pc)
	}
	if err != nil {
		if r.cfg.Insecure && status.Code(err) == codes.Unavailable {
			return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s at %s: %w (this daemon runs with -insecure-peers: "+
				"a peer that authenticates its peers refuses it; give both the same -peer-secret-file)", engineID, addr, err)
		}
		if r.cfg.TLS && status.Code(err) == codes.Unavailable {
			return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s at %s: %w (mutual TLS: the peer must present a certificate "+
				"of this daemon's -tls-ca, and this daemon one of the peer's)", engineID, addr, err)
		}
		return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s at %s: %w", engineID, addr, err)
	}
	out, err := r.dec.Decode(engineID, resp)
	if err != nil {
		return kvxfer.HandshakeResult{}, err
	}
	mid := t0.Add(t1.Sub(t0) / 2)
	out.ClockOffset = time.Unix(0, resp.ServerUnixNanos).Sub(mid)
	return out, nil
}

// Close closes the client connections.
func (r *PeerResolver) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.mu.conns {
		_ = c.cc.Close()
	}
	r.mu.conns = map[string]*peerConn{}
	r.dec.Close()
}
