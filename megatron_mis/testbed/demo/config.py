"""``DemoConfig``: every setting of ``megatron-mis demo`` (and of the plain-Megatron example,
which runs the same loop). Importing this module imports neither torch nor Megatron, so the
command line can validate its flags and print ``--help`` at once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from megatron_mis.config.base import ConfigBase, doc

__all__ = [
    "BUILTIN_CORRECTIONS", "DIAGNOSTIC_TIS", "REWRITE_EXPONENT", "REWRITTEN_TIS", "DemoConfig", "QUICK", "available_cpus",
]

#: The short mode (``--quick``): a few small steps, for tests and a first look; explicit flags win.
QUICK: dict[str, object] = {
    "steps": 3,
    "prompts_per_step": 4,
    "samples_per_prompt": 4,
    "micro_batch_size": 8,
    "updates_per_step": 1,
}

_PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")

#: Token TIS taken apart: study diagnostics that tell what of its weight moves the outcome (docs/study.md,
#: "What of the token TIS weight costs reward at T = 1.5"), not presets a user would run. ``{name:
#: MISConfig fields}``;
#: with r_t = pi_old / pi_rollout, ``token_tis_floor1`` weighs clamp(r_t, 1, 2): the tokens the
#: trainer finds less likely than the rollout did keep weight 1 and only the others are raised;
#: ``token_tis_cap1`` weighs min(r_t, 1): the less likely tokens are discounted as by token TIS
#: and none is raised. The others weigh min(r_t, 2) as token TIS does and then rewrite the weights
#: (:data:`REWRITTEN_TIS`): ``token_tis_shuffled`` permutes the log-ratios log r_t at random among
#: each micro-batch's loss tokens (the same weights, no longer tied to the tokens they were measured
#: on); ``token_tis_group_mean`` gives every loss token of a GRPO group the group's mean weight (the
#: weights' variation within a group removed, that between groups kept); ``token_tis_group_permuted``
#: is its placebo: each group weighted by the mean weight of another group of the micro-batch (the
#: group means deranged among the groups: the same weights, independent of each group's samples);
#: ``token_tis_balanced``
#: scales down the first-token weights of one side of each group (the samples above or below its
#: mean reward, whichever weighs more) until sum_i w_i A_i over the group's first tokens, which share
#: the prompt as their context, is 0 as it is unweighted; ``token_tis_unit`` is the null arm: every
#: weight rewritten to exactly 1, so it trains through decoupled PPO and the engine as the others do,
#: with none's gradient; ``token_tis_group_permuted_half``, ``token_tis_group_permuted_double``,
#: ``token_tis_group_permuted_wide`` and ``token_tis_group_permuted_wider`` are the placebo at
#: another dose of noise (:data:`REWRITE_EXPONENT`): each placebo weight w raised to the power 1/2,
#: 2, 3.5 or 6, its log-spread around 1 multiplied by that power (the null arm is the power 0; 3.5
#: and 6 spread the group weights about as widely, by the K3 of the weights, as the shuffled
#: weights' half dose and the shuffled weights), then bounded at 2 again by the engine as every
#: rewritten weight is;
#: ``token_tis_shuffled_tenth``, ``token_tis_shuffled_quarter``, ``token_tis_shuffled_half`` and
#: ``token_tis_shuffled_double`` are the shuffled weights at another dose: each shuffled token weight
#: raised to the power 1/10, 1/4, 1/2 or 2 the same way (per token, where the placebo's doses act per
#: group).
DIAGNOSTIC_TIS: dict[str, dict[str, object]] = {
    "token_tis_floor1": {"tis_mode": "clip", "tis_lower_bound": 1.0, "tis_upper_bound": 2.0},
    "token_tis_cap1": {"tis_mode": "truncate", "tis_upper_bound": 1.0},
    "token_tis_shuffled": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_shuffled_tenth": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_shuffled_quarter": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_shuffled_half": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_shuffled_double": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_group_mean": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_group_permuted": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_group_permuted_half": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_group_permuted_double": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_group_permuted_wide": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_group_permuted_wider": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_balanced": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
    "token_tis_unit": {"tis_mode": "truncate", "tis_upper_bound": 2.0},
}
#: The diagnostics whose weights the trainer rewrites before the loss, and how (``{name: rewrite}``):
#: ``shuffle`` permutes a micro-batch's log-ratios; ``group_mean``, ``group_mean_permuted`` and
#: ``balance_first_token`` act on each GRPO group's weights and need whole groups in every
#: micro-batch (``group_mean_permuted`` at least two); ``unit`` sets every weight to 1.
REWRITTEN_TIS: dict[str, str] = {
    "token_tis_shuffled": "shuffle",
    "token_tis_shuffled_tenth": "shuffle",
    "token_tis_shuffled_quarter": "shuffle",
    "token_tis_shuffled_half": "shuffle",
    "token_tis_shuffled_double": "shuffle",
    "token_tis_group_mean": "group_mean",
    "token_tis_group_permuted": "group_mean_permuted",
    "token_tis_group_permuted_half": "group_mean_permuted",
    "token_tis_group_permuted_double": "group_mean_permuted",
    "token_tis_group_permuted_wide": "group_mean_permuted",
    "token_tis_group_permuted_wider": "group_mean_permuted",
    "token_tis_unit": "unit",
    "token_tis_balanced": "balance_first_token",
}
#: The diagnostics whose rewritten weights are raised to a power before the engine weighs them
#: (``{name: p}``: every loss token's weight w becomes w ** p; the others keep p = 1).
REWRITE_EXPONENT: dict[str, float] = {
    "token_tis_group_permuted_half": 0.5,
    "token_tis_group_permuted_double": 2.0,
    "token_tis_group_permuted_wide": 3.5,
    "token_tis_group_permuted_wider": 6.0,
    "token_tis_shuffled_tenth": 0.1,
    "token_tis_shuffled_quarter": 0.25,
    "token_tis_shuffled_half": 0.5,
    "token_tis_shuffled_double": 2.0,
}
#: Corrections the demo builds itself (besides the presets of ``configs/presets/``).
BUILTIN_CORRECTIONS: tuple[str, ...] = ("none", "bypass_ppo", "decoupled_ppo", *DIAGNOSTIC_TIS)


def available_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(kw_only=True, slots=True)
class DemoConfig(ConfigBase):
    """A small GRPO run: a Megatron-Core GPT learns a synthetic digit task from rollouts of a
    separate engine whose numerics differ (see ``docs/demo.md``)."""

    # ---- the run -------------------------------------------------------------------------
    name: str = doc("demo", "Run name: outputs go to OUT_DIR/NAME/ (metrics.jsonl, report.png, summary.json).")
    out_dir: str = doc("runs", "Folder holding the run folders.")
    steps: int = doc(150, "RL steps (one rollout batch, its pi_old recompute and its optimizer updates each).")
    seed: int = doc(0, "Seed of the model initialisation, the task and the sampling (runs are deterministic given it).")
    correction: str = doc(
        "token_tis",
        "Mismatch correction: a preset of configs/presets/ (e.g. token_tis, seed000_default), a mis.yaml "
        "path, or none. A preset trains with decoupled PPO, IS weights pi_old/pi_rollout from the MIS "
        "engine; none trains with plain PPO against the recomputed pi_old (no IS weight, nothing "
        "rejected) while the engine still measures the mismatch; bypass_ppo: PPO with pi_rollout as "
        "pi_old (its clip bounds pi_theta / pi_rollout); decoupled_ppo: 3-policy PPO with the unbounded "
        "token weight pi_old / pi_rollout; token_tis_floor1 / token_tis_cap1 / token_tis_shuffled / "
        "token_tis_group_mean / token_tis_group_permuted / token_tis_balanced (study diagnostics): decoupled PPO "
        "with the token weight clamped to [1, 2] (no token discounted) / truncated at 1 (none raised) / token TIS's "
        "weights shuffled among each micro-batch's loss tokens / averaged over each GRPO group's loss tokens / "
        "averaged over another group's (the group means deranged among the micro-batch's groups) / with each "
        "group's first-token weights scaled on one side so that sum_i w_i A_i over them is 0; token_tis_unit "
        "(the null arm): decoupled PPO with every weight rewritten to exactly 1 (none's gradient); "
        "token_tis_group_permuted_half / _double / _wide / _wider: the deranged group means raised to the power "
        "1/2 / 2 / 3.5 / 6; "
        "token_tis_shuffled_tenth / _quarter / _half / _double: the shuffled token weights raised to the power "
        "1/10 / 1/4 / 1/2 / 2.",
    )
    compare: bool = doc(
        False,
        "Run the baseline (correction none) and then CORRECTION with the same seed; print a side-by-side "
        "table and overlay both in the report.",
    )
    # ---- rollout -------------------------------------------------------------------------
    rollout_precision: Literal["fp32", "bf16", "fp16", "int8", "int4"] | None = doc(
        None,
        "Numeric path of the rollout engine: fp32, bf16, fp16, int8 or int4 (per-channel weight-only). null: "
        "bf16, or fp32 with true_on_policy. The trainer always recomputes pi_old in fp32.",
    )
    true_on_policy: bool = doc(
        False,
        "Roll out through the trainer's own kernels, shapes and reduction order (Let Speed Be With Stability's first "
        "solution): rollout and training log-probs are bitwise equal, checked every step (needs fp32, "
        "tp <= 2, cp = pp = 1). The fast fp32 engine is timed on the same prompts for the cost.",
    )
    temperature: float = doc(1.0, "Sampling temperature (the trainer's log-probs use the same unless trainer_temperature is set).")
    trainer_temperature: float | None = doc(
        None,
        "The temperature of the trainer's log-probs (pi_old, pi_theta); null: the rollout's. Set it apart from "
        "temperature to reproduce the bug class where the rollout engine applies a temperature the trainer does "
        "not (the dose-response mechanism 'temperature').",
    )
    top_p: float = doc(1.0, "Rollout nucleus sampling (1: off); the trainer does not truncate (a support mismatch) unless trainer_truncation.")
    top_k: int = doc(0, "Rollout top-k sampling (0: off); the trainer does not truncate.")
    rollout_logprobs: Literal["raw", "processed"] = doc(
        "raw",
        "With top_p / top_k: the rollout records the raw log-probs of softmax(logits / T) (SGLang's default) or "
        "the processed ones of the truncated, renormalised distribution it sampled from.",
    )
    trainer_truncation: bool = doc(
        False,
        "With top_p / top_k: the rollout records each token's kept ids and the trainer replays that support "
        "(its pi_old and pi_theta are those of the truncated, renormalised distribution, as slime's top-p replay; "
        "megatron_mis.parallel.tp_logprobs.TokenSupport). Needs rollout_logprobs: processed.",
    )
    replay_entropy: Literal["kept", "full"] = doc(
        "kept",
        "With trainer_truncation, the entropy of the loss's bonus and metric (LossConfig.replay_entropy): kept, the "
        "renormalised distribution's over the replayed support (every replay run archived up to 2026-12-07), or full, "
        "the whole softmax's, as slime's top-p replay computes it (LossConfig's default).",
    )
    staleness: int = doc(
        0,
        "Policy staleness as in asynchronous RL: each rollout uses the weights of this many optimizer steps "
        "earlier (a ring buffer of weight snapshots; the first steps use the initial weights). 0: fresh weights.",
    )
    stale_fraction: float = doc(
        1.0,
        "With staleness k: the share of each rollout batch's prompt groups sampled with the k-step-old weights, "
        "the rest with the current ones (a mixed batch, as slime's over-sampling buffer and partial rollouts hand "
        "the trainer: a few old groups among fresh ones). 1: the whole batch stale. stale_fraction x "
        "prompts_per_step must be a whole number of groups.",
    )
    # ---- task ----------------------------------------------------------------------------
    task: Literal["copy", "reverse", "sort"] = doc("copy", "The synthetic task: copy, reverse or sort the prompt digits.")
    min_digits: int = doc(3, "Fewest digits per prompt.")
    max_digits: int = doc(3, "Most digits per prompt.")
    vocab_size: int = doc(
        16, "Model vocabulary: 4 special ids, the digits 0-9 and unused ids (>= 14; an untrained policy emits them too)."
    )
    scratchpad: int = doc(
        0,
        "Long-tail task: free, unscored response tokens before the answer (responses scratchpad + max_digits "
        "tokens; with a large vocab_size they sample the policy's low-probability tail). 0: the answer at once.",
    )
    scratchpad_position: Literal["before", "after"] = doc(
        "before", "Long-tail task: the scratchpad before the answer, or after it (the answer first; learns faster)."
    )
    digit_credit: float = doc(0.0, "Long-tail task: reward credit for a wrong digit at an answer position (0: none).")
    distractors: int = doc(0, "Long-tail task: random unused-vocabulary ids in the prompt after the digits.")
    eos: bool = doc(
        False,
        "Answers must end with <eos>: response lengths vary (what --lr-schedule length-decay watches); "
        "learns more slowly.",
    )
    # ---- GRPO ----------------------------------------------------------------------------
    prompts_per_step: int = doc(16, "Prompts per RL step.")
    samples_per_prompt: int = doc(8, "Responses sampled per prompt (the GRPO group, >= 2).")
    advantage_estimator: Literal["grpo", "rloo"] = doc(
        "grpo", "grpo: (r - group mean) / group std; rloo: r - mean of the other group members."
    )
    micro_batch_size: int = doc(32, "Sequences per trainer micro-batch (packed thd).")
    updates_per_step: int = doc(
        1,
        "Optimizer updates per RL step: the step's micro-batches are split into this many mini-batches "
        "(with 1, pi_theta = pi_old at the update and PPO's clip never acts).",
    )
    lr: float = doc(3e-3, "Adam learning rate (the digit task collapses to repeated digits from about 5e-3 on).")
    lr_schedule: Literal["constant", "length-decay"] = doc(
        "constant",
        "constant, or length-decay: Beyond Precision's response-length-surge schedule (halve the rate every "
        "1.8 x surge-step steps after a surge of the global mean response length, floor 0.1).",
    )
    lr_surge_step: int | None = doc(
        None,
        "length-decay only: pin the surge (trigger) step instead of detecting it (the default digit "
        "task has no length surge to detect).",
    )
    clip_grad: float = doc(1.0, "Gradient-norm clipping (0: off).")
    eps_clip: float = doc(0.2, "PPO clip range.")
    entropy_coef: float = doc(
        0.0,
        "Entropy bonus of the loss (LossConfig.entropy_coef, slime --entropy-coef); keeps the long-tail task's free "
        "scratchpad tokens from collapsing to one sequence.",
    )
    # ---- model ---------------------------------------------------------------------------
    hidden_size: int = doc(64, "GPT width.")
    num_layers: int = doc(2, "GPT layers.")
    num_attention_heads: int = doc(4, "Attention heads.")
    num_moe_experts: int | None = doc(
        None,
        "MoE: routed experts per layer (every layer MoE, Megatron's TopKRouter + SequentialMLP, no biases); "
        "null: a dense GPT. The rollout engine routes in its own precision, so expert choices flip.",
    )
    moe_router_topk: int = doc(2, "MoE: experts per token.")
    moe_ffn_hidden_size: int | None = doc(None, "MoE: each expert's MLP width; null: 4 x hidden_size.")
    rollout_router_noise: float = doc(
        0.0,
        "MoE only: the rollout engine adds Gaussian noise of this many standard deviations of each token's router "
        "logits before its top-k (the trainer's routers stay noiseless), so choices near a tie flip at a rate "
        "that grows with it: a dose for routing mismatch that R3 removes. 0: off.",
    )
    routing_replay: bool = doc(
        False,
        "MoE only: rollout routing replay (R3) — the trainer's routers use the experts the rollout engine "
        "chose, in the pi_old recompute and in every training forward (megatron_mis.routing.RoutingReplay).",
    )
    # ---- parallelism ---------------------------------------------------------------------
    tp: int = doc(1, "Tensor-parallel size.")
    cp: int = doc(1, "Context-parallel size (sequences split zigzag over 2*cp chunks).")
    pp: int = doc(1, "Pipeline-parallel size (the rollout engine gathers the stages' weights).")
    dp: int = doc(1, "Data-parallel size; tp x cp x pp x dp processes run on gloo.")
    threads: int | None = doc(
        None, "Intra-op threads per process; null: the available cores / processes (at least 1)."
    )
    # ---- output --------------------------------------------------------------------------
    progress: bool = doc(True, "Show a progress bar with the live reward and K3 KL.")
    plot: bool = doc(True, "Write the PNG report.")
    dump_log_probs: str | None = doc(
        None,
        "Folder: every step writes its rollout log-probs and the trainer's recomputed pi_old to "
        "DIR/ARM/step-SSSSS.dp-R.jsonl (megatron-mis' JSONL dump, rollout_id = step - 1, one line per sequence, "
        "one file per data-parallel rank), which megatron-mis analyze reads as it reads a host's dumps. "
        "null: off. Changes nothing in the run.",
    )

    # ---------------------------------------------------------------------------- resolved
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def precision(self) -> str:
        """The resolved rollout precision."""
        if self.rollout_precision is not None:
            return self.rollout_precision
        return "fp32" if self.true_on_policy else "bf16"

    @property
    def resolved_trainer_temperature(self) -> float:
        """The temperature of the trainer's log-probs."""
        return self.temperature if self.trainer_temperature is None else self.trainer_temperature

    @property
    def num_sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def num_threads(self) -> int:
        if self.threads is not None:
            return self.threads
        return max(1, available_cpus() // self.world_size)

    @property
    def arms(self) -> list[str]:
        """The corrections run, in order (``["none", CORRECTION]`` with ``compare``)."""
        return ["none", self.correction] if self.compare else [self.correction]

    def _check(self) -> list[str]:
        out: list[str] = []
        for name in ("steps", "prompts_per_step", "micro_batch_size", "updates_per_step", "hidden_size",
                     "num_layers", "num_attention_heads", "tp", "cp", "pp", "dp", "min_digits"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.samples_per_prompt < 2:
            out.append(f"samples_per_prompt={self.samples_per_prompt!r} must be >= 2 (a GRPO group needs two samples)")
        if self.max_digits < self.min_digits:
            out.append(f"max_digits={self.max_digits!r} must be >= min_digits={self.min_digits!r}")
        if self.max_digits > 16:
            out.append(f"max_digits={self.max_digits!r} must be <= 16 (a small demo)")
        if not self.temperature > 0:
            out.append(f"temperature={self.temperature!r} must be > 0")
        if self.trainer_temperature is not None and not self.trainer_temperature > 0:
            out.append(f"trainer_temperature={self.trainer_temperature!r} must be > 0 or null")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p!r} must lie in (0, 1]")
        if self.top_k < 0:
            out.append(f"top_k={self.top_k!r} must be >= 0 (0: off)")
        if self.rollout_logprobs not in ("raw", "processed"):
            out.append(f"rollout_logprobs={self.rollout_logprobs!r} must be 'raw' or 'processed'")
        if self.staleness < 0:
            out.append(f"staleness={self.staleness!r} must be >= 0")
        if not 0 < self.stale_fraction <= 1:
            out.append(f"stale_fraction={self.stale_fraction!r} must lie in (0, 1]")
        elif self.stale_fraction < 1:
            groups = self.stale_fraction * self.prompts_per_step
            if self.staleness == 0:
                out.append(f"stale_fraction={self.stale_fraction!r} needs staleness >= 1 (with fresh weights there is nothing stale to mix in)")
            if abs(groups - round(groups)) > 1e-9 or round(groups) < 1:
                out.append(f"stale_fraction={self.stale_fraction!r} x prompts_per_step={self.prompts_per_step} = {groups:g} "
                           "must be a whole number of prompt groups >= 1")
        if self.replay_entropy != "kept" and not self.trainer_truncation:
            out.append(f"replay_entropy={self.replay_entropy!r} needs trainer_truncation (without a replayed support "
                       "the entropy is the whole softmax's already)")
        if self.trainer_truncation and not (self.top_k or self.top_p < 1):
            out.append("trainer_truncation needs top_p < 1 or top_k > 0 (there is no truncation to replay)")
        elif self.trainer_truncation and self.rollout_logprobs != "processed":
            out.append(
                f"trainer_truncation with rollout_logprobs={self.rollout_logprobs!r}: the trainer's replayed log-probs are "
                "those of the truncated distribution, so the rollout must record the same (set rollout_logprobs: processed)"
            )
        if self.true_on_policy and (self.staleness or self.top_k or self.top_p < 1 or (
                self.trainer_temperature is not None and self.trainer_temperature != self.temperature)):
            out.append("true_on_policy with staleness / top_k / top_p / trainer_temperature: a true on-policy rollout "
                       "has none of these mismatches (set them only with the fast engine)")
        if not self.lr > 0:
            out.append(f"lr={self.lr!r} must be > 0")
        if self.clip_grad < 0:
            out.append(f"clip_grad={self.clip_grad!r} must be >= 0 (0: off)")
        if not 0.0 <= self.entropy_coef <= 1.0:
            out.append(f"entropy_coef={self.entropy_coef!r} must lie in [0, 1]")
        if not 0 < self.eps_clip < 1:
            out.append(f"eps_clip={self.eps_clip!r} must lie in (0, 1)")
        if self.threads is not None and self.threads < 1:
            out.append(f"threads={self.threads!r} must be >= 1 or null")
        if self.lr_surge_step is not None and self.lr_surge_step < 1:
            out.append(f"lr_surge_step={self.lr_surge_step!r} must be >= 1")
        if not self.name or any(c in self.name for c in "/\\") or self.name in (".", ".."):
            out.append(f"name={self.name!r} must be a plain folder name (no '/')")
        if self.dump_log_probs is not None and (not self.dump_log_probs or os.path.isfile(self.dump_log_probs)):
            out.append(f"dump_log_probs={self.dump_log_probs!r} must be a folder path (made if missing) or null")
        out += self._correction_problems()
        if self.compare and self.correction == "none":
            out.append("compare=True runs the baseline (none) against CORRECTION: choose a preset, e.g. --correction token_tis")
        if self.true_on_policy:
            if self.rollout_precision not in (None, "fp32"):
                out.append(f"true_on_policy needs rollout_precision fp32 (the trainer's), got {self.rollout_precision!r}")
            if self.tp > 2:
                out.append(f"true_on_policy with tp={self.tp}: the aligned path reproduces the TP all-reduce only for tp <= 2")
            if self.cp > 1:
                out.append(f"true_on_policy with cp={self.cp}: the aligned path mirrors the CP = 1 forward")
            if self.pp > 1:
                out.append(f"true_on_policy with pp={self.pp}: the aligned path mirrors the PP = 1 forward")
        if self.num_moe_experts is not None:
            if self.num_moe_experts < 2:
                out.append(f"num_moe_experts={self.num_moe_experts!r} must be >= 2 or null (dense)")
            elif not 1 <= self.moe_router_topk <= self.num_moe_experts:
                out.append(f"moe_router_topk={self.moe_router_topk!r} must lie in [1, num_moe_experts={self.num_moe_experts}]")
            if max(self.tp, self.cp, self.pp) > 1:
                out.append(
                    f"num_moe_experts with tp={self.tp}, cp={self.cp}, pp={self.pp}: the MoE demo runs with "
                    "tp = cp = pp = 1 (data parallelism only)"
                )
            if self.true_on_policy:
                out.append("true_on_policy with num_moe_experts: the aligned rollout path mirrors dense layers only")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            out.append(f"moe_ffn_hidden_size={self.moe_ffn_hidden_size!r} must be >= 1 or null")
        if not 0.0 <= self.rollout_router_noise <= 10.0:
            out.append(f"rollout_router_noise={self.rollout_router_noise!r} must lie in [0, 10] (router-logit standard deviations)")
        elif self.rollout_router_noise > 0 and self.num_moe_experts is None:
            out.append(f"rollout_router_noise={self.rollout_router_noise!r} needs an MoE model (set num_moe_experts)")
        if self.routing_replay and self.num_moe_experts is None:
            out.append("routing_replay=True needs an MoE model (set num_moe_experts)")
        if not 0.0 <= self.digit_credit < 1.0:
            out.append(f"digit_credit={self.digit_credit!r} must lie in [0, 1)")
        if self.scratchpad < 0 or self.scratchpad > 1024:
            out.append(f"scratchpad={self.scratchpad!r} must lie in [0, 1024]")
        if self.distractors < 0 or self.distractors > 64:
            out.append(f"distractors={self.distractors!r} must lie in [0, 64]")
        if self.scratchpad and self.eos:
            out.append("scratchpad with eos=True: the answer's position is fixed by the scratchpad (no <eos>)")
        if self.distractors and self.vocab_size <= 14:
            out.append(f"distractors={self.distractors} need unused ids: vocab_size={self.vocab_size} must exceed 14")
        if self.vocab_size < 14:
            out.append(f"vocab_size={self.vocab_size!r} must be >= 14 (4 special ids and 10 digits)")
        # layout: the vocabulary and the heads split over TP; whole micro-batches per DP rank
        if self.tp >= 1 and (self.vocab_size % self.tp or self.num_attention_heads % self.tp):
            out.append(
                f"tp={self.tp} must divide vocab_size={self.vocab_size} and num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads >= 1 and self.hidden_size % self.num_attention_heads:
            out.append(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}")
        if self.pp > 1 and self.num_layers % self.pp:
            out.append(f"pp={self.pp} must divide num_layers={self.num_layers}")
        if min(self.dp, self.micro_batch_size, self.updates_per_step, self.prompts_per_step) >= 1 and self.samples_per_prompt >= 2:
            n = self.num_sequences
            per_rank = n // self.dp
            if n % self.dp or per_rank % self.micro_batch_size or (per_rank // self.micro_batch_size) % self.updates_per_step:
                out.append(
                    f"{n} sequences per step (prompts_per_step x samples_per_prompt) must split into dp={self.dp} "
                    f"ranks x whole micro-batches of micro_batch_size={self.micro_batch_size} x "
                    f"updates_per_step={self.updates_per_step} (n divisible by dp x micro_batch_size x updates_per_step)"
                )
        return out

    def _correction_problems(self) -> list[str]:
        rewrite = REWRITTEN_TIS.get(self.correction)
        if rewrite in ("group_mean", "group_mean_permuted", "balance_first_token"):
            out = []
            if self.samples_per_prompt >= 1 and self.micro_batch_size % self.samples_per_prompt:
                out.append(f"correction={self.correction!r} rewrites each GRPO group's weights and needs whole groups "
                           f"in every micro-batch: micro_batch_size={self.micro_batch_size} must be a multiple of "
                           f"samples_per_prompt={self.samples_per_prompt}")
            if rewrite == "group_mean_permuted" and self.micro_batch_size < 2 * self.samples_per_prompt:
                out.append(f"correction={self.correction!r} gives each GRPO group another group's mean weight and "
                           f"needs at least 2 groups per micro-batch: micro_batch_size={self.micro_batch_size} must be "
                           f">= 2 x samples_per_prompt={self.samples_per_prompt}")
            return out
        if self.correction in BUILTIN_CORRECTIONS:
            return []
        from megatron_mis.config.base import ConfigError
        from megatron_mis.config.mis import MISConfig
        from megatron_mis.presets import preset_path

        try:
            mis = MISConfig.from_yaml(preset_path(self.correction))
        except FileNotFoundError as exc:
            return [f"correction={self.correction!r}: {exc} (or none)"]
        except ConfigError as exc:
            return [f"correction={self.correction!r}: {exc}"]
        if mis.normalizes and mis.tis_batch_normalize_scope == "global":
            return [
                f"correction={self.correction!r} sets tis_batch_normalize_scope: global; the demo's loss "
                "normalises per micro-batch (use micro_batch)"
            ]
        return []

    def _warnings(self) -> list[str]:
        out = []
        if self.lr_surge_step is not None and self.lr_schedule != "length-decay":
            out.append("lr_surge_step has no effect without lr_schedule='length-decay'")
        if self.rollout_logprobs == "processed" and not (self.top_k or self.top_p < 1):
            out.append("rollout_logprobs='processed' has no effect without top_k or top_p")
        if self.num_moe_experts is None and (self.moe_router_topk != 2 or self.moe_ffn_hidden_size is not None):
            out.append("moe_router_topk / moe_ffn_hidden_size have no effect without num_moe_experts (a dense GPT)")
        return out
