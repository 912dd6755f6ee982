"""Fake CUDA on a CPU-only PyTorch build: run public entry points on ``cuda:0`` tensors and fail,
naming ``file:line``, on every host synchronisation a real GPU would pay for.

A GPU cannot be asked for in CI, but the synchronisations that cost on one are visible in the
ops that are dispatched: a blocking host-to-device copy (``t.to("cuda")`` without
``non_blocking``, ``torch.tensor(data, device="cuda")``, indexing a CUDA tensor with a Python
list or a CPU tensor) is ``cudaMemcpyAsync`` plus a stream synchronise; a host read (``.item()``,
``bool(t)``, ``int(t)``, ``float(t)``, ``.tolist()``, ``.cpu()``) or an op whose output shape
depends on the data (boolean-mask indexing, ``nonzero``, ``masked_select``, ``unique``) waits for
the queue to drain.

How it works (all of it is undone on exit; nothing is left installed):

- :class:`FakeCudaTensor` is a wrapper tensor subclass whose ``device`` is ``cuda:0`` and whose
  payload is a real CPU tensor (the "shadow"): every op runs on the shadow, so data-dependent
  code gets real values and the results can be compared with a plain CPU run.
- :class:`SyncProbe` (a ``TorchDispatchMode``) sees every dispatched aten op, classifies it as a
  real CUDA build would run it, records each synchronisation with the ``file:line`` of the first
  frame outside torch, and runs it on the shadows.
- C++ code paths that exclude Python dispatch (``torch.tensor(data, device=...)``, list indices)
  reach the ``CUDA`` dispatch key: a Python fallback kernel registered there for the duration
  does the same.
- Indexing and ``.to("cuda")`` open a CUDA device guard, which a CPU-only build does not have.
  The CPU build's own no-op guard (``libc10``'s registry entry for ``CPU``) is placed in the
  registry slot for ``CUDA`` through ``ctypes`` (no compiler needed) and the slot is emptied again
  on exit; ``torch.cuda._lazy_init``, ``Event``, ``current_device``, ``synchronize`` and
  ``current_stream`` are patched for the duration (``Event.synchronize`` and
  ``torch.cuda.synchronize`` are recorded as synchronisations).
- Pinned host memory (``pin_memory=True``) does not exist without CUDA: such buffers are plain
  CPU tensors whose storages the probe remembers as pinned.
- Autograd runs through the wrapper (its engine uses the same no-op guard), so backward passes
  are probed too.

On a machine with CUDA none of this is installed: :func:`fake_cuda` raises, and the same tests
run on the real device under ``torch.cuda.set_sync_debug_mode("error")``
(``tests/fakecuda/test_real_cuda.py``).

Usage::

    with fake_cuda() as probe:
        x = probe.cuda(torch.randn(8))       # a cuda:0 tensor with a CPU shadow
        out = entry_point(x, ...)
        probe.check_outputs(out)             # CPU tensors returned for CUDA inputs
    probe.assert_clean()                     # AssertionError listing every sync with file:line
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FakeCudaTensor", "backward", "SyncProbe", "Violation", "fake_cuda", "fake_cuda_unavailable_reason", "shadow"]

aten = torch.ops.aten
_CUDA = torch.device("cuda", 0)
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)

#: Violation kinds.
BLOCKING_H2D = "blocking host-to-device copy"
HOST_READ = "host read"
DATA_DEPENDENT = "data-dependent shape"
CPU_INDEX = "CUDA tensor indexed by a CPU tensor (blocking copy)"
DEVICE_MISMATCH = "device mismatch"
CPU_OUTPUT = "CPU tensor returned for CUDA inputs"
EXPLICIT_SYNC = "explicit synchronize"
KINDS = (BLOCKING_H2D, HOST_READ, DATA_DEPENDENT, CPU_INDEX, DEVICE_MISMATCH, CPU_OUTPUT, EXPLICIT_SYNC)

_INDEX_OPS = {
    aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
    aten._unsafe_index.Tensor, aten._unsafe_index_put.default,
}
# ops that may mix devices without a synchronisation or an error (metadata, copies handled apart)
_METADATA_OPS = {
    aten.is_pinned.default, aten._pin_memory.default, aten.is_same_size.default,
    aten._has_compatible_shallow_copy_type.default, aten.lift_fresh.default, aten.detach.default,
    aten.alias.default, aten.set_.source_Storage_storage_offset,
}
# returns a Python scalar but reads only metadata
_SCALAR_METADATA = {aten.is_pinned.default, aten.is_same_size.default, aten._has_compatible_shallow_copy_type.default,
                    aten.is_nonzero.default}


@dataclass(frozen=True)
class Violation:
    """One synchronisation (or device error) a real GPU would hit: its kind, the aten op and the
    ``file:line`` of the first frame outside torch and this harness."""

    kind: str
    op: str
    where: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.kind} ({self.op}{': ' + self.detail if self.detail else ''})"


class FakeCudaTensor(torch.Tensor):
    """A ``cuda:0`` tensor whose data is a CPU tensor (:func:`shadow`). Only usable inside
    :func:`fake_cuda`."""

    _shadow: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "FakeCudaTensor":
        r = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=_CUDA, requires_grad=data.requires_grad, layout=data.layout,
        )
        r._shadow = data
        return r

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # never reads a value
        return f"FakeCudaTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def tolist(self) -> Any:  # torch refuses .tolist() on subclasses: record it, answer from the shadow
        probe = SyncProbe.current
        if probe is not None:
            probe.record(HOST_READ, "Tensor.tolist", f"{tuple(self.shape)} {self.dtype}")
        return self._shadow.tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        probe = SyncProbe.current
        if probe is None:
            raise RuntimeError(f"{func}: a FakeCudaTensor was used outside megatron_mis.testing.fake_cuda.fake_cuda()")
        return probe._run(func, args, kwargs or {})


def shadow(t: Any) -> Any:
    """The CPU data behind a fake CUDA tensor (tensors elsewhere in a pytree pass through); under
    :func:`megatron_mis.testing.real_cuda.real_cuda`, a CPU copy of a real CUDA tensor, read
    with the sync-debug mode off (not recorded)."""
    def host(x):
        if isinstance(x, FakeCudaTensor):
            return x._shadow
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":  # a real GPU
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return x.detach().cpu()
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return x
    return tree_map(host, t)


def _where(skip: tuple[str, ...] = ()) -> str:
    """``file:line (in function)`` of the innermost frame outside torch, this module and ``skip``."""
    frames = traceback.extract_stack()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if (path == _THIS_FILE or path.startswith(_TORCH_DIR) or "/contextlib.py" in path
                or any(path.endswith(name) for name in skip)):
            continue
        short = path
        for marker in ("/megatron_mis/", "/tests/", "/benchmarks/"):
            if marker in path:
                short = path[path.rindex(marker) + 1:]
                break
        return f"{short}:{frame.lineno} (in {frame.name})"
    return "<unknown>"


def _is_fake(x: Any) -> bool:
    return isinstance(x, FakeCudaTensor)


def _device_arg(kwargs: dict) -> torch.device | None:
    d = kwargs.get("device")
    return None if d is None else torch.device(d)


class SyncProbe(TorchDispatchMode):
    """Records every host synchronisation of the ops run under it (see the module docstring)."""

    current: "SyncProbe | None" = None

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[Violation] = []
        self._pinned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._pinned_ptrs: set[int] = set()
        self.num_ops = 0

    # ------------------------------------------------------------------------------ public
    def cuda(self, t: Any) -> Any:
        """Move a (pytree of) CPU tensor(s) to fake ``cuda:0`` without recording a copy (test
        set-up); a leaf that requires grad stays a leaf."""
        def move(x):
            if isinstance(x, torch.Tensor) and not _is_fake(x):
                out = FakeCudaTensor(x.detach())
                return out.requires_grad_(x.requires_grad) if x.is_leaf and x.requires_grad else out
            return x
        return tree_map(move, t)

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """Mark a CPU tensor as pinned host memory (what ``pin_memory()`` would return)."""
        self._pinned_ptrs.add(t.untyped_storage().data_ptr())
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return (not _is_fake(t)) and t.untyped_storage().data_ptr() in self._pinned_ptrs

    def record(self, kind: str, op: Any, detail: str = "") -> None:
        self.violations.append(Violation(kind, str(op), _where(), detail))

    def check_outputs(self, out: Any, name: str = "output") -> None:
        """Record every CPU tensor with elements in ``out`` (a pytree, dataclass fields included)."""
        for i, leaf in enumerate(_leaves(out)):
            if isinstance(leaf, torch.Tensor) and not _is_fake(leaf) and leaf.dim() > 0:
                self.violations.append(
                    Violation(CPU_OUTPUT, name, _where(), f"leaf {i}: CPU tensor of shape {tuple(leaf.shape)}")
                )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run plain CPU code (a reference) inside the block: the probe steps aside."""
        with torch.utils._python_dispatch._disable_current_modes():
            saved, SyncProbe.current = SyncProbe.current, None
            try:
                yield
            finally:
                SyncProbe.current = saved

    def count(self, kind: str | None = None) -> int:
        return sum(1 for v in self.violations if kind is None or v.kind == kind)

    def report(self) -> str:
        return "\n".join(f"  {v}" for v in self.violations)

    def assert_clean(self, allowed: int = 0, what: str = "") -> None:
        """Fail (listing each with ``file:line``) if more than ``allowed`` synchronisations or
        device errors were recorded."""
        if len(self.violations) > allowed:
            raise AssertionError(
                f"{what or 'the probed code'}: {len(self.violations)} host synchronisation(s) / device error(s) on "
                f"CUDA inputs (allowed: {allowed}):\n{self.report()}"
            )

    def assert_matches(self, actual: Any, expected: Any, *, equal_nan: bool = False, msg: str | None = None) -> None:
        """``actual`` (on the fake device) equals ``expected`` (the CPU run) bit for bit: the fake
        device computes with the CPU's kernels. (:class:`~megatron_mis.testing.real_cuda.RealCudaProbe`
        allows a GPU's rounding instead.)"""
        torch.testing.assert_close(shadow(actual), expected, rtol=0, atol=0, equal_nan=equal_nan, msg=msg)

    def assert_metric_matches(self, actual: float, expected: float, what: str) -> None:
        """A reduced metric (a Python float) equals the CPU run's to float64 summation order
        (relative 1e-9)."""
        if not math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12):
            raise AssertionError(f"{what}: {actual!r} != {expected!r}")

    def clear(self) -> None:
        self.violations.clear()

    # ------------------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs or {})

    def _run(self, func, args, kwargs):
        self.num_ops += 1
        kwargs = dict(kwargs)
        flat, _ = tree_flatten((args, kwargs))
        fakes = [x for x in flat if _is_fake(x)]
        target = self._target_device(func, args, kwargs, fakes)
        if fakes or (target is not None and target.type == "cuda"):
            self._classify(func, args, kwargs, flat, fakes, target)
        pin = kwargs.get("pin_memory")
        if pin:
            kwargs["pin_memory"] = False
        if "device" in kwargs and kwargs["device"] is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = torch.device("cpu")
        if func is aten._pin_memory.default:
            return self.pinned(shadow(args[0]).clone())
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        inner_args, inner_kwargs = shadow(args), shadow(kwargs)
        with _no_dispatch():
            out = func(*inner_args, **inner_kwargs)
        if pin:
            tree_map(lambda x: self.pinned(x) if isinstance(x, torch.Tensor) else x, out)
        if target is not None and target.type == "cuda":
            # in-place ops return their (fake) self
            inputs = {id(shadow(x)): x for x in flat if _is_fake(x)}
            return tree_map(
                lambda x: inputs.get(id(x), FakeCudaTensor(x) if isinstance(x, torch.Tensor) else x), out
            )
        if func is aten._to_copy.default and fakes and kwargs.get("non_blocking"):
            tree_map(lambda x: self.pinned(x) if isinstance(x, torch.Tensor) else x, out)  # torch pins d2h outputs
        return out

    @staticmethod
    def _target_device(func, args, kwargs, fakes) -> torch.device | None:
        if func in (aten.copy_.default, aten.copy.default) or func._schema.name.endswith("_out") or "out" in kwargs:
            dst = kwargs.get("out", args[0] if args else None)
            if isinstance(dst, torch.Tensor):
                return dst.device
        d = _device_arg(kwargs)
        if d is not None:
            return d
        if func is aten._to_copy.default:
            return args[0].device
        return _CUDA if fakes else None

    def _classify(self, func, args, kwargs, flat, fakes, target) -> None:
        name = func._schema.name
        non_blocking = bool(kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2 else False))
        if func in (aten._to_copy.default, aten.copy_.default, aten.copy.default):
            src = args[1] if func is not aten._to_copy.default else args[0]
            src_cuda = isinstance(src, torch.Tensor) and src.device.type == "cuda"
            if target.type == "cuda" and isinstance(src, torch.Tensor) and not src_cuda and not non_blocking:
                self.record(BLOCKING_H2D, func, f"{tuple(src.shape)} {src.dtype} without non_blocking=True")
            if target.type == "cpu" and src_cuda:
                dst = args[0] if func is not aten._to_copy.default else None
                if not non_blocking or (dst is not None and not self.is_pinned(dst)):
                    self.record(HOST_READ, func, f"device-to-host copy of {tuple(src.shape)} {src.dtype}"
                                + ("" if not non_blocking else " into pageable memory"))
            return
        if func is aten._local_scalar_dense.default:
            self.record(HOST_READ, func, "a value read on the host (.item(), bool(), int(), float(), .tolist())")
            return
        if func in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            for idx in indices or ():
                if idx is None:
                    continue
                if idx.dtype in (torch.bool, torch.uint8) and func not in (aten._unsafe_index_put.default,):
                    self.record(DATA_DEPENDENT, func, "boolean-mask index (nonzero)")
                elif not _is_fake(idx):
                    self.record(CPU_INDEX, func, f"CPU index of shape {tuple(idx.shape)}")
            return
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and kwargs.get("output_size") is not None:
            return  # the output size is given: nothing is read (the reason output_size exists)
        if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
            if func not in _SCALAR_METADATA:
                self.record(DATA_DEPENDENT, func, "output shape or value depends on the data")
                return
        returns = [str(r.type) for r in func._schema.returns]
        if returns and all(r in ("Scalar", "bool", "int", "float", "SymInt") for r in returns) and func not in _SCALAR_METADATA:
            self.record(HOST_READ, func, f"returns {', '.join(returns)} to the host")
            return
        if func in _METADATA_OPS:
            return
        cpu = [x for x in flat if isinstance(x, torch.Tensor) and not _is_fake(x) and x.dim() > 0]
        if cpu and (fakes or target.type == "cuda"):
            self.record(DEVICE_MISMATCH, func, f"CPU tensor(s) of shape {[tuple(x.shape) for x in cpu]} with CUDA tensors")
        del name


def _leaves(out: Any) -> list[Any]:
    import dataclasses

    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [leaf for f in dataclasses.fields(out) for leaf in _leaves(getattr(out, f.name))]
    if isinstance(out, dict):
        return [leaf for v in out.values() for leaf in _leaves(v)]
    if isinstance(out, (list, tuple)):
        return [leaf for v in out for leaf in _leaves(v)]
    return [out]


@contextlib.contextmanager
def _no_dispatch() -> Iterator[None]:
    guard = torch._C._DisableTorchDispatch()
    try:
        yield
    finally:
        del guard


# ---------------------------------------------------------------------------------- installing
def _guard_registry() -> Any:
    lib = ctypes.CDLL(os.path.join(_TORCH_DIR, "lib", "libc10.so"))
    return (ctypes.c_void_p * 64).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")


# c10::impl::DeviceGuardImplInterface's virtual functions in declaration order (Itanium ABI: the
# object's first word points at slot 0; two words before it are offset-to-top and the RTTI).
_SLOT_TYPE, _SLOT_EXCHANGE_DEVICE, _SLOT_GET_DEVICE = 0, 1, 2
_NUM_SLOTS = 26  # 24 virtual functions + the two destructor entries
_DEVICE_CUDA0 = 1  # c10::Device{DeviceType::CUDA = 1, index 0} as its two bytes, little-endian
_DEVICE_CPU = 0xFF00  # c10::Device{DeviceType::CPU = 0, index -1}
_GUARD: dict[str, Any] = {}


def _cuda_guard() -> int:
    """A CUDA device guard for a CPU-only build, made without a compiler: a copy of the CPU
    build's no-op guard (``NoOpDeviceGuardImpl<CPU>``) whose ``type()``, ``getDevice()`` and
    ``exchangeDevice()`` answer ``cuda:0``. Built once per process (the callbacks must outlive
    every use); checked against the CPU guard's own answers first."""
    if "object" in _GUARD:
        return ctypes.addressof(_GUARD["object"])
    reg = _guard_registry()
    cpu = reg[0]
    vptr = ctypes.c_void_p.from_address(cpu).value
    table = (ctypes.c_void_p * (_NUM_SLOTS + 2)).from_address(vptr - 2 * ctypes.sizeof(ctypes.c_void_p))
    type_fn = ctypes.CFUNCTYPE(ctypes.c_int8, ctypes.c_void_p)
    device_fn = ctypes.CFUNCTYPE(ctypes.c_uint16, ctypes.c_void_p)
    exchange_fn = ctypes.CFUNCTYPE(ctypes.c_uint16, ctypes.c_void_p, ctypes.c_uint16)
    # the slots are where this module expects them: the CPU guard says CPU and cpu:-1
    if type_fn(table[2 + _SLOT_TYPE])(cpu) != 0 or device_fn(table[2 + _SLOT_GET_DEVICE])(cpu) != _DEVICE_CPU:
        raise RuntimeError("libc10's CPU device guard does not have the expected virtual-function layout")
    callbacks = [
        type_fn(lambda this: 1), exchange_fn(lambda this, device: _DEVICE_CUDA0), device_fn(lambda this: _DEVICE_CUDA0),
    ]
    new_table = (ctypes.c_void_p * (_NUM_SLOTS + 2))(*table)
    for slot, cb in zip((_SLOT_TYPE, _SLOT_EXCHANGE_DEVICE, _SLOT_GET_DEVICE), callbacks):
        new_table[2 + slot] = ctypes.cast(cb, ctypes.c_void_p).value
    obj = (ctypes.c_void_p * 1)(ctypes.addressof(new_table) + 2 * ctypes.sizeof(ctypes.c_void_p))
    _GUARD.update(object=obj, table=new_table, callbacks=callbacks)
    return ctypes.addressof(obj)


def fake_cuda_unavailable_reason() -> str | None:
    """Why :func:`fake_cuda` cannot run here (``None`` when it can)."""
    if torch.cuda.is_available():
        return "CUDA is available: the fake-CUDA tier runs on the real device (tests/fakecuda/test_real_cuda.py)"
    if torch.backends.cuda.is_built():
        return "this torch build has CUDA compiled in but no device: fake CUDA would collide with its kernels"
    try:
        reg = _guard_registry()
    except (OSError, ValueError) as exc:
        return f"libc10's device-guard registry is not reachable through ctypes ({exc})"
    if not reg[0]:
        return "libc10 has no CPU device guard registered"
    if reg[1] and reg[1] != _GUARD.get("address"):
        return "a CUDA device guard is already registered"
    try:
        _GUARD["address"] = _cuda_guard()
    except (RuntimeError, ValueError, OSError) as exc:
        return str(exc)
    return None


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        probe = SyncProbe.current
        if probe is not None:
            probe.record(EXPLICIT_SYNC, "torch.cuda.Event.synchronize")

    def wait(self, stream: Any = None) -> None:
        pass


class _FakeStream:
    device = _CUDA

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        _synchronize()


def _synchronize(device: Any = None) -> None:
    probe = SyncProbe.current
    if probe is not None:
        probe.record(EXPLICIT_SYNC, "torch.cuda.synchronize")


#: Ops that C++ code paths excluding Python dispatch (``torch.tensor(data, device=...)``, list
#: indices) call on the CUDA key: given CUDA kernels for the duration that run as the mode does.
_CUDA_KERNELS = ("empty_strided", "empty.memory_format", "copy_", "_to_copy", "lift_fresh", "_copy_from",
                 "_copy_from_and_resize", "resize_", "index.Tensor", "clone", "view", "as_strided",
                 "_reshape_alias", "detach", "alias", "zeros", "fill_.Scalar", "zero_")


def _cuda_kernel(op: Any):
    def kernel(*args, **kwargs):
        probe = SyncProbe.current
        if probe is None:
            raise RuntimeError(f"{op}: CUDA op outside fake_cuda()")
        return probe._run(op, args, kwargs)
    return kernel


@contextlib.contextmanager
def fake_cuda() -> Iterator[SyncProbe]:
    """Install fake CUDA and a :class:`SyncProbe` for the block; everything is removed on exit.

    Raises:
        RuntimeError: if it cannot run here (:func:`fake_cuda_unavailable_reason` says why), or
            when nested.
    """
    reason = fake_cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"fake_cuda() cannot run: {reason}")
    if SyncProbe.current is not None:
        raise RuntimeError("fake_cuda() is not re-entrant")
    reg = _guard_registry()
    installed_guard = not reg[1]
    if installed_guard:
        reg[1] = _cuda_guard()
    patches = {
        "_lazy_init": lambda: None, "Event": _FakeEvent, "current_device": lambda: 0,
        "synchronize": _synchronize, "current_stream": lambda device=None: _FakeStream(),
        "default_stream": lambda device=None: _FakeStream(), "device_count": lambda: 1,
    }
    saved = {k: getattr(torch.cuda, k) for k in patches}
    lib = torch.library.Library("aten", "IMPL")
    probe = SyncProbe()
    try:
        for k, v in patches.items():
            setattr(torch.cuda, k, v)
        for name in _CUDA_KERNELS:
            packet, _, overload = name.partition(".")
            lib.impl(name, _cuda_kernel(getattr(getattr(aten, packet), overload or "default")), "CUDA")
        SyncProbe.current = probe
        with probe:
            yield probe
    finally:
        SyncProbe.current = None
        lib._destroy()
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        if installed_guard:
            reg[1] = None


def backward(loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """``loss.backward(grad)`` walked by hand (this build's autograd engine refuses a CUDA device
    it cannot find): every node's backward runs on fake CUDA under the probe, in topological
    order, and leaf gradients accumulate into ``.grad``. Missing output gradients of a node are
    materialised as zeros (the engine's default)."""
    if loss.grad_fn is None:
        raise ValueError("loss does not require grad")
    if loss.device.type == "cuda" and not isinstance(loss, FakeCudaTensor):  # a real GPU (testing.real_cuda)
        loss.backward(grad)
        return
    # post-order DFS over the graph, then reverse: a node runs after every node that feeds it
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(loss.grad_fn, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append((nxt, False))
    pending: dict[int, dict[int, torch.Tensor]] = {id(loss.grad_fn): {0: grad if grad is not None else torch.ones_like(loss)}}
    for node in reversed(order):
        slots = pending.pop(id(node), {})
        if not slots:
            continue
        if type(node).__name__ == "AccumulateGrad":
            var = node.variable
            g = slots[0]
            var.grad = g.detach() if var.grad is None else var.grad + g.detach()
            continue
        metadata = node._input_metadata
        grads = []
        for i, meta in enumerate(metadata):
            grads.append(slots[i] if i in slots else torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device))
        with torch.no_grad():
            outs = node.apply(*grads) if hasattr(node, "_forward_cls") else node(*grads)
        if isinstance(outs, torch.Tensor) or outs is None:
            outs = (outs,)
        for (nxt, slot), g in zip(node.next_functions, outs):
            if nxt is None or g is None:
                continue
            into = pending.setdefault(id(nxt), {})
            into[slot] = g if slot not in into else into[slot] + g
