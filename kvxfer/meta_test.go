package kvxfer_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

func fullMeta() *kvxfer.StepMeta {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	spans := func(base topology.BlockID) []topology.Span {
		return []topology.Span{{Start: 16, IDs: []topology.BlockID{base, base + 1}}, {IDs: []topology.BlockID{base + 2}}}
	}
	return &kvxfer.StepMeta{Step: 7, SchedulerClock: at,
		Recv: []kvxfer.RecvReq{{ReqID: "d-1", TransferID: "t-1", Local: spans(1), Deadline: at,
			Remote: kvxfer.RemoteRef{EngineID: "P", Addr: "p:1", ReqID: "p-1", TPSize: 2, PPSize: 1, Blocks: spans(10), Tokens: 40, Expiry: at}}},
		Send:         []kvxfer.SendReq{{ReqID: "p-2", TransferID: "t-2", Deadline: at, Blocks: spans(20), Tokens: 33}},
		Prefill:      []kvxfer.SendReq{{ReqID: "p-3", TransferID: "t-3", Blocks: spans(30), Tokens: 17}},
		Save:         []kvxfer.SaveReq{{ReqID: "p-4", Blocks: [][]topology.BlockID{{40, 41}, {42}}}},
		InBatch:      []string{"p-2", "p-3"},
		NotProcessed: []string{"p-5"},
	}
}

// sharedSlices reports the paths of slices of a and b (walked in
// parallel) that share their first element: a clone must share none.
func sharedSlices(a, b reflect.Value, path string) []string {
	var out []string
	switch a.Kind() {
	case reflect.Pointer:
		if !a.IsNil() && !b.IsNil() {
			if a.Pointer() == b.Pointer() {
				out = append(out, path)
			}
			out = append(out, sharedSlices(a.Elem(), b.Elem(), path)...)
		}
	case reflect.Struct:
		for i := range a.NumField() {
			out = append(out, sharedSlices(a.Field(i), b.Field(i), path+"."+a.Type().Field(i).Name)...)
		}
	case reflect.Slice:
		if a.Len() > 0 && b.Len() > 0 && a.Index(0).Addr().Pointer() == b.Index(0).Addr().Pointer() {
			out = append(out, path)
		}
		for i := range min(a.Len(), b.Len()) {
			out = append(out, sharedSlices(a.Index(i), b.Index(i), path+"[]")...)
		}
	}
	return out
}

func TestStepMetaClone(t *testing.T) {
	orig, want := fullMeta(), fullMeta()
	c := orig.Clone()
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("Clone() = %+v, want %+v", c, want)
	}
	if shared := sharedSlices(reflect.ValueOf(orig), reflect.ValueOf(c), "StepMeta"); len(shared) > 0 {
		t.Fatalf("Clone() shares memory with the original at %v", shared)
	}
	// Mutating every nested slice of the clone leaves the original intact.
	c.Recv[0].Local[0].IDs[0] = 99
	c.Recv[0].Remote.Blocks[1].IDs[0] = 99
	c.Recv[0].ReqID = "x"
	c.Send[0].Blocks[0].IDs[1] = 99
	c.Prefill[0].Blocks[0] = topology.Span{}
	c.Save[0].Blocks[1][0] = 99
	c.InBatch[0], c.NotProcessed[0] = "x", "x"
	c.Recv = append(c.Recv, kvxfer.RecvReq{ReqID: "more"})
	if !reflect.DeepEqual(orig, want) {
		t.Errorf("original after mutating its clone = %+v, want %+v", orig, want)
	}

	for _, tc := range []struct {
		name string
		in   *kvxfer.StepMeta
	}{
		{"nil", nil},
		{"empty", &kvxfer.StepMeta{}},
		{"empty non-nil slices", &kvxfer.StepMeta{Recv: []kvxfer.RecvReq{}, InBatch: []string{}}},
		{"nil spans inside", &kvxfer.StepMeta{Recv: []kvxfer.RecvReq{{ReqID: "a"}}, Send: []kvxfer.SendReq{{ReqID: "b", Blocks: []topology.Span{{}}}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.in.Clone(); !reflect.DeepEqual(got, tc.in) {
				t.Errorf("Clone(%+v) = %+v, want an equal copy", tc.in, got)
			}
		})
	}
}

// An engine may hand one StepMeta to every rank: Step never modifies it,
// even when validation drops an entry, and every rank runs the good ones.
func TestStepSharedMetaUnchanged(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 2, nil)
		q := x.req("r1", 40, 0)
		now := time.Now()
		meta := &kvxfer.StepMeta{Step: 1, SchedulerClock: now, Recv: []kvxfer.RecvReq{
			{ReqID: "bad", Local: q.sim.D, Remote: kvxfer.RemoteRef{EngineID: ""}}, // dropped: no engine
			q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute)),
		}}
		want := meta.Clone()
		for i, w := range x.d.workers[0] {
			if err := w.Step(meta); err == nil || !strings.Contains(err.Error(), "Remote.EngineID is empty") {
				t.Errorf("rank %d: Step error = %v, want one naming Remote.EngineID", i, err)
			}
		}
		if !reflect.DeepEqual(meta, want) {
			t.Errorf("shared StepMeta after Step on two ranks = %+v, want unchanged %+v", meta, want)
		}
		x.sendP(q)
		x.settle()
		if got := x.recvResult(q); len(got) != 2 || got[0].Result != kvxfer.ResultDone || got[1].Result != kvxfer.ResultDone {
			t.Errorf("D outcomes = %+v, want done on both ranks", got)
		}
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		for i, w := range x.d.workers[0] {
			if got := w.Metrics().Snapshot().BadInput["recv_req.remote.engine_id"]; got != 1 {
				t.Errorf("rank %d: bad RecvReqs counted = %d, want 1", i, got)
			}
		}
		if !reflect.DeepEqual(meta, want) {
			t.Errorf("shared StepMeta after the transfer = %+v, want unchanged %+v", meta, want)
		}
	})
}
