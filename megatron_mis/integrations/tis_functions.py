"""Drop-in TIS functions for slime and Miles (``--custom-tis-function-path``).

    --use-tis --custom-config-path mis.yaml \
    --custom-tis-function-path megatron_mis.compute_mis_weights_with_cp

The host calls the function once per micro-batch from its loss (DESIGN section 2) with keyword
arguments ``args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
response_lengths`` (Miles adds ``parallel_state`` and ``max_seq_lens``) and expects
``(pg_loss, modified_masks, metrics)``:

- ``pg_loss``: this rank's flat per-token loss multiplied by the IS weights (exactly 0 where a
  token is rejected, even if the host's loss was not finite there);
- ``modified_masks``: one FULL-length mask per sample, correct on every CP rank (the hosts build
  numerators from each rank's chunk and, in Miles without ``rollout_mask_sums``, denominators
  from the whole masks);
- ``metrics``: ``mis_*`` per-token tensors aligned with ``pg_loss``; hosts reduce them over the
  ORIGINAL loss mask.

The configuration is read from the keys the host set on ``args`` (from the YAML), validated once
per ``args`` object (re-validated only if those keys change), with every error raised on the
first call.

``tis_batch_normalize_scope: global`` needs the mean over the step's whole batch, computed once
per step by :func:`prepare_global_normalizer` (slime: ``--rollout-data-postprocess-path
megatron_mis.integrations.slime.rollout_data_postprocess``; Miles: the patch in ``patches/``).

Host users import these from their host's entry module (:mod:`megatron_mis.integrations.slime`,
:mod:`megatron_mis.integrations.miles`); this module is where they are implemented.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import DeferredCount, nonfinite_message
from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp, lengths_1d
from megatron_mis.parallel.global_norm import compute_global_normalizer
from megatron_mis.parallel.state import GroupView, HostGroups, host_groups

__all__ = [
    "compute_mis_weights_with_cp",
    "compute_mis_weights_fsdp",
    "prepare_global_normalizer",
    "config_from_args",
]

_CACHE_ATTR = "_megatron_mis_config_cache"
_NORM_ATTR = "_megatron_mis_global_normalizer"
_BYPASS_WARNED_ATTR = "_megatron_mis_bypass_warned"


def config_from_args(args: Any) -> MISConfig:
    """The validated :class:`MISConfig` for a host's ``args`` (cached on the object; validated
    again only when one of the MIS keys or ``custom_config_path`` changes)."""
    names = MISConfig.field_names()
    snapshot = tuple(getattr(args, n, None) for n in names) + (getattr(args, "custom_config_path", None),)
    cached = getattr(args, _CACHE_ATTR, None)
    if cached is not None and cached[0] == snapshot:
        return cached[1]
    cfg = MISConfig.from_host_args(args)
    try:
        setattr(args, _CACHE_ATTR, (snapshot, cfg))
    except AttributeError:  # an immutable args object: validate every call instead
        pass
    return cfg


def _layout_of(args: Any, max_seq_lens: Sequence[int] | None, cp_layout: str | None) -> tuple[str, Any]:
    if cp_layout is not None:
        if cp_layout not in ("thd", "bshd", "allgather"):  # checked at CP = 1 too
            raise ValueError(f"cp_layout={cp_layout!r} is not supported; valid: 'thd', 'bshd', 'allgather' (or None)")
        if cp_layout == "bshd" and max_seq_lens is None:
            raise ValueError("cp_layout='bshd' needs max_seq_lens (the padded length per sample)")
        return cp_layout, max_seq_lens
    qkv = getattr(args, "qkv_format", "thd") or "thd"
    if qkv == "bshd":
        if max_seq_lens is None:
            raise ValueError("args.qkv_format='bshd' needs max_seq_lens (Miles passes it; pass max_seq_lens=...)")
        return "bshd", max_seq_lens
    if qkv != "thd":
        raise ValueError(f"args.qkv_format={qkv!r} is not supported; valid: 'thd', 'bshd'")
    # slime / Miles redistribute allgather-CP log-probs into the zigzag layout before the loss,
    # so the function always sees thd / bshd pieces.
    return "thd", None


_NONFINITE_ATTR = "_megatron_mis_pending_nonfinite"
_METRICS_ONLY_WARNED_ATTR = "_megatron_mis_metrics_only_warned"


def _check_args(args: Any) -> None:
    if isinstance(args, dict):
        raise TypeError(
            "args must be the host's argument namespace (attributes, e.g. argparse.Namespace), got a dict: its keys "
            "would be ignored; pass argparse.Namespace(**mapping)"
        )
    if args is None:
        raise TypeError("args must be the host's argument namespace carrying the mis.yaml keys, got None")


def _check_pg_loss(pg_loss: Any) -> torch.Tensor:
    if not isinstance(pg_loss, torch.Tensor):
        raise TypeError(
            f"pg_loss must be a 1-D tensor (this rank's per-token loss, sequences concatenated), got "
            f"{type(pg_loss).__name__}" + (f" of {len(pg_loss)} entries" if isinstance(pg_loss, (list, tuple)) else "")
        )
    if pg_loss.dim() != 1:
        raise ValueError(f"pg_loss must be 1-D [T_local], got shape {tuple(pg_loss.shape)}")
    return pg_loss


def _warn_deferred_nonfinite(args: Any, res: Any, cfg: MISConfig) -> None:
    """Warn about non-finite log-probs without a host synchronisation: the count of the
    PREVIOUS call is read once its device copy has landed (at once on the CPU)."""
    pending = getattr(args, _NONFINITE_ATTR, None)
    if pending is not None:
        count = pending.poll()
        if count:
            warnings.warn(nonfinite_message(count, cfg), RuntimeWarning, stacklevel=4)
    try:
        setattr(args, _NONFINITE_ATTR, DeferredCount(res.num_nonfinite))
    except AttributeError:
        pass


def _warn_once(args: Any, attr: str, message: str, stacklevel: int) -> None:
    """A RuntimeWarning the first time per ``args`` object (remembered in ``attr`` on it; every
    time where ``args`` takes no attributes). ``stacklevel`` as seen from the caller."""
    if getattr(args, attr, False):
        return
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    try:
        setattr(args, attr, True)
    except AttributeError:
        pass


def _check_loss_length(pg_loss: torch.Tensor, num_tokens: int) -> None:
    if pg_loss.shape[0] != num_tokens:
        raise ValueError(
            f"pg_loss has shape {tuple(pg_loss.shape)} but this rank holds {num_tokens} response tokens "
            "(pg_loss must be the flat local per-token loss, sequences concatenated)"
        )


def _metrics_only_config(args: Any, cfg: MISConfig) -> MISConfig:
    """The hosts call with use_tis false only for --get-mismatch-metrics: metrics, loss unchanged."""
    acts = [n for n, on in (("use_rs", cfg.use_rs), ("rs_veto_threshold", cfg.rs_veto_threshold is not None),
                            ("prob_veto_threshold", cfg.prob_veto_threshold is not None),
                            ("nonfinite_policy='reject'", cfg.nonfinite_policy == "reject")) if on]
    if cfg.rs_without_tis:
        return cfg
    if acts:
        _warn_once(
            args, _METRICS_ONLY_WARNED_ATTR,
            f"megatron-mis: {', '.join(acts)} has no effect without use_tis: slime / Miles call the TIS function with "
            "use_tis false only for --get-mismatch-metrics, so megatron-mis reports metrics and leaves the loss and "
            "masks unchanged (set rs_without_tis: true to reject anyway)",
            stacklevel=4,
        )
    policy = "neutralize" if cfg.nonfinite_policy == "reject" else cfg.nonfinite_policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg.replace(use_rs=False, rs_veto_threshold=None, prob_veto_threshold=None, nonfinite_policy=policy)


def _apply(
    args: Any,
    pg_loss: torch.Tensor,
    inputs: CPInputs,
    groups: HostGroups,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    cfg = config_from_args(args)
    pg_loss = _check_pg_loss(pg_loss)
    if inputs.train_log_probs is None and cfg.use_tis:
        _warn_once(
            args, _BYPASS_WARNED_ATTR,
            "megatron-mis: train_log_probs is None (rollout log-probs used as the old policy and nothing "
            "recomputed), so every IS ratio is 1 and the mismatch metrics are 0; only the probability veto "
            "can act. Recompute pi_old (drop --use-rollout-logprobs or set --get-mismatch-metrics) to correct.",
            stacklevel=3,
        )
    metrics_only = not cfg.use_tis
    run_cfg = _metrics_only_config(args, cfg) if metrics_only else cfg
    normalizer = None
    if cfg.normalizes and cfg.tis_batch_normalize_scope == "global":
        normalizer = getattr(args, _NORM_ATTR, None)
        if normalizer is None:
            raise RuntimeError(
                "megatron-mis: tis_batch_normalize_scope='global' needs the step's global mean, computed once per "
                "step before the micro-batches: slime: --rollout-data-postprocess-path "
                "megatron_mis.integrations.slime.rollout_data_postprocess; Miles: apply "
                "patches/miles-31f1ca96-global-mis-normalizer.patch; plain Megatron-Core: "
                "megatron_mis.parallel.global_norm.compute_global_normalizer"
            )
        normalizer = normalizer[1]
    out = compute_mis_cp(inputs, run_cfg, groups.cp, global_normalizer=normalizer)
    res = out.result
    _check_loss_length(pg_loss, res.weights.numel())
    _warn_deferred_nonfinite(args, res, cfg)
    metrics = dict(res.token_metrics)
    if metrics_only and not (cfg.rs_without_tis and run_cfg.rejects):
        # the host's meaning: metrics only; loss and masks exactly as given (masks as 0 / 1)
        return pg_loss, _unchanged_masks(inputs), metrics
    weights = res.weights.to(device=pg_loss.device, dtype=pg_loss.dtype)
    keep = res.keep_mask.to(pg_loss.device)
    new_loss = torch.where(keep, pg_loss * weights, 0.0)  # a scalar zero: no [T] buffer of zeros
    return new_loss, out.modified_masks, metrics


def _unchanged_masks(inputs: CPInputs) -> list[torch.Tensor]:
    """The given full-length masks with the documented exact conversion (a value > 0 is 1,
    anything else 0, in the mask's dtype): no value passes through."""
    return [m if m.dtype == torch.bool else (m > 0).to(m.dtype) for m in inputs.loss_masks]


def compute_mis_weights_with_cp(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    parallel_state: Any | None = None,
    max_seq_lens: Sequence[int] | None = None,
    cp_group: Any | None = None,
    cp_layout: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """slime / Miles custom TIS function with context parallelism (see module docstring).

    Args:
        args: the host's argument namespace carrying the ``mis.yaml`` keys.
        pg_loss: ``[T_local]`` per-token policy loss of this CP rank's response tokens.
        train_log_probs: per sample, this rank's piece of log pi_old (or ``None``).
        rollout_log_probs: per sample, this rank's piece of log pi_rollout.
        loss_masks: per sample, the FULL response-length mask.
        total_lengths, response_lengths: ``[N]`` per sample.
        parallel_state: Miles' ``ParallelState`` (else Megatron-Core's parallel state is read).
        max_seq_lens: bshd padded lengths (Miles).
        cp_group: an explicit CP process group (overrides both).
        cp_layout: ``"thd"`` / ``"bshd"`` / ``"allgather"`` to override ``args.qkv_format``.

    Collectives: over the CP group only — one all-gather of per-sample statistics, plus one
    ``uint8`` all-reduce when token-level rejection is configured; none when CP = 1.
    """
    _check_args(args)
    layout, msl = _layout_of(args, max_seq_lens, cp_layout)
    groups = host_groups(parallel_state, cp_group=cp_group)
    inputs = CPInputs(
        train_log_probs=train_log_probs,
        rollout_log_probs=rollout_log_probs,
        loss_masks=loss_masks,
        total_lengths=total_lengths,
        response_lengths=response_lengths,
        layout=layout,
        max_seq_lens=msl,
        local_length=kwargs.get("local_length"),
    )
    return _apply(args, pg_loss, inputs, groups)


def compute_mis_weights_fsdp(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """The same for hosts without context parallelism (FSDP backends): whole sequences on every
    rank, no collectives, no host synchronisation."""
    _check_args(args)
    if isinstance(rollout_log_probs, torch.Tensor) or not isinstance(rollout_log_probs, (list, tuple)):
        raise TypeError(
            f"rollout_log_probs must be a list with one 1-D tensor per sample, got {type(rollout_log_probs).__name__}"
        )
    try:
        lengths = lengths_1d(rollout_log_probs)
    except (AttributeError, TypeError):
        bad = next(i for i, r in enumerate(rollout_log_probs) if not isinstance(r, torch.Tensor))
        raise TypeError(
            f"rollout_log_probs[{bad}] must be a torch.Tensor, got {type(rollout_log_probs[bad]).__name__}"
        ) from None
    inputs = CPInputs(
        train_log_probs=train_log_probs,
        rollout_log_probs=rollout_log_probs,
        loss_masks=loss_masks,
        total_lengths=[n + 1 for n in lengths],  # one prompt token: only the response matters here
        response_lengths=lengths,
    )
    groups = HostGroups(cp=GroupView.trivial(), dp=GroupView.trivial(), tp=GroupView.trivial())
    return _apply(args, pg_loss, inputs, groups)


def prepare_global_normalizer(args: Any, rollout_id: int, rollout_data: dict, *, parallel_state: Any | None = None) -> None:
    """Compute the global self-normalisation mean once per step and keep it on ``args`` for the
    micro-batch calls. Signature of slime's ``--rollout-data-postprocess-path`` hook (called on
    every training rank after log-probs are recomputed, before training).

    Uses ``rollout_data["log_probs"]`` (this rank's CP pieces of pi_old; absent on pipeline
    stages other than the last, which do nothing), ``rollout_log_probs``, ``loss_masks``,
    ``total_lengths``, ``response_lengths`` and optionally ``max_seq_lens``. The mean covers every
    sample this rollout trains on across all data-parallel ranks; with several optimizer steps
    per rollout it is the rollout's mean (the weights do not depend on the parameters trained).
    Does nothing unless ``tis_batch_normalize_scope: global``.
    """
    cfg = config_from_args(args)
    if not (cfg.normalizes and cfg.tis_batch_normalize_scope == "global"):
        return
    groups = host_groups(parallel_state)
    if not groups.is_last_pp_stage or "rollout_log_probs" not in rollout_data:
        return
    layout, msl = _layout_of(args, rollout_data.get("max_seq_lens"), None)
    train = rollout_data.get("log_probs")
    inputs = CPInputs(
        train_log_probs=list(train) if train is not None and len(train) else None,
        rollout_log_probs=list(rollout_data["rollout_log_probs"]),
        loss_masks=list(rollout_data["loss_masks"]),
        total_lengths=list(rollout_data["total_lengths"]),
        response_lengths=list(rollout_data["response_lengths"]),
        layout=layout,
        max_seq_lens=msl,
    )
    mean = compute_global_normalizer([inputs], cfg, cp=groups.cp, dp=groups.dp)
    setattr(args, _NORM_ATTR, (rollout_id, mean))
