"""``LossConfig``: which policy loss, KL term, entropy bonus, advantage estimator and loss
aggregation the plain Megatron-Core loss uses.

Where slime already has an argument for the same concept the key has slime's name and meaning
(``eps_clip``, ``eps_clip_high``, ``eps_clip_c``, ``use_kl_loss``, ``kl_loss_coef``,
``kl_loss_type``, ``use_unbiased_kl``, ``entropy_coef``, ``use_opsm``, ``opsm_delta``,
``advantage_estimator``, ``grpo_std_normalization``, ``rollout_temperature``,
``log_probs_chunk_size``), so a slime user recognises them. The IS / RS settings are not here:
they are :class:`megatron_mis.config.mis.MISConfig`'s.

Names of losses, KL estimators and advantage estimators are checked against the built-in names
(:data:`BUILTIN_NAMES`) and against the registries defined here (:data:`POLICY_LOSSES`,
:data:`KL_ESTIMATORS`, :data:`ADVANTAGE_ESTIMATORS`), into which :mod:`megatron_mis.core.losses`,
:mod:`megatron_mis.core.kl` and :mod:`megatron_mis.core.advantages` register their functions (and
user code its own). This module never imports the math, so a config can be built and validated
without it; ``tests/unit/test_losses.py`` checks that the built-in names equal what core registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_mis.config.base import ConfigBase, doc
from megatron_mis.registry import Registry, suggest

__all__ = [
    "LossConfig",
    "AggregationMode",
    "ADVANTAGE_ESTIMATORS",
    "BUILTIN_NAMES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
]

#: Policy losses (``megatron_mis.core.losses`` registers :class:`PolicyLoss` objects).
POLICY_LOSSES: Registry[Any] = Registry("policy loss")
#: KL estimators (``megatron_mis.core.kl`` registers the functions).
KL_ESTIMATORS: Registry[Any] = Registry("KL estimator")
#: Advantage estimators (``megatron_mis.core.advantages`` registers the functions).
ADVANTAGE_ESTIMATORS: Registry[Any] = Registry("advantage estimator")

#: The names core registers, so that a config is validated without importing the math.
BUILTIN_NAMES: dict[str, tuple[str, ...]] = {
    "policy_loss": ("bypass_ppo", "cispo", "decoupled_ppo", "gspo", "ppo", "reinforce"),
    "kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
    "advantage_estimator": ("grpo", "reinforce_baseline", "rloo"),
}

AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]

_DEFAULTS = {
    "eps_clip": 0.2,
    "eps_clip_high": None,
    "eps_clip_c": None,
    "opsm_delta": 1e-4,
    "kl_loss_type": "k3",
    "grpo_std_normalization": True,
    "grpo_std_eps": 1e-6,
}


@dataclass(kw_only=True, slots=True)
class LossConfig(ConfigBase):
    """Policy loss, KL / entropy terms, advantages and aggregation (see ``docs/losses.md``)."""

    policy_loss: str = doc(
        "decoupled_ppo",
        "Registered policy loss: ppo (standard PPO against pi_old, no mismatch correction), "
        "decoupled_ppo (3-policy PPO: (pi_old/pi_rollout) x clipped pi_theta/pi_old objective), "
        "bypass_ppo (pi_rollout is the old policy; no extra IS factor), reinforce "
        "(-w x A x log pi_theta with w = pi_old/pi_rollout from the MIS engine), gspo (GSPO: w x "
        "clipped objective in the sequence ratio exp(mean log(pi_theta/pi_old)), CP-exact; slime "
        "--advantage-estimator gspo) or cispo (CISPO: -w x sg(clip(pi_theta/pi_old)) x A x log "
        "pi_theta; slime --advantage-estimator cispo).",
    )
    eps_clip: float = doc(0.2, "PPO lower clip range: the ratio is clipped below at 1 - eps_clip (slime --eps-clip).")
    eps_clip_high: float | None = doc(
        None, "PPO upper clip range: clipped above at 1 + eps_clip_high; null means eps_clip (slime --eps-clip-high)."
    )
    eps_clip_c: float | None = doc(
        None,
        "Dual-clip constant c > 1: for negative advantages the per-token loss is capped at -c x A "
        "(Dual-clip PPO, arXiv:1912.09729; slime --eps-clip-c). null: off.",
    )
    use_kl_loss: bool = doc(False, "Add kl_loss_coef x KL(pi_theta || pi_ref) to the loss (needs ref log-probs).")
    kl_loss_coef: float = doc(0.0, "Weight of the KL term (slime --kl-loss-coef).")
    kl_loss_type: str = doc(
        "k3",
        "KL estimator: k1 (log pi/pi_ref), k2 ((log pi/pi_ref)^2/2), k3 (r - 1 - log r with "
        "r = pi_ref/pi) or low_var_kl (k3 clamped to [-10, 10]). slime's default is k1.",
    )
    use_unbiased_kl: bool = doc(
        False,
        "DeepSeek-V3.2 unbiased KL: multiply the per-token KL estimate by pi_theta/pi_old, the "
        "ratio NOT detached, so its gradient is unbiased for samples from pi_old (exact for k1, k3).",
    )
    entropy_coef: float = doc(0.0, "Entropy bonus: the loss gets -entropy_coef x mean entropy (slime --entropy-coef).")
    use_opsm: bool = doc(
        False,
        "Off-policy sequence masking (DeepSeek-V3.2): drop the tokens with negative advantage of "
        "every sequence whose mean log(pi_old/pi_theta) over its loss tokens exceeds opsm_delta.",
    )
    opsm_delta: float = doc(1e-4, "OPSM threshold delta on the sequence's mean log(pi_old/pi_theta) (slime --opsm-delta).")
    advantage_estimator: str = doc(
        "grpo",
        "Registered advantage estimator: grpo (group mean/std normalised), rloo (leave-one-out "
        "baseline) or reinforce_baseline (batch-mean baseline).",
    )
    grpo_std_normalization: bool = doc(
        True, "GRPO: divide by the group's reward std (+ grpo_std_eps); false gives Dr. GRPO (slime's dest name)."
    )
    grpo_std_eps: float = doc(1e-6, "GRPO: added to the group std before dividing.")
    loss_aggregation: AggregationMode = doc(
        "token_mean",
        "token_mean: sum of token losses / global token count (slime --calculate-per-token-loss); "
        "seq_mean_token_mean: mean over each sequence's tokens, then / global sequence count "
        "(slime's default); seq_mean_token_sum: sum over each sequence's tokens / global "
        "sequence count.",
    )
    rejected_in_denominator: bool = doc(
        True,
        "Whether tokens (and sequences) rejected by RS / mask-mode IS / veto stay in the loss "
        "denominators. true: as current slime (denominators from the original loss mask); false: "
        "as Miles without rollout_mask_sums (denominators from the kept tokens only).",
    )
    nonfinite_input_policy: Literal["neutralize", "error"] = doc(
        "neutralize",
        "NaN or +-inf advantages, rewards, old or reference log-probs on loss tokens: neutralize "
        "(drop the token or sequence from the loss, counted in num_nonfinite_inputs, with a "
        "warning) or error (raise).",
    )
    ratio_log_bound: float = doc(
        20.0,
        "Log-ratios log(pi_theta/pi_old) and KL log-ratios are clamped to [-bound, bound] before "
        "exp so nothing overflows (exp(20) ~ 4.9e8; clamped tokens get no gradient through exp).",
    )
    rollout_temperature: float = doc(
        1.0, "Sampling temperature of the rollout engine: logits / T before log-softmax, as SGLang does."
    )
    log_probs_chunk_size: int = doc(
        1024, "Tokens per chunk in the vocab-parallel log-prob computation (bounds memory); -1: one chunk."
    )
    replay_entropy: Literal["full", "kept"] = doc(
        "full",
        "With a rollout support (top-p / top-k replay, RLMicroBatch.rollout_support) the log-probs are those of the "
        "distribution renormalised over the kept ids; the entropy (bonus and metric) is that of the full "
        "softmax(logits / T) (full: as slime's top-p replay, whose keep-mask reaches the log-probs only, "
        "slime/backends/megatron_utils/loss.py:531 at 624b824a; one more log-prob pass per micro-batch) or of the "
        "renormalised distribution (kept: at most log of the kept count, so an entropy bonus flattens the kept ids "
        "whatever the tail holds). No effect without a support.",
    )

    @classmethod
    def from_namespace(cls, namespace: Any, *, source: str | None = None) -> "LossConfig":
        """As :meth:`ConfigBase.from_namespace`, plus slime's way of choosing GSPO / CISPO: slime
        selects them by ``--advantage-estimator gspo | cispo`` and computes GRPO advantages for
        both (``slime/backends/megatron_utils/loss.py:763`` at 624b824a). Without a
        ``policy_loss`` attribute such a namespace gives ``policy_loss`` gspo / cispo with
        ``advantage_estimator`` grpo."""
        estimator = getattr(namespace, "advantage_estimator", None)
        if estimator in ("gspo", "cispo") and getattr(namespace, "policy_loss", None) is None:
            namespace = _Overlay(namespace, policy_loss=estimator, advantage_estimator="grpo")
        return ConfigBase.from_namespace.__func__(cls, namespace, source=source)

    @property
    def eps_high(self) -> float:
        """Resolved upper clip range (``eps_clip_high`` or ``eps_clip``)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def kl_active(self) -> bool:
        """Whether the KL term is part of the loss."""
        return self.use_kl_loss and self.kl_loss_coef != 0.0

    def _check(self) -> list[str]:
        problems: list[str] = []
        if not 0.0 <= self.eps_clip <= 1.0:
            problems.append(f"eps_clip={self.eps_clip!r} must lie in [0, 1] (the lower clip bound is 1 - eps_clip)")
        if self.eps_clip_high is not None and not self.eps_clip_high >= 0.0:
            problems.append(f"eps_clip_high={self.eps_clip_high!r} must be >= 0, or null")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            problems.append(f"eps_clip_c={self.eps_clip_c!r} must be > 1 (dual-clip constant), or null")
        if not self.kl_loss_coef >= 0.0:
            problems.append(f"kl_loss_coef={self.kl_loss_coef!r} must be >= 0")
        if not self.entropy_coef >= 0.0:
            problems.append(f"entropy_coef={self.entropy_coef!r} must be >= 0 (it is a bonus)")
        if not self.opsm_delta >= 0.0:
            problems.append(f"opsm_delta={self.opsm_delta!r} must be >= 0")
        if not self.grpo_std_eps > 0.0:
            problems.append(f"grpo_std_eps={self.grpo_std_eps!r} must be > 0")
        if not 0.0 < self.ratio_log_bound <= 80.0:
            problems.append(f"ratio_log_bound={self.ratio_log_bound!r} must lie in (0, 80] (exp overflows float32 near 88)")
        if not self.rollout_temperature > 0.0:
            problems.append(f"rollout_temperature={self.rollout_temperature!r} must be > 0")
        if self.log_probs_chunk_size != -1 and self.log_probs_chunk_size < 1:
            problems.append(f"log_probs_chunk_size={self.log_probs_chunk_size!r} must be >= 1, or -1 (no chunking)")
        problems += _registry_problems(self)
        return problems

    def _warnings(self) -> list[str]:
        out: list[str] = []
        if self.kl_loss_coef != 0.0 and not self.use_kl_loss:
            out.append(f"kl_loss_coef={self.kl_loss_coef!r} has no effect because use_kl_loss is false")
        if self.use_kl_loss and self.kl_loss_coef == 0.0:
            out.append("use_kl_loss is true but kl_loss_coef is 0: the KL term is not added")
        if self.use_unbiased_kl and not self.use_kl_loss:
            out.append("use_unbiased_kl has no effect because use_kl_loss is false")
        if self.use_unbiased_kl and self.kl_loss_type == "k2":
            out.append(
                "use_unbiased_kl with kl_loss_type='k2': pi_theta/pi_old x k2 is not an unbiased "
                "estimator of KL(pi_theta || pi_ref) (E_pi[k2] != KL); use k1 or k3"
            )
        if not self.use_opsm and self.opsm_delta != _DEFAULTS["opsm_delta"]:
            out.append(f"opsm_delta={self.opsm_delta!r} has no effect because use_opsm is false")
        if self.policy_loss == "reinforce":
            changed = [n for n in ("eps_clip", "eps_clip_high", "eps_clip_c") if getattr(self, n) != _DEFAULTS[n]]
            if changed:
                out.append(f"{', '.join(changed)} set but policy_loss='reinforce' does not clip")
        ppo_clip_range = self.eps_clip == _DEFAULTS["eps_clip"] and self.eps_clip_high is None
        if self.policy_loss == "gspo" and ppo_clip_range:
            out.append(
                "policy_loss='gspo' with PPO's clip range eps_clip=0.2: GSPO clips a sequence's geometric-mean "
                "ratio, which stays far closer to 1 than a token's, so this range almost never clips; the GSPO "
                "paper (arXiv:2507.18071) uses eps_clip: 3.0e-4, eps_clip_high: 4.0e-4"
            )
        if self.policy_loss == "cispo" and ppo_clip_range:
            out.append(
                "policy_loss='cispo' with eps_clip=0.2: ratios below 0.8 are raised to 0.8 (slime's convention); "
                "MiniMax-M1's CISPO (arXiv:2506.13585) has no lower bound: eps_clip: 1.0, and tunes eps_clip_high"
            )
        if self.policy_loss == "cispo" and self.eps_clip_c is not None:
            out.append(f"eps_clip_c={self.eps_clip_c!r} has no effect: policy_loss='cispo' has no dual clip")
        if self.advantage_estimator != "grpo":
            changed = [n for n in ("grpo_std_normalization", "grpo_std_eps") if getattr(self, n) != _DEFAULTS[n]]
            if changed:
                out.append(f"{', '.join(changed)} set but advantage_estimator={self.advantage_estimator!r}")
        return out


class _Overlay:
    """A read-only view of a host namespace with some attributes replaced (the host's ``args`` is
    never modified)."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self._base = base
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._base, name)


def _registry_problems(cfg: LossConfig) -> list[str]:
    """Unknown names, one sentence each, listing the valid names (built-in and registered)."""
    problems = []
    for field, registry in (
        ("policy_loss", POLICY_LOSSES),
        ("kl_loss_type", KL_ESTIMATORS),
        ("advantage_estimator", ADVANTAGE_ESTIMATORS),
    ):
        name = getattr(cfg, field)
        valid = sorted(set(BUILTIN_NAMES[field]) | set(registry.names()))
        if name not in valid:
            problems.append(
                f"{field}={name!r}: unknown {registry.kind} {name!r}{suggest(str(name), valid)}; valid: {', '.join(valid)}"
            )
    return problems
