package stream_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
)

// StepEntriesFromProto leaves out only the entries it cannot read, each
// a refusal naming its request and field: the step's other entries and
// its aborts convert as usual.
func TestStepEntriesRefusedAlone(t *testing.T) {
	p := benchStep(3)
	p.Recv[1].Remote = nil
	p.Send[2].Tokens = 1 << 40
	p.NotProcessed = []string{"p-x"}
	m, refused, err := stream.StepEntriesFromProto(p)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range m.Recv {
		ids = append(ids, r.ReqID)
	}
	for _, s := range m.Send {
		ids = append(ids, s.ReqID)
	}
	if !slices.Equal(ids, []string{"d-0", "d-2", "p-0", "p-1"}) || !slices.Equal(m.NotProcessed, []string{"p-x"}) {
		t.Errorf("converted %v (not processed %v), want d-0 d-2 p-0 p-1 and the abort", ids, m.NotProcessed)
	}
	if len(refused) != 2 {
		t.Fatalf("refused %+v, want d-1 and p-2", refused)
	}
	for i, w := range []struct {
		role       kvxfer.Role
		id, label  string
		reason     string
		localKnown bool
	}{
		{kvxfer.RoleConsumer, "d-1", "recv_req.remote", "step.recv[1].remote is missing", true},
		{kvxfer.RoleProducer, "p-2", "send_req.tokens", "step.send[2].tokens = 1099511627776 out of range", false},
	} {
		r := refused[i]
		if r.Role != w.role || r.ReqID != w.id || r.Field != w.label || !strings.Contains(r.Reason, w.reason) ||
			(len(r.Local) > 0) != w.localKnown || !errors.Is(r.Err, stream.ErrInvalid) {
			t.Errorf("refusal %d = %+v, want %s %s (%s) naming %q", i, r, w.role, w.id, w.label, w.reason)
		}
	}
	if _, _, err := stream.StepEntriesFromProto(nil); !errors.Is(err, stream.ErrInvalid) {
		t.Errorf("nil step: %v, want ErrInvalid", err)
	}
}
