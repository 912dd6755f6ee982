"""``MISConfig``: what the importance-sampling / rejection-sampling engine does.

The first eleven keys are the ones slime and Miles already read from ``mis.yaml`` (same names,
same meaning); the rest are added by megatron-mis. See ``configs/mis.yaml`` for a commented file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

from megatron_mis.config.base import ConfigBase, ConfigError, Interval, _check_namespace, doc, load_yaml_mapping
from megatron_mis.registry import Registry, RegistryKeyError

__all__ = [
    "MISConfig", "Level", "ISMode", "RSCriterion", "RSCriterionSpec", "RS_CRITERIA", "RSBound", "MAX_LOG_RATIO_BOUND",
    "ZSCORE_BATCH_K3", "ZSCORE_DEFAULT_Z", "ZSCORE_K3_FLOOR",
    "HOST_KEYS", "HOST_BOUND_FLAGS", "resolve_host_bound_flags",
]

Level = Literal["token", "sequence", "geometric"]
#: truncate / clip / mask (out of band: out of the loss mask) / icepop (token level only, Miles'
#: ``icepop_function``: out of band: weight 0, the token stays in the loss mask)
ISMode = Literal["truncate", "clip", "mask", "icepop"]
#: IS modes that only exist at token level, and the levels they allow.
TOKEN_ONLY_MODES = {"icepop": ("token",)}

#: Divergence rejection criteria (verl's rollout_rs options), with
#: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, r = pi_train / pi_rollout.
RSCriterion = Literal[
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
    "seq_zscore_k1",
]


class RSCriterionSpec(NamedTuple):
    """What a divergence criterion measures.

    Attributes:
        name: the criterion's name (``seq_mean_k3``).
        reduce: ``token`` (each token on its own), ``sum``, ``mean`` or ``max`` over the
            sequence's valid loss-mask tokens, or ``zscore`` (``seq_zscore_k1``: the mean log r
            in standard deviations of its own length, a geometric band that scales with length).
        k: the estimator, 1, 2 or 3.
    """

    name: str
    reduce: str
    k: int

    @property
    def token_level(self) -> bool:
        return self.reduce == "token"

    @property
    def is_band(self) -> bool:
        """k1 criteria take a ratio band ``[lower, upper]`` (``seq_zscore_k1`` a reference K3 and a z
        bound); k2 / k3 an upper bound only."""
        return self.k == 1 and self.reduce != "zscore"


#: The registry of divergence criteria (one entry per name of :data:`RSCriterion`).
RS_CRITERIA: Registry[RSCriterionSpec] = Registry("rejection criterion")
for _name in get_args(RSCriterion):
    _reduce, _k = _name.rsplit("_k", 1)
    RS_CRITERIA.register(_name, RSCriterionSpec(_name, {"token": "token", "seq_sum": "sum", "seq_mean": "mean", "seq_max": "max", "seq_zscore": "zscore"}[_reduce], int(_k)))


class RSBound(NamedTuple):
    """One resolved criterion of ``rs_criteria``: a k1 criterion keeps ``lower <= ratio <= upper``
    (the ratio of its level: ``r_t``, ``prod r_t`` or ``exp(mean log r_t)``); a k2 / k3 criterion
    keeps ``value <= upper`` (``lower`` is 0, unused). ``seq_zscore_k1`` keeps
    ``|mean log r_t + K3| <= upper x sqrt(2 K3 / n)`` over the sequence's ``n`` valid tokens, with
    ``lower`` the reference ``K3`` (:data:`ZSCORE_BATCH_K3`: this call's measured K3)."""

    name: str
    lower: float
    upper: float

#: ``RSBound.lower`` of ``seq_zscore_k1`` with ``k3: batch``: the reference K3 is measured on the
#: call's own valid tokens (a fixed reference K3 is > 0).
ZSCORE_BATCH_K3 = 0.0
#: ``k3: batch`` measures at least this K3: below it the log-ratios are float32 rounding (the
#: monitor's default floor on ``mis_k3_kl``), and a band of width 0 would reject rounding.
ZSCORE_K3_FLOOR = 1e-8
#: The z bound of ``seq_zscore_k1`` when the mapping gives none.
ZSCORE_DEFAULT_Z = 3.0

#: exp(x) overflows float32 just above 88; keep every exponent well inside.
MAX_LOG_RATIO_BOUND = 80.0

_F32_MAX = 3.4028234663852886e38  # largest finite float32

_RATIO_BOUNDS = ("tis_lower_bound", "tis_upper_bound", "rs_lower_bound", "rs_upper_bound")

#: Keys slime and Miles already use in ``mis.yaml``.
HOST_KEYS = (
    "use_tis",
    "use_rs",
    "tis_level",
    "rs_level",
    "tis_mode",
    "tis_lower_bound",
    "tis_upper_bound",
    "rs_lower_bound",
    "rs_upper_bound",
    "rs_veto_threshold",
    "tis_batch_normalize",
)

#: slime's / Miles' own IS bound flags (``--tis-clip``, ``--tis-clip-low``; the same names in the
#: YAML): ``{flag: (the hosts' default, the MIS key it sets)}``. Their built-in TIS function is
#: ``clamp(r, tis_clip_low, tis_clip)`` (slime loss.py:897, Miles loss_hub/corrections.py:24).
HOST_BOUND_FLAGS = {"tis_clip": (2.0, "tis_upper_bound"), "tis_clip_low": (0.0, "tis_lower_bound")}


@dataclass(kw_only=True, slots=True)
class MISConfig(ConfigBase):
    """Importance sampling (IS), rejection sampling (RS), veto and self-normalisation settings.

    With r_t = pi_train(y_t) / pi_rollout(y_t): token level uses r_t, sequence level prod r_t,
    geometric level exp(mean log r_t) over the sequence's loss-mask tokens.
    """

    # ---- keys shared with slime / Miles -------------------------------------------------------
    use_tis: bool = doc(
        False,
        "Apply importance-sampling weights pi_train/pi_rollout to the policy loss. Off: weights are 1 "
        "(metrics, rejection and veto still work).",
    )
    use_rs: bool = doc(
        False,
        "Rejection sampling: drop tokens (rs_level=token) or whole sequences (sequence/geometric) "
        "whose ratio at rs_level lies outside [rs_lower_bound, rs_upper_bound], or, when rs_criteria is "
        "set, that fail one of those divergence criteria. Independent of use_tis.",
    )
    tis_level: Level = doc(
        "token",
        "IS weight level: token (r_t), sequence (prod r_t) or geometric (exp(mean log r_t)).",
    )
    rs_level: Level = doc("token", "Level at which rejection sampling compares the ratio with its bounds.")
    tis_mode: ISMode = doc(
        "truncate",
        "truncate: min(w, U) (TIS); clip: clamp(w, L, U); mask: keep w inside [L, U], reject the "
        "token or sequence (by tis_level) outside: it leaves the loss mask (MIS); icepop (token level "
        "only, Miles' icepop_function): w inside [L, U], weight 0 outside, and the token stays in the "
        "loss mask (denominators, entropy and KL terms keep it; counted in mis_tis_zero_weight_fraction_*).",
    )
    tis_lower_bound: float | None = doc(
        None, "L for clip and mask modes; null means 1/tis_upper_bound. Unused by truncate."
    )
    tis_upper_bound: float = doc(2.0, "U: the upper bound of the IS weight in every mode.")
    rs_lower_bound: float | None = doc(None, "RS lower bound; null means the resolved tis_lower_bound.")
    rs_upper_bound: float | None = doc(None, "RS upper bound; null means tis_upper_bound.")
    rs_veto_threshold: float | None = doc(
        None,
        "Per-token ratio veto: reject the whole sequence if any kept token has r_t below this value "
        "(e.g. 1.0e-4). Works with or without use_rs. null: off.",
    )
    tis_batch_normalize: bool = doc(
        False,
        "Self-normalise the IS weights to mean 1 over the tokens (token level) or sequences "
        "(sequence/geometric level) named by tis_batch_normalize_over. Needs use_tis.",
    )

    # ---- added by megatron-mis -----------------------------------------------------------------
    tis_batch_normalize_scope: Literal["micro_batch", "global"] = doc(
        "micro_batch",
        "Where the self-normalisation mean is taken: micro_batch (this call's sequences, exact under "
        "context parallelism) or global (the whole step's batch across data-parallel ranks; needs the "
        "per-step statistics entry point, see README).",
    )
    tis_batch_normalize_over: Literal["loss_mask", "kept"] = doc(
        "loss_mask",
        "Which weights the self-normalisation mean is taken over. loss_mask: every loss-mask token "
        "(token level) or every sequence with one (sequence/geometric level), rejected ones included "
        "with their bounded weight: slime's and Miles' mis.py. kept: only the tokens / sequences that "
        "survive rejection (megatron-mis' earlier meaning). Read by the host drop-ins and "
        "compute_global_normalizer; the engine called directly (compute_mis, MegatronRLLoss) uses kept.",
    )
    rs_veto_without_rs: bool = doc(
        False,
        "Host drop-ins: false (the hosts' meaning): rs_veto_threshold acts only with use_rs: true, and "
        "is inert (with a warning) without it. true: the ratio veto acts without rejection sampling too.",
    )
    apply_is_weights: bool = doc(
        True,
        "Host drop-ins: false keeps use_tis: true (so slime / Miles call the function) but every IS "
        "weight is 1: only rejection sampling and the vetoes act (e.g. geometric RS alone).",
    )
    log_ratio_bound: float = doc(
        20.0,
        "Every log-ratio (token, sequence sum or geometric mean) is clamped to [-bound, bound] before "
        "exp, so nothing overflows (exp(20) ~ 4.9e8). At most 80.",
    )
    nonfinite_policy: Literal["neutralize", "reject", "error"] = doc(
        "neutralize",
        "NaN or +-inf train/rollout log-probs on loss-mask tokens: neutralize (ratio 1, counted in "
        "mis_nonfinite_token_fraction, a warning gives the count), reject (drop the token from the "
        "loss mask, counted) or error (raise).",
    )
    prob_veto_threshold: float | None = doc(
        None,
        "Probability veto: reject the whole sequence if any kept token's probability under "
        "prob_veto_source is below this value (Let Speed Be With Stability (lmsys.org/blog/2026-01-16-training-inference-mismatch)'s 'near-zero probability' reading). null: off.",
    )
    prob_veto_source: Literal["rollout", "train"] = doc(
        "rollout", "Which policy's token probability the probability veto looks at."
    )

    # ---- engine output and speed (megatron-mis) -------------------------------------------------
    mis_metrics: Literal["standard", "full", "none"] = doc(
        "standard",
        "Which metrics the engine builds: standard (every metric a dashboard plots, the hosts' names "
        "with the hosts' definitions), full (standard plus rarely read ones: megatron-mis' kept-token "
        "variants of the final-weight statistics and of the after-bound weight) or none (weights and "
        "masks only: the fastest path; the host drop-ins then return an empty metrics dict).",
    )
    compile_engine: bool = doc(
        False,
        "Run the engine's token and sequence stages through torch.compile(fullgraph=True, "
        "dynamic=True); the first call of a process compiles (seconds to minutes; inductor needs a C++ "
        "compiler on a CPU, Triton on a GPU). On a 2-core CPU, at every batch size measured (1k to 553k "
        "tokens), it ran every statistic 1.1-2.4x faster than eager and weights only 0.99-1.5x "
        "(benchmarks/README.md); not yet timed on a GPU.",
    )
    rs_without_tis: bool = doc(
        False,
        "Host drop-ins only: slime and Miles also call the TIS function when only "
        "--get-mismatch-metrics is set (use_tis false); by default that call reports metrics and "
        "leaves the loss and masks unchanged (use_rs and the vetoes then have no effect, with a "
        "warning). true: apply rejection sampling and the vetoes in that case too (weights stay 1).",
    )
    rs_criteria: dict[str, Any] = doc(
        {},
        "Divergence rejection criteria (verl's rollout_rs), applied by use_rs: true in place of the ratio "
        "band at rs_level; every criterion listed must pass. A mapping {criterion: threshold}: token_k1, "
        "seq_sum_k1, seq_mean_k1 take a ratio band [lower, upper] of r_t, prod r_t, exp(mean log r_t) (the "
        "band at token / sequence / geometric level; one number U means [1/U, U]); token_k2, token_k3, "
        "seq_sum_k2/k3, seq_mean_k2/k3, seq_max_k2/k3 take an upper bound of k2 = (log r)^2/2 or "
        "k3 = r - 1 - log r (per token, or the sum / mean / max over the sequence's valid loss-mask tokens). "
        "seq_zscore_k1 is the geometric band that scales with length: {k3: K, z: Z} rejects a sequence of n valid "
        "tokens whose mean log r lies more than Z x sqrt(2 K / n) from -K (K: the mismatch's mean per-token K3, a "
        "number or 'batch' for this call's measured one; Z default 3; one number means {k3: number}). "
        "E.g. {seq_mean_k3: 0.005, seq_max_k3: 2.0}. Empty: the ratio band. docs/engine.md says which to choose.",
    )

    # ---------------------------------------------------------------------------- resolved bounds
    @property
    def tis_lower(self) -> float:
        """Resolved IS lower bound (``1 / tis_upper_bound`` when unset)."""
        return self.tis_lower_bound if self.tis_lower_bound is not None else 1.0 / self.tis_upper_bound

    @property
    def rs_lower(self) -> float:
        """Resolved RS lower bound."""
        return self.rs_lower_bound if self.rs_lower_bound is not None else self.tis_lower

    @property
    def rs_upper(self) -> float:
        """Resolved RS upper bound."""
        return self.rs_upper_bound if self.rs_upper_bound is not None else self.tis_upper_bound

    @property
    def normalizes(self) -> bool:
        """Whether weights are self-normalised."""
        return self.use_tis and self.tis_batch_normalize

    def rs_bounds(self) -> tuple[RSBound, ...]:
        """The divergence criteria rejection sampling applies (``()`` without ``use_rs`` or with
        an empty ``rs_criteria``, where the ratio band at ``rs_level`` applies), in the order given."""
        if not self.use_rs or not self.rs_criteria:
            return ()
        bounds, _ = _parse_criteria(self.rs_criteria)
        return tuple(bounds)

    @property
    def rs_band(self) -> bool:
        """Whether rejection sampling compares the ratio at ``rs_level`` with ``[rs_lower_bound,
        rs_upper_bound]`` (``use_rs`` without ``rs_criteria``)."""
        return self.use_rs and not self.rs_criteria

    @property
    def rejects(self) -> bool:
        """Whether this config can remove tokens or sequences from the loss mask."""
        return (
            self.use_rs
            or (self.use_tis and self.tis_mode == "mask")
            or self.rs_veto_threshold is not None
            or self.prob_veto_threshold is not None
            or self.nonfinite_policy == "reject"
        )

    @property
    def token_rejects(self) -> bool:
        """Whether single tokens (not only whole sequences) can be rejected."""
        return (
            (self.rs_band and self.rs_level == "token")
            or any(RS_CRITERIA.get(b.name).token_level for b in self.rs_bounds())
            or (self.use_tis and self.tis_mode == "mask" and self.tis_level == "token")
            or self.nonfinite_policy == "reject"
        )

    # --------------------------------------------------------------------------------- checks
    #: Ranges of the numeric keys (checked, and named in type errors, by ConfigBase).
    _RANGES = {
        **{name: Interval(low=0.0, reason="a ratio bound") for name in _RATIO_BOUNDS},
        "rs_veto_threshold": Interval(low=0.0, high=1.0),
        "prob_veto_threshold": Interval(low=0.0, high=1.0),
        "log_ratio_bound": Interval(
            low=0.0, high=MAX_LOG_RATIO_BOUND, high_open=False, reason="exp overflows float32 near 88"
        ),
    }

    def _check(self) -> list[str]:
        """Cross-field rules (ranges are in ``_RANGES``). The IS bounds are compared only where IS
        uses both (use_tis with clip / mask), the RS bounds only where RS is on: a bound that
        nothing reads cannot be wrong (``use_tis, tis_upper_bound=1.0`` truncates at 1)."""
        problems = []
        for name in _RATIO_BOUNDS:
            value = getattr(self, name)
            if value is not None and not 1.0 / _F32_MAX <= value <= _F32_MAX:
                problems.append(
                    f"{name}={value!r} must lie in [{1.0 / _F32_MAX:.4g}, {_F32_MAX:.4g}] (float32, in which the "
                    "weights are computed, must hold the bound and its reciprocal)"
                )
        if problems:
            return problems
        if self.use_tis and self.tis_mode != "truncate" and not self.tis_lower < self.tis_upper_bound:
            problems.append(
                f"tis_lower_bound={self.tis_lower!r} must be < tis_upper_bound={self.tis_upper_bound!r}"
                + (" (unset, it is 1/tis_upper_bound)" if self.tis_lower_bound is None else "")
            )
        allowed_levels = TOKEN_ONLY_MODES.get(self.tis_mode)
        if allowed_levels is not None and self.tis_level not in allowed_levels:
            problems.append(
                f"tis_mode={self.tis_mode!r} is token-level only (Miles' icepop_function weighs each token): "
                f"tis_level={self.tis_level!r} is not allowed with it; allowed tis_level: "
                + ", ".join(repr(x) for x in allowed_levels)
                + " (for a sequence-level band use tis_mode: mask, which rejects the sequence)"
            )
        criteria_bounds, criteria_problems = _parse_criteria(self.rs_criteria)
        problems += criteria_problems
        if self.rs_criteria and self.use_rs and not criteria_problems:
            ignored = [f"{n}={getattr(self, n)!r}" for n in ("rs_lower_bound", "rs_upper_bound") if getattr(self, n) is not None]
            if self.rs_level != "token":
                ignored.append(f"rs_level={self.rs_level!r}")
            if ignored:
                problems.append(
                    f"{', '.join(ignored)} set together with rs_criteria: with rs_criteria the ratio band is not "
                    "applied (it would be silently ignored); write the band as a k1 criterion of its level "
                    "(token_k1, seq_sum_k1 or seq_mean_k1: [lower, upper]) in rs_criteria, or drop rs_criteria"
                )
        if self.rs_band and not self.rs_lower < self.rs_upper:
            # name the keys the values come from: an unset RS bound is the IS bound's value
            low = f"rs_lower_bound={self.rs_lower!r}"
            if self.rs_lower_bound is None:
                low += (f" (unset: tis_lower_bound={self.tis_lower_bound!r})" if self.tis_lower_bound is not None
                        else " (unset: 1/tis_upper_bound, as tis_lower_bound is unset)")
            high = f"rs_upper_bound={self.rs_upper!r}"
            if self.rs_upper_bound is None:
                high += f" (unset: tis_upper_bound={self.tis_upper_bound!r})"
            problems.append(f"{low} must be < {high} (unset RS bounds default to the IS bounds)")
        if self.tis_batch_normalize and not self.use_tis:
            problems.append(
                "tis_batch_normalize=true has nothing to normalise: use_tis is false, so every weight is 1 "
                "(set use_tis: true or tis_batch_normalize: false)"
            )
        if self.tis_batch_normalize and not self.apply_is_weights:
            problems.append(
                "tis_batch_normalize=true has nothing to normalise: apply_is_weights is false, so every weight is 1 "
                "(set tis_batch_normalize: false)"
            )
        if (self.use_rs and not criteria_problems and self.tis_batch_normalize_scope == "global"
                and self.tis_batch_normalize_over == "kept"
                and any(b.name == "seq_zscore_k1" and b.lower == ZSCORE_BATCH_K3 for b in criteria_bounds)):
            problems.append(
                "rs_criteria: seq_zscore_k1 with k3: batch measures K3 per call (micro-batch), but the global "
                "normaliser (tis_batch_normalize_scope='global', tis_batch_normalize_over='kept') decides what is kept "
                "over the whole step at once, so the two would keep different sequences: give k3 a number (your "
                "measured mis_k3_kl), or use tis_batch_normalize_over: loss_mask or scope micro_batch"
            )
        if self.tis_batch_normalize_scope == "global" and not self.tis_batch_normalize:
            problems.append(
                "tis_batch_normalize_scope='global' needs tis_batch_normalize: true"
            )
        return problems

    def _warnings(self) -> list[str]:
        out = []
        if self.use_tis and self.tis_mode == "truncate" and self.tis_lower_bound is not None:
            out.append(
                f"tis_lower_bound={self.tis_lower_bound!r} has no effect in tis_mode='truncate' "
                "(truncate only caps at tis_upper_bound); it is still the default for rs_lower_bound"
            )
        if not self.use_rs and self.rs_criteria:
            out.append(f"rs_criteria={dict(self.rs_criteria)!r} has no effect because use_rs is false")
        if not self.use_rs:
            for name in ("rs_lower_bound", "rs_upper_bound"):
                if getattr(self, name) is not None:
                    out.append(f"{name}={getattr(self, name)!r} has no effect because use_rs is false")
        if not self.use_tis:
            changed = [
                n for n in ("tis_level", "tis_mode", "tis_lower_bound")
                if getattr(self, n) != _DEFAULTS[n]
            ]
            if changed:
                out.append(f"{', '.join(changed)} set but use_tis is false: IS weights are all 1")
        return out

    # ------------------------------------------------------------------------------- loading
    @classmethod
    def from_host_args(cls, args: Any) -> "MISConfig":
        """Build from a slime / Miles ``args`` namespace.

        The host sets every key of ``--custom-config-path`` on ``args`` without checking it, so the
        YAML file (when ``args.custom_config_path`` names one, or holds Miles' inline
        ``base64:`` payload) is read again and any key that looks like a misspelt MIS key is
        reported, together with every other problem. The hosts' own bound flags ``tis_clip`` /
        ``tis_clip_low`` are honoured (:func:`resolve_host_bound_flags`).
        """
        import types

        _check_namespace(args)
        problems: list[str] = []
        data: dict = {}
        path = getattr(args, "custom_config_path", None)
        if path:
            try:
                data = _load_host_yaml(path)
            except (FileNotFoundError, ConfigError, ValueError) as exc:
                data = {}
                problems.append(str(exc))
            problems += unknown_mis_like_keys(data)
        values = {n: getattr(args, n) for n in cls.field_names() if getattr(args, n, None) is not None}
        flags = {
            flag: getattr(args, flag) for flag, (default, _) in HOST_BOUND_FLAGS.items()
            # set: named in the YAML (even at the host's default value), or changed on the command line
            if getattr(args, flag, None) is not None and (flag in data or not _same_number(getattr(args, flag), default))
        }
        changes, flag_problems = resolve_host_bound_flags(values, flags)
        problems += flag_problems
        values.update(changes)
        source = f"args{f' from {_short_path(path)}' if path else ''}"
        try:
            cfg = cls.from_namespace(types.SimpleNamespace(**values), source=source)
        except ConfigError as exc:
            raise ConfigError(exc.config_name, problems + exc.problems) from None
        if problems:
            raise ConfigError(cls._label(source), problems)
        return cfg


def _same_number(value: Any, default: float) -> bool:
    try:
        return float(value) == default
    except (TypeError, ValueError):
        return False


def _short_path(path: str) -> str:
    return "an inline base64 YAML" if str(path).startswith("base64:") else str(path)


def _load_host_yaml(path: str) -> dict[str, Any]:
    """The mapping of a host's ``--custom-config-path``: a file, or Miles' ``base64:<payload>``."""
    if str(path).startswith("base64:"):
        import base64
        import binascii
        import os
        import tempfile

        try:
            text = base64.b64decode(str(path)[len("base64:"):], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ValueError(f"custom_config_path: the inline base64 YAML does not decode ({exc})") from None
        fd, tmp = tempfile.mkstemp(suffix=".yaml")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return load_yaml_mapping(tmp, allow_empty=True)
        finally:
            os.unlink(tmp)
    return load_yaml_mapping(path)


def resolve_host_bound_flags(values: dict[str, Any], flags: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The MIS keys the hosts' own bound flags set, with the hosts' meaning.

    slime's and Miles' built-in TIS is ``clamp(r, tis_clip_low, tis_clip)``: ``tis_clip`` is the
    upper bound U, ``tis_clip_low`` the lower bound L (0, their default, means none). A user who
    switches to megatron-mis keeps those bounds:

    - ``tis_clip`` sets ``tis_upper_bound``; ``tis_clip_low`` sets ``tis_lower_bound`` and, when
      the YAML gives no ``tis_mode``, ``tis_mode: clip`` (the hosts' clamp);
    - a flag that disagrees with the MIS key set beside it is an error naming both, and
      ``tis_clip_low`` with ``tis_mode: truncate`` (which has no lower bound) is an error.

    Args:
        values: the MIS keys that are set (from the YAML on ``args``, or a mapping).
        flags: the host flags that are set (on ``args``: differing from the hosts' default; in a
            mapping: present).

    Returns:
        ``(changes to the MIS keys, problems)``.
    """
    changes: dict[str, Any] = {}
    problems: list[str] = []
    for flag, value in flags.items():
        if flag not in HOST_BOUND_FLAGS:
            continue
        default, key = HOST_BOUND_FLAGS[flag]
        try:
            number = float(value)
        except (TypeError, ValueError):
            problems.append(f"{flag}={value!r} must be a number (the hosts' --{flag.replace('_', '-')}, default {default})")
            continue
        if flag == "tis_clip_low" and number == 0.0:
            continue  # the hosts' "no lower bound"
        mine = values.get(key)
        if mine is not None and not _same_number(mine, number):
            problems.append(
                f"{flag}={value!r} (the host's --{flag.replace('_', '-')}) and {key}={mine!r} disagree: both set "
                f"the IS {'upper' if key == 'tis_upper_bound' else 'lower'} bound; keep one of them"
            )
            continue
        changes[key] = number
        if flag == "tis_clip_low":
            mode = values.get("tis_mode")
            if mode is None:
                changes["tis_mode"] = "clip"
            elif mode == "truncate":
                problems.append(
                    f"tis_clip_low={value!r} (the host's --tis-clip-low) has no effect with tis_mode='truncate', which "
                    "only caps at the upper bound: set tis_mode: clip for the hosts' clamp(r, tis_clip_low, tis_clip), "
                    "or drop --tis-clip-low"
                )
    return changes, problems


_DEFAULTS = {"tis_level": "token", "tis_mode": "truncate", "tis_lower_bound": None}

#: a number written in plain decimal notation: PyYAML reads ``5e-3`` as a string
_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (bools, NaN, inf and other types are not numbers)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        if not _NUMBER.fullmatch(value.strip()):
            return None
        value = value.strip()
    if not isinstance(value, (int, float, str)):
        return None
    try:
        out = float(value)
    except (OverflowError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _parse_criteria(value: Any) -> tuple[list[RSBound], list[str]]:
    """``rs_criteria`` resolved into :class:`RSBound` s, and one sentence per problem (every
    problem of the mapping, each naming the criterion, the bad value and what is allowed)."""
    if not isinstance(value, dict):
        return [], [
            f"rs_criteria={value!r:.80} must be a mapping {{criterion: threshold}}, e.g. {{seq_mean_k3: 0.005}} "
            f"(criteria: {', '.join(RS_CRITERIA.names())})"
        ]
    bounds, problems = [], []
    for name, threshold in value.items():
        try:
            spec = RS_CRITERIA.get(name)
        except RegistryKeyError as exc:
            problems.append(f"rs_criteria: {exc}")
            continue
        if spec.reduce == "zscore":
            bound, problem = _parse_zscore(name, threshold)
            if problem:
                problems.append(problem)
            else:
                bounds.append(bound)
            continue
        if spec.is_band:
            pair = threshold if isinstance(threshold, (list, tuple)) else None
            if pair is None:
                upper = _number(threshold)
                lower = None if upper is None or upper <= 1.0 else 1.0 / upper
            elif len(pair) == 2:
                lower, upper = _number(pair[0]), _number(pair[1])
            else:
                lower = upper = None
            ok = (
                lower is not None and upper is not None
                and 1.0 / _F32_MAX <= lower < upper <= _F32_MAX
            )
            if not ok:
                problems.append(
                    f"rs_criteria: {name}={threshold!r:.60} must be a ratio band [lower, upper] with "
                    f"0 < lower < upper (finite, float32 range), or one number U > 1 meaning [1/U, U]"
                )
                continue
            bounds.append(RSBound(name, float(lower), float(upper)))
        else:
            upper = _number(threshold)
            if upper is None or not 0.0 < upper <= _F32_MAX:
                problems.append(
                    f"rs_criteria: {name}={threshold!r:.60} must be one positive finite number, the upper bound of "
                    f"k{spec.k} (k2 and k3 are >= 0, so they have no lower bound)"
                )
                continue
            bounds.append(RSBound(name, 0.0, float(upper)))
    return bounds, problems


def _parse_zscore(name: str, value: Any) -> tuple[RSBound | None, str | None]:
    """``seq_zscore_k1``'s threshold: ``{k3: K, z: Z}`` (``K`` a positive number or ``'batch'``,
    ``Z`` a positive number, default 3) or one number ``K``; ``(bound, None)`` or ``(None, problem)``."""
    allowed = (
        f"must be {{k3: K, z: Z}} with K > 0 the reference mean per-token K3 (or 'batch': this call's measured K3) "
        f"and Z > 0 (default {ZSCORE_DEFAULT_Z:g}), or one number K > 0"
    )
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in ("k3", "z"))
        if unknown or "k3" not in value:
            what = f"unknown key(s) {', '.join(unknown)}" if unknown else "no k3"
            return None, f"rs_criteria: {name}={value!r:.80} has {what}: it {allowed}"
        k3_value, z_value = value["k3"], value.get("z", ZSCORE_DEFAULT_Z)
    else:
        k3_value, z_value = value, ZSCORE_DEFAULT_Z
    z = _number(z_value)
    if isinstance(k3_value, str) and k3_value.strip() == "batch":
        k3: float | None = ZSCORE_BATCH_K3
    else:
        k3 = _number(k3_value)
        k3 = k3 if k3 is not None and 0.0 < k3 <= 1e3 else None
    if k3 is None or z is None or not 0.0 < z <= 1e3:
        return None, f"rs_criteria: {name}={value!r:.80} {allowed} (K and Z at most 1000)"
    return RSBound(name, float(k3), float(z)), None


#: Prefixes of keys that belong to this config; a YAML key with one of these prefixes (or within
#: a small edit distance of a valid key) that is not a valid key is reported as a typo.
_MIS_PREFIXES = ("tis_", "rs_", "mis_", "use_tis", "use_rs", "prob_veto", "log_ratio", "nonfinite")


def unknown_mis_like_keys(data: dict[str, Any]) -> list[str]:
    """Problems for keys of a shared host YAML that look like MIS keys but are not valid ones."""
    import difflib

    valid = MISConfig.field_names() + list(HOST_BOUND_FLAGS)
    problems = []
    for key in data:
        if key in valid or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.8)
        if close or key.startswith(_MIS_PREFIXES):
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown MIS key {key!r}{hint}; valid keys: {', '.join(valid)}")
    return problems
