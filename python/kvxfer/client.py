"""A plain Python client for kvxferd's kvxfer.v1 services.

    c = Client("/run/kvxferd.sock")           # the daemon's unix socket
    s = c.scheduler("engine-0")              # SchedulerService for one engine
    s.open(pb.SchedulerConfig(...))
    w = c.connect(pb.WorkerHello(...))       # one WorkerService stream per rank
    w.step(pb.StepMeta(...)); f = w.poll()   # finished sets as they arrive
    w.bye(); c.close()

Any engine can use it; nothing here is vLLM-specific. Every failed call raises a
typed :mod:`kvxfer.errors` error carrying the daemon's status code. KV bytes
never cross these calls: the engine shares its KV memory with the daemon
(:mod:`kvxfer.shm` for host memory, :mod:`kvxfer.cuda` for GPU memory).
"""

from __future__ import annotations

import operator
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import grpc

from kvxfer import errors, inprocess
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as rpc

DEFAULT_SOCKET = "/run/kvxferd/kvxferd.sock"
# Finished sets and handshakes can be large (20k outcomes is a few MB).
_MAX_MESSAGE = 256 << 20


def _target(address: str) -> str:
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return "unix:" + address
    return address


class Client:
    """A connection to one kvxferd. Safe for concurrent use by threads.

    ``address`` is the daemon's unix socket path (engines talk to their
    daemon over it) or a gRPC target (``host:port`` reaches PeerService).
    ``timeout`` bounds every unary call, in seconds. ``direct=False``
    keeps rank streams to this process's in-process server on gRPC
    (:meth:`connect`). ``peer_secret`` (the
    bytes of the daemon's -peer-secret-file, :func:`kvxfer.peerauth.load_secret`)
    authenticates this client to a PeerService; it is needed there unless
    the daemon runs with -insecure-peers.
    """

    def __init__(self, address: str = DEFAULT_SOCKET, timeout: float = 10.0, peer_secret: bytes | None = None,
                 direct: bool | None = None):
        # Before, a wrong address or timeout failed later as an
        # AttributeError or TypeError from inside gRPC or the first call
        # (a pathlib.Path socket too).
        if isinstance(address, os.PathLike):
            address = os.fspath(address)
        self.address = _str_arg("Client", "address", address)
        self.timeout = _seconds_arg("Client", "timeout", timeout)
        self._closed = False
        self._direct = direct
        self._sched_ids: dict | None = None  # _direct_methods' table, made once
        opts = [("grpc.max_receive_message_length", _MAX_MESSAGE),
                ("grpc.max_send_message_length", _MAX_MESSAGE)]
        self._bridge = None
        target = _target(address)
        if peer_secret is not None:
            from kvxfer.peerauth import Bridge
            self._bridge = Bridge(address, peer_secret)
            target = self._bridge.address
        self._channel = grpc.insecure_channel(target, options=opts)
        self._sched = rpc.SchedulerServiceStub(self._channel)
        self._worker = rpc.WorkerServiceStub(self._channel)
        self._peer = rpc.PeerServiceStub(self._channel)

    def call(self, op: str, fn, req, timeout: float | None = None):
        self._check_open(op)
        timeout = self.timeout if timeout is None else _seconds_arg(op, "timeout", timeout)
        method = self._direct_methods().get(id(fn))
        if method is not None:
            try:
                kind, r = inprocess.call(method, req.SerializeToString(), timeout)
            except inprocess.ForkedChildError:
                raise
            except inprocess.InProcessError as e:
                # No server (stopped, by the engine or by itself, or
                # stopping): what a gRPC call says of a server it cannot
                # reach, a KvxferError as every call's error is (callers
                # fail their requests on it; an InProcessError went past
                # them, out of the engine's loop).
                raise errors.Unavailable(op, str(e)) from None
            if kind == "status":
                raise errors.from_code(op, *r)
            return _SCHED_OUT[method].FromString(r)
        try:
            return fn(req, timeout=timeout)
        except grpc.RpcError as e:
            raise self._error(op, e) from None
        except ValueError:
            # gRPC's word for a channel closed as the call began.
            if self._closed:
                self._check_open(op)
            raise

    def _check_open(self, op: str) -> None:
        """Raises Unavailable once the client was closed. Before, a closed
        client's gRPC calls raised gRPC's ValueError (no KvxferError, so
        past an engine's handling of failed calls), while its direct calls
        to this process's in-process server went on working."""
        if self._closed:
            raise errors.Unavailable(op, f"the client for {self.address} is closed (Client.close): make a new one")

    def _error(self, op: str, e: grpc.RpcError) -> errors.DaemonError:
        """The typed error of a failed call or stream; where the server is
        another process's in-process server and could not be reached, it
        says why (gRPC's own words are "connection reset by peer")."""
        err = errors.from_rpc_error(op, e)
        if self._closed and e.code() == grpc.StatusCode.CANCELLED:
            # A call in flight as the client closed: before, a bare
            # DaemonError (CANCELLED, "Channel closed!"), where calls after
            # the close are Unavailable.
            return errors.Unavailable(op, f"the client for {self.address} was closed during the call ({err.details})")
        foreign = self._foreign()
        # gRPC in a forked child may say CANCELLED ("closed on fork") of a
        # channel made before the fork; this client cancels no call that
        # reaches here (a stream's own cancel is no error).
        if foreign is not None and (isinstance(err, errors.Unavailable) or e.code() == grpc.StatusCode.CANCELLED):
            err = errors.Unavailable(op, f"{err.details} ({foreign})")
        return err

    def _foreign(self) -> str | None:
        """Why this process may be refused by the in-process server at
        this client's address, or None: another process's such server
        refuses it as the socket opens, where gRPC says no more than
        "connection reset". Asked when a call fails, not as the client is
        made: a client made in the server's own process and used in a
        child forked from it is refused there."""
        return inprocess.refused_here(self.address)

    def _direct_methods(self) -> dict:
        """SchedulerService's unary methods by their stub's id, where this
        client's calls go to its own process's in-process server without
        gRPC (libkvxfer's kvxfer_call: the same handler, the caller this
        process); empty elsewhere, or with direct=False."""
        if self._direct is False or self.address != inprocess.direct_endpoint():
            return {}
        if self._sched_ids is None:
            self._sched_ids = {id(getattr(self._sched, m)): m for m in _SCHED_OUT}
        return self._sched_ids

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel connects, or raises Unavailable."""
        self._check_open("connect")
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            foreign = self._foreign()
            why = f" ({foreign})" if foreign is not None else ""
            raise errors.Unavailable("connect", f"no daemon at {self.address} within {timeout}s{why}") from None

    def scheduler(self, engine_id: str) -> "Scheduler":
        return Scheduler(self, engine_id)

    def connect(self, hello: pb.WorkerHello, ready_timeout: float = 30.0) -> "WorkerStream":
        """Opens a rank's stream and waits for the daemon's Ready. The hello
        says how large a message this client accepts (unless it says so
        itself), so the daemon splits its outcome sets to fit.

        To this process's own in-process server (kvxfer.inprocess) the
        stream is direct, not gRPC (:class:`DirectWorkerStream`: the same
        messages through the library's calls, no thread between), unless
        the client was made with ``direct=False`` or the library predates
        direct streams."""
        _msg_arg("Connect", "hello", hello, pb.WorkerHello)
        ready_timeout = _seconds_arg("Connect", "ready_timeout", ready_timeout)
        self._check_open("Connect")
        if not hello.max_message_bytes:
            hello.max_message_bytes = _MAX_MESSAGE
        if self._direct is not False and self.address == inprocess.direct_endpoint():
            return DirectWorkerStream(hello, ready_timeout)
        return WorkerStream(self, hello, ready_timeout)

    def handshake(self, engine_id: str) -> pb.HandshakeResponse:
        """PeerService.Handshake (what peer daemons call)."""
        try:
            return self.call("Handshake", self._peer.Handshake, pb.HandshakeRequest(engine_id=engine_id))
        except errors.Unavailable as e:
            if self._bridge is not None and self._bridge.errors:
                raise errors.Unavailable("Handshake", f"peer authentication failed: {self._bridge.errors[-1]}") from e
            raise

    def close(self) -> None:
        self._closed = True
        self._channel.close()
        if self._bridge is not None:
            self._bridge.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class StepResult:
    """What SchedulerService.Step returned."""

    meta: pb.StepMeta | None
    pending: bool
    counters: pb.SchedulerCounters
    # Per op index: the error of a failed op.
    errors: dict[int, errors.DaemonError] = field(default_factory=dict)
    # Per op index: (delay, params) of a request_finished op.
    finished: dict[int, tuple[bool, pb.TransferParams | None]] = field(default_factory=dict)
    # The engine's generation as its peers' handshakes report it when the
    # daemon answered (a pull scheduler's; 0: not known there).
    generation: int = 0


class Scheduler:
    """SchedulerService calls for one engine (an engine that delegates its
    scheduler-side connector logic to kvxfer). Not thread-safe: one owner,
    the engine's scheduler loop."""

    def __init__(self, client: Client, engine_id: str):
        self._c = client
        self.engine_id = _str_arg("Scheduler", "engine_id", engine_id)
        self.takes_preempted = False
        self.takes_new_request = False

    def open(self, config: pb.SchedulerConfig) -> str:
        """Creates (or replaces) the engine's scheduler; returns the daemon's peer address."""
        _msg_arg("OpenScheduler", "config", config, pb.SchedulerConfig)
        config.engine_id = self.engine_id
        r = self._c.call("OpenScheduler", self._c._sched.OpenScheduler, pb.OpenSchedulerRequest(config=config))
        # Whether the daemon takes FINISH_STATUS_PREEMPTED (an older one
        # refuses it): as its last OpenScheduler answer said.
        self.takes_preempted = r.takes_preempted
        # Whether it takes SchedulerOp.new_request (an older one refuses it
        # as an empty op).
        self.takes_new_request = r.takes_new_request
        return r.addr

    def matched_tokens(self, request: pb.EngineRequest, computed: int) -> tuple[int, bool]:
        computed = _int_arg("MatchedTokens", "computed", computed)
        r = self._c.call("MatchedTokens", self._c._sched.MatchedTokens,
                         pb.MatchedTokensRequest(engine_id=self.engine_id, request=request, computed=computed))
        return r.tokens, getattr(r, "async")  # a Python keyword: not an attribute name

    def after_alloc(self, request: pb.EngineRequest, blocks: Iterable[Iterable[int]], computed: int, external: int) -> pb.TransferParams:
        blocks = block_lists(blocks, "AfterAlloc")
        computed, external = _int_arg("AfterAlloc", "computed", computed), _int_arg("AfterAlloc", "external", external)
        r = self._c.call("AfterAlloc", self._c._sched.AfterAlloc, pb.AfterAllocRequest(
            engine_id=self.engine_id, request=request, blocks=blocks, computed=computed, external=external))
        return r.params

    def request_finished(self, request: pb.EngineRequest, status: int, blocks: Iterable[Iterable[int]], computed: int):
        """Returns (delay, params for the other engine or None, the request's own params)."""
        blocks = block_lists(blocks, "RequestFinished")
        computed = _int_arg("RequestFinished", "computed", computed)
        status = _int_arg("RequestFinished", "status", status, _INT32_MAX)
        r = self._c.call("RequestFinished", self._c._sched.RequestFinished, pb.RequestFinishedRequest(
            engine_id=self.engine_id, request=request, status=status, blocks=blocks, computed=computed))
        return r.delay, (r.params if r.HasField("params") else None), r.request_params

    def build_meta(self) -> pb.StepMeta:
        return self._c.call("BuildMeta", self._c._sched.BuildMeta, pb.BuildMetaRequest(engine_id=self.engine_id)).meta

    def update(self, finished: pb.Finished) -> bool:
        """Returns whether the engine must keep stepping for kvxfer."""
        return self._c.call("Update", self._c._sched.Update, pb.UpdateRequest(engine_id=self.engine_id, finished=finished)).pending

    def step_request(self, req: pb.StepRequest) -> StepResult:
        """One round trip with a StepRequest built by the caller."""
        _msg_arg("Step", "req", req, pb.StepRequest)
        req.engine_id = self.engine_id
        return step_result(self._c.call("Step", self._c._sched.Step, req))

    def step(self, ops: list[pb.SchedulerOp], build_meta: bool = True) -> StepResult:
        """One round trip: applies ops in order, then builds the step's metadata."""
        r = self._c.call("Step", self._c._sched.Step, pb.StepRequest(engine_id=self.engine_id, ops=ops, build_meta=build_meta))
        return step_result(r)

    def stream(self) -> "StepStream":
        """Opens a Steps stream: steps sent without waiting for answers."""
        return StepStream(self._c, self.engine_id)

    def close(self) -> None:
        self._c.call("CloseScheduler", self._c._sched.CloseScheduler, pb.CloseSchedulerRequest(engine_id=self.engine_id))


def step_result(r: pb.StepResponse) -> StepResult:
    out = StepResult(meta=r.meta if r.HasField("meta") else None, pending=r.pending, counters=r.counters,
                     generation=r.generation)
    for res in r.results:
        if res.code != 0:
            out.errors[res.index] = errors.from_code("Step.ops[%d]" % res.index, res.code, res.error)
        else:
            out.finished[res.index] = (res.delay, res.params if res.HasField("params") else None)
    return out


class StepStream:
    """SchedulerService.Steps for one engine: :meth:`send` queues a step
    and returns at once (no round trip on the engine's critical path); the
    daemon applies steps in order and answers in order, and :meth:`results`
    takes the answers that arrived. When the stream ends, :attr:`error`
    says why and :meth:`results` raises it once the answers are taken.
    """

    def __init__(self, client: Client, engine_id: str):
        self.engine_id = engine_id
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._answers: list[pb.StepResponse] = []
        self._arrived = threading.Condition(self._lock)
        self._done = threading.Event()
        self._closing = False
        self.error: errors.KvxferError | None = None
        self._client = client
        client._check_open("Steps")
        self._call = client._sched.Steps(_requests(self._out))
        self._reader = threading.Thread(target=self._read, name=f"kvxfer-steps-{engine_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for m in self._call:
                with self._lock:
                    self._answers.append(m.step)
                    self._arrived.notify_all()
        except grpc.RpcError as e:
            if not self._closing:
                self.error = self._client._error("Steps", e)
        finally:
            with self._lock:
                if self.error is None and not self._closing:
                    self.error = errors.StreamClosed("kvxferd ended the Steps stream")
                self._done.set()
                self._arrived.notify_all()
            self._out.put(_BYE)  # ends gRPC's thread that feeds the stream (_requests)

    @property
    def closed(self) -> bool:
        return self._done.is_set()

    def send(self, req: pb.StepRequest | pb.StepsRequest) -> None:
        """Queues one step (its engine_id is set here). A StepsRequest is
        queued as it is: build the step inside one (``m.step``) to spare a
        copy; gRPC serializes it on its own thread."""
        if self._done.is_set():
            raise self.error or errors.StreamClosed("Steps stream is closed")
        _msg_arg("Steps", "req", req, (pb.StepRequest, pb.StepsRequest))
        if isinstance(req, pb.StepsRequest):
            req.step.engine_id = self.engine_id
            self._out.put(req)
            return
        req.engine_id = self.engine_id
        self._out.put(pb.StepsRequest(step=req))

    def results(self, wait: float = 0.0, count: int = 1) -> list[pb.StepResponse]:
        """Takes the answers that arrived, waiting up to ``wait`` seconds
        for at least ``count``. Raises the stream's error once it ended and
        every answer was taken."""
        with self._lock:
            if wait > 0:
                deadline = time.monotonic() + wait
                while len(self._answers) < count and not self._done.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._arrived.wait(left)
            out, self._answers = self._answers, []
            if not out and self._done.is_set() and self.error is not None:
                raise self.error
            return out

    def close(self) -> None:
        self._closing = True
        self._out.put(_BYE)
        self._done.wait(5)
        if not self._done.is_set():
            self._call.cancel()


_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1
_UINT64_MAX = (1 << 64) - 1


def _bad(op: str, name: str, v, want: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(op, f"{name} = {v!r}, want {want} (refused by the client: nothing was sent)")


def _int_arg(op: str, name: str, v, maximum: int = _INT64_MAX) -> int:
    """v as an integer in [0, maximum] (an int, or what operator.index
    takes: a numpy integer), or InvalidArgument naming name: never a
    boolean, a fraction or a string."""
    if type(v) is not int:
        try:
            if isinstance(v, bool):
                raise TypeError
            v = operator.index(v)
        except TypeError:
            raise _bad(op, name, v, "an integer") from None
    if not 0 <= v <= maximum:
        raise _bad(op, name, v, f"an integer in [0, {maximum}]")
    return v


def _seconds_arg(op: str, name: str, v) -> float:
    """v as a positive, finite number of seconds, or InvalidArgument naming
    name: gRPC ends a call with a deadline of 0 or less at once, where a
    direct call to the in-process server took it as no limit."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise _bad(op, name, v, "a positive number of seconds")
    return v


def _msg_arg(op: str, name: str, v, cls) -> None:
    """Raises InvalidArgument naming name unless v is a cls message (a
    tuple: one of them); before, a dict or None failed as an
    AttributeError from inside this module."""
    if not isinstance(v, cls):
        want = " or ".join(c.DESCRIPTOR.full_name for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise _bad(op, name, v, f"a {want}")


def _str_arg(op: str, name: str, v) -> str:
    """v as a string protobuf can carry (no lone surrogate), or
    InvalidArgument naming name."""
    if type(v) is not str:
        raise _bad(op, name, v, "a string")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(op, name, v, "valid Unicode (no lone surrogate)") from None
    return v


def _str_args(op: str, name: str, vs: Iterable[str]) -> list[str]:
    if isinstance(vs, (str, bytes)):
        raise _bad(op, name, vs, "a list of strings")
    try:
        vs = list(vs)
    except TypeError:
        raise _bad(op, name, vs, "a list of strings") from None
    for i, v in enumerate(vs):
        if type(v) is not str or not v.isascii():
            _str_arg(op, f"{name}[{i}]", v)
    return vs


def block_lists(blocks: Iterable[Iterable[int]], op: str = "blocks") -> list[pb.BlockList]:
    """The block lists (one per KV-cache group) as kvxfer.v1 carries them,
    or InvalidArgument naming the first list or id that is not a list of
    int32 block ids >= 0 (nothing is sent)."""
    if isinstance(blocks, (str, bytes)):
        raise _bad(op, "blocks", blocks, "a list of block id lists")
    try:
        groups = list(blocks)
    except TypeError:
        raise _bad(op, "blocks", blocks, "a list of block id lists") from None
    out = []
    for g, b in enumerate(groups):
        if isinstance(b, (str, bytes)):
            raise _bad(op, f"blocks[{g}]", b, "a list of block ids")
        try:
            lst = b if type(b) is list else list(b)
        except TypeError:
            raise _bad(op, f"blocks[{g}]", b, "a list of block ids") from None
        if not all(type(x) is int for x in lst) or (lst and (min(lst) < 0 or max(lst) > _INT32_MAX)):
            lst = [_int_arg(op, f"blocks[{g}][{i}]", x, _INT32_MAX) for i, x in enumerate(lst)]
        out.append(pb.BlockList(block_ids=lst))
    return out


@dataclass
class Finished:
    """Outcomes a rank reported since the last poll."""

    sending: list[pb.Outcome] = field(default_factory=list)
    recving: list[pb.Outcome] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)
    step_errors: list[pb.StepError] = field(default_factory=list)
    stats: list[pb.TransferStats] = field(default_factory=list)


_BYE = object()

# SchedulerService's unary methods and their response types (a call of
# one of them can go to an in-process server without gRPC: Client.call).
_SCHED_OUT = {m.name: getattr(pb, m.output_type.name)
              for m in pb.DESCRIPTOR.services_by_name["SchedulerService"].methods
              if not m.client_streaming and not m.server_streaming}


def _gather(pending: Finished, m: pb.ConnectResponse) -> str:
    """Adds what a ConnectResponse reports to pending; returns its kind."""
    kind = m.WhichOneof("msg")
    if kind == "finished":
        f = m.finished
        pending.sending.extend(f.sending)
        pending.recving.extend(f.recving)
        pending.invalid_block_ids.extend(f.invalid_block_ids)
        if f.HasField("stats"):
            pending.stats.append(f.stats)
    elif kind == "step_error":
        pending.step_errors.append(m.step_error)
    return kind


def _requests(q: queue.SimpleQueue) -> Iterator:
    """A stream's requests: what q receives, until _BYE."""
    while (m := q.get()) is not _BYE:
        yield m


class _RankStream:
    """What a rank's stream does whatever carries it (gRPC: WorkerStream;
    libkvxfer's calls: DirectWorkerStream): the messages the engine sends,
    checked against the stream's state, and what poll hands back. A
    subclass sets _lock, _pending, _done, error and _closed_send, and
    writes a message with _write."""

    _closed_send: bool
    _pid: int  # the process that opened the stream

    def _write(self, m) -> None:
        raise NotImplementedError

    def _check_process(self) -> None:
        """Raises in a child forked from the process that opened the
        stream, whose messages would go nowhere (no thread of the child
        carries them) and whose locks a thread of the parent may have held
        at the fork: ForkedChildError where the parent loaded libkvxfer,
        else StreamClosed saying why."""
        if os.getpid() == self._pid:
            return
        inprocess.check_not_forked()
        raise errors.StreamClosed(f"kvxfer: this stream was opened by process {self._pid}, and this is a child forked from it "
                                  f"(pid {os.getpid()}): it carries nothing here; open a stream in this process")

    def _send(self, m) -> None:
        self._check_process()
        if self._done.is_set():
            raise errors.StreamClosed("stream is closed", self.error)
        if self._closed_send:
            raise errors.StreamClosed("bye already sent")
        self._write(m)

    def step(self, meta: pb.StepMeta) -> None:
        """Hands the rank one step's metadata."""
        self._send(pb.ConnectRequest(step=meta))

    def step_ref(self, step: int, recv: Iterable[str] = (), send: Iterable[str] = ()) -> None:
        """Hands the rank the metadata its scheduler published for step
        (StepStream with publish_step) on this daemon. recv and send are the
        requests the engine begins waiting on with this step on this rank:
        should the step be dropped, its StepError (dropped) names them back,
        for the engine to fail (but a layer-wise producer the rank holds
        prefilling from an earlier step: its outcome comes from the
        worker, failed, once its WRITEs in flight end)."""
        step = _int_arg("Connect.step_ref", "step", step, _UINT64_MAX)
        recv, send = _str_args("Connect.step_ref", "recv", recv), _str_args("Connect.step_ref", "send", send)
        self._send(pb.ConnectRequest(step_ref=pb.StepRef(step=step, recv_request_ids=recv, send_request_ids=send)))

    def layer_saved(self, step: int, layer: int) -> None:
        """Layer-wise push: layer (global index) of step is in memory."""
        step = _int_arg("Connect.layer_saved", "step", step, _UINT64_MAX)
        layer = _int_arg("Connect.layer_saved", "layer", layer, _INT32_MAX)
        self._send(pb.ConnectRequest(layer_saved=pb.LayerSaved(step=step, layer=layer)))

    def _take_pending(self) -> Finished:
        """What arrived since the last poll (self._lock held); raises
        StreamClosed when the stream ended and nothing is left."""
        f, self._pending = self._pending, Finished()
        if self._done.is_set() and self._empty_f(f) and self.error is not None:
            raise errors.StreamClosed(str(self.error), self.error)
        return f

    def _empty(self) -> bool:
        return self._empty_f(self._pending)

    @staticmethod
    def _empty_f(f: Finished) -> bool:
        return not (f.sending or f.recving or f.invalid_block_ids or f.step_errors or f.stats)

    @property
    def closed(self) -> bool:
        return self._done.is_set()


class WorkerStream(_RankStream):
    """One rank's WorkerService.Connect stream.

    The calling thread sends (step, layer_saved, bye never block on the
    network: messages are queued to gRPC's sender); one daemon thread reads
    the daemon's messages and accumulates them for :meth:`poll`. When the
    stream ends, :attr:`error` holds why (None after a clean bye) and
    :meth:`poll` raises :class:`kvxfer.errors.StreamClosed` once every
    outcome received before the end was taken.
    """

    def __init__(self, client: Client, hello: pb.WorkerHello, ready_timeout: float):
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = Finished()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._arrived = threading.Condition(self._lock)
        self.error: errors.KvxferError | None = None
        self.agent_name = ""
        self._closed_send = False
        self._pid = os.getpid()
        self._client = client
        self._out.put(pb.ConnectRequest(hello=hello))
        self._call = client._worker.Connect(_requests(self._out))
        self._reader = threading.Thread(target=self._read, name=f"kvxfer-stream-{hello.engine_id}", daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout) or self.error is not None:
            # No answer in time is a deadline, not a daemon known to be
            # unreachable: one that is frozen or slow may still serve (and
            # move bytes) once it runs again.
            err = self.error or errors.DeadlineExceeded("Connect", f"no Ready within {ready_timeout}s")
            self._call.cancel()
            raise err

    def _read(self) -> None:
        try:
            for m in self._call:
                with self._lock:
                    if _gather(self._pending, m) == "ready":
                        self.agent_name = m.ready.agent_name
                        self._ready.set()
                    self._arrived.notify_all()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or not self._closed_send:
                self.error = self._client._error("Connect", e)
        finally:
            with self._lock:
                if self.error is None and not self._closed_send:
                    self.error = errors.StreamClosed("kvxferd ended the stream")
                self._done.set()
                self._ready.set()
                self._arrived.notify_all()
            # gRPC's thread that feeds the stream its requests waits on
            # _out (_requests) until it takes _BYE, whatever ended the
            # stream: without it, that thread outlived every stream that
            # ended other than by bye or cancel (the daemon gone, a refused
            # hello, the client closed).
            self._out.put(_BYE)

    def _write(self, m) -> None:
        self._out.put(m)

    def poll(self, wait: float = 0.0) -> Finished:
        """Takes what arrived since the last poll, waiting up to ``wait``
        seconds for something when nothing has. Raises StreamClosed when the
        stream ended and nothing is left to take."""
        self._check_process()
        with self._lock:
            if wait > 0 and self._empty() and not self._done.is_set():
                self._arrived.wait(wait)
            return self._take_pending()

    def bye(self, timeout: float = 60.0) -> Finished:
        """Asks the daemon to end the stream once the rank's transfers are
        done, waits for the end (up to ``timeout``) and returns every outcome
        not yet polled."""
        self._check_process()
        if not self._done.is_set() and not self._closed_send:
            self._out.put(pb.ConnectRequest(bye=pb.Bye()))
            self._closed_send = True
            self._out.put(_BYE)
        if not self._done.wait(timeout):
            self._call.cancel()
            self._done.wait(5)
        with self._lock:
            f, self._pending = self._pending, Finished()
        return f

    def cancel(self) -> None:
        """Ends the stream at once (the daemon fails what the rank held)."""
        self._check_process()
        self._closed_send = True
        self._out.put(_BYE)
        self._call.cancel()
        self._done.wait(5)


class DirectWorkerStream(_RankStream):
    """One rank's WorkerService.Connect stream to this process's in-process
    server, without gRPC: the same kvxfer.v1 messages handed to libkvxfer
    and taken from it by its calls (kvxfer.h, kvxfer_stream_*), which
    release the GIL while they wait. No thread of its own: :meth:`poll`
    takes what arrived. Through gRPC, each message crossed three Python
    threads (0.2 to 0.5 ms each way on a GPU machine). Its methods and
    errors are :class:`WorkerStream`'s.
    """

    def __init__(self, hello: pb.WorkerHello, ready_timeout: float):
        self._ip = inprocess
        self._lock = threading.Lock()  # _pending, error, _done
        self._take_lock = threading.Lock()  # one taker at a time
        self._pending = Finished()
        self._done = threading.Event()
        self.error: errors.KvxferError | None = None
        self.agent_name = ""
        self._closed_send = False
        self._pid = os.getpid()
        self._id = 0
        try:
            self._id = inprocess.stream_open()
        except inprocess.ForkedChildError:
            raise
        except inprocess.InProcessError as e:
            # No server (stopped since the client chose this stream), or
            # too many streams open: what a gRPC stream says of a server
            # it cannot reach, a KvxferError as every stream error is.
            raise errors.Unavailable("Connect", str(e)) from None
        try:
            self._write(pb.ConnectRequest(hello=hello))
            deadline = time.monotonic() + ready_timeout
            while not self.agent_name:
                left = deadline - time.monotonic()
                if self._done.is_set():
                    raise self.error or errors.StreamClosed("kvxfer ended the stream before its Ready")
                if left <= 0:
                    # As on a gRPC stream: a deadline, not a server known
                    # to be gone (a slow one may still serve).
                    raise errors.DeadlineExceeded("Connect", f"no Ready within {ready_timeout}s")
                self._take(left)
        except BaseException:
            self._ip.stream_release(self._id)
            self._done.set()
            raise

    def __del__(self):
        ip = getattr(self, "_ip", None)
        if ip is not None and getattr(self, "_id", 0):
            try:
                ip.stream_release(self._id)
            except Exception:  # noqa: BLE001 - at interpreter exit, or in a forked child
                pass

    # The longest the main thread waits inside the library at a time:
    # Python runs its signal handlers (Ctrl-C's KeyboardInterrupt, an
    # engine's SIGTERM handler) between its own instructions only, never
    # while a call into the library waits, so a whole wait there would put
    # them off until it ended (the gRPC stream waits on a Condition, which
    # a signal interrupts).
    SIGNAL_SLICE = 0.1

    def _take(self, wait: float) -> None:
        """Takes the stream's messages: waits up to wait seconds (none if
        negative) for the first, then takes what else arrived, up to the
        stream's end."""
        self._ip.check_not_forked()  # before the lock a thread of the parent may have held at the fork
        got = False
        deadline = time.monotonic() + max(wait, 0.0)
        main = threading.current_thread() is threading.main_thread()
        with self._take_lock:
            while True:
                w = 0.0
                if not got:
                    w = max(deadline - time.monotonic(), 0.0)
                    if main:
                        w = min(w, self.SIGNAL_SLICE)
                r = self._ip.stream_take(self._id, w)
                if r is None:  # nothing (more) within the wait, or this slice of it
                    if got or time.monotonic() >= deadline:
                        return
                    continue
                kind, payload = r
                if kind == "ended":
                    code, msg = payload
                    with self._lock:
                        # After bye or cancel, a clean or cancelled end is
                        # no error (as on the gRPC stream).
                        if self.error is None and not (code in (0, 1) and self._closed_send):
                            self.error = (errors.from_code("Connect", code, msg) if code != 0
                                          else errors.StreamClosed("kvxfer ended the stream"))
                        self._done.set()
                    return
                m = pb.ConnectResponse.FromString(payload)
                with self._lock:
                    if _gather(self._pending, m) == "ready":
                        self.agent_name = m.ready.agent_name
                got = True

    def _write(self, m) -> None:
        if self._ip.stream_put(self._id, m.SerializeToString()) is not None:
            self._take(0.0)  # the stream ended: why, from its end
            raise errors.StreamClosed("stream is closed", self.error)

    def poll(self, wait: float = 0.0) -> Finished:
        """Takes what arrived since the last poll, waiting up to ``wait``
        seconds for something when nothing has. Raises StreamClosed when
        the stream ended and nothing is left to take."""
        self._ip.check_not_forked()  # in a forked child, the locks below may be held by no thread of it
        if not self._done.is_set():
            with self._lock:
                empty = self._empty()
            self._take(wait if empty else 0.0)  # a negative wait is none, as on the gRPC stream
        with self._lock:
            return self._take_pending()

    def bye(self, timeout: float = 60.0) -> Finished:
        """Asks the server to end the stream once the rank's transfers are
        done, waits for the end (up to ``timeout``) and returns every
        outcome not yet polled."""
        self._ip.check_not_forked()
        if not self._done.is_set() and not self._closed_send:
            try:
                self._write(pb.ConnectRequest(bye=pb.Bye()))
            except errors.StreamClosed:
                pass
            self._closed_send = True
            self._ip.stream_close_send(self._id)
        deadline = time.monotonic() + timeout
        while not self._done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self._ip.stream_release(self._id)  # a hang-up, as gRPC's cancel
                with self._lock:
                    self._done.set()
                break
            self._take(min(left, 1.0))
        with self._lock:
            f, self._pending = self._pending, Finished()
        return f

    def cancel(self) -> None:
        """Ends the stream at once (the server fails what the rank held)."""
        self._ip.check_not_forked()
        self._closed_send = True
        self._ip.stream_release(self._id)
        with self._lock:
            self._done.set()

