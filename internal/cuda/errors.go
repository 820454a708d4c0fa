package cuda

import (
	"errors"
	"fmt"
)

// ErrUnavailable: no CUDA driver or device here.
var ErrUnavailable = errors.New("cuda: unavailable")

// Error keeps the driver's status.
type Error struct {
	Op   string
	Code int
	Msg  string
}

func (e *Error) Error() string { return fmt.Sprintf("cuda: %s: CUresult %d (%s)", e.Op, e.Code, e.Msg) }
