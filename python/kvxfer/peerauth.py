"""kvxferd's peer authentication, client side, for Python tools that call a
daemon's PeerService (kvxferd authenticates every peer connection with the
shared secret of its -peer-secret-file).

The exchange (see the Go package internal/peerauth for the whole protocol):
the client sends "KVXA", version 1, the purpose ("grpc"), its name and a fresh
nonce; the server answers with its nonce and an HMAC-SHA256 proof over both;
the client checks it, sends its own proof and reads the server's verdict.

gRPC's Python API cannot run an exchange on a connection before HTTP/2
starts, so :class:`Bridge` listens on a unix socket of its own and, for each
connection a channel opens to it, connects to the daemon, authenticates, and
relays the bytes both ways. The socket lies in a directory only this user can
enter, and a connection of another uid is refused: whoever reaches the bridge
reaches the peer as this process (with its secret). Engines never need this:
they talk to their own daemon over its unix socket.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import socket
import struct
import tempfile
import threading
import time

MAGIC = b"KVXA"
VERSION = 1
NONCE = 32
MAC = 32


class AuthError(Exception):
    """The peer authentication failed; the message says why."""


def load_secret(path: str) -> bytes:
    """A secret file as kvxferd reads it: surrounding whitespace trimmed,
    at least 16 bytes, readable by its owner only."""
    st = os.stat(path, follow_symlinks=False)
    if st.st_mode & 0o077:
        raise AuthError(f"peer secret file {path}: mode {oct(st.st_mode & 0o777)} lets other users read it")
    with open(path, "rb") as f:
        secret = f.read(64 << 10).strip()
    if len(secret) < 16:
        raise AuthError(f"peer secret file {path}: {len(secret)} bytes, want at least 16")
    return secret


def _mac(secret: bytes, label: str, transcript: bytes) -> bytes:
    return hmac.new(secret, b"kvxfer peer auth v1 " + label.encode() + transcript, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        b = sock.recv(n - len(out))
        if not b:
            raise AuthError("the peer closed the connection during authentication")
        out += b
    return out


def client_handshake(sock: socket.socket, secret: bytes, purpose: str = "grpc", name: str = "python") -> None:
    """Runs the client's side of the exchange on a connected socket; raises
    AuthError unless both sides hold the same secret."""
    p, n = purpose.encode(), name.encode()
    if len(p) > 255 or len(n) > 255:
        raise ValueError("purpose and name are at most 255 bytes")
    msg = MAGIC + bytes([VERSION, len(p)]) + p + bytes([len(n)]) + n + os.urandom(NONCE)
    sock.sendall(msg)
    reply = _read(sock, 5 + NONCE + MAC)
    if reply[:4] != MAGIC or reply[4] != VERSION:
        raise AuthError("not a kvxfer peer (its answer is not the exchange's)")
    transcript = msg + reply[5:5 + NONCE]
    if not hmac.compare_digest(reply[5 + NONCE:], _mac(secret, "server", transcript)):
        raise AuthError("its proof does not match our secret (the same -peer-secret-file as the daemon's?)")
    sock.sendall(_mac(secret, "client", transcript))
    if _read(sock, 1) != b"\x01":
        raise AuthError("it refused our proof")


class Bridge:
    """A local address whose connections reach ``target`` (host:port)
    authenticated with ``secret``. Use ``bridge.address`` (``unix:`` and
    ``bridge.path``) as a gRPC target; ``close`` stops it. Only this user's
    processes can connect: the socket lies in a directory of mode 0700, and
    a connection of another uid (SO_PEERCRED) is closed at once. Before, it
    listened on a loopback port, and any local user who connected to it
    reached the peer authenticated with this process's secret. Safe for
    concurrent use."""

    # Failures kept in errors (the latest last): a channel to an
    # unreachable peer retries for as long as it lives.
    MAX_ERRORS = 16

    def __init__(self, target: str, secret: bytes, name: str = "python", timeout: float = 10.0):
        host, _, port = target.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self._secret, self._name, self._timeout = secret, name, timeout
        self._dir = tempfile.mkdtemp(prefix="kvxfer-bridge-")  # mode 0700: this user's only
        self.path = os.path.join(self._dir, "peer.sock")
        self._ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._ln.bind(self.path)
            self._ln.listen(128)
        except OSError:
            self._ln.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.address = "unix:" + self.path
        self._uid = os.getuid()
        self.errors: list[str] = []
        self._lock = threading.Lock()  # _closed, _socks, _threads, errors
        self._closed = False
        # The connections being relayed (both ends), and the threads that
        # relay them: close ends them and waits for the threads.
        self._socks: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="kvxfer-peerauth-bridge")
        self._acceptor.start()

    def _track(self, s: socket.socket) -> bool:
        """Adds s to the connections close ends; False (s closed) once closing."""
        with self._lock:
            if self._closed:
                s.close()
                return False
            self._socks.add(s)
            return True

    def _untrack(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                self._socks.discard(s)
                s.close()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=self._run, args=(target, *args), daemon=True, name="kvxfer-peerauth-relay")
        with self._lock:
            self._threads.add(t)
        t.start()

    def _run(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept(self) -> None:
        while True:
            try:
                local, _ = self._ln.accept()
            except OSError:
                return  # closed (close shuts the listener down: accept returns)
            if not self._own(local):
                local.close()
                continue
            if not self._track(local):
                return
            self._spawn(self._serve, local)

    def _own(self, s: socket.socket) -> bool:
        """Whether s's peer runs as this process's uid (SO_PEERCRED)."""
        try:
            _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        except OSError:
            return False
        if uid != self._uid:
            self._fail(f"a connection of uid {uid} refused (the bridge is uid {self._uid}'s)")
            return False
        return True

    def _fail(self, why: str) -> None:
        with self._lock:
            self.errors.append(f"{self._target[0]}:{self._target[1]}: {why}")
            del self.errors[:-self.MAX_ERRORS]

    def _serve(self, local: socket.socket) -> None:
        try:
            remote = socket.create_connection(self._target, timeout=self._timeout)
        except OSError as e:
            self._fail(str(e))
            self._untrack(local)
            return
        if not self._track(remote):
            self._untrack(local)
            return
        try:
            client_handshake(remote, self._secret, "grpc", self._name)
            remote.settimeout(None)
        except (OSError, AuthError) as e:
            self._fail(str(e))
            self._untrack(local, remote)
            return

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    b = src.recv(1 << 16)
                    if not b:
                        break
                    dst.sendall(b)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pipe, args=(remote, local), daemon=True, name="kvxfer-peerauth-relay")
        back.start()
        pipe(local, remote)
        back.join()
        self._untrack(local, remote)

    def close(self, timeout: float | None = None) -> None:
        """Stops accepting, ends the connections being relayed and waits
        (up to timeout, default the connect timeout plus a second) for the
        bridge's threads to exit. Idempotent."""
        with self._lock:
            self._closed = True
            socks, self._socks = list(self._socks), set()
        # close(2) alone does not wake a thread blocked in accept(2) (nor
        # free the listening socket it holds); shutdown does.
        for s in (self._ln, *socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._ln.close()
        deadline = time.monotonic() + (self._timeout + 1 if timeout is None else timeout)
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(max(0.0, deadline - time.monotonic()))
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            if not threads or time.monotonic() >= deadline:
                break
            threads[0].join(max(0.0, deadline - time.monotonic()))
        for s in socks:
            s.close()
        shutil.rmtree(self._dir, ignore_errors=True)
