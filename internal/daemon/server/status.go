package server

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

// Status maps an error to a gRPC status error: the only place kvxfer's
// errors become status codes. Bad input is InvalidArgument, a topology
// mismatch or a GPU this host lacks (no driver, no device with the
// engine's UUID) FailedPrecondition, a worker that hit an internal error
// (kvxfer.ErrInternal) Internal, a closed daemon Unavailable, an unknown
// engine NotFound, a call the caller may not make PermissionDenied, a
// rank attached already AlreadyExists, context errors their own codes.
func Status(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	var code codes.Code
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	case errors.Is(err, kvxfer.ErrRequestLimit): // before ErrInvalid, which a scheduler call's errors are wrapped in
		code = codes.ResourceExhausted
	case errors.Is(err, stream.ErrInvalid), errors.Is(err, topology.ErrInvalidLayout), errors.Is(err, topology.ErrInvalidBlocks),
		errors.Is(err, hotpath.ErrInvalidRequest), errors.Is(err, kvxfer.ErrOutOfBounds), errors.Is(err, kvxfer.ErrBadMetadata):
		code = codes.InvalidArgument
	case errors.Is(err, topology.ErrIncompatible), errors.Is(err, topology.ErrUnsupported),
		errors.Is(err, cuda.ErrNoDevice), errors.Is(err, cuda.ErrUnavailable):
		code = codes.FailedPrecondition
	case errors.Is(err, kvxfer.ErrInternal): // before ErrClosed, which it also is
		code = codes.Internal
	case errors.Is(err, kvxfer.ErrClosed), errors.Is(err, errDraining):
		code = codes.Unavailable
	case errors.Is(err, kvxfer.ErrUnknownEngine):
		code = codes.NotFound
	case errors.Is(err, ErrPermission):
		code = codes.PermissionDenied
	case errors.Is(err, ErrAttached):
		code = codes.AlreadyExists
	case errors.Is(err, ErrLimit):
		code = codes.ResourceExhausted
	default:
		code = codes.Internal
	}
	return status.Error(code, err.Error())
}
