package nixl

import (
	"errors"
	"fmt"
)

var (
	// ErrUnavailable: NIXL's C library cannot be loaded here.
	ErrUnavailable = errors.New("nixl: unavailable")
	// ErrClosed: the agent was closed.
	ErrClosed = errors.New("nixl: closed")
	// ErrBadString: a name or parameter holds a NUL byte, where the C
	// string NIXL gets would end.
	ErrBadString = errors.New("nixl: NUL byte in a string")
)

// Error keeps NIXL's status code.
type Error struct {
	Op   string
	Code int
	// Transport: the failure is the transport's, not the request's: a
	// transfer was made (its descriptors and peer were good) and posting
	// it failed, or a notification failed in the backend; such as a
	// connection to the peer that UCX found broken.
	Transport bool
}

func (e *Error) Error() string {
	return fmt.Sprintf("nixl: %s: status %d (%s)", e.Op, e.Code, codeName(e.Code))
}

func codeName(c int) string {
	switch c {
	case 1:
		return "in progress"
	case -1:
		return "invalid parameter"
	case -2:
		return "backend error"
	case -3:
		return "invalid state"
	case -4:
		return "exception"
	case -5:
		return "no telemetry"
	case -6:
		return "not found"
	}
	return "unknown"
}
