// Package agentrpc serves one kvxfer.Backend over a stream connection (a
// unix socket) with net/rpc, and drives it from another process through
// Client, itself a kvxfer.Backend. Tests use it to run the backend
// conformance suite between agents in separate processes (`kvxferd
// agent`): the agents' memory is a shared-memory file mapped both in the
// agent's process and in the test's, so the test reads and writes the
// bytes directly while every backend call crosses the socket.
//
// Errors keep kvxfer's sentinels across the connection (errors.Is works
// on the client's side); a call on a broken connection (the agent's
// process is gone) fails with kvxfer.ErrClosed.
package agentrpc

import (
	"errors"
	"fmt"
	"io"
	"net/rpc"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// Info describes the served agent.
type Info struct {
	// Pid is the agent process's id.
	Pid int
	// Region is the agent's memory (not registered yet), at the
	// addresses of the agent's process.
	Region kvxfer.MemRegion
}

// sentinels are the errors kept across the connection, by index.
var sentinels = [...]error{kvxfer.ErrClosed, kvxfer.ErrUnknownPeer, kvxfer.ErrUnknownXfer, kvxfer.ErrOutOfBounds,
	kvxfer.ErrBadMetadata, kvxfer.ErrXferFailed, kvxfer.ErrNotRegistered}

// Err is an error on the wire: its text and which sentinels it matches.
type Err struct {
	Msg   string
	Kinds uint32 // bit i: errors.Is(err, sentinels[i])
}

func toWire(err error) *Err {
	if err == nil {
		return nil
	}
	e := &Err{Msg: err.Error()}
	for i, s := range sentinels {
		if errors.Is(err, s) {
			e.Kinds |= 1 << i
		}
	}
	return e
}

// remoteError is an error the agent returned.
type remoteError struct {
	msg string
	is  []error
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return e.is }

func fromWire(e *Err) error {
	if e == nil {
		return nil
	}
	r := &remoteError{msg: e.Msg}
	for i, s := range sentinels {
		if e.Kinds&(1<<i) != 0 {
			r.is = append(r.is, s)
		}
	}
	return r
}

// Wire messages (calls without arguments take an int, gob sends no
// empty structs). Byte slices travel with a flag where nil and empty
// differ (gob sends an empty slice as nil).
type (
	ErrReply   struct{ Err *Err }
	BytesReply struct {
		B   []byte
		Err *Err
	}
	NameReply struct {
		Name kvxfer.PeerName
		Err  *Err
	}
	PostArgs struct {
		Op       hotpath.Op
		Peer     kvxfer.PeerName
		Descs    []hotpath.Desc
		Notif    []byte
		HasNotif bool
	}
	IDReply struct {
		ID  kvxfer.XferID
		Err *Err
	}
	StateReply struct {
		State kvxfer.XferState
		Err   *Err
	}
	NotifyArgs struct {
		Peer kvxfer.PeerName
		Msg  []byte
	}
	NotifsReply struct{ Notifs []kvxfer.Notif }
)

// service is the net/rpc receiver ("Agent").
type service struct {
	be     kvxfer.Backend
	info   Info
	closed chan struct{}
	once   sync.Once
}

func (s *service) Info(_ int, r *Info) error { *r = s.info; return nil }
func (s *service) Register(rs []kvxfer.MemRegion, r *ErrReply) error {
	r.Err = toWire(s.be.Register(rs))
	return nil
}
func (s *service) Deregister(rs []kvxfer.MemRegion, r *ErrReply) error {
	r.Err = toWire(s.be.Deregister(rs))
	return nil
}
func (s *service) LocalMetadata(_ int, r *BytesReply) error {
	b, err := s.be.LocalMetadata()
	r.B, r.Err = b, toWire(err)
	return nil
}
func (s *service) LoadPeer(meta []byte, r *NameReply) error {
	n, err := s.be.LoadPeer(meta)
	r.Name, r.Err = n, toWire(err)
	return nil
}
func (s *service) InvalidatePeer(p kvxfer.PeerName, r *ErrReply) error {
	r.Err = toWire(s.be.InvalidatePeer(p))
	return nil
}
func (s *service) Post(a PostArgs, r *IDReply) error {
	notif := a.Notif
	if a.HasNotif && notif == nil {
		notif = []byte{}
	}
	id, err := s.be.Post(a.Op, a.Peer, a.Descs, notif)
	r.ID, r.Err = id, toWire(err)
	return nil
}
func (s *service) State(id kvxfer.XferID, r *StateReply) error {
	st, err := s.be.State(id)
	r.State, r.Err = st, toWire(err)
	return nil
}
func (s *service) Release(id kvxfer.XferID, r *ErrReply) error {
	r.Err = toWire(s.be.Release(id))
	return nil
}
func (s *service) Notify(a NotifyArgs, r *ErrReply) error {
	msg := a.Msg
	if msg == nil {
		msg = []byte{}
	}
	r.Err = toWire(s.be.Notify(a.Peer, msg))
	return nil
}
func (s *service) DrainNotifs(_ int, r *NotifsReply) error {
	r.Notifs = s.be.DrainNotifs(nil)
	return nil
}

// Wait blocks until the backend signals Events, the backend is closed, or
// the timeout passes; it reports whether there was a signal.
func (s *service) Wait(timeout time.Duration, got *bool) error {
	t := time.NewTimer(min(max(timeout, time.Millisecond), 10*time.Second))
	defer t.Stop()
	select {
	case <-s.be.Events():
		*got = true
	case <-s.closed:
	case <-t.C:
	}
	return nil
}

// SameHostParts answers how many transfer parts the agent copied out of
// same-host peers' memory files (0 for a backend without that path).
func (s *service) SameHostParts(_ int, r *uint64) error {
	if b, ok := s.be.(interface{ SameHostParts() uint64 }); ok {
		*r = b.SameHostParts()
	}
	return nil
}

func (s *service) Close(_ int, r *ErrReply) error {
	r.Err = toWire(s.be.Close())
	s.once.Do(func() { close(s.closed) })
	return nil
}

// Serve serves be on conn until the client hangs up, then closes be. The
// caller's process is expected to exit then: a client closing the
// connection is a peer that goes away.
func Serve(conn io.ReadWriteCloser, be kvxfer.Backend, info Info) error {
	srv := rpc.NewServer()
	s := &service{be: be, info: info, closed: make(chan struct{})}
	if err := srv.RegisterName("Agent", s); err != nil {
		return err
	}
	srv.ServeConn(conn)
	s.once.Do(func() { close(s.closed) })
	return be.Close()
}

// Client is a kvxfer.Backend whose every call is served by an agent in
// another process (Serve). It is safe for concurrent use.
type Client struct {
	rpc    *rpc.Client
	events chan struct{}
	done   chan struct{}
	once   sync.Once
	info   Info
}

var _ kvxfer.Backend = (*Client)(nil)

// NewClient drives the agent served on conn; it asks for the agent's
// Info at once.
func NewClient(conn io.ReadWriteCloser) (*Client, error) {
	c := &Client{rpc: rpc.NewClient(conn), events: make(chan struct{}, 1), done: make(chan struct{})}
	if err := c.call("Info", 0, &c.info); err != nil {
		c.rpc.Close()
		return nil, err
	}
	go c.watch()
	return c, nil
}

// Info returns the agent's description.
func (c *Client) Info() Info { return c.info }

// watch turns the agent's event signals into signals on Events until the
// connection ends.
func (c *Client) watch() {
	defer close(c.done)
	for {
		var got bool
		if err := c.rpc.Call("Agent.Wait", 200*time.Millisecond, &got); err != nil {
			return
		}
		if got {
			select {
			case c.events <- struct{}{}:
			default:
			}
		}
	}
}

// call makes one call; a broken connection is ErrClosed.
func (c *Client) call(method string, args, reply any) error {
	err := c.rpc.Call("Agent."+method, args, reply)
	if err == nil {
		return nil
	}
	if errors.Is(err, rpc.ErrShutdown) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		strings.Contains(err.Error(), "connection reset") || strings.Contains(err.Error(), "broken pipe") {
		return fmt.Errorf("%w: agent %d: %w", kvxfer.ErrClosed, c.info.Pid, err)
	}
	return fmt.Errorf("agent %d: %s: %w", c.info.Pid, method, err)
}

// Register implements kvxfer.Backend.
func (c *Client) Register(rs []kvxfer.MemRegion) error {
	var r ErrReply
	if err := c.call("Register", rs, &r); err != nil {
		return err
	}
	return fromWire(r.Err)
}

// Deregister implements kvxfer.Backend.
func (c *Client) Deregister(rs []kvxfer.MemRegion) error {
	var r ErrReply
	if err := c.call("Deregister", rs, &r); err != nil {
		return err
	}
	return fromWire(r.Err)
}

// LocalMetadata implements kvxfer.Backend.
func (c *Client) LocalMetadata() ([]byte, error) {
	var r BytesReply
	if err := c.call("LocalMetadata", 0, &r); err != nil {
		return nil, err
	}
	return r.B, fromWire(r.Err)
}

// LoadPeer implements kvxfer.Backend.
func (c *Client) LoadPeer(meta []byte) (kvxfer.PeerName, error) {
	var r NameReply
	if err := c.call("LoadPeer", meta, &r); err != nil {
		return "", err
	}
	return r.Name, fromWire(r.Err)
}

// InvalidatePeer implements kvxfer.Backend.
func (c *Client) InvalidatePeer(p kvxfer.PeerName) error {
	var r ErrReply
	if err := c.call("InvalidatePeer", p, &r); err != nil {
		return err
	}
	return fromWire(r.Err)
}

// Post implements kvxfer.Backend.
func (c *Client) Post(op hotpath.Op, peer kvxfer.PeerName, descs []hotpath.Desc, notif []byte) (kvxfer.XferID, error) {
	var r IDReply
	if err := c.call("Post", PostArgs{Op: op, Peer: peer, Descs: descs, Notif: notif, HasNotif: notif != nil}, &r); err != nil {
		return 0, err
	}
	return r.ID, fromWire(r.Err)
}

// State implements kvxfer.Backend.
func (c *Client) State(id kvxfer.XferID) (kvxfer.XferState, error) {
	var r StateReply
	if err := c.call("State", id, &r); err != nil {
		return 0, err
	}
	return r.State, fromWire(r.Err)
}

// Release implements kvxfer.Backend.
func (c *Client) Release(id kvxfer.XferID) error {
	var r ErrReply
	if err := c.call("Release", id, &r); err != nil {
		return err
	}
	return fromWire(r.Err)
}

// Notify implements kvxfer.Backend.
func (c *Client) Notify(peer kvxfer.PeerName, msg []byte) error {
	var r ErrReply
	if err := c.call("Notify", NotifyArgs{Peer: peer, Msg: msg}, &r); err != nil {
		return err
	}
	return fromWire(r.Err)
}

// DrainNotifs implements kvxfer.Backend; on a broken connection it
// appends nothing.
func (c *Client) DrainNotifs(dst []kvxfer.Notif) []kvxfer.Notif {
	var r NotifsReply
	if err := c.call("DrainNotifs", 0, &r); err != nil {
		return dst
	}
	return append(dst, r.Notifs...)
}

// SameHostParts returns how many transfer parts the agent copied out of
// same-host peers' memory files (the built-in backend's same-host path).
func (c *Client) SameHostParts() (uint64, error) {
	var n uint64
	err := c.call("SameHostParts", 0, &n)
	return n, err
}

// Events implements kvxfer.Backend.
func (c *Client) Events() <-chan struct{} { return c.events }

// Close implements kvxfer.Backend: it closes the agent's backend and
// hangs up, which ends the agent (Serve returns). It is idempotent. It
// waits for the agent's answer as long as the connection lasts: whoever
// runs the agent bounds that (kvxfertest kills an agent that does not
// answer, which ends the connection and Close).
func (c *Client) Close() error {
	var err error
	c.once.Do(func() {
		var r ErrReply
		if err = c.rpc.Call("Agent.Close", 0, &r); err == nil {
			err = fromWire(r.Err)
		} else {
			err = fmt.Errorf("agent %d: close: %w", c.info.Pid, err)
		}
		_ = c.rpc.Close()
		<-c.done
	})
	return err
}
