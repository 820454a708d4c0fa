"""kvxfer inside this process (the in-process placement): libkvxfer, the
server kvxferd runs, loaded as a C shared library.

:func:`start` loads the library once per process (ctypes), starts its
server (idempotent) and returns the gRPC endpoint the engine's per-rank
streams connect to (``kvxfer.Client(endpoint)``); there, and only from this
process, memory may be named by its address (``SharedMemory.in_process``:
:func:`host_memory`). :func:`stop` stops it; it also stops at interpreter
exit. A child forked from a process that loaded the library gets
:class:`ForkedChildError` from every call (the Go runtime does not survive
fork): start kvxfer in a spawned process instead.

The library is found at ``$KVXFER_LIBKVXFER``, or else ``libkvxfer.so``
beside this package; build it with
``go build -buildmode=c-shared -o libkvxfer.so ./cmd/libkvxfer``.
The library changes no environment variable and leaves Python's signal
handlers alone.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import threading
from pathlib import Path

from kvxfer.v1 import kvxfer_pb2 as pb

__all__ = ["InProcessError", "ForkedChildError", "library_path", "start", "check_config", "stop", "endpoint", "version", "host_memory"]

# Status codes (cmd/libkvxfer/kvxfer.h).
OK, ECONFIG, ESTARTED, EFORK, ERANGE, EFAIL, EAGAIN, EENDED, ESTATUS = 0, 1, 2, 3, 4, 5, 6, 7, 8


class InProcessError(RuntimeError):
    """libkvxfer refused a call; ``code`` is its status (kvxfer.h)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class ForkedChildError(InProcessError):
    """A call in a child forked from a process that loaded libkvxfer."""


# Reentrant: a signal handler runs on the thread it interrupts, which may
# hold the lock (inside start, check_config or version); one that calls
# stop() (a SIGTERM handler shutting the server down) would otherwise wait
# for itself for ever. The C calls it guards are never interrupted midway
# (Python runs handlers between bytecodes), and libkvxfer orders its own
# start and stop.
_lock = threading.RLock()
# _stops counts stops: a start that a stop interrupted (a signal handler)
# returns its endpoint but does not record it as the running one.
_stops = 0
_lib: ctypes.CDLL | None = None
_path: str | None = None
_endpoint: str | None = None
_loader_pid: int | None = None
_exit_registered = False


def _forked_error() -> ForkedChildError:
    return ForkedChildError(EFORK, f"kvxfer: called in a forked child (pid {os.getpid()}) of the process that loaded "
                            f"libkvxfer (pid {_loader_pid}): the Go runtime does not survive fork; start kvxfer in a "
                            "spawned process (multiprocessing 'spawn'), not a forked one")


def _after_fork_in_child() -> None:
    # The lock may have been held by another thread at fork: a new one.
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check_not_forked() -> None:
    """Raises ForkedChildError in a child forked from the process that
    loaded the library (before a caller waits for a lock that a thread of
    the parent may have held at the fork: no thread of the child would
    ever let go of it)."""
    if _lib is not None and os.getpid() != _loader_pid:
        raise _forked_error()


def library_path() -> str:
    """Where libkvxfer is: $KVXFER_LIBKVXFER, else libkvxfer.so beside
    this package."""
    p = os.environ.get("KVXFER_LIBKVXFER") or str(Path(__file__).resolve().parent / "libkvxfer.so")
    if not os.path.exists(p):
        raise InProcessError(EFAIL, f"kvxfer: libkvxfer not found at {p}: build it with "
                             "go build -buildmode=c-shared -o libkvxfer.so ./cmd/libkvxfer and set KVXFER_LIBKVXFER")
    return p


def _load() -> ctypes.CDLL:
    """The library, loaded once per process (its Go runtime with it)."""
    global _lib, _path, _loader_pid
    if _lib is not None:
        if os.getpid() != _loader_pid:
            raise _forked_error()
        return _lib
    path = library_path()
    lib = ctypes.CDLL(path)
    lib.kvxfer_start.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.kvxfer_start.restype = ctypes.c_int
    lib.kvxfer_stop.argtypes = []
    lib.kvxfer_stop.restype = ctypes.c_int
    lib.kvxfer_version.restype = ctypes.c_char_p
    lib.kvxfer_last_error.restype = ctypes.c_char_p
    if hasattr(lib, "kvxfer_check_config"):
        lib.kvxfer_check_config.argtypes = [ctypes.c_char_p]
        lib.kvxfer_check_config.restype = ctypes.c_int
    if hasattr(lib, "kvxfer_stream_open"):  # C ABI 2: direct streams
        lib.kvxfer_stream_open.argtypes = []
        lib.kvxfer_stream_open.restype = ctypes.c_longlong
        lib.kvxfer_stream_put.argtypes = [ctypes.c_longlong, ctypes.c_char_p, ctypes.c_size_t]
        lib.kvxfer_stream_put.restype = ctypes.c_int
        lib.kvxfer_stream_take.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.POINTER(ctypes.c_void_p),
                                           ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
        lib.kvxfer_stream_take.restype = ctypes.c_int
        lib.kvxfer_stream_close_send.argtypes = [ctypes.c_longlong]
        lib.kvxfer_stream_close_send.restype = None
        lib.kvxfer_stream_release.argtypes = [ctypes.c_longlong]
        lib.kvxfer_stream_release.restype = None
        lib.kvxfer_free.argtypes = [ctypes.c_void_p]
        lib.kvxfer_free.restype = None
        lib.kvxfer_call.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_longlong,
                                    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
        lib.kvxfer_call.restype = ctypes.c_int
    _lib, _path, _loader_pid = lib, path, os.getpid()
    return lib


def _error(lib: ctypes.CDLL, code: int) -> InProcessError:
    msg = (lib.kvxfer_last_error() or b"").decode("utf-8", "replace") or f"kvxfer: status {code}"
    return (ForkedChildError if code == EFORK else InProcessError)(code, msg)


def start(config: dict | None = None) -> str:
    """Starts this process's kvxfer server (or finds it running with the
    same configuration) and returns its endpoint, a gRPC target.

    ``config`` keys are kvxferd serve's flag names (``-`` or ``_``), e.g.
    ``{"peer_listen": "0.0.0.0:7600", "peer_secret_file": "...",
    "backend": "nixl"}``; the defaults are kvxferd's, except an abstract
    socket for this process only, a peer port the system picks, no metrics
    endpoint, and a drain-timeout of 5 s."""
    global _endpoint, _exit_registered
    text = json.dumps(config or {}, sort_keys=True)
    with _lock:
        lib = _load()
        buf = ctypes.create_string_buffer(4096)
        stops = _stops
        code = lib.kvxfer_start(text.encode(), buf, len(buf))
        if code != OK:
            raise _error(lib, code)
        ep = buf.value.decode()
        if stops == _stops:  # (else a stop came in since: none runs)
            _endpoint = ep
        if not _exit_registered:
            atexit.register(_at_exit)
            _exit_registered = True
        return ep


def check_config(config: dict | None = None) -> None:
    """Checks ``config`` as :func:`start` reads it (every key known, every
    value of its flag's type and range, the keys together consistent)
    without starting anything: raises InProcessError (ECONFIG) naming the
    key and the value. Loads the library (a library without the check
    checks nothing here; its start does)."""
    text = json.dumps(config or {}, sort_keys=True)
    with _lock:
        lib = _load()
        if not hasattr(lib, "kvxfer_check_config"):
            return
        code = lib.kvxfer_check_config(text.encode())
        if code != OK:
            raise _error(lib, code)


def stop() -> None:
    """Stops this process's server, if one runs: transfers in flight
    finish (within its drain-timeout), every rank's stream ends, and no
    memory named by address is touched after it returns. Raises
    InProcessError where a rank had still not let go of its memory when
    the server gave up waiting (40 s after the drain): that memory may
    still be touched, and must not be freed. A signal handler's exception
    (Ctrl-C's KeyboardInterrupt) interrupts the wait: it propagates while
    the stop goes on, and memory may be touched until it ends; at
    interpreter exit the process then exits without waiting."""
    global _endpoint, _stops
    with _lock:
        if _lib is None:
            return
        lib = _load()
        _stops += 1
        # (The endpoint stays this server's while it drains: this
        # process's clients reach it directly, and are refused at once.)
        try:
            code = _stop_interruptibly(lib)
        finally:
            _endpoint = None  # (none runs now, whatever the stop's code)
        if code != OK:
            raise _error(lib, code)


def _stop_interruptibly(lib: ctypes.CDLL) -> int:
    """Calls kvxfer_stop on a thread of its own and waits for it where a
    signal handler can run: Python runs handlers on the main thread
    between bytecodes only, and a stop draining transfers (up to the
    drain-timeout, plus 40 s where a rank does not let go of its memory)
    inside one C call would keep Ctrl-C (KeyboardInterrupt) from acting
    until it returned. Interrupted, the stop goes on in the background (a
    later start waits for it) and the handler's exception propagates.
    Where no thread can be started (an interpreter finalizing), it calls
    the library directly."""
    result: list[int] = []

    def run() -> None:
        result.append(lib.kvxfer_stop())

    t = threading.Thread(target=run, name="kvxfer-stop", daemon=True)
    try:
        t.start()
    except RuntimeError:
        return lib.kvxfer_stop()
    while t.is_alive():
        t.join(0.1)
    return result[0] if result else EFAIL


def _at_exit() -> None:
    if _lib is None or os.getpid() != _loader_pid:
        return  # a forked child exiting: the server is its parent's
    try:
        stop()
    except InProcessError:
        pass
    except KeyboardInterrupt:
        # Ctrl-C while the exiting process drained: exit now, as the user
        # asked, without waiting for transfers in flight (their peers end
        # them within the liveness bound, as for a killed process).
        os.write(2, b"kvxfer: stop interrupted at exit; exiting without waiting for transfers in flight\n")


def endpoint() -> str | None:
    """The running server's endpoint, or None."""
    if _lib is not None and os.getpid() != _loader_pid:
        raise _forked_error()
    return _endpoint


# The endpoint of a server started with the default socket: an abstract
# name with the pid of the process it serves (internal/daemon parseJSON).
_OWN_ENDPOINT = re.compile(r"unix-abstract:kvxfer-(\d+)-[0-9a-f]+")


def refused_here(address: str) -> str | None:
    """Why this process may be refused by the in-process server at
    address, or None: such a server serves its own process only (unless
    started with own_process_only false), and refuses another's connection
    as the socket opens, so that gRPC says no more than "connection reset".
    Known for a server whose endpoint names its process (the default
    socket)."""
    m = _OWN_ENDPOINT.fullmatch(address or "")
    if m is None or int(m.group(1)) == os.getpid():
        return None
    pid = int(m.group(1))
    if _lib is not None and pid == _loader_pid:
        return (f"kvxfer: {address} is the in-process server of process {pid}, and this is a child forked from it "
                f"(pid {os.getpid()}): the server serves its own process only (the Go runtime does not survive fork); "
                "start kvxfer in a spawned process (multiprocessing 'spawn'), not a forked one")
    return (f"kvxfer: {address} is the in-process server of process {pid} (libkvxfer), which serves its own process only; "
            f"this is process {os.getpid()}: start an in-process server here (kvxfer.inprocess.start), or use kvxferd")


def has_direct_streams() -> bool:
    """Whether the loaded library serves direct streams (C ABI 2)."""
    return _lib is not None and hasattr(_lib, "kvxfer_stream_open")


def direct_endpoint() -> str | None:
    """The running server's endpoint where this process may reach it
    without gRPC (direct streams and calls), else None: no server, a
    library without them, or a forked child (which never raises here: its
    clients take gRPC, as before direct streams)."""
    if not has_direct_streams() or os.getpid() != _loader_pid:
        return None
    return _endpoint


# Direct streams (kvxfer.h, kvxfer_stream_*): the calls behind
# kvxfer.client.DirectWorkerStream. ctypes releases the GIL while they run.

def _direct_lib() -> ctypes.CDLL:
    lib = _load() if _lib is not None else None
    if lib is None or not hasattr(lib, "kvxfer_stream_open"):
        raise InProcessError(EFAIL, "kvxfer: no in-process library with direct streams is loaded")
    return lib


def stream_open() -> int:
    """Opens a direct stream on the running server; its id."""
    lib = _direct_lib()
    sid = lib.kvxfer_stream_open()
    if sid == 0:
        raise _error(lib, EFAIL)
    return sid


def stream_put(sid: int, msg: bytes) -> int | None:
    """Hands the stream one marshalled ConnectRequest: None, or EENDED
    when the stream ended."""
    lib = _direct_lib()
    code = lib.kvxfer_stream_put(sid, msg, len(msg))
    if code == OK:
        return None
    if code == EENDED:
        return code
    raise _error(lib, code)


def stream_take(sid: int, wait: float):
    """The stream's next ConnectResponse, waiting up to wait seconds
    (negative: without limit): ("msg", bytes), ("ended", (code,
    message)) once it ended, or None when nothing came."""
    lib = _direct_lib()
    out, n, code = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_int()
    wait_us = -1 if wait < 0 else int(wait * 1e6)
    rc = lib.kvxfer_stream_take(sid, wait_us, ctypes.byref(out), ctypes.byref(n), ctypes.byref(code))
    if rc == EAGAIN:
        return None
    return _answer(lib, rc, out, n, code, ("msg", EENDED, "ended"))


def call(method: str, req: bytes, timeout: float | None):
    """One SchedulerService call (method: its name) without gRPC: ("ok",
    response bytes) or ("status", (code, message))."""
    lib = _direct_lib()
    out, n, code = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_int()
    wait_us = 0 if not timeout or timeout <= 0 else int(timeout * 1e6)
    rc = lib.kvxfer_call(method.encode(), req, len(req), wait_us, ctypes.byref(out), ctypes.byref(n), ctypes.byref(code))
    return _answer(lib, rc, out, n, code, ("ok", ESTATUS, "status"))


def _answer(lib: ctypes.CDLL, rc: int, out, n, code, kinds: tuple[str, int, str]):
    """What a take or a call returned: (kinds[0], the message's bytes,
    copied and freed) for OK; (kinds[2], (gRPC code, message)) for the
    status kinds[1]; else the call's error raised."""
    ok, end_rc, end = kinds
    if rc == OK:
        try:
            return ok, ctypes.string_at(out, n.value)
        finally:
            lib.kvxfer_free(out)
    if rc == end_rc:
        return end, (code.value, (lib.kvxfer_last_error() or b"").decode("utf-8", "replace"))
    raise _error(lib, rc)


def stream_close_send(sid: int) -> None:
    """Ends what the engine sends on the stream (after its bye)."""
    _direct_lib().kvxfer_stream_close_send(sid)


def stream_release(sid: int) -> None:
    """Forgets the stream, ending it first if it runs (a hang-up)."""
    if _lib is None or os.getpid() != _loader_pid:
        return
    _direct_lib().kvxfer_stream_release(sid)


def version() -> str:
    """libkvxfer's version."""
    with _lock:
        return _load().kvxfer_version().decode()


def host_memory(base: int, size: int) -> pb.SharedMemory:
    """A hello.memory entry naming host memory of this process by its
    address (e.g. ``tensor.data_ptr()``, ``array.ctypes.data``): only this
    process's in-process server accepts it. Keep the memory alive until
    the rank's stream has ended."""
    return pb.SharedMemory(base=base, size=size, in_process=pb.IN_PROCESS_MEMORY_HOST)


def device_memory(base: int, size: int, device: int) -> pb.SharedMemory:
    """A hello.memory entry naming GPU memory this process allocated on
    CUDA device ordinal ``device`` by its address."""
    return pb.SharedMemory(base=base, size=size, device=device, in_process=pb.IN_PROCESS_MEMORY_DEVICE)
