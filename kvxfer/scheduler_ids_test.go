package kvxfer

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// A request whose id, or an id or address of its params, is longer than
// MaxIDBytes (what a rank takes in a step and a peer in a message) is
// refused by every scheduler call that would keep it, naming the field and
// its length and quoting only the start of the value, counted in
// BadParams; the engine's other requests carry on. Before, the scheduler
// kept such requests (MaxRequests of them, each as long as a message
// allows: gigabytes for one engine), and their ranks refused them later,
// at the step.
func TestSchedulerIDsBounded(t *testing.T) {
	long := strings.Repeat("x", MaxIDBytes+1)
	producer := func(id string) *Request {
		return &Request{ID: id, PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}}
	}
	consumer := func(id string) *Request {
		p := pParams(ModePush)
		p.RemoteRequestID = "p-" + id
		return &Request{ID: id, PromptTokens: 40, Params: p}
	}
	tests := []struct {
		name, field string
		mode        Mode
		mut         func(*SchedulerConfig)
		call        func(s *Scheduler, r *Request) error
		req         func(id string) *Request
		long        func(r *Request)
	}{
		{name: "request_finished id", field: "Request.ID", mode: ModePush, req: producer,
			long: func(r *Request) { r.ID = long },
			call: func(s *Scheduler, r *Request) error {
				_, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1)}, 16)
				return err
			}},
		{name: "request_finished transfer id", field: "TransferID", mode: ModePush, req: producer,
			long: func(r *Request) { r.Params.TransferID = long },
			call: func(s *Scheduler, r *Request) error {
				_, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1)}, 16)
				return err
			}},
		{name: "after_alloc remote engine id", field: "RemoteEngineID", mode: ModePush, req: consumer,
			long: func(r *Request) { r.Params.RemoteEngineID = long },
			call: func(s *Scheduler, r *Request) error {
				return s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, Computed: 16, External: 24})
			}},
		{name: "after_alloc remote request id", field: "RemoteRequestID", mode: ModePush, req: consumer,
			long: func(r *Request) { r.Params.RemoteRequestID = long },
			call: func(s *Scheduler, r *Request) error {
				return s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, Computed: 16, External: 24})
			}},
		{name: "after_alloc remote addr", field: "RemoteAddr", mode: ModePush, req: consumer,
			long: func(r *Request) { r.Params.RemoteAddr = long },
			call: func(s *Scheduler, r *Request) error {
				return s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, Computed: 16, External: 24})
			}},
		{name: "after_alloc producer id", field: "Request.ID", mode: ModePush, req: producer,
			long: func(r *Request) { r.ID = long },
			call: func(s *Scheduler, r *Request) error { return s.AfterAlloc(r, Alloc{}) }},
		{name: "prefill id", field: "Request.ID", mode: ModePush, mut: func(c *SchedulerConfig) { c.Layerwise = true }, req: producer,
			long: func(r *Request) { r.ID = long },
			call: func(s *Scheduler, r *Request) error { return s.Prefill(r, [][]topology.BlockID{ids(1)}, 0, 16) }},
		{name: "scheduled id", field: "Request.ID", mode: ModePull, mut: func(c *SchedulerConfig) { c.HostBuffer = true }, req: producer,
			long: func(r *Request) { r.ID = long },
			call: func(s *Scheduler, r *Request) error {
				s.saving[r.ID] = true // as if AfterAlloc had taken it (it refuses the id now)
				return s.Scheduled(r, [][]topology.BlockID{ids(1)}, 0, 16)
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, tc.mode, tc.mut)
			bad := tc.req("bad")
			tc.long(bad)
			err := tc.call(s, bad)
			if err == nil || !strings.Contains(err.Error(), tc.field) || !strings.Contains(err.Error(), "1025 bytes, want at most 1024") {
				t.Fatalf("call with %s of %d bytes: %v, want an error naming %s and its length", tc.field, len(long), err, tc.field)
			}
			if len(err.Error()) > 256 {
				t.Errorf("error has %d bytes, want the value quoted in part only", len(err.Error()))
			}
			if got := s.Counters().BadParams; got != 1 {
				t.Errorf("Counters().BadParams = %d, want 1", got)
			}
			if err := tc.call(s, tc.req("good")); err != nil {
				t.Errorf("a good request after: %v", err)
			}
			m := s.BuildMeta()
			for _, e := range m.Recv {
				if len(e.ReqID) > MaxIDBytes || len(e.Remote.EngineID) > MaxIDBytes || len(e.Remote.Addr) > MaxIDBytes || len(e.Remote.ReqID) > MaxIDBytes {
					t.Errorf("step staged a receive with an id past MaxIDBytes")
				}
			}
			for _, e := range append(m.Send, m.Prefill...) {
				if len(e.ReqID) > MaxIDBytes || len(e.TransferID) > MaxIDBytes {
					t.Errorf("step staged a send with an id past MaxIDBytes")
				}
			}
		})
	}
	s, _ := newSched(t, ModePush, nil)
	r := consumer("bad")
	r.ID = long
	if n, async := s.MatchedTokens(r, 0); n != 0 || async {
		t.Errorf("MatchedTokens of a request with a long id = %d, %v, want 0, false", n, async)
	}
}
