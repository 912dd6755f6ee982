"""``MISConfig``: what the importance-sampling / rejection-sampling engine does.

The first eleven keys are the ones slime and Miles already read from ``mis.yaml`` (same names,
same meaning); the rest are added by megatron-mis. See ``configs/mis.yaml`` for a commented file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_mis.config.base import ConfigBase, ConfigError, Interval, _check_namespace, doc, load_yaml_mapping

__all__ = ["MISConfig", "Level", "ISMode", "MAX_LOG_RATIO_BOUND", "HOST_KEYS", "HOST_BOUND_FLAGS", "resolve_host_bound_flags"]

Level = Literal["token", "sequence", "geometric"]
ISMode = Literal["truncate", "clip", "mask"]

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
        "whose ratio at rs_level lies outside [rs_lower_bound, rs_upper_bound]. Independent of use_tis.",
    )
    tis_level: Level = doc(
        "token",
        "IS weight level: token (r_t), sequence (prod r_t) or geometric (exp(mean log r_t)).",
    )
    rs_level: Level = doc("token", "Level at which rejection sampling compares the ratio with its bounds.")
    tis_mode: ISMode = doc(
        "truncate",
        "truncate: min(w, U) (TIS); clip: clamp(w, L, U); mask: keep w inside [L, U], reject the "
        "token or sequence (by tis_level) outside (MIS / IcePop).",
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
            (self.use_rs and self.rs_level == "token")
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
        if self.use_rs and not self.rs_lower < self.rs_upper:
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
            if getattr(args, flag, None) is not None and not _same_number(getattr(args, flag), default)
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
