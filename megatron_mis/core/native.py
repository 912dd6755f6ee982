"""The MIS engine's weights and masks through a native CPU kernel, for the host drop-ins (pure
torch and C++; no Megatron).

``native_engine: true`` with ``mis_metrics: none``: the host drop-ins (lists in, lists out, no
context parallelism) run the token work as two C++ passes over the per-sample pieces
(``csrc/mis_native.cpp``), with no joined copy of the inputs and one ``[T]`` float32 scratch
between the passes:

1. per sample, the eager engine's per-token arithmetic (validity, clamped log-ratio, the token
   IS bound, token rejections, vetoes) and its per-sequence sums; each token's kept weight goes
   to a float32 scratch;
2. the sequence decisions and the normalising mean in torch on ``[N]``
   (:func:`megatron_mis.core.engine.sequence_decisions`, the same code the engine runs);
3. per sample, the host's loss (``pg_loss`` times the weight, exactly 0 where a token is
   rejected) and the returned masks (one ``[T]`` tensor in the joined masks' dtype, split into
   per-sample views as the torch engine does). The loss's backward recomputes the weights and the
   keep mask from the scratch.

The built kernel is process-wide state by nature (``torch.ops.megatron_mis_native``): :func:`load`
builds it once per process and remembers a failed build, so a job without a compiler gets the
same clear error on every call instead of a rebuild attempt per micro-batch.

The values are the eager engine's, bit for bit: the same float32 operations, and the exponential
``torch.exp`` computes (MKL's ``vmsExp`` in high-accuracy mode where torch is built with MKL, as
``ATen/cpu/vml.h`` calls it; ATen's vectorised ``exp`` otherwise). The per-sequence sums are float64
sums of the same float32 values within fixed blocks, so they do not depend on the thread count
(and differ from the engine's chunked sums by float64 rounding at most: none in the tests).
``tests/unit/test_native.py`` compares the drop-in's loss, masks and gradient with the engine's.

The kernel is built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja``; 16-21 s on 2 cores, then cached in ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), for the CPU capability torch itself dispatches to. It runs on a
CPU only; on a GPU the drop-ins run the torch engine.
"""

from __future__ import annotations

import functools
import operator
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_mis.core.engine import sequence_decisions
from megatron_mis.core.statistics import BIG, Plan, SequenceExtremum, SequenceStatistics, SequenceSum

__all__ = ["NativeBuildError", "NativeResult", "load", "unsupported_reason", "weights_and_masks"]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "mis_native.cpp"
_LOG_PROB_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
#: where the token pass writes its sums, in the kernel's order: eight sums, then the three columns
#: the engine derives from them (sum log r, the non-finite and the token-rejected counts)
_COLUMNS = [int(c) for c in (
    SequenceSum.N_MASK, SequenceSum.N_VALID, SequenceSum.N_TOK_KEPT, SequenceSum.N_RATIO_VETO,
    SequenceSum.N_PROB_VETO, SequenceSum.SUM_TRAIN_LP, SequenceSum.SUM_ROLLOUT_LP, SequenceSum.SUM_W_KEPT,
    SequenceSum.SUM_LOG_R, SequenceSum.N_NONFINITE, SequenceSum.N_TOK_REJECTED,
)]
#: compiler flags per CPU capability torch reports (ATen's vector types are selected by the define)
_CAPABILITY_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
}


class NativeBuildError(RuntimeError):
    """The native kernel could not be built (no C++ compiler, no ninja, a failed compile)."""


@dataclass
class _Loaded:
    ops: Any = None
    error: BaseException | None = None


_STATE = _Loaded()


def load() -> Any:
    """The kernel's op namespace ``torch.ops.megatron_mis_native``, built on the first call of a
    process (later calls return it; a failed build raises the same :class:`NativeBuildError`
    again instead of retrying)."""
    if _STATE.ops is not None:
        return _STATE.ops
    if _STATE.error is not None:
        raise NativeBuildError(str(_STATE.error)) from _STATE.error
    try:
        _STATE.ops = _build()
    except Exception as exc:  # noqa: BLE001 - every build failure is reported the same way
        _STATE.error = exc
        raise NativeBuildError(str(exc)) from exc
    return _STATE.ops


def _build() -> Any:
    from torch.utils import cpp_extension

    if shutil.which("c++") is None and shutil.which("g++") is None and not os.environ.get("CXX"):
        raise NativeBuildError(
            "native_engine: true needs a C++ compiler to build its kernel (none found: install g++ or set CXX), "
            "or set native_engine: false"
        )
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package ships the binary

            path = os.pathsep.join([ninja.BIN_DIR, path])
        except ImportError:
            raise NativeBuildError(
                "native_engine: true needs ninja to build its kernel (pip install ninja, or megatron-mis[native]), "
                "or set native_engine: false"
            ) from None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(capability, [])]
    old_path = os.environ.get("PATH")
    os.environ["PATH"] = path  # torch's builder calls `ninja` from PATH
    try:
        cpp_extension.load(
            name=f"megatron_mis_native_{capability.lower()}",
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            is_python_module=False,
            verbose=False,
        )
    finally:
        if old_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old_path
    return torch.ops.megatron_mis_native


def unsupported_reason(rollout: list[torch.Tensor], pg_loss: torch.Tensor) -> str | None:
    """Why a call cannot take the native path, as far as Python checks it (an empty micro-batch, a
    loss that is not a float CPU tensor), or ``None``. The pieces' devices and dtypes are checked
    by the kernel itself, which raises ``NotImplementedError`` for one it does not read."""
    if not rollout:
        return "an empty micro-batch"
    if not pg_loss.is_cpu:
        return f"pg_loss on {pg_loss.device} (the kernel runs on a CPU)"
    if pg_loss.dtype not in _LOG_PROB_DTYPES:
        return f"pg_loss of dtype {pg_loss.dtype}"
    return None


@dataclass
class NativeResult:
    """What the native path returns to a host drop-in.

    Attributes:
        loss: ``[T]`` in ``pg_loss``'s dtype: ``pg_loss`` times the weight where a token is kept,
            exactly 0 elsewhere (differentiable in ``pg_loss``).
        masks: per sample, the kept mask (0 / 1) in the dtype ``torch.cat`` gives the joined masks
            (views of one ``[T]`` tensor, as the torch engine returns them).
        stats: the per-sequence :class:`SequenceStatistics` (no extrema: ``mis_metrics: none``).
        num_nonfinite: 0-dim int64, loss-mask tokens with NaN / inf log-probs.
    """

    loss: torch.Tensor
    masks: list[torch.Tensor]
    stats: SequenceStatistics
    num_nonfinite: torch.Tensor


def _options(plan: Plan) -> list[float]:
    modes = {"truncate": 0.0, "clip": 1.0, "mask": 2.0}
    return [
        plan.bound,
        modes[plan.tis_mode] if plan.token_is else -1.0,
        plan.tis_lo, plan.tis_hi,
        1.0 if plan.use_rs and plan.rs_level == "token" else 0.0,
        plan.rs_lo, plan.rs_hi,
        0.0 if plan.log_ratio_veto is None else 1.0,
        0.0 if plan.log_ratio_veto is None else plan.log_ratio_veto,
        0.0 if plan.log_prob_veto is None else (2.0 if plan.prob_veto_train else 1.0),
        0.0 if plan.log_prob_veto is None else plan.log_prob_veto,
        1.0 if plan.reject_nonfinite else 0.0,
    ]


class _HostLoss(torch.autograd.Function):
    """``where(keep, pg_loss * w, 0)`` and the kept masks ``[T]``, computed by the kernel; the
    backward is the select's, ``where(keep, grad * w, 0)``, with ``w`` and ``keep`` recomputed from
    the scratch (the forward writes neither)."""

    @staticmethod
    def forward(ctx, pg_loss, lengths, scratch, alive, seq_weight, norm, mode, mask_dtype, masks_out):  # type: ignore[override]
        loss, _, _, flat_masks = load().output_pass.default(
            lengths, pg_loss.detach(), scratch, alive, seq_weight, norm, mode, mask_dtype, True, False
        )
        ctx.save_for_backward(scratch, alive, seq_weight)
        ctx.lengths, ctx.norm, ctx.mode, ctx.mask_dtype, ctx.pg_dtype = lengths, norm, mode, mask_dtype, pg_loss.dtype
        masks_out.append(flat_masks)  # no gradient: handed back beside autograd
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):  # type: ignore[override]
        scratch, alive, seq_weight = ctx.saved_tensors
        _, weights, keep, _ = load().output_pass.default(
            ctx.lengths, scratch, scratch, alive, seq_weight, ctx.norm, ctx.mode, ctx.mask_dtype, False, True
        )
        grad = torch.where(keep, grad_loss * weights.to(ctx.pg_dtype).to(grad_loss.dtype), 0.0)
        return (grad,) + (None,) * 8


def weights_and_masks(
    train: list[torch.Tensor] | None,
    rollout: list[torch.Tensor],
    masks: list[torch.Tensor],
    pg_loss: torch.Tensor,
    plan: Plan,
    normalizer: torch.Tensor | None = None,
    lengths: list[int] | None = None,
) -> NativeResult:
    """The host drop-in's outputs for whole sequences (no context parallelism).

    Args:
        train: per sample ``[L_n]`` log pi_old, or ``None`` (every ratio 1).
        rollout: per sample ``[L_n]`` log pi_rollout.
        masks: per sample ``[L_n]`` loss mask (a value > 0 is in the loss).
        pg_loss: ``[T]`` the host's per-token loss, ``T = sum L_n``.
        plan: the configuration (``mis_metrics: none``; ``nonfinite_policy`` neutralize or reject).
        normalizer: the global self-normalisation mean (0-dim float64), or ``None``.
        lengths: the samples' lengths, if the caller has them (else read from ``masks``).

    The caller has validated the lists (types, lengths) and :func:`unsupported_reason`.

    Raises:
        NotImplementedError: a piece the kernel does not read (not on a CPU, or a dtype other
            than float16 / bfloat16 / float32 / float64 log-probs and those or bool / integer
            masks); nothing has been computed, so the caller can run the torch engine instead.
    """
    ops = load()
    sums, scratch = ops.token_pass.default(
        [] if train is None else train, rollout, masks, _options(plan), _COLUMNS, len(SequenceSum)
    )
    n = len(rollout)
    f64 = torch.float64
    stats = SequenceStatistics(
        sums=sums,
        mins=torch.full((n, len(SequenceExtremum)), BIG, dtype=f64),
        maxs=torch.full((n, len(SequenceExtremum)), -BIG, dtype=f64),
    )
    seqs, _, norm = sequence_decisions(stats, normalizer, plan)
    alive = ~seqs.rejected
    if plan.token_is:
        mode, seq_weight = 0, torch.zeros(n)
    elif plan.use_tis:
        mode = 1
        seq_weight = torch.where(alive, seqs.w_seq / norm, torch.zeros_like(seqs.w_seq)).to(torch.float32)
    else:
        mode, seq_weight = 2, torch.zeros(n)
    norm32 = norm.to(torch.float32)  # read by the kernel (no host read of a tensor here)
    # the returned masks take the dtype torch.cat gives the joined masks (the torch engine's)
    mask_dtype = functools.reduce(torch.promote_types, set(map(operator.attrgetter("dtype"), masks)))
    if lengths is None:
        lengths = list(map(torch.Tensor.numel, masks))
    flat: list[torch.Tensor] = []
    loss = _HostLoss.apply(pg_loss, lengths, scratch, alive.to(torch.float32), seq_weight, norm32, mode, mask_dtype, flat)
    return NativeResult(
        loss=loss, masks=list(torch.split(flat[0], lengths)), stats=stats,
        num_nonfinite=sums[:, SequenceSum.N_NONFINITE].sum().to(torch.int64),
    )
