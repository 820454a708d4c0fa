package server_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

func marshal(t *testing.T, m *pb.ConnectRequest) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// take waits for a direct stream's next message (or its end) and decodes
// it.
func take(t *testing.T, ds *server.DirectStream) (m *pb.ConnectResponse, ended bool, code codes.Code, msg string) {
	t.Helper()
	b, ok, ended, code, msg := ds.Take(10 * time.Second)
	if !ok && !ended {
		t.Fatal("nothing from the direct stream within 10 s")
	}
	if ended {
		return nil, true, code, msg
	}
	m = new(pb.ConnectResponse)
	if err := proto.Unmarshal(b, m); err != nil {
		t.Fatal(err)
	}
	return m, false, 0, ""
}

// directHello is a push worker's hello naming 64 KiB of this process's
// memory by address (mapped for the test's life).
func directHello(t *testing.T) *pb.WorkerHello {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	return &pb.WorkerHello{EngineId: "direct", Mode: pb.Mode_MODE_PUSH, Layout: stream.LayoutToProto(ptr(addrLayout(base, len(mem)))),
		CompatHash: "m", MaxMessageBytes: stream.DefaultMaxMessage,
		Memory: []*pb.SharedMemory{{Base: base, Size: uint64(len(mem)), InProcess: pb.InProcessMemory(stream.InProcessHost)}}}
}

// A direct worker stream (no gRPC: libkvxfer's engine in this process)
// is served as a gRPC one is: a hello naming this process's memory by
// address is answered Ready, steps are taken, a bye ends it cleanly; a
// first message that is no hello ends it with the reason; Cancel and the
// server's Close end it; what is handed after the end, or does not
// parse, is refused; no goroutine outlives it.
func TestDirectStream(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	hello := directHello(t)

	ds := d.srv.OpenDirect()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil || m.GetReady().GetAgentName() == "" {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready naming the agent", m, ended, code, msg)
	}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 1}}})); err != nil {
		t.Fatalf("a step: %v", err)
	}
	if err := ds.Put([]byte{0xff, 0xff, 0xff}); err == nil || !strings.Contains(err.Error(), "does not parse") {
		t.Fatalf("bytes that are no ConnectRequest: %v", err)
	}
	if err := ds.Put(make([]byte, server.MaxDirectMessage+1)); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("a message over MaxDirectMessage: %v", err)
	}
	if got := d.srv.Refusals()["bad_message"]; got != 2 {
		t.Fatalf("refusals of bad messages: %d, want 2", got)
	}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Bye{Bye: &pb.Bye{}}})); err != nil {
		t.Fatal(err)
	}
	ds.CloseSend()
	for {
		_, ended, code, msg := take(t, ds)
		if ended {
			if code != codes.OK {
				t.Fatalf("after bye: ended %v %s, want OK", code, msg)
			}
			break
		}
	}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 2}}})); !errors.Is(err, server.ErrDirectEnded) {
		t.Fatalf("a step after the end: %v, want ErrDirectEnded", err)
	}

	// The first message must be a hello.
	bad := d.srv.OpenDirect()
	if err := bad.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 1}}})); err != nil {
		t.Fatal(err)
	}
	if _, ended, code, msg := take(t, bad); !ended || code != codes.InvalidArgument || !strings.Contains(msg, "must be hello") {
		t.Fatalf("a step first: ended %v, %v %q; want InvalidArgument naming hello", ended, code, msg)
	}

	// Cancel ends a stream that waits for its hello.
	c := d.srv.OpenDirect()
	c.Cancel()
	if _, ended, code, _ := take(t, c); !ended || code != codes.Canceled {
		t.Fatalf("cancelled: ended %v, %v; want Canceled", ended, code)
	}

	// Nothing comes within a short wait on an open stream; the server's
	// Close ends it.
	open := d.srv.OpenDirect()
	if _, ok, ended, _, _ := open.Take(20 * time.Millisecond); ok || ended {
		t.Fatalf("an open stream gave ok %v ended %v before any hello", ok, ended)
	}
	if err := d.srv.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ended, _, _ := take(t, open); !ended {
		t.Fatal("the server's Close left a direct stream open")
	}
	// Every stream ended: none is served any more.
	var left string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		buf := make([]byte, 1<<20)
		left = ""
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "server.(*Server).Connect(") || strings.Contains(g, "server.(*Server).OpenDirect") {
				left = g
			}
		}
		if left == "" {
			return
		}
	}
	t.Fatalf("a direct stream's goroutine outlived it:\n%s", left)
}

func ptr[T any](v T) *T { return &v }

// A SchedulerService call without gRPC (CallDirect) runs the handler the
// gRPC call does, for this process: OpenScheduler names the peer
// address, MatchedTokens answers as over gRPC; an unknown method, a
// request that does not parse and a call the handler refuses come back
// with their gRPC status.
func TestCallDirect(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	call := func(method string, req, resp proto.Message) (codes.Code, string) {
		t.Helper()
		b, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		out, code, msg := d.srv.CallDirect(method, b, 5*time.Second)
		if code == codes.OK {
			if err := proto.Unmarshal(out, resp); err != nil {
				t.Fatal(err)
			}
		}
		return code, msg
	}
	var open pb.OpenSchedulerResponse
	if code, msg := call("OpenScheduler", &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "D", Mode: pb.Mode_MODE_PUSH,
		TpSize: 1, LogicalBlockSize: 16}}, &open); code != codes.OK || open.Addr != d.peerAddr {
		t.Fatalf("OpenScheduler: %v %s, %v; want the peer address %s", code, msg, &open, d.peerAddr)
	}
	var mt pb.MatchedTokensResponse
	req := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
	if code, msg := call("MatchedTokens", &pb.MatchedTokensRequest{EngineId: "D", Request: req}, &mt); code != codes.OK || mt.Tokens != 40 || !mt.Async {
		t.Fatalf("MatchedTokens: %v %s, %v", code, msg, &mt)
	}
	if code, msg := call("MatchedTokens", &pb.MatchedTokensRequest{EngineId: "nobody", Request: req}, &mt); code == codes.OK {
		t.Fatalf("MatchedTokens of an engine with no scheduler: OK (%s)", msg)
	}
	if _, code, msg := d.srv.CallDirect("NoSuchMethod", nil, 0); code != codes.Unimplemented || !strings.Contains(msg, "NoSuchMethod") {
		t.Fatalf("an unknown method: %v %q", code, msg)
	}
	if _, code, msg := d.srv.CallDirect("Step", []byte{0xff, 0xff}, 0); code != codes.InvalidArgument || !strings.Contains(msg, "does not parse") {
		t.Fatalf("bytes that are no StepRequest: %v %q", code, msg)
	}
	if _, code, msg := d.srv.CallDirect("Step", make([]byte, server.MaxDirectMessage+1), 0); code != codes.InvalidArgument ||
		!strings.Contains(msg, "at most") {
		t.Fatalf("a request over MaxDirectMessage: %v %q", code, msg)
	}
	if got := d.srv.Refusals()["bad_message"]; got != 2 {
		t.Fatalf("refusals of bad requests: %d, want 2", got)
	}
}

// A direct stream that ended says so to every Take, a Take that does not
// wait (0) included: never "nothing yet" (kvxfer.h: KVXFER_EENDED once the
// stream ended and every message before its end was taken).
func TestDirectTakeAfterEndSaysEnded(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	ds := d.srv.OpenDirect()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 1}}})); err != nil {
		t.Fatal(err)
	}
	if _, ended, code, _ := take(t, ds); !ended || code != codes.InvalidArgument {
		t.Fatalf("a step first: ended %v, %v; want the end, InvalidArgument", ended, code)
	}
	again := 0
	for range 200 {
		_, ok, ended, code, _ := ds.Take(0)
		switch {
		case ok:
			t.Fatal("a message after the end")
		case !ended:
			again++
		case code != codes.InvalidArgument:
			t.Fatalf("ended with %v, then %v", codes.InvalidArgument, code)
		}
	}
	if again > 0 {
		t.Fatalf("%d of 200 Take(0) on an ended stream said nothing came, not that it ended", again)
	}
}

// Draining does not wait for a stream that has not said hello (it could
// only be refused: the server takes no new rank while it drains): a stop
// of a server with such a stream open returns at once, not after the
// hello timeout, and the stream ends Unavailable (shutting down).
func TestDrainDoesNotWaitForHello(t *testing.T) {
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) { c.HelloTimeout = time.Minute })
	ds := d.srv.OpenDirect()
	time.Sleep(200 * time.Millisecond) // its Connect waits for the hello
	// "At once" is against the hello timeout (a minute): a Drain that
	// waited for the hello runs out of its 30 s. (A 2 s bound on the
	// Drain measured the machine's load as much as the server.)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t0 := time.Now()
	if err := d.srv.Drain(ctx); err != nil {
		t.Fatalf("Drain with one stream waiting for its hello (hello timeout 1m): %v after %v", err, time.Since(t0))
	}
	if _, ended, code, msg := take(t, ds); !ended || code != codes.Unavailable {
		t.Fatalf("the stream without hello after Drain: ended %v, %v %q; want Unavailable", ended, code, msg)
	}
}

// OpenScheduler refuses a duration in milliseconds past what it can hold
// (time.Duration's nanoseconds), naming the field, instead of letting it
// wrap: 18446744073710 ms (584 years) wrapped to a lease of 0.45 ms.
func TestOpenSchedulerMillisOverflow(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	for _, tc := range []struct {
		field string
		cfg   *pb.SchedulerConfig
	}{
		{"lease_millis", &pb.SchedulerConfig{LeaseMillis: 18446744073710}},
		{"registration_timeout_millis", &pb.SchedulerConfig{RegistrationTimeoutMillis: 18446744073710}},
		{"decoder_blocks_ttl_millis", &pb.SchedulerConfig{DecoderBlocksTtlMillis: 1 << 62}},
	} {
		tc.cfg.EngineId, tc.cfg.Mode, tc.cfg.TpSize, tc.cfg.LogicalBlockSize = "D-"+tc.field, pb.Mode_MODE_PUSH, 1, 16
		b, err := proto.Marshal(&pb.OpenSchedulerRequest{Config: tc.cfg})
		if err != nil {
			t.Fatal(err)
		}
		if _, code, msg := d.srv.CallDirect("OpenScheduler", b, 5*time.Second); code != codes.InvalidArgument || !strings.Contains(msg, tc.field) {
			t.Errorf("OpenScheduler with %s past time.Duration: %v %q; want InvalidArgument naming the field", tc.field, code, msg)
		}
	}
}

// A Put that waits for room (the server reads no more: 64 messages
// queued) returns once the stream ends, ErrDirectEnded: the end was
// recorded under the lock that Put held while it waited, so a stream that
// ended while the engine had a message waiting hung that engine's thread
// (and its CloseSend) until the server stopped.
func TestDirectPutWaitingWhenStreamEnds(t *testing.T) {
	entered, fail := make(chan struct{}), make(chan struct{})
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) {
		c.NewBackend = func(string, *topology.Layout, bool) (server.Backend, error) {
			close(entered)
			<-fail
			return nil, errors.New("no backend for this test")
		}
	})
	ds := d.srv.OpenDirect()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: directHello(t)}})); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered: // the server took the hello and reads no more until it answers
	case <-time.After(10 * time.Second):
		t.Fatal("the hello did not reach the backend factory within 10 s")
	}
	step := marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 1}}})
	for i := range 64 {
		if err := ds.Put(step); err != nil {
			t.Fatalf("step %d into the stream's queue: %v", i, err)
		}
	}
	put := make(chan error, 1)
	go func() { put <- ds.Put(step) }() // the 65th waits for room
	time.Sleep(100 * time.Millisecond)
	close(fail) // the hello is refused: the stream ends
	select {
	case err := <-put:
		if !errors.Is(err, server.ErrDirectEnded) {
			t.Fatalf("a Put waiting when the stream ended: %v, want ErrDirectEnded", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a Put waiting for room when the stream ended still waits 10 s later")
	}
	if _, ended, code, msg := take(t, ds); !ended || code == codes.OK {
		t.Fatalf("after the refused hello: ended %v, %v %q; want the end with the refusal", ended, code, msg)
	}
}

// A message handed to a direct stream that ended is refused every time
// (kvxfer.h: KVXFER_EENDED once it ended): the engine learns its step
// reached no rank. Put's wait chose at random between room in the
// stream's buffer and its end, and took about one in three into the
// buffer of a stream nobody would read again, answering OK.
func TestDirectPutAfterEndRefused(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 1}}})); err != nil {
		t.Fatal(err)
	}
	if _, ended, code, _ := take(t, ds); !ended || code != codes.InvalidArgument {
		t.Fatalf("a step first: ended %v, %v; want the end, InvalidArgument", ended, code)
	}
	step := marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 2}}})
	taken := 0
	for range 60 { // the stream's buffer holds 64
		if err := ds.Put(step); err == nil {
			taken++
		} else if !errors.Is(err, server.ErrDirectEnded) {
			t.Fatalf("Put after the end = %v, want ErrDirectEnded", err)
		}
	}
	if taken > 0 {
		t.Errorf("%d of 60 Puts after the stream ended answered OK, want each refused (ErrDirectEnded)", taken)
	}
}

// An engine that steps without taking what the server sends (its one
// thread puts step after step, and takes only later) is not held for ever:
// its gRPC stream's reader takes the server's messages as they come, and
// a direct stream's Put, which waited for room while the server's sender
// waited for the engine to take and its receiver for the sender, hung the
// engine's thread once the server had sent directOut (1024) messages
// nobody took. Every request still ends in exactly one outcome, in order,
// and the stream ends cleanly after bye.
func TestDirectPutWhileTheEngineTakesNothing(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: directHello(t)}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready", m, ended, code, msg)
	}
	const steps = 3000 // each answered by a Finished (one request aborted before it was scheduled)
	put := make(chan error, 1)
	go func() {
		for i := 1; i <= steps; i++ {
			m := &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: uint64(i),
				Recv: []*pb.RecvRequest{{RequestId: fmt.Sprintf("r%d", i), Aborted: true}}}}}
			if err := ds.Put(marshal(t, m)); err != nil {
				put <- fmt.Errorf("step %d: %w", i, err)
				return
			}
		}
		put <- ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Bye{Bye: &pb.Bye{}}}))
	}()
	select {
	case err := <-put:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		ds.Cancel() // ends the Put that waits, and the test
		<-put
		t.Fatalf("the engine's Puts (%d steps, nothing taken) still wait 30 s on", steps)
	}
	ds.CloseSend()
	next := 1
	for {
		m, ended, code, msg := take(t, ds)
		if ended {
			if code != codes.OK {
				t.Fatalf("after bye: ended %v %s, want OK", code, msg)
			}
			break
		}
		for _, o := range m.GetFinished().GetRecving() {
			if want := fmt.Sprintf("r%d", next); o.GetRequestId() != want {
				t.Fatalf("outcome for %s, want %s next (each request once, in order)", o.GetRequestId(), want)
			}
			next++
		}
	}
	if next != steps+1 {
		t.Fatalf("%d outcomes, want %d", next-1, steps)
	}
}
