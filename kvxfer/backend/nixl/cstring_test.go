//go:build linux

package nixl

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
)

// Names and parameters reach NIXL as C strings, which end at their first
// NUL byte: a Go string holding one is refused, naming it, instead of
// being cut short there. Before, a call naming peer "P\x00junk" reached
// peer P (a notification was delivered to it, and InvalidatePeer forgot
// it), an agent named "A\x00B" opened as "A" while its Name said
// otherwise, and a parameter value was cut at the NUL.
func TestNULInNamesRefused(t *testing.T) {
	a, b := newCloseEnd(t, 1<<16), newCloseEnd(t, 1<<16)
	peer := linked(t, a, b)
	bad := peer + "\x00junk"
	if err := a.b.Notify(bad, []byte("to the wrong peer")); err == nil {
		t.Error("Notify to a name with a NUL in it succeeded")
	}
	time.Sleep(100 * time.Millisecond)
	if got := b.b.DrainNotifs(nil); len(got) != 0 {
		t.Errorf("a notification to %q reached %q: %q", bad, peer, got[0].Msg)
	}
	if _, err := a.b.Post(hotpath.OpWrite, bad, []hotpath.Desc{{Local: a.r.Addr, Remote: b.r.Addr, Len: 64}}, nil); err == nil {
		t.Error("Post to a name with a NUL in it succeeded")
	}
	if _, err := a.b.Prepare(bad, []hotpath.Entry{{Addr: b.r.Addr, Len: 64}}); err == nil {
		t.Error("Prepare for a name with a NUL in it succeeded")
	}
	if err := a.b.InvalidatePeer(bad); err == nil {
		t.Error("InvalidatePeer of a name with a NUL in it succeeded")
	}
	if err := a.b.Notify(peer, []byte("still known")); err != nil {
		t.Errorf("the peer was forgotten: %v", err)
	}
	for _, cfg := range []Config{
		{Name: fmt.Sprint("nul-", rand.Uint64(), "\x00x")},
		{Name: fmt.Sprint("nul-", rand.Uint64()), Plugin: "UCX\x00x"},
		{Name: fmt.Sprint("nul-", rand.Uint64()), Params: map[string]string{"engine_config": "TLS=tcp\x00,x"}},
		{Name: fmt.Sprint("nul-", rand.Uint64()), Params: map[string]string{"device_list\x00x": "lo"}},
	} {
		be, err := New(cfg)
		if errors.Is(err, ErrUnavailable) {
			t.Skip(err)
		}
		if err == nil {
			t.Errorf("%+q: opened as %q", fmt.Sprint(cfg), be.Name())
			_ = be.Close()
			continue
		}
		if !strings.Contains(err.Error(), "NUL") {
			t.Errorf("%+q: refused with %v, which does not say why", fmt.Sprint(cfg), err)
		}
	}
}
