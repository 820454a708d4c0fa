"""Shared-memory files kvxferd accepts as an engine's host KV cache.

kvxferd maps an engine's host memory from files under its shm directory
(``kvxferd -shm-dir``, default ``/dev/shm``): a regular file directly or
indirectly under that directory, at least as long as the size the engine
declares, mapped read-write and shared, so the daemon moves bytes straight in
and out of the engine's cache. :func:`create` makes such a file (mode 0600,
created exclusively, sized with ftruncate) and maps it in this process;
:class:`ShmBuffer` exposes it as a buffer (``torch.frombuffer`` takes it) and
its address, which is what a hello's ``SharedMemory.base`` and region bases
refer to.

A file :func:`create` made and no :meth:`ShmBuffer.close` removed goes when
the process that made it exits (not a child forked from it): a tmpfs file
holds its memory until it is removed, so an engine that exits without
closing its buffers would leave its whole KV cache in /dev/shm. (A process
killed outright still leaves them.)
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import secrets
import threading

DEFAULT_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE

# The files create made and close has not removed, with the pid of the
# process that made each: that process removes them at its exit.
_live: dict[str, int] = {}
_live_lock = threading.Lock()


def _remove_at_exit() -> None:
    pid = os.getpid()
    with _live_lock:
        mine = [path for path, owner in _live.items() if owner == pid]
        for path in mine:
            del _live[path]
    for path in mine:
        try:
            os.unlink(path)
        except OSError:
            pass


atexit.register(_remove_at_exit)


def _after_fork_in_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # a thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ShmBuffer:
    """One shared-memory file mapped in this process. Not thread-safe to close."""

    def __init__(self, path: str, size: int, mm: mmap.mmap):
        self.path = path
        self.size = size
        self._mm = mm
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping (a writable buffer of ``size`` bytes)."""
        if self._mm is None:
            raise ValueError(f"shm {self.path}: closed")
        return self._mm

    def contains(self, addr: int, length: int) -> bool:
        return self.base <= addr and addr + length <= self.base + self.size

    def close(self, remove: bool = True, unmap: bool = True) -> None:
        """Removes the file's name (else it goes at the exit of the process
        that made it) and unmaps it. Tensors made over the
        buffer with torch.frombuffer do not keep it mapped: pass
        unmap=False while any may still be used (the memory then stays
        mapped until this object is collected or the process ends)."""
        if self._mm is not None and unmap:
            try:
                self._mm.close()
            except BufferError:
                # A tensor still views the memory; it stays mapped until
                # the process ends, but the name goes now.
                pass
            self._mm = None
        if remove:
            with _live_lock:
                _live.pop(self.path, None)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def create(size: int, directory: str = DEFAULT_DIR, name: str | None = None) -> ShmBuffer:
    """Creates a file of ``size`` bytes (rounded up to the page size) under
    ``directory``, mode 0600, and maps it. ``name`` defaults to a random one."""
    if size <= 0:
        raise ValueError(f"shm.create: size = {size}, want > 0")
    size = (size + PAGE - 1) // PAGE * PAGE
    if name is None:
        name = f"kvxfer-{os.getpid()}-{secrets.token_hex(6)}"
    if "/" in name or name in (".", ".."):
        raise ValueError(f"shm.create: name = {name!r}, want a plain file name")
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    with _live_lock:
        _live[path] = os.getpid()
    return ShmBuffer(path, size, mm)


def find_mapping(addr: int, length: int, directory: str = DEFAULT_DIR) -> tuple[str, int, int] | None:
    """Finds the file under ``directory`` mapped at [addr, addr+length) in this
    process (from /proc/self/maps): returns (path, mapping start, mapping size
    from the file's offset 0), or None. Only mappings at file offset 0 count,
    since the daemon maps a file from its start."""
    d = os.path.realpath(directory) + os.sep
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if not path.startswith(d) and not os.path.realpath(path).startswith(d):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if int(parts[2], 16) != 0:
            continue
        if lo <= addr and addr + length <= hi:
            return path, lo, hi - lo
    return None
