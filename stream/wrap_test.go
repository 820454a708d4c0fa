package stream_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// recordWorker answers a hello with ready and keeps every message its
// stream carried, until the stream ends.
type recordWorker struct {
	pb.UnimplementedWorkerServiceServer
	mu  sync.Mutex
	got []*pb.ConnectRequest
}

func (w *recordWorker) Connect(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	for {
		m, err := st.Recv()
		if err != nil {
			return nil
		}
		w.mu.Lock()
		w.got = append(w.got, m)
		w.mu.Unlock()
		if m.GetHello() != nil {
			if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Ready{Ready: &pb.Ready{}}}); err != nil {
				return err
			}
		}
		if m.GetBye() != nil {
			return nil
		}
	}
}

func (w *recordWorker) messages() []*pb.ConnectRequest {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]*pb.ConnectRequest(nil), w.got...)
}

// kvxfer.v1's integers are 32-bit: a value past that went out wrapped,
// another valid value (a TP size of 2^32+1 reached kvxferd as 1, a layer
// 2^32+3 as layer 3), and the daemon could not tell. The client refuses
// such a value, naming the field, and sends nothing of it.
func TestClientRefusesValuesPast32Bits(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := &recordWorker{}
	sock := filepath.Join(t.TempDir(), "w.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	pb.RegisterWorkerServiceServer(g, w)
	go func() { _ = g.Serve(l) }()
	defer g.Stop()
	c, err := stream.Dial("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const wrapped = 1<<32 + 1

	layout := topology.Layout{TPSize: 1, PPSize: 1}
	for _, tc := range []struct {
		field string
		hello stream.Hello
	}{
		{"hello.layout.tp_size", stream.Hello{Layout: topology.Layout{TPSize: wrapped, PPSize: 1}}},
		{"hello.layout.kernel_block_size", stream.Hello{Layout: topology.Layout{TPSize: 1, PPSize: 1, KernelBlockSize: wrapped + 15}}},
		{"hello.layout.groups[0].regions[1]", stream.Hello{Layout: topology.Layout{TPSize: 1, PPSize: 1,
			Groups: []topology.Group{{Kind: topology.KindFullAttention, Regions: []int{0, wrapped}}}}}},
		{"hello.first_layer", stream.Hello{Layout: layout, FirstLayer: wrapped + 2}},
		{"hello.memory[0].device", stream.Hello{Layout: layout, Memory: []stream.Memory{{Path: "/x", Size: 1, Device: wrapped}}}},
	} {
		tc.hello.EngineID, tc.hello.Mode = "E", kvxfer.ModePush
		rs, err := c.Connect(ctx, tc.hello)
		if err == nil {
			_ = rs.Close(ctx)
			t.Errorf("%s past 32 bits: connected, want a refusal naming it", tc.field)
			continue
		}
		if !errors.Is(err, stream.ErrInvalid) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s past 32 bits: %v, want ErrInvalid naming it", tc.field, err)
		}
	}
	if n := len(w.messages()); n != 0 {
		t.Fatalf("the daemon got %d messages of refused hellos, want none", n)
	}

	rs, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: layout})
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.LayerSaved(1, wrapped+2); !errors.Is(err, stream.ErrInvalid) || !strings.Contains(err.Error(), "layer_saved.layer") {
		t.Errorf("LayerSaved with a layer past 32 bits: %v, want ErrInvalid naming layer_saved.layer", err)
	}
	m := &kvxfer.StepMeta{Step: 1, Recv: []kvxfer.RecvReq{{ReqID: "d-1", Local: []topology.Span{{IDs: []topology.BlockID{1}}},
		Remote: kvxfer.RemoteRef{EngineID: "P", Addr: "127.0.0.1:1", TPSize: wrapped + 1}}}}
	if err := rs.Step(m); !errors.Is(err, stream.ErrInvalid) || !strings.Contains(err.Error(), "tp_size") || !strings.Contains(err.Error(), `"d-1"`) {
		t.Errorf("a step whose remote TP size is past 32 bits: %v, want ErrInvalid naming the request and tp_size", err)
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	if err := rs.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, m := range w.messages() {
		if m.GetLayerSaved() != nil || m.GetStep() != nil {
			t.Errorf("the daemon got %v, a refused message", m)
		}
	}
}
