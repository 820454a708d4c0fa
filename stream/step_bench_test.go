package stream_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
	"google.golang.org/protobuf/proto"
)

// benchStep is a step of n receives and n sends, each with 2 groups of 8
// blocks, as the daemon hands it to each rank (StepFromProto).
func benchStep(n int) *pb.StepMeta {
	m := &kvxfer.StepMeta{Step: 7, SchedulerClock: time.Unix(0, 1)}
	spans := func(i int) []topology.Span {
		var out []topology.Span
		for g := range 2 {
			ids := make([]topology.BlockID, 8)
			for j := range ids {
				ids[j] = topology.BlockID(i*16 + g*8 + j)
			}
			out = append(out, topology.Span{Start: 0, IDs: ids})
		}
		return out
	}
	for i := range n {
		m.Recv = append(m.Recv, kvxfer.RecvReq{ReqID: fmt.Sprintf("d-%d", i), TransferID: fmt.Sprintf("t-%d", i), Local: spans(i),
			Deadline: time.Unix(0, 5), Remote: kvxfer.RemoteRef{EngineID: "P", Addr: "p:1", ReqID: fmt.Sprintf("p-%d", i), TPSize: 1, PPSize: 1, Tokens: 128}})
		m.Send = append(m.Send, kvxfer.SendReq{ReqID: fmt.Sprintf("p-%d", i), TransferID: fmt.Sprintf("t-%d", i), Deadline: time.Unix(0, 5),
			Blocks: spans(i), Tokens: 128})
	}
	return stream.StepToProto(m)
}

// BenchmarkStepFromProto: the daemon's conversion of a step's metadata
// for a rank, at 16 and 256 requests a side; allocations per request.
func BenchmarkStepFromProto(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprintf("%d", n), func(b *testing.B) {
			p := benchStep(n)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := stream.StepFromProto(p); err != nil {
					b.Fatal(err)
				}
			}
			allocs := testing.AllocsPerRun(10, func() { _, _ = stream.StepFromProto(p) })
			b.ReportMetric(allocs/float64(2*n), "allocs/request")
		})
	}
}

// A step survives the round trip through kvxfer.v1 (block lists sharing
// one allocation included: appending to one span's ids leaves the next
// one's alone), and each malformed field is refused by its name.
func TestStepConversion(t *testing.T) {
	p := benchStep(3)
	m, err := stream.StepFromProto(p)
	if err != nil {
		t.Fatal(err)
	}
	if back := stream.StepToProto(m); !proto.Equal(back, p) {
		t.Fatalf("round trip changed the step:\n%v\n%v", back, p)
	}
	first := m.Recv[0].Local[0].IDs
	next := m.Recv[0].Local[1].IDs[0]
	_ = append(first, 999)
	if m.Recv[0].Local[1].IDs[0] != next {
		t.Fatal("appending to one span's ids overwrote the next span's")
	}
	for _, tc := range []struct {
		name   string
		mutate func(*pb.StepMeta)
		field  string
	}{
		{"tokens", func(p *pb.StepMeta) { p.Recv[2].Remote.Tokens = 1 << 40 }, "step.recv[2].remote.tokens"},
		{"remote", func(p *pb.StepMeta) { p.Recv[1].Remote = nil }, "step.recv[1].remote is missing"},
		{"start", func(p *pb.StepMeta) { p.Send[1].Blocks[1].Start = -1 << 40 }, "step.send[1].blocks[1].start"},
		{"span", func(p *pb.StepMeta) { p.Recv[0].Local[1] = nil }, "step.recv[0].local[1] is missing"},
		{"send", func(p *pb.StepMeta) { p.Send[2] = nil }, "step.send[2] is missing"},
	} {
		q := benchStep(3)
		tc.mutate(q)
		if _, err := stream.StepFromProto(q); !errors.Is(err, stream.ErrInvalid) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: %v, want ErrInvalid naming %s", tc.name, err, tc.field)
		}
	}
}

// benchFinished is a rank's finished sets of n outcomes a side (a
// quarter failed with a reason) and a few invalid blocks.
func benchFinished(n int) *kvxfer.Finished {
	f := &kvxfer.Finished{InvalidBlocks: []topology.BlockID{3, 4, 5}}
	for i := range n {
		o := kvxfer.Outcome{ReqID: fmt.Sprintf("r-%d", i), Result: kvxfer.ResultDone}
		if i%4 == 0 {
			o.Result, o.Reason, o.Kind = kvxfer.ResultFailed, "peer gone", kvxfer.FailurePeerGone
		}
		f.Sending = append(f.Sending, o)
		f.Recving = append(f.Recving, o)
	}
	return f
}

// conversions are the stream's per-step conversions, each over a step
// or finished set of n requests a side.
func conversions(n int) map[string]func() {
	p := benchStep(n)
	m, _ := stream.StepFromProto(p)
	f := benchFinished(n)
	fp := stream.FinishedToProto(f)
	var se stream.StepEncoder
	var fe stream.FinishedEncoder
	return map[string]func(){
		"StepFromProto":     func() { _, _ = stream.StepFromProto(p) },
		"StepToProto":       func() { _ = stream.StepToProto(m) },
		"StepEncoder":       func() { _ = se.Encode(m) },
		"FinishedToProto":   func() { _ = stream.FinishedToProto(f) },
		"FinishedEncoder":   func() { _ = fe.Encode(f) },
		"FinishedFromProto": func() { _, _ = stream.FinishedFromProto(fp) },
	}
}

// reusing names the conversions whose memory is kept from one message to
// the next: the client's steps, the daemon's finished sets.
var reusing = map[string]bool{"StepEncoder": true, "FinishedEncoder": true}

// BenchmarkConversions: the client's step encoding (StepToProto), the
// daemon's finished sets (FinishedToProto) and the client's decoding of
// them (FinishedFromProto), at 16 and 256 requests a side.
func BenchmarkConversions(b *testing.B) {
	for _, n := range []int{16, 256} {
		for name, f := range conversions(n) {
			b.Run(fmt.Sprintf("%s/%d", name, n), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					f()
				}
				b.ReportMetric(testing.AllocsPerRun(10, f)/float64(2*n), "allocs/request")
			})
		}
	}
}

// TestConversionsZeroAllocsPerRequest: every per-step conversion
// allocates the same at 256 requests a side as at 16 (per step, never per
// request), and a handful of times at most; the encoders that keep their
// memory (the client's steps, the daemon's finished sets) allocate
// nothing at all once warm.
func TestConversionsZeroAllocsPerRequest(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under -race")
	}
	small, large := conversions(16), conversions(256)
	for name := range small {
		small[name]() // warm: the encoders size their memory
		large[name]()
		a16, a256 := testing.AllocsPerRun(20, small[name]), testing.AllocsPerRun(20, large[name])
		if a256 != a16 || a256 > 12 {
			t.Errorf("%s: %v allocations at 16 requests a side, %v at 256; want the same, at most 12", name, a16, a256)
		}
		if reusing[name] && a256 != 0 {
			t.Errorf("%s: %v allocations per set once warm, want 0", name, a256)
		}
	}
}

// An encoder reused across steps and finished sets of changing sizes
// (bigger, smaller, empty) gives each the message StepToProto and
// FinishedToProto give it alone: nothing of an earlier one stays.
func TestEncodersReused(t *testing.T) {
	var se stream.StepEncoder
	var fe stream.FinishedEncoder
	for _, n := range []int{3, 40, 1, 0, 17} {
		m, err := stream.StepFromProto(benchStep(n))
		if err != nil {
			t.Fatal(err)
		}
		m.Prefill = m.Send[:n/2]
		m.NotProcessed = []string{"x"}
		if got, want := se.Encode(m), stream.StepToProto(m); !proto.Equal(got, want) {
			t.Errorf("step of %d requests a side through a reused StepEncoder:\n%v\nwant\n%v", n, got, want)
		}
		f := benchFinished(n)
		if n == 0 {
			f.InvalidBlocks = nil
		}
		if got, want := fe.Encode(f), stream.FinishedToProto(f); !proto.Equal(got, want) {
			t.Errorf("finished sets of %d outcomes a side through a reused FinishedEncoder:\n%v\nwant\n%v", n, got, want)
		}
	}
}

// Finished sets survive the round trip through kvxfer.v1.
func TestFinishedConversion(t *testing.T) {
	f := benchFinished(5)
	back, err := stream.FinishedFromProto(stream.FinishedToProto(f))
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(back) != fmt.Sprint(*f) {
		t.Fatalf("round trip changed the sets:\n%v\n%v", back, *f)
	}
	empty, err := stream.FinishedFromProto(stream.FinishedToProto(&kvxfer.Finished{}))
	if err != nil || empty.Sending != nil || empty.Recving != nil || empty.InvalidBlocks != nil {
		t.Fatalf("empty sets: %+v, %v", empty, err)
	}
}
