package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// ErrPermission is the error of a call the caller may not make: an engine
// service reached other than through kvxferd's unix socket, or an engine
// whose ranks or scheduler belong to another uid. Status maps it to
// PermissionDenied.
var ErrPermission = errors.New("permission denied")

// EngineAuthInfo identifies the process behind an engine connection: the
// credentials the kernel recorded for the unix socket's peer
// (SO_PEERCRED) when it connected, and its groups (SO_PEERGROUPS).
type EngineAuthInfo struct {
	credentials.CommonAuthInfo
	UID, GID uint32
	PID      int32
	// Groups are the peer's primary group (GID) and its supplementary
	// groups: what it may search when kvxferd maps its files (shm.Cred).
	Groups []uint32
}

// AuthType implements credentials.AuthInfo.
func (EngineAuthInfo) AuthType() string { return "unix-peercred" }

// EngineCredentials returns the server credentials of kvxferd's engine
// listener (grpc.Creds): they accept unix-socket connections only and
// record each peer's uid, gid and pid, which WorkerService and
// SchedulerService require (engine services are reachable only there, and
// what an engine may touch is decided by its uid). Clients connect with
// insecure credentials: nothing is exchanged.
func EngineCredentials() credentials.TransportCredentials { return engineCreds{} }

// OwnProcessCredentials are EngineCredentials that accept connections
// from this process only (SO_PEERCRED pid == getpid): libkvxfer's
// in-process placement, whose abstract unix socket every process of the
// network namespace could reach. refused, when set, is called for each
// connection refused.
func OwnProcessCredentials(refused func()) credentials.TransportCredentials {
	return engineCreds{ownOnly: true, refused: refused}
}

type engineCreds struct {
	ownOnly bool
	refused func()
}

var errNotUnix = fmt.Errorf("%w: engine services are served on kvxferd's unix socket only", ErrPermission)

func (e engineCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, nil, errNotUnix
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, nil, err
	}
	var cred *unix.Ucred
	var groups []uint32
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		if cerr == nil {
			groups = peerGroups(int(fd), cred.Gid)
		}
	}); err != nil {
		return nil, nil, err
	}
	if cerr != nil {
		return nil, nil, fmt.Errorf("server: SO_PEERCRED: %w", cerr)
	}
	if e.ownOnly && int(cred.Pid) != os.Getpid() {
		if e.refused != nil {
			e.refused()
		}
		return nil, nil, fmt.Errorf("%w: engine connection from process %d: this in-process kvxfer serves its own process (%d) only",
			ErrPermission, cred.Pid, os.Getpid())
	}
	return c, EngineAuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
		UID: cred.Uid, GID: cred.Gid, PID: cred.Pid, Groups: groups}, nil
}

// ModeCredentials wraps engine credentials (EngineCredentials) so that
// they accept only the peers a unix socket file of permission mode,
// owned by this process's effective uid and gid, would let connect (write
// permission): the owner's bits for a peer of this uid, else the group's
// for a peer in this gid, else everyone's; uid 0 always. For an abstract
// socket (kvxferd -socket @name), which has no file and so no
// permissions: without it, -socket-mode (0600 by default: "only kvxferd's
// user") was ignored and every local user, in any container of the
// network namespace, reached the engine services. refused, when set, is
// called for each connection refused.
func ModeCredentials(c credentials.TransportCredentials, mode os.FileMode, refused func()) credentials.TransportCredentials {
	return modeCreds{TransportCredentials: c, mode: mode.Perm(), uid: uint32(os.Geteuid()), gid: uint32(os.Getegid()), refused: refused}
}

type modeCreds struct {
	credentials.TransportCredentials
	mode     os.FileMode
	uid, gid uint32
	refused  func()
}

// allows reports whether the mode lets a peer of uid and groups connect.
func (m modeCreds) allows(uid uint32, groups []uint32) bool {
	switch {
	case uid == 0:
		return true
	case uid == m.uid:
		return m.mode&0o200 != 0
	case slices.Contains(groups, m.gid):
		return m.mode&0o020 != 0
	}
	return m.mode&0o002 != 0
}

func (m modeCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := m.TransportCredentials.ServerHandshake(c)
	if err != nil {
		return conn, ai, err
	}
	e, ok := ai.(EngineAuthInfo)
	if !ok || !m.allows(e.UID, e.Groups) {
		if m.refused != nil {
			m.refused()
		}
		return nil, nil, fmt.Errorf("%w: engine connection of uid %d (process %d): the engine socket's mode %#o lets it not connect",
			ErrPermission, e.UID, e.PID, m.mode)
	}
	return conn, ai, nil
}

func (m modeCreds) Clone() credentials.TransportCredentials {
	m.TransportCredentials = m.TransportCredentials.Clone()
	return m
}

// BoundEngineConns wraps the engine listener's credentials (those of
// EngineCredentials or OwnProcessCredentials) so that the connections
// open at once are bounded, in all and per uid (Config.MaxEngineConns,
// MaxEngineConnsPerUID): a connection past a bound fails its handshake,
// is closed by gRPC before it reads a byte of it, and is counted
// (engine_conns, engine_conns_per_uid). Streams were bounded, not the
// connections under them: one user could hold connections that opened
// no stream (never sending even HTTP/2's preface past the handshake)
// until the daemon ran out of descriptors, and every engine's next
// connection, and every mapping, failed.
func (s *Server) BoundEngineConns(c credentials.TransportCredentials) credentials.TransportCredentials {
	return boundCreds{TransportCredentials: c, l: s.limits}
}

// BoundCalls returns the engine server's option (grpc.InTapHandle) that
// bounds the calls in flight, of every method, per uid and in all
// (Config.MaxCallsPerUID, MaxCalls): gRPC takes any number of streams
// over one connection, each a goroutine and buffers here, so one engine
// connection could otherwise grow the daemon without bound (a health
// watch lives until its caller ends it; a unary call whose request never
// comes waits for it). The check runs as the stream's headers arrive,
// before a goroutine is started for it or a byte of its request read; a
// call past the bound is refused at once (ResourceExhausted, naming the
// flag; counted as calls_per_uid or calls) and the caller's other calls
// carry on. A call counts until it ends (its context is done).
func (s *Server) BoundCalls() grpc.ServerOption { return grpc.InTapHandle(s.admitCall) }

func (s *Server) admitCall(ctx context.Context, info *tap.Info) (context.Context, error) {
	uid := uint32(0) // as BoundEngineConns counts a connection of unknown uid
	if ai, err := caller(ctx); err == nil {
		uid = ai.UID
	}
	done, err := s.limits.take(&s.limits.calls, uid, 1)
	if err != nil {
		return ctx, status.Errorf(codes.ResourceExhausted, "%s: %v", info.FullMethodName, err)
	}
	context.AfterFunc(ctx, done)
	return ctx, nil
}

type boundCreds struct {
	credentials.TransportCredentials
	l *limits
}

func (b boundCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := b.TransportCredentials.ServerHandshake(c)
	if err != nil {
		return conn, ai, err
	}
	uid := uint32(0)
	if e, ok := ai.(EngineAuthInfo); ok {
		uid = e.UID
	}
	done, err := b.l.take(&b.l.conns, uid, 1)
	if err != nil {
		return nil, nil, fmt.Errorf("server: engine connection of uid %d refused: %w", uid, err)
	}
	return &boundConn{Conn: conn, done: done}, ai, nil
}

func (b boundCreds) Clone() credentials.TransportCredentials {
	return boundCreds{TransportCredentials: b.TransportCredentials.Clone(), l: b.l}
}

// boundConn gives its connection's place back once closed.
type boundConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *boundConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}

// soPeerGroups is SO_PEERGROUPS (Linux 4.13), the same on every
// architecture.
const soPeerGroups = 59

// peerGroups returns gid and the supplementary groups the kernel recorded
// for the unix socket fd's peer when it connected (SO_PEERGROUPS). Where
// the kernel has none to give, it is gid alone: a directory the peer may
// search through a supplementary group only is then refused, never the
// other way round.
func peerGroups(fd int, gid uint32) []uint32 {
	groups := []uint32{gid}
	buf := make([]uint32, 64)
	for range 2 {
		n := uint32(len(buf) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, soPeerGroups,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
		switch {
		case errno == unix.ERANGE && int(n/4) > len(buf):
			buf = make([]uint32, n/4)
			continue
		case errno != 0:
			return groups
		}
		return append(groups, buf[:min(int(n/4), len(buf))]...)
	}
	return groups
}

func (engineCreds) ClientHandshake(_ context.Context, _ string, c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return c, EngineAuthInfo{}, nil
}

func (engineCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "unix-peercred"}
}

func (e engineCreds) Clone() credentials.TransportCredentials { return e }

func (engineCreds) OverrideServerName(string) error { return nil }

// caller is what the kernel recorded (SO_PEERCRED) of the engine process
// behind ctx's connection, or an ErrPermission error when ctx did not
// come through EngineCredentials (a TCP connection, or a server built
// without them).
func caller(ctx context.Context) (EngineAuthInfo, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return EngineAuthInfo{}, errNotUnix
	}
	ai, ok := p.AuthInfo.(EngineAuthInfo)
	if !ok {
		return EngineAuthInfo{}, errNotUnix
	}
	return ai, nil
}

// callerUID is the uid of the engine process behind ctx's connection (see
// caller).
func callerUID(ctx context.Context) (uint32, error) {
	ai, err := caller(ctx)
	return ai.UID, err
}
