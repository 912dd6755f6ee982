"""Fuzzing the public API: every outcome is classified, and only two classes pass.

Each generated case is an input to one public entry point together with what the package promises
about it: ``ok`` (a valid input: the call must return a result within its documented bounds),
``error`` (a bad input: the call must raise a clear error) or ``either`` (the documented contract
allows both, e.g. a loss mask of 2 may be read as "in the loss" or rejected). The outcome is

- ``correct``: returned, and the result passes the entry point's checks (finite numbers, weights
  within the configured bounds, masks in {0, 1} and inside the loss mask, valid JSON, ...);
- ``clear``: raised ``ValueError`` / ``TypeError`` / ``KeyError`` (``ConfigError`` is a
  ``ValueError``) whose message names the culprit (the parameter, key or file);
- ``unclear``: any other exception, a message naming none of the culprits, or a valid input
  rejected;
- ``silent``: a returned result that fails a check, or a bad input accepted;
- ``hang``: no answer within the per-case time limit (the call runs in a worker thread).

The tests fail on anything but ``correct`` and ``clear``. Generation is derandomised (the same
cases in every run) and sized for about two minutes on two cores; ``benchmarks/fuzz_public_api.py``
runs the same strategies with thousands of cases and prints the counts per class.

``KNOWN_CASES`` at the end are minimal inputs that failed when this suite was written (see
``notes/fuzz_findings.md`` of the session); they stay as plain tests until the code is fixed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from megatron_mis.config import ConfigError, MISConfig

GOOD = ("correct", "clear")
CLASSES = ("correct", "clear", "unclear", "silent", "hang")

#: Seconds one case may take before it counts as a hang (generous: the CI machine is shared).
CASE_TIMEOUT_S = float(os.environ.get("MIS_FUZZ_CASE_TIMEOUT", "60"))


# ============================================================================ the classifier
@dataclass
class Case:
    """One generated call and what the package promises about it.

    Attributes:
        entry: the public entry point (for the counts).
        label: the input, short enough to read in a failure message.
        call: runs the entry point; returns what it returned.
        expect: ``"ok"``, ``"error"`` or ``"either"`` (see module docstring).
        names: an error message must contain at least one of these (case-insensitive).
        check: returns the violations of a returned value (empty list: within bounds).
    """

    entry: str
    label: str
    call: Callable[[], Any]
    expect: str
    names: tuple[str, ...] = ()
    check: Callable[[Any], list[str]] | None = None
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"Case({self.entry}: {self.label}; expect {self.expect})"


#: ConfigError is a ValueError; FileNotFoundError is what a missing file gives (naming it).
_CLEAR_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError)


def classify(case: Case, timeout: float = CASE_TIMEOUT_S) -> tuple[str, str]:
    """``(class, detail)`` of one case (see module docstring)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                box["value"] = case.call()
        except BaseException as exc:  # noqa: BLE001 - classified below
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout)
    try:
        if worker.is_alive():
            return "hang", f"no answer within {timeout:g} s"
        if "error" in box:
            exc = box["error"]
            text = f"{type(exc).__name__}: {exc}"
            if case.expect == "ok":
                return "unclear", f"valid input rejected: {text}"
            if not isinstance(exc, _CLEAR_ERRORS):
                return "unclear", text
            message = str(exc).lower()
            if case.names and not any(n.lower() in message for n in case.names):
                return "unclear", f"{text} (names none of {list(case.names)})"
            return "clear", text
        if case.expect == "error":
            return "silent", f"bad input accepted (returned {_brief(box['value'])})"
        problems = case.check(box["value"]) if case.check is not None else []
        if problems:
            return "silent", "; ".join(problems[:4])
        return "correct", ""
    finally:
        for fn in case.cleanup:
            fn()


def _brief(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _finite(name: str, t: Any) -> list[str]:
    if isinstance(t, torch.Tensor):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = t[~torch.isfinite(t)].flatten()[:3].tolist()
            return [f"{name} not finite ({bad})"]
        return []
    if isinstance(t, float) and not math.isfinite(t):
        return [f"{name}={t}"]
    return []


def _binary(name: str, t: torch.Tensor) -> list[str]:
    v = t.detach().double()
    if not bool(((v == 0) | (v == 1)).all()):
        return [f"{name} has values outside {{0, 1}}: {sorted(set(v[(v != 0) & (v != 1)].tolist()))[:4]}"]
    return []


# ============================================================================= value strategies
NONFINITE = [math.nan, math.inf, -math.inf]
F32_MAX = float(np.finfo(np.float32).max)
EXTREME = [0.0, -0.0, -1e-8, -80.0, -88.0, 88.0, -100.0, -1e4, -1e30, 1e30, -F32_MAX, F32_MAX, -3e38, 3e38]

finite_logprob = st.one_of(
    st.floats(-30.0, 0.0, width=32),
    st.sampled_from(EXTREME),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
)
any_logprob = st.one_of(finite_logprob, finite_logprob, finite_logprob, st.sampled_from(NONFINITE))


@st.composite
def packed_lengths(draw, max_seqs: int = 5, max_len: int = 6) -> list[int]:
    return draw(st.lists(st.integers(0, max_len), min_size=0, max_size=max_seqs))


@st.composite
def mis_configs(draw, global_scope: bool = True) -> MISConfig:
    """A valid :class:`MISConfig` (drawn from every option; invalid combinations are redrawn)."""
    levels = ["token", "sequence", "geometric"]
    kw = dict(
        use_tis=draw(st.booleans()),
        use_rs=draw(st.booleans()),
        tis_level=draw(st.sampled_from(levels)),
        rs_level=draw(st.sampled_from(levels)),
        tis_mode=draw(st.sampled_from(["truncate", "clip", "mask"])),
        tis_upper_bound=draw(st.sampled_from([1.0, 1.2, 2.0, 5.0, 1e3])),
        tis_lower_bound=draw(st.sampled_from([None, None, 0.1, 0.5, 0.9])),
        rs_lower_bound=draw(st.sampled_from([None, 0.5, 0.8])),
        rs_upper_bound=draw(st.sampled_from([None, 1.25, 2.0, 50.0])),
        rs_veto_threshold=draw(st.sampled_from([None, None, 1e-4, 0.5])),
        log_ratio_bound=draw(st.sampled_from([1.0, 20.0, 80.0])),
        nonfinite_policy=draw(st.sampled_from(["neutralize", "reject", "error"])),
        prob_veto_threshold=draw(st.sampled_from([None, None, 1e-6, 0.3])),
        prob_veto_source=draw(st.sampled_from(["rollout", "train"])),
    )
    if kw["use_tis"]:
        kw["tis_batch_normalize"] = draw(st.booleans())
        if kw["tis_batch_normalize"] and global_scope:
            kw["tis_batch_normalize_scope"] = draw(st.sampled_from(["micro_batch", "global"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return MISConfig(**kw)
        except ConfigError:
            from hypothesis import assume

            assume(False)


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# ================================================================ engine (compute_mis) checks
def _check_mis_result(res: Any, cfg: MISConfig, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                      cu: list[int]) -> list[str]:
    from megatron_mis.core.engine import MISResult

    if not isinstance(res, MISResult):
        return [f"returned {type(res).__name__}, not MISResult"]
    t = train.shape[0]
    out: list[str] = []
    w, keep = res.weights, res.keep_mask
    if tuple(w.shape) != (t,) or tuple(keep.shape) != (t,):
        return [f"weights {tuple(w.shape)} / keep_mask {tuple(keep.shape)} are not [{t}]"]
    out += _finite("weights", w)
    if keep.dtype != torch.bool:
        out.append(f"keep_mask dtype {keep.dtype}")
    in_loss = mask != 0
    if bool((keep & ~in_loss).any()):
        out.append("keep_mask keeps a token outside the loss mask")
    if bool((w < 0).any()):
        out.append(f"negative weight {float(w.min())}")
    if bool((w[~keep] != 0).any()):
        out.append("nonzero weight on a token that is not kept")
    if not cfg.use_tis:
        out += _binary("weights (use_tis off)", w)
    elif not cfg.normalizes and bool(keep.any()):
        kw = w[keep].double()
        hi = cfg.tis_upper_bound * (1 + 1e-5)
        if bool((kw > hi).any()):
            out.append(f"kept weight {float(kw.max())} above tis_upper_bound={cfg.tis_upper_bound}")
        if cfg.tis_mode != "truncate" and bool((kw < cfg.tis_lower * (1 - 1e-5)).any()):
            out.append(f"kept weight {float(kw.min())} below tis_lower_bound={cfg.tis_lower}")
    elif cfg.normalizes and cfg.tis_batch_normalize_scope == "micro_batch" and bool(keep.any()):
        if cfg.tis_level == "token":
            mean = float(w[keep].double().mean())
        else:
            sw = res.seq_weights.double()
            kept_seq = ~res.seq_rejected & (sw > 0)
            mean = float(sw[kept_seq].mean()) if bool(kept_seq.any()) else 1.0
        if not math.isclose(mean, 1.0, rel_tol=1e-3):
            out.append(f"self-normalised mean weight is {mean}, not 1")
    out += _finite("seq_weights", res.seq_weights)
    for name, value in res.token_metrics.items():
        if tuple(value.shape) != (t,):
            out.append(f"token metric {name} has shape {tuple(value.shape)}")
        out += _finite(f"token metric {name}", value)
    for name, value in res.summary.items():
        out += _finite(f"summary {name}", value)
    for name, value in res.bucket_table.items():
        out += _finite(f"bucket_table {name}", value)
    out += _mask_mode_rule(res, cfg, train, rollout, mask)
    return out


def _mask_mode_rule(res: Any, cfg: MISConfig, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Token-level mask mode alone (no RS, veto or normalisation): a loss token is kept exactly when
    its ratio lies in [L, U]; a neutralised (non-finite) token counts as ratio 1 like any other."""
    if not (cfg.use_tis and cfg.tis_mode == "mask" and cfg.tis_level == "token") or cfg.use_rs:
        return []
    if cfg.rs_veto_threshold is not None or cfg.prob_veto_threshold is not None or cfg.nonfinite_policy != "neutralize":
        return []
    tr, ro = train.double(), rollout.double()
    finite = torch.isfinite(tr) & torch.isfinite(ro)
    log_r = torch.where(finite, (tr - ro).clamp(-cfg.log_ratio_bound, cfg.log_ratio_bound), torch.zeros_like(tr))
    r = torch.exp(log_r)
    lo, hi = cfg.tis_lower, cfg.tis_upper_bound
    inside = (r >= lo) & (r <= hi)
    near_edge = ((r - lo).abs() <= 1e-4 * lo) | ((r - hi).abs() <= 1e-4 * hi)
    in_loss = mask != 0
    wrong = in_loss & ~near_edge & (inside != res.keep_mask)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0, 0])
        return [
            f"mask mode: token {i} (train={float(train[i])}, rollout={float(rollout[i])}, ratio "
            f"{float(r[i]):.6g}, bounds [{lo:g}, {hi:g}]) kept={bool(res.keep_mask[i])}"
        ]
    return []


def _product_may_overflow(adv: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor, log_bound: float) -> bool:
    """The documented refusal of compute_rl_loss: max ratio (e^ratio_log_bound) x max |IS weight|
    x max |A| over loss tokens beyond float32 may be refused (a loss that does not fit is an error)."""
    on = (mask != 0) & torch.isfinite(adv)
    if weights is not None:
        on = on & torch.isfinite(weights)
    if not bool(on.any()):
        return False
    a = float(adv[on].abs().max())
    w = 1.0 if weights is None else float(weights[on].abs().max())
    return math.log(max(a, 1e-300)) + math.log(max(w, 1e-300)) + float(log_bound) > math.log(F32_MAX)


def _largest_log_factor(policy: Any, lp: torch.Tensor, mask: torch.Tensor, log_bound: float) -> float:
    """log of the largest factor besides A and the IS weight in a policy-loss term: the ratio's
    bound e^ratio_log_bound, or for REINFORCE-type losses (``log_prob_term``: reinforce, cispo)
    the largest finite |log pi| over loss tokens, times (cispo) its clipped ratio, at most
    e^ratio_log_bound."""
    if not policy.log_prob_term:
        return float(log_bound)
    values = lp.detach()[(mask != 0) & torch.isfinite(lp.detach())].abs()
    ratio = float(log_bound) if policy.old_policy != "none" else 0.0
    return math.log(max(float(values.max()), 1e-300)) + ratio if values.numel() else -math.inf


def _nonfinite_in_loss(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> bool:
    """A token with a NaN / inf log-prob is in the loss (mask value > 0)."""
    return bool((~(torch.isfinite(train) & torch.isfinite(rollout)) & (mask > 0)).any())


def _tensor(values: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@st.composite
def engine_cases(draw) -> Case:
    from megatron_mis.core.engine import compute_mis

    cfg = draw(mis_configs())
    lengths = draw(packed_lengths())
    t = sum(lengths)
    train = _tensor(draw(st.lists(any_logprob, min_size=t, max_size=t)))
    rollout = _tensor(draw(st.lists(any_logprob, min_size=t, max_size=t)))
    mask = _tensor(draw(st.lists(st.sampled_from([0.0, 1.0, 1.0]), min_size=t, max_size=t)))
    cu: Any = _cu(lengths)
    kwargs: dict[str, Any] = {}
    if cfg.normalizes and cfg.tis_batch_normalize_scope == "global":
        kwargs["global_normalizer"] = draw(st.sampled_from([1.0, 0.5, 3.7]))
    has_nonfinite = bool((~(torch.isfinite(train) & torch.isfinite(rollout)) & (mask != 0)).any())
    expect, names = "ok", ()
    if cfg.nonfinite_policy == "error" and has_nonfinite:
        expect, names = "error", ("nan or inf", "non-finite", "nonfinite")
    label = f"cfg={_cfg_label(cfg)} lengths={lengths} train={train.tolist()} rollout={rollout.tolist()} mask={mask.tolist()}"

    prior = names if expect == "error" else ()  # a corrupted call may still raise the first error
    corruption = draw(st.sampled_from(["none"] * 6 + ["config", "cu_seqlens", "tensor", "edges", "reduce", "normalizer", "mask_values"]))
    if corruption == "config":
        bad = draw(st.sampled_from([None, {}, "token_tis", cfg.to_dict(), MISConfig]))
        cfg_arg: Any = bad
        expect, names = "error", ("config",)
        label = f"config={bad!r} " + label
    else:
        cfg_arg = cfg
    if corruption == "cu_seqlens":
        bad = draw(st.sampled_from([
            None, "0,4", [0, 2**70], [0, math.nan], [0, 1.5, t], [1, t], [0, t + 1], [[0, t]], [], "04",
            torch.tensor([0.0, 0.5, float(t)]), [0, None], [0, True] if t == 1 else [0, -1, t],
            torch.tensor([[0, t]]),
        ]))
        cu = bad
        expect, names = "error", ("cu_seqlens",) + prior
        label = f"cu_seqlens={bad!r} " + label
    if corruption == "tensor":
        which = draw(st.sampled_from(["train_log_probs", "rollout_log_probs", "loss_mask"]))
        bad = draw(st.sampled_from(["list", "2d", "short", "none", "int"]))
        value = {"train_log_probs": train, "rollout_log_probs": rollout, "loss_mask": mask}[which]
        if bad == "list":
            value = value.tolist()
        elif bad == "2d":
            value = value.reshape(1, -1)
        elif bad == "short":
            value = torch.cat([value, value.new_zeros(1)])
        elif bad == "none":
            value = None
        elif bad == "int":
            if which == "loss_mask":
                bad = "list"
                value = value.tolist()
            else:
                value = value.to(torch.int64)
        if which == "train_log_probs":
            train_arg, rollout_arg, mask_arg = value, rollout, mask
        elif which == "rollout_log_probs":
            train_arg, rollout_arg, mask_arg = train, value, mask
        else:
            train_arg, rollout_arg, mask_arg = train, rollout, value
        expect, names = "error", (which, "log-probs") + prior
        label = f"{which} made {bad} " + label
    else:
        train_arg, rollout_arg, mask_arg = train, rollout, mask
    if corruption == "edges":
        bad = draw(st.sampled_from([[0.0, math.nan, 1.0], [0.0, math.inf], [0.5, 0.2], [0.0, 0.5, 0.5, 1.0], [], [0.0],
                                    "abc", [-0.1, 1.0], [0.0, 1.5], [0.0, None, 1.0]]))
        kwargs["prob_bucket_edges"] = bad
        expect, names = "error", ("prob_bucket_edges",) + prior
        label = f"prob_bucket_edges={bad!r} " + label
    if corruption == "reduce":
        bad = draw(st.sampled_from([5, "x", 1.5]))
        kwargs["reduce_stats"] = bad
        expect, names = "error", ("reduce_stats",) + prior
        label = f"reduce_stats={bad!r} " + label
    if corruption == "normalizer" and cfg.normalizes and cfg.tis_batch_normalize_scope == "global":
        bad = draw(st.sampled_from(["abc", math.nan, -1.0, 0.0, math.inf, [1.0, 2.0], torch.tensor([1.0, 2.0]), None]))
        kwargs["global_normalizer"] = bad
        expect, names = "error", ("global_normalizer",) + prior
        label = f"global_normalizer={bad!r} " + label
    if corruption == "mask_values" and t:
        vals = draw(st.lists(st.sampled_from([math.nan, math.inf, 2.0, -1.0, 0.5, 255.0]), min_size=1, max_size=t))
        mask_arg = mask.clone()
        mask_arg[: len(vals)] = _tensor(vals)
        # the new values move tokens in or out of the loss (a value > 0 is in; NaN is out), so the
        # non-finite expectation is recomputed over the tokens the corrupted mask keeps in
        if cfg.nonfinite_policy == "error" and _nonfinite_in_loss(train, rollout, mask_arg):
            expect, names = "error", ("nan or inf", "non-finite", "nonfinite", "loss_mask")
        else:  # "a value > 0 marks a loss token": 2, -1, 0.5 are documented; NaN / inf may be refused
            expect, names = "either", ("loss_mask",)
        label = f"loss_mask values {vals} " + label

    def call():
        return compute_mis(train_arg, rollout_arg, mask_arg, cu, cfg_arg, **kwargs)

    def check(res):
        m = mask_arg if isinstance(mask_arg, torch.Tensor) else mask
        return _check_mis_result(res, cfg, train, rollout, torch.nan_to_num(m, nan=1.0), _cu(lengths))

    return Case("compute_mis", label, call, expect, names, check)


def _cfg_label(cfg: MISConfig) -> str:
    default = MISConfig()
    return "{" + ", ".join(f"{k}={v!r}" for k, v in cfg.to_dict().items() if getattr(default, k) != v) + "}"


# ===================================================================== host drop-ins (CP = 1)
def _host_args(cfg: MISConfig) -> argparse.Namespace:
    return argparse.Namespace(**cfg.to_dict(), custom_config_path=None, qkv_format="thd")


def _check_host(out: Any, masks: list[torch.Tensor], pg: torch.Tensor) -> list[str]:
    if not (isinstance(out, tuple) and len(out) == 3):
        return [f"returned {type(out).__name__}, not (pg_loss, masks, metrics)"]
    new_pg, new_masks, metrics = out
    problems = []
    if not isinstance(new_pg, torch.Tensor) or new_pg.shape != pg.shape:
        return [f"pg_loss came back as {_brief(new_pg)}"]
    problems += _finite("pg_loss", new_pg)
    if len(new_masks) != len(masks):
        problems.append(f"{len(new_masks)} masks for {len(masks)} samples")
    for i, (new, old) in enumerate(zip(new_masks, masks)):
        if new.shape != old.shape:
            problems.append(f"mask {i} has shape {tuple(new.shape)}, expected {tuple(old.shape)}")
            continue
        problems += _binary(f"modified mask {i}", new)
        old_in = old.double() > 0  # the documented reading of a mask value (NaN and negatives are out)
        if bool(((new.double() != 0) & ~old_in).any()):
            problems.append(f"modified mask {i} adds a token outside the loss mask")
    if not problems and new_masks:  # CP = 1: the local layout is the concatenation of the samples
        was_in = torch.cat([m.double() for m in masks]) > 0
        dropped = was_in & (torch.cat([m.double() for m in new_masks]) == 0)
        if dropped.shape == new_pg.shape and bool((new_pg[dropped] != 0).any()):
            problems.append("pg_loss nonzero on a loss token the modified masks reject")
    for name, value in metrics.items():
        if tuple(value.shape) != tuple(pg.shape):
            problems.append(f"metric {name} has shape {tuple(value.shape)}")
        problems += _finite(f"metric {name}", value)
    return problems


@st.composite
def host_cases(draw, entry: str) -> Case:
    import megatron_mis

    fn = getattr(megatron_mis, entry)
    cfg = draw(mis_configs(global_scope=False))
    if draw(st.integers(0, 3)) == 0:  # weights and masks only (no metrics) in a quarter of the cases
        cfg = cfg.replace(mis_metrics="none")
    n = draw(st.integers(0, 4))
    resp = [draw(st.integers(0, 5)) for _ in range(n)]
    prompt = [draw(st.integers(1, 3)) for _ in range(n)]
    total = [p + r for p, r in zip(prompt, resp)]
    train = [_tensor(draw(st.lists(any_logprob, min_size=r, max_size=r))) for r in resp]
    rollout = [_tensor(draw(st.lists(any_logprob, min_size=r, max_size=r))) for r in resp]
    masks = [_tensor(draw(st.lists(st.sampled_from([0.0, 1.0, 1.0]), min_size=r, max_size=r))) for r in resp]
    if draw(st.booleans()):
        masks = [m.to(torch.int64) for m in masks]
    pg = _tensor(draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=sum(resp), max_size=sum(resp))))
    args: Any = _host_args(cfg)
    pg_arg: Any = pg
    kw: dict[str, Any] = dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    if entry == "compute_mis_weights_with_cp":
        kw.update(total_lengths=total, response_lengths=resp)
    nonfinite = any(bool((~(torch.isfinite(a) & torch.isfinite(b)) & (m != 0)).any()) for a, b, m in zip(train, rollout, masks))
    expect, names = "ok", ()
    if cfg.nonfinite_policy == "error" and nonfinite:
        expect, names = "error", ("nan or inf", "non-finite", "nonfinite")
    label = f"cfg={_cfg_label(cfg)} resp={resp} total={total} train={[x.tolist() for x in train]} rollout={[x.tolist() for x in rollout]} masks={[m.tolist() for m in masks]}"
    prior = names if expect == "error" else ()
    corruptions = ["none"] * 5 + ["mask_values", "args", "pg_loss", "none_entry", "flat_tensor"]
    if entry == "compute_mis_weights_with_cp":
        corruptions += ["total_lengths", "cp_layout", "response_lengths"]
    corruption = draw(st.sampled_from(corruptions))
    if corruption == "mask_values" and sum(resp):
        i = next(i for i, r in enumerate(resp) if r)
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf, 2.0, -1.0, 0.5, 255.0]))
        bad_masks = [m.clone().double() for m in masks]
        bad_masks[i][0] = value
        kw["loss_masks"] = bad_masks
        # a loss mask is 0 / 1 (DESIGN section 2); others may be refused or read as in / out
        # (value > 0), but what comes back must be 0 / 1 and no NaN may reach the host's loss.
        # NaN / inf: an error under nonfinite_policy 'error' (it may sync). The new value may move
        # a non-finite token in or out of the loss, so that expectation is recomputed.
        strict = not math.isfinite(value) and cfg.nonfinite_policy == "error"
        bad_in_loss = any(_nonfinite_in_loss(a, b, m) for a, b, m in zip(train, rollout, bad_masks))
        if strict or (cfg.nonfinite_policy == "error" and bad_in_loss):
            expect, names = "error", ("loss_mask", "nan or inf", "non-finite", "nonfinite")
        else:
            expect, names = "either", ("loss_mask",)
        label = f"loss_masks[{i}][0]={value} " + label
    elif corruption == "args":
        args = draw(st.sampled_from([cfg.to_dict(), None, "mis.yaml", 5]))
        expect, names = "error", ("args",) + prior
        label = f"args={_brief(args, 60)} " + label
    elif corruption == "pg_loss":
        bad = draw(st.sampled_from(["short", "list", "2d", "none"]))
        pg_arg = {"short": torch.cat([pg, pg.new_zeros(1)]), "list": pg.tolist(), "2d": pg.reshape(1, -1), "none": None}[bad]
        expect, names = "error", ("pg_loss",) + prior
        label = f"pg_loss {bad} " + label
    elif corruption == "none_entry" and n:
        which = draw(st.sampled_from(["rollout_log_probs", "loss_masks"] + (["train_log_probs"] if n else [])))
        lst = list(kw[which])
        lst[draw(st.integers(0, n - 1))] = None
        kw[which] = lst
        expect, names = "error", (which, which.rstrip("s")) + prior
        label = f"{which} with a None entry " + label
    elif corruption == "flat_tensor" and n:
        which = draw(st.sampled_from(["rollout_log_probs", "loss_masks", "train_log_probs"]))
        kw[which] = torch.cat([x.double() for x in kw[which]])
        expect, names = "error", (which, which.rstrip("s")) + prior
        label = f"{which} as one flat tensor " + label
    elif corruption == "total_lengths" and n:
        bad = draw(st.sampled_from(["fraction", "string", "short", "less"]))
        tl = {"fraction": [x + 0.7 for x in total], "string": "".join(str(x) for x in total), "short": total[:-1],
              "less": [r - 1 if r else -1 for r in resp]}[bad]
        kw["total_lengths"] = tl
        expect, names = "error", ("total_lengths", "total_length") + prior
        label = f"total_lengths={tl!r} " + label
    elif corruption == "response_lengths" and n:
        bad = [r + 1 for r in resp]
        kw["response_lengths"] = bad
        expect, names = "error", ("response_length", "values") + prior
        label = f"response_lengths={bad} " + label
    elif corruption == "cp_layout":
        bad = draw(st.sampled_from(["foo", 5, "THD "]))
        kw["cp_layout"] = bad
        expect, names = "error", ("cp_layout",) + prior
        label = f"cp_layout={bad!r} " + label

    def call():
        return fn(args, pg_loss=pg_arg, **kw)

    def check(out):
        return _check_host(out, [m if isinstance(m, torch.Tensor) else torch.zeros(0) for m in kw["loss_masks"]], pg)

    return Case(entry, label, call, expect, names, check)


# ===================================================================== RL loss and registries
@st.composite
def loss_configs(draw):
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.kl import KL_ESTIMATORS
    from megatron_mis.core.losses import POLICY_LOSSES

    kw = dict(
        policy_loss=draw(st.sampled_from(POLICY_LOSSES.names())),
        eps_clip=draw(st.sampled_from([0.0, 0.2, 1.0])),
        eps_clip_high=draw(st.sampled_from([None, 0.28, 5.0])),
        eps_clip_c=draw(st.sampled_from([None, 3.0])),
        use_kl_loss=draw(st.booleans()),
        kl_loss_coef=draw(st.sampled_from([0.0, 0.01, 1.0])),
        kl_loss_type=draw(st.sampled_from(KL_ESTIMATORS.names())),
        use_unbiased_kl=draw(st.booleans()),
        entropy_coef=draw(st.sampled_from([0.0, 0.01])),
        use_opsm=draw(st.booleans()),
        loss_aggregation=draw(st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])),
        rejected_in_denominator=draw(st.booleans()),
        nonfinite_input_policy=draw(st.sampled_from(["neutralize", "error"])),
        ratio_log_bound=draw(st.sampled_from([1.0, 20.0, 80.0])),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LossConfig(**kw)


@st.composite
def rl_loss_cases(draw) -> Case:
    from megatron_mis.core.aggregation import Denominators
    from megatron_mis.core.losses import POLICY_LOSSES, compute_rl_loss

    cfg = draw(loss_configs())
    lengths = draw(packed_lengths())
    t = sum(lengths)
    policy = POLICY_LOSSES.get(cfg.policy_loss)

    def vec(strategy):
        return _tensor(draw(st.lists(strategy, min_size=t, max_size=t)))

    lp = vec(any_logprob).requires_grad_(True)
    old = vec(any_logprob)
    rollout = vec(any_logprob)
    ref = vec(any_logprob)
    adv = vec(st.one_of(st.floats(-10, 10, width=32), st.sampled_from([0.0, 1e30, -1e30, F32_MAX] + NONFINITE)))
    ent = vec(st.one_of(st.floats(0, 10, width=32), st.sampled_from([0.0, 1e30, math.nan])))
    w = vec(st.one_of(st.floats(0, 5, width=32), st.sampled_from([0.0, 4.9e8])))
    mask = vec(st.sampled_from([0.0, 1.0, 1.0]))
    keep = vec(st.sampled_from([0.0, 1.0, 1.0])).bool()
    cu = torch.tensor(_cu(lengths))
    den = Denominators(num_tokens=max(1.0, float(mask.sum())), num_sequences=max(1.0, float(len(lengths))))
    kw: dict[str, Any] = dict(old_log_probs=old, rollout_log_probs=rollout, keep_mask=keep)
    if cfg.kl_active:
        kw["ref_log_probs"] = ref
    if cfg.entropy_coef > 0 or draw(st.booleans()):
        kw["entropy"] = ent
    if policy.uses_is_weights:
        kw["is_weights"] = w
    inputs = [lp.detach(), adv] + [v for k, v in kw.items() if k not in ("keep_mask",) and v is not None and
                                   (k != "old_log_probs" or policy.old_policy != "rollout") and
                                   (k != "rollout_log_probs" or policy.old_policy == "rollout")]
    nonfinite = any(bool((~torch.isfinite(x) & (mask != 0)).any()) for x in inputs)
    expect, names = "ok", ()
    if cfg.nonfinite_input_policy == "error" and nonfinite:
        expect, names = "error", ("non-finite",)
    elif bool(((adv.abs() >= 1e30) & torch.isfinite(adv) & (mask != 0)).any()) or _product_may_overflow(
        adv, w if policy.uses_is_weights else None, mask, _largest_log_factor(policy, lp, mask, cfg.ratio_log_bound)
    ):
        # ratio (up to e^ratio_log_bound; REINFORCE: |log pi|) x IS weight x A may not fit float32:
        # a finite loss, or an error naming the advantages and the IS weights (compute_rl_loss
        # checks the terms).
        expect, names = "either", ("advantages",)
    label = (f"cfg={cfg.to_dict()} lengths={lengths} log_probs={lp.tolist()} adv={adv.tolist()} old={old.tolist()} "
             f"rollout={rollout.tolist()} mask={mask.tolist()}")
    args: list[Any] = [lp, adv, mask, cu, cfg, den]
    prior = names if expect == "error" else ()
    corruption = draw(st.sampled_from(["none"] * 5 + ["cu_seqlens", "shape", "config", "denominators"]))
    if corruption == "cu_seqlens":
        bad = draw(st.sampled_from([_cu(lengths), None, torch.tensor([0.5, float(t)]), torch.tensor([0, t + 1]),
                                    torch.tensor([[0, t]]), "0,4"]))
        args[3] = bad
        expect, names = "error", ("cu_seqlens",) + prior
        label = f"cu_seqlens={bad!r} " + label
    elif corruption == "shape":
        which = draw(st.sampled_from(["advantages", "loss_mask", "old_log_probs"]))
        bad_t = torch.zeros(t + 1)
        if which == "advantages":
            args[1] = bad_t
        elif which == "loss_mask":
            args[2] = bad_t
        else:
            kw["old_log_probs"] = bad_t
        expect, names = "error", (which,) + prior
        label = f"{which} of length {t + 1} " + label
    elif corruption == "config":
        bad = draw(st.sampled_from([None, {"policy_loss": "ppo"}, "ppo"]))
        args[4] = bad
        expect, names = "error", ("config",) + prior
        label = f"config={bad!r} " + label
    elif corruption == "denominators":
        bad = draw(st.sampled_from([None, 5, (1.0, 1.0)]))
        args[5] = bad
        expect, names = "error", ("denominators",) + prior
        label = f"denominators={bad!r} " + label

    def call():
        out = compute_rl_loss(*args, **kw)
        if out.loss.requires_grad:
            out.loss.backward()
        return out

    def check(out):
        problems = _finite("loss", out.loss.detach())
        for group in (out.shares, out.token_sums, out.counts):
            for k, v in group.items():
                problems += _finite(k, v.detach() if isinstance(v, torch.Tensor) else v)
        if lp.grad is not None:
            problems += _finite("grad of log_probs", lp.grad)
        if bool((out.pg_mask & ~(mask != 0)).any()) or bool((out.valid_mask & ~(mask != 0)).any()):
            problems.append("pg_mask / valid_mask outside the loss mask")
        return problems

    return Case("compute_rl_loss", label, call, expect, names, check)


@st.composite
def registry_cases(draw) -> Case:
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.advantages import ADVANTAGE_ESTIMATORS
    from megatron_mis.core.kl import KL_ESTIMATORS
    from megatron_mis.core.losses import POLICY_LOSSES

    registry, key = draw(st.sampled_from([(POLICY_LOSSES, "policy_loss"), (KL_ESTIMATORS, "kl_loss_type"),
                                          (ADVANTAGE_ESTIMATORS, "advantage_estimator")]))
    name = draw(st.one_of(st.sampled_from(registry.names()), st.text(max_size=12), st.sampled_from([None, 5, ["ppo"], ("k3",)])))
    valid = isinstance(name, str) and name in registry.names()
    via = draw(st.sampled_from(["registry", "config"]))
    if via == "registry":
        def call():
            return registry.get(name)
        names = (repr(name)[:20], "valid") if isinstance(name, str) and name else ("valid",)
    else:
        def call():
            return LossConfig(**{key: name})
        names = (key,)
    return Case("policy-loss registry", f"{via} {key}={name!r}", call, "ok" if valid else "error", names,
                lambda out: [] if out is not None else ["returned None"])


@st.composite
def advantage_cases(draw) -> Case:
    from megatron_mis.core.advantages import compute_advantages

    g = draw(st.integers(1, 4))
    groups = draw(st.integers(0, 3))
    n = g * groups
    rewards = _tensor(draw(st.lists(st.one_of(st.floats(-10, 10, width=32), st.sampled_from([0.0, 1e30, -1e30, F32_MAX, -F32_MAX, 3e38]),
                                              st.sampled_from(NONFINITE)), min_size=n, max_size=n)))
    estimator = draw(st.sampled_from(["grpo", "rloo", "reinforce_baseline"]))
    policy = draw(st.sampled_from(["neutralize", "error"]))
    kw: dict[str, Any] = dict(estimator=estimator, nonfinite_policy=policy,
                              grpo_std_normalization=draw(st.booleans()), grpo_std_eps=draw(st.sampled_from([1e-6, 1.0])))
    if draw(st.booleans()):
        kw["group_size"] = g
    else:
        kw["group_ids"] = torch.arange(n) // g
    expect, names = "ok", ()
    finite = rewards[torch.isfinite(rewards)].double()
    if policy == "error" and not bool(torch.isfinite(rewards).all()):
        expect, names = "error", ("non-finite",)
    elif finite.numel() and float(finite.max() - finite.min()) > F32_MAX:
        # a spread beyond float32's range: r - baseline may not fit the float32 advantages
        expect, names = "either", ("rewards",)
    label = f"rewards={rewards.tolist()} {({k: v for k, v in kw.items() if k != 'group_ids'})}"
    prior = names if expect == "error" else ()
    corruption = draw(st.sampled_from(["none"] * 4 + ["group_size", "estimator", "rewards", "group_ids", "valid"]))
    arg: Any = rewards
    if corruption == "group_size":
        bad = draw(st.sampled_from([0, -1, 2.5, True, "2"] + ([n + 1] if n else [])))
        kw.pop("group_ids", None)
        kw["group_size"] = bad
        expect, names = "error", ("group_size",) + prior
        label = f"group_size={bad!r} " + label
    elif corruption == "estimator":
        kw["estimator"] = draw(st.sampled_from(["nope", "", None, 3]))
        expect, names = "error", ("estimator",) + prior
        label = f"estimator={kw['estimator']!r} " + label
    elif corruption == "rewards":
        arg = draw(st.sampled_from([rewards.tolist(), rewards.reshape(1, -1) if n else torch.zeros(2, 2), None]))
        expect, names = "error", ("rewards",) + prior
        label = f"rewards={_brief(arg, 40)} " + label
    elif corruption == "group_ids":
        kw.pop("group_size", None)
        kw["group_ids"] = draw(st.sampled_from([torch.zeros(n + 1, dtype=torch.long), torch.zeros(n), list(range(n))]))
        expect, names = "error", ("group_ids",) + prior
        label = f"group_ids={_brief(kw['group_ids'], 40)} " + label
    elif corruption == "valid":
        kw["valid"] = draw(st.sampled_from([torch.ones(n + 1, dtype=torch.bool), [True] * n]))
        expect, names = "error", ("valid",) + prior
        label = f"valid={_brief(kw['valid'], 40)} " + label

    def call():
        return compute_advantages(arg, **kw)

    def check(res):
        problems = _finite("advantages", res.advantages)
        if tuple(res.advantages.shape) != (n,):
            problems.append(f"advantages shape {tuple(res.advantages.shape)}")
        valid = kw.get("valid")
        if not problems and isinstance(valid, torch.Tensor) is False and "group_ids" not in kw:
            problems += _spread_kept(rewards, res.advantages, g, kw["estimator"])
        return problems

    return Case("compute_advantages", label, call, expect, names, check)


def _spread_kept(rewards: torch.Tensor, adv: torch.Tensor, g: int, estimator: str) -> list[str]:
    """A group (the whole batch for reinforce_baseline) of finite rewards that clearly differ must
    not come back with all-zero advantages (an overflowed mean or std does that)."""
    size = rewards.numel() if estimator == "reinforce_baseline" else g
    if size < 2 or not bool(torch.isfinite(rewards).all()):
        return []
    r64 = rewards.double().reshape(-1, size)
    a = adv.double().reshape(-1, size)
    for i in range(r64.shape[0]):
        spread = float(r64[i].max() - r64[i].min())
        scale = float(r64[i].abs().max())
        if spread > 1e-3 * scale and spread > 1e-20 and bool((a[i] == 0).all()):
            return [f"group {i} rewards {r64[i].tolist()} differ but every advantage is 0"]
    return []


@st.composite
def kl_cases(draw) -> Case:
    from megatron_mis.core.kl import KL_ESTIMATORS, kl_estimate

    t = draw(st.integers(0, 6))
    lp = _tensor(draw(st.lists(finite_logprob, min_size=t, max_size=t))).requires_grad_(True)
    ref = _tensor(draw(st.lists(finite_logprob, min_size=t, max_size=t)))
    old = _tensor(draw(st.lists(finite_logprob, min_size=t, max_size=t)))
    kind = draw(st.sampled_from(KL_ESTIMATORS.names()))
    unbiased = draw(st.booleans())
    bound = draw(st.sampled_from([1.0, 20.0, 80.0]))
    kw: dict[str, Any] = dict(old_log_probs=old if unbiased or draw(st.booleans()) else None, unbiased=unbiased, log_ratio_bound=bound)
    expect, names = "ok", ()
    label = f"kind={kind} log_probs={lp.tolist()} ref={ref.tolist()} old={old.tolist()} unbiased={unbiased} bound={bound}"
    corruption = draw(st.sampled_from(["none"] * 4 + ["bound", "kind", "shape", "old"]))
    ref_arg: Any = ref
    if corruption == "bound":
        kw["log_ratio_bound"] = draw(st.sampled_from([math.nan, -1.0, 0.0, math.inf, "20", None, 1e6]))
        # no documented range: a large bound may be taken, but then the result must stay finite
        expect, names = ("either" if kw["log_ratio_bound"] == 1e6 else "error"), ("log_ratio_bound",)
        label = f"log_ratio_bound={kw['log_ratio_bound']!r} " + label
    elif corruption == "kind":
        kind = draw(st.sampled_from(["k4", "", None, 3]))
        expect, names = "error", ("kind", "kl estimator", "valid")
        label = f"kind={kind!r} " + label
    elif corruption == "shape":
        ref_arg = draw(st.sampled_from([torch.zeros(t + 1), ref.tolist(), None]))
        expect, names = "error", ("ref_log_probs",)
        label = f"ref_log_probs={_brief(ref_arg, 40)} " + label
    elif corruption == "old" and unbiased:
        kw["old_log_probs"] = draw(st.sampled_from([None, torch.zeros(t + 1)]))
        expect, names = "error", ("old_log_probs",)
        label = f"old_log_probs={_brief(kw['old_log_probs'], 40)} " + label

    def call():
        out = kl_estimate(lp, ref_arg, kind, **kw)
        out.sum().backward()
        return out

    def check(out):
        problems = _finite("kl", out.detach()) + _finite("grad", lp.grad if lp.grad is not None else torch.zeros(0))
        if kind in ("k2", "k3") and not unbiased and bool((out < -1e-6).any()):
            problems.append(f"{kind} negative: {float(out.min())}")
        if kind == "low_var_kl" and not unbiased and bool((out.abs() > 10 + 1e-6).any()):
            problems.append("low_var_kl outside [-10, 10]")
        return problems

    return Case("kl_estimate", label, call, expect, names, check)


@st.composite
def routing_cases(draw) -> Case:
    from megatron_mis.routing.sglang import decode_routed_experts

    num_tokens = draw(st.integers(1, 6))
    start = draw(st.integers(0, num_tokens - 1))
    layers = draw(st.integers(1, 3))
    experts = draw(st.sampled_from([1, 4, 8, 300]))
    topk = draw(st.integers(1, min(experts, 3)))
    rows = num_tokens - 1 - start
    ids = np.array(draw(st.lists(st.integers(0, experts - 1), min_size=rows * layers * topk, max_size=rows * layers * topk)))
    wire = draw(st.sampled_from([None, "int32", "uint16", "uint8"] if experts <= 256 else [None, "int32", "uint16"]))
    dtype = np.dtype("<i4") if wire in (None, "int32") else np.dtype("<u2" if wire == "uint16" else "u1")
    payload: Any = base64.b64encode(ids.astype(dtype).tobytes()).decode()
    meta: Any = {"routed_experts": payload}
    if wire is not None:
        meta["routed_experts_dtype"] = wire
    kw = dict(num_tokens=num_tokens, num_layers=layers, topk=topk, num_experts=experts, start_len=start)
    expect, names = "ok", ()
    label = f"ids={ids.tolist()} wire={wire} {kw}"
    corruption = draw(st.sampled_from(["none"] * 4 + ["meta", "payload", "ints", "ids", "dtype"]))
    if corruption == "meta":
        meta = draw(st.sampled_from([None, [payload], payload, {}, {"routed_experts": None}]))
        expect, names = "error", ("meta_info", "routed_experts")
        label = f"meta_info={_brief(meta, 40)} " + label
    elif corruption == "payload":
        bad = draw(st.sampled_from(["!!!", payload + "A", "", 5, [[1.5]], {"a": 1}, payload[:-4] if len(payload) > 4 else "AA=="]))
        meta = dict(meta, routed_experts=bad)
        expect, names = ("ok", ()) if bad == "" and rows == 0 else ("error", ("routed_experts",))
        label = f"routed_experts={_brief(bad, 40)} " + label
    elif corruption == "ints":
        which = draw(st.sampled_from(list(kw)))
        bad = draw(st.sampled_from([0, -1, True, 2.0, "3", None, 2**70]))
        kw = dict(kw, **{which: bad})
        expect, names = "error", (which,)
        if which == "start_len" and bad == 0:
            # a valid start, but the payload was encoded for the drawn one: ok only if unchanged
            expect, names = ("ok", ()) if start == 0 else ("error", ("routed_experts", "start_len"))
        elif bad == 2**70 and which != "start_len":
            expect, names = "either", (which, "routed_experts")
        label = f"{which}={bad!r} " + label
    elif corruption == "ids" and rows:
        bad_ids = ids.copy()
        bad_ids[0] = draw(st.sampled_from([experts, -1, 2**31 - 1]))
        if wire in ("uint8", "uint16") and bad_ids[0] < 0:
            bad_ids[0] = experts
        meta = dict(meta, routed_experts=base64.b64encode(bad_ids.astype(dtype).tobytes()).decode())
        expect, names = "error", ("expert", "num_experts")
        label = f"expert id {bad_ids[0]} " + label
    elif corruption == "dtype":
        meta = dict(meta, routed_experts_dtype=draw(st.sampled_from(["float32", "int64", 5, ""])))
        expect, names = "error", ("routed_experts_dtype",)
        label = f"routed_experts_dtype={meta['routed_experts_dtype']!r} " + label

    def call():
        return decode_routed_experts(meta, **kw)

    def check(out):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, layers, topk):
            return [f"returned {_brief(out, 60)}, expected shape {(rows, layers, topk)}"]
        if out.numel() and (int(out.long().min()) < 0 or int(out.long().max()) >= experts):
            return [f"expert ids outside [0, {experts})"]
        if not torch.equal(out.long().flatten(), torch.as_tensor(ids, dtype=torch.long)):
            return ["decoded ids differ from the encoded ones"]
        return []

    return Case("decode_routed_experts", label, call, expect, names, check)


# ============================================================================ configs and files
#: Per MIS key: values that are valid alone, and values that are invalid whatever the other keys.
VALID_VALUES: dict[str, list[Any]] = {
    "use_tis": [True, False], "use_rs": [True, False],
    "tis_level": ["token", "sequence", "geometric"], "rs_level": ["token", "sequence", "geometric"],
    "tis_mode": ["truncate", "clip", "mask"], "tis_lower_bound": [None, 0.1, 0.5],
    "tis_upper_bound": [1.5, 2, "1e1", 3.0], "rs_lower_bound": [None, 0.2], "rs_upper_bound": [None, 4.0],
    "rs_veto_threshold": [None, 1e-4, "1e-4"], "tis_batch_normalize": [False],
    "tis_batch_normalize_scope": ["micro_batch"], "log_ratio_bound": [20.0, 80, 1e-3, "5"],
    "nonfinite_policy": ["neutralize", "reject", "error"], "prob_veto_threshold": [None, 0.5],
    "prob_veto_source": ["rollout", "train"],
}
_BAD_NUMBERS = [True, False, math.nan, math.inf, -math.inf, "nan", "inf", "abc", " 2", "1_0", 10**400, [1.0], {"a": 1}, -1.0, 0.0]
INVALID_VALUES: dict[str, list[Any]] = {
    "use_tis": ["yes", 1, 0, None, "true", 1.0], "use_rs": ["no", 1, None],
    "tis_level": ["tokens", "", None, 1, True], "rs_level": ["seq", None],
    "tis_mode": ["trunc", None, 0], "tis_lower_bound": _BAD_NUMBERS,
    "tis_upper_bound": _BAD_NUMBERS + [None], "rs_lower_bound": _BAD_NUMBERS, "rs_upper_bound": _BAD_NUMBERS,
    "rs_veto_threshold": _BAD_NUMBERS + [1.0, 1.5], "tis_batch_normalize": ["true", 1, None],
    "tis_batch_normalize_scope": ["global_batch", None], "log_ratio_bound": _BAD_NUMBERS + [80.5, 1e3, None],
    "nonfinite_policy": ["ignore", None, True], "prob_veto_threshold": _BAD_NUMBERS + [1.0],
    "prob_veto_source": ["old", None],
}


def _check_config(cfg: Any) -> list[str]:
    """An accepted MISConfig holds well-typed, finite, in-range values."""
    if not isinstance(cfg, MISConfig):
        return [f"returned {type(cfg).__name__}"]
    problems = []
    for name in ("use_tis", "use_rs", "tis_batch_normalize"):
        if not isinstance(getattr(cfg, name), bool):
            problems.append(f"{name}={getattr(cfg, name)!r} is not a bool")
    for name in ("tis_lower_bound", "tis_upper_bound", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold",
                 "prob_veto_threshold", "log_ratio_bound"):
        v = getattr(cfg, name)
        if v is None:
            continue
        if type(v) is not float or not math.isfinite(v) or v <= 0:
            problems.append(f"{name}={v!r} accepted")
        elif name.endswith("_bound") and name != "log_ratio_bound" and not 1 / F32_MAX <= v <= F32_MAX:
            problems.append(f"{name}={v!r} accepted (float32 cannot hold it or its reciprocal)")
    if not cfg.log_ratio_bound <= 80:
        problems.append(f"log_ratio_bound={cfg.log_ratio_bound}")
    for name in ("rs_veto_threshold", "prob_veto_threshold"):
        v = getattr(cfg, name)
        if v is not None and not v < 1:
            problems.append(f"{name}={v}")
    if cfg.use_rs and not cfg.rs_lower < cfg.rs_upper:
        problems.append(f"RS bounds [{cfg.rs_lower}, {cfg.rs_upper}] accepted with use_rs")
    if cfg.use_tis and cfg.tis_mode != "truncate" and not cfg.tis_lower < cfg.tis_upper_bound:
        problems.append(f"IS bounds [{cfg.tis_lower}, {cfg.tis_upper_bound}] accepted")
    return problems


@st.composite
def config_dicts(draw) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """A mapping of MIS keys, and what it must give: ``ok``, ``error`` (naming ``names``) or ``either``."""
    keys = draw(st.lists(st.sampled_from(sorted(VALID_VALUES)), unique=True, max_size=6))
    data = {k: draw(st.sampled_from(VALID_VALUES[k])) for k in keys}
    kind = draw(st.sampled_from(["valid", "bad_value", "bad_value", "unknown_key", "random"]))
    if kind == "bad_value":
        key = draw(st.sampled_from(sorted(INVALID_VALUES)))
        data[key] = draw(st.sampled_from(INVALID_VALUES[key]))
        return data, "error", (key,)
    if kind == "unknown_key":
        key = draw(st.sampled_from(["tis_levle", "use_tiss", "lr", "TIS_MODE", "", "rs veto", 5]))
        data[key] = 1
        return data, "error", (str(key) if key != "" else "''",)
    if kind == "random":
        key = draw(st.sampled_from(sorted(VALID_VALUES)))
        data[key] = draw(st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(),
                                   st.text(max_size=6), st.lists(st.integers(), max_size=2)))
        return data, "either", tuple(data)
    return data, "ok", ()  # every combination of VALID_VALUES is valid


@st.composite
def config_cases(draw) -> Case:
    data, expect, names = draw(config_dicts())
    via = draw(st.sampled_from(["MISConfig", "from_dict", "from_namespace"]))
    if via == "from_namespace" and any(not isinstance(k, str) or not k.isidentifier() for k in data):
        via = "from_dict"
    if via == "MISConfig":
        if any(k not in VALID_VALUES for k in data):
            call = lambda: MISConfig(**{str(k): v for k, v in data.items()})  # noqa: E731
        else:
            call = lambda: MISConfig(**data)  # noqa: E731
    elif via == "from_dict":
        call = lambda: MISConfig.from_dict(data)  # noqa: E731
    else:
        ns = argparse.Namespace(**data, custom_config_path=None)
        call = lambda: MISConfig.from_host_args(ns)  # noqa: E731
        if expect == "error" and names and names[0] not in VALID_VALUES:
            expect = "ok"  # a namespace carries the host's own keys too: unknown attributes are not ours
        elif expect == "error" and data.get(names[0], 0) is None:
            expect = "ok"  # documented: a None attribute (an unset argparse option) takes the default
    return Case("MISConfig", f"{via}({_brief(data, 300)})", call, expect, names, _check_config)


# --------------------------------------------------------------------------- bad and good files
def _dup_yaml(data: dict[str, Any], key: str) -> str:
    import yaml

    text = yaml.safe_dump(data, sort_keys=False) if data else ""
    return text + f"{key}: {json.dumps(VALID_VALUES[key][0])}\n"


FILE = "<the file's path>"  # placeholder in names: replaced by the case's path


@st.composite
def yaml_files(draw) -> tuple[bytes | None, str, tuple[str, ...]]:
    """``(content or None for a directory / missing file, expect, names)``; the file's path is
    always an acceptable name for an error about the file."""
    import yaml

    data, expect, names = draw(config_dicts())
    kind = draw(st.sampled_from(["mapping"] * 4 + ["duplicate", "not_utf8", "deep", "digits", "not_mapping", "empty",
                                                 "comments", "garbage", "directory", "missing", "tag"]))
    if kind == "mapping":
        try:
            text = yaml.safe_dump(data, sort_keys=False) if data else "{}\n"
        except (yaml.YAMLError, ValueError):
            text = "{}\n"
            expect, names = "ok", ()
        return text.encode(), expect, names
    if kind == "duplicate":
        key = draw(st.sampled_from(sorted(VALID_VALUES)))
        base = {k: v for k, v in data.items() if isinstance(v, (bool, str, type(None))) or type(v) in (int, float)}
        base.setdefault(key, VALID_VALUES[key][0])
        return _dup_yaml(base, key).encode(), "error", (FILE,)
    if kind == "not_utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\x80abc"]))
        return b"use_tis: " + junk + b"\n", "error", (FILE,)
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1000, 5000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b"{a: ", b"}")]))
        return b"use_tis: " + opener * depth + closer * depth + b"\n", "error", (FILE,)
    if kind == "digits":
        digits = draw(st.sampled_from([40, 400, 5000]))
        key = draw(st.sampled_from(["tis_upper_bound", "log_ratio_bound", "rs_veto_threshold"]))
        return f"{key}: {'9' * digits}\n".encode(), "error", (FILE,)
    if kind == "not_mapping":
        return draw(st.sampled_from([b"- use_tis\n", b"42\n", b"use_tis\n", b"'text'\n", b"[1, 2]\n"])), "error", (FILE,)
    if kind == "empty":
        return draw(st.sampled_from([b"", b"\n\n", b"---\n"])), "error", (FILE,)
    if kind == "comments":
        return b"# use_tis: true\n", "error", (FILE,)
    if kind == "garbage":
        blob = draw(st.binary(min_size=1, max_size=40))
        return blob, "either", (FILE,)
    if kind == "tag":
        return b"use_tis: !!python/object/apply:os.system ['true']\n", "error", (FILE,)
    return None, "error", (FILE,)


def _write_case_file(content: bytes | None, kind_hint: str, suffix: str = ".yaml") -> tuple[str, Callable[[], None]]:
    tmp = tempfile.mkdtemp(prefix="mis_fuzz_")
    path = os.path.join(tmp, "cfg" + suffix)
    if content is None:
        if kind_hint == "directory":
            os.mkdir(path)

    else:
        with open(path, "wb") as fh:
            fh.write(content)

    def cleanup():
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)

    return path, cleanup


@st.composite
def from_yaml_cases(draw) -> Case:
    content, expect, names = draw(yaml_files())
    hint = draw(st.sampled_from(["directory", "missing"])) if content is None else ""
    path, cleanup = _write_case_file(content, hint)
    label = f"{hint or 'file'} {(content or b'')[:120]!r}"

    def call():
        return MISConfig.from_yaml(path)

    def check(cfg):
        return _check_config(cfg)

    return Case("MISConfig.from_yaml", label, call, expect, _file_names(expect, names, path), check, [cleanup])


def _file_names(expect: str, names: tuple[str, ...], path: str) -> tuple[str, ...]:
    """A file-level error must name the file (``FILE``); a key-level error names the key."""
    return tuple(path if n == FILE else n for n in names) if names else (path,)


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    from megatron_mis.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


class CliFailure(Exception):
    """The CLI exited non-zero with something other than a clear status-2 message."""


def _cli_call(argv: list[str], path: str) -> Callable[[], tuple[str, str]]:
    def call():
        try:
            rc, out, err = _run_cli(argv)
        except Exception as exc:  # a traceback escaping the CLI is never a clear error
            raise CliFailure(f"raised {type(exc).__name__}: {exc}") from exc
        if rc == 2 and err.startswith("error:"):
            raise ValueError(err)  # a clear refusal: classified by the names it contains
        if rc != 0:
            raise CliFailure(f"exit {rc}: {err[-400:]}")
        return out, err

    return call


@st.composite
def validate_cases(draw) -> Case:
    content, expect, names = draw(yaml_files())
    hint = draw(st.sampled_from(["directory", "missing"])) if content is None else ""
    path, cleanup = _write_case_file(content, hint)
    label = f"{hint or 'file'} {(content or b'')[:120]!r}"

    def check(result):
        out, _ = result
        return [] if out.startswith(f"# {path}: valid") else [f"exit 0 but printed {out[:80]!r}"]

    return Case("cli validate", label, _cli_call(["validate", path], path), expect,
                _file_names(expect, names, path), check, [cleanup])


def _strict_json(text: str) -> Any:
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@st.composite
def analyze_cases(draw) -> Case:
    kind = draw(st.sampled_from(["jsonl"] * 4 + ["pt"] * 2 + ["jsonl_bad"] * 3 + ["pt_bad", "bytes"]))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 5))
        row: dict[str, Any] = {
            "rollout_log_probs": draw(st.lists(any_logprob, min_size=n, max_size=n)),
            "train_log_probs": draw(st.lists(any_logprob, min_size=n, max_size=n)),
        }
        if draw(st.booleans()):
            row["loss_mask"] = draw(st.lists(st.sampled_from([0, 1, 1]), min_size=n, max_size=n))
        rows.append(row)
    expect = "ok"
    suffix = ".jsonl"
    if kind == "jsonl":
        content = "\n".join(json.dumps(r) for r in rows).encode() + b"\n"
    elif kind == "jsonl_bad":
        bad = draw(st.sampled_from(["not_object", "wrong_type", "length", "missing", "not_json", "empty", "not_utf8", "nested"]))
        if bad == "not_object":
            content = draw(st.sampled_from([b"[1, 2]\n", b"3\n", b'"x"\n', b"null\n"]))
        elif bad == "wrong_type":
            value = draw(st.sampled_from(["abc", {"a": 1}, [[1.0]], [None], None, 5, [True], ["1.0"]]))
            content = (json.dumps(dict(rows[0], train_log_probs=value)) + "\n").encode()
        elif bad == "length":
            content = (json.dumps(dict(rows[0], train_log_probs=rows[0]["train_log_probs"] + [0.0])) + "\n").encode()
        elif bad == "missing":
            content = (json.dumps({"rollout_log_probs": rows[0]["rollout_log_probs"]}) + "\n").encode()
        elif bad == "not_json":
            content = b"{rollout_log_probs: [1]\n"
        elif bad == "empty":
            content = b""
        elif bad == "not_utf8":
            content = b'{"rollout_log_probs": [\xff]}\n'
        else:
            content = (json.dumps(dict(rows[0], loss_mask=[[1]] * len(rows[0]["train_log_probs"]))) + "\n").encode()
        # an empty JSONL has no samples: refusing it or reporting nothing are both defensible
        expect = ("either" if bad == "empty" else "error")
    elif kind == "pt":
        suffix = ".pt"
        buf = io.BytesIO()
        torch.save({"rollout_log_probs": [torch.tensor(r["rollout_log_probs"]) for r in rows],
                    "train_log_probs": [torch.tensor(r["train_log_probs"]) for r in rows]}, buf)
        content = buf.getvalue()
    elif kind == "pt_bad":
        suffix = ".pt"
        bad = draw(st.sampled_from(["garbage", "empty", "list", "scalar_entries", "strings"]))
        if bad == "garbage":
            content = b"not a torch file"
        elif bad == "empty":
            content = b""
        else:
            buf = io.BytesIO()
            payload = {"list": [1, 2], "scalar_entries": {"rollout_log_probs": [1.0], "train_log_probs": [1.0]},
                       "strings": {"rollout_log_probs": ["a"], "train_log_probs": ["b"]}}[bad]
            torch.save(payload, buf)
            content = buf.getvalue()
        expect = "error"
    else:
        content = draw(st.binary(max_size=60))
        suffix = draw(st.sampled_from([".jsonl", ".pt"]))
        expect = "either"
    path, cleanup = _write_case_file(content, "", suffix)
    label = f"{suffix} {content[:160]!r}"

    def check(result):
        out, _ = result
        try:
            report = _strict_json(out)
        except ValueError as exc:
            return [f"--json printed invalid JSON ({exc})"]
        problems = []
        for k, v in report.get("metrics", {}).items():
            if isinstance(v, float) and not math.isfinite(v):
                problems.append(f"metric {k}={v}")
        return problems

    return Case("cli analyze", label, _cli_call(["analyze", path, "--json"], path), expect, (path,), check, [cleanup])


# ============================================================================== the entry points
STRATEGIES: dict[str, Callable[[], st.SearchStrategy[Case]]] = {
    "MISConfig": config_cases,
    "MISConfig.from_yaml": from_yaml_cases,
    "cli validate": validate_cases,
    "cli analyze": analyze_cases,
    "compute_mis": engine_cases,
    "compute_mis_weights_fsdp": lambda: host_cases("compute_mis_weights_fsdp"),
    "compute_mis_weights_with_cp": lambda: host_cases("compute_mis_weights_with_cp"),
    "compute_rl_loss": rl_loss_cases,
    "policy-loss registry": registry_cases,
    "compute_advantages": advantage_cases,
    "kl_estimate": kl_cases,
    "decode_routed_experts": routing_cases,
}

#: Cases per entry point in the test run (about two minutes in all on two cores).
EXAMPLES = {
    "MISConfig": 150, "MISConfig.from_yaml": 60, "cli validate": 50, "cli analyze": 50, "compute_mis": 150,
    "compute_mis_weights_fsdp": 80, "compute_mis_weights_with_cp": 80, "compute_rl_loss": 100,
    "policy-loss registry": 60, "compute_advantages": 100, "kl_estimate": 100, "decode_routed_experts": 100,
}


def run_entry(entry: str, max_examples: int, *, derandomize: bool = True, on_case: Callable[[Case, str, str], None]) -> None:
    """Generate ``max_examples`` cases for ``entry`` and hand each classified one to ``on_case``
    (generation only: no shrinking, so a run's length is predictable)."""

    @settings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    @given(STRATEGIES[entry]())
    def run(case: Case) -> None:
        outcome, detail = classify(case)
        on_case(case, outcome, detail)

    run()


@pytest.mark.parametrize("entry", sorted(STRATEGIES))
def test_fuzz_public_api(entry):
    failures: dict[tuple[str, str], str] = {}

    def on_case(case: Case, outcome: str, detail: str) -> None:
        if outcome not in GOOD:
            failures.setdefault((outcome, detail.split("(")[0][:80]), f"{outcome}: {detail[:300]}\n      input: {case.label[:400]}")

    torch.set_num_threads(1)
    run_entry(entry, EXAMPLES[entry], on_case=on_case)
    assert not failures, f"{entry}: {len(failures)} kind(s) of failure:\n  " + "\n  ".join(list(failures.values())[:12])


def test_classifier_tells_the_classes_apart():
    """The classifier itself: each class from a hand-made case."""
    def ok():
        return 1

    def vague():
        raise ValueError("something went wrong")

    def named():
        raise ValueError("cu_seqlens[0] must be 0")

    def other():
        raise AttributeError("'list' object has no attribute 'dim'")

    def slow():
        threading.Event().wait(5)

    assert classify(Case("x", "", ok, "ok", check=lambda v: []))[0] == "correct"
    assert classify(Case("x", "", ok, "ok", check=lambda v: ["nan"]))[0] == "silent"
    assert classify(Case("x", "", ok, "error", ("cu_seqlens",)))[0] == "silent"
    assert classify(Case("x", "", named, "error", ("cu_seqlens",)))[0] == "clear"
    assert classify(Case("x", "", vague, "error", ("cu_seqlens",)))[0] == "unclear"
    assert classify(Case("x", "", other, "error", ("cu_seqlens",)))[0] == "unclear"
    assert classify(Case("x", "", named, "ok"))[0] == "unclear"  # a valid input rejected
    assert classify(Case("x", "", slow, "ok"), timeout=0.2)[0] == "hang"


# ============================================================================ known failures
def _known(entry: str, label: str, call: Callable[[], Any], expect: str, names: tuple[str, ...] = (),
           check: Callable[[Any], list[str]] | None = None) -> Case:
    return Case(entry, label, call, expect, names, check)


def _engine_case(cfg: MISConfig, train: list[float], rollout: list[float], mask: list[float], cu: Any = None, **kw) -> Case:
    from megatron_mis.core.engine import compute_mis

    tr, ro, m = _tensor(train), _tensor(rollout), _tensor(mask)
    cu = _cu([len(train)]) if cu is None else cu
    return _known("compute_mis", f"{_cfg_label(cfg)} {train} {rollout} {mask} cu={cu!r} {kw}",
                  lambda: compute_mis(tr, ro, m, cu, cfg, **kw), "ok",
                  check=lambda res: _check_mis_result(res, cfg, tr, ro, m, cu if isinstance(cu, list) else [0, len(train)]))


def _bad_engine(cfg: Any, cu: Any, names: tuple[str, ...], **kw) -> Case:
    from megatron_mis.core.engine import compute_mis

    z = torch.zeros(4)
    return _known("compute_mis", f"config={cfg!r} cu_seqlens={cu!r} {kw}",
                  lambda: compute_mis(z, z, torch.ones(4), cu, cfg, **kw), "error", names)


def _host_case(entry: str, names: tuple[str, ...], expect: str = "error", args: Any = None, masks: Any = None, **kw) -> Case:
    import megatron_mis

    args = _host_args(MISConfig(use_tis=True)) if args is None else args
    masks = [torch.ones(3)] if masks is None else masks
    call_kw = dict(train_log_probs=[torch.zeros(3)], rollout_log_probs=[torch.zeros(3)], loss_masks=masks)
    if entry == "compute_mis_weights_with_cp":
        call_kw.update(total_lengths=[5], response_lengths=[3])
    call_kw.update(kw)
    pg = torch.ones(3)
    return _known(entry, f"args={_brief(args, 40)} masks={masks} {kw}",
                  lambda: getattr(megatron_mis, entry)(args, pg_loss=pg, **call_kw), expect, names,
                  check=lambda out: _check_host(out, masks, pg))


def _known_cases() -> dict[str, Callable[[], Case]]:
    from megatron_mis.core.advantages import compute_advantages
    from megatron_mis.core.kl import kl_estimate

    tis = MISConfig(use_tis=True)
    return {
        # engine: overflow-proof metrics (issue 12, "Silent")
        "engine_chi2_overflow_at_max_bound": lambda: _engine_case(
            MISConfig(use_tis=True, log_ratio_bound=80.0), [0.0], [-80.0], [1.0]),
        "engine_fp32_sum_overflow": lambda: _engine_case(tis, [-3e38, -3e38], [3e38, 3e38], [1.0, 1.0]),
        "engine_mask_mode_nan_token_kept": lambda: _engine_case(
            MISConfig(use_tis=True, tis_mode="mask", tis_lower_bound=1.5, tis_upper_bound=3.0),
            [math.nan, -1.0], [-1.0, -1.0], [1.0, 1.0]),
        # engine: arguments that must be refused naming the parameter
        "engine_config_none": lambda: _bad_engine(None, [0, 4], ("config",)),
        "engine_config_dict": lambda: _bad_engine({"use_tis": True}, [0, 4], ("config",)),
        "engine_cu_seqlens_none": lambda: _bad_engine(tis, None, ("cu_seqlens",)),
        "engine_cu_seqlens_string": lambda: _bad_engine(tis, "0,4", ("cu_seqlens",)),
        "engine_cu_seqlens_digits": lambda: _bad_engine(tis, "04", ("cu_seqlens",)),
        "engine_cu_seqlens_huge": lambda: _bad_engine(tis, [0, 2**70], ("cu_seqlens",)),
        "engine_cu_seqlens_nan": lambda: _bad_engine(tis, [0, math.nan], ("cu_seqlens",)),
        "engine_cu_seqlens_fraction": lambda: _bad_engine(tis, [0, 1.5, 4], ("cu_seqlens",)),
        "engine_reduce_stats_int": lambda: _bad_engine(tis, [0, 4], ("reduce_stats",), reduce_stats=5),
        "engine_global_normalizer_str": lambda: _bad_engine(
            MISConfig(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="global"), [0, 4],
            ("global_normalizer",), global_normalizer="abc"),
        "engine_bucket_edges_nan": lambda: _bad_engine(tis, [0, 4], ("prob_bucket_edges",), prob_bucket_edges=[0.0, math.nan, 1.0]),
        "engine_bucket_edges_inf": lambda: _bad_engine(tis, [0, 4], ("prob_bucket_edges",), prob_bucket_edges=[0.0, math.inf]),
        # host drop-ins: loss-mask values, lengths, layout, args
        # a NaN mask value: read as value > 0 (out) by default, an error under nonfinite_policy 'error'
        "host_fsdp_mask_nan": lambda: _host_case("compute_mis_weights_fsdp", ("loss_mask",), "either",
                                                 masks=[_tensor([math.nan, 1.0, 0.0])]),
        "host_fsdp_mask_nan_error": lambda: _host_case(
            "compute_mis_weights_fsdp", ("loss_masks[0]",), args=_host_args(MISConfig(use_tis=True, nonfinite_policy="error")),
            masks=[_tensor([math.nan, 1.0, 0.0])]),
        "host_cp_mask_inf_error": lambda: _host_case(
            "compute_mis_weights_with_cp", ("loss_masks[0]",), args=_host_args(MISConfig(use_tis=True, nonfinite_policy="error")),
            masks=[_tensor([1.0, math.inf, 0.0])]),
        "host_fsdp_mask_two": lambda: _host_case("compute_mis_weights_fsdp", ("loss_mask",), "either", masks=[_tensor([2.0, 1.0, 0.0])]),
        "host_cp_mask_nan": lambda: _host_case("compute_mis_weights_with_cp", ("loss_mask",), "either",
                                               masks=[_tensor([math.nan, 1.0, 0.0])]),
        "host_cp_total_lengths_fraction": lambda: _host_case(
            "compute_mis_weights_with_cp", ("total_lengths", "total_length"), total_lengths=[5.5]),
        "host_cp_total_lengths_string": lambda: _host_case(
            "compute_mis_weights_with_cp", ("total_lengths", "total_length"), total_lengths="5"),
        "host_cp_layout_foo": lambda: _host_case("compute_mis_weights_with_cp", ("cp_layout",), cp_layout="foo"),
        "host_args_dict": lambda: _host_case("compute_mis_weights_fsdp", ("args",), args={"use_tis": True}),
        "host_loss_masks_none_entry": lambda: _host_case("compute_mis_weights_fsdp", ("loss_mask",), masks=[None]),
        # the RL loss, advantages, KL, routing
        "rl_loss_cu_seqlens_list": lambda: _known(
            "compute_rl_loss", "cu_seqlens=[0, 2] (a list)", lambda: _rl_loss_call(cu=[0, 2]), "error", ("cu_seqlens",)),
        "advantages_mean_overflow": lambda: _known(
            "compute_advantages", "rewards=[3e38, 3e38] group_size=2 (grpo)",
            lambda: compute_advantages(_tensor([3e38, 3e38]), group_size=2), "ok",
            check=lambda res: _finite("advantages", res.advantages)),
        "advantages_std_overflow": lambda: _known(
            "compute_advantages", "rewards=[1e30, 2e30] group_size=2 (grpo)",
            lambda: compute_advantages(_tensor([1e30, 2e30]), group_size=2), "ok",
            check=lambda res: _finite("advantages", res.advantages) + _spread_kept(_tensor([1e30, 2e30]), res.advantages, 2, "grpo")),
        "advantages_group_size_bool": lambda: _known(
            "compute_advantages", "group_size=True", lambda: compute_advantages(torch.zeros(3), group_size=True), "error", ("group_size",)),
        "advantages_group_size_zero": lambda: _known(
            "compute_advantages", "group_size=0", lambda: compute_advantages(torch.zeros(4), group_size=0), "error", ("group_size",)),
        "kl_bound_nan": lambda: _known(
            "kl_estimate", "log_ratio_bound=nan", lambda: kl_estimate(torch.zeros(2), torch.zeros(2), "k3", log_ratio_bound=math.nan),
            "error", ("log_ratio_bound",)),
        "routing_meta_none": lambda: _known(
            "decode_routed_experts", "meta_info=None",
            lambda: __import__("megatron_mis.routing.sglang", fromlist=["x"]).decode_routed_experts(
                None, num_tokens=3, num_layers=1, topk=1, num_experts=4), "error", ("meta_info", "routed_experts")),
        "rl_loss_ppo_ratio_times_advantage_overflow": lambda: _known(
            "compute_rl_loss", "ppo, log_probs=[0], old_log_probs=[-20], advantages=[-1e30]",
            lambda: _rl_loss_call(cu=torch.tensor([0, 1]), n=1, advantages=_tensor([-1e30]), old_log_probs=_tensor([-20.0])),
            "error", ("advantages",)),
        # found by a --random run: REINFORCE's term is w * A * log pi (no ratio); the refusal
        # blamed the ratio bound and did not name the log-probs
        "rl_loss_reinforce_log_prob_overflow": lambda: _known(
            "compute_rl_loss", "reinforce, log_probs=[3e38], advantages=[7.5], is_weights=[1]",
            lambda: _rl_loss_call(cu=torch.tensor([0, 1]), n=1, advantages=_tensor([7.5]), log_probs=_tensor([3e38]),
                                  policy_loss="reinforce", old_log_probs=_tensor([3e38]), rollout_log_probs=_tensor([3e38]),
                                  is_weights=torch.ones(1)),
            "error", ("log_probs",)),
        # CISPO's term is w * clip(r) * A * log pi: the refusal names the log-probs and the clip
        "rl_loss_cispo_log_prob_overflow": lambda: _known(
            "compute_rl_loss", "cispo, log_probs=[-3e38], advantages=[2], is_weights=[1]",
            lambda: _rl_loss_call(cu=torch.tensor([0, 1]), n=1, advantages=_tensor([2.0]), log_probs=_tensor([-3e38]),
                                  policy_loss="cispo", old_log_probs=_tensor([-3e38]), is_weights=torch.ones(1)),
            "error", ("log_probs", "clipped ratio")),
        # GSPO's cp_sum must hand back the summed [N, k] statistics
        "rl_loss_gspo_cp_sum_wrong_shape": lambda: _known(
            "compute_rl_loss", "gspo, cp_sum returns [N, 2]",
            lambda: _rl_loss_call(cu=torch.tensor([0, 2]), n=2, advantages=_tensor([1.0, 1.0]), policy_loss="gspo",
                                  old_log_probs=_tensor([-1.0, -1.0]), is_weights=torch.ones(2), cp_sum=lambda t: t[:, :2]),
            "error", ("cp_sum", "[N, k]")),
        # found by a --random run: finite per-token terms (A = F32_MAX, ratio clipped to 1) whose
        # sum over a sequence overflows; the loss came back -inf and kl_loss NaN (pg_loss * 0)
        "rl_loss_aggregate_overflow": lambda: _known(
            "compute_rl_loss", "ppo, seq_mean_token_sum, advantages=[F32_MAX, F32_MAX] in one sequence",
            lambda: _rl_loss_call(cu=torch.tensor([0, 2]), n=2, advantages=_tensor([F32_MAX, F32_MAX])),
            "error", ("advantages",)),
        "kl_k2_unclamped": lambda: _known(
            "kl_estimate", "k2, log_probs=[0], ref_log_probs=[-1e20]",
            lambda: kl_estimate(torch.zeros(1), _tensor([-1e20]), "k2"), "ok", check=lambda out: _finite("kl", out)),
        "kl_ref_list": lambda: _known(
            "kl_estimate", "ref_log_probs=[0.0] (a list)", lambda: kl_estimate(torch.zeros(1), [0.0], "k3"), "error", ("ref_log_probs",)),
        "routing_num_experts_huge": lambda: _known(
            "decode_routed_experts", "num_experts=2**70",
            lambda: __import__("megatron_mis.routing.sglang", fromlist=["x"]).decode_routed_experts(
                {"routed_experts": base64.b64encode(np.array([1], dtype="<i4").tobytes()).decode()},
                num_tokens=2, num_layers=1, topk=1, num_experts=2**70), "either", ("num_experts",),
            check=lambda out: [] if out.tolist() == [[[1]]] else [f"decoded {out.tolist()}"]),
        # found by --random runs: an empty payload made the shape [0, 2**70, 1] and torch's
        # reshape overflowed (an unclear TypeError); a bare number was read as a one-element array
        "routing_num_layers_huge_empty_payload": lambda: _known(
            "decode_routed_experts", "routed_experts='' num_tokens=1 num_layers=2**70",
            lambda: __import__("megatron_mis.routing.sglang", fromlist=["x"]).decode_routed_experts(
                {"routed_experts": ""}, num_tokens=1, num_layers=2**70, topk=1, num_experts=300), "error", ("num_layers",)),
        "routing_payload_scalar": lambda: _known(
            "decode_routed_experts", "routed_experts=5 (a number) for one route",
            lambda: __import__("megatron_mis.routing.sglang", fromlist=["x"]).decode_routed_experts(
                {"routed_experts": 5}, num_tokens=2, num_layers=1, topk=1, num_experts=8), "error", ("routed_experts",)),
        "analyze_json_infinity": lambda: _analyze_case(
            b'{"rollout_log_probs": [3e38, 3e38], "train_log_probs": [-3e38, -3e38]}\n', "ok"),
        "analyze_row_not_object": lambda: _analyze_case(b"3\n", "error"),
        "analyze_garbage_pt": lambda: _analyze_case(b"not a torch file", "error", ".pt"),
        "analyze_bool_log_prob": lambda: _analyze_case(b'{"rollout_log_probs": [0.0], "train_log_probs": [true]}\n', "error"),
        # configs (this suite's own fixes; kept as regressions)
        "config_tis_upper_1_rs_off": lambda: _known("MISConfig", "use_tis, tis_upper_bound=1.0",
                                                    lambda: MISConfig(use_tis=True, tis_upper_bound=1.0), "ok", check=_check_config),
        "config_host_args_dict": lambda: _known("MISConfig", "from_host_args(dict)",
                                                lambda: MISConfig.from_host_args({"use_tis": True}), "error", ("args",)),
    }


def _rl_loss_call(cu: Any, n: int = 2, advantages: torch.Tensor | None = None, log_probs: torch.Tensor | None = None,
                  policy_loss: str = "ppo", **kw):
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.aggregation import Denominators
    from megatron_mis.core.losses import compute_rl_loss

    lp = (torch.zeros(n) if log_probs is None else log_probs.clone()).requires_grad_(True)
    adv = torch.ones(n) if advantages is None else advantages
    return compute_rl_loss(lp, adv, torch.ones(n), cu, LossConfig(policy_loss=policy_loss), Denominators(float(n), 1.0), **kw)


def _analyze_case(content: bytes, expect: str, suffix: str = ".jsonl") -> Case:
    path, cleanup = _write_case_file(content, "", suffix)

    def check(result):
        try:
            _strict_json(result[0])
        except ValueError as exc:
            return [f"--json printed invalid JSON ({exc})"]
        return []

    return Case("cli analyze", f"{suffix} {content!r}", _cli_call(["analyze", path, "--json"], path), expect, (path,),
                check, [cleanup])


KNOWN_CASES = _known_cases()


@pytest.mark.parametrize("name", sorted(KNOWN_CASES))
def test_known_case(name):
    case = KNOWN_CASES[name]()
    outcome, detail = classify(case)
    assert outcome in GOOD, f"{name}: {outcome}: {detail}\n  input: {case.label}"
