package server_test

import (
	"errors"
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

// A direct worker stream (no gRPC: libkvxfer's engine in this process)
// is served as a gRPC one is: a hello naming this process's memory by
// address is answered Ready, steps are taken, a bye ends it cleanly; a
// first message that is no hello ends it with the reason; Cancel and the
// server's Close end it; what is handed after the end, or does not
// parse, is refused; no goroutine outlives it.
func TestDirectStream(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	mem, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	hello := &pb.WorkerHello{EngineId: "direct", Mode: pb.Mode_MODE_PUSH, Layout: stream.LayoutToProto(ptr(addrLayout(base, len(mem)))),
		CompatHash: "m", MaxMessageBytes: stream.DefaultMaxMessage,
		Memory: []*pb.SharedMemory{{Base: base, Size: uint64(len(mem)), InProcess: pb.InProcessMemory(stream.InProcessHost)}}}

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
