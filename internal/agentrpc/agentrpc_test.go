package agentrpc_test

import (
	"errors"
	"fmt"
	"net"
	"testing"

	"github.com/kvxfer/kvxfer/internal/agentrpc"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// pipeHarness serves fake agents through agentrpc over in-process
// connections: the whole suite passes through the proxy.
type pipeHarness struct {
	fab *kvxfertest.Fabric
	n   int
}

func (h *pipeHarness) New(t *testing.T, size int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	h.n++
	a, err := h.fab.NewAgent(fmt.Sprint("agent-", h.n))
	if err != nil {
		t.Fatal(err)
	}
	r := a.Alloc(size, 0)
	srv, cli := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- agentrpc.Serve(srv, a, agentrpc.Info{Pid: h.n, Region: r}) }()
	c, err := agentrpc.NewClient(cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Close()
		<-served
	})
	if c.Info().Region != r || c.Info().Pid != h.n {
		t.Fatalf("Info = %+v, want region %+v", c.Info(), r)
	}
	return c, r, a.Bytes(r.Addr, r.Len)
}

func TestConformanceThroughRPC(t *testing.T) {
	kvxfertest.Conformance(t, &pipeHarness{fab: kvxfertest.NewFabric()})
}

// Errors keep their sentinels across the connection, and a client whose
// agent went away reports ErrClosed.
func TestErrors(t *testing.T) {
	h := &pipeHarness{fab: kvxfertest.NewFabric()}
	be, r, _ := h.New(t, 4096)
	err := be.Deregister([]kvxfer.MemRegion{r})
	if !errors.Is(err, kvxfer.ErrNotRegistered) || errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("Deregister of unregistered memory = %v, want ErrNotRegistered only", err)
	}
	if _, err := be.State(42); !errors.Is(err, kvxfer.ErrUnknownXfer) {
		t.Errorf("State(42) = %v, want ErrUnknownXfer", err)
	}
	if err := be.Close(); err != nil {
		t.Fatal(err)
	}
	if err := be.Register([]kvxfer.MemRegion{r}); !errors.Is(err, kvxfer.ErrClosed) {
		t.Errorf("Register after Close = %v, want ErrClosed", err)
	}
	if got := be.DrainNotifs(nil); len(got) != 0 {
		t.Errorf("DrainNotifs after Close = %v", got)
	}
}
