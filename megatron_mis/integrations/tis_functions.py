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

The configuration is read from the keys the host set on ``args`` (from the YAML; the hosts'
``--tis-clip`` / ``--tis-clip-low`` included), validated once per ``args`` object (re-validated
only if those keys change), with every error raised on the first call. Nothing is stored on
``args`` (Megatron pickles it into every checkpoint): what the functions remember between calls
lives in :mod:`megatron_mis.integrations.state`.

What the host's flags do to the call (docs/hosts.md):

- ``--use-rollout-logprobs`` (bypass, both hosts): the PPO ratio is already
  pi_theta / pi_rollout, so the IS weights are 1 (never applied a second time); rejection
  sampling and the vetoes act on the ratio of the ``train_log_probs`` the host passes;
- ``use_tis`` false (only ``--get-mismatch-metrics``): metrics only, unless ``rs_without_tis``;
- ``apply_is_weights: false``: as bypass, for rejection without IS weights;
- ``rs_veto_threshold`` acts only with ``use_rs`` (as in the hosts) unless ``rs_veto_without_rs``;
- ``--advantage-estimator gspo`` (a sequence-level PPO ratio): sequence- and geometric-level
  weights and rejection act as written (one value per sequence on all its tokens, exact under
  CP); token-level IS weights or token-level rejection are applied as written too, with a
  warning (once per ``args``) that says what they amount to there and names the sequence-level
  presets (docs/hosts.md, "GSPO").

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
from megatron_mis.integrations.host_report import SEQUENCE_LEVEL_PRESETS, SEQUENCE_RATIO_ESTIMATORS
from megatron_mis.integrations.state import GlobalMean, state_of
from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp, cp_normalization_statistics, lengths_1d
from megatron_mis.parallel.global_norm import compute_global_normalizer, normalization_config, usable_mean
from megatron_mis.parallel.state import GroupView, HostGroups, host_groups

__all__ = [
    "compute_mis_weights_with_cp",
    "compute_mis_weights_fsdp",
    "prepare_global_normalizer",
    "config_from_args",
]

_SNAPSHOT_KEYS = ("custom_config_path", "tis_clip", "tis_clip_low")


def config_from_args(args: Any) -> MISConfig:
    """The validated :class:`MISConfig` for a host's ``args`` (cached in the drop-in state of
    ``args``, never on it; validated again only when one of the MIS keys, the hosts' bound flags
    or ``custom_config_path`` changes)."""
    names = MISConfig.field_names()
    snapshot = tuple(getattr(args, n, None) for n in names) + tuple(getattr(args, n, None) for n in _SNAPSHOT_KEYS)
    _check_args(args)
    state = state_of(args)
    if state.config is not None and state.config[0] == snapshot:
        return state.config[1]
    cfg = MISConfig.from_host_args(args)
    state.config = (snapshot, cfg)
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
    """Warn about non-finite log-probs without a host synchronisation: the counts of EARLIER
    calls are read once their device copies have landed (at once on the CPU); a count whose
    CUDA event is still pending waits for a later call (the host may run several micro-batches
    ahead of the device), it is never read early nor dropped."""
    state = state_of(args)
    waiting = state.nonfinite_backlog + ([state.pending_nonfinite] if state.pending_nonfinite is not None else [])
    polled = [(d, d.poll()) for d in waiting]
    state.nonfinite_backlog = [d for d, v in polled if v is None]
    count = sum(v for _, v in polled if v)
    if count:
        warnings.warn(nonfinite_message(count, cfg), RuntimeWarning, stacklevel=4)
    state.pending_nonfinite = DeferredCount(res.num_nonfinite)


def _warn_once(args: Any, key: str, message: str, stacklevel: int) -> None:
    """A RuntimeWarning the first time per ``args`` object and ``key`` (remembered in the drop-in
    state of ``args``). ``stacklevel`` as seen from the caller."""
    warned = state_of(args).warned
    if key in warned:
        return
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    warned.add(key)


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
            args, "metrics_only",
            f"megatron-mis: {', '.join(acts)} has no effect without use_tis: slime / Miles call the TIS function with "
            "use_tis false only for --get-mismatch-metrics, so megatron-mis reports metrics and leaves the loss and "
            "masks unchanged (set rs_without_tis: true to reject anyway)",
            stacklevel=4,
        )
    policy = "neutralize" if cfg.nonfinite_policy == "reject" else cfg.nonfinite_policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg.replace(use_rs=False, rs_veto_threshold=None, prob_veto_threshold=None, nonfinite_policy=policy)


def _quiet_replace(cfg: MISConfig, **changes: Any) -> MISConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg.replace(**changes)


def _bypass(args: Any) -> bool:
    return bool(getattr(args, "use_rollout_logprobs", False))


def _rejection_only_config(args: Any, cfg: MISConfig) -> MISConfig:
    """``use_tis`` with ``--use-rollout-logprobs`` or ``apply_is_weights: false``: IS weights 1,
    rejection sampling and the vetoes act (docs/hosts.md, "bypass")."""
    bypass = _bypass(args)
    inert = [n for n, on in (
        ("tis_batch_normalize", cfg.tis_batch_normalize),
        ("tis_mode='mask'", cfg.tis_mode == "mask"),
        ("tis_mode='icepop'", cfg.tis_mode == "icepop"),
    ) if on]
    why = (
        "--use-rollout-logprobs is set, so the PPO ratio is already pi_theta / pi_rollout and an IS weight "
        "would apply the correction twice" if bypass else "apply_is_weights is false"
    )
    _warn_once(
        args, "rejection_only",
        f"megatron-mis: {why}: every IS weight is 1; rejection sampling and the vetoes act"
        + (f" ({', '.join(inert)} then has no effect)" if inert else "") + " (docs/hosts.md)",
        stacklevel=5,
    )
    return _quiet_replace(
        cfg, use_tis=False, tis_batch_normalize=False, tis_batch_normalize_scope="micro_batch", rs_without_tis=True
    )


def _host_veto(args: Any, cfg: MISConfig) -> MISConfig:
    """slime's and Miles' ``rs_veto_threshold`` acts only inside rejection sampling."""
    if cfg.rs_veto_threshold is None or cfg.use_rs or cfg.rs_veto_without_rs:
        return cfg
    _warn_once(
        args, "veto_without_rs",
        f"megatron-mis: rs_veto_threshold={cfg.rs_veto_threshold!r} has no effect because use_rs is false (as in "
        "slime's and Miles' mis.py, the ratio veto is part of rejection sampling); set use_rs: true, or "
        "rs_veto_without_rs: true to veto without rejection sampling",
        stacklevel=5,
    )
    return _quiet_replace(cfg, rs_veto_threshold=None)


def _warn_token_level_under_sequence_ratio(args: Any, run_cfg: MISConfig) -> None:
    """``args.advantage_estimator`` is GSPO: the host's PPO ratio is one per sequence,
    exp(mean log pi_theta / pi_old) over its loss-mask tokens, on every one of its tokens (slime
    loss.py:992-1027 with ppo_utils.py:95-121, Miles loss_hub/losses.py:141-179). A token-level
    IS weight or a token-level rejection then mixes granularities: applied as written (what the
    hosts' built-in TIS does under GSPO), with a warning naming the sequence-level settings."""
    estimator = getattr(args, "advantage_estimator", None)
    if estimator not in SEQUENCE_RATIO_ESTIMATORS:
        return
    token_is = run_cfg.use_tis and run_cfg.tis_level == "token"
    token_rejection = [n for n, on in (
        ("rs_level='token'", run_cfg.use_rs and run_cfg.rs_level == "token"),
        ("tis_mode='mask' at tis_level='token'", token_is and run_cfg.tis_mode == "mask"),
    ) if on]
    if not (token_is or token_rejection):
        return
    what = ", ".join((["tis_level='token' (IS weights)"] if token_is else []) + token_rejection)
    parts = []
    if token_is:
        parts.append(
            "a token IS weight multiplies a loss that is the same on every token of the sequence, so the host's "
            "per-sample mean scales the sequence by the mean of its token weights, which is not an importance "
            "weight of the sequence"
        )
    if token_rejection:
        parts.append(
            "a token rejected alone leaves the loss mask, but its log-prob still enters the sequence ratio of the "
            "tokens kept, so its gradient is scaled down, not removed"
        )
    _warn_once(
        args, "token_level_under_sequence_ratio",
        f"megatron-mis: args.advantage_estimator={estimator!r} makes the host's PPO ratio one per sequence "
        f"(exp of the mean log(pi_theta / pi_old) over its tokens), but {what} act(s) per token: "
        + "; ".join(parts) + ". The configuration is applied as written (as the host's built-in TIS is). For one "
        "weight per sequence (exact under context parallelism) set tis_level: geometric (GSPO's own length "
        "normalisation) or sequence, and rs_level: geometric or sequence; sequence-level presets: "
        f"{', '.join(SEQUENCE_LEVEL_PRESETS)} (docs/hosts.md, GSPO)",
        stacklevel=5,
    )


def _check_train_present(args: Any, cfg: MISConfig, run_cfg: MISConfig, inputs: CPInputs) -> None:
    """``train_log_probs is None`` (Miles with --use-rollout-logprobs and no pi_old recompute):
    refuse what needs the train policy's ratio, warn where only metrics lose it."""
    if inputs.train_log_probs is not None:
        return
    needs = [n for n, on in (
        ("IS weights (use_tis)", run_cfg.use_tis),
        ("use_rs", run_cfg.use_rs),
        ("rs_veto_threshold", run_cfg.rs_veto_threshold is not None),
        ("prob_veto_source='train'", run_cfg.prob_veto_threshold is not None and run_cfg.prob_veto_source == "train"),
    ) if on]
    if needs and (cfg.use_tis or cfg.rs_without_tis):
        raise ValueError(
            f"megatron-mis: train_log_probs is None (the host recomputed no pi_old: Miles with "
            f"--use-rollout-logprobs), but {', '.join(needs)} need(s) the ratio pi_old / pi_rollout. Add "
            "--get-mismatch-metrics (the host then recomputes pi_old), or drop --use-rollout-logprobs"
        )
    _warn_once(
        args, "no_train_log_probs",
        "megatron-mis: train_log_probs is None (the host recomputed no pi_old), so the mismatch metrics see "
        "ratio 1 everywhere; add --get-mismatch-metrics to recompute pi_old",
        stacklevel=5,
    )


def _global_mean(args: Any, num_samples: int) -> Any:
    """The current rollout's global mean, checked to belong to the samples being trained."""
    entry = state_of(args).global_mean
    if entry is None:
        raise RuntimeError(
            "megatron-mis: tis_batch_normalize_scope='global' needs the step's global mean, computed once per "
            "step before the micro-batches: slime: --rollout-data-postprocess-path "
            "megatron_mis.integrations.slime.rollout_data_postprocess; Miles: apply "
            "patches/miles-31f1ca96-global-mis-normalizer.patch; plain Megatron-Core: "
            "megatron_mis.parallel.global_norm.compute_global_normalizer"
        )
    if entry.consumed + num_samples > entry.num_samples:
        raise RuntimeError(
            f"megatron-mis: the stored global self-normalisation mean is stale: it belongs to rollout "
            f"{entry.rollout_id}, whose {entry.num_samples} sample(s) on this rank were already trained "
            f"({entry.consumed} consumed, this call brings {num_samples}). The per-rollout hook did not run for "
            "the rollout now training: check --rollout-data-postprocess-path (slime) or the global-normaliser "
            "patch (Miles), which must call prepare_global_normalizer for every rollout"
        )
    entry.consumed += num_samples
    return entry.mean


def _apply(
    args: Any,
    pg_loss: torch.Tensor,
    inputs: CPInputs,
    groups: HostGroups,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    cfg = config_from_args(args)
    pg_loss = _check_pg_loss(pg_loss)
    metrics_only = not cfg.use_tis
    if metrics_only:
        run_cfg = _metrics_only_config(args, cfg)
    elif _bypass(args) or not cfg.apply_is_weights:
        run_cfg = _rejection_only_config(args, cfg)
    else:
        run_cfg = cfg
    run_cfg = _host_veto(args, run_cfg)
    _warn_token_level_under_sequence_ratio(args, run_cfg)
    _check_train_present(args, cfg, run_cfg, inputs)
    normalizer = None
    if run_cfg.normalizes:
        num_samples = len(inputs.response_lengths)
        if run_cfg.tis_batch_normalize_scope == "global":
            normalizer = _global_mean(args, num_samples)
        else:
            if num_samples == 1 and run_cfg.tis_level != "token":
                _warn_once(
                    args, "single_sequence_normalize",
                    f"megatron-mis: tis_batch_normalize at tis_level={run_cfg.tis_level!r} over a micro-batch of one "
                    "sequence divides its weight by itself (every weight becomes 1, the IS correction is lost); "
                    "use tis_batch_normalize_scope: global (docs/hosts.md)",
                    stacklevel=4,
                )
            if run_cfg.tis_batch_normalize_over == "loss_mask":
                stats = cp_normalization_statistics(inputs, normalization_config(run_cfg), groups.cp)
                normalizer = usable_mean(stats)
        if normalizer is not None:
            run_cfg = _quiet_replace(run_cfg, tis_batch_normalize_scope="global")
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
    """Compute the global self-normalisation mean once per rollout and keep it (in the drop-in
    state of ``args``, never on it) for the micro-batch calls. Signature of slime's
    ``--rollout-data-postprocess-path`` hook (called on every training rank after log-probs are
    recomputed, before training).

    Uses ``rollout_data["log_probs"]`` (this rank's CP pieces of pi_old; absent on pipeline
    stages other than the last, which do nothing), ``rollout_log_probs``, ``loss_masks``,
    ``total_lengths``, ``response_lengths`` and optionally ``max_seq_lens``. The mean covers every
    sample this rollout trains on across all data-parallel ranks; with several optimizer steps
    per rollout it is the rollout's mean (the weights do not depend on the parameters trained).
    The micro-batch calls check that they train no more samples than it covers (a skipped hook
    is an error, not a silently reused mean). Does nothing unless ``tis_batch_normalize_scope:
    global``, or where IS weights are 1 (``--use-rollout-logprobs``, ``apply_is_weights: false``).

    Raises:
        RuntimeError: ``rollout_data`` has no ``log_probs`` (slime reused the training forward's
            log-probs, Miles ``--skip-actor-forward-only``): pi_old does not exist before training.
    """
    cfg = config_from_args(args)
    if not (cfg.normalizes and cfg.tis_batch_normalize_scope == "global") or _bypass(args) or not cfg.apply_is_weights:
        return
    groups = host_groups(parallel_state)
    if not groups.is_last_pp_stage or "rollout_log_probs" not in rollout_data:
        return
    train = rollout_data.get("log_probs")
    if train is None or not len(train):
        if getattr(args, "skip_actor_forward_only", False):
            cause, fix = "--skip-actor-forward-only skips the pi_old forward pass", "drop --skip-actor-forward-only"
        else:
            cause = (
                "slime reuses the training forward's log-probs as pi_old (one optimizer step per rollout, kl_coef 0, "
                "no --get-mismatch-metrics: can_reuse_log_probs_in_loss in slime/backends/megatron_utils/actor.py)"
            )
            fix = "add --get-mismatch-metrics (slime then recomputes pi_old before training)"
        raise RuntimeError(
            f"megatron-mis: tis_batch_normalize_scope='global' needs pi_old for the whole rollout before training, "
            f"but rollout_data has no 'log_probs': {cause}. Fix: {fix}, or use tis_batch_normalize_scope: "
            "micro_batch (exact here: pi_old is the training forward's own log-probs)"
        )
    layout, msl = _layout_of(args, rollout_data.get("max_seq_lens"), None)
    inputs = CPInputs(
        train_log_probs=list(train),
        rollout_log_probs=list(rollout_data["rollout_log_probs"]),
        loss_masks=list(rollout_data["loss_masks"]),
        total_lengths=list(rollout_data["total_lengths"]),
        response_lengths=list(rollout_data["response_lengths"]),
        layout=layout,
        max_seq_lens=msl,
    )
    mean = compute_global_normalizer([inputs], cfg, cp=groups.cp, dp=groups.dp)
    state_of(args).global_mean = GlobalMean(int(rollout_id), mean, num_samples=len(inputs.response_lengths))
