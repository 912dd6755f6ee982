"""``StudyConfig``, the settings (a task and a mismatch source) and the arms (a correction or a
no-mismatch reference) of ``megatron-mis study``. Importing this module imports neither torch
nor Megatron, so the command line validates its flags and prints ``--help`` at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_mis.config.base import ConfigBase, doc
from megatron_mis.testbed.demo.config import DIAGNOSTIC_TIS, DemoConfig, available_cpus

__all__ = ["ARMS", "DEFAULT_ARMS", "DEFAULT_SETTING", "DEMO_COMPARE_SETTING", "NO_MECHANISM", "OUTCOMES", "QUICK",
           "SETTINGS", "SWEEPS", "Arm", "Setting", "Sweep", "StudyConfig", "arm_overrides_of_extra", "run_config"]


#: A setting's steps-to-threshold reward unless it names its own (:attr:`Setting.threshold`).
DEFAULT_THRESHOLD = 0.5

#: The rewards a report can compare arms on (:attr:`Setting.outcome`), with their names in reports.
OUTCOMES: dict[str, str] = {
    "final_reward": "final reward",
    "greedy_reward": "greedy reward",
}


@dataclass(frozen=True)
class Setting:
    """A task and a mismatch source: the :class:`DemoConfig` fields every arm of the study shares."""

    name: str
    description: str
    overrides: dict[str, Any]
    #: the correction ``megatron-mis demo --compare --preset NAME`` sets against none
    demo_correction: str = "token_tis"
    #: the arms a study of this setting runs by default (``None``: :data:`DEFAULT_ARMS`)
    arms: tuple[str, ...] | None = None
    #: the reward whose first crossing (k-step moving mean) is "steps to threshold": a point on
    #: the way to this task's plateau, which an unlearned run never reaches
    threshold: float = DEFAULT_THRESHOLD
    #: the per-run reward the report compares arms on (:data:`OUTCOMES`): the training reward of
    #: the last steps, or the greedy evaluation where the reference samples from another
    #: distribution than the arms (top-p: its untruncated samples score lower as samples, not as
    #: a policy)
    outcome: str = "final_reward"

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"setting {self.name!r}: outcome={self.outcome!r}, expected one of {list(OUTCOMES)}")

    def demo_values(self) -> dict[str, Any]:
        """The :class:`DemoConfig` values ``megatron-mis demo --preset NAME`` starts from."""
        return {**self.overrides, "correction": self.demo_correction}


@dataclass(frozen=True)
class Arm:
    """One arm: the :class:`DemoConfig` fields it changes on top of the setting (a correction, a
    schedule, or a no-mismatch rollout path)."""

    name: str
    description: str
    overrides: dict[str, Any]
    reference: bool = False  # a no-mismatch reference (its rollouts carry no bf16/int mismatch)


_BASE: dict[str, Any] = {
    "task": "copy",
    "min_digits": 3,
    "max_digits": 3,
    "vocab_size": 16,
    "prompts_per_step": 16,
    "samples_per_prompt": 8,
    "micro_batch_size": 64,
    "updates_per_step": 1,
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "lr": 3e-3,
    "steps": 80,
}


def _setting(name: str, description: str, *, arms: tuple[str, ...] | None = None, demo_correction: str = "token_tis",
             threshold: float = DEFAULT_THRESHOLD, outcome: str = "final_reward", **changes: Any) -> Setting:
    return Setting(name, description, {**_BASE, **changes}, demo_correction=demo_correction, arms=arms,
                   threshold=threshold, outcome=outcome)


#: A small MoE GPT: every layer MoE, 16 experts, top-2 (the rollout engine routes in its own precision);
#: chosen by measuring K3 (docs/study.md): 16 experts flip more often than 8 under int4.
_MOE: dict[str, Any] = {"num_moe_experts": 16, "moe_router_topk": 2}
#: The arms of the MoE settings: the baseline, the no-mismatch reference, routing replay with and
#: without a token IS weight, two corrections without replay, and Let Speed Be With Stability's default.
MOE_ARMS: tuple[str, ...] = ("none", "ref_fp32", "r3", "r3_token_tis", "token_tis", "sequence_mis", "seed000_default")


#: The settings (mismatch sources). Every one keeps the trainer in fp32; only the rollout differs.
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        _setting("int4", "copy 3 digits; rollouts with 4-bit per-channel weight-only quantised linears", rollout_precision="int4"),
        _setting("int8", "copy 3 digits; rollouts with int8 per-channel weight-only quantised linears", rollout_precision="int8"),
        _setting("bf16", "copy 3 digits; bf16 rollouts (weights and activations), fp32 trainer", rollout_precision="bf16"),
        _setting("fp16", "copy 3 digits; fp16 rollouts (weights and activations), fp32 trainer", rollout_precision="fp16"),
        _setting(
            "batch-variant",
            "copy 3 digits; fp32 rollouts whose only difference is the reduction order (KV-cache decode "
            "shapes [B, 1] and fused linears vs the trainer's packed full-sequence forward)",
            rollout_precision="fp32",
        ),
        _setting(
            "int4-long",
            "copy 6 digits (longer responses, When Speed Kills Stability's horizon argument); int4 rollouts",
            rollout_precision="int4", min_digits=6, max_digits=6, steps=120,
        ),
        _setting(
            "bf16-long",
            "copy 6 digits (longer responses); bf16 rollouts",
            rollout_precision="bf16", min_digits=6, max_digits=6, steps=120,
        ),
        _setting(
            "moe-bf16",
            "copy 3 digits; MoE GPT (16 experts, top-2, every layer); bf16 rollouts whose routers pick the top-2 "
            "on bf16 logits, so expert choices flip against the fp32 trainer",
            arms=MOE_ARMS, rollout_precision="bf16", **_MOE,
        ),
        _setting(
            "moe-int4",
            "copy 3 digits; MoE GPT (16 experts, top-2, every layer); rollouts with 4-bit per-channel weight-only "
            "quantised attention and experts (router unquantised), so expert choices flip against the fp32 trainer",
            arms=MOE_ARMS, rollout_precision="int4", **_MOE,
        ),
    )
}
#: The setting ``megatron-mis study`` runs without ``--setting`` (``demo --compare`` runs
#: :data:`DEMO_COMPARE_SETTING`).
DEFAULT_SETTING = "int4"


# ------------------------------------------------------------------------ dose-response sweeps
@dataclass(frozen=True)
class Sweep:
    """A mechanism with a dose: one setting per dose (named ``NAME-LABEL``), the same arms at
    every dose. ``values`` sets the dose's :class:`DemoConfig` fields; ``measure`` names the
    dose on the report's axis."""

    name: str
    description: str
    measure: str
    doses: tuple[tuple[str, dict[str, Any]], ...]  # (label, DemoConfig fields at this dose)
    base: dict[str, Any]
    arms: tuple[str, ...]
    #: the correction ``megatron-mis demo --compare --preset NAME-DOSE`` sets against none
    demo_correction: str = "token_tis"
    #: the doses' :attr:`Setting.threshold`
    threshold: float = DEFAULT_THRESHOLD
    #: the doses' :attr:`Setting.outcome`
    outcome: str = "final_reward"

    def setting_name(self, label: str) -> str:
        return f"{self.name}-{label}"

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.doses]

    def dose_value(self, label: str) -> Any:
        return dict(self.doses)[label][self.measure]


#: The full sweeps' run length: long enough to reach the plateau and see late collapses.
SWEEP_STEPS = 300
_SWEEP_BASE: dict[str, Any] = {"rollout_precision": "fp32", "steps": SWEEP_STEPS}
_CORRECTIONS: tuple[str, ...] = ("none", "ref_fp32", "token_tis", "token_mis", "sequence_mis")

#: The long-tail task (issue 29): a vocabulary of 512 ids, distractors, a free scratchpad after the
#: answer; a small batch (8 prompts x 8 samples in micro-batches of 4: the packed attention costs
#: grow with the micro-batch's length) so a step stays about a second at 64-token responses. An
#: entropy bonus of 0.03 keeps the scratchpad a high-entropy tail (entropy ~5.8 of ln 512 = 6.2:
#: tokens sampled at probabilities near 1/512); without one it collapsed to a single sequence by
#: step 60-160 in pilots at lr 1e-3-5e-3 (with the scratchpad before or after the answer), and the
#: answer froze at a guess (docs/study.md).
_LONG_TAIL: dict[str, Any] = {
    "vocab_size": 512, "distractors": 4, "digit_credit": 0.3, "scratchpad_position": "after",
    "prompts_per_step": 8, "samples_per_prompt": 8, "micro_batch_size": 4, "lr": 3e-3, "entropy_coef": 0.03,
}
#: The long-tail task's steps-to-threshold reward: its runs start at the floor (0.01-0.02) and plateau
#: at 0.34-0.39 (digit credit), so the default 0.5 is never reached; 0.2 times the take-off (in the
#: 64-256-token sweeps' runs that took off, the 10-step mean crossed it between steps 67 and 298,
#: median 110 / 129 / 151 at 64 / 128 / 256 tokens).
LONG_TAIL_THRESHOLD = 0.2

SWEEPS: dict[str, Sweep] = {
    w.name: w
    for w in (
        Sweep(
            "staleness",
            "asynchronous RL: rollouts from the weights of k optimizer steps earlier (fp32 rollouts, so the "
            "staleness is the only mismatch besides reduction order); 1 update per rollout batch",
            "staleness",
            tuple((f"k{k}", {"staleness": k}) for k in (0, 1, 2, 4, 8, 16)),
            _SWEEP_BASE,
            _CORRECTIONS + ("decoupled_ppo", "bypass_ppo"),
            demo_correction="bypass_ppo",
        ),
        Sweep(
            "staleness-multi",
            "asynchronous RL with 4 optimizer updates per rollout batch (PPO's clip acts): rollouts from the "
            "weights of k optimizer steps earlier",
            "staleness",
            tuple((f"k{k}", {"staleness": k}) for k in (0, 4, 8, 16)),
            {**_SWEEP_BASE, "updates_per_step": 4, "micro_batch_size": 32},
            _CORRECTIONS + ("decoupled_ppo", "bypass_ppo"),
            demo_correction="bypass_ppo",
        ),
        Sweep(
            "staleness-mixed",
            "mixed batches as over-sampling buffers and partial rollouts make them: a share f of each batch's prompt "
            "groups from the weights of 8 optimizer steps earlier, the rest fresh (fp32 rollouts, 1 update per "
            "batch): a few outlier sequences that sequence-level rejection can drop and token-level weights cannot",
            "stale_fraction",
            tuple((f"f{f:g}", {"stale_fraction": f}) for f in (0.125, 0.25, 0.5, 1.0)),
            {**_SWEEP_BASE, "staleness": 8},
            ("none", "ref_fp32", "token_tis", "token_mis", "sequence_mis", "geo_rs_token_tis", "zscore_rs_token_mis", "bypass_ppo"),
            demo_correction="bypass_ppo",
        ),
        Sweep(
            "temperature",
            "the rollout engine samples at temperature T and records log_softmax(logits / T); the trainer "
            "computes its log-probs at T = 1 (a configuration bug class)",
            "temperature",
            tuple((f"t{t:g}", {"temperature": t, "trainer_temperature": 1.0}) for t in (1.0, 0.9, 0.75, 0.5, 1.25, 1.5)),
            _SWEEP_BASE,
            _CORRECTIONS,
        ),
        Sweep(
            "top-p-raw",
            "nucleus sampling in the rollout, raw (untruncated) log-probs recorded, no truncation in the trainer: "
            "a support mismatch the recorded log-probs do not show",
            "top_p",
            tuple((f"p{p:g}", {"top_p": p, "rollout_logprobs": "raw"}) for p in (1.0, 0.98, 0.95, 0.9, 0.8)),
            _SWEEP_BASE,
            _CORRECTIONS,
            outcome="greedy_reward",
        ),
        Sweep(
            "top-p-processed",
            "nucleus sampling in the rollout, the truncated distribution's log-probs recorded, no truncation in "
            "the trainer: every sampled token has pi_train / pi_rollout = the kept mass < 1",
            "top_p",
            tuple((f"p{p:g}", {"top_p": p, "rollout_logprobs": "processed" if p < 1 else "raw"}) for p in (1.0, 0.98, 0.95, 0.9, 0.8)),
            _SWEEP_BASE,
            _CORRECTIONS,
            outcome="greedy_reward",
        ),
        Sweep(
            "top-p-replay",
            "nucleus sampling with the truncated distribution's log-probs recorded, and the rollout's support "
            "replayed in the trainer (trainer_truncation, as slime's top-p replay): the support mismatch removed "
            "at its source, against top-p-processed",
            "top_p",
            tuple((f"p{p:g}", {"top_p": p, "rollout_logprobs": "processed" if p < 1 else "raw", "trainer_truncation": p < 1})
                  for p in (1.0, 0.98, 0.95, 0.9, 0.8)),
            _SWEEP_BASE,
            _CORRECTIONS,
            outcome="greedy_reward",
        ),
        Sweep(
            "long-tail",
            "the long-tail task: vocabulary 512, 4 distractor ids in the prompt, 3 digits to copy and then a free "
            "scratchpad of S tokens (responses of S + 3 = 64, 128, 256 tokens) kept high-entropy by an entropy bonus; "
            "int4 rollouts",
            "scratchpad",
            tuple((f"s{n}", {"scratchpad": n}) for n in (61, 125, 253)),
            {**_SWEEP_BASE, **_LONG_TAIL, "rollout_precision": "int4"},
            _CORRECTIONS + ("sequence_tis", "geo_rs_token_tis"),
            threshold=LONG_TAIL_THRESHOLD,
        ),
        Sweep(
            "long-tail-stale",
            "the long-tail task with 64-token responses (scratchpad 61, int4) and rollouts from the weights of k "
            "optimizer steps earlier: the sequence log-weight SD sqrt(2 L K3) passes 1 (K3 ~ 0.03 at k = 2), where "
            "token- and sequence-level corrections should separate",
            "staleness",
            tuple((f"k{k}", {"staleness": k}) for k in (0, 1, 2, 4)),
            {**_SWEEP_BASE, **_LONG_TAIL, "scratchpad": 61, "rollout_precision": "int4"},
            ("none", "ref_fp32", "token_tis", "sequence_tis", "sequence_mis", "zscore_rs_token_mis", "bypass_ppo"),
            demo_correction="token_tis", threshold=LONG_TAIL_THRESHOLD,
        ),
        Sweep(
            "long-tail-stale-128",
            "long-tail-stale at twice the length: 128-token responses (scratchpad 125, int4), rollouts from the "
            "weights of k optimizer steps earlier; at the same per-token K3 the sequence log-weight SD "
            "sqrt(2 L K3) is sqrt(2) times the 64-token one (k0: fresh int4 alone)",
            "staleness",
            tuple((f"k{k}", {"staleness": k}) for k in (0, 1, 2)),
            {**_SWEEP_BASE, **_LONG_TAIL, "scratchpad": 125, "rollout_precision": "int4"},
            ("none", "ref_fp32", "token_tis", "sequence_tis", "sequence_mis"),
            demo_correction="token_tis", threshold=LONG_TAIL_THRESHOLD,
        ),
        Sweep(
            "long-tail-stale-256",
            "long-tail-stale at four times the length: 256-token responses (scratchpad 253, int4), rollouts from the "
            "weights of k optimizer steps earlier (k0: fresh int4 alone, the long-tail sweep's s253); the arms that "
            "separated at 64 and 128 tokens",
            "staleness",
            tuple((f"k{k}", {"staleness": k}) for k in (0, 1)),
            {**_SWEEP_BASE, **_LONG_TAIL, "scratchpad": 253, "rollout_precision": "int4"},
            ("none", "ref_fp32", "token_tis", "sequence_mis", "sequence_tis"),
            demo_correction="token_tis", threshold=LONG_TAIL_THRESHOLD,
        ),
        *(
            Sweep(
                f"long-tail-{mech}-{kind}",
                f"the long-tail task with 64-token responses (vocabulary 512, scratchpad 61 kept near uniform by the "
                f"entropy bonus, fp32 rollouts) and {how} in the rollout: {what}",
                measure,
                tuple((f"{prefix}{v:g}", {measure: v, **(values if v != off else {})}) for v in doses),
                {**_SWEEP_BASE, **_LONG_TAIL, "scratchpad": 61},
                _CORRECTIONS + ("sequence_tis", "token_tis_normalized"),
                threshold=LONG_TAIL_THRESHOLD, outcome="greedy_reward",
            )
            for mech, how, measure, prefix, off, doses, kept in (
                ("top-p", "nucleus sampling", "top_p", "p", 1.0, (1.0, 0.95, 0.9, 0.8), "about p"),
                ("top-k", "top-k sampling", "top_k", "k", 0, (256, 64, 16), "about k / 512 while the tail is flat"),
            )
            for kind, what, values in (
                ("raw", "raw log-probs recorded, no truncation in the trainer (a support mismatch the recorded "
                 "log-probs do not show, on a tail of hundreds of ids)", {"rollout_logprobs": "raw"}),
                ("processed", "the truncated distribution's log-probs recorded, no truncation in the trainer: every "
                 f"sampled scratchpad token has pi_train / pi_rollout = the kept mass, {kept}, so the sequence "
                 "log-weight is about 61 times its log", {"rollout_logprobs": "processed"}),
                ("replay", "the truncated distribution's log-probs recorded and the rollout's support replayed in the "
                 "trainer (trainer_truncation)", {"rollout_logprobs": "processed", "trainer_truncation": True}),
                ("replay-full-entropy", "the truncated distribution's log-probs recorded and the rollout's support "
                 "replayed in the trainer for the log-probs only: the entropy bonus stays the whole softmax's, as in "
                 "slime's top-p replay (trainer_truncation, replay_entropy full)",
                 {"rollout_logprobs": "processed", "trainer_truncation": True, "replay_entropy": "full"}),
            )
        ),
        Sweep(
            "long-tail-precision",
            "the long-tail task with 128-token responses (vocabulary 512, scratchpad 125): bf16, int8 and int4 rollouts",
            "rollout_precision",
            tuple((p, {"rollout_precision": p}) for p in ("bf16", "int8", "int4")),
            {**_SWEEP_BASE, **_LONG_TAIL, "scratchpad": 125},
            _CORRECTIONS + ("sequence_tis", "geo_rs_token_tis"),
            threshold=LONG_TAIL_THRESHOLD,
        ),
        Sweep(
            "moe-ties",
            "the MoE GPT (top-2, every layer MoE, experts of width 64) with int4 rollouts; more experts per layer put "
            "more router choices near ties, so more of them flip against the fp32 trainer (a 3-step probe: 4-9% of "
            "the rollout's experts, 9-18% of (token, layer) choices at 32-64 experts); R3 among the arms",
            "num_moe_experts",
            tuple((f"e{e}", {"num_moe_experts": e}) for e in (16, 32, 64)),
            {**_SWEEP_BASE, "rollout_precision": "int4", "moe_router_topk": 2, "moe_ffn_hidden_size": 64},
            MOE_ARMS,
        ),
        Sweep(
            "moe-noise",
            "the MoE GPT (16 experts of width 64, top-2, every layer MoE) with fp32 rollouts whose routers add Gaussian "
            "noise of sigma router-logit standard deviations before the top-k: expert choices near a tie flip against "
            "the noiseless trainer at a rate that grows with sigma (routing mismatch alone; R3 among the arms)",
            "rollout_router_noise",
            tuple((f"n{n:g}", {"rollout_router_noise": n}) for n in (0.05, 0.1, 0.2, 0.4)),
            {**_SWEEP_BASE, "num_moe_experts": 16, "moe_router_topk": 2, "moe_ffn_hidden_size": 64},
            ("none", "ref_fp32", "r3", "token_tis", "sequence_mis"),
        ),
    )
}
for _w in SWEEPS.values():
    for _label, _values in _w.doses:
        _name = _w.setting_name(_label)
        if _name in SETTINGS:  # pragma: no cover - a definition error
            raise RuntimeError(f"sweep setting {_name!r} clashes with a setting")
        SETTINGS[_name] = _setting(
            _name, f"{_w.name} sweep, {_w.measure} = {_w.dose_value(_label)!r}: {_w.description}",
            arms=_w.arms, demo_correction=_w.demo_correction, threshold=_w.threshold, outcome=_w.outcome,
            **{**_w.base, **_values},
        )

#: The setting ``megatron-mis demo --compare`` (and ``make demo``) runs without ``--preset``: the
#: staleness sweep at k = 4 (rollouts from the weights 4 optimizer steps earlier), none against its
#: demo correction bypass PPO. It is the first setting where the study measured the uncorrected run
#: falling behind and a correction closing the gap (docs/study.md); under :data:`DEFAULT_SETTING`
#: (int4) no correction changes the outcome, so a comparison there shows nothing.
DEMO_COMPARE_SETTING = "staleness-k4"
if DEMO_COMPARE_SETTING not in SETTINGS or SETTINGS[DEMO_COMPARE_SETTING].demo_correction == "none":  # pragma: no cover
    raise RuntimeError(f"DEMO_COMPARE_SETTING={DEMO_COMPARE_SETTING!r} must name a setting with a correction")

#: The DemoConfig fields of every mechanism, at their harmless values: a no-mismatch reference
#: arm resets them (fresh weights, the rollout's temperature in the trainer, no truncation), and
#: ``megatron-mis demo --true-on-policy`` drops a preset's values of them.
NO_MECHANISM: dict[str, Any] = {"staleness": 0, "stale_fraction": 1.0, "trainer_temperature": None, "top_p": 1.0, "top_k": 0,
                                "rollout_logprobs": "raw", "trainer_truncation": False, "replay_entropy": "kept",
                                "rollout_router_noise": 0.0}


def _arm(name: str, description: str, reference: bool = False, **overrides: Any) -> Arm:
    return Arm(name, description, overrides, reference)


#: Every arm. ``reference`` arms replace the setting's rollout path by a mismatch-free one.
ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        _arm("none", "PPO against the recomputed fp32 pi_old, no IS weight (the mismatch uncorrected)", correction="none"),
        _arm("token_tis", "decoupled PPO, token IS weight truncated at 2", correction="token_tis"),
        _arm("token_tis_normalized", "decoupled PPO, token IS weight truncated at 2, self-normalised to mean 1 over "
             "the micro-batch's loss tokens", correction="token_tis_normalized"),
        _arm("token_tis_floor1", "diagnostic: decoupled PPO, token IS weight clamped to [1, 2] (token TIS without "
             "its discount of the tokens the trainer finds less likely)", correction="token_tis_floor1"),
        _arm("token_tis_cap1", "diagnostic: decoupled PPO, token IS weight truncated at 1 (token TIS's discount, "
             "no token raised)", correction="token_tis_cap1"),
        _arm("token_tis_shuffled", "diagnostic: decoupled PPO, token IS weight truncated at 2 with the log-ratios "
             "shuffled among each micro-batch's loss tokens (token TIS's weights, on other tokens)",
             correction="token_tis_shuffled"),
        _arm("token_tis_shuffled_tenth", "diagnostic (the shuffled weights at a tenth of the dose): "
             "token_tis_shuffled's token weights w rewritten to w ** 0.1 (their log-spread around 1 divided by 10, "
             "per token)", correction="token_tis_shuffled_tenth"),
        _arm("token_tis_shuffled_quarter", "diagnostic (the shuffled weights at a quarter of the dose): "
             "token_tis_shuffled's token weights w rewritten to w ** 0.25 (their log-spread around 1 divided by 4, "
             "per token)", correction="token_tis_shuffled_quarter"),
        _arm("token_tis_shuffled_half", "diagnostic (the shuffled weights at half the dose): token_tis_shuffled's "
             "token weights w rewritten to w ** 0.5 (their log-spread around 1 halved, per token)",
             correction="token_tis_shuffled_half"),
        _arm("token_tis_shuffled_double", "diagnostic (the shuffled weights at twice the dose): token_tis_shuffled's "
             "token weights w rewritten to w ** 2 (their log-spread around 1 doubled, per token; bounded at 2)",
             correction="token_tis_shuffled_double"),
        _arm("token_tis_group_mean", "diagnostic: decoupled PPO, every loss token weighted by its GRPO group's mean "
             "token TIS weight (min(r, 2) averaged over the group's loss tokens: no variation within a group)",
             correction="token_tis_group_mean"),
        _arm("token_tis_group_permuted", "diagnostic (placebo of token_tis_group_mean): every loss token weighted by "
             "another GRPO group's mean token TIS weight (the group means deranged among the micro-batch's groups)",
             correction="token_tis_group_permuted"),
        _arm("token_tis_group_permuted_half", "diagnostic (the placebo at half the noise): token_tis_group_permuted's "
             "weights w rewritten to w ** 0.5 (their log-spread around 1 halved)",
             correction="token_tis_group_permuted_half"),
        _arm("token_tis_group_permuted_double", "diagnostic (the placebo at twice the noise): token_tis_group_permuted's "
             "weights w rewritten to w ** 2 (their log-spread around 1 doubled; bounded at 2)",
             correction="token_tis_group_permuted_double"),
        _arm("token_tis_group_permuted_wide", "diagnostic (the placebo at 3.5 times the noise, about the spread of "
             "token_tis_shuffled_half): token_tis_group_permuted's weights w rewritten to w ** 3.5 (bounded at 2)",
             correction="token_tis_group_permuted_wide"),
        _arm("token_tis_group_permuted_wider", "diagnostic (the placebo at 6 times the noise, about the spread of "
             "token_tis_shuffled): token_tis_group_permuted's weights w rewritten to w ** 6 (bounded at 2)",
             correction="token_tis_group_permuted_wider"),
        _arm("token_tis_balanced", "diagnostic: token TIS with each GRPO group's first-token weights scaled down on "
             "its heavier side so that sum_i w_i A_i over the first tokens (one shared context) is 0, as unweighted",
             correction="token_tis_balanced"),
        _arm("token_tis_unit", "diagnostic (null arm): decoupled PPO through the MIS engine with every token weight "
             "rewritten to exactly 1 (none's gradient by another code path)", correction="token_tis_unit"),
        _arm("token_mis", "decoupled PPO, token IS weight masked outside [0.5, 5] (MIS: out of the loss mask)", correction="token_mis"),
        _arm("sequence_tis", "decoupled PPO, sequence IS weight truncated at 2, batch-normalised", correction="sequence_tis"),
        _arm("sequence_mis", "decoupled PPO, sequence IS weight masked outside [1e-8, 2], batch-normalised", correction="sequence_mis"),
        _arm("geo_rs_token_tis", "geometric RS [0.999, 1.001] + token TIS 2", correction="geometric_rs_token_tis"),
        _arm("zscore_rs_token_mis", "token MIS [0.5, 5] + the length-scaled geometric band (seq_zscore_k1, K3 of the batch, "
             "z = 3)", correction="zscore_rs_token_mis"),
        _arm("seed000_default", "Let Speed Be With Stability's default: token TIS 1.5 + geometric RS [0.99, 1.001] + veto 1e-4, normalised", correction="seed000_default"),
        _arm("bypass_ppo", "PPO with pi_rollout as pi_old (its clip bounds pi_theta / pi_rollout), no weight", correction="bypass_ppo"),
        _arm("decoupled_ppo", "3-policy PPO with the unbounded token weight pi_old / pi_rollout", correction="decoupled_ppo"),
        _arm(
            "length_decay", "none + Beyond Precision's length-decay LR (surge pinned at step 20: the task has no length surge)",
            correction="none", lr_schedule="length-decay", lr_surge_step=20,
        ),
        _arm("r3", "rollout routing replay (MoE only): the trainer's routers use the rollout's experts; PPO, no IS weight",
             correction="none", routing_replay=True),
        _arm("r3_token_tis", "rollout routing replay (MoE only) + decoupled PPO with token IS weight truncated at 2",
             correction="token_tis", routing_replay=True),
        _arm("ref_fp32", "no-mismatch reference: fast fp32 rollouts (only reduction-order differences), fresh weights, "
             "the rollout's temperature in the trainer, no truncation; none", True,
             correction="none", rollout_precision="fp32", **NO_MECHANISM),
        _arm("ref_true_on_policy", "no-mismatch reference: true on-policy rollouts (bitwise equal log-probs), none", True,
             correction="none", rollout_precision="fp32", true_on_policy=True, **NO_MECHANISM),
    )
}
#: The arms of a dense setting (the routing-replay arms need an MoE model).
#: token_tis_normalized (added 2026-11-29 for the truncation sweeps) is left out so that a setting's default
#: arms stay the ones its archived report ran.
#: The token TIS diagnostics (DIAGNOSTIC_TIS: added 2026-12-01 for the temperature sweep) likewise.
DEFAULT_ARMS: tuple[str, ...] = tuple(
    a for a in ARMS
    if not ARMS[a].overrides.get("routing_replay") and a != "token_tis_normalized" and a not in DIAGNOSTIC_TIS
)

#: ``--quick``: a smoke run (explicit flags win).
QUICK: dict[str, Any] = {"seeds": 2, "steps": 4}
_QUICK_RUN: dict[str, Any] = {"prompts_per_step": 4, "samples_per_prompt": 4, "micro_batch_size": 8}


@dataclass(kw_only=True, slots=True)
class StudyConfig(ConfigBase):
    """Arms x seeds of the demo's GRPO run in one setting, with statistics (``docs/study.md``)."""

    setting: str = doc(DEFAULT_SETTING, "The task and mismatch source (see SETTINGS / --list).")
    sweep: str | None = doc(
        None, "A dose-response sweep (see SWEEPS / --list): every dose's setting with the sweep's arms; 'setting' is then ignored."
    )
    doses: list[str] | None = doc(None, "sweep only: the dose labels to run (null: all; with quick: the first and the last).")
    arms: list[str] | None = doc(
        None, "Arms to run (the first 'none' is the paired baseline); null: the setting's arms (DEFAULT_ARMS for a dense setting)."
    )
    seeds: int = doc(8, "Seeds per arm (seed s of every arm starts from the same weights and prompts).")
    first_seed: int = doc(0, "The first seed (seeds first_seed .. first_seed + seeds - 1).")
    steps: int | None = doc(None, "RL steps per run; null: the setting's.")
    jobs: int | None = doc(None, "Runs in parallel (worker processes); null: the available cores.")
    threads: int = doc(1, "Intra-op threads per worker process.")
    out_dir: str = doc("runs/study", "Folder of the study: OUT_DIR/SETTING/ARM/seed-S.jsonl, report.md, report.png, summary.json.")
    last_k: int = doc(10, "Final reward = mean reward of the last k steps.")
    threshold: float | None = doc(
        None,
        "Steps to threshold: the first step whose k-step moving mean reward reaches it; null: the setting's own "
        "(0.5; 0.2 for the long-tail task, whose plateau is 0.34-0.39).",
    )
    collapse_fraction: float = doc(
        0.5,
        "Collapse: a run that gained at least 0.1 reward (peak k-step moving mean - first k-step mean) "
        "and then lost more than this fraction of the gain by the end (final - start < (1 - f) x "
        "(peak - start)).",
    )
    bootstrap: int = doc(10000, "Bootstrap resamples per confidence interval.")
    confidence: float = doc(0.95, "Confidence level of the intervals.")
    quick: bool = doc(False, "Smoke mode: 2 seeds x 4 steps of 4 prompts x 4 samples (explicit flags win).")
    progress: bool = doc(True, "Show the tqdm bar over runs.")
    plot: bool = doc(True, "Write report.png.")
    extra: dict[str, Any] = doc(
        {},
        "Further DemoConfig fields for every run (--set KEY=VALUE), applied on top of the setting; an arm's own "
        "fields win (a no-mismatch reference keeps its reset: --set staleness=2 leaves ref_fp32 fresh).",
    )

    def _check(self) -> list[str]:
        out: list[str] = []
        if self.setting not in SETTINGS:
            out.append(f"setting={self.setting!r} is not one of {sorted(SETTINGS)}")
        if self.sweep is not None:
            if self.sweep not in SWEEPS:
                out.append(f"sweep={self.sweep!r} is not one of {sorted(SWEEPS)}")
            elif self.doses is not None:
                bad_doses = [d for d in self.doses if d not in SWEEPS[self.sweep].labels]
                if bad_doses or not self.doses:
                    out.append(f"doses={self.doses!r}: each must be one of {SWEEPS[self.sweep].labels}")
        elif self.doses is not None:
            out.append("doses needs a sweep")
        if self.arms is not None:
            unknown = [a for a in self.arms if a not in ARMS]
            if unknown:
                out.append(f"arms {unknown} are not among {list(ARMS)}")
            if not self.arms:
                out.append("arms is empty: name at least one arm (or null: the setting's arms)")
            if len(set(self.arms)) != len(self.arms):
                out.append(f"arms={self.arms!r} repeats an arm")
        if self.seeds < 1:
            out.append(f"seeds={self.seeds!r} must be >= 1")
        if self.first_seed < 0:
            out.append(f"first_seed={self.first_seed!r} must be >= 0")
        if self.steps is not None and self.steps < 1:
            out.append(f"steps={self.steps!r} must be >= 1 or null")
        if self.jobs is not None and self.jobs < 1:
            out.append(f"jobs={self.jobs!r} must be >= 1 or null")
        if self.threads < 1:
            out.append(f"threads={self.threads!r} must be >= 1")
        if self.last_k < 1:
            out.append(f"last_k={self.last_k!r} must be >= 1")
        if not 0 < self.collapse_fraction < 1:
            out.append(f"collapse_fraction={self.collapse_fraction!r} must lie in (0, 1)")
        if self.bootstrap < 100:
            out.append(f"bootstrap={self.bootstrap!r} must be >= 100")
        if not 0.5 < self.confidence < 1:
            out.append(f"confidence={self.confidence!r} must lie in (0.5, 1)")
        bad = sorted(set(self.extra) - set(DemoConfig.field_names()))
        if bad:
            out.append(f"extra keys {bad} are not DemoConfig fields")
        if not out:
            probe = self.for_dose(self.dose_labels[0]) if self.sweep is not None else self
            for arm in self.arm_names:  # every run's DemoConfig validates (e.g. a batch that does not split)
                try:
                    run_config(probe, arm, self.first_seed)
                except ValueError as exc:
                    out.append(f"arm {arm!r}: {exc}")
                    break
        return out

    @property
    def arm_names(self) -> list[str]:
        """The arms run: ``arms``, or the setting's default arms."""
        if self.arms is not None:
            return list(self.arms)
        if self.sweep is not None and self.sweep in SWEEPS:
            return list(SWEEPS[self.sweep].arms)
        return list(SETTINGS[self.setting].arms or DEFAULT_ARMS)

    @property
    def dose_labels(self) -> list[str]:
        """sweep only: the doses run (``doses``; with ``quick`` the first and the last; else all)."""
        labels = SWEEPS[self.sweep].labels
        if self.doses is not None:
            return [d for d in labels if d in self.doses]
        return [labels[0], labels[-1]] if self.quick else labels

    def for_dose(self, label: str) -> "StudyConfig":
        """sweep only: the study of one dose (its setting, the same arms, seeds and flags)."""
        values = self.to_dict()
        values.update(setting=SWEEPS[self.sweep].setting_name(label), sweep=None, doses=None)
        return StudyConfig(**values)

    @property
    def num_jobs(self) -> int:
        return self.jobs if self.jobs is not None else max(1, available_cpus() // self.threads)

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    @property
    def resolved_threshold(self) -> float:
        """``threshold``, or the sweep's / setting's own."""
        if self.threshold is not None:
            return self.threshold
        if self.sweep is not None:
            return SWEEPS[self.sweep].threshold
        return SETTINGS[self.setting].threshold

    @property
    def resolved_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        if self.quick:
            return int(QUICK["steps"])
        if self.sweep is not None:
            return SWEEP_STEPS
        return int(SETTINGS[self.setting].overrides["steps"])


def arm_overrides_of_extra(study: StudyConfig) -> list[tuple[str, str, Any, Any]]:
    """``(arm, key, the arm's value, the --set value)`` for every ``extra`` key an arm of the study
    sets to another value: the arm's value is the one run (a reference stays a reference)."""
    return [
        (arm, key, ARMS[arm].overrides[key], value)
        for arm in study.arm_names if arm in ARMS
        for key, value in study.extra.items()
        if key in ARMS[arm].overrides and ARMS[arm].overrides[key] != value
    ]


def run_config(study: StudyConfig, arm: str, seed: int, *, out_dir: str = "runs/study/.scratch") -> DemoConfig:
    """The :class:`DemoConfig` of one run: the setting, then ``--quick``, then the study's
    ``extra`` overrides (``--set``: they change the task or the mechanism), then the arm (its
    correction, or a no-mismatch reference's resets, which ``--set`` must not undo:
    :func:`arm_overrides_of_extra` lists where an arm wins), then ``steps``."""
    values: dict[str, Any] = dict(SETTINGS[study.setting].overrides)
    if study.quick:
        values.update(_QUICK_RUN)
    values.update(study.extra)
    values.update(ARMS[arm].overrides)
    values.update(
        steps=study.resolved_steps, seed=seed, name=f"{arm}-seed-{seed}", out_dir=out_dir,
        threads=study.threads, progress=False, plot=False, compare=False,
    )
    if values.get("lr_surge_step") is not None and values["lr_surge_step"] > values["steps"]:
        values["lr_surge_step"] = max(1, values["steps"] // 5)
    return DemoConfig(**values)
