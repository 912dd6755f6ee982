"""What a ``--custom-config-path`` YAML does inside slime or Miles (``megatron-mis validate --host``).

Pure Python (no torch, no YAML parser, no host import): :func:`host_report` takes the mapping the
YAML holds, optionally the host flags of the launch command, and returns :class:`HostNote` s —
keys that do nothing on that host, host flags a YAML key overrides, host bounds that are not read,
keys whose host meaning differs from megatron-mis' own, keys that need a hook or a patch, and
errors (combinations the host makes impossible, bounds that disagree).

Every fact below was read in the hosts' code at the supported commits (slime
624b824a898ab0ec1fcb4d373004c7f3852bf515, Miles 31f1ca961a94cb860cec3b2dea34ec332bfa8f76) and is
cited as ``file:line`` in :data:`HOST_FACTS`; the meanings megatron-mis gives the keys on a host are
those of ``docs/hosts.md`` (its machine-readable summary). The two hosts share the facts that
matter here:

- both load the YAML after their own argument checks and ``setattr(args, key, value)`` for every
  key, logging "Argument ... is already set ... will override" for keys that are host arguments —
  so ``use_tis``, ``tis_clip``, ``tis_clip_low`` (and any host flag) in the YAML override the
  command line (slime ``slime/utils/arguments.py:2013-2019``, Miles
  ``miles/utils/arguments.py:3475-3480``); the check that refuses ``--use-rollout-logprobs`` with
  ``--use-tis`` runs before (slime ``arguments.py:1854-1855``, Miles ``arguments.py:3142-3143``);
- both call the TIS function only when ``args.use_tis or args.get_mismatch_metrics`` (slime
  ``slime/backends/megatron_utils/loss.py:1050``, Miles
  ``miles/backends/training_utils/loss_hub/losses.py:230``);
- both have ``--tis-clip`` (default 2.0) and ``--tis-clip-low`` (default 0), read only by their
  built-in TIS (slime ``loss.py:897``, Miles ``loss_hub/corrections.py:24``), never when
  ``--custom-tis-function-path`` names another function;
- with ``--advantage-estimator gspo`` both build ONE PPO ratio per sequence, exp of the mean
  log(pi_theta / pi_old) over its loss-mask tokens from CP-gathered log-probs, expanded to every
  local token (slime ``loss.py:992-1027`` and ``slime/utils/ppo_utils.py:95-121``, Miles
  ``loss_hub/losses.py:141-179`` and ``loss_hub/math_utils.py:224-250``), then call the TIS
  function exactly as otherwise: this rank's CP pieces, and the returned ``pg_loss`` reduced per
  sample (slime ``loss.py:1064-1105``, Miles ``loss_hub/losses.py:248-299``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "HOSTS", "HOST_FACTS", "HostNote", "SEQUENCE_LEVEL_PRESETS", "SEQUENCE_RATIO_ESTIMATORS", "host_report",
    "parse_host_flags",
]

HOSTS = ("slime", "miles")
#: ``--advantage-estimator`` values whose PPO ratio is one per sequence (GSPO), on both hosts.
SEQUENCE_RATIO_ESTIMATORS = ("gspo",)
#: Shipped presets whose IS weights and rejection are all per sequence (configs/presets/), named
#: by the drop-in's warning and by ``validate --host`` for a sequence-level ratio.
SEQUENCE_LEVEL_PRESETS = ("geometric_tis", "geometric_rs", "sequence_tis", "sequence_mis")
NoteKind = Literal["inert", "overrides_flag", "ignored_bound", "host_meaning", "needs_hook", "error"]

#: ``fact -> {host: "path:line"}``, the host code each note rests on.
HOST_FACTS: dict[str, dict[str, str]] = {
    "yaml_on_args": {
        "slime": "slime/utils/arguments.py:2013-2019",
        "miles": "miles/utils/arguments.py:3475-3480",
    },
    "bypass_excludes_use_tis_check": {
        "slime": "slime/utils/arguments.py:1854-1855",
        "miles": "miles/utils/arguments.py:3142-3143",
    },
    "call_condition": {
        "slime": "slime/backends/megatron_utils/loss.py:1050",
        "miles": "miles/backends/training_utils/loss_hub/losses.py:230",
    },
    "custom_function_replaces_builtin": {
        "slime": "slime/backends/megatron_utils/loss.py:1074-1077",
        "miles": "miles/backends/training_utils/loss_hub/losses.py:241-246",
    },
    "builtin_tis_reads_tis_clip": {
        "slime": "slime/backends/megatron_utils/loss.py:897",
        "miles": "miles/backends/training_utils/loss_hub/corrections.py:24",
    },
    "tis_clip_flags": {
        "slime": "slime/utils/arguments.py:1067-1077",
        "miles": "miles/utils/arguments.py:1545-1555",
    },
    "bypass_train_log_probs": {
        "slime": "slime/backends/megatron_utils/loss.py:985-989",
        "miles": "miles/backends/training_utils/loss_hub/losses.py:127-132, miles/backends/megatron_utils/actor.py:523-525",
    },
    "log_prob_reuse": {
        "slime": "slime/backends/megatron_utils/actor.py:461-475",
        "miles": "miles/utils/arguments.py:1527-1537",
    },
    "rollout_data_hook": {
        "slime": "slime/backends/megatron_utils/actor.py:506",
        "miles": "miles/backends/megatron_utils/actor.py:563-564",
    },
    "skip_forward_refuses_hooks": {
        "miles": "miles/utils/arguments.py:3532-3560",
    },
    "sequence_level_ratio": {
        "slime": "slime/backends/megatron_utils/loss.py:992-1027, slime/utils/ppo_utils.py:95-121",
        "miles": "miles/backends/training_utils/loss_hub/losses.py:141-179, "
                 "miles/backends/training_utils/loss_hub/math_utils.py:224-250",
    },
    "advantage_estimator_flag": {
        "slime": "slime/utils/arguments.py:940-951",
        "miles": "miles/utils/arguments.py:1421-1431",
    },
    "icepop_keeps_mask": {
        "slime": "slime/backends/megatron_utils/loss.py:921-933",
        "miles": "miles/backends/training_utils/loss_hub/corrections.py:52-62",
    },
}

#: Host arguments a YAML key may name (and so override) that matter to megatron-mis:
#: ``key -> (command-line flag, default)``; the same on both hosts
#: (slime ``arguments.py:1027-1077``, Miles ``arguments.py:1503-1555``).
_HOST_ARGS: dict[str, tuple[str, Any]] = {
    "use_tis": ("--use-tis", False),
    "get_mismatch_metrics": ("--get-mismatch-metrics", False),
    "use_rollout_logprobs": ("--use-rollout-logprobs", False),
    "tis_clip": ("--tis-clip", 2.0),
    "tis_clip_low": ("--tis-clip-low", 0.0),
    "custom_tis_function_path": ("--custom-tis-function-path", None),
    "rollout_data_postprocess_path": ("--rollout-data-postprocess-path", None),
    "custom_megatron_before_train_step_hook_path": ("--custom-megatron-before-train-step-hook-path", None),
    "advantage_estimator": ("--advantage-estimator", "grpo"),
}
_MILES_ONLY_ARGS = {"skip_actor_forward_only": ("--skip-actor-forward-only", False)}

#: docs/hosts.md ``host_bound_flags``: host flag -> the MIS key megatron-mis reads it as.
_BOUND_FLAG_KEYS = {"tis_clip": "tis_upper_bound", "tis_clip_low": "tis_lower_bound"}
#: docs/hosts.md ``modes.bypass``: keys that do nothing in bypass mode (the IS weight is 1).
_BYPASS_INERT = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound", "tis_batch_normalize",
                 "tis_batch_normalize_scope")
#: docs/hosts.md ``modes.bypass.acting_keys``: ratio-based rejection that still acts in bypass mode.
_RATIO_REJECTION = ("use_rs", "rs_veto_threshold", "prob_veto_threshold")
#: docs/hosts.md ``modes.metrics_only.inert_keys``.
_METRICS_ONLY_INERT = ("use_rs", "rs_veto_threshold", "prob_veto_threshold", "tis_batch_normalize")
#: Every MIS key a YAML may hold besides the host arguments (those of configs/mis.yaml).
_MIS_PREFIXES = ("tis_", "rs_", "use_rs", "prob_veto", "apply_is_weights")

_SLIME_HOOK = "megatron_mis.integrations.slime.rollout_data_postprocess"
_MILES_NORMALIZER_PATCH = "patches/miles-31f1ca96-global-mis-normalizer.patch"
_MILES_LENGTH_PATCH = "patches/miles-31f1ca96-length-decay.patch"
_SLIME_LENGTH_PATCH = "patches/slime-624b824a-length-decay.patch"
_NAME = {"slime": "slime", "miles": "Miles"}
_POSS = {"slime": "slime's", "miles": "Miles'"}


@dataclass(frozen=True, slots=True)
class HostNote:
    """One finding. ``kind`` ``error`` makes ``validate --host`` exit non-zero; every other kind
    is information the user should read before launching.

    Attributes:
        kind: inert | overrides_flag | ignored_bound | host_meaning | needs_hook | error.
        key: the YAML key (or host flag) the note is about.
        message: what happens on the host, and the fix where there is one.
        source: the host code it rests on (``host path:line``) or ``docs/hosts.md``.
    """

    kind: NoteKind
    key: str
    message: str
    source: str

    @property
    def is_error(self) -> bool:
        return self.kind == "error"

    def format(self) -> str:
        return f"{self.kind}: {self.key}: {self.message} [{self.source}]"


def _src(fact: str, host: str) -> str:
    return f"{host} {HOST_FACTS[fact][host]}"


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"))


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_host_flags(argv: list[str] | str, host: str) -> dict[str, Any]:
    """The host arguments megatron-mis cares about from a launch command line (other flags are
    skipped): ``{"use_tis": True, "tis_clip": 1.5, ...}``. Store-true flags become ``True``, the
    others take the next word. Raises ``ValueError`` naming a valued flag given without a value
    or a bound flag whose value is not a number."""
    import shlex

    words = shlex.split(argv) if isinstance(argv, str) else list(argv)
    known = {flag: key for key, (flag, _) in {**_HOST_ARGS, **(_MILES_ONLY_ARGS if host == "miles" else {})}.items()}
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word, _, inline = words[i].partition("=")
        key = known.get(word)
        i += 1
        if key is None:
            continue
        default = {**_HOST_ARGS, **_MILES_ONLY_ARGS}[key][1]
        if isinstance(default, bool):
            out[key] = True
            continue
        if inline:
            value = inline
        elif i < len(words) and not words[i].startswith("--"):
            value = words[i]
            i += 1
        else:
            raise ValueError(f"host flag {word} needs a value")
        if key in _BOUND_FLAG_KEYS:
            number = _number(value)
            if number is None:
                raise ValueError(f"host flag {word}={value!r} must be a number")
            value = number
        out[key] = value
    return out


def _sequence_ratio_notes(data: Mapping[str, Any], host: str, estimator: str, *, weights: bool) -> list[HostNote]:
    """docs/hosts.md ``sequence_level_ratio``: token-level settings under a per-sequence PPO ratio.
    ``weights``: IS weights act (``use_tis``, not bypass)."""
    weights = weights and data.get("apply_is_weights", True) not in (False, "false", "False")
    tis_level = data.get("tis_level", "token")
    rs_level = data.get("rs_level", "token")
    presets = ", ".join(SEQUENCE_LEVEL_PRESETS)
    source = _src("sequence_level_ratio", host) + "; docs/hosts.md sequence_level_ratio"
    head = (f"--advantage-estimator {estimator} makes {_POSS[host]} PPO ratio one per sequence (exp of the mean "
            "log(pi_theta / pi_old) over its tokens)")
    notes = []
    if weights and tis_level == "token":
        notes.append(HostNote(
            "host_meaning", "tis_level",
            f"{head}; token-level IS weights (tis_level: token{'' if 'tis_level' in data else ', the default'}) "
            "multiply a loss that is the same on every token of a sequence, so the sequence is scaled by the mean "
            "of its token weights, not by an importance weight of the sequence. Applied as written, with a warning "
            "at the first call; for one weight per sequence use tis_level: geometric (GSPO's length normalisation) "
            f"or sequence (presets: {presets})",
            source,
        ))
    rejects = []
    if _truthy(data.get("use_rs")) and rs_level == "token":
        rejects.append("rs_level")
    if weights and tis_level == "token" and data.get("tis_mode") == "mask":
        rejects.append("tis_mode")
    for key in rejects:
        notes.append(HostNote(
            "host_meaning", key,
            f"{head}; a token rejected by {key}: {data.get(key, 'token')} leaves the loss mask, but its log-prob "
            "still enters the sequence ratio of the tokens kept, so its gradient is scaled down, not removed. "
            f"Applied as written, with a warning at the first call; rs_level: geometric or sequence rejects whole "
            f"sequences (presets: {presets})",
            source,
        ))
    return notes


def host_report(data: Mapping[str, Any], host: str, *, flags: Mapping[str, Any] | None = None) -> list[HostNote]:
    """What the YAML ``data`` does on ``host``.

    Args:
        data: the YAML's mapping, as the host sets it on ``args``.
        host: ``"slime"`` or ``"miles"``.
        flags: the host arguments of the launch command (:func:`parse_host_flags`); ``None`` when
            unknown — then the notes say what depends on them instead of deciding.

    Returns:
        The notes, errors first.

    Raises:
        ValueError: ``host`` is not slime or miles.
    """
    if host not in HOSTS:
        raise ValueError(f"host={host!r} is not supported; valid: {', '.join(HOSTS)}")
    notes: list[HostNote] = []
    add = notes.append
    known_flags = flags is not None
    flags = dict(flags or {})
    host_args = {**_HOST_ARGS, **(_MILES_ONLY_ARGS if host == "miles" else {})}

    # ---- YAML keys that are host arguments override the command line (set after parsing)
    for key, (flag, default) in host_args.items():
        if key not in data:
            continue
        cli = flags.get(key, default)
        said = f" (the command line gives {cli!r})" if known_flags and key in flags and flags[key] != data[key] else ""
        add(HostNote(
            "overrides_flag", key,
            f"{_NAME[host]} sets every YAML key on args after parsing its flags, so {key}: {data[key]!r} overrides "
            f"{flag}{said}; keep the setting in one place",
            _src("yaml_on_args", host),
        ))
    effective = {key: flags.get(key, default) for key, (_, default) in host_args.items()}
    effective.update({k: data[k] for k in host_args if k in data})
    use_tis = _truthy(effective["use_tis"])
    metrics = _truthy(effective["get_mismatch_metrics"])
    bypass = _truthy(effective["use_rollout_logprobs"])

    # ---- is the function called at all?
    mis_keys = sorted(k for k in data if str(k).startswith(_MIS_PREFIXES) and k not in host_args)
    if "use_tis" in data and not _truthy(data["use_tis"]):
        if known_flags and not metrics:
            add(HostNote(
                "error", "use_tis",
                f"use_tis: false in the YAML overrides --use-tis and {_NAME[host]} calls the TIS function only when "
                "use_tis or get_mismatch_metrics is set: the function is never called and every MIS key "
                f"({', '.join(mis_keys) or 'none'}) does nothing. Fix: use_tis: true with apply_is_weights: false "
                "for rejection without IS weights",
                _src("call_condition", host),
            ))
        else:
            add(HostNote(
                "inert", "use_tis",
                f"use_tis: false in the YAML overrides --use-tis; {_NAME[host]} calls the TIS function only when "
                "use_tis or get_mismatch_metrics is set, so without --get-mismatch-metrics every MIS key "
                f"({', '.join(mis_keys) or 'none'}) does nothing, and with it only the metrics are computed "
                "(unless rs_without_tis: true). For rejection without IS weights: use_tis: true with "
                "apply_is_weights: false",
                _src("call_condition", host),
            ))
    elif known_flags and not use_tis and not metrics and mis_keys:
        add(HostNote(
            "error", "use_tis",
            f"neither --use-tis nor --get-mismatch-metrics is on the command line and the YAML does not set "
            f"use_tis: {_NAME[host]} never calls the TIS function, so {', '.join(mis_keys)} do nothing. Fix: --use-tis",
            _src("call_condition", host),
        ))
    metrics_only = (known_flags or "use_tis" in data) and not use_tis and (metrics or not known_flags)
    if metrics_only and not _truthy(data.get("rs_without_tis")):
        for key in _METRICS_ONLY_INERT:
            if key in data and data[key] not in (None, False):
                add(HostNote(
                    "inert", key,
                    f"{key} does nothing while use_tis is false (metrics only: loss and masks unchanged); "
                    "rs_without_tis: true makes rejection and vetoes act with weights 1",
                    "docs/hosts.md modes.metrics_only",
                ))

    # ---- the host's own bound flags
    custom = effective.get("custom_tis_function_path")
    for flag, key in _BOUND_FLAG_KEYS.items():
        flag_value = data.get(flag, flags.get(flag))
        if flag_value is None:
            continue
        number = _number(flag_value)
        if number is None:
            add(HostNote("error", flag, f"{flag}={flag_value!r} must be a number", _src("tis_clip_flags", host)))
            continue
        if flag == "tis_clip_low" and number == 0.0:
            continue  # the hosts' "no lower bound"
        mine = data.get(key)
        if mine is not None and _number(mine) != number:
            add(HostNote(
                "error", flag,
                f"{flag}={flag_value!r} (the host's --{flag.replace('_', '-')}) and {key}={mine!r} both set the IS "
                f"{'upper' if key == 'tis_upper_bound' else 'lower'} bound and disagree; keep one of them",
                "docs/hosts.md bound_conflicts",
            ))
        elif flag == "tis_clip_low" and data.get("tis_mode") == "truncate":
            add(HostNote(
                "error", flag,
                f"tis_clip_low={flag_value!r} with tis_mode: truncate, which has no lower bound: set tis_mode: clip "
                "for the hosts' clamp(r, tis_clip_low, tis_clip), or drop tis_clip_low",
                "docs/hosts.md bound_conflicts",
            ))
        else:
            mode = " (and tis_mode: clip, as no tis_mode is set)" if flag == "tis_clip_low" and "tis_mode" not in data else ""
            add(HostNote(
                "host_meaning", flag,
                f"{_POSS[host]} own {flag}={flag_value!r} is read by megatron-mis as {key}{mode}, the bound of the "
                f"host's built-in clamp(r, tis_clip_low, tis_clip)",
                _src("builtin_tis_reads_tis_clip", host) + "; docs/hosts.md host_bound_flags",
            ))
    for key, flag in (("tis_upper_bound", "tis_clip"), ("tis_lower_bound", "tis_clip_low")):
        if key in data and flag not in data and flag not in flags:
            add(HostNote(
                "ignored_bound", flag,
                f"{key}={data[key]!r} is the bound; {_POSS[host]} --{flag.replace('_', '-')} (default "
                f"{_HOST_ARGS[flag][1]}) is read only by its built-in TIS, which --custom-tis-function-path "
                "replaces" + ("" if known_flags else f"; a --{flag.replace('_', '-')} other than its default that "
                              f"disagrees with {key} is an error at the first call"),
                _src("custom_function_replaces_builtin", host),
            ))
    if known_flags and custom is None and any(str(k).startswith(_MIS_PREFIXES) for k in data):
        add(HostNote(
            "error", "custom_tis_function_path",
            f"no --custom-tis-function-path: {_NAME[host]} runs its built-in vanilla TIS (clamp(r, tis_clip_low, "
            "tis_clip)) and reads none of the MIS keys. Fix: --custom-tis-function-path "
            "megatron_mis.compute_mis_weights_with_cp",
            _src("custom_function_replaces_builtin", host),
        ))

    # ---- bypass: pi_old := pi_rollout, the PPO ratio already holds pi_theta / pi_rollout
    if bypass:
        if use_tis and "use_tis" in data:
            add(HostNote(
                "host_meaning", "use_tis",
                f"use_tis: true in the YAML with --use-rollout-logprobs passes {_POSS[host]} own check that refuses the "
                "two together (it runs before the YAML is applied); megatron-mis treats it as bypass mode: "
                "IS weights 1, rejection and vetoes act",
                _src("bypass_excludes_use_tis_check", host),
            ))
        for key in _BYPASS_INERT:
            if key in data and data[key] not in (None, False):
                add(HostNote(
                    "inert", key,
                    f"{key} does nothing with --use-rollout-logprobs (bypass): the PPO ratio is already "
                    "pi_theta / pi_rollout, so the IS weight is 1 (never applied twice)",
                    _src("bypass_train_log_probs", host) + "; docs/hosts.md modes.bypass",
                ))
        rejection = [k for k in _RATIO_REJECTION if k in data and data[k] not in (None, False)]
        if host == "miles" and rejection and not metrics:
            add(HostNote(
                "error", rejection[0],
                f"{', '.join(rejection)} need the trainer's log-probs, but Miles passes train_log_probs=None with "
                "--use-rollout-logprobs unless --get-mismatch-metrics is set (the first call raises). Fix: "
                "--get-mismatch-metrics",
                _src("bypass_train_log_probs", host) + "; docs/hosts.md modes.bypass",
            ))

    # ---- a sequence-level PPO ratio (GSPO) with token-level IS weights or rejection
    estimator = effective.get("advantage_estimator")
    if estimator in SEQUENCE_RATIO_ESTIMATORS and (use_tis or (metrics and _truthy(data.get("rs_without_tis")))):
        for note in _sequence_ratio_notes(data, host, estimator, weights=use_tis and not bypass):
            add(note)

    # ---- keys whose host meaning differs from megatron-mis' engine
    if _truthy(data.get("tis_batch_normalize")) and "tis_batch_normalize_over" not in data:
        add(HostNote(
            "host_meaning", "tis_batch_normalize",
            "normalises over ALL loss-mask tokens / sequences, rejected ones included (the hosts' mis.py); "
            "tis_batch_normalize_over: kept gives megatron-mis' mean over the survivors of rejection",
            "docs/hosts.md host_meanings.tis_batch_normalize",
        ))
        if data.get("tis_level") in ("sequence", "geometric") and data.get("tis_batch_normalize_scope", "micro_batch") != "global":
            add(HostNote(
                "host_meaning", "tis_batch_normalize_scope",
                f"{data['tis_level']}-level weights normalised per micro-batch: with --use-dynamic-batch-size and "
                "long responses a micro-batch can hold one sequence, whose weight then becomes exactly 1. "
                "tis_batch_normalize_scope: global normalises over the whole step",
                "docs/hosts.md host_meanings.tis_batch_normalize",
            ))
    if data.get("rs_veto_threshold") is not None and not _truthy(data.get("use_rs")) and not _truthy(data.get("rs_veto_without_rs")):
        add(HostNote(
            "inert", "rs_veto_threshold",
            "acts only inside rejection sampling on the hosts (use_rs: true); rs_veto_without_rs: true makes it "
            "act without RS",
            "docs/hosts.md host_meanings.rs_veto_threshold",
        ))
    if data.get("tis_mode") == "mask":
        add(HostNote(
            "host_meaning", "tis_mode",
            "mask removes an out-of-band token / sequence from the loss mask (no denominator, entropy or KL "
            f"term); {_POSS[host]} IcePop keeps it in the mask with weight 0: that is tis_mode: icepop "
            "(token level; with an entropy bonus, a KL loss or Miles without rollout_mask_sums the two losses differ)",
            _src("icepop_keeps_mask", host) + "; docs/hosts.md host_meanings.tis_mode",
        ))

    # ---- keys that need a hook or a patch
    if data.get("tis_batch_normalize_scope") == "global" and _truthy(data.get("tis_batch_normalize", False)):
        if host == "slime":
            hook = effective.get("rollout_data_postprocess_path")
            kind = "error" if known_flags and hook != _SLIME_HOOK else "needs_hook"
            given = known_flags and hook == _SLIME_HOOK
            add(HostNote(
                kind, "tis_batch_normalize_scope",
                f"global needs the per-rollout mean from --rollout-data-postprocess-path {_SLIME_HOOK}"
                + (f" (the command line gives {hook!r})" if kind == "error" else " (given)" if given else "")
                + "; with log-prob reuse (one optimizer step per rollout, kl_coef 0, no --get-mismatch-metrics) "
                "rollout_data has no log_probs then and the first call raises: add --get-mismatch-metrics or use "
                "tis_batch_normalize_scope: micro_batch",
                _src("rollout_data_hook", host) + "; " + _src("log_prob_reuse", host),
            ))
        elif _truthy(effective.get("skip_actor_forward_only")):
            add(HostNote(
                "error", "tis_batch_normalize_scope",
                "global needs pi_old before training, but --skip-actor-forward-only skips its recompute "
                "(rollout_data has no log_probs; the first call raises). Fix: drop --skip-actor-forward-only or "
                "use tis_batch_normalize_scope: micro_batch",
                _src("log_prob_reuse", host) + "; docs/hosts.md modes.log_prob_reuse",
            ))
        else:
            add(HostNote(
                "needs_hook", "tis_batch_normalize_scope",
                f"global needs {_MILES_NORMALIZER_PATCH} (Miles calls its rollout-data hook without the data); "
                "with --skip-actor-forward-only rollout_data has no log_probs and the first call raises",
                _src("rollout_data_hook", host) + "; " + _src("log_prob_reuse", host),
            ))
    for key in ("length_decay_enabled", "monitor_enabled"):
        if not _truthy(data.get(key)):
            continue
        if host == "miles":
            where = f"{_MILES_LENGTH_PATCH} (apply it before the normaliser patch)"
        elif key == "length_decay_enabled":
            where = (
                f"--rollout-data-postprocess-path {_SLIME_HOOK} (the response lengths) and "
                "--custom-megatron-before-train-step-hook-path megatron_mis.integrations.slime.before_train_step, "
                f"or {_SLIME_LENGTH_PATCH} instead of the step hook (checkpointed schedule)"
            )
        else:
            where = f"--rollout-data-postprocess-path {_SLIME_HOOK} and {_SLIME_LENGTH_PATCH} (it feeds the monitor)"
        add(HostNote("needs_hook", key, f"needs {where}", _src("rollout_data_hook", host)))
    if host == "miles" and _truthy(effective.get("skip_actor_forward_only")):
        hooks = [k for k in ("rollout_data_postprocess_path", "custom_megatron_before_train_step_hook_path") if effective.get(k)]
        if hooks:
            add(HostNote(
                "error", "skip_actor_forward_only",
                f"Miles refuses --skip-actor-forward-only together with {', '.join('--' + h.replace('_', '-') for h in hooks)}",
                _src("skip_forward_refuses_hooks", host),
            ))

    notes.sort(key=lambda n: not n.is_error)
    return notes
