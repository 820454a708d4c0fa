package stream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// Client is an engine's connection to its kvxferd. It is safe for
// concurrent use.
type Client struct {
	cc *grpc.ClientConn
}

// Dial connects to kvxferd at target ("unix:///run/kvxferd.sock" or
// host:port). Extra options follow the defaults (insecure transport).
func Dial(target string, opts ...grpc.DialOption) (*Client, error) {
	cc, err := grpc.NewClient(target, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(DefaultMaxMessage))}, opts...)...)
	if err != nil {
		return nil, err
	}
	return &Client{cc: cc}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.cc.Close() }

// Memory holds part of a rank's KV cache, seen by the engine at Base: a
// shared-memory file (Path; make it with shm.Create, whose package doc
// gives the rules kvxferd applies), or GPU memory shared as a CUDA IPC
// handle (CUDAIPCHandle, 64 bytes; needs kvxferd -backend=nixl) on the GPU
// with DeviceUUID ("GPU-..." as cuda.FormatUUID writes it), or, when that
// is empty, on device ordinal Device as the engine numbers it.
//
// With a server running inside the engine's own process (libkvxfer),
// InProcess names the memory by its address instead: [Base, Base+Size) in
// that process, host or GPU memory (on Device or DeviceUUID), with no
// Path and no handle; servers refuse it from any other process.
type Memory struct {
	Path          string
	Base, Size    uint64
	CUDAIPCHandle []byte
	Device        int
	DeviceUUID    string
	InProcess     InProcessMemory
}

// InProcessMemory says whether a Memory is named by its address in the
// server's own process, and which kind it is (kvxfer.v1 InProcessMemory).
type InProcessMemory int32

// The kinds of InProcessMemory.
const (
	NotInProcess    InProcessMemory = iota // a file or a CUDA IPC handle
	InProcessHost                          // host memory
	InProcessDevice                        // GPU memory
)

// Hello describes a rank when its stream opens.
type Hello struct {
	EngineID   string
	Mode       kvxfer.Mode
	Layout     topology.Layout
	Memory     []Memory
	CompatHash string
	Layerwise  bool
	// FirstLayer is the model layer of Layout.Regions[0]: needed for
	// layer-wise push from a later pipeline stage under SeparateKV
	// (WorkerHello.first_layer), 0 elsewhere.
	FirstLayer int
	// MaxMessageBytes is the largest message this client accepts on the
	// stream (0: DefaultMaxMessage, what Dial sets); kvxferd keeps its
	// messages within half of it, and refuses less than 32 KiB. Set it when Dial's options set another
	// grpc.MaxCallRecvMsgSize.
	MaxMessageBytes uint32
}

// DefaultMaxMessage is the receive limit Dial sets (gRPC's default).
const DefaultMaxMessage = 4 << 20

// RankStream is one worker rank's stream. Step and LayerSaved may be
// called from any goroutine; Finished delivers the rank's outcomes.
type RankStream struct {
	st     grpc.BidiStreamingClient[pb.ConnectRequest, pb.ConnectResponse]
	cancel context.CancelFunc
	sendMu sync.Mutex
	// step is the message Step sends, its parts reused from one step to
	// the next under sendMu: gRPC has encoded a message when SendMsg
	// returns, so it may change then (a stats handler of the caller's
	// that kept messages past its callback would see them change).
	step struct {
		enc StepEncoder
		msg pb.ConnectRequest_Step
		req pb.ConnectRequest
	}
	finished chan kvxfer.Finished
	errs     chan *StepError
	done     chan struct{}
	err      error
}

// Connect opens a rank's stream and waits for kvxferd's ready. Finished
// sets arrive on the returned stream's Finished channel until it closes.
func (c *Client) Connect(ctx context.Context, h Hello) (*RankStream, error) {
	sctx, cancel := context.WithCancel(context.Background())
	// Until the stream is ready, ctx ending gives it up, wherever Connect
	// waits: for the stream (a caller's grpc.WaitForReady), to send the
	// hello (flow control), or for the ready.
	stop := context.AfterFunc(ctx, cancel)
	fail := func(err error) (*RankStream, error) {
		stop()
		cancel()
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, err
	}
	if err := h.check(); err != nil {
		return fail(err)
	}
	st, err := pb.NewWorkerServiceClient(c.cc).Connect(sctx)
	if err != nil {
		return fail(err)
	}
	hello := &pb.WorkerHello{EngineId: h.EngineID, Mode: pb.Mode(h.Mode), Layout: LayoutToProto(&h.Layout), CompatHash: h.CompatHash, Layerwise: h.Layerwise,
		MaxMessageBytes: h.MaxMessageBytes, FirstLayer: int32(h.FirstLayer)}
	if hello.MaxMessageBytes == 0 {
		hello.MaxMessageBytes = DefaultMaxMessage
	}
	for _, m := range h.Memory {
		hello.Memory = append(hello.Memory, &pb.SharedMemory{Path: m.Path, Base: m.Base, Size: m.Size, CudaIpcHandle: m.CUDAIPCHandle,
			Device: int32(m.Device), DeviceUuid: m.DeviceUUID, InProcess: pb.InProcessMemory(m.InProcess)})
	}
	if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}}); err != nil {
		if errors.Is(err, io.EOF) {
			// The daemon ended the stream first (a refusal): its status
			// comes from Recv, not Send.
			if _, rerr := st.Recv(); rerr != nil {
				err = rerr
			}
		}
		return fail(err)
	}
	m, err := st.Recv()
	if err != nil {
		return fail(err)
	}
	if m.GetReady() == nil {
		return fail(fmt.Errorf("stream: kvxferd answered hello with %T", m.Msg))
	}
	if !stop() {
		// ctx ended as the ready came: the stream is cancelled.
		return fail(ctx.Err())
	}
	r := &RankStream{st: st, cancel: cancel, finished: make(chan kvxfer.Finished, 64), errs: make(chan *StepError, 16), done: make(chan struct{})}
	go r.read()
	return r, nil
}

// check refuses, naming the field, a hello whose values kvxfer.v1 would
// carry wrapped (its integers are 32-bit): a TP size of 2^32+1 would
// reach kvxferd as 1, a valid layout that is not the engine's. kvxferd
// validates the rest.
func (h *Hello) check() error {
	l := &h.Layout
	for _, f := range [...]struct {
		name string
		v    int
	}{{"tp_rank", l.TPRank}, {"tp_size", l.TPSize}, {"pp_rank", l.PPRank}, {"pp_size", l.PPSize}, {"total_kv_heads", l.TotalKVHeads},
		{"head_size", l.HeadSize}, {"elem_bytes", l.ElemBytes}, {"logical_block_size", l.LogicalBlockSize},
		{"kernel_block_size", l.KernelBlockSize}, {"region_offset", l.RegionOffset}} {
		if !fits32(f.v) {
			return Invalid("hello.layout.%s = %d: past a 32-bit field", f.name, f.v)
		}
	}
	for i, g := range l.Groups {
		for j, r := range g.Regions {
			if !fits32(r) {
				return Invalid("hello.layout.groups[%d].regions[%d] = %d: past a 32-bit field", i, j, r)
			}
		}
	}
	if !fits32(h.FirstLayer) {
		return Invalid("hello.first_layer = %d: past a 32-bit field", h.FirstLayer)
	}
	for i, m := range h.Memory {
		if !fits32(m.Device) {
			return Invalid("hello.memory[%d].device = %d: past a 32-bit field", i, m.Device)
		}
	}
	return nil
}

// fits32 reports whether v is carried unchanged by a 32-bit field.
func fits32(v int) bool { return v >= math.MinInt32 && v <= math.MaxInt32 }

func (r *RankStream) read() {
	defer close(r.done)
	defer close(r.finished)
	// Once nothing reads the stream it is hung up, however reading
	// stopped: kvxferd then ends the rank (what it holds fails, fenced)
	// and Step fails, rather than taking steps whose outcomes nobody
	// reads.
	defer r.cancel()
	for {
		m, err := r.st.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				r.err = err
			}
			return
		}
		switch x := m.Msg.(type) {
		case *pb.ConnectResponse_Finished:
			f, err := FinishedFromProto(x.Finished)
			if err != nil {
				r.err = err
				return
			}
			// Delivered unless the stream is given up (Close's context
			// ended, or the connection broke): a reader waiting for an
			// engine that stopped reading would keep Close waiting for
			// ever.
			select {
			case r.finished <- f:
			case <-r.st.Context().Done():
				r.err = fmt.Errorf("stream: finished sets left unread when the stream ended: %w", r.st.Context().Err())
				return
			}
		case *pb.ConnectResponse_StepError:
			e := x.StepError
			se := &StepError{Step: e.Step, Message: e.Message, Dropped: e.Dropped, Recv: e.RecvRequestIds, Send: e.SendRequestIds}
			if se.Dropped {
				// Requests depend on it: delivered, as finished sets are
				// (or the stream ends: Close cancels it).
				select {
				case r.errs <- se:
				case <-r.st.Context().Done():
					return
				}
				continue
			}
			select {
			case r.errs <- se:
			default:
			}
		}
	}
}

func (r *RankStream) send(m *pb.ConnectRequest) error {
	r.sendMu.Lock()
	defer r.sendMu.Unlock()
	return r.st.Send(m)
}

// Step hands the rank one step's metadata: encoded and sent when it
// returns (meta is the caller's again), allocating nothing per request.
// Step waits while the rank's outcomes go unread (kvxferd takes no more
// steps than it can send outcomes for): read Finished from another
// goroutine, as the steps go out, or Step waits until Close's context
// ends (which gives the stream up).
func (r *RankStream) Step(meta *kvxfer.StepMeta) error {
	for i := range meta.Recv {
		// What kvxfer.v1 would carry wrapped (32-bit fields), refused
		// before anything is sent: a wrapped size names another layout.
		rm := &meta.Recv[i].Remote
		if !fits32(rm.TPSize) || !fits32(rm.PPSize) {
			return Invalid("step %d: recv[%d] (request %q): remote tp_size %d, pp_size %d: past a 32-bit field",
				meta.Step, i, meta.Recv[i].ReqID, rm.TPSize, rm.PPSize)
		}
	}
	r.sendMu.Lock()
	defer r.sendMu.Unlock()
	s := &r.step
	s.msg.Step = s.enc.Encode(meta)
	s.req.Msg = &s.msg
	err := r.st.Send(&s.req)
	s.msg.Step = nil
	return err
}

// StepRef hands the rank the step metadata its engine's scheduler
// published on the same daemon (StepRequest.PublishStep). recv and send
// are the consumer and producer requests the engine begins waiting on
// with this step on this rank: should the step be dropped, its StepError
// names them back (StepErrors), for the engine to fail. A step named again
// is refused (a StepError, not dropped) and ignored; one dropped is
// dropped again.
func (r *RankStream) StepRef(step uint64, recv, send []string) error {
	return r.send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_StepRef{StepRef: &pb.StepRef{Step: step, RecvRequestIds: recv, SendRequestIds: send}}})
}

// LayerSaved reports a layer of a step saved (layer-wise push).
func (r *RankStream) LayerSaved(step uint64, layer int) error {
	if !fits32(layer) {
		return Invalid("layer_saved.layer = %d (step %d): past a 32-bit field", layer, step)
	}
	return r.send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_LayerSaved{LayerSaved: &pb.LayerSaved{Step: step, Layer: int32(layer)}}})
}

// Finished delivers the rank's finished sets; it closes when the stream
// ends.
func (r *RankStream) Finished() <-chan kvxfer.Finished { return r.finished }

// Err waits for the stream to end (Finished closed) and returns why: nil
// after a graceful end.
func (r *RankStream) Err() error {
	<-r.done
	return r.err
}

// StepErrors delivers the rank's step errors. A dropped step's error is
// delivered as finished sets are (the stream waits for room: read it, the
// requests it ends get no outcome otherwise); one about refused entries,
// whose requests get their failed outcomes in Finished, is dropped when
// nobody reads.
func (r *RankStream) StepErrors() <-chan *StepError { return r.errs }

// StepError is a step, or entries of one, that a rank's worker did not
// take in (pb.StepError).
type StepError struct {
	// Step is the step's number (StepMeta.Step, or StepRef's).
	Step uint64
	// Message says why, naming the step, or each refused entry's request,
	// field and value.
	Message string
	// Dropped: no entry of the step reached the worker, and no outcome
	// will come on this rank for any request Recv and Send name. The
	// engine ends those, on this rank: a receive as failed, a send as
	// ended (its blocks freed).
	Dropped bool
	// Recv and Send are the consumer and producer requests of a dropped
	// step: those its StepRef listed, and those its metadata names when
	// kvxferd read it. A long list comes in several StepErrors of the
	// same step. Send leaves out a layer-wise producer the rank held
	// prefilling from an earlier step (its Prefill entry) that the step
	// finished: the worker ends it (nothing more is written from its
	// blocks, its consumer told), and its failed outcome, naming the
	// step, comes in Finished once its WRITEs in flight end.
	Recv, Send []string
}

func (e *StepError) Error() string {
	if e.Dropped {
		return fmt.Sprintf("step %d dropped: %s", e.Step, e.Message)
	}
	return fmt.Sprintf("step %d: %s", e.Step, e.Message)
}

// Close says bye: kvxferd lets the rank's transfers finish, sends every
// outcome left and ends the stream. Close returns once it ended (drain
// Finished meanwhile) or ctx ends, which gives the stream up (cancels it),
// also while the bye, or a Step, waits to be sent to a daemon that reads no
// more of the stream.
func (r *RankStream) Close(ctx context.Context) error {
	stop := context.AfterFunc(ctx, r.cancel)
	defer stop()
	err := r.send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Bye{Bye: &pb.Bye{}}})
	if err == nil {
		r.sendMu.Lock()
		err = r.st.CloseSend()
		r.sendMu.Unlock()
	}
	ended := false
	select {
	case <-r.done:
		ended = true
	case <-ctx.Done():
	}
	r.cancel()
	<-r.done
	if cerr := ctx.Err(); cerr != nil && (!ended || err != nil) {
		return cerr
	}
	if err == nil || (errors.Is(err, io.EOF) && r.err != nil) {
		// A bye the daemon did not take (io.EOF): it ended the stream
		// first, and why is the stream's error.
		err = r.err
	}
	return err
}
