package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/puzpuzpuz/xsync/v4"
)

// PeerResolver handshakes with peer daemons over PeerService; it keeps one
// client connection per address, at most MaxConns of them, closing the
// least recently used idle one to make room. It implements
// kvxfer.Resolver and is safe for concurrent use: a handshake to a
// connected address (every liveness probe) takes its connection without a
// lock; dialing, evicting and retiring connections take turns.
type PeerResolver struct {
	dec   *HandshakeDecoder
	cfg   ResolverConfig
	conns *xsync.Map[string, *peerConn]
	mu    sync.Mutex // dialing, eviction, retirement, Close
}

// peerConn is one cached connection. refs counts the calls using it; -1
// means closed (evicted, or retired and idle): it takes no new call.
type peerConn struct {
	cc       *grpc.ClientConn
	refs     atomic.Int32
	retired  atomic.Bool  // out of the cache: closed when no call uses it
	lastUsed atomic.Int64 // unix nanoseconds
}

// acquire counts a call on pc unless it is closed.
func (pc *peerConn) acquire() bool {
	for {
		n := pc.refs.Load()
		if n < 0 {
			return false
		}
		if pc.refs.CompareAndSwap(n, n+1) {
			pc.lastUsed.Store(time.Now().UnixNano())
			return true
		}
	}
}

// release ends a call on pc, closing pc if it was retired and this was
// its last call.
func (pc *peerConn) release() {
	if pc.refs.Add(-1) == 0 && pc.retired.Load() {
		pc.closeIdle()
	}
}

// closeIdle closes pc if no call uses it (once: the CAS claims it).
func (pc *peerConn) closeIdle() bool {
	if pc.refs.CompareAndSwap(0, -1) {
		_ = pc.cc.Close()
		return true
	}
	return false
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
	// Lookup, when set, finds the address of an engine named without
	// one (a registry: kvxferd -etcd). The address it gives is dialed
	// like any other: Allow and the peer credentials still apply.
	// It is given the handshake's context and returns once that is done,
	// at the latest: a registry that cannot be reached holds no
	// handshake, probe or worker's Close past it.
	Lookup func(ctx context.Context, engineID string) (string, error)

	// dial, when set, replaces the TCP dial of peer connections (tests:
	// a link that drops what is sent).
	dial func(ctx context.Context, addr string) (net.Conn, error)
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
	r := &PeerResolver{dec: NewHandshakeDecoder(), cfg: cfg, conns: xsync.NewMap[string, *peerConn]()}
	return r
}

// conn returns addr's connection, marked in use until done is called;
// fresh says it was dialed by this call.
func (r *PeerResolver) conn(addr string) (pc *peerConn, done func(), fresh bool, err error) {
	if pc, ok := r.conns.Load(addr); ok && !pc.retired.Load() && pc.acquire() {
		return pc, pc.release, false, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if pc, ok := r.conns.Load(addr); ok && !pc.retired.Load() && pc.acquire() {
		return pc, pc.release, false, nil // dialed meanwhile
	}
	r.conns.Delete(addr) // closed by eviction, if anything
	if err := checkPeerAddr(addr); err != nil {
		return nil, nil, false, err
	}
	if r.cfg.Allow != nil {
		if err := r.cfg.Allow(addr); err != nil {
			return nil, nil, false, err
		}
	}
	if r.conns.Size() >= r.cfg.MaxConns && !r.evictLocked() {
		return nil, nil, false, fmt.Errorf("%d peer connections in use, the most this daemon keeps", r.conns.Size())
	}
	// Reconnect within a second of a peer daemon coming back (gRPC's
	// default backoff grows to two minutes): a restarted peer is
	// handshaken again on the next request.
	opts := []grpc.DialOption{grpc.WithTransportCredentials(r.cfg.Creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxHandshake)),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6,
			Jitter: 0.2, MaxDelay: time.Second}, MinConnectTimeout: 2 * time.Second})}
	if r.cfg.dial != nil {
		opts = append(opts, grpc.WithContextDialer(r.cfg.dial))
	}
	// The dns scheme, named: gRPC would read a scheme in addr itself
	// ("unix:7600" is a unix socket) as the target's.
	c, err := grpc.NewClient("dns:///"+addr, opts...)
	if err != nil {
		return nil, nil, false, err
	}
	pc = &peerConn{cc: c}
	pc.acquire()
	r.conns.Store(addr, pc)
	return pc, pc.release, true, nil
}

// checkPeerAddr refuses a peer address that is not host:port over TCP:
// addresses come from engines' transfer params and the registry, and
// gRPC would take one such as "unix:///path" or "dns:///host:port" as
// a target of its own kind (a unix socket the engine's uid could not
// reach), or default a missing port.
func checkPeerAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err == nil {
		n, perr := strconv.Atoi(port)
		switch {
		case perr != nil || n < 1 || n > 65535 || strings.Trim(port, "0123456789") != "":
			err = fmt.Errorf("port %q", port)
		case host == "":
			err = errors.New("no host")
		case strings.Contains(host, ":"):
			if _, perr := netip.ParseAddr(host); perr != nil {
				err = fmt.Errorf("host %q", host)
			}
		case strings.ContainsFunc(host, func(c rune) bool {
			return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_')
		}):
			err = fmt.Errorf("host %q", host)
		}
	}
	if err != nil {
		return fmt.Errorf("peer address %q: want host:port (a host name or IP, a port of 1 to 65535): %w", addr, err)
	}
	return nil
}

// retire takes addr's connection pc out of the cache (the next handshake
// dials a new one) and closes it once no call uses it: a handshake that
// timed out may have gone into a connection that is dead without knowing
// it (a partition: TCP keeps retransmitting, further and further apart),
// and a peer that is back is reached at once over a new one.
func (r *PeerResolver) retire(addr string, pc *peerConn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cur, ok := r.conns.Load(addr); ok && cur == pc {
		r.conns.Delete(addr)
	}
	pc.retired.Store(true)
	pc.closeIdle()
}

// evictLocked closes the least recently used connection not in use; false
// when every one is in use.
func (r *PeerResolver) evictLocked() bool {
	for {
		var oldest string
		var victim *peerConn
		r.conns.Range(func(addr string, pc *peerConn) bool {
			if pc.refs.Load() == 0 && (victim == nil || pc.lastUsed.Load() < victim.lastUsed.Load()) {
				oldest, victim = addr, pc
			}
			return true
		})
		if victim == nil {
			return false
		}
		if victim.closeIdle() { // else a call took it meanwhile: look again
			r.conns.Delete(oldest)
			return true
		}
	}
}

// Conns returns how many peer connections the resolver keeps.
func (r *PeerResolver) Conns() int {
	return r.conns.Size()
}

// Handshake implements kvxfer.Resolver. The clock offset is the peer's
// clock minus the midpoint of the call.
//
// An engine whose ranks are served each by its own server (the
// in-process placement: the answer says rank_port_base) is asked at each
// rank's port for the ranks the first answer does not list, at once; the
// result lists every rank, under a generation that changes whenever one
// of theirs does (a rank's process restarted).
func (r *PeerResolver) Handshake(ctx context.Context, engineID, addr string) (kvxfer.HandshakeResult, error) {
	if addr == "" && r.cfg.Lookup != nil {
		a, err := r.cfg.Lookup(ctx, engineID)
		if err != nil {
			return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s: %w", engineID, err)
		}
		addr = a
	}
	out, leaving, base, rtt, err := r.handshakeOne(ctx, engineID, addr)
	switch {
	case err != nil:
		return out, err
	case base != 0:
		return r.spread(ctx, engineID, addr, base, out, leaving, rtt)
	case len(leaving) > 0:
		return kvxfer.HandshakeResult{}, leavingError(engineID, addr, out.Ranks, leaving)
	}
	return out, nil
}

// maxSpreadRanks bounds the ranks a spread engine is asked about (a peer
// names its TP and PP sizes).
const maxSpreadRanks = 1024

// spread completes first, the answer of one of an engine's per-rank
// servers at addr (with its ranks leaving apart), with the other ranks',
// asked at their ports.
//
// The clock offset is the sample of the quickest answer (the least round
// trip, SPEC §2): the offset is off by at most half its round trip, and
// the first answer's may be long (a new connection, a busy peer).
func (r *PeerResolver) spread(ctx context.Context, engineID, addr string, base uint32, first kvxfer.HandshakeResult,
	firstLeaving []kvxfer.RankInfo, firstRTT time.Duration) (kvxfer.HandshakeResult, error) {
	all := append(slices.Clip(first.Ranks), firstLeaving...)
	if len(all) == 0 {
		return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s at %s: no ranks", kvxfer.ErrBadMetadata, engineID, addr)
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s at %s: %w", engineID, addr, err)
	}
	tpSize, ppSize := all[0].Layout.TPSize, all[0].Layout.PPSize
	if tpSize <= 0 || ppSize <= 0 || tpSize*ppSize > maxSpreadRanks {
		return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s at %s: tp size %d pp size %d: want 1 to %d ranks in all",
			kvxfer.ErrBadMetadata, engineID, addr, tpSize, ppSize, maxSpreadRanks)
	}
	type rankGen struct {
		rank    kvxfer.RankInfo
		leaving bool // answered, as leaving
		gen     uint64
		offset  time.Duration
		rtt     time.Duration
		err     error
	}
	got := make([]rankGen, tpSize*ppSize)
	for i, ri := range all {
		l := &ri.Layout
		if l.PPRank < 0 || l.PPRank >= ppSize || l.TPRank < 0 || l.TPRank >= tpSize {
			return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s at %s: rank tp %d pp %d outside tp size %d pp size %d",
				kvxfer.ErrBadMetadata, engineID, addr, l.TPRank, l.PPRank, tpSize, ppSize)
		}
		got[l.PPRank*tpSize+l.TPRank] = rankGen{rank: ri, gen: first.Generation, leaving: i >= len(first.Ranks)}
	}
	var wg sync.WaitGroup
	for i := range got {
		if got[i].rank.EngineID != "" {
			continue // the first answer listed it
		}
		pp, tp := i/tpSize, i%tpSize
		port := RankPort(int(base), tpSize, pp, tp)
		if port > 65535 {
			return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s at %s: rank tp %d pp %d would be at port %d (rank_port_base %d)",
				kvxfer.ErrBadMetadata, engineID, addr, tp, pp, port, base)
		}
		at := net.JoinHostPort(host, strconv.Itoa(port))
		wg.Go(func() {
			res, leaving, b, rtt, err := r.handshakeOne(ctx, engineID, at)
			if err == nil && b != base {
				err = fmt.Errorf("%w: handshake %s at %s: rank_port_base %d, but %s says %d", kvxfer.ErrBadMetadata, engineID, at, b, addr, base)
			}
			if err != nil {
				got[i].err = fmt.Errorf("rank tp %d pp %d (port %d = rank_port_base %d + pp*%d + tp): %w", tp, pp, port, base, tpSize, err)
				return
			}
			for j, ri := range append(slices.Clip(res.Ranks), leaving...) {
				if ri.Layout.TPRank == tp && ri.Layout.PPRank == pp {
					got[i] = rankGen{rank: ri, gen: res.Generation, offset: res.ClockOffset, rtt: rtt, leaving: j >= len(res.Ranks)}
					return
				}
			}
			got[i].err = fmt.Errorf("%w: handshake %s at %s: rank tp %d pp %d is not served there", kvxfer.ErrBadMetadata, engineID, at, tp, pp)
		})
	}
	wg.Wait()
	out := kvxfer.HandshakeResult{ClockOffset: first.ClockOffset}
	best := firstRTT
	gens := make([]uint64, len(got))
	var unanswered error
	var answered, published, leaving []kvxfer.RankInfo
	for i := range got {
		switch {
		case got[i].err != nil:
			if unanswered == nil {
				unanswered = got[i].err
			}
			continue
		case got[i].leaving:
			leaving = append(leaving, got[i].rank)
		default:
			published = append(published, got[i].rank)
		}
		answered = append(answered, got[i].rank)
	}
	if unanswered != nil {
		// Some ranks did not answer (a rank's process died): the handshake
		// fails, naming the first; the ranks that answered still say who
		// speaks for them (kvxfer.PartialHandshakeError).
		return kvxfer.HandshakeResult{}, &kvxfer.PartialHandshakeError{Answered: answered, Err: unanswered}
	}
	if len(leaving) > 0 {
		return kvxfer.HandshakeResult{}, leavingError(engineID, addr, published, leaving)
	}
	for i := range got {
		if got[i].rtt > 0 && got[i].rtt < best {
			out.ClockOffset, best = got[i].offset, got[i].rtt
		}
		out.Ranks = append(out.Ranks, got[i].rank)
		gens[i] = got[i].gen
	}
	out.Generation = spreadGeneration(len(gens), func(i int) uint64 { return gens[i] })
	return out, nil
}

// spreadGeneration is the generation of a spread engine of n ranks whose
// servers answered gen(i) for rank i (pp major): it changes whenever one
// of theirs does. The engine's scheduler stamps the same on its params
// (Server.generation). It is FNV-1a of the generations' little-endian
// bytes, computed in place (no allocation: a scheduler asks at each
// request it holds).
func spreadGeneration(n int, gen func(i int) uint64) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := range n {
		g := gen(i)
		for range 8 {
			h = (h ^ (g & 0xff)) * prime
			g >>= 8
		}
	}
	return max(h, 1)
}

// handshakeOne asks the server at addr about an engine, and returns its
// answer's rank_port_base and the call's round trip (its clock offset's
// bound: half of it).
func (r *PeerResolver) handshakeOne(ctx context.Context, engineID, addr string) (_ kvxfer.HandshakeResult, leaving []kvxfer.RankInfo, base uint32, rtt time.Duration, err error) {
	pc, done, fresh, err := r.conn(addr)
	if err != nil {
		return kvxfer.HandshakeResult{}, nil, 0, 0, fmt.Errorf("handshake %s at %s: %w", engineID, addr, err)
	}
	req := &pb.HandshakeRequest{EngineId: engineID, AcceptZstd: true}
	t0 := time.Now()
	resp, err := pb.NewPeerServiceClient(pc.cc).Handshake(ctx, req)
	if status.Code(err) == codes.Unavailable && ctx.Err() == nil && !fresh {
		// A cached connection that fails at once says little of the peer
		// now: it may be waiting out its backoff after the peer went away
		// (a restarted daemon), or be stuck in a connection attempt begun
		// during a partition (its SYN lost, the next one seconds away,
		// while gRPC fails calls at once until an attempt succeeds). Ask
		// again over a new connection: one whole attempt, within ctx, so
		// a peer that is back is reached now and one that refuses still
		// fails fast.
		r.retire(addr, pc)
		done()
		var again *peerConn
		again, done, _, err = r.conn(addr)
		if err != nil {
			return kvxfer.HandshakeResult{}, nil, 0, 0, fmt.Errorf("handshake %s at %s: %w", engineID, addr, err)
		}
		pc = again
		t0 = time.Now()
		resp, err = pb.NewPeerServiceClient(pc.cc).Handshake(ctx, req)
	}
	defer done()
	t1 := time.Now()
	if status.Code(err) == codes.DeadlineExceeded {
		r.retire(addr, pc)
	}
	if err != nil {
		if r.cfg.Insecure && status.Code(err) == codes.Unavailable {
			return kvxfer.HandshakeResult{}, nil, 0, 0, fmt.Errorf("handshake %s at %s: %w (this daemon runs with -insecure-peers: "+
				"a peer that authenticates its peers refuses it; give both the same -peer-secret-file)", engineID, addr, err)
		}
		if r.cfg.TLS && status.Code(err) == codes.Unavailable {
			return kvxfer.HandshakeResult{}, nil, 0, 0, fmt.Errorf("handshake %s at %s: %w (mutual TLS: the peer must present a certificate "+
				"of this daemon's -tls-ca, and this daemon one of the peer's)", engineID, addr, err)
		}
		return kvxfer.HandshakeResult{}, nil, 0, 0, fmt.Errorf("handshake %s at %s: %w", engineID, addr, err)
	}
	out, leaving, err := r.dec.decode(engineID, resp)
	if err != nil {
		return kvxfer.HandshakeResult{}, nil, 0, 0, err
	}
	mid := t0.Add(t1.Sub(t0) / 2)
	out.ClockOffset = time.Unix(0, resp.ServerUnixNanos).Sub(mid)
	return out, leaving, resp.GetRankPortBase(), t1.Sub(t0), nil
}

// Close closes the client connections.
func (r *PeerResolver) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.conns.Range(func(addr string, pc *peerConn) bool {
		_ = pc.cc.Close()
		r.conns.Delete(addr)
		return true
	})
	r.dec.Close()
}
