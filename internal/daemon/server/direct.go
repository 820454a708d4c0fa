package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A direct worker stream: WorkerService.Connect served to an engine in
// this process without gRPC (libkvxfer's in-process placement: the
// engine's Python calls the library, which hands it the kvxfer.v1
// messages, marshalled, in both directions). The same messages, the same
// server code (Connect), the caller known by construction: this
// process, its uid. Through gRPC in one process, each message crossed
// three Python threads (gRPC's sender, its poller, the stream's reader):
// 0.2-0.5 ms each way on the GPU machine (bench/RESULTS.md).

// MaxDirectMessage bounds one message an engine hands a direct stream:
// what the engine's gRPC stream takes (gRPC's default receive limit).
const MaxDirectMessage = 4 << 20

// directOut is how many marshalled messages a direct stream holds for
// its engine: past it the server's Send waits, as gRPC's flow control
// would make it.
const directOut = 1024

// ErrDirectEnded is the error of a message handed to a direct stream
// that ended (or whose sending side the engine closed).
var ErrDirectEnded = errors.New("server: the stream ended")

// DirectStream is one direct worker stream (OpenDirect). Its methods are
// safe for concurrent use.
type DirectStream struct {
	ctx    context.Context
	cancel context.CancelFunc
	in     chan *pb.ConnectRequest
	out    chan []byte
	ended  chan struct{}

	limits *limits // counts what the engine hands that is refused

	// What the server sent that a Put waiting for room took out of out
	// for the engine (the engine's own messages, taken in its place: see
	// Put), older than all in out; Take hands them first. omu guards it
	// and every receive from out, so that the engine takes the server's
	// messages in the order they were sent. wakeTake and wakePut (a token
	// each) say that the server sent something, or that backlog holds
	// something, to a Take and to a Put that wait.
	omu      sync.Mutex
	backlog  [][]byte
	wakeTake chan struct{}
	wakePut  chan struct{}

	mu       sync.Mutex // guards inClosed (close(in) once, no Put after it)
	inClosed bool

	// How the stream ended: written before ended is closed, read only
	// after it is (the close publishes them), so never under mu, which a
	// Put holds while it waits for room: recording the end under mu would
	// wait for that Put, which waits for the end.
	code codes.Code
	msg  string
}

// directAddr is a direct stream's peer address.
type directAddr struct{}

func (directAddr) Network() string { return "direct" }
func (directAddr) String() string  { return fmt.Sprintf("pid %d (in process)", os.Getpid()) }

var _ net.Addr = directAddr{}

// OpenDirect opens a direct worker stream and serves it (Connect) until
// it ends: the engine's bye and hang-up (CloseSend), Cancel, or the
// server's Close.
func (s *Server) OpenDirect() *DirectStream {
	ctx, cancel := context.WithCancel(peer.NewContext(s.life, &peer.Peer{Addr: directAddr{}, AuthInfo: ownStreamAuth()}))
	d := &DirectStream{ctx: ctx, cancel: cancel, in: make(chan *pb.ConnectRequest, 64), out: make(chan []byte, directOut),
		ended: make(chan struct{}), limits: s.limits, wakeTake: make(chan struct{}, 1), wakePut: make(chan struct{}, 1)}
	go func() {
		err := s.Connect(d)
		st := status.Convert(err)
		d.code, d.msg = st.Code(), st.Message()
		close(d.ended)
		cancel()
	}()
	return d
}

// Put hands the server one marshalled ConnectRequest. One too large, or
// that does not parse, is refused (counted: kvxfer_refused_total
// {reason="bad_message"}) and the stream goes on.
//
// A Put may wait for room (the server takes the engine's messages one at
// a time, and not while its sender waits for the engine to take what it
// sent: an engine that does not read is held). While it waits, it takes
// what the server sends into the stream's backlog, in the engine's place,
// as the reader of the engine's gRPC stream would: an engine that puts
// step after step on one thread and takes only later waited for its own
// Take (the server's sender full, its receiver behind it), for ever.
func (d *DirectStream) Put(b []byte) error {
	m := new(pb.ConnectRequest)
	if err := d.limits.parse("ConnectRequest", b, m); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.inClosed {
		return ErrDirectEnded
	}
	// An ended stream refuses first: the wait below picks at random among
	// what is ready, room in the buffer of a stream nobody reads again
	// among them.
	select {
	case <-d.ended:
		return ErrDirectEnded
	case <-d.ctx.Done():
		return ErrDirectEnded
	default:
	}
	select {
	case d.in <- m: // room: the backlog is for a Put that waits
		return nil
	default:
	}
	for {
		select {
		case d.in <- m:
			return nil
		case <-d.ended:
			return ErrDirectEnded
		case <-d.ctx.Done():
			return ErrDirectEnded
		case <-d.wakePut:
			d.omu.Lock()
			moved := false
			for drained := false; !drained; {
				select {
				case b := <-d.out:
					d.backlog = append(d.backlog, b)
					moved = true
				default:
					drained = true
				}
			}
			d.omu.Unlock()
			if moved {
				wake(d.wakeTake)
			}
		}
	}
}

// wake leaves c's token, if it is not there already.
func wake(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// next is the oldest message the server sent that the engine has not
// taken (the backlog's first, then out's), if any.
func (d *DirectStream) next() ([]byte, bool) {
	d.omu.Lock()
	defer d.omu.Unlock()
	if len(d.backlog) > 0 {
		b := d.backlog[0]
		d.backlog[0] = nil
		d.backlog = d.backlog[1:]
		if len(d.backlog) == 0 {
			d.backlog = nil
		}
		return b, true
	}
	select {
	case b := <-d.out:
		return b, true
	default:
		return nil, false
	}
}

// more reports whether a message is left to take (a Take that took one
// passes the token on to another that waits).
func (d *DirectStream) more() bool {
	d.omu.Lock()
	defer d.omu.Unlock()
	return len(d.backlog) > 0 || len(d.out) > 0
}

// CloseSend ends what the engine sends (gRPC's half-close): the server
// reads io.EOF after the messages handed before.
func (d *DirectStream) CloseSend() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.inClosed {
		d.inClosed = true
		close(d.in)
	}
}

// Cancel ends the stream at once (the engine hung up).
func (d *DirectStream) Cancel() { d.cancel() }

// Take returns the server's next message, marshalled, waiting up to
// wait for one (negative: as long as it takes). ok false and ended false:
// none came within wait. ended true: the stream ended and every message
// before its end was taken; code and msg say how (codes.OK: cleanly).
func (d *DirectStream) Take(wait time.Duration) (b []byte, ok, ended bool, code codes.Code, msg string) {
	var timeout <-chan time.Time
	for {
		// ended is looked at before what is left: what the server sent
		// before it ended is all there once it has (an ended stream says
		// so without waiting, whatever wait is).
		end := false
		select {
		case <-d.ended:
			end = true
		default:
		}
		if b, ok := d.next(); ok {
			if d.more() {
				wake(d.wakeTake)
			}
			return b, true, false, 0, ""
		}
		if end {
			return nil, false, true, d.code, d.msg // ended is closed: they are set
		}
		if timeout == nil && wait >= 0 {
			t := time.NewTimer(wait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-d.wakeTake:
		case <-d.ended:
		case <-timeout:
			return nil, false, false, 0, ""
		}
	}
}

// The server's side: grpc.BidiStreamingServer.

func (d *DirectStream) Context() context.Context { return d.ctx }

func (d *DirectStream) Recv() (*pb.ConnectRequest, error) {
	// What the engine put before it hung up (Cancel) is received first,
	// as a gRPC stream's messages that reached the daemon are: a step put
	// just before is taken in, and its requests' ends tell their peers.
	// Before, one select between the two dropped it half the time.
	select {
	case m, ok := <-d.in:
		if !ok {
			return nil, io.EOF
		}
		return m, nil
	default:
	}
	select {
	case m, ok := <-d.in:
		if !ok {
			return nil, io.EOF
		}
		return m, nil
	case <-d.ctx.Done():
		return nil, status.FromContextError(d.ctx.Err()).Err()
	}
}

func (d *DirectStream) Send(m *pb.ConnectResponse) error {
	b, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	select {
	case d.out <- b:
		wake(d.wakeTake)
		wake(d.wakePut)
		return nil
	case <-d.ctx.Done():
		return status.FromContextError(d.ctx.Err()).Err()
	}
}

func (d *DirectStream) SetHeader(metadata.MD) error  { return nil }
func (d *DirectStream) SendHeader(metadata.MD) error { return nil }
func (d *DirectStream) SetTrailer(metadata.MD)       {}

func (d *DirectStream) SendMsg(m any) error {
	r, ok := m.(*pb.ConnectResponse)
	if !ok {
		return fmt.Errorf("server: a direct stream sends ConnectResponse, not %T", m)
	}
	return d.Send(r)
}

func (d *DirectStream) RecvMsg(m any) error {
	r, ok := m.(*pb.ConnectRequest)
	if !ok {
		return fmt.Errorf("server: a direct stream receives ConnectRequest, not %T", m)
	}
	got, err := d.Recv()
	if err != nil {
		return err
	}
	proto.Merge(r, got)
	return nil
}

// CallDirect makes one SchedulerService call (method: its name, as
// "Step") without gRPC, for an engine of this process (libkvxfer's
// kvxfer_call): req is the marshalled request, the answer the
// marshalled response, or the call's gRPC status. The same handler as
// over gRPC, the caller this process; wait bounds it as a deadline would
// (0: none).
func (s *Server) CallDirect(method string, req []byte, wait time.Duration) (resp []byte, code codes.Code, msg string) {
	var h func(any, context.Context, func(any) error, grpc.UnaryServerInterceptor) (any, error)
	for _, m := range pb.SchedulerService_ServiceDesc.Methods {
		if m.MethodName == method {
			h = m.Handler
		}
	}
	if h == nil {
		return nil, codes.Unimplemented, fmt.Sprintf("server: no SchedulerService method %q", method)
	}
	ctx := peer.NewContext(s.life, &peer.Peer{Addr: directAddr{}, AuthInfo: ownAuth()})
	if wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, wait)
		defer cancel()
	}
	out, err := h(s.sched, ctx, func(v any) error {
		if err := s.limits.parse(method+" request", req, v.(proto.Message)); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
		return nil
	}, nil)
	if err != nil {
		st := status.Convert(err)
		return nil, st.Code(), st.Message()
	}
	b, err := proto.Marshal(out.(proto.Message))
	if err != nil {
		return nil, codes.Internal, err.Error()
	}
	return b, codes.OK, ""
}

// ownAuth is what a direct call's caller is: this process.
func ownAuth() EngineAuthInfo {
	return EngineAuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
		UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), PID: int32(os.Getpid())}
}

// ownStreamAuth is ownAuth with this process's groups: a direct worker
// stream's, whose hello may name shared-memory files (shm.MapAs).
func ownStreamAuth() EngineAuthInfo {
	ai := ownAuth()
	ai.Groups = []uint32{ai.GID}
	if gs, err := os.Getgroups(); err == nil {
		for _, g := range gs {
			ai.Groups = append(ai.Groups, uint32(g))
		}
	}
	return ai
}

// parse decodes what an engine handed without gRPC into m: one over
// MaxDirectMessage, or that does not parse, is refused and counted
// (bad_message).
func (l *limits) parse(what string, b []byte, m proto.Message) error {
	var err error
	if len(b) > MaxDirectMessage {
		err = fmt.Errorf("server: a %s of %d bytes (at most %d)", what, len(b), MaxDirectMessage)
	} else if perr := proto.Unmarshal(b, m); perr != nil {
		err = fmt.Errorf("server: a %s that does not parse: %w", what, perr)
	}
	if err != nil {
		l.refuse("bad_message")
	}
	return err
}
