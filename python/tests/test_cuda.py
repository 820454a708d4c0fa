"""kvxfer.cuda: exporting CUDA tensors as IPC handles, against a fake driver
(every call and argument checked), plus one run on a real GPU when there is
one."""

from __future__ import annotations

import ctypes
import enum
import importlib
import os
import re
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PYTHON_DIR))  # this checkout's kvxfer, installed or not
kcuda = importlib.import_module("kvxfer.cuda")


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUpointer_attribute(enum.IntEnum):
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


LEGACY = CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE


@dataclass(frozen=True)
class Dev:
    ordinal: int


@dataclass(frozen=True)
class Ctx:
    ordinal: int


class Handle13:
    """cuda-python 13's CUipcMemHandle: its bytes only through getPtr."""

    def __init__(self, raw: bytes):
        self._buf = ctypes.create_string_buffer(raw, 64)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)


class Handle12:
    """cuda-python 12's CUipcMemHandle: a reserved bytes field."""

    def __init__(self, raw: bytes):
        self.reserved = raw


class Uuid:
    def __init__(self, raw: bytes):
        self.bytes = raw


@dataclass(frozen=True)
class Alloc:
    base: int
    size: int
    device: int
    capable: bool = True


def handle_of(base: int) -> bytes:
    return bytes(((base >> (8 * (i % 6))) ^ (i * 37)) & 0xFF for i in range(64))


UUIDS = {0: bytes(range(0xA0, 0xB0)), 1: bytes.fromhex("5f0e4b6a1c2d3e4f8a9b0c1d2e3f4a5b")}
UUID_STRS = {0: "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf", 1: "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"}


class FakeDriver:
    """Enough of cuda-python's driver module: each function returns
    (CUresult, values...), records its call, and behaves like the driver
    where it matters (pointer queries need a current context on the
    pointer's device; primary contexts are reference counted)."""

    CUresult = CUresult
    CUpointer_attribute = CUpointer_attribute

    def __init__(self, allocs=(), fail=None, handle_type=Handle13):
        self.allocs = list(allocs)
        self.fail = dict(fail or {})
        self.handle_type = handle_type
        self.calls: list[tuple[str, tuple]] = []
        self.stack: list[Ctx] = []
        self.refs: dict[int, int] = {}

    def _enter(self, op, args, nout):
        self.calls.append((op, args))
        if op in self.fail:
            return (self.fail[op],) + (None,) * nout
        return None

    def _alloc(self, ptr):
        for a in self.allocs:
            if a.base <= ptr < a.base + a.size:
                return a
        return None

    def _ptr_op(self, op, args, ptr, nout):
        if (r := self._enter(op, args, nout)) is not None:
            return r
        a = self._alloc(ptr)
        if a is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,) + (None,) * nout
        if not self.stack or self.stack[-1].ordinal != a.device:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,) + (None,) * nout
        return a

    def cuInit(self, flags):
        return self._enter("cuInit", (flags,), 0) or (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal):
        if (r := self._enter("cuDeviceGet", (ordinal,), 1)) is not None:
            return r
        if ordinal not in UUIDS:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (CUresult.CUDA_SUCCESS, Dev(ordinal))

    def cuDeviceGetUuid(self, dev):
        return self._enter("cuDeviceGetUuid", (dev,), 1) or (CUresult.CUDA_SUCCESS, Uuid(UUIDS[dev.ordinal]))

    def cuDevicePrimaryCtxRetain(self, dev):
        if (r := self._enter("cuDevicePrimaryCtxRetain", (dev,), 1)) is not None:
            return r
        self.refs[dev.ordinal] = self.refs.get(dev.ordinal, 0) + 1
        return (CUresult.CUDA_SUCCESS, Ctx(dev.ordinal))

    def cuDevicePrimaryCtxRelease(self, dev):
        if (r := self._enter("cuDevicePrimaryCtxRelease", (dev,), 0)) is not None:
            return r
        self.refs[dev.ordinal] -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx):
        if (r := self._enter("cuCtxPushCurrent", (ctx,), 0)) is not None:
            return r
        self.stack.append(ctx)
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        if (r := self._enter("cuCtxPopCurrent", (), 1)) is not None:
            return r
        return (CUresult.CUDA_SUCCESS, self.stack.pop())

    def cuPointerGetAttribute(self, attribute, ptr):
        a = self._ptr_op("cuPointerGetAttribute", (attribute, ptr), ptr, 1)
        if isinstance(a, tuple):
            return a
        assert attribute == LEGACY, attribute
        return (CUresult.CUDA_SUCCESS, int(a.capable))

    def cuMemGetAddressRange(self, ptr):
        a = self._ptr_op("cuMemGetAddressRange", (ptr,), ptr, 2)
        return a if isinstance(a, tuple) else (CUresult.CUDA_SUCCESS, a.base, a.size)

    def cuIpcGetMemHandle(self, ptr):
        a = self._ptr_op("cuIpcGetMemHandle", (ptr,), ptr, 1)
        if isinstance(a, tuple):
            return a
        assert ptr == a.base, "handles are taken on the allocation's base"
        return (CUresult.CUDA_SUCCESS, self.handle_type(handle_of(a.base)))

    def ops(self):
        return [op for op, _ in self.calls]

    def balanced(self):
        return not self.stack and all(n == 0 for n in self.refs.values())


@dataclass
class FakeTensor:
    ptr: int
    index: int | None = 0
    is_cuda: bool = True

    def data_ptr(self) -> int:
        return self.ptr

    @property
    def device(self):
        return types.SimpleNamespace(type="cuda" if self.is_cuda else "cpu", index=self.index)

    def __str__(self):
        return f"FakeTensor({self.ptr:#x})"


A = Alloc(base=0x7F00_0000_0000, size=1 << 30, device=0)
B = Alloc(base=0x7F80_0000_0000, size=64 << 20, device=1)


def ctx_calls(ordinal, *inner):
    d, c = Dev(ordinal), Ctx(ordinal)
    return [("cuDevicePrimaryCtxRetain", (d,)), ("cuCtxPushCurrent", (c,)), *inner,
            ("cuCtxPopCurrent", ()), ("cuDevicePrimaryCtxRelease", (d,))]


def test_export_tensor_calls_and_share():
    drv = FakeDriver([A])
    ptr = A.base + 3 * 4096
    share = kcuda.export_tensor(FakeTensor(ptr), driver=drv)
    assert share == kcuda.GpuShare(handle=handle_of(A.base), base=A.base, size=A.size, offset=3 * 4096,
                                   device_uuid=UUID_STRS[0])
    assert drv.calls == [
        ("cuInit", (0,)),
        ("cuDeviceGet", (0,)),
        *ctx_calls(0, ("cuPointerGetAttribute", (LEGACY, ptr)), ("cuMemGetAddressRange", (ptr,))),
        *ctx_calls(0, ("cuIpcGetMemHandle", (A.base,))),
        ("cuDeviceGetUuid", (Dev(0),)),
    ]
    assert drv.balanced(), "every context pushed is popped and every retain released"
    assert len(share.handle) == 64 and isinstance(share.handle, bytes)
    with pytest.raises(AttributeError):
        share.base = 0  # frozen


@pytest.mark.parametrize("handle_type", [Handle13, Handle12], ids=["cuda-python 13 (getPtr)", "cuda-python 12 (reserved)"])
def test_handle_bytes_either_binding(handle_type):
    share = kcuda.export_tensor(FakeTensor(A.base), driver=FakeDriver([A], handle_type=handle_type))
    assert share.handle == handle_of(A.base)


@pytest.mark.parametrize("raw, want", [
    (bytes(16), "GPU-00000000-0000-0000-0000-000000000000"),
    (bytes(range(16)), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"),
    (b"\xff" * 16, "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"),
    # The vector of internal/cuda's TestFormatUUID: both sides write the same string.
    (bytes.fromhex("5f0e4b6a1c2d3e4f8a9b0c1d2e3f4a5b"), "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"),
])
def test_format_uuid(raw, want):
    assert kcuda.format_uuid(raw) == want
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", want)


@pytest.mark.parametrize("raw", [b"", bytes(15), bytes(17)])
def test_format_uuid_rejects_wrong_length(raw):
    with pytest.raises(ValueError, match=f"{len(raw)} bytes"):
        kcuda.format_uuid(raw)


@pytest.mark.parametrize("offset", [0, 256, 4096 * 1000 + 64, A.size - 1])
def test_offset_is_data_ptr_minus_base(offset):
    share = kcuda.export_tensor(FakeTensor(A.base + offset), driver=FakeDriver([A]))
    assert (share.base, share.size, share.offset) == (A.base, A.size, offset)


def test_export_tensors_one_share_per_allocation():
    drv = FakeDriver([A, B])
    # vLLM's layout: every layer a view into one allocation; here two
    # allocations on two GPUs, met interleaved.
    caches = {
        "layers.0.attn": FakeTensor(A.base + 0x1000, 0),
        "layers.1.attn": FakeTensor(B.base + 0x2000, 1),
        "layers.2.attn": FakeTensor(A.base + 0x3000, 0),
        "layers.3.attn": FakeTensor(A.base, 0),
        "layers.4.attn": FakeTensor(B.base + 0x100, 1),
    }
    shares = kcuda.export_tensors(caches, driver=drv)
    assert shares == [
        kcuda.GpuShare(handle_of(A.base), A.base, A.size, 0x1000, UUID_STRS[0]),
        kcuda.GpuShare(handle_of(B.base), B.base, B.size, 0x2000, UUID_STRS[1]),
    ]
    ops = drv.ops()
    assert ops.count("cuInit") == 1
    assert [a for op, a in drv.calls if op == "cuIpcGetMemHandle"] == [(A.base,), (B.base,)]
    assert [a for op, a in drv.calls if op == "cuDeviceGetUuid"] == [(Dev(0),), (Dev(1),)]
    assert [a for op, a in drv.calls if op == "cuDeviceGet"] == [(0,), (1,)]
    assert [a[1] for op, a in drv.calls if op == "cuPointerGetAttribute"] == [t.ptr for t in caches.values()]
    assert drv.balanced()
    # A list works the same way.
    assert kcuda.export_tensors(list(caches.values()), driver=FakeDriver([A, B])) == shares


def test_export_tensors_empty():
    drv = FakeDriver([A])
    assert kcuda.export_tensors([], driver=drv) == []
    assert drv.calls == []


def test_not_shareable():
    vmm = Alloc(base=0x7E00_0000_0000, size=2 << 20, device=0, capable=False)
    drv = FakeDriver([vmm])
    with pytest.raises(kcuda.NotShareableError) as e:
        kcuda.export_tensor(FakeTensor(vmm.base + 512), driver=drv)
    msg = str(e.value)
    for want in ("virtual-memory API", "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF", "sleep mode",
                 "get_mem_pool_context", hex(vmm.base + 512)):
        assert want in msg, f"{want!r} not in {msg!r}"
    assert "cuIpcGetMemHandle" not in drv.ops() and "cuMemGetAddressRange" not in drv.ops()
    assert drv.balanced(), "the context is popped and released on the error path"
    assert isinstance(e.value, ValueError)


def test_not_shareable_names_the_layer():
    vmm = Alloc(base=0x7E00_0000_0000, size=2 << 20, device=0, capable=False)
    with pytest.raises(kcuda.NotShareableError, match=r"model\.layers\.7\.attn"):
        kcuda.export_tensors({"model.layers.6.attn": FakeTensor(A.base), "model.layers.7.attn": FakeTensor(vmm.base)},
                             driver=FakeDriver([A, vmm]))


FAILING_OPS = ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent", "cuPointerGetAttribute",
               "cuMemGetAddressRange", "cuCtxPopCurrent", "cuIpcGetMemHandle", "cuDeviceGetUuid",
               "cuDevicePrimaryCtxRelease"]


@pytest.mark.parametrize("op", FAILING_OPS)
def test_failing_cuda_call_raises_cuda_error(op):
    drv = FakeDriver([A], fail={op: CUresult.CUDA_ERROR_NOT_SUPPORTED})
    with pytest.raises(kcuda.CudaError) as e:
        kcuda.export_tensor(FakeTensor(A.base + 64), driver=drv)
    assert (e.value.op, e.value.code, e.value.name) == (op, 801, "CUDA_ERROR_NOT_SUPPORTED")
    assert str(e.value) == f"{op} failed: CUDA_ERROR_NOT_SUPPORTED (CUresult 801)"
    assert drv.ops().count(op) == 1, "nothing is retried"
    if op in ("cuPointerGetAttribute", "cuMemGetAddressRange", "cuIpcGetMemHandle"):
        assert drv.balanced(), "a failure inside the context still pops and releases it"


def test_cuda_error_with_plain_int_result():
    class IntDriver(FakeDriver):
        def cuInit(self, flags):
            self.calls.append(("cuInit", (flags,)))
            return (3,)  # a binding whose CUresult is a bare int

    with pytest.raises(kcuda.CudaError, match=r"cuInit failed: CUresult 3 \(CUresult 3\)"):
        kcuda.export_tensor(FakeTensor(A.base), driver=IntDriver([A]))


def test_unknown_pointer_is_a_cuda_error():
    with pytest.raises(kcuda.CudaError, match="cuPointerGetAttribute failed: CUDA_ERROR_INVALID_VALUE"):
        kcuda.export_tensor(FakeTensor(0x1000), driver=FakeDriver([A]))


@pytest.mark.parametrize("tensor, name, match", [
    (FakeTensor(A.base, is_cuda=False), "tensor", r"tensor is not a CUDA tensor \(device .*cpu"),
    (FakeTensor(0), "tensor", r"tensor holds no GPU memory"),
    (FakeTensor(A.base, index=None), "tensor", r"without a device index"),
])
def test_bad_tensor_rejected_before_any_driver_call(tensor, name, match):
    drv = FakeDriver([A])
    with pytest.raises(ValueError, match=match):
        kcuda.export_tensor(tensor, driver=drv)
    assert drv.calls == []


def test_cpu_tensor_in_a_list_is_named():
    with pytest.raises(ValueError, match=r"tensors\[1\] is not a CUDA tensor"):
        kcuda.export_tensors([FakeTensor(A.base), FakeTensor(A.base, is_cuda=False)], driver=FakeDriver([A]))


def test_imports_without_torch_or_cuda_python():
    # None in sys.modules makes an import fail as if the package were absent.
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        sys.modules["cuda"] = None
        sys.modules["cuda.bindings"] = None
        from kvxfer import cuda
        class CpuTensor:
            is_cuda = False
            device = "cpu"
        try:
            cuda.export_tensor(CpuTensor())  # refused before the driver is needed
        except ValueError as e:
            print("ValueError:", e)
        try:
            cuda.load_driver()
        except ImportError as e:
            print("ImportError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(PYTHON_DIR)})
    assert out.returncode == 0, out.stderr
    assert "ValueError: tensor is not a CUDA tensor (device cpu)" in out.stdout
    assert "ImportError: kvxfer.cuda needs cuda-python" in out.stdout


def test_load_driver_falls_back_to_cuda_cuda(monkeypatch):
    old = types.ModuleType("cuda")
    old.cuda = types.SimpleNamespace(name="cuda-python < 12.6 driver")
    monkeypatch.setitem(sys.modules, "cuda", old)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    assert kcuda.load_driver() is old.cuda


def test_worker_hello_shares_gpu_memory_by_uuid(monkeypatch):
    """The connector's worker side, for CUDA KV caches: one SharedMemory per
    allocation (vLLM's layer views share one), with its IPC handle, base,
    size and the GPU's UUID, and no file path."""
    from kvxfer import vllm as kv
    drv = FakeDriver([B])
    monkeypatch.setattr(kcuda, "load_driver", lambda: drv)
    layers = [FakeTensor(B.base + i * 4096, index=1) for i in range(3)]
    mem = kv.share_memory(None, layers, [(t.ptr, 4096) for t in layers])
    assert [(m.base, m.size, m.cuda_ipc_handle, m.device_uuid, m.path) for m in mem] == [
        (B.base, B.size, handle_of(B.base), UUID_STRS[1], "")]
    assert drv.balanced()
