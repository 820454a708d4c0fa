package server_test

import (
	"context"
	"fmt"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// BenchmarkHandshakeRPC: a whole handshake over loopback gRPC for a big
// deployment's payload, with and without zstd.
func BenchmarkHandshakeRPC(b *testing.B) {
	for _, descs := range []int{10000, 100000} {
		for _, compress := range []int{-1, 1024} {
			name := fmt.Sprintf("descs-%d/zstd=%v", descs, compress > 0)
			b.Run(name, func(b *testing.B) {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					b.Fatal(err)
				}
				srv, err := server.New(server.Config{PeerAddr: ln.Addr().String(), CompressAbove: compress, Logger: quiet})
				if err != nil {
					b.Fatal(err)
				}
				var list pb.RankList
				if err := proto.Unmarshal(server.HandshakePayloadForTest(8, 80, descs), &list); err != nil {
					b.Fatal(err)
				}
				for _, r := range list.Ranks {
					l, err := stream.LayoutFromProto("layout", r.Layout)
					if err != nil {
						b.Fatal(err)
					}
					srv.PublishForTest(kvxfer.RankInfo{EngineID: r.EngineId, CompatHash: r.CompatHash, Layout: l, Agent: r.Agent})
				}
				g := grpc.NewServer()
				srv.RegisterPeer(g)
				go func() { _ = g.Serve(ln) }()
				defer g.Stop()
				res := server.NewPeerResolver(server.ResolverConfig{})
				defer res.Close()
				for b.Loop() {
					out, err := res.Handshake(context.Background(), "prefill-0", ln.Addr().String())
					if err != nil || len(out.Ranks) != 8 {
						b.Fatalf("handshake: %d ranks, %v", len(out.Ranks), err)
					}
				}
			})
		}
	}
}

// A handshake payload larger than gRPC's default 4 MiB message limit
// still goes through (compressed, and the resolver accepts large ones).
func TestLargeHandshake(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	for _, compress := range []int{-1, 1024} {
		srv, err := server.New(server.Config{PeerAddr: ln.Addr().String(), CompressAbove: compress, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		var list pb.RankList
		_ = proto.Unmarshal(server.HandshakePayloadForTest(8, 80, 100000), &list)
		for _, r := range list.Ranks {
			l, _ := stream.LayoutFromProto("layout", r.Layout)
			srv.PublishForTest(kvxfer.RankInfo{EngineID: r.EngineId, CompatHash: r.CompatHash, Layout: l, Agent: r.Agent})
		}
		g := grpc.NewServer()
		srv.RegisterPeer(g)
		go func() { _ = g.Serve(ln) }()
		res := server.NewPeerResolver(server.ResolverConfig{})
		out, err := res.Handshake(context.Background(), "prefill-0", ln.Addr().String())
		if err != nil || len(out.Ranks) != 8 || len(out.Ranks[0].Agent) < 1<<20 {
			t.Errorf("compress above %d: handshake of 16 MB: %d ranks, %v", compress, len(out.Ranks), err)
		}
		res.Close()
		g.Stop()
		ln, _ = net.Listen("tcp", ln.Addr().String())
	}
	ln.Close()
}
