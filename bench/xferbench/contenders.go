package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
)

// A contender moves one xcase's WRITE from this process's source mapping
// into the child's destination mapping. Adding one is a table entry: its
// receiving side, opened in the child, and its sending side, opened here
// with what the receiving side reported.
type contender struct {
	name string
	// what says in a few words what is measured (printed in the header).
	what string
	// avail returns why the contender cannot run here (nil: it can). It
	// runs in the parent before the child starts, and may set the
	// environment the child inherits.
	avail func() error
	// peer opens the receiving side in the child over its destination
	// mapping dst (nil: the contender needs none).
	peer func(o opts, dst []byte) (peerInfo, io.Closer, error)
	// open opens the sending side here.
	open func(o opts, e *sides, info peerInfo) (mover, error)
}

// opts are the settings shared by the contenders.
type opts struct {
	// Conns is the number of TCP connections (builtin, rawtcp).
	Conns int
}

// peerInfo is what a receiving side tells the sending side.
type peerInfo struct {
	Meta []byte `json:",omitempty"` // backend metadata to load
	Addr string `json:",omitempty"` // a TCP address to dial
}

// sides are the mappings as the parent sees them, and the child's
// address of its destination mapping (where descriptors point).
type sides struct {
	src, dst []byte   // the parent's mappings of the source and destination files
	srcFile  *os.File // the file src maps
	dstBase  uint64   // the child's address of dst
}

// mover is an open contender.
type mover interface {
	// write moves c's pieces once and returns the time from the start
	// (the post) to the sender knowing every byte landed.
	write(c xcase) (time.Duration, error)
	close() error
}

// xferTimeout bounds one transfer: a contender that hangs fails the run.
const xferTimeout = 2 * time.Minute

// contenders are the contenders in the order they are printed.
var contenders = []contender{
	builtinContender("builtin", "kvxfer/backend/tcp over loopback: one Post of every descriptor, Events until done",
		func(o opts) tcp.Config { return tcp.Config{Conns: o.Conns, DisableSameHost: true} }, false),
	builtinContender("samehost", "kvxfer/backend/tcp, same-host path: the source adopted with its file (MapFile), the receiver copies out of it",
		func(o opts) tcp.Config { return tcp.Config{Conns: o.Conns} }, true),
	rawContender("rawtcp", "Go TCP, same connections: writev per part, bufio(64 KiB)+ReadFull per piece, 1-byte ack", 64<<10),
	{name: "nixl", what: "kvxfer/backend/nixl (UCX, CPU memory; UCX_TLS=sm unless set): one Post, State polled until done",
		avail: nixlAvail, peer: nixlPeer, open: nixlOpen},
	{name: "memcpy", what: "copy() of every piece between two mappings in one goroutine of one process",
		open: func(_ opts, e *sides, _ peerInfo) (mover, error) { return memcpyMover{e}, nil }},
}

func findContender(name string) (contender, bool) {
	for _, c := range contenders {
		if c.name == name {
			return c, true
		}
	}
	return contender{}, false
}

// builtinContender is kvxfer's built-in backend with the configuration
// cfg makes: a variant (another netxfer option) is one more call in the
// table.
func builtinContender(name, what string, cfg func(opts) tcp.Config, withFile bool) contender {
	return contender{name: name, what: what,
		peer: func(o opts, dst []byte) (peerInfo, io.Closer, error) {
			b, err := tcp.New(cfg(o))
			if err != nil {
				return peerInfo{}, nil, err
			}
			meta, err := adopt(b, b.Map, dst)
			if err != nil {
				b.Close()
				return peerInfo{}, nil, err
			}
			return peerInfo{Meta: meta}, b, nil
		},
		open: func(o opts, e *sides, info peerInfo) (mover, error) {
			b, err := tcp.New(cfg(o))
			if err != nil {
				return nil, err
			}
			mapMem := b.Map
			if withFile {
				mapMem = func(base uint64, mem []byte) error { return b.MapFile(base, mem, e.srcFile, 0) }
			}
			return openBackend(b, mapMem, e, info, false)
		},
	}
}

// adopt maps and registers mem with b and returns b's metadata.
func adopt(b kvxfer.Backend, mapMem func(uint64, []byte) error, mem []byte) ([]byte, error) {
	base := addr(mem)
	if err := mapMem(base, mem); err != nil {
		return nil, fmt.Errorf("map: %w", err)
	}
	if err := b.Register([]kvxfer.MemRegion{{Addr: base, Len: uint64(len(mem)), Kind: kvxfer.MemDRAM}}); err != nil {
		return nil, fmt.Errorf("register: %w", err)
	}
	return b.LocalMetadata()
}

// openBackend makes b the sending side of a kvxfer.Backend contender.
func openBackend(b kvxfer.Backend, mapMem func(uint64, []byte) error, e *sides, info peerInfo, spin bool) (mover, error) {
	if _, err := adopt(b, mapMem, e.src); err != nil {
		b.Close()
		return nil, err
	}
	peer, err := b.LoadPeer(info.Meta)
	if err != nil {
		b.Close()
		return nil, fmt.Errorf("load peer: %w", err)
	}
	return &backendMover{b: b, peer: peer, e: e, spin: spin, timer: time.NewTimer(time.Hour)}, nil
}

// backendMover posts one WRITE of every piece through a kvxfer.Backend.
type backendMover struct {
	b     kvxfer.Backend
	peer  kvxfer.PeerName
	e     *sides
	spin  bool // poll State in a loop (NIXL: no completion callback) instead of waiting on Events
	timer *time.Timer
	c     xcase
	descs []hotpath.Desc
}

func (m *backendMover) write(c xcase) (time.Duration, error) {
	if m.c != c || m.descs == nil {
		// The list is the engine's to build (hotpath, benchmarked on its
		// own): built once per case, outside the timing.
		m.c, m.descs = c, m.descs[:0]
		src := addr(m.e.src)
		for i := range c.n() {
			m.descs = append(m.descs, hotpath.Desc{Local: src + uint64(c.srcOff(i)), Remote: m.e.dstBase + uint64(c.dstOff(i)), Len: uint64(c.piece)})
		}
	}
	m.timer.Reset(xferTimeout)
	defer m.timer.Stop()
	start := time.Now()
	id, err := m.b.Post(hotpath.OpWrite, m.peer, m.descs, nil)
	if err != nil {
		return 0, fmt.Errorf("post: %w", err)
	}
	defer m.b.Release(id)
	for {
		s, err := m.b.State(id)
		switch {
		case s == kvxfer.XferDone:
			return time.Since(start), nil
		case s != kvxfer.XferInProgress:
			return 0, fmt.Errorf("transfer %s: %w", s, err)
		case m.spin:
			select {
			case <-m.timer.C:
				return 0, fmt.Errorf("transfer still in progress after %v", xferTimeout)
			default:
			}
		default:
			select {
			case <-m.b.Events():
			case <-m.timer.C:
				return 0, fmt.Errorf("transfer still in progress after %v", xferTimeout)
			}
		}
	}
}

func (m *backendMover) close() error { return m.b.Close() }

// memcpyMover copies every piece in this process: the same-host upper
// bound (one copy, no system call, no second process).
type memcpyMover struct{ e *sides }

func (m memcpyMover) write(c xcase) (time.Duration, error) {
	start := time.Now()
	for i := range c.n() {
		copy(c.dst(m.e.dst, i), c.src(m.e.src, i))
	}
	return time.Since(start), nil
}

func (memcpyMover) close() error { return nil }

// Raw TCP: the baseline the built-in backend's TCP path is held to. A
// part's frame is a 12-byte header (piece size, first piece, pieces) and
// the pieces' bytes; the receiver knows the layout (xcase), so no
// descriptor table travels (the built-in backend sends 16 bytes per
// descriptor). The receiver reads through a 64 KiB bufio.Reader with
// io.ReadFull into each destination piece: pieces smaller than the
// buffer are copied out of large reads, larger ones are read straight
// into place (bufio passes a read at least as large as its buffer
// through). That is the faster honest choice here: reading every piece
// straight from the socket (bufSize 0) costs a system call per piece and
// moved 512 B pieces at 0.4 GB/s against 1.1-1.2 (8 and 64 MiB, 11
// interleaved rounds, 2 vCPUs); buffers of 16 KiB, 256 KiB and 1 MiB were
// within the noise of 64 KiB.
const rawHeader = 12

// rawContender is raw TCP whose receiver reads through a buffer of
// bufSize bytes (0: every piece read straight from the socket).
func rawContender(name, what string, bufSize int) contender {
	return contender{name: name, what: what, open: rawOpen,
		peer: func(_ opts, dst []byte) (peerInfo, io.Closer, error) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return peerInfo{}, nil, err
			}
			s := &rawServer{ln: ln, dst: dst, bufSize: bufSize, conns: map[net.Conn]bool{}}
			s.wg.Add(1)
			go s.accept()
			return peerInfo{Addr: ln.Addr().String()}, s, nil
		}}
}

type rawServer struct {
	ln      net.Listener
	dst     []byte
	bufSize int
	wg      sync.WaitGroup
	mu      sync.Mutex
	// conns are the accepted connections, closed by Close.
	conns  map[net.Conn]bool
	closed bool
}

func (s *rawServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = true
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

func (s *rawServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer c.Close()
	var r io.Reader = c
	if s.bufSize > 0 {
		r = bufio.NewReaderSize(c, s.bufSize)
	}
	var h [rawHeader]byte
	for {
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return
		}
		xc := xcase{piece: int(binary.LittleEndian.Uint32(h[0:]))}
		first, n := int(binary.LittleEndian.Uint32(h[4:])), int(binary.LittleEndian.Uint32(h[8:]))
		if xc.piece <= 0 || n <= 0 || 2*(first+n)*xc.piece > len(s.dst) { // the last piece ends at slot 2(first+n)
			fmt.Fprintf(os.Stderr, "xferbench child: rawtcp: part of %d pieces of %d B from %d outside the mapping\n", n, xc.piece, first)
			return
		}
		for i := first; i < first+n; i++ {
			if _, err := io.ReadFull(r, xc.dst(s.dst, i)); err != nil {
				return
			}
		}
		if _, err := c.Write([]byte{1}); err != nil {
			return
		}
	}
}

func (s *rawServer) Close() error {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	err := s.ln.Close()
	s.wg.Wait()
	return err
}

// rawOpen dials the receiver's connections.
func rawOpen(o opts, e *sides, info peerInfo) (mover, error) {
	m := &rawMover{e: e}
	for range o.Conns {
		c, err := net.DialTimeout("tcp", info.Addr, 5*time.Second)
		if err != nil {
			m.close()
			return nil, err
		}
		m.conns = append(m.conns, c)
	}
	return m, nil
}

type rawMover struct {
	e     *sides
	conns []net.Conn
	errs  []error
}

func (m *rawMover) write(c xcase) (time.Duration, error) {
	n := c.n()
	parts := min(len(m.conns), n)
	m.errs = append(m.errs[:0], make([]error, parts)...)
	deadline := time.Now().Add(xferTimeout)
	start := time.Now()
	var wg sync.WaitGroup
	for k := range parts {
		wg.Go(func() { m.errs[k] = m.part(m.conns[k], c, k*n/parts, (k+1)*n/parts, deadline) })
	}
	wg.Wait()
	d := time.Since(start)
	return d, errors.Join(m.errs...)
}

// part sends pieces [first, end) of c on conn and waits for the ack.
func (m *rawMover) part(conn net.Conn, c xcase, first, end int, deadline time.Time) error {
	if err := conn.SetDeadline(deadline); err != nil {
		return err
	}
	bufs := make(net.Buffers, 0, 1+end-first)
	h := make([]byte, rawHeader)
	binary.LittleEndian.PutUint32(h[0:], uint32(c.piece))
	binary.LittleEndian.PutUint32(h[4:], uint32(first))
	binary.LittleEndian.PutUint32(h[8:], uint32(end-first))
	bufs = append(bufs, h)
	for i := first; i < end; i++ {
		bufs = append(bufs, c.src(m.e.src, i))
	}
	if _, err := bufs.WriteTo(conn); err != nil {
		return fmt.Errorf("rawtcp: send: %w", err)
	}
	var ack [1]byte
	if _, err := io.ReadFull(conn, ack[:]); err != nil {
		return fmt.Errorf("rawtcp: ack: %w", err)
	}
	return nil
}

func (m *rawMover) close() error {
	for _, c := range m.conns {
		c.Close()
	}
	return nil
}

// NIXL over UCX between the two processes. On one host UCX moves the
// bytes with CMA (process_vm_writev: one copy, by the kernel) and its
// messages over shared memory; those transports need UCX's peer error
// handling off (bench/RESULTS.md, the conformance runs).
var nixlParams = map[string]string{"ucx_error_handling_mode": "none"}

// nixlAvail finds NIXL's library and sets the environment NIXL and UCX
// read when they load (as kvxferd does), inherited by the child.
func nixlAvail() error {
	lib, err := capi.FindLibrary()
	if err != nil {
		return err
	}
	env := capi.ProcessEnv(lib)
	if os.Getenv("UCX_TLS") == "" {
		env = append(env, "UCX_TLS=sm")
	}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if err := os.Setenv(k, v); err != nil {
			return err
		}
	}
	b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("xferbench-probe-%d", os.Getpid()), Params: nixlParams})
	if err != nil {
		return err
	}
	return b.Close()
}

func nixlPeer(_ opts, dst []byte) (peerInfo, io.Closer, error) {
	b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("xferbench-recv-%d", os.Getpid()), Params: nixlParams})
	if err != nil {
		return peerInfo{}, nil, err
	}
	meta, err := adopt(b, b.Map, dst)
	if err != nil {
		b.Close()
		return peerInfo{}, nil, err
	}
	return peerInfo{Meta: meta}, b, nil
}

func nixlOpen(_ opts, e *sides, info peerInfo) (mover, error) {
	b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("xferbench-send-%d", os.Getpid()), Params: nixlParams})
	if err != nil {
		return nil, err
	}
	// The backend's poller looks every millisecond; polling State in a
	// loop is what NIXL's own benchmarks do, and it measures NIXL, not
	// our poll interval.
	return openBackend(b, b.Map, e, info, true)
}
