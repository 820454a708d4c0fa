package netxfer

import (
	"bufio"
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/finesleep"
	"github.com/kvxfer/kvxfer/internal/forkclose"
)

// The same-host path. An agent also listens on an abstract unix socket
// (named in its metadata); a peer in the same network namespace (so on
// the same host) dials it instead of TCP. Both ends check with
// SO_PEERCRED that the other runs as their own user, then authenticate
// as on TCP. On such a connection a WRITE from file-backed memory
// (MapFile) sends no payload: the sender passes its memory's file,
// reopened read-only, over the socket (SCM_RIGHTS) once per connection,
// and each part names its source as (file, offset). The receiver maps
// the file read-only and copies straight from it into its own memory:
// one copy, done by the side whose memory changes, after the same bounds
// and guard checks as a TCP part. A READ is the mirror image: the server
// checks the ranges against its guard and its memory, and answers with
// where they lie in its files (passed the same way, server to client);
// the client copies them into its own memory. Everything else
// (notifications, transfers touching memory without a file) uses the TCP
// frames over the same socket.
//
// Fencing. The side whose memory is read (a WRITE's client, a READ's
// server) also passes a page of its own (a memfd), and sets it when the
// connection fails or its memory is unmapped or closed, before it fails
// the transfers waiting on the connection (so before its caller can reuse
// the memory). The copying side reads the page after it copied a part and
// fails the part if it is set: bytes copied from memory already withdrawn
// are never counted as landed, and no notification is delivered for them.
//
// A sender's file that shrinks under the receiver's mapping faults the
// copy (SIGBUS); the receiver copies with the runtime's panic-on-fault
// set, so the part fails and the daemon stays up.

const (
	tFence      = 5 // | fd (SCM_RIGHTS): the sender's fence page
	tChunk      = 6 // chunk u32, off u64, len u64 | fd: memory the sender's parts name
	tWriteLocal = 7 // xfer u64, part u32, parts u32, ndesc u32, notif u32 | notif | ndesc×(addr u64, len u64, chunk u32, off u64)
	// Server to client, answering a tReadReq on a local connection whose
	// ranges all lie in memory with a file (tFence and tChunk first, as
	// needed): where each range's bytes are, for the client to copy.
	tReadLocal = 21 // xfer u64, part u32, ndesc u32 | ndesc×(chunk u32, off u64)
	// GPU memory: the CUDA IPC export of an allocation (no descriptor
	// passed), imported by the peer on the GPU of that UUID.
	tChunkDev = 8 // chunk u32, uuid [16]byte, handle [64]byte, size u64
	// A client's descriptor area (a memfd both map): a ring its WRITE
	// parts' tables are written into, so that a table of thousands of
	// pieces crosses no socket. The server copies a table out before it
	// reads it and then records how far it consumed the ring (the area's
	// first 8 bytes); a table that does not fit goes inline.
	tDescs      = 10 // | fd: the area, descAreaSize bytes
	tWriteTable = 11 // as tWriteLocal, the table replaced by pos u64: where it starts in the ring (bytes written before it)
	// Client to server, once, after its fence, where the server's socket
	// name has readAcksMark: this client acknowledges every READ answer
	// naming the server's memory (tReadLocal, tReadLayoutLocal) once it
	// no longer reads that memory (tReadCopied). The server answers such
	// READs only to clients that said so (see heldRead).
	tReadAcks   = 27
	tReadCopied = 28 // xfer u64, part u32

	descAreaSize = 4 << 20
	descRingOff  = 64 // the ring starts here; [0, 8) is the server's consumed count
	descRingSize = descAreaSize - descRingOff

	localRefSize = 12

	localDescSize = 28
	fenceSize     = 4096
	// maxHeldReads bounds the READ answers a connection's client has not
	// acknowledged yet.
	maxHeldReads = 1 << 16
	// maxChunks bounds the files one connection may pass; maxQueuedFDs the
	// descriptors received ahead of their frames.
	maxChunks    = 1024
	maxQueuedFDs = 16
)

// layoutsMark ends the name of the same-host socket of an agent that
// takes layout frames (tWriteLayout, tWriteLayoutTable, tReadLayout):
// the name travels in the agent's metadata, which a build from before
// them loads and dials like any other name, so builds old and new reach
// each other, and only agents that take them are sent layouts.
const layoutsMark = ".layouts"

// readAcksMark is in the same-host socket's name of an agent that takes
// tReadAcks and tReadCopied (before gatesMark and layoutsMark, which
// older builds look for at the name's end).
const readAcksMark = ".racks"

// identMark is in the same-host socket's name of an agent that takes
// versionIdent hellos on TCP (before readAcksMark): its peers' hellos
// name the agent they mean, and one that reaches another agent at its
// address (a process that restarted there) fails.
const identMark = ".ident"

// hasMark reports whether a same-host socket's name carries mark (the
// name's random part has no dot).
func hasMark(uaddr, mark string) bool { return strings.Contains(uaddr+".", mark+".") }

// listenLocal starts the agent's abstract unix socket.
func (a *Agent) listenLocal() error {
	var b [12]byte
	_, _ = rand.Read(b[:])
	name := "@kvxfer-netxfer-" + hex.EncodeToString(b[:])
	if !a.cfg.noIdent {
		name += identMark
	}
	if !a.cfg.noReadAcks {
		name += readAcksMark
	}
	if !a.cfg.noLayouts {
		if !a.cfg.noGates {
			name += gatesMark
		}
		name += layoutsMark
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return err
	}
	forkclose.Listener(ln)
	a.uln, a.uaddr = ln, name
	return nil
}

// peerCred returns the credentials of the process at the other end of c
// (as it connected).
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if cerr != nil {
		return nil, cerr
	}
	return cred, nil
}

// peerUID returns the uid of the process at the other end of c.
func peerUID(c *net.UnixConn) (uint32, error) {
	cred, err := peerCred(c)
	if err != nil {
		return 0, err
	}
	return cred.Uid, nil
}

// checkPeerUser refuses a local connection from or to another user: the
// same-host path shares memory, so only with the agent's own user.
func checkPeerUser(c *net.UnixConn) error {
	uid, err := peerUID(c)
	if err != nil {
		return fmt.Errorf("peer credentials: %w", err)
	}
	if me := uint32(os.Geteuid()); uid != me {
		return fmt.Errorf("peer runs as uid %d, this agent as uid %d: the same-host path is only between agents of one user", uid, me)
	}
	return nil
}

// MapFile adopts caller-owned memory at base, as Map, that is the shared
// mapping of f's bytes [off, off+len(mem)) (off a multiple of the page
// size). Peers on the same host then copy WRITEs out of it directly (the
// agent keeps its own read-only reopening of f, until Unmap or Close).
// Memory whose file cannot be reopened read-only is adopted as by Map.
func (a *Agent) MapFile(base uint64, mem []byte, f *os.File, off int64) error {
	if f == nil {
		return a.Map(base, mem)
	}
	if off < 0 || off%int64(os.Getpagesize()) != 0 {
		return fmt.Errorf("netxfer: map file at offset %d: want a multiple of the page size", off)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("netxfer: map file: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size < off+int64(len(mem)) {
		return fmt.Errorf("netxfer: map file: not a regular file of at least %d bytes", off+int64(len(mem)))
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		a.log.Debug("netxfer: memory not shareable on the same host", "base", base, "err", err)
		return a.Map(base, mem)
	}
	ro := os.NewFile(uintptr(fd), f.Name())
	if err := a.mapChunk(chunk{base: base, mem: mem, size: uint64(len(mem)), file: ro, off: off}); err != nil {
		ro.Close()
		return err
	}
	return nil
}

// Device is a GPU as the same-host path uses it (kvxferd: a CUDA device
// of its process). Addresses are device addresses in this process
// (unified addressing: a copy may name memory of two GPUs).
type Device interface {
	// Import maps an allocation another process of this host exported
	// (a CUDA IPC handle) and returns its address here.
	Import(handle [64]byte) (uint64, error)
	// Unmap unmaps what Import mapped.
	Unmap(ptr uint64) error
	CopyDevice(dst, src uint64, n int) error
	CopyIn(dst uint64, src []byte) error
	CopyOut(dst []byte, src uint64) error
}

// devRef reads a GPU and an allocation's IPC handle from a frame: 16
// bytes of UUID, then 64 of handle.
func devRef(b []byte) (uuid [16]byte, h [64]byte) {
	copy(uuid[:], b[:16])
	copy(h[:], b[16:80])
	return uuid, h
}

// Sizer is a Device that can say how many bytes an import really maps
// (kvxferd: cuMemGetAddressRange). A peer's GPU memory imported on one is
// checked against the size the peer claims, so that a peer that claims
// more than its allocation cannot make this process's copies run past
// the mapping (which would fault its GPU context).
type Sizer interface {
	AllocSize(ptr uint64) (uint64, error)
}

// checkImport checks an import at ptr on dev against the size claimed
// for it (where dev is a Sizer that can tell).
func checkImport(dev Device, ptr, claimed uint64) error {
	s, ok := dev.(Sizer)
	if !ok {
		return nil
	}
	n, err := s.AllocSize(ptr)
	if err != nil {
		// The driver cannot say: unchecked, as on a device that is no
		// Sizer (refusing would refuse every import on it).
		return nil
	}
	if claimed > n {
		return fmt.Errorf("%w: GPU memory claimed as %d bytes maps %d", ErrProtocol, claimed, n)
	}
	return nil
}

// BatchDevice is a Device that copies many pieces between GPU memories
// with one asynchronous launch (kvxferd: internal/cuda's copy kernel).
// The GPU pieces of a same-host part are staged as one batch per
// destination device and posted; the goroutine that read the part goes
// on serving its connection while the batch runs, and the part ends (its
// grant released, its memory unpinned, its acknowledgement sent) once the
// batch is done. Devices of one GPU compare equal (==).
type BatchDevice interface {
	Device
	// NewBatch returns an empty batch with room for n pieces.
	NewBatch(n int) (DevBatch, error)
}

// DevBatch is a batch being staged. The agent has checked every piece
// against the memory it lies in before it adds it.
type DevBatch interface {
	// Add stages n bytes from src to dst (device addresses in this
	// process); false: no room left, nothing staged.
	Add(dst, src, n uint64) bool
	// Post queues the batch and returns at once; the batch is spent.
	Post() (DevCopy, error)
	// Discard gives the batch up unposted.
	Discard()
}

// DevPiece is one piece of a batch: Len bytes from Src to Dst, device
// addresses in this process.
type DevPiece struct{ Dst, Src, Len uint64 }

// DevCopy is a batch in flight.
type DevCopy interface {
	// Done reports whether the batch ended and, once it has, its error.
	// It never blocks.
	Done() (bool, error)
}

// postBatch stages pieces on dev as one batch and posts it.
func postBatch(dev BatchDevice, ps []DevPiece) (DevCopy, error) {
	b, err := dev.NewBatch(len(ps))
	if err != nil {
		return nil, err
	}
	for _, p := range ps {
		if !b.Add(p.Dst, p.Src, p.Len) {
			b.Discard()
			return nil, fmt.Errorf("a batch of room for %d pieces refused piece %d", len(ps), len(ps))
		}
	}
	return b.Post()
}

// maxInFlight bounds the parts of one connection whose GPU batches run
// while the connection serves on; past it the next part waits for its
// own.
const maxInFlight = 64

// MapDevice adopts GPU memory at base (its address in this process:
// kvxferd imported the engine's allocation there) of size bytes, which
// is the allocation exported as handle on the GPU of uuid. Such memory
// moves only on the same-host path: a peer imports handle on its own
// process's device for uuid (Config.Devices) and copies with the GPU; a
// TCP transfer naming it fails with ErrDeviceMemory.
func (a *Agent) MapDevice(base, size uint64, dev Device, uuid [16]byte, handle [64]byte) error {
	if dev == nil {
		return errors.New("netxfer: map device memory: no device")
	}
	return a.mapChunk(chunk{base: base, size: size, dev: dev, uuid: uuid, handle: handle})
}

// fdReader reads a local connection, keeping the descriptors that come
// with its bytes, in order.
type fdReader struct {
	c   *net.UnixConn
	oob []byte
	fds []int
}

func newFDReader(c *net.UnixConn) *fdReader {
	return &fdReader{c: c, oob: make([]byte, unix.CmsgSpace(4*maxQueuedFDs))}
}

func (f *fdReader) Read(p []byte) (int, error) {
	n, oobn, flags, _, err := f.c.ReadMsgUnix(p, f.oob)
	n = max(n, 0)
	if n == 0 && oobn == 0 && err == nil && len(p) > 0 {
		err = io.EOF // a stream socket's end
	}
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(f.oob[:oobn])
		if perr != nil {
			return n, fmt.Errorf("%w: control message: %w", ErrProtocol, perr)
		}
		for i := range msgs {
			fds, ferr := unix.ParseUnixRights(&msgs[i])
			if ferr != nil {
				continue
			}
			for _, fd := range fds {
				unix.CloseOnExec(fd)
			}
			f.fds = append(f.fds, fds...)
		}
	}
	if flags&unix.MSG_CTRUNC != 0 || len(f.fds) > maxQueuedFDs {
		return n, fmt.Errorf("%w: more than %d descriptors ahead of their frames", ErrProtocol, maxQueuedFDs)
	}
	return n, err
}

// take returns the oldest descriptor received and not yet taken.
func (f *fdReader) take() (int, error) {
	if len(f.fds) == 0 {
		return -1, fmt.Errorf("%w: a frame without its descriptor", ErrProtocol)
	}
	fd := f.fds[0]
	f.fds = f.fds[1:]
	return fd, nil
}

func (f *fdReader) close() {
	for _, fd := range f.fds {
		unix.Close(fd)
	}
	f.fds = nil
}

// localServer is what a local connection's server holds: the sender's
// fence and the memory it passed, mapped read-only.
type localServer struct {
	c      *net.UnixConn
	inc    string // the client's incarnation (its hello's)
	fr     *fdReader
	fence  []byte
	chunks map[uint32][]byte
	devs   map[uint32]*devImport // the peer's GPU memory, imported here
	refs   []localRef
	tab    []byte        // a part's descriptor table (server side)
	lay    layoutScratch // a layout part's parse (reused)
	descs  []byte        // the client's descriptor area, mapped here
	ranges []Region      // its ranges
	dst    []target
	src    []target
	// GPU batches: the part's pieces grouped by destination device
	// (reused), and the parts whose batches run while the connection
	// serves on (slots bounds them; pending lets close wait for them).
	// wmu orders the answers written by those parts' ends with the
	// connection's own (the server side).
	groups  []devGroup
	slots   chan struct{}
	pending sync.WaitGroup
	wmu     sync.Mutex
	serving bool // wmu is held by the connection's goroutine (server side)
	// last is the memory piece looked up last (pieces come in runs of
	// one chunk); passing memory clears it.
	last struct {
		ok bool
		id uint32
		m  []byte
		d  *devImport
	}
	// For READs from this agent's memory: the memory files passed to the
	// client, and this side's fence (under mu: Unmap and Close set it).
	sent map[uint32]bool
	mu   struct {
		sync.Mutex
		fence     []byte
		withdrawn bool
		reads     map[partKey]*heldRead // answered, not yet acknowledged
	}
	// acks: the client acknowledges READ answers (tReadAcks; read and
	// written by the connection's goroutine alone).
	acks bool
	// The peer's gates (gate.go, P side): its gate areas and GPU memory
	// imported here, and the launches through them in flight.
	gateAreas  map[uint32]*devImport
	gateChunks map[uint32]*gateChunk
	gateUse    sync.WaitGroup
}

type localRef struct {
	chunk uint32
	off   uint64
}

func newLocalServer(c *net.UnixConn) *localServer {
	return &localServer{c: c, fr: newFDReader(c), chunks: map[uint32][]byte{}, devs: map[uint32]*devImport{},
		sent: map[uint32]bool{}, slots: make(chan struct{}, maxInFlight)}
}

// devImport is a peer's GPU allocation imported in this process: on the
// device of its GPU, and on other devices that copy out of it (their
// kernels read it through the import's peer mapping), imported there on
// first use.
type devImport struct {
	dev       Device
	ptr, size uint64
	handle    [64]byte
	on        []devMapping
}

type devMapping struct {
	dev Device
	ptr uint64 // 0: the import failed (copies go piece by piece)
}

// at returns the allocation's address as mapped on dev, importing it
// there first if need be; false where it cannot be.
func (m *devImport) at(dev Device) (uint64, bool) {
	if dev == m.dev {
		return m.ptr, true
	}
	for _, o := range m.on {
		if o.dev == dev {
			return o.ptr, o.ptr != 0
		}
	}
	ptr, err := dev.Import(m.handle)
	if err != nil {
		ptr = 0
	}
	m.on = append(m.on, devMapping{dev, ptr})
	return ptr, ptr != 0
}

func (m *devImport) unmap() {
	_ = m.dev.Unmap(m.ptr)
	for _, o := range m.on {
		if o.ptr != 0 {
			_ = o.dev.Unmap(o.ptr)
		}
	}
}

// target is one piece's memory: bytes (host), or n bytes at a device
// address (off into imp, where it is a peer's allocation imported here).
type target struct {
	b   []byte
	dev Device
	ptr uint64
	n   uint64
	imp *devImport
	off uint64
}

// devGroup is a batch being built: the pieces bound for one device.
type devGroup struct {
	dev    BatchDevice
	pieces []DevPiece
}

// piece returns [off, off+n) of the peer's memory passed as chunk id.
func (s *localServer) piece(id uint32, off, n uint64) (target, bool) {
	if !s.last.ok || s.last.id != id {
		s.last.id, s.last.m, s.last.d = id, s.chunks[id], s.devs[id]
		s.last.ok = true
	}
	if m := s.last.m; m != nil {
		if off > uint64(len(m)) || n > uint64(len(m))-off {
			return target{}, false
		}
		return target{b: m[off : off+n]}, true
	}
	if d := s.last.d; d != nil && off <= d.size && n <= d.size-off {
		return target{dev: d.dev, ptr: d.ptr + off, n: n, imp: d, off: off}, true
	}
	return target{}, false
}

// withdraw sets this side's fence and ends the connection: a READ the
// client is copying out of this agent's memory does not count.
func (s *localServer) withdraw() {
	s.mu.Lock()
	s.mu.withdrawn = true
	if s.mu.fence != nil {
		setFence(s.mu.fence)
	}
	s.mu.Unlock()
	_ = s.c.Close()
}

func (s *localServer) close() {
	s.withdraw()
	s.pending.Wait() // GPU batches still reading or writing memory unmapped below
	s.mu.Lock()
	if s.mu.fence != nil {
		_ = unix.Munmap(s.mu.fence)
		s.mu.fence = nil
	}
	s.mu.Unlock()
	s.fr.close()
	if s.fence != nil {
		_ = unix.Munmap(s.fence)
	}
	if s.descs != nil {
		_ = unix.Munmap(s.descs)
		s.descs = nil
	}
	for _, m := range s.chunks {
		_ = unix.Munmap(m)
	}
	s.chunks = nil
	for _, d := range s.devs {
		d.unmap()
	}
	s.devs = nil
	s.last.ok, s.last.m, s.last.d = false, nil, nil
}

// withdrawn reads the sender's fence, after the bytes it guards were
// copied, and whether its process hung up meanwhile (killed: it could
// set no fence, and its engine may reuse the memory once it notices).
func (s *localServer) withdrawn() bool { return fenceSet(s.fence) || hungUp(s.c) }

// hungUp reports whether the other end of c closed (or died), without
// reading: the kernel reports it at once, whatever is still unread.
func hungUp(c *net.UnixConn) bool {
	rc, err := c.SyscallConn()
	if err != nil {
		return true
	}
	gone := false
	if err := rc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if n, err := unix.Poll(p, 0); err == nil && n > 0 {
			gone = p[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
		}
	}); err != nil {
		return true
	}
	return gone
}

// fenceSet reads a fence page after the bytes it guards were copied: a
// read-modify-write, so that no load of the copy is ordered after it.
func fenceSet(f []byte) bool { return atomic.AddUint32((*uint32)(unsafe.Pointer(&f[0])), 0) != 0 }

func setFence(f []byte) { atomic.StoreUint32((*uint32)(unsafe.Pointer(&f[0])), 1) }

// newFence makes a fence page: a memfd, mapped here, to pass on.
func newFence() (fd int, page []byte, err error) {
	fd, err = unix.MemfdCreate("kvxfer-fence", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, nil, err
	}
	if err = unix.Ftruncate(fd, fenceSize); err == nil {
		page, err = unix.Mmap(fd, 0, fenceSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	return fd, page, nil
}

// serveLocal handles the frames only local connections carry.
func (a *Agent) serveLocal(s *localServer, r *scatterReader, w *bufio.Writer, from string, typ byte, hdr []byte) error {
	switch typ {
	case tReadAcks:
		if a.cfg.noReadAcks {
			return fmt.Errorf("%w: frame type %d from %s", ErrProtocol, typ, from)
		}
		s.acks = true
		return nil
	case tReadCopied:
		return a.readCopied(s, r, hdr)
	case tFence:
		fd, err := s.fr.take()
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if s.fence != nil {
			return fmt.Errorf("%w: a second fence", ErrProtocol)
		}
		m, err := mapShared(fd, 0, fenceSize, unix.PROT_READ|unix.PROT_WRITE)
		if err != nil {
			return fmt.Errorf("fence: %w", err)
		}
		s.fence = m
		return nil
	case tChunk:
		if err := readFull(r, hdr[:20]); err != nil {
			return err
		}
		fd, err := s.fr.take()
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		id := binary.LittleEndian.Uint32(hdr[:4])
		off := binary.LittleEndian.Uint64(hdr[4:12])
		n := binary.LittleEndian.Uint64(hdr[12:20])
		old := s.chunks[id]
		if old == nil && len(s.chunks)+len(s.devs) >= maxChunks {
			return fmt.Errorf("%w: more than %d memory files on one connection", ErrProtocol, maxChunks)
		}
		if n == 0 || n > 1<<46 || off > 1<<46 || off%uint64(os.Getpagesize()) != 0 {
			return fmt.Errorf("%w: memory file %d at offset %d, %d bytes", ErrProtocol, id, off, n)
		}
		m, err := mapShared(fd, int64(off), int(n), unix.PROT_READ)
		if err != nil {
			return fmt.Errorf("memory file %d: %w", id, err)
		}
		if old != nil {
			_ = unix.Munmap(old)
		}
		s.chunks[id] = m
		s.last.ok = false
		return nil
	case tChunkDev:
		var b [92]byte
		if err := readFull(r, b[:]); err != nil {
			return err
		}
		id := binary.LittleEndian.Uint32(b[:4])
		uuid, h := devRef(b[4:84])
		n := binary.LittleEndian.Uint64(b[84:92])
		old, had := s.devs[id]
		if had {
			s.waitPending() // batches may still read the memory it replaces
		}
		if !had && len(s.chunks)+len(s.devs) >= maxChunks {
			return fmt.Errorf("%w: more than %d memory files on one connection", ErrProtocol, maxChunks)
		}
		if a.cfg.Devices == nil {
			return fmt.Errorf("%w: GPU memory from %s, and this agent takes none (no devices)", ErrProtocol, from)
		}
		if n == 0 || n > 1<<46 {
			return fmt.Errorf("%w: GPU memory %d of %d bytes", ErrProtocol, id, n)
		}
		dev, err := a.cfg.Devices(uuid)
		if err != nil {
			return fmt.Errorf("GPU memory %d: device %x: %w", id, uuid, err)
		}
		ptr, err := dev.Import(h)
		if err != nil {
			return fmt.Errorf("GPU memory %d: import: %w", id, err)
		}
		if err := checkImport(dev, ptr, n); err != nil {
			_ = dev.Unmap(ptr)
			return fmt.Errorf("GPU memory %d from %s: %w", id, from, err)
		}
		if had {
			old.unmap()
		}
		s.devs[id] = &devImport{dev: dev, ptr: ptr, size: n, handle: h}
		s.last.ok = false
		return nil
	case tDescs:
		fd, err := s.fr.take()
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if s.descs != nil {
			return fmt.Errorf("%w: a second descriptor area", ErrProtocol)
		}
		m, err := mapShared(fd, 0, descAreaSize, unix.PROT_READ|unix.PROT_WRITE)
		if err != nil {
			return fmt.Errorf("descriptor area: %w", err)
		}
		s.descs = m
		return nil
	case tWriteLocal, tWriteTable:
		if s.fence == nil {
			return fmt.Errorf("%w: a local write before the fence", ErrProtocol)
		}
		return a.serveWriteLocal(s, r, w, from, hdr, typ == tWriteTable)
	case tReadLayout:
		if a.cfg.noLayouts {
			break
		}
		return a.serveReadLayout(s, r, w, from, hdr)
	case tWriteLayout, tWriteLayoutTable:
		if a.cfg.noLayouts {
			break
		}
		if s.fence == nil {
			return fmt.Errorf("%w: a local write before the fence", ErrProtocol)
		}
		return a.serveWriteLayout(s, r, w, from, hdr, typ == tWriteLayoutTable)
	case tGateArea, tGateChunk, tGateOpen, tGateShut:
		if a.cfg.noGates {
			break
		}
		return a.serveGate(s, r, from, typ, hdr)
	}
	return fmt.Errorf("%w: frame type %d", ErrProtocol, typ)
}

// mapShared maps n bytes of the regular file fd at off, checking first
// that the file holds them.
func mapShared(fd int, off int64, n int, prot int) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size < off+int64(n) {
		return nil, fmt.Errorf("%w: not a regular file of at least %d bytes", ErrProtocol, off+int64(n))
	}
	return unix.Mmap(fd, off, n, prot, unix.MAP_SHARED)
}

// serveWriteLocal lands one local WRITE part: each piece copied from the
// sender's file into registered memory.
func (a *Agent) serveWriteLocal(s *localServer, r *scatterReader, w *bufio.Writer, from string, hdr []byte, inArea bool) error {
	h, err := readWriteHeader(r, hdr)
	if err != nil {
		return err
	}
	took := false // landLocal took the part (and answers it, or notes it lost)
	defer func() {
		if !took {
			a.partLost(session{from, s.inc}, h)
		}
	}()
	a.wire(WirePartRead, XferID(h.id), h.part)
	if h.n > maxDescs {
		return fmt.Errorf("%w: %d descriptors", ErrProtocol, h.n)
	}
	tab, err := a.readTable(s, r, hdr, localDescSize*int(h.n), inArea)
	if err != nil {
		return err
	}
	if cap(s.ranges) < int(h.n) || cap(s.ranges) > keepScratch {
		s.ranges = make([]Region, h.n)
	}
	ranges := s.ranges[:h.n]
	s.refs = s.refs[:0]
	for i := range ranges {
		e := tab[localDescSize*i:]
		ranges[i] = Region{binary.LittleEndian.Uint64(e), binary.LittleEndian.Uint64(e[8:])}
		s.refs = append(s.refs, localRef{binary.LittleEndian.Uint32(e[16:]), binary.LittleEndian.Uint64(e[20:])})
	}
	if err := a.landingRoom(session{from, s.inc}, h); err != nil {
		return err
	}
	// Admitted, the copy ends before the grant that let it in can (no
	// abort: a copy between mapped memories is short).
	v, ticket, berr := a.admitGuard(from, Write, ranges, h.notif, nil)
	if v == Deny {
		return berr
	}
	took = true
	return a.landLocal(s, w, from, h, v, ticket, berr, func() (bool, []DevCopy, error) {
		// GPU to GPU (the common case of GPU engines): the batch built
		// in one pass.
		return a.devicePart(s, ranges, s.refs)
	}, func() ([]Region, []localRef) { return ranges, s.refs })
}

// readTable reads a part's table of n bytes into the connection's buffer
// (kept up to keepScratch descriptors): inline, or out of the client's
// descriptor area (inArea: its position follows), copied out before a
// byte of it is read (the client may write the area at any time), then
// marked consumed.
func (a *Agent) readTable(s *localServer, r *scatterReader, hdr []byte, n int, inArea bool) ([]byte, error) {
	if cap(s.tab) < n || cap(s.tab) > localDescSize*keepScratch {
		s.tab = make([]byte, n)
	}
	tab := s.tab[:n]
	if !inArea {
		return tab, readFull(r, tab)
	}
	if err := readFull(r, hdr[:8]); err != nil {
		return nil, err
	}
	pos := binary.LittleEndian.Uint64(hdr[:8])
	off := pos % descRingSize
	if s.descs == nil || off+uint64(n) > descRingSize {
		return nil, fmt.Errorf("%w: a table of %d bytes at %d of the descriptor area", ErrProtocol, n, pos)
	}
	copy(tab, s.descs[descRingOff+off:])
	atomic.StoreUint64((*uint64)(unsafe.Pointer(&s.descs[0])), pos+uint64(n))
	a.areaTables.Add(1)
	return tab, nil
}

// landLocal lands a same-host WRITE part admitted (v, ticket; berr: why
// not) on its way: fast posts it as one GPU batch where it can (false:
// it could not, nothing posted), else pieces lists its pieces (ranges in
// this agent's memory, refs in the sender's) for the general path. The
// part ends once its bytes are where they go (answered from another
// goroutine when GPU batches still run).
func (a *Agent) landLocal(s *localServer, w *bufio.Writer, from string, h writeHeader, v Verdict, ticket uint64, berr error,
	fast func() (bool, []DevCopy, error), pieces func() ([]Region, []localRef)) error {
	a.memMu.RLock()
	var inflight []DevCopy
	posted := false
	if berr == nil {
		posted, inflight, berr = fast()
		if errors.Is(berr, ErrProtocol) {
			a.memMu.RUnlock()
			a.releaseGuard(ticket)
			a.partLost(session{from, s.inc}, h)
			return berr
		}
	}
	if berr == nil && !posted {
		ranges, refs := pieces()
		s.dst, berr = a.targets(s.dst[:0], ranges)
		if berr == nil {
			s.src = s.src[:0]
			for i, ref := range refs {
				p, ok := s.piece(ref.chunk, ref.off, ranges[i].Len)
				if !ok {
					berr = fmt.Errorf("%w: piece %d names [%d, +%d) of memory %d, which the peer did not pass",
						ErrProtocol, i, ref.off, ranges[i].Len, ref.chunk)
					break
				}
				s.src = append(s.src, p)
			}
			if berr != nil {
				a.memMu.RUnlock()
				a.releaseGuard(ticket)
				a.partLost(session{from, s.inc}, h)
				return berr
			}
			inflight, berr = s.copyPieces(s.dst, s.src)
			clear(s.dst)
			clear(s.src)
		}
	}
	if berr == nil || len(inflight) > 0 {
		// The part ends once its bytes are where they go: its memory
		// unpinned, its grant released (before the completion is
		// delivered: the Worker that waits for it may be the one the
		// delivery goes to), then the answer.
		release := func(berr error) error {
			if berr == nil && s.withdrawn() {
				berr = fmt.Errorf("%w: the sender withdrew its memory during the copy (its fence set, or it hung up)", ErrXferFailed)
			}
			if berr == nil {
				a.localParts.Add(1)
			}
			a.memMu.RUnlock()
			a.releaseGuard(ticket)
			return berr
		}
		if len(inflight) > 0 {
			posted := berr
			if s.async(inflight, func(err error, ended func()) {
				// Released first: the connection's goroutine may wait
				// for this memory (an Unmap waiting for it) holding wmu.
				err = release(cmp.Or(posted, err))
				// Answered from a goroutine of its own: writing to the
				// socket may block (it runs next on the poller's
				// processor, which yields between rounds).
				go func() {
					s.wmu.Lock()
					defer ended()
					defer s.wmu.Unlock()
					if a.landed(w, session{from, s.inc}, h, v, err) != nil {
						_ = s.c.Close()
					}
				}()
			}) {
				return nil
			}
			berr = cmp.Or(berr, waitCopies(inflight))
		}
		return a.landed(w, session{from, s.inc}, h, v, release(berr))
	}
	a.memMu.RUnlock()
	a.releaseGuard(ticket)
	return a.landed(w, session{from, s.inc}, h, v, berr)
}

// devicePart posts a same-host WRITE part whose pieces all go from a
// peer's GPU memory into this agent's on one BatchDevice as one batch, in
// one pass over them (the bounds checked as targets and piece check
// them). It reports false, having posted nothing, for any other part
// (the caller takes the general path); an error where a piece is out of
// bounds. Callers hold memMu for reading.
func (a *Agent) devicePart(s *localServer, ranges []Region, refs []localRef) (bool, []DevCopy, error) {
	if len(ranges) == 0 {
		return false, nil, nil
	}
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return false, nil, ErrClosed
	}
	var c regionCursor
	var ch *chunk
	var dev BatchDevice
	var b DevBatch
	// give up returns the part to the general path (nothing posted).
	giveUp := func() (bool, []DevCopy, error) {
		a.mu.Unlock()
		if b != nil {
			b.Discard()
		}
		return false, nil, nil
	}
	fail := func(err error) (bool, []DevCopy, error) {
		a.mu.Unlock()
		if b != nil {
			b.Discard()
		}
		return true, nil, err
	}
	var imp *devImport
	var impID uint32
	var impAt uint64
	for i, r := range ranges {
		if ch == nil || r.Addr < ch.base || r.Addr-ch.base+r.Len > ch.size {
			if ch = a.chunkLocked(r.Addr); ch == nil || ch.dev == nil {
				return giveUp() // host memory, or out of bounds: the general path says
			}
			bd, ok := ch.dev.(BatchDevice)
			if !ok || dev != nil && bd != dev {
				return giveUp()
			}
			if dev == nil {
				dev = bd
				nb, err := dev.NewBatch(len(ranges))
				if err != nil {
					return fail(fmt.Errorf("%w: GPU copy of %d pieces: %w", ErrXferFailed, len(ranges), err))
				}
				b = nb
			}
		}
		if !c.inside(a, r.Addr, r.Len) || r.Addr-ch.base+r.Len > ch.size {
			return fail(fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, r.Addr, r.Len, a.cfg.Name, ErrOutOfBounds))
		}
		ref := refs[i]
		if imp == nil || ref.chunk != impID {
			d := s.devs[ref.chunk]
			if d == nil {
				return giveUp() // host memory, or not passed: the general path says
			}
			at, ok := d.at(ch.dev)
			if !ok {
				return giveUp()
			}
			imp, impID, impAt = d, ref.chunk, at
		}
		if ref.off > imp.size || r.Len > imp.size-ref.off {
			return fail(fmt.Errorf("%w: piece %d names [%d, +%d) of memory %d, which the peer did not pass",
				ErrProtocol, i, ref.off, r.Len, ref.chunk))
		}
		if !b.Add(r.Addr, impAt+ref.off, r.Len) {
			return fail(fmt.Errorf("%w: GPU copy: a batch of room for %d pieces refused piece %d", ErrXferFailed, len(ranges), i))
		}
	}
	a.mu.Unlock()
	cp, err := b.Post()
	if err != nil {
		return true, nil, fmt.Errorf("%w: GPU copy of %d pieces: %w", ErrXferFailed, len(ranges), err)
	}
	return true, []DevCopy{cp}, nil
}

// copyPieces copies src[i] into dst[i]: host bytes with copy (a fault on
// either side, a file shrunk under its mapping, is an error), a GPU piece
// with its device. Pieces between GPU memories whose destination is a
// BatchDevice are posted as one batch per device and returned in flight
// (the caller ends the part once they are done, even when err is set);
// the others are copied one by one.
func (s *localServer) copyPieces(dst, src []target) (inflight []DevCopy, err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: copy faulted (a memory file shrank): %v", ErrXferFailed, r)
		}
	}()
	groups := s.groups[:0]
	defer func() {
		for i := range groups {
			groups[i].pieces = groups[i].pieces[:0]
		}
		s.groups = groups[:0]
	}()
	// The destination device of the last piece, as a BatchDevice (nil:
	// not one), and its group.
	var lastDev Device
	var lastBatch BatchDevice
	lastGroup := -1
	for i, d := range dst {
		sp := src[i]
		switch {
		case d.dev == nil && sp.dev == nil:
			copy(d.b, sp.b)
		case d.dev != nil && sp.dev != nil:
			if d.dev != lastDev {
				lastDev, lastGroup = d.dev, -1
				lastBatch, _ = d.dev.(BatchDevice)
			}
			if lastBatch != nil {
				from, ok := sp.ptr, sp.dev == d.dev
				if !ok && sp.imp != nil {
					// Another GPU of this host: read through the
					// allocation's import on the destination's.
					var at uint64
					if at, ok = sp.imp.at(d.dev); ok {
						from = at + sp.off
					}
				}
				if ok {
					if lastGroup < 0 {
						groups, lastGroup = groupOf(groups, lastBatch)
					}
					groups[lastGroup].pieces = append(groups[lastGroup].pieces, DevPiece{d.ptr, from, d.n})
					continue
				}
			}
			err = d.dev.CopyDevice(d.ptr, sp.ptr, int(d.n))
		case d.dev != nil:
			err = d.dev.CopyIn(d.ptr, sp.b)
		default:
			err = sp.dev.CopyOut(d.b, sp.ptr)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: piece %d: %w", ErrXferFailed, i, err)
		}
	}
	for _, g := range groups {
		c, perr := postBatch(g.dev, g.pieces)
		if perr != nil {
			return inflight, fmt.Errorf("%w: GPU copy of %d pieces: %w", ErrXferFailed, len(g.pieces), perr)
		}
		inflight = append(inflight, c)
	}
	return inflight, nil
}

// groupOf returns groups with one for dev, and its index.
func groupOf(groups []devGroup, dev BatchDevice) ([]devGroup, int) {
	for i := range groups {
		if groups[i].dev == dev {
			return groups, i
		}
	}
	if len(groups) < cap(groups) {
		groups = groups[:len(groups)+1]
		groups[len(groups)-1].dev = dev
		groups[len(groups)-1].pieces = groups[len(groups)-1].pieces[:0]
	} else {
		groups = append(groups, devGroup{dev: dev})
	}
	return groups, len(groups) - 1
}

// waitCopies waits until batches in flight are done and returns the
// first one's error.
func waitCopies(cs []DevCopy) error {
	done := make(chan error, 1)
	polled.add(cs, func(err error) { done <- err })
	return <-done
}

// polled is the process's poller of GPU batches in flight: one goroutine,
// running while batches are in flight, that asks each
// whether it is done and calls its end with the result. It spins
// (yielding the processor between rounds) while batches are young, since
// a batch of KV blocks takes tens to hundreds of microseconds and a
// timer's wake-up would cost more than that; a batch in flight for over
// spinFor is polled every pollEvery. Ends run on the poller's goroutine:
// they must not block (what may, they hand to a goroutine of their own).
var polled devPoller

const (
	spinFor   = 5 * time.Millisecond
	pollEvery = 50 * time.Microsecond
)

type devPoller struct {
	mu      sync.Mutex
	running bool
	queue   []*polledBatch
}

type polledBatch struct {
	copies []DevCopy // those not done yet
	err    error     // the first error of those done
	since  time.Time
	end    func(error)
}

func (p *devPoller) add(cs []DevCopy, end func(error)) {
	b := &polledBatch{copies: cs, since: time.Now(), end: end}
	p.mu.Lock()
	p.queue = append(p.queue, b)
	start := !p.running
	p.running = true
	p.mu.Unlock()
	if start {
		go p.loop()
	}
}

func (p *devPoller) loop() {
	var mine []*polledBatch
	for {
		p.mu.Lock()
		mine = append(mine, p.queue...)
		clear(p.queue)
		p.queue = p.queue[:0]
		if len(mine) == 0 {
			// No spinning while idle: it would take a processor from
			// the goroutines that post the next batch.
			p.running = false
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
		young := false
		mine = slices.DeleteFunc(mine, func(b *polledBatch) bool {
			for len(b.copies) > 0 {
				done, err := b.copies[0].Done()
				if !done {
					break
				}
				if b.err == nil && err != nil {
					b.err = fmt.Errorf("%w: GPU copy: %w", ErrXferFailed, err)
				}
				b.copies = b.copies[1:]
			}
			if len(b.copies) > 0 {
				young = young || time.Since(b.since) < spinFor
				return false
			}
			b.end(b.err)
			return true
		})
		switch {
		case len(mine) == 0:
		case young:
			runtime.Gosched()
		default:
			finesleep.Sleep(pollEvery) // time.Sleep would take a millisecond
		}
	}
}

// async ends a part whose batches are in flight once they are done, so
// that the connection's goroutine serves on: end is called from the
// poller with their result and a func to call once the part has ended
// (end must not block the poller: what may block, it does on a goroutine
// of its own). False (nothing started) when maxInFlight parts of the
// connection already wait: the caller waits for its batches itself.
func (s *localServer) async(inflight []DevCopy, end func(err error, ended func())) bool {
	select {
	case s.slots <- struct{}{}:
	default:
		return false
	}
	s.pending.Add(1)
	ended := func() {
		<-s.slots
		s.pending.Done()
	}
	polled.add(slices.Clone(inflight), func(err error) { end(err, ended) })
	return true
}

// waitPending waits until no part's batches run. The connection's
// goroutine serving a frame holds wmu (server side), which those parts'
// ends take to answer: it is let go meanwhile.
func (s *localServer) waitPending() {
	if s.serving {
		s.wmu.Unlock()
		defer s.wmu.Lock()
	}
	s.pending.Wait()
}

// targets resolves ranges of registered memory, host or GPU (as resolve
// does for host memory). Callers hold memMu for reading while they use
// the targets.
func (a *Agent) targets(dst []target, ranges []Region) ([]target, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return dst, ErrClosed
	}
	var c regionCursor
	var ch *chunk
	for i, r := range ranges {
		if !c.inside(a, r.Addr, r.Len) {
			return dst, fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, r.Addr, r.Len, a.cfg.Name, ErrOutOfBounds)
		}
		if ch == nil || r.Addr < ch.base || r.Addr-ch.base+r.Len > ch.size {
			if ch = a.chunkLocked(r.Addr); ch == nil || r.Addr-ch.base+r.Len > ch.size {
				return dst, fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, r.Addr, r.Len, a.cfg.Name, ErrOutOfBounds)
			}
		}
		o := r.Addr - ch.base
		if ch.dev != nil {
			dst = append(dst, target{dev: ch.dev, ptr: r.Addr, n: r.Len})
		} else {
			dst = append(dst, target{b: ch.mem[o : o+r.Len : o+r.Len]})
		}
	}
	return dst, nil
}

// dialLocal opens a local connection to the peer: credentials,
// authentication, hello, then the fence.
func (p *peer) dialLocal() (*conn, error) {
	a := p.owner
	d := net.Dialer{Timeout: a.cfg.DialTimeout}
	nc, err := d.Dial("unix", p.uaddr)
	if err != nil {
		return nil, err
	}
	uc := nc.(*net.UnixConn)
	fail := func(err error) (*conn, error) {
		_ = nc.Close()
		return nil, err
	}
	if err := checkPeerUser(uc); err != nil {
		return fail(err)
	}
	if a.cfg.Auth != nil {
		if err := a.cfg.Auth.Client(nc, "data", a.cfg.Name); err != nil {
			return fail(err)
		}
	}
	hello := helloFrame(a.cfg.Name)
	if p.ident != "" {
		hello = identHello(a.cfg.Name, p.ident, a.inc)
	}
	if _, err := nc.Write(hello); err != nil {
		return fail(err)
	}
	ffd, fence, err := newFence()
	if err != nil {
		return fail(err)
	}
	defer unix.Close(ffd)
	if _, _, err := uc.WriteMsgUnix([]byte{tFence}, unix.UnixRights(ffd), nil); err != nil {
		_ = unix.Munmap(fence)
		return fail(err)
	}
	if p.readAcks {
		if _, err := nc.Write([]byte{tReadAcks}); err != nil {
			_ = unix.Munmap(fence)
			return fail(err)
		}
	}
	// The descriptor area (none if it cannot be made: tables go inline).
	var descs []byte
	if dfd, err := unix.MemfdCreate("kvxfer-descs", unix.MFD_CLOEXEC); err == nil {
		if err = unix.Ftruncate(dfd, descAreaSize); err == nil {
			descs, err = unix.Mmap(dfd, 0, descAreaSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		}
		if err == nil {
			if _, _, err = uc.WriteMsgUnix([]byte{tDescs}, unix.UnixRights(dfd), nil); err != nil {
				_ = unix.Munmap(descs)
				unix.Close(dfd)
				_ = unix.Munmap(fence)
				return fail(err)
			}
		} else if descs != nil {
			_ = unix.Munmap(descs)
			descs = nil
		}
		unix.Close(dfd)
	}
	in := newLocalServer(uc) // the server's fence and files, for READs
	return &conn{p: p, c: nc, r: newScatterReader(in.fr), pending: map[partKey]*xfer{},
		uc: uc, fence: fence, sent: map[uint32]bool{}, in: in, descs: descs, acks: p.readAcks}, nil
}

// withdraw sets the connection's fence (once): parts copied from now on
// do not count. Called before the parts waiting on the connection fail.
func (c *conn) withdraw() {
	if c.fence == nil {
		return
	}
	setFence(c.fence)
	_ = unix.Munmap(c.fence)
	c.fence = nil
}

// sendPartLocal sends a WRITE part as references into the agent's memory
// files. It reports false, sending nothing, when a piece lies in memory
// without a file (the caller sends the bytes instead).
func (a *Agent) sendPartLocal(c *conn, x *xfer, part int) (bool, error) {
	ds := x.descs[x.split[part]:x.split[part+1]]
	h := make([]byte, 0, 25+len(x.notif)+localDescSize*len(ds))
	h = appendWriteHeader(h, tWriteLocal, x, part, len(ds))
	a.memMu.RLock()
	defer a.memMu.RUnlock()
	a.mu.Lock()
	var cur regionCursor
	var m refMaker
	for i, d := range ds {
		if !cur.inside(a, d.Local, d.Len) {
			a.mu.Unlock()
			return true, fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, d.Local, d.Len, a.cfg.Name, ErrOutOfBounds)
		}
		ref, ok := m.ref(a, d.Local, d.Len)
		if !ok {
			a.mu.Unlock()
			return false, nil
		}
		h = binary.LittleEndian.AppendUint64(h, d.Remote)
		h = binary.LittleEndian.AppendUint64(h, d.Len)
		h = binary.LittleEndian.AppendUint32(h, ref.chunk)
		h = binary.LittleEndian.AppendUint64(h, ref.off)
	}
	need := m.need
	a.mu.Unlock()
	return true, c.sendPart(need, h, len(h)-localDescSize*len(ds), tWriteTable)
}

// sendPart sends a same-host part whose header is h[:hl] and whose table
// is h[hl:]: first the files its table names that the peer lacks, then
// the part, its table through the descriptor ring (the frame's type then
// tableType) when there is room, else inline. A failure fails the
// connection.
func (c *conn) sendPart(need []*chunk, h []byte, hl int, tableType byte) error {
	c.lockWrite()
	defer c.wmu.Unlock()
	if err := sendChunks(c.uc, c.sent, need); err != nil {
		c.fail(fmt.Errorf("%w: write to %s: %w", ErrXferFailed, c.p.name, err))
		return err
	}
	if c.descs != nil {
		if pos, ok := c.putTable(h[hl:]); ok {
			h[0] = tableType
			h = binary.LittleEndian.AppendUint64(h[:hl], pos)
		}
	}
	// The header (appendWriteHeader): type, transfer, part.
	c.p.owner.wire(WirePartSent, XferID(binary.LittleEndian.Uint64(h[1:9])), binary.LittleEndian.Uint32(h[9:13]))
	if _, err := c.c.Write(h); err != nil {
		c.fail(fmt.Errorf("%w: write to %s: %w", ErrXferFailed, c.p.name, err))
		return err
	}
	return nil
}

// putTable writes a part's descriptor table into the connection's area
// (c.wmu held) and returns where it starts; false if the ring has no room
// for it now (the table goes inline).
func (c *conn) putTable(tab []byte) (uint64, bool) {
	n := uint64(len(tab))
	if n == 0 || n > descRingSize/2 {
		return 0, false
	}
	pos := c.head
	if off := pos % descRingSize; off+n > descRingSize {
		pos += descRingSize - off // to the ring's start
	}
	consumed := atomic.LoadUint64((*uint64)(unsafe.Pointer(&c.descs[0])))
	if pos+n-consumed > descRingSize {
		return 0, false
	}
	off := pos % descRingSize
	copy(c.descs[descRingOff+off:], tab)
	c.head = pos + n
	return pos, true
}

// sendChunks passes the memory files of need not passed yet on c.
func sendChunks(c *net.UnixConn, sent map[uint32]bool, need []*chunk) error {
	for _, ch := range need {
		if sent[ch.id] {
			continue
		}
		if ch.dev != nil {
			f := make([]byte, 0, 93)
			f = append(f, tChunkDev)
			f = binary.LittleEndian.AppendUint32(f, ch.id)
			f = append(f, ch.uuid[:]...)
			f = append(f, ch.handle[:]...)
			f = binary.LittleEndian.AppendUint64(f, ch.size)
			if _, err := c.Write(f); err != nil {
				return err
			}
			sent[ch.id] = true
			continue
		}
		f := make([]byte, 0, 21)
		f = append(f, tChunk)
		f = binary.LittleEndian.AppendUint32(f, ch.id)
		f = binary.LittleEndian.AppendUint64(f, uint64(ch.off))
		f = binary.LittleEndian.AppendUint64(f, uint64(len(ch.mem)))
		if _, _, err := c.WriteMsgUnix(f, unix.UnixRights(int(ch.file.Fd())), nil); err != nil {
			return err
		}
		sent[ch.id] = true
	}
	return nil
}

// refMaker names ranges of the agent's memory as (file, offset), for a
// peer on the same host, remembering the last range's chunk (a.mu held).
type refMaker struct {
	ch   *chunk
	need []*chunk
}

// ref returns where [addr, addr+n) (registered memory) lies in its
// chunk's file; false if the chunk has none.
func (m *refMaker) ref(a *Agent, addr, n uint64) (localRef, bool) {
	if m.ch == nil || addr < m.ch.base || addr-m.ch.base+n > m.ch.size {
		m.ch = a.chunkLocked(addr)
		if m.ch == nil || !m.ch.shareable() || addr-m.ch.base+n > m.ch.size {
			m.ch = nil
			return localRef{}, false
		}
		if !slices.Contains(m.need, m.ch) {
			m.need = append(m.need, m.ch)
		}
	}
	return localRef{m.ch.id, uint64(m.ch.off) + addr - m.ch.base}, true
}

// answerReadLocal answers a READ part on a local connection with where
// its ranges (checked already; memMu held for reading) lie in the
// agent's memory files: false if one lies in memory without a file (the
// caller sends the bytes instead).
func (a *Agent) answerReadLocal(s *localServer, w *bufio.Writer, k partKey, ranges []Region, hr *heldRead, ticket uint64) (bool, error) {
	h := make([]byte, 0, 17+localRefSize*len(ranges))
	h = append(h, tReadLocal)
	h = binary.LittleEndian.AppendUint64(h, uint64(k.id))
	h = binary.LittleEndian.AppendUint32(h, k.part)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(ranges)))
	a.mu.Lock()
	var m refMaker
	for _, r := range ranges {
		ref, ok := m.ref(a, r.Addr, r.Len)
		if !ok {
			a.mu.Unlock()
			return false, nil
		}
		h = binary.LittleEndian.AppendUint32(h, ref.chunk)
		h = binary.LittleEndian.AppendUint64(h, ref.off)
	}
	a.mu.Unlock()
	return true, a.sendLocalAnswer(s, w, h, m.need, k, hr, ticket)
}

// sendLocalAnswer sends a READ answer naming memory of this agent's (h:
// tReadLocal or tReadLayoutLocal) on a local connection, after this
// side's fence and the memory files it names that were not passed yet.
// The part (k, its admission ticket) is held until the client
// acknowledges it (readhold.go).
func (a *Agent) sendLocalAnswer(s *localServer, w *bufio.Writer, h []byte, need []*chunk, k partKey, hr *heldRead, ticket uint64) error {
	if err := w.Flush(); err != nil {
		return err
	}
	if err := s.holdRead(a, k, hr, ticket); err != nil {
		return err
	}
	s.mu.Lock()
	if s.mu.withdrawn {
		s.mu.Unlock()
		return ErrClosed
	}
	if s.mu.fence != nil {
		s.mu.Unlock()
	} else {
		// The page is recorded before it is sent, and the lock is not
		// held while sending (withdraw, from Unmap or Close, must never
		// wait for a socket): a withdraw from now on sets it.
		fd, page, err := newFence()
		if err != nil {
			s.mu.Unlock()
			return err
		}
		s.mu.fence = page
		s.mu.Unlock()
		_, _, err = s.c.WriteMsgUnix([]byte{tFence}, unix.UnixRights(fd), nil)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	if err := sendChunks(s.c, s.sent, need); err != nil {
		return err
	}
	if _, err := w.Write(h); err != nil {
		return err
	}
	return w.Flush()
}

// readLocal lands a tReadLocal answer: each piece copied out of the
// server's file into the transfer's memory here.
func (c *conn) readLocal(hdr []byte) error {
	if err := readFull(c.r, hdr[:16]); err != nil {
		return err
	}
	id := XferID(binary.LittleEndian.Uint64(hdr[:8]))
	part := binary.LittleEndian.Uint32(hdr[8:12])
	n := binary.LittleEndian.Uint32(hdr[12:16])
	if n > maxDescs {
		return fmt.Errorf("%w: %d descriptors", ErrProtocol, n)
	}
	tab := make([]byte, localRefSize*int(n))
	if err := readFull(c.r, tab); err != nil {
		return err
	}
	x := c.take(partKey{id, part})
	if x == nil {
		c.ackRead(id, part) // released or failed meanwhile: nothing to copy
		return nil
	}
	x.expand() // a layout READ the server answered piece by piece
	ds := x.descs[x.split[part]:x.split[part+1]]
	if int(n) != len(ds) {
		return c.lost(x, fmt.Errorf("%w: read answer with %d pieces for a part of %d", ErrProtocol, n, len(ds)))
	}
	return c.landRead(x, part, nil, func() ([]Region, []localRef) {
		loc := make([]Region, len(ds))
		refs := make([]localRef, len(ds))
		for i, d := range ds {
			e := tab[localRefSize*i:]
			loc[i], refs[i] = Region{d.Local, d.Len}, localRef{binary.LittleEndian.Uint32(e), binary.LittleEndian.Uint64(e[4:])}
		}
		return loc, refs
	})
}

// landRead copies a same-host READ part out of the server's memory
// (passed on this connection) into this agent's: as one GPU batch of its
// layouts as they are where it has them and they allow (deviceLayout),
// else piece by piece (pieces: the ranges here, where each lies in the
// server's memory). A piece naming memory the server did not pass breaks
// the protocol. The part finishes once its bytes landed (from another
// goroutine while GPU batches run).
func (c *conn) landRead(x *xfer, part uint32, lays []wireLayout, pieces func() ([]Region, []localRef)) error {
	a, s := c.p.owner, c.in
	if s.fence == nil {
		return c.lost(x, fmt.Errorf("%w: a local read answer before the fence", ErrProtocol))
	}
	if !a.beginLanding(x, nil) {
		// Released: the engine may have reused the memory; the server
		// may let its own go.
		c.ackRead(x.id, part)
		return nil
	}
	a.memMu.RLock()
	var posted bool
	var inflight []DevCopy
	var err error
	if lays != nil {
		posted, inflight, err = a.deviceLayout(s, lays)
	}
	if !posted && err == nil {
		loc, refs := pieces()
		s.src = s.src[:0]
		for i, ref := range refs {
			p, ok := s.piece(ref.chunk, ref.off, loc[i].Len)
			if !ok {
				a.memMu.RUnlock()
				a.endLanding(x, nil)
				clear(s.src)
				return c.lost(x, fmt.Errorf("%w: piece %d names [%d, +%d) of memory %d, which the peer did not pass", ErrProtocol, i, ref.off, loc[i].Len, ref.chunk))
			}
			s.src = append(s.src, p)
		}
		s.dst, err = a.targets(s.dst[:0], loc)
		if err == nil {
			inflight, err = s.copyPieces(s.dst, s.src)
		} else {
			err = fmt.Errorf("%w: %w", ErrXferFailed, err)
		}
		clear(s.dst)
		clear(s.src)
	}
	end := func(err error) {
		if err == nil && s.withdrawn() {
			err = fmt.Errorf("%w: the peer withdrew its memory during the copy (its fence set, or it hung up)", ErrXferFailed)
		}
		// The copy ended: a Release waiting for it returns (before the
		// acknowledgement, whose write may wait for the server), and the
		// server may let its memory go.
		a.endLanding(x, nil)
		c.ackRead(x.id, part)
		a.memMu.RUnlock()
		if err == nil {
			a.localParts.Add(1)
		}
		a.finishPart(x, err)
	}
	if len(inflight) > 0 {
		posted := err
		if s.async(inflight, func(err error, ended func()) {
			go func() { // finishing a READ may send its notification
				end(cmp.Or(posted, err))
				ended()
			}()
		}) {
			return nil
		}
		err = cmp.Or(err, waitCopies(inflight))
	}
	end(err)
	return nil
}

// chunkLocked returns the mapped chunk holding addr (a.mu held).
func (a *Agent) chunkLocked(addr uint64) *chunk {
	for i := range a.mu.chunks {
		c := &a.mu.chunks[i]
		if addr >= c.base && addr-c.base < c.size {
			return c
		}
	}
	return nil
}
