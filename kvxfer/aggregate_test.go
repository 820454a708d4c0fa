package kvxfer

import (
	"reflect"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

func TestAggregatorReportsOnceAllRanksListed(t *testing.T) {
	a, err := NewAggregator(3)
	if err != nil {
		t.Fatal(err)
	}
	done := Outcome{ReqID: "r", Result: ResultDone}
	for rank := range 2 {
		if out, err := a.Add(rank, &Finished{Sending: []Outcome{done}}); out != nil || err != nil {
			t.Fatalf("Add(rank %d) = %+v, %v; want nothing before every rank reported", rank, out, err)
		}
	}
	out, err := a.Add(2, &Finished{Sending: []Outcome{done}})
	if err != nil || out == nil || !reflect.DeepEqual(out.Sending, []Outcome{done}) {
		t.Fatalf("Add(last rank) = %+v, %v; want r done once", out, err)
	}
	if a.Pending() != 0 {
		t.Errorf("Pending = %d after the report, want 0", a.Pending())
	}
}

func TestAggregatorWorstResultWins(t *testing.T) {
	tests := []struct {
		name string
		in   []Result
		want Result
	}{
		{"all done", []Result{ResultDone, ResultDone}, ResultDone},
		{"one failed", []Result{ResultDone, ResultFailed}, ResultFailed},
		{"expired beats aborted", []Result{ResultAborted, ResultExpired}, ResultExpired},
		{"failed beats expired", []Result{ResultFailed, ResultExpired}, ResultFailed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, _ := NewAggregator(len(tc.in))
			var out *Finished
			for rank, r := range tc.in {
				out, _ = a.Add(rank, &Finished{Recving: []Outcome{{ReqID: "x", Result: r, Reason: r.String()}}})
			}
			if out == nil || len(out.Recving) != 1 || out.Recving[0].Result != tc.want || out.Recving[0].Reason != tc.want.String() {
				t.Errorf("aggregate of %v = %+v, want %v with its reason", tc.in, out, tc.want)
			}
		})
	}
}

func TestAggregatorRejectsBadInput(t *testing.T) {
	a, _ := NewAggregator(2)
	if _, err := a.Add(2, &Finished{}); err == nil || !strings.Contains(err.Error(), "rank 2") {
		t.Errorf("Add(rank 2 of 2) error = %v, want one naming rank 2", err)
	}
	o := Outcome{ReqID: "r", Result: ResultDone}
	if _, err := a.Add(0, &Finished{Sending: []Outcome{o, o}}); err == nil || !strings.Contains(err.Error(), `"r" twice`) {
		t.Errorf("double report error = %v, want one naming the request", err)
	}
	out, err := a.Add(1, &Finished{Sending: []Outcome{o}, InvalidBlocks: []topology.BlockID{3, 1, 3}})
	if err != nil || out == nil || len(out.Sending) != 1 || !reflect.DeepEqual(out.InvalidBlocks, []topology.BlockID{1, 3}) {
		t.Errorf("Add after a double report = %+v, %v; want r once and invalid blocks [1 3]", out, err)
	}
	if _, err := NewAggregator(0); err == nil {
		t.Error("NewAggregator(0) succeeded")
	}
}
