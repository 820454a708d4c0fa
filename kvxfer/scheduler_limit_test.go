package kvxfer

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// Every set a Scheduler keeps per request is bounded by MaxRequests,
// whether the engine never hands back its outcomes (held, receiving),
// never finishes its requests (being saved, prefilled) or never builds a
// step (staged): one more is refused (ErrRequestLimit naming the bound,
// counted) and adds nothing, and what ends a request makes room. Before,
// each grew by one entry per request without end (in kvxferd, one engine
// could grow the daemon's memory so).
func TestSchedulerRequestLimit(t *testing.T) {
	const limit = 3
	producer := func(id string) *Request {
		return &Request{ID: id, PromptTokens: 16, Params: &TransferParams{TransferID: "t-" + id, DoRemoteDecode: true}}
	}
	consumer := func(id string) *Request {
		p := pParams(ModePush)
		p.TransferID, p.RemoteRequestID = "t-"+id, "p-"+id
		return &Request{ID: id, PromptTokens: 40, Params: p}
	}
	tests := []struct {
		name string
		mut  func(*SchedulerConfig)
		mode Mode
		// add tracks request id; it returns what the scheduler said.
		add func(s *Scheduler, id string) error
		// end makes room: it ends request id (nil: a BuildMeta does).
		end func(s *Scheduler, id string)
	}{
		{name: "held, no sending outcome", mode: ModePush,
			add: func(s *Scheduler, id string) error {
				_, _, err := s.RequestFinished(producer(id), FinishStopped, [][]topology.BlockID{ids(1)}, 16)
				s.BuildMeta()
				return err
			},
			end: func(s *Scheduler, id string) {
				s.Update(&Finished{Sending: []Outcome{{ReqID: id, Result: ResultDone}}})
			}},
		{name: "receiving, no receiving outcome", mode: ModePush,
			add: func(s *Scheduler, id string) error {
				err := s.AfterAlloc(consumer(id), Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, Computed: 16, External: 24})
				s.BuildMeta()
				return err
			},
			end: func(s *Scheduler, id string) {
				s.Update(&Finished{Recving: []Outcome{{ReqID: id, Result: ResultDone}}})
				_, _, _ = s.RequestFinished(&Request{ID: id}, FinishStopped, nil, 0)
			}},
		{name: "saved to the host buffer, never finished", mode: ModePull, mut: func(c *SchedulerConfig) { c.HostBuffer = true },
			add: func(s *Scheduler, id string) error {
				err := s.AfterAlloc(producer(id), Alloc{})
				s.BuildMeta()
				return err
			},
			end: func(s *Scheduler, id string) { _, _, _ = s.RequestFinished(producer(id), FinishAborted, nil, 0) }},
		{name: "prefilled, never finished", mode: ModePush, mut: func(c *SchedulerConfig) { c.Layerwise = true },
			add: func(s *Scheduler, id string) error {
				err := s.Prefill(producer(id), [][]topology.BlockID{ids(1)}, 0, 16)
				s.BuildMeta()
				return err
			},
			end: func(s *Scheduler, id string) { _, _, _ = s.RequestFinished(producer(id), FinishAborted, nil, 0) }},
		{name: "staged saves, no step built", mode: ModePull, mut: func(c *SchedulerConfig) { c.HostBuffer = true },
			add: func(s *Scheduler, id string) error {
				r := producer("p")
				if !s.saving["p"] {
					if err := s.AfterAlloc(r, Alloc{}); err != nil {
						return err
					}
				}
				return s.Scheduled(r, [][]topology.BlockID{ids(1)}, 0, 1)
			}},
		{name: "staged aborts, no step built", mode: ModePush,
			add: func(s *Scheduler, id string) error {
				_, _, err := s.RequestFinished(consumer(id), FinishAborted, nil, 0)
				return err
			}},
		{name: "staged producer aborts, no step built", mode: ModePush,
			add: func(s *Scheduler, id string) error {
				_, _, err := s.RequestFinished(producer(id), FinishAborted, nil, 0)
				return err
			}},
		{name: "staged batch, no step built", mode: ModePush,
			add: func(s *Scheduler, id string) error { return s.AfterAlloc(producer(id), Alloc{}) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, tc.mode, func(c *SchedulerConfig) {
				c.MaxRequests = limit
				if tc.mut != nil {
					tc.mut(c)
				}
			})
			for i := range limit {
				if err := tc.add(s, fmt.Sprintf("r%d", i)); err != nil {
					t.Fatalf("request %d of %d: %v", i, limit, err)
				}
			}
			err := tc.add(s, "over")
			if !errors.Is(err, ErrRequestLimit) || !strings.Contains(err.Error(), "MaxRequests") || !strings.Contains(err.Error(), `request "`) {
				t.Fatalf("request %d past MaxRequests %d: %v, want ErrRequestLimit naming the request and MaxRequests", limit+1, limit, err)
			}
			if got := s.Counters().RequestLimit; got != 1 {
				t.Errorf("Counters().RequestLimit = %d, want 1", got)
			}
			if tc.end != nil {
				tc.end(s, "r0")
			} else {
				s.BuildMeta()
			}
			if err := tc.add(s, "after"); err != nil {
				t.Errorf("a request after one ended: %v", err)
			}
		})
	}
}

// MaxRequests negative: no bound.
func TestSchedulerNoRequestLimit(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.MaxRequests = -1 })
	for i := range 100 {
		if _, _, err := s.RequestFinished(&Request{ID: fmt.Sprint(i), PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}},
			FinishStopped, [][]topology.BlockID{ids(1)}, 16); err != nil {
			t.Fatal(err)
		}
	}
	if s.Held() != 100 {
		t.Errorf("Held() = %d, want 100", s.Held())
	}
}
