package etcdtest

import (
	"net"
	"testing"
)

// A port found free but taken before etcd binds it (another process's,
// as when the tests of other packages run beside these) does not fail
// Start: etcd starts again on new ports.
func TestStartOnAPortTakenMeanwhile(t *testing.T) {
	if _, err := Binary(); err != nil {
		t.Skip(err.Error())
	}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	picks := 0
	pickPort = func(t testing.TB) string {
		picks++
		if picks == 1 {
			return taken.Addr().String() // the client port, taken
		}
		return freePort(t)
	}
	defer func() { pickPort = freePort }()
	s := Start(t)
	if s.Endpoint() == taken.Addr().String() {
		t.Fatalf("etcd serves on the port that was taken, %s", s.Endpoint())
	}
	if picks < 4 {
		t.Fatalf("%d ports picked: Start did not start again on new ones", picks)
	}
}
