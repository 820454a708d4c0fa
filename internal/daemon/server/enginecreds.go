package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// ErrPermission is the error of a call the caller may not make: an engine
// service reached other than through kvxferd's unix socket, or an engine
// whose ranks or scheduler belong to another uid. Status maps it to
// PermissionDenied.
var ErrPermission = errors.New("permission denied")

// EngineAuthInfo identifies the process behind an engine connection: the
// credentials the kernel recorded for the unix socket's peer
// (SO_PEERCRED) when it connected.
type EngineAuthInfo struct {
	credentials.CommonAuthInfo
	UID, GID uint32
	PID      int32
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
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
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
		UID: cred.Uid, GID: cred.Gid, PID: cred.Pid}, nil
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
