"""Typed errors carrying kvxferd's gRPC status codes.

Every failed call to the daemon raises a :class:`DaemonError` subclass chosen by
the status code the daemon returned (kvxferd maps its errors to codes in one
place: bad input -> INVALID_ARGUMENT, unknown engine -> NOT_FOUND, incompatible
layouts -> FAILED_PRECONDITION, closed or unreachable -> UNAVAILABLE).
"""

from __future__ import annotations

import grpc


class KvxferError(Exception):
    """Base of every error this package raises."""


class DaemonError(KvxferError):
    """A call to kvxferd failed; ``code`` is the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, op: str, details: str, code: grpc.StatusCode | None = None):
        if code is not None:
            self.code = code
        self.op = op
        self.details = details
        super().__init__(f"kvxferd {op}: {self.code.name}: {details}")


class InvalidArgument(DaemonError):
    """The daemon refused a field; ``details`` names it and its value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(DaemonError):
    """Unknown engine or rank (e.g. a scheduler call before open)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(DaemonError):
    """The request cannot be served as things stand (e.g. incompatible layouts)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(DaemonError):
    """The daemon is unreachable, draining or closed."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(DaemonError):
    """The call did not finish within its timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(DaemonError):
    """The daemon refused the caller."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(DaemonError):
    """The caller did not authenticate."""

    code = grpc.StatusCode.UNAUTHENTICATED


class StreamClosed(KvxferError):
    """A worker stream ended; ``cause`` is the daemon's error, if any."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


_BY_CODE = {
    c.code: c
    for c in (InvalidArgument, NotFound, FailedPrecondition, Unavailable, DeadlineExceeded,
              PermissionDenied, Unauthenticated)
}


def from_rpc_error(op: str, err: grpc.RpcError) -> DaemonError:
    """Returns the typed error for a failed gRPC call."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code)
    if cls is None:
        return DaemonError(op, details or "", code)
    return cls(op, details or "")


def from_code(op: str, code: int, details: str) -> DaemonError:
    """Returns the typed error for a numeric status code (a Step op's result)."""
    status = next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(status)
    if cls is None:
        return DaemonError(op, details, status)
    return cls(op, details)
