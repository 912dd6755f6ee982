#!/usr/bin/env python3
"""A small mutation check of the integration layer: listed one-line mutants, each applied in a
throw-away copy of the tree, each against the tests that should catch it.

A mutant is an exact text substitution (``original`` must occur exactly once in ``file``) and the
tests that exercise that code. For every mutant the runner writes the mutated file into a copy of
the working tree (made once per run from ``git ls-files``; the real files are never edited),
runs ``python -m pytest -x`` on the listed tests with a timeout, restores the file, and records:

- ``killed``: the tests failed (the mutant was caught);
- ``survived``: the tests passed (a test gap, or an equivalent mutant: docs/testing.md says which);
- ``timeout``: the tests ran past ``--timeout`` (counted as killed, marked);
- ``error``: the mutant does not apply, or pytest could not run (usage / collection error): a
  defect of the list, never counted in the score.

Score = (killed + timeout) / (killed + timeout + survived); mutants reviewed as equivalent
(``equivalent=True``: no test can tell them from the original) are also reported apart.

Usage (one thread; the whole list takes tens of minutes on 2 cores, see docs/testing.md)::

    .venv/bin/python tools/mutate.py --list
    .venv/bin/python tools/mutate.py --check            # every mutant applies (no tests run)
    .venv/bin/python tools/mutate.py                    # all mutants
    .venv/bin/python tools/mutate.py --only loss-is-weights-ones,rollout-sample-t1 --json out.json

Not a CI step: it is slow by nature (every mutant re-runs its tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# test groups (pytest node ids relative to the repository root)
T_LOSS = ["tests/distributed/test_megatron_loss.py::test_decoupled_ppo_with_mis_at_temperature_equals_the_parts",
          "tests/distributed/test_megatron_loss.py::test_loss_value_equals_direct_computation"]
T_LOSS_ALL = ["tests/distributed/test_megatron_loss.py"]
T_ROLLOUT = ["tests/distributed/test_rollout_sampling.py"]
T_LEARN = ["tests/distributed/test_demo_learning.py"]
T_REPORT = ["tests/unit/test_study_report.py"]
T_ENGINE = ["tests/unit/test_engine.py"]
T_HOOKS = ["tests/distributed/test_lr_schedule.py"]
T_MONITOR = ["tests/unit/test_monitor.py", "tests/unit/test_surge.py"]
T_TP = ["tests/distributed/test_tp_logprobs.py"]
T_PACKING = ["tests/unit/test_packing.py"]
T_CP_MIS = ["tests/distributed/test_cp_mis.py"]
T_ROUTING = ["tests/unit/test_routing_sglang.py", "tests/distributed/test_routing_slicing.py"]
T_REPLAY = ["tests/distributed/test_routing_replay.py"]
T_TIS = ["tests/unit/test_list_adapter.py", "tests/e2e/test_examples_hosts.py"]
T_DEFERRED = ["tests/fakecuda/test_deferred_count.py"]
T_METRIC_STORE = ["tests/distributed/test_megatron_loss.py::test_tp2_and_dp2_match_single_process",
                  "tests/distributed/test_megatron_loss.py::test_decoupled_ppo_with_mis_at_temperature_equals_the_parts"]


@dataclass
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    tests: list[str]
    why: str = ""  # what the mutant breaks
    equivalent: bool = False  # reviewed: no test can tell it from the original (docs/testing.md)
    status: str = ""
    seconds: float = 0.0
    detail: str = field(default="", repr=False)


M = Mutant
MUTANTS: list[Mutant] = [
    # ---- the rows of issue 33 --------------------------------------------------------------
    M("loss-is-weights-ones", "megatron_mis/integrations/megatron_loss.py",
      "is_weights = res.weights.to(dev)", "is_weights = torch.ones_like(res.weights).to(dev)", T_LOSS,
      "MegatronRLLoss multiplies by all-ones IS weights (correction silently off)"),
    M("loss-ignores-temperature", "megatron_mis/integrations/megatron_loss.py",
      "temperature=self.config.rollout_temperature,", "temperature=1.0,", T_LOSS,
      "MegatronRLLoss computes log pi_theta at temperature 1"),
    M("train-negated-advantages", "megatron_mis/testbed/demo/train.py",
      "advantages=torch.repeat_interleave(advantages[idx], resp),",
      "advantages=torch.repeat_interleave(-advantages[idx], resp),", T_LEARN,
      "the demo trainer minimises reward"),
    M("rollout-sample-t1", "megatron_mis/testbed/demo/rollout/engine.py",
      "tok = _draw(filtered, generator)",
      "tok = _draw(_filter(torch.log_softmax(logits.float(), dim=-1), cfg.top_k, cfg.top_p), generator)", T_ROLLOUT,
      "fast path samples at T=1 while recording log-probs at T"),
    M("report-verdict-swapped", "megatron_mis/testbed/study/report.py",
      'return "supported" if above == (supported_if == "above") else "contradicted"',
      'return "contradicted" if above == (supported_if == "above") else "supported"', T_REPORT,
      "the study's verdicts swapped"),
    M("report-worse-side", "megatron_mis/testbed/study/report.py",
      'worse = d["excludes_zero"] and d["high"] < 0', 'worse = d["excludes_zero"] and d["low"] > 0', T_REPORT,
      "'measurably worse' tested on the wrong side of 0"),
    M("metrics-prob-veto-seq-negated", "megatron_mis/core/metrics.py",
      'seq("mis_prob_veto_seq_fraction", seqs.prob_vetoed)', 'seq("mis_prob_veto_seq_fraction", ~seqs.prob_vetoed)',
      T_ENGINE, "mis_prob_veto_seq_fraction negated"),
    M("metrics-after-bound-min-is-max", "megatron_mis/core/metrics.py",
      'summary["mis_weight_after_bound_min"], summary["mis_weight_after_bound_max"] = extrema[2], extrema[3]',
      'summary["mis_weight_after_bound_min"], summary["mis_weight_after_bound_max"] = extrema[3], extrema[3]',
      T_ENGINE, "mis_weight_after_bound_min computed as a max"),
    M("metrics-before-bound-mean-n-plus-1", "megatron_mis/core/metrics.py",
      "weight_counts = [nv, count]", "weight_counts = [nv + 1, count]",
      T_ENGINE, "..._before_bound_mean divided by n + 1"),
    M("engine-sequence-clip-is-truncate", "megatron_mis/core/engine.py",
      "return w.clamp(lo, hi), low, high", "return w.clamp(max=hi), low, high",
      ["tests/unit/test_engine.py::test_hand_derived_weights"],
      "sequence / geometric clip mode treated as truncate (the hand-derived geometric clip row)"),
    M("engine-deferred-count-event-unrecorded", "megatron_mis/core/engine.py",
      "            self._event.record()\n", "            pass\n", T_DEFERRED,
      "DeferredCount's CUDA event never recorded: a never-recorded event is complete, so poll() reads the "
      "pinned buffer before the non-blocking copy has landed (the fake-CUDA tier runs the CUDA branch)"),
    M("engine-deferred-count-never-queried", "megatron_mis/core/engine.py",
      "if self._event is not None and not self._event.query():", "if False:", T_DEFERRED,
      "DeferredCount.poll() reads the pinned buffer without asking whether its event completed"),
    M("engine-deferred-count-blocking-read", "megatron_mis/core/engine.py",
      "if self._event is not None and not self._event.query():",
      "if self._event is not None and self._event.synchronize():", T_DEFERRED,
      "DeferredCount.poll() waits for the device (Event.synchronize) instead of polling"),
    M("drop-in-pending-count-dropped", "megatron_mis/integrations/tis_functions.py",
      "state.nonfinite_backlog = [d for d, v in polled if v is None]", "state.nonfinite_backlog = []", T_DEFERRED,
      "a non-finite count whose CUDA event is still pending at the next call is lost (never warned)"),
    M("hooks-local-mean", "megatron_mis/integrations/scheduler_hooks.py",
      "    mean = global_mean_response_length(\n",
      "    mean = (lambda lengths, group: sum(lengths) / len(lengths) if len(lengths) else None)(\n", T_HOOKS,
      "observe_rollout feeds the rank-local mean instead of the all-reduced one"),
    # ---- integrations/ -----------------------------------------------------------------------
    M("loss-scale-no-world", "megatron_mis/integrations/megatron_loss.py",
      "return out.loss * float(num_microbatches * world), torch.tensor(1, dtype=torch.int), metrics",
      "return out.loss * float(num_microbatches), torch.tensor(1, dtype=torch.int), metrics", T_LOSS_ALL,
      "the 3-tuple loss forgets the data-parallel factor W"),
    M("loss-keep-mask-dropped", "megatron_mis/integrations/megatron_loss.py",
      "keep_mask = res.keep_mask.to(dev)", "keep_mask = torch.ones_like(res.keep_mask).to(dev)", T_LOSS,
      "rejected tokens stay in the loss"),
    M("loss-engine-on-pitheta", "megatron_mis/integrations/megatron_loss.py",
      "train = old if old is not None else log_probs.detach()", "train = log_probs.detach()", T_LOSS,
      "the engine's IS weight uses pi_theta instead of pi_old"),
    M("loss-denominator-rejected-kept", "megatron_mis/integrations/megatron_loss.py",
      "            keep &= full_keep.to(keep.device)\n", "            pass\n", T_LOSS,
      "rejected tokens stay in the denominators although rejected_in_denominator=False"),
    M("metric-store-lsum-denominator", "megatron_mis/integrations/rl_metrics.py",
      'out[k.partition("/")[2]] = v / num_loss if num_loss > 0 else 0.0',
      'out[k.partition("/")[2]] = v / (num_loss + 1) if num_loss > 0 else 0.0', T_METRIC_STORE,
      "loss-token metric means divided by n + 1"),
    M("metric-store-min-sign", "megatron_mis/integrations/rl_metrics.py",
      'out[f"{name}_{kind}"] = v if kind == "max" else -v', 'out[f"{name}_{kind}"] = v', T_METRIC_STORE,
      "reduced minima keep the negation of the MAX trick"),
    M("engine-metrics-ratio-max-min", "megatron_mis/integrations/rl_metrics.py",
      'out["max/mis_ratio"] = masked_extreme(ratio, valid, "max")', 'out["max/mis_ratio"] = masked_extreme(ratio, valid, "min")',
      T_METRIC_STORE + ["tests/e2e/test_demo.py::test_default_quick_run_bf16_mismatch_is_real"],
      "the ratio maximum reported as the minimum"),
    M("hooks-step-offset", "megatron_mis/integrations/scheduler_hooks.py",
      "    step = rollout_id + 1\n", "    step = rollout_id + 2\n", T_HOOKS,
      "rollout r observed as step r + 2"),
    # ---- parallel/ ---------------------------------------------------------------------------
    M("tp-logprobs-temperature", "megatron_mis/parallel/tp_logprobs.py",
      "return z / temperature if temperature != 1.0 else z", "return z", T_TP + T_LOSS,
      "vocab-parallel log-probs ignore the temperature"),
    # ---- monitor/ ----------------------------------------------------------------------------
    M("monitor-global-mean-no-allreduce", "megatron_mis/monitor/distributed.py",
      "    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)\n", "    pass\n", T_HOOKS,
      "the global mean response length is the local one"),
    M("monitor-global-mean-swapped", "megatron_mis/monitor/distributed.py",
      "    return total / count\n", "    return count / total if total else None\n", T_HOOKS,
      "mean computed upside down"),
    # ---- testbed trainer, rollout, report -----------------------------------------------------
    M("train-no-optimizer-step", "megatron_mis/testbed/demo/train.py",
      "            self.optimizer.step()\n", "            pass\n", T_LEARN, "the trainer never updates"),
    M("train-grad-from-main-grad-negated", "megatron_mis/testbed/demo/train.py",
      "                p.grad = p.main_grad.to(p.dtype)", "                p.grad = -p.main_grad.to(p.dtype)", T_LEARN,
      "gradient ascent on the loss"),
    M("train-old-logprobs-dropped", "megatron_mis/testbed/demo/train.py",
      "micro_batches = [mb.with_old_log_probs(o.cpu()) for mb, o in zip(micro_batches, old)]",
      "micro_batches = [mb.with_old_log_probs(None) for mb, o in zip(micro_batches, old)]",
      T_LEARN + ["tests/e2e/test_demo.py::test_fp32_rollouts_mismatch_is_rounding_and_runs_are_deterministic"],
      "pi_old never reaches the loss (the engine compares pi_theta with the rollout)"),
    M("rollout-record-t1", "megatron_mis/testbed/demo/rollout/engine.py",
      "logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)  # SGLang: fp32 log-softmax",
      "logp = torch.log_softmax(logits.float(), dim=-1)  # SGLang: fp32 log-softmax", T_ROLLOUT,
      "fast path samples and records at T=1"),
    M("rollout-aligned-sample-t1", "megatron_mis/testbed/demo/rollout/engine.py",
      "tok = _sample(log_softmax_from_shards(row_shards, temperature=cfg.temperature), cfg, generator)",
      "tok = _sample(log_softmax_from_shards(row_shards, temperature=1.0), cfg, generator)", T_ROLLOUT,
      "true-on-policy path samples at T=1"),
    M("rollout-logp-wrong-token", "megatron_mis/testbed/demo/rollout/engine.py",
      "logp_tok = logp.gather(-1, tok[:, None]).squeeze(-1)", "logp_tok = logp.max(-1).values", T_ROLLOUT,
      "records the log-prob of the argmax instead of the sampled token"),
    M("rollout-top-p-off-by-one", "megatron_mis/testbed/demo/rollout/sampling.py",
      "drop_sorted = before >= top_p", "drop_sorted = before > top_p", ["tests/distributed/test_rollout.py::test_top_k_top_p_filtering"],
      "nucleus keeps one token too many at an exact boundary"),
    M("report-better-side", "megatron_mis/testbed/study/report.py",
      'and v["vs_none"][key]["low"] > 0]', 'and v["vs_none"][key]["high"] > 0]', T_REPORT,
      "'measurably better' tested on the high end (equivalent: the arms are already filtered on excludes_zero)",
      equivalent=True),
    M("report-collapse-majority", "megatron_mis/testbed/study/report.py",
      'majority = c["k"] > c["n"] / 2', 'majority = c["k"] >= c["n"]', T_REPORT,
      "a collapse majority needs every seed"),
    M("report-recover-inside", "megatron_mis/testbed/study/report.py",
      'and ref_ci[1] <= s[key][0] <= ref_ci[2]]', 'and ref_ci[1] <= s[key][0]]', T_REPORT,
      "'recovers' ignores the upper end of the reference's CI"),
    M("sweep-outcome-ignored", "megatron_mis/testbed/study/sweep_report.py",
      '.get("vs_reference", {}).get(sweep.outcome)', '.get("vs_reference", {}).get("final_reward")',
      ["tests/unit/test_study_archive.py"],
      "a top-p sweep's none - reference read on the training reward, not its outcome (the greedy reward)"),
    M("report-outcome-ignored", "megatron_mis/testbed/study/report.py",
      'key = summary["outcome"]  # the reward the arms are compared on', 'key = "final_reward"', T_REPORT,
      "a top-p setting's answers read on the training reward, not its outcome (the greedy reward)"),
    M("monitor-gap-floor", "megatron_mis/monitor/config.py",
      '{"mis_k3_kl": 1e-8, "mis_log_ppl_abs_diff": 1e-5}', '{"mis_k3_kl": 1e-8}', T_MONITOR,
      "the log-ppl gap at fp32 rounding unfloored (its wobble fires the trend rule)"),
    M("report-seq-vs-token-direction", "megatron_mis/testbed/study/report.py",
      'verdict = _verdict(d, supported_if="above")', 'verdict = _verdict(d, supported_if="below")', T_REPORT,
      "seed 001's claim tested in the wrong direction"),
    M("stats-paired-order", "megatron_mis/testbed/study/stats.py",
      "diffs = [float(arm[s]) - float(baseline[s]) for s in seeds]",
      "diffs = [float(baseline[s]) - float(arm[s]) for s in seeds]", T_REPORT + ["tests/unit/test_study_stats.py"],
      "paired differences baseline - arm"),
    # ---- more parallel/ -----------------------------------------------------------------------
    M("layout-zigzag-chunks-swapped", "megatron_mis/parallel/layout.py",
      "return (r * c, (r + 1) * c), ((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c)",
      "return ((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c), (r * c, (r + 1) * c)", T_PACKING + T_CP_MIS,
      "a CP rank's two zigzag chunks in the wrong order"),
    M("packing-thd-index-swapped", "megatron_mis/parallel/packing.py",
      "pos = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))",
      "pos = torch.where(j < c, (2 * cp_size - 1 - cp_rank) * c + j, cp_rank * c + (j - c))", T_PACKING,
      "thd global index with the chunks swapped"),
    M("cp-mis-rejection-bits-not-shared", "megatron_mis/parallel/cp_mis.py",
      "dist.all_reduce(bits, group=cp.group)  # each position is set by exactly one rank",
      "pass  # each position is set by exactly one rank", T_CP_MIS,
      "token rejections of other CP ranks missing from the full-length masks"),
    M("cp-mis-mask-nonnegative", "megatron_mis/parallel/cp_mis.py",
      "return mask if mask.dtype == torch.bool else mask > 0", "return mask if mask.dtype == torch.bool else mask >= 0",
      T_CP_MIS + ["tests/unit/test_list_adapter.py"], "a 0 loss-mask value counts as in the loss"),
    # ---- routing/ ------------------------------------------------------------------------------
    M("routing-moe-pattern-offset", "megatron_mis/routing/slicing.py",
      "return [i % moe_layer_freq == 0 for i in range(num_layers)]",
      "return [i % moe_layer_freq == 1 for i in range(num_layers)]", T_ROUTING,
      "the wrong layers are MoE for moe_layer_freq k"),
    M("routing-thd-offsets", "megatron_mis/routing/slicing.py",
      "offsets = torch.cumsum(total, 0) - total", "offsets = torch.cumsum(total, 0)", T_ROUTING,
      "every sample's routes shifted by its own length"),
    M("routing-thd-padding-edge", "megatron_mis/routing/slicing.py",
      "pieces.append(torch.where(pos < t, pos + off, torch.full_like(pos, -1)))",
      "pieces.append(torch.where(pos <= t, pos + off, torch.full_like(pos, -1)))", T_ROUTING,
      "the first padding position of a CP chunk takes the next sample's route"),
    M("routing-compact-dtype-boundary", "megatron_mis/routing/sglang.py",
      "    if num_experts <= 256:\n", "    if num_experts < 256:\n", ["tests/unit/test_routing_sglang.py"],
      "256 experts no longer fit uint8 (a wider dtype: memory only)"),
    # ---- more monitor/ -------------------------------------------------------------------------
    M("surge-patience-off-by-one", "megatron_mis/monitor/surge.py",
      "self._streak >= self.config.length_surge_patience", "self._streak > self.config.length_surge_patience",
      T_MONITOR + T_HOOKS, "the surge fires one observation late"),
    M("surge-ratio-strict", "megatron_mis/monitor/surge.py",
      "and smoothed >= self.config.length_surge_ratio * reference", "and smoothed > self.config.length_surge_ratio * reference",
      T_MONITOR + T_HOOKS, "a length of exactly ratio x the reference no longer counts"),
    M("monitor-spike-direction", "megatron_mis/monitor/monitor.py",
      "if baseline > 0 and value > cfg.monitor_spike_factor * baseline:",
      "if baseline > 0 and value < cfg.monitor_spike_factor * baseline:", T_MONITOR, "spikes reported for dips"),
    M("monitor-trend-and-or", "megatron_mis/monitor/monitor.py",
      "if growth >= cfg.monitor_trend_min_growth and tau >= cfg.monitor_trend_min_tau:",
      "if growth >= cfg.monitor_trend_min_growth or tau >= cfg.monitor_trend_min_tau:", T_MONITOR,
      "a trend warning on growth alone or monotonicity alone"),
    M("monitor-kendall-one-sided", "megatron_mis/monitor/monitor.py",
      "score += (vj > vi) - (vj < vi)", "score += (vj > vi)", T_MONITOR, "Kendall's tau ignores discordant pairs"),
    # ---- more integrations/ --------------------------------------------------------------------
    M("tis-drop-in-weights-ignored", "megatron_mis/integrations/tis_functions.py",
      "new_loss = torch.where(keep, pg_loss * weights, 0.0)", "new_loss = torch.where(keep, pg_loss, 0.0)",
      ["tests/unit/test_engine_contract.py", "tests/unit/test_list_adapter.py", "tests/distributed/test_cp_mis.py"],
      "the slime / Miles drop-in forgets the IS weights"),
    M("tis-drop-in-keep-ignored", "megatron_mis/integrations/tis_functions.py",
      "new_loss = torch.where(keep, pg_loss * weights, 0.0)", "new_loss = pg_loss * weights",
      ["tests/unit/test_engine_contract.py", "tests/unit/test_list_adapter.py", "tests/distributed/test_cp_mis.py"],
      "rejected tokens multiplied by their weight 0 instead of set to 0 (differs only for non-finite pg_loss)"),
    # ---- issue 29: the length-scaled band, router noise, --set layering, the entropy bonus ---------
    M("zscore-uncentred", "megatron_mis/core/engine.py",
      'out[name] = has_valid & ((level_log_r["geometric"] + k3).abs() > half)',
      'out[name] = has_valid & (level_log_r["geometric"].abs() > half)',
      ["tests/unit/test_engine_rs_criteria.py"],
      "seq_zscore_k1's band centred on 0 instead of -K3 (long answers rejected too often)"),
    M("zscore-batch-k3-over-mask", "megatron_mis/core/engine.py",
      "k3 = (stats.col(SequenceSum.SUM_K3).sum() / n_valid.sum().clamp_min(1))",
      "k3 = (stats.col(SequenceSum.SUM_K3).sum() / stats.col(SequenceSum.N_MASK).sum().clamp_min(1))",
      ["tests/unit/test_engine_rs_criteria.py"],
      "k3: batch averages over loss-mask tokens, neutralised non-finite ones included"),
    M("router-noise-ignored", "megatron_mis/testbed/demo/rollout/fast.py",
      "if self.router_noise > 0 and generator is not None:", "if False:",
      ["tests/distributed/test_rollout_moe.py::test_router_noise_flips_expert_choices_at_a_rate_that_grows_with_it"],
      "the rollout's router noise never applied (the moe-noise dose is 0 at every dose)"),
    M("study-set-overrides-arm", "megatron_mis/testbed/study/config.py",
      "    values.update(study.extra)\n    values.update(ARMS[arm].overrides)\n",
      "    values.update(ARMS[arm].overrides)\n    values.update(study.extra)\n",
      ["tests/e2e/test_study.py::test_set_changes_the_mechanism_and_a_reference_stays_a_reference"],
      "--set applied over the arm: a no-mismatch reference made stale by --set staleness=K"),
    M("demo-entropy-coef-dropped", "megatron_mis/testbed/demo/train.py",
      "entropy_coef=cfg.entropy_coef,", "entropy_coef=0.0,",
      ["tests/distributed/test_testbed_mechanisms.py::test_entropy_coef_reaches_every_arms_loss_and_is_validated"],
      "--entropy-coef never reaches the loss"),
    M("stale-fraction-all-fresh", "megatron_mis/testbed/demo/train.py",
      "            old_part = self.engine.generate(prompts[:cut], generator=self.g_rollout)\n            self.engine.load_weights(self._weights())\n",
      "            self.engine.load_weights(self._weights())\n            old_part = self.engine.generate(prompts[:cut], generator=self.g_rollout)\n",
      ["tests/distributed/test_testbed_mechanisms.py::test_mixed_staleness_samples_the_first_groups_stale_and_the_rest_fresh"],
      "a mixed batch sampled entirely with the current weights (staleness-mixed has no stale groups)"),
    M("recommend-middle-sequence-mis", "megatron_mis/analysis/recommend.py",
      '            "token_tis", None, None, s, share, "sequence-level",',
      '            "sequence_mis", None, None, s, share, "sequence-level",',
      ["tests/unit/test_recommend.py"],
      "analyze advises sequence MIS for 0.15 < s <= 1 again (the study measured no benefit and a lost run at 128 tokens)"),
    M("recommend-one-sided-ignored", "megatron_mis/analysis/report.py",
      "    return asdict(recommend(k3, length, share_ratio_above=above))",
      "    return asdict(recommend(k3, length))",
      ["tests/unit/test_recommend.py"],
      "analyze ignores the ratio histogram: processed top-k / top-p log-probs get token MIS again, "
      "not the sampling fix"),
    M("recommend-one-sided-bin", "megatron_mis/analysis/recommend.py",
      "    return float(sum(counts[start[0] + 1:])) / total if total > 0 else None",
      "    return float(sum(counts[start[0]:])) / total if total > 0 else None",
      ["tests/unit/test_recommend.py"],
      "the share above the bound counts the bin just below it (ratios 1.06-1.12 as 'above')"),
    M("monitor-rejected-bound-dropped", "megatron_mis/monitor/config.py",
      '        {"mis_k3_kl": 1e-2, "mis_rejected_token_fraction": 0.5},',
      '        {"mis_k3_kl": 1e-2},',
      ["tests/unit/test_monitor.py"],
      "the monitor stays silent when a correction rejects every loss token (token MIS over processed top-k)"),
    M("testbed-monitor-without-rejections", "megatron_mis/testbed/demo/train.py",
      '                   "mis_rejected_token_fraction": record["rejected_token_fraction"]},',
      '                   "mis_rejected_token_fraction": None},',
      ["tests/distributed/test_testbed_mechanisms.py::test_the_monitor_flags_a_correction_that_rejects_every_token"],
      "the testbed's monitor is not fed the rejected-token fraction, so the study's runs cannot show the bound"),
    M("ended-low-from-the-peak", "megatron_mis/testbed/study/report.py",
      'if m["final_reward"] - m["start_reward"] < bar)', 'if m["peak_reward"] - m["start_reward"] < bar)',
      ["tests/unit/test_study_report.py::test_ended_low_counts_runs_that_never_reach_the_plateau"],
      "a run that reached the plateau and fell off it is not counted as ended low (the peak read for the end)"),
    M("threshold-ignores-the-setting", "megatron_mis/testbed/study/config.py",
      "        return SETTINGS[self.setting].threshold", "        return 0.5",
      ["tests/unit/test_study_report.py::test_steps_to_threshold_is_the_settings_own_unless_given"],
      "a long-tail dose's report times a 0.5 its runs never reach (steps to threshold 0/n everywhere)"),
    M("study-scratch-left-behind", "megatron_mis/testbed/study/runner.py",
      "        for scratch in scratches:  # also a killed worker's", "        for scratch in []:  # also a killed worker's",
      ["tests/e2e/test_study_dose.py::test_an_interrupted_sweep_exits_promptly"],
      "an interrupted study leaves its killed workers' scratch folders (half-written runs) in the temp folder"),
    M("sweep-copy-ignores-other-doses", "megatron_mis/testbed/study/runner.py",
      "sources=others + _other_sweeps_on_disk(study))", "sources=_other_sweeps_on_disk(study))",
      ["tests/e2e/test_study_dose.py::test_a_sweep_of_some_doses_copies_a_finished_run_of_another_dose"],
      "--doses reruns the reference another dose already finished"),
    M("sweep-copy-ignores-other-sweeps", "megatron_mis/testbed/study/runner.py",
      "sources=others + _other_sweeps_on_disk(study))", "sources=others)",
      ["tests/e2e/test_study_dose.py::test_a_sweep_copies_a_finished_run_of_another_sweep"],
      "a sweep reruns a run another sweep in the same out-dir already finished"),
    M("cpu-compat-skips-with-cuda", "megatron_mis/testing/cpu.py",
      "    global _depth\n    with _lock:", "    global _depth\n    if torch.cuda.is_available():\n        yield\n        return\n    with _lock:",
      ["tests/unit/test_testing_cpu.py::test_cpu_compat_installs_its_shims_where_cuda_is_available_too"],
      "the CPU shims skipped where CUDA is available (the demo failed so on an H100)"),
    M("current-device-cpu-for-torch-too", "megatron_mis/testing/cpu.py",
      "        if (caller == \"torch\" or caller.startswith(\"torch.\")) and torch.cuda.is_available():",
      "        if False:",
      ["tests/unit/test_testing_cpu.py::test_cpu_compat_installs_its_shims_where_cuda_is_available_too"],
      "torch.cuda.current_device() is \"cpu\" for torch's own modules too (TorchDynamo failed so on an H100)"),
    M("archive-shares-bodies-by-prefix", "megatron_mis/testbed/study/archive.py",
      "        digest = hashlib.sha256(body.encode(\"utf-8\")).hexdigest()",
      "        digest = hashlib.sha256(body[:40].encode(\"utf-8\")).hexdigest()",
      ["tests/unit/test_study_archive.py::test_round_trip_is_lossless_and_a_copied_body_is_stored_once"],
      "the run archive shares a body between runs whose bodies only begin alike (lossy)"),
    M("archive-restore-overwrites", "megatron_mis/testbed/study/archive.py",
      "        if path.is_file():\n            counts[\"present\"] += 1",
      "        if False:\n            counts[\"present\"] += 1",
      ["tests/unit/test_study_archive.py::test_restore_keeps_files_on_disk_and_update_merges"],
      "restoring an archive overwrites the run files already on disk"),
    M("archive-rewrites-unchanged-runs", "megatron_mis/testbed/study/archive.py",
      "            if rel not in full:", "            if True:",
      ["tests/unit/test_study_archive.py::test_round_trip_is_lossless_and_a_copied_body_is_stored_once"],
      "the run archive rewrites every run on each update (every file a git change)"),
    M("archive-replaced-by-disk", "megatron_mis/testbed/study/archive.py",
      "            if rel not in runs:", "            if True:",
      ["tests/unit/test_study_archive.py::test_restore_keeps_files_on_disk_and_update_merges"],
      "a run of another configuration in the out-dir replaces the archive's run of the same name"),
    M("sigterm-unhandled", "megatron_mis/cli/stopping.py",
      "    previous = signal.signal(signal.SIGTERM, stop)", "    previous = signal.getsignal(signal.SIGTERM)",
      ["tests/unit/test_cli_stopping.py::test_the_stop_handler_is_scoped_and_holds_a_signal_back_while_the_archive_is_written"],
      "SIGTERM kills a study or demo at once: workers orphaned, scratch left, the archive not updated"),
    M("signal-deferral-missing", "megatron_mis/cli/stopping.py",
      "    previous = signal.signal(signum, lambda received, frame: held.append(received))",
      "    previous = signal.getsignal(signum)",
      ["tests/unit/test_cli_stopping.py::test_the_stop_handler_is_scoped_and_holds_a_signal_back_while_the_archive_is_written",
       "tests/unit/test_cli_stopping.py::test_a_signal_that_another_thread_receives_is_held_back_too"],
      "a SIGTERM during the archive update stops it half-written"),
    M("tqdm-lock-multiprocess", "megatron_mis/testbed/demo/launch.py",
      "    tqdm.set_lock(threading.RLock())", "    pass",
      ["tests/e2e/test_study_dose.py::test_sigterm_stops_a_sweep_and_keeps_its_runs_in_the_archive"],
      "a stopped study or demo ends with a 'leaked semaphore objects' warning from the killed workers' tqdm lock"),
    M("pool-backend-ignored", "megatron_mis/testing/distributed.py",
      "        if backend not in (\"gloo\", \"nccl\"):", "        if False:",
      ["tests/distributed/test_group_cleanup.py::test_pool_arguments_are_validated"],
      "an unknown process-group backend accepted silently"),
]


def _tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


def make_copy(dest: Path) -> None:
    """Copy the working tree's tracked and untracked-but-not-ignored files into ``dest``."""
    for rel in _tree_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def check_applies(m: Mutant, root: Path = ROOT) -> str | None:
    """``None`` if ``m`` applies to ``root`` (original found exactly once), else why not."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    n = path.read_text(encoding="utf-8").count(m.original)
    if n != 1:
        return f"original found {n} times in {m.file} (must be exactly once)"
    if m.original == m.replacement:
        return "replacement equals the original"
    for t in m.tests:
        if not (root / t.split("::")[0]).is_file():
            return f"test file {t.split('::')[0]} does not exist"
    return None


def run_mutant(m: Mutant, copy: Path, python: str, timeout: float) -> None:
    problem = check_applies(m, copy)
    if problem:
        m.status, m.detail = "error", problem
        return
    path = copy / m.file
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace(m.original, m.replacement, 1), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *m.tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = None, str(exc)[-300:]
    finally:
        path.write_text(text, encoding="utf-8")
    m.seconds = time.monotonic() - t0
    if rc is None:
        m.status = "timeout"
    elif rc == 0:
        m.status = "survived"
    elif rc == 1:
        m.status = "killed"
    else:  # 2 interrupted / 3 internal / 4 usage / 5 no tests: the list is wrong, not the code
        m.status = "error"
    m.detail = tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--check", action="store_true", help="check that every mutant applies; run no test")
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's test run (default 600)")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the interpreter to run pytest with")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        print(f"duplicate mutant ids: {sorted(dup)}", file=sys.stderr)
        return 2
    chosen = MUTANTS
    if args.only:
        want = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [w for w in want if w not in ids]
        if unknown:
            print(f"unknown mutant ids {unknown}; known: {', '.join(ids)}", file=sys.stderr)
            return 2
        chosen = [m for m in MUTANTS if m.id in want]
    if args.list:
        for m in chosen:
            print(f"{m.id:38s} {m.file}: {m.why}")
        return 0
    bad = [(m.id, p) for m in chosen if (p := check_applies(m))]
    for mid, p in bad:
        print(f"[does not apply] {mid}: {p}", file=sys.stderr)
    if args.check:
        print(f"{len(chosen) - len(bad)}/{len(chosen)} mutants apply")
        return 1 if bad else 0

    with tempfile.TemporaryDirectory(prefix="mis_mutate_") as tmp:
        copy = Path(tmp) / "tree"
        make_copy(copy)
        probe = subprocess.run([args.python, "-c", "import megatron_mis, sys; sys.stdout.write(megatron_mis.__file__)"],
                               cwd=copy, capture_output=True, text=True)
        if not probe.stdout.startswith(str(copy)):
            print(f"the copy's package is not the one imported from it ({probe.stdout or probe.stderr}); "
                  "run with an interpreter whose megatron_mis is not pinned elsewhere", file=sys.stderr)
            return 2
        for i, m in enumerate(chosen, 1):
            run_mutant(m, copy, args.python, args.timeout)
            print(f"[{i}/{len(chosen)}] {m.status:8s} {m.seconds:6.1f}s  {m.id}", flush=True)
            if m.status == "error":
                print("    " + m.detail.strip().replace("\n", "\n    ")[-600:], flush=True)
    killed = sum(m.status in ("killed", "timeout") for m in chosen)
    survived = [m for m in chosen if m.status == "survived"]
    errors = [m for m in chosen if m.status == "error"]
    scored = killed + len(survived)
    score = killed / scored if scored else float("nan")
    print(f"\nkilled {killed}, survived {len(survived)}, errors {len(errors)}; score {killed}/{scored} = {score:.1%}")
    equivalent = [m for m in survived if m.equivalent]
    if equivalent:
        rest = scored - len(equivalent)
        print(f"without the {len(equivalent)} known equivalent mutant(s): {killed}/{rest} = {killed / rest if rest else float('nan'):.1%}")
    for m in survived:
        print(f"  survived{' (equivalent)' if m.equivalent else ''}: {m.id} ({m.file}: {m.why})")
    if args.json:
        Path(args.json).write_text(json.dumps({"score": score, "mutants": [asdict(m) for m in chosen]}, indent=1) + "\n")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
