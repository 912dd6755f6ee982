"""The fake-CUDA tier's probe on a real GPU: the same interface as
:class:`megatron_mis.testing.fake_cuda.SyncProbe`, backed by
``torch.cuda.set_sync_debug_mode("warn")`` instead of a dispatch mode.

On a machine with CUDA, ``MEGATRON_MIS_REAL_CUDA_TIER=1 python -m pytest tests/fakecuda`` runs the
tier's tests with this probe: the entry points get real ``cuda`` tensors, and every operation the
CUDA runtime reports as synchronising (a blocking copy, ``.item()``, ``nonzero``, a boolean mask,
``torch.cuda.synchronize``) while the probe is active is recorded as a violation with the
``file:line`` of the first frame outside torch. What the sync-debug mode does not see (a CPU
tensor returned for CUDA inputs) is recorded by :meth:`RealCudaProbe.check_outputs`, as on the
fake device.

Opt-in, not automatic: the tier's tests compare against a CPU reference, several of them bitwise
(``rtol=0``), which the fake device (it computes on the CPU) meets by construction and a GPU's
kernels need not; a value mismatch there is a difference of kernels, a recorded violation is a
host synchronisation.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from megatron_mis.testing.fake_cuda import CPU_OUTPUT, Violation, _leaves, _where, shadow

__all__ = ["RealCudaProbe", "SYNC", "real_cuda"]

#: The one violation kind the sync-debug mode reports.
SYNC = "synchronizing CUDA operation"
_SKIP = ("/megatron_mis/testing/real_cuda.py", "/warnings.py")


class RealCudaProbe:
    """Records the synchronising CUDA operations run while it is active (see the module docstring)."""

    current: "RealCudaProbe | None" = None

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self._active = False
        self._previous_showwarning: Any = warnings.showwarning  # set again by real_cuda() on entry

    # the fake probe's public interface --------------------------------------------------
    def cuda(self, t: Any) -> Any:
        """Move a (pytree of) CPU tensor(s) to the GPU (test set-up, not recorded); a leaf that
        requires grad stays a leaf."""
        def move(x):
            if isinstance(x, torch.Tensor) and x.device.type != "cuda":
                out = x.detach().to("cuda")
                return out.requires_grad_(x.requires_grad) if x.is_leaf and x.requires_grad else out
            return x
        with self.paused():
            out = tree_map(move, t)
            torch.cuda.synchronize()
        return out

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        with self.paused():
            return t.pin_memory()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_pinned()

    def record(self, kind: str, op: Any, detail: str = "") -> None:
        self.violations.append(Violation(kind, str(op), _where(_SKIP), detail))

    def check_outputs(self, out: Any, name: str = "output") -> None:
        for i, leaf in enumerate(_leaves(out)):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda" and leaf.dim() > 0:
                self.violations.append(
                    Violation(CPU_OUTPUT, name, _where(_SKIP), f"leaf {i}: CPU tensor of shape {tuple(leaf.shape)}"))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run set-up or reference code inside the block: nothing is recorded."""
        saved = self._active
        self._set(False)
        try:
            yield
        finally:
            self._set(saved)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for v in self.violations if kind is None or v.kind == kind)

    def report(self) -> str:
        return "\n".join(f"  {v}" for v in self.violations)

    def assert_clean(self, allowed: int = 0, what: str = "") -> None:
        if len(self.violations) > allowed:
            raise AssertionError(
                f"{what or 'the probed code'}: {len(self.violations)} host synchronisation(s) on the GPU "
                f"(allowed: {allowed}):\n{self.report()}")

    def assert_matches(self, actual: Any, expected: Any, *, equal_nan: bool = False, msg: str | None = None) -> None:
        """``actual`` (on the GPU) equals ``expected`` (the CPU run) within torch's default
        tolerance for the dtype (float32: 1.3e-6 relative, 1e-5 absolute): a GPU's kernels round
        differently from the CPU's (on an H100, 2026-11-27: at most 1 ulp, 4.8e-7 on log-probs near
        -4, 2.2e-16 on float64 summaries), so bit equality, which the fake device meets, is not
        the test here; a wrong value is."""
        torch.testing.assert_close(shadow(actual), expected, equal_nan=equal_nan, msg=msg)

    def assert_metric_matches(self, actual: float, expected: float, what: str) -> None:
        """A reduced metric (a Python float, reduced from float32 values) equals the CPU run's
        within float32 rounding (relative 1.3e-6, absolute 1e-5: torch's float32 defaults)."""
        if not math.isclose(actual, expected, rel_tol=1.3e-6, abs_tol=1e-5):
            raise AssertionError(f"{what}: {actual!r} != {expected!r} (float32 tolerance)")

    def clear(self) -> None:
        self.violations.clear()

    # ------------------------------------------------------------------------------------
    def _set(self, active: bool) -> None:
        self._active = active
        torch.cuda.set_sync_debug_mode("warn" if active else "default")

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if "synchroniz" in text.lower() and self._active:
            self.violations.append(Violation(SYNC, text.splitlines()[0][:120], _where(_SKIP), ""))
        else:
            self._previous_showwarning(message, category, filename, lineno, file, line)


@contextlib.contextmanager
def real_cuda() -> Iterator[RealCudaProbe]:
    """A :class:`RealCudaProbe` active for the block (the sync-debug mode is restored on exit).

    Raises:
        RuntimeError: without a CUDA device, or when nested.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("real_cuda() needs a CUDA device")
    if RealCudaProbe.current is not None:
        raise RuntimeError("real_cuda() is not re-entrant")
    probe = RealCudaProbe()
    torch.cuda.init()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        probe._previous_showwarning = warnings.showwarning
        warnings.showwarning = probe._showwarning
        RealCudaProbe.current = probe
        try:
            probe._set(True)
            yield probe
        finally:
            probe._set(False)
            RealCudaProbe.current = None
            torch.cuda.synchronize()

