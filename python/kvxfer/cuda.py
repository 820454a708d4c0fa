"""Share torch CUDA tensors with kvxferd as CUDA IPC memory handles.

An engine whose KV cache lives in GPU memory hands kvxferd, for each
allocation holding part of the cache, a ``SharedMemory`` message: the
allocation's legacy CUDA IPC handle (64 bytes), its base address and size as
the engine sees them, and the GPU's UUID. kvxferd opens the handle on the GPU
with that UUID, which is right whatever ``CUDA_VISIBLE_DEVICES`` each process
has (ordinals are not). Regions of the layout are then given in the engine's
own addresses (``tensor.data_ptr()``), inside ``[base, base + size)``.

Usage, with vLLM's layer name -> tensor dict::

    from kvxfer.cuda import export_tensors
    for share in export_tensors(kv_caches):   # one per allocation
        memory.append(pb.SharedMemory(cuda_ipc_handle=share.handle, base=share.base,
                                      size=share.size, device_uuid=share.device_uuid))

The caller keeps the tensors alive (and does not free their memory) for as
long as kvxferd may use it, that is until the rank's stream has ended.

Only memory from ``cudaMalloc`` (PyTorch's default caching allocator, vLLM's
KV cache without sleep mode) can be shared this way. Memory mapped through
CUDA's virtual-memory API (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
vLLM's sleep mode / CuMemAllocator) has no legacy IPC handle; exporting it
raises NotShareableError.

The driver is reached through cuda-python (a vLLM dependency):
``cuda.bindings.driver`` in cuda-python 12.6 and later (13.x included),
``cuda.cuda`` in older releases. Neither it nor torch is imported until a
function needs them, so this module imports anywhere. Every function takes an
optional ``driver`` (an object with cuda-python's driver functions and enums)
so that tests can pass a fake one.

Calls may come from any thread: each makes the tensor's device's primary
context current only for its driver calls, restores the thread's previous
context, and holds nothing afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = [
    "CudaError",
    "GpuShare",
    "NotShareableError",
    "export_tensor",
    "export_tensors",
    "format_uuid",
    "load_driver",
]

HANDLE_BYTES = 64
"""Size of a CUDA IPC memory handle (CUipcMemHandle)."""

UUID_BYTES = 16


class CudaError(RuntimeError):
    """A driver call returned an error CUresult.

    Attributes: ``op`` (the driver function, e.g. "cuIpcGetMemHandle"),
    ``code`` (the CUresult as an int) and ``name`` (e.g.
    "CUDA_ERROR_INVALID_VALUE").
    """

    def __init__(self, op: str, code: int, name: str):
        super().__init__(f"{op} failed: {name} (CUresult {code})")
        self.op = op
        self.code = code
        self.name = name


class NotShareableError(ValueError):
    """The tensor's memory cannot be shared through a legacy CUDA IPC handle."""


@dataclasses.dataclass(frozen=True)
class GpuShare:
    """One GPU allocation shared with kvxferd (the fields of SharedMemory).

    ``handle``: the allocation's CUDA IPC handle (64 bytes).
    ``base``, ``size``: the allocation's address range in this process
    (cuMemGetAddressRange).
    ``offset``: ``tensor.data_ptr() - base`` of the exported tensor (for
    export_tensors: of the first tensor found in the allocation).
    ``device_uuid``: the GPU's UUID, "GPU-" and 8-4-4-4-12 lower-case hex
    digits as nvidia-smi prints it.
    """

    handle: bytes
    base: int
    size: int
    offset: int
    device_uuid: str


def load_driver() -> Any:
    """Import cuda-python's driver module: ``cuda.bindings.driver`` or, for
    cuda-python before 12.6, ``cuda.cuda``. ImportError if neither exists."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError as e:
            raise ImportError(
                "kvxfer.cuda needs cuda-python (pip install cuda-python); "
                "neither cuda.bindings.driver nor cuda.cuda imports"
            ) from e
    return driver


def format_uuid(raw: bytes) -> str:
    """Format a 16-byte device UUID as nvidia-smi does (lower-case hex).

    MIG instances report their own UUID; it is written with the "GPU-" prefix
    too, as kvxferd (cuda.FormatUUID) writes it, so both sides agree.
    """
    if len(raw) != UUID_BYTES:
        raise ValueError(f"device UUID has {len(raw)} bytes, want {UUID_BYTES}: {raw!r}")
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def export_tensor(tensor: Any, *, driver: Any = None) -> GpuShare:
    """Export the allocation holding a CUDA tensor as a GpuShare.

    Raises ValueError if ``tensor`` is not a CUDA tensor or holds no memory,
    NotShareableError if its memory has no legacy IPC handle (see the module
    doc), CudaError if a driver call fails.
    """
    return _Exporter(driver).export(tensor, "tensor")


def export_tensors(tensors: Iterable[Any] | Mapping[str, Any], *, driver: Any = None) -> list[GpuShare]:
    """Export the allocations holding several CUDA tensors, each once.

    vLLM's KV cache tensors (``register_kv_caches``' dict of layer name ->
    tensor) are views into a few allocations; tensors with the same
    allocation base give one GpuShare, in the order the allocations are first
    met, with the offset of the first tensor met in each. A Mapping's keys
    name the tensors in errors; otherwise "tensors[i]" does.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else ((f"tensors[{i}]", t) for i, t in enumerate(tensors))
    ex = _Exporter(driver)
    shares: dict[int, GpuShare] = {}
    for name, t in items:
        index, ptr, base, size = ex.locate(t, str(name))
        if base not in shares:
            shares[base] = ex.share(index, ptr, base, size)
    return list(shares.values())


class _Exporter:
    """One export call's driver and per-device state."""

    def __init__(self, driver: Any):
        self._d = driver  # loaded on first use: bad tensors are refused without it
        self.devices: dict[int, Any] = {}  # torch/CUDA ordinal -> CUdevice
        self.uuids: dict[int, str] = {}

    @property
    def d(self) -> Any:
        if self._d is None:
            self._d = load_driver()
        return self._d

    def call(self, op: str, *args: Any) -> tuple:
        """Call driver function op, check its CUresult, return the rest."""
        out = getattr(self.d, op)(*args)
        res, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
        code = int(res)
        if code != 0:
            raise CudaError(op, code, getattr(res, "name", None) or f"CUresult {code}")
        return rest

    def export(self, tensor: Any, name: str) -> GpuShare:
        index, ptr, base, size = self.locate(tensor, name)
        return self.share(index, ptr, base, size)

    def device(self, index: int) -> Any:
        if index not in self.devices:
            if not self.devices:
                self.call("cuInit", 0)
            (self.devices[index],) = self.call("cuDeviceGet", index)
        return self.devices[index]

    @contextlib.contextmanager
    def current(self, index: int) -> Iterator[None]:
        """Make device index's primary context (the one PyTorch uses) current
        on this thread for the block, whatever was current before: the
        pointer queries need a context, and the calling thread may have none
        or another device's."""
        dev = self.device(index)
        (ctx,) = self.call("cuDevicePrimaryCtxRetain", dev)
        try:
            self.call("cuCtxPushCurrent", ctx)
            try:
                yield
            finally:
                self.call("cuCtxPopCurrent")
        finally:
            self.call("cuDevicePrimaryCtxRelease", dev)

    def locate(self, tensor: Any, name: str) -> tuple[int, int, int, int]:
        """Check that tensor's memory can be shared; return its device index,
        its data pointer, and its allocation's base and size."""
        if not getattr(tensor, "is_cuda", False):
            raise ValueError(f"{name} is not a CUDA tensor (device {getattr(tensor, 'device', '?')})")
        index = tensor.device.index
        if index is None:
            raise ValueError(f"{name} is a CUDA tensor without a device index")
        ptr = int(tensor.data_ptr())
        if ptr == 0:
            raise ValueError(f"{name} holds no GPU memory (data_ptr 0: an empty tensor)")
        with self.current(index):
            (capable,) = self.call(
                "cuPointerGetAttribute",
                self.d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                ptr,
            )
            if not capable:
                raise NotShareableError(
                    f"{name} (address {ptr:#x}) is memory from CUDA's virtual-memory API, which legacy CUDA "
                    "IPC handles cannot share: PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:True) and vLLM's sleep mode allocate it. Turn expandable segments "
                    "off (PYTORCH_CUDA_ALLOC_CONF, and no sleep mode), or let the connector allocate the KV "
                    "cache (vLLM's get_mem_pool_context)."
                )
            base, size = self.call("cuMemGetAddressRange", ptr)
        return index, ptr, int(base), int(size)

    def share(self, index: int, ptr: int, base: int, size: int) -> GpuShare:
        with self.current(index):
            (h,) = self.call("cuIpcGetMemHandle", base)
        return GpuShare(
            handle=_struct_bytes(h, "reserved", HANDLE_BYTES),
            base=base,
            size=size,
            offset=ptr - base,
            device_uuid=self.uuid(index),
        )

    def uuid(self, index: int) -> str:
        if index not in self.uuids:
            (u,) = self.call("cuDeviceGetUuid", self.device(index))
            self.uuids[index] = format_uuid(_struct_bytes(u, "bytes", UUID_BYTES))
        return self.uuids[index]


def _struct_bytes(obj: Any, field: str, n: int) -> bytes:
    """The n bytes of a cuda-python struct: its bytes field where the
    version exposes it (cuda-python 12: CUipcMemHandle.reserved; every
    version: CUuuid.bytes), else the struct's own memory (getPtr, which
    cuda-python 13 leaves as the only way to CUipcMemHandle's bytes)."""
    raw = getattr(obj, field, None)
    if raw is not None and len(raw) == n:
        return bytes(raw)
    return ctypes.string_at(int(obj.getPtr()), n)
