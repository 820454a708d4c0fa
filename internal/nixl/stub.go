//go:build !cgo

package nixl

import (
	"syscall"
	"time"
)

// Without cgo NIXL cannot be called: every entry point reports
// ErrUnavailable, so CGO_ENABLED=0 builds work.

// Library reports that NIXL is unavailable without cgo.
func Library() (string, error) { return "", ErrUnavailable }

// Agent is unavailable without cgo.
type Agent struct{}

// Xfer is unavailable without cgo.
type Xfer struct{}

// Notif is a received notification.
type Notif struct {
	From string
	Msg  []byte
}

// OpenVRAM reports ErrUnavailable without cgo.
func OpenVRAM(name, plugin string, params map[string]string) (*Agent, error) {
	return nil, ErrUnavailable
}

// Telemetry is NIXL's own measurement of a finished transfer.
type Telemetry struct {
	Post, Transfer time.Duration
	Bytes, Descs   uint64
}

// Telemetry is unavailable without cgo.
func (a *Agent) Telemetry(Xfer) (Telemetry, bool) { return Telemetry{}, false }

// Prepped is unavailable without cgo.
type Prepped struct{}

func (a *Agent) Prepare(string, [][3]uint64) (Prepped, error) { return Prepped{}, ErrUnavailable }
func (a *Agent) Unprepare(Prepped) error                      { return nil }
func (a *Agent) PostPrepared(bool, Prepped, Prepped, [][2]int32, []byte) (Xfer, error) {
	return Xfer{}, ErrUnavailable
}
func (a *Agent) MakePrepared(bool, Prepped, Prepped, [][2]int32, []byte) (Xfer, error) {
	return Xfer{}, ErrUnavailable
}
func (a *Agent) Make(bool, string, [][3]uint64, []byte) (Xfer, error) { return Xfer{}, ErrUnavailable }
func (a *Agent) Start(Xfer) error                                     { return ErrUnavailable }

// Open reports ErrUnavailable without cgo.
func Open(name, plugin string, params map[string]string) (*Agent, error) { return nil, ErrUnavailable }

// OpenConfig reports ErrUnavailable without cgo.
func OpenConfig(Config) (*Agent, error) { return nil, ErrUnavailable }

func (a *Agent) Name() string                                         { return "" }
func (a *Agent) Register([][3]uint64) error                           { return ErrUnavailable }
func (a *Agent) Deregister([][3]uint64) error                         { return ErrUnavailable }
func (a *Agent) Metadata() ([]byte, error)                            { return nil, ErrUnavailable }
func (a *Agent) LoadPeer([]byte) (string, error)                      { return "", ErrUnavailable }
func (a *Agent) InvalidatePeer(string) error                          { return ErrUnavailable }
func (a *Agent) Post(bool, string, [][3]uint64, []byte) (Xfer, error) { return Xfer{}, ErrUnavailable }
func (a *Agent) PostDevs(bool, string, [][3]uint64, [][2]uint64, []byte) (Xfer, error) {
	return Xfer{}, ErrUnavailable
}
func (a *Agent) State(Xfer) (bool, error)                    { return false, ErrUnavailable }
func (a *Agent) Release(Xfer) error                          { return ErrUnavailable }
func (a *Agent) Notify(string, []byte) error                 { return ErrUnavailable }
func (a *Agent) Drain(dst []Notif) ([]Notif, error)          { return dst, ErrUnavailable }
func (a *Agent) TryDrain(dst []Notif) ([]Notif, bool, error) { return dst, true, ErrUnavailable }
func (a *Agent) TryState(Xfer) (bool, bool, error)           { return false, true, ErrUnavailable }
func (a *Agent) Close() error                                { return nil }

// RestoredSignals returns nothing without cgo (no agent is ever made).
func RestoredSignals() map[syscall.Signal]int64 { return nil }
