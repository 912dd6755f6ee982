"""The dose-response mechanisms of the testbed do what they say (issue 29):

- staleness k: the rollout engine samples with the weights of exactly k optimizer steps earlier
  (the first steps with the initial weights), also with several optimizer steps per batch;
- temperature mismatch: the rollout records log_softmax(logits / T) while the trainer's pi_old
  is computed at T = 1;
- top-p / top-k: the processed log-probs are those of the truncated, renormalised distribution
  (hand-derived), the raw ones those of the full softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mis.testbed.demo.config import DemoConfig
from megatron_mis.testbed.demo.rollout.sampling import processed_log_probs
from megatron_mis.testing.distributed import ProcessGroupPool

_SMALL = dict(prompts_per_step=4, samples_per_prompt=4, micro_batch_size=8, rollout_precision="fp32",
              progress=False, plot=False, threads=1)


@pytest.fixture(scope="module")
def pool1():
    with ProcessGroupPool(1) as pool:
        yield pool


# ------------------------------------------------------------------------- hand-derived
def test_processed_log_probs_hand_derived():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = p.log()
    # top_p 0.7: mass strictly before 0.5 is 0 and before 0.3 is 0.5 (< 0.7): kept; before 0.15 is 0.8: dropped
    out = processed_log_probs(lp, 0, 0.7)
    torch.testing.assert_close(out[0, :2], torch.tensor([math.log(0.5 / 0.8), math.log(0.3 / 0.8)]))
    assert torch.isinf(out[0, 2:]).all() and (out[0, 2:] < 0).all()
    # top_k 3: the three largest renormalised over 0.95
    out = processed_log_probs(lp, 3, 1.0)
    torch.testing.assert_close(out[0, :3], (p[0, :3] / 0.95).log())
    assert out[0, 3] == float("-inf")
    # neither: the row unchanged
    torch.testing.assert_close(processed_log_probs(lp, 0, 1.0), lp)


def test_mechanism_fields_are_validated_together():
    from megatron_mis.config.base import ConfigError

    with pytest.raises(ConfigError) as err:
        DemoConfig(staleness=-1, top_p=0.0, top_k=-2, trainer_temperature=0.0, rollout_logprobs="sorted")
    msg = str(err.value)
    for part in ("staleness=-1", "top_p=0.0", "top_k=-2", "trainer_temperature=0.0", "rollout_logprobs='sorted'"):
        assert part in msg
    with pytest.raises(ConfigError, match="true_on_policy with staleness"):
        DemoConfig(true_on_policy=True, staleness=2)


def test_entropy_coef_reaches_every_arms_loss_and_is_validated():
    """--entropy-coef is the loss's entropy bonus in every arm (none, the built-in PPO variants and
    a preset), and a value outside [0, 1] is an error naming it."""
    from megatron_mis.config.base import ConfigError
    from megatron_mis.testbed.demo.train import arm_spec

    cfg = DemoConfig(entropy_coef=0.02, **_SMALL)
    for correction in ("none", "bypass_ppo", "decoupled_ppo", "token_tis", "zscore_rs_token_mis"):
        assert arm_spec(correction, cfg).loss.entropy_coef == 0.02, correction
    assert arm_spec("none", DemoConfig(**_SMALL)).loss.entropy_coef == 0.0
    with pytest.raises(ConfigError, match=r"entropy_coef=-0.1 must lie in \[0, 1\]"):
        DemoConfig(entropy_coef=-0.1)


# ------------------------------------------------------------------------------ staleness
def _staleness_run(k: int, updates: int, steps: int):
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(staleness=k, updates_per_step=updates, steps=steps, correction="none", **_SMALL)
    out = []
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec("none", cfg))
        history = [trainer._weights().tensors]  # history[n]: the weights after n optimizer steps
        for step in range(1, steps + 1):
            record = trainer.step(step)
            used = trainer.engine.weights.tensors
            match = [n for n, h in enumerate(history) if h is not None and all(torch.equal(h[key], used[key]) for key in h)]
            out.append({"n_before": len(history) - 1, "match": match, "lag": record["policy_lag"]})
            for _ in range(updates):  # the trainer made `updates` optimizer steps; only the last is observable
                history.append(None)
            history[-1] = trainer._weights().tensors
        trainer.close()
    return out


@pytest.mark.parametrize("k,updates", [(0, 1), (2, 1), (3, 1), (4, 2), (3, 2)])
def test_staleness_samples_with_the_weights_of_k_optimizer_steps_earlier(pool1, k, updates):
    (rows,) = pool1.run(_staleness_run, k, updates, 6)
    for step, row in enumerate(rows, start=1):
        n = row["n_before"]  # optimizer steps done before this step's rollout
        assert n == (step - 1) * updates
        want = max(0, n - k)
        if updates > 1 and want % updates:  # an intermediate version: not in the history, but not the others either
            assert row["match"] == [], row
        else:
            # exactly that version (versions are distinct once the model moved)
            assert row["match"] == [want], (step, row)
        assert row["lag"] == n - want


def _mixed_staleness_run(k: int, fraction: float, steps: int):
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(staleness=k, stale_fraction=fraction, steps=steps, correction="none", **_SMALL)
    out = []
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec("none", cfg))
        history = [trainer._weights().tensors]
        calls = []
        generate = trainer.engine.generate

        def spy(prompts, *, generator=None):  # which weights each generate call samples with
            used = trainer.engine.weights.tensors
            calls.append((len(prompts), [n for n, h in enumerate(history) if all(torch.equal(h[key], used[key]) for key in h)]))
            batch = generate(prompts, generator=generator)
            calls[-1] += (batch.num_sequences,)
            return batch

        trainer.engine.generate = spy
        for step in range(1, steps + 1):
            calls.clear()
            record = trainer.step(step)
            out.append({"n_before": len(history) - 1, "calls": list(calls), "lag": record["policy_lag"],
                        "share": record.get("stale_fraction")})
            history.append(trainer._weights().tensors)
        trainer.close()
    return out


@pytest.mark.parametrize("k,fraction", [(2, 0.5), (3, 0.25)])
def test_mixed_staleness_samples_the_first_groups_stale_and_the_rest_fresh(pool1, k, fraction):
    """stale_fraction f: the first f x prompts_per_step groups come from the weights of k optimizer
    steps earlier, the other groups from the current weights, in one batch of every group."""
    (rows,) = pool1.run(_mixed_staleness_run, k, fraction, 5)
    stale = round(fraction * 4) * 4  # prompts_per_step 4 x samples_per_prompt 4
    for step, row in enumerate(rows, start=1):
        n = row["n_before"]
        assert n == step - 1
        assert [c[0] for c in row["calls"]] == [stale, 16 - stale] == [c[2] for c in row["calls"]]
        if n - max(0, n - k):  # the versions differ: each part matches its own one only
            assert row["calls"][0][1] == [max(0, n - k)] and row["calls"][1][1] == [n], (step, row)
        assert row["lag"] == n - max(0, n - k) and row["share"] == fraction


def test_stale_fraction_is_validated():
    from megatron_mis.config.base import ConfigError

    with pytest.raises(ConfigError, match="needs staleness >= 1"):
        DemoConfig(stale_fraction=0.5)
    with pytest.raises(ConfigError, match=r"stale_fraction=0.3 x prompts_per_step=16 = 4.8 must be a whole number"):
        DemoConfig(staleness=2, stale_fraction=0.3)
    with pytest.raises(ConfigError, match=r"= 1.6e-11 must be a whole number of prompt groups >= 1"):
        DemoConfig(staleness=2, stale_fraction=1e-12)  # within rounding of 0 groups: still no stale group
    with pytest.raises(ConfigError, match=r"stale_fraction=1.5 must lie in \(0, 1\]"):
        DemoConfig(staleness=2, stale_fraction=1.5)
    assert DemoConfig(staleness=2, stale_fraction=0.25).stale_fraction == 0.25


def test_rollout_batch_concat_keeps_the_order_and_refuses_mixed_engines():
    from megatron_mis.testbed.demo.rollout import RolloutBatch

    def batch(ids, precision="fp32", support=None):
        return RolloutBatch(prompts=[torch.tensor([i]) for i in ids], responses=[torch.tensor([i, i + 1]) for i in ids],
                            rollout_log_probs=[torch.tensor([-float(i), -1.0]) for i in ids],
                            finished=torch.tensor([i % 2 == 0 for i in ids]), precision=precision, support=support)

    joined = RolloutBatch.concat([batch([1, 2]), batch([3])])
    assert [int(p) for p in joined.prompts] == [1, 2, 3] and joined.finished.tolist() == [False, True, False]
    assert [r.tolist() for r in joined.rollout_log_probs] == [[-1.0, -1.0], [-2.0, -1.0], [-3.0, -1.0]]
    with pytest.raises(ValueError, match="different engine configurations"):
        RolloutBatch.concat([batch([1]), batch([2], precision="bf16")])
    with pytest.raises(ValueError, match="routes or supports"):
        RolloutBatch.concat([batch([1]), batch([2], support=[[[]]])])


# ------------------------------------------------------------------------- temperature
def _temperature_run(t_rollout: float):
    from megatron_mis.parallel.packing import pack_sequences
    from megatron_mis.testbed.demo.scoring import trainer_log_probs
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(temperature=t_rollout, trainer_temperature=1.0, steps=1, correction="token_tis", **_SMALL)
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec("token_tis", cfg))
        prompts = [p.prompt for p in trainer.task.sample(8, generator=torch.Generator().manual_seed(3))]
        batch = trainer.engine.generate(prompts, generator=torch.Generator().manual_seed(4))
        packed = pack_sequences(batch.sequences)
        with torch.no_grad():
            at_t = trainer_log_probs(trainer.model, packed, batch.response_lengths, temperature=t_rollout)
            at_1 = trainer_log_probs(trainer.model, packed, batch.response_lengths, temperature=1.0)
        # the trainer's own pi_old recompute (the loss's temperature) on one step's batch
        from megatron_mis.integrations.megatron_loss import RLMicroBatch

        lengths = torch.tensor([s.numel() for s in batch.sequences])
        mb = RLMicroBatch(
            tokens=torch.cat(batch.sequences),
            cu_seqlens=torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).int(),
            response_lengths=batch.response_lengths, loss_mask=torch.ones(int(batch.response_lengths.sum())),
            advantages=torch.zeros(int(batch.response_lengths.sum())),
            rollout_log_probs=torch.cat(batch.rollout_log_probs), pad_token_id=trainer.pad,
        )
        (old,) = trainer.rl.recompute_log_probs([trainer.ddp], [mb])
        trainer.close()
    return torch.cat(batch.rollout_log_probs), torch.cat(at_t), torch.cat(at_1), old.cpu()


@pytest.mark.parametrize("t", [0.5, 1.5])
def test_temperature_arm_records_rollout_T_while_the_trainer_uses_1(pool1, t):
    ((rollout, at_t, at_1, old),) = pool1.run(_temperature_run, t)
    torch.testing.assert_close(rollout, at_t, atol=1e-4, rtol=0)  # log_softmax(logits / T), fp32 rounding
    torch.testing.assert_close(old, at_1, atol=1e-5, rtol=0)  # the trainer's pi_old at T = 1
    assert float((at_t - at_1).abs().max()) > 0.05  # the dose is a real mismatch


# ------------------------------------------------------------------------------- top-p
def _top_p_run(logprobs: str, top_p: float, top_k: int):
    from megatron_mis.testbed.demo.rollout import RolloutConfig, RolloutEngine
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(steps=1, correction="none", **_SMALL)
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec("none", cfg))
        rc = RolloutConfig(precision="fp32", max_new_tokens=4, top_p=top_p, top_k=top_k, logprobs=logprobs)
        engine = RolloutEngine(trainer.engine.weights, rc)
        prompts = [p.prompt for p in trainer.task.sample(16, generator=torch.Generator().manual_seed(3))]
        batch = engine.generate(prompts, generator=torch.Generator().manual_seed(4))
        # independent reference: the full fp32 distribution at every response position, sorted by hand
        full = RolloutEngine(trainer.engine.weights, RolloutConfig(precision="fp32", max_new_tokens=4))
        seqs = batch.sequences
        expected = []
        for s, r in zip(seqs, batch.response_lengths.tolist()):
            t = s.numel()
            with torch.no_grad():
                logits = full._model.forward(
                    s[None], torch.arange(t)[None], full._model.new_cache(1, t), 0,
                    (torch.arange(t)[None, :] <= torch.arange(t)[:, None])[None, None],
                )[0]
            probs = torch.softmax(logits.float(), -1)[t - r - 1 : t - 1].double()
            for row, tok in zip(probs, s[t - r :].tolist()):
                order = torch.argsort(row, descending=True)
                keep = torch.zeros_like(row, dtype=torch.bool)
                mass = 0.0
                for rank, i in enumerate(order.tolist()):
                    if (top_k and rank >= top_k) or (rank > 0 and mass >= top_p):
                        break
                    keep[i] = True
                    mass += float(row[i])
                assert keep[tok], "a token outside the truncated support was sampled"
                kept = float(row[keep].sum())
                expected.append((math.log(float(row[tok])), math.log(float(row[tok]) / kept)))
        trainer.close()
    return torch.cat(batch.rollout_log_probs), torch.tensor(expected, dtype=torch.float64)


@pytest.mark.parametrize("top_p,top_k", [(0.7, 0), (1.0, 3), (0.9, 5)])
def test_top_p_records_raw_or_processed_log_probs(pool1, top_p, top_k):
    ((raw, exp_raw),) = pool1.run(_top_p_run, "raw", top_p, top_k)
    ((proc, exp_proc),) = pool1.run(_top_p_run, "processed", top_p, top_k)
    torch.testing.assert_close(raw.double(), exp_raw[:, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(proc.double(), exp_proc[:, 1], atol=1e-4, rtol=0)
    # the processed log-probs sit above the raw ones by -log(kept mass) >= 0; somewhere strictly
    assert float((exp_proc[:, 1] - exp_proc[:, 0]).max()) > 1e-3


# --------------------------------------------------------------------- top-p replay (trainer)
def _replay_step(trainer_truncation: bool):
    """One demo step with top-p 0.7 and processed rollout log-probs (fp32 rollouts), the
    trainer replaying the rollout's support or not: the step's record."""
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(steps=1, correction="none", top_p=0.7, rollout_logprobs="processed",
                     trainer_truncation=trainer_truncation, seed=5, **_SMALL)
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec("none", cfg))
        record = trainer.step(1)
        trainer.close()
    return record


def test_trainer_truncation_removes_the_support_mismatch(pool1):
    """Without the replay every sampled token has pi_train / pi_rollout = its kept mass < 1 (K3
    well above fp32 rounding); with it the trainer's pi_old is the rollout's truncated
    distribution and the mismatch falls to the two fp32 forwards' rounding."""
    ((off,),) = [pool1.run(_replay_step, False)]
    ((on,),) = [pool1.run(_replay_step, True)]
    assert off["mis_k3_kl"] > 1e-3 and off["logprob_abs_diff_max"] > 0.05
    assert on["mis_k3_kl"] < 1e-9 and on["logprob_abs_diff_max"] < 1e-4



def _one_step(correction: str, **fields):
    """One demo step (fp32 rollouts, the DemoConfig ``fields``, which may override the small batch's) under
    ``correction``: its record."""
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(steps=1, correction=correction, **{**_SMALL, **fields})
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec(correction, cfg))
        record = trainer.step(1)
        trainer.close()
    return record


def test_the_monitor_flags_a_correction_that_rejects_every_token(pool1):
    """Processed top-k log-probs make every ratio the token's kept mass, at the start below 0.5:
    token MIS ([0.5, 5]) masks every loss token (the study's long-tail top-k 64 runs trained
    nothing), and the testbed's monitor, fed the rejected-token fraction, flags it on the first
    step; without a weight nothing is rejected and no watched metric is missing."""
    top_k = dict(top_k=3, rollout_logprobs="processed", seed=5)
    ((mis,),) = [pool1.run(_one_step, "token_mis", **top_k)]
    ((none,),) = [pool1.run(_one_step, "none", **top_k)]
    assert mis["rejected_token_fraction"] == 1.0 and mis["grad_norm"] == 0.0 and mis["mis_ratio_max"] < 0.5
    assert [m for m in mis["monitor_warnings"] if m.startswith("mis_rejected_token_fraction=1 at step 1 exceeds its "
                                                              "bound 0.5: the correction removes most")]
    assert none["rejected_token_fraction"] == 0.0 and none["grad_norm"] > 0.0
    assert not [m for m in none["monitor_warnings"] if "rejected" in m or "no such metric" in m], none["monitor_warnings"]


def test_the_token_tis_diagnostics_weigh_the_step_as_they_say(pool1):
    """On the same first step (same weights, same rollout): the floor's weights are token TIS's
    raised to 1 (its smallest 1, its largest token TIS's), the cap's token TIS's cut at 1 (its
    smallest token TIS's, its largest 1), and the shuffled arm's are token TIS's weights (the same
    mean, smallest and largest: a permutation within each micro-batch) on other tokens, so its
    gradient differs."""
    tis, floor, cap, shuffled = (pool1.run(_one_step, c, temperature=1.5, trainer_temperature=1.0, seed=2)[0]
                                 for c in ("token_tis", "token_tis_floor1", "token_tis_cap1", "token_tis_shuffled"))
    assert tis["is_weight_min"] < 1 < tis["is_weight_max"]  # a two-sided weight to take apart
    assert floor["is_weight_min"] == pytest.approx(1.0)
    assert floor["is_weight_max"] == pytest.approx(tis["is_weight_max"])
    assert cap["is_weight_max"] == pytest.approx(1.0) and cap["is_weight_min"] == pytest.approx(tis["is_weight_min"])
    assert floor["is_weight_mean"] > tis["is_weight_mean"] > cap["is_weight_mean"]
    for key in ("is_weight_mean", "is_weight_min", "is_weight_max", "mis_k3_kl"):
        assert shuffled[key] == pytest.approx(tis[key], rel=1e-5), key
    assert shuffled["reward_mean"] == tis["reward_mean"]
    assert shuffled["logprob_abs_diff_max"] == tis["logprob_abs_diff_max"]  # the records see the true pairs
    assert abs(shuffled["grad_norm"] - tis["grad_norm"]) > 1e-3 * tis["grad_norm"]


def test_the_group_diagnostics_rewrite_token_tis_s_weights_per_group(pool1):
    """On the same first step: the group-mean arm's weights have token TIS's mean (every group has
    the same number of loss tokens) and a narrower range; the balanced arm only scales first-token
    weights down, so its largest weight is at most token TIS's and its mean below it. The placebo
    swaps the group means of each micro-batch's two groups: the group mean's weights (the same
    mean, smallest and largest) on the other group, so its gradient differs from the group mean's.
    All reach the gradient; the records (reward, log-prob comparison) see the true pairs."""
    tis, mean, permuted, balanced = (
        pool1.run(_one_step, c, temperature=1.5, trainer_temperature=1.0, seed=2)[0]
        for c in ("token_tis", "token_tis_group_mean", "token_tis_group_permuted", "token_tis_balanced"))
    assert mean["is_weight_mean"] == pytest.approx(tis["is_weight_mean"], rel=1e-6)
    assert tis["is_weight_min"] < mean["is_weight_min"] <= mean["is_weight_max"] < tis["is_weight_max"]
    for key in ("is_weight_mean", "is_weight_min", "is_weight_max"):
        assert permuted[key] == pytest.approx(mean[key], rel=1e-6), key
    assert abs(permuted["grad_norm"] - mean["grad_norm"]) > 1e-3 * mean["grad_norm"]
    assert balanced["is_weight_max"] <= tis["is_weight_max"] * (1 + 1e-6)
    assert balanced["is_weight_mean"] < tis["is_weight_mean"] * (1 - 1e-4)
    for arm in (mean, permuted, balanced):
        assert arm["reward_mean"] == tis["reward_mean"]
        assert arm["logprob_abs_diff_max"] == tis["logprob_abs_diff_max"]
        assert abs(arm["grad_norm"] - tis["grad_norm"]) > 1e-3 * tis["grad_norm"]


def test_the_placebo_s_noise_doses_raise_its_weights_to_a_power(pool1):
    """On the same first step each dose of the placebo (powers 1/2, 2, 3.5 and 6) draws the placebo's
    derangement (the same generator stream) and raises its weights to its power: the smallest and
    largest weight are the placebo's to that power (a power is monotone; the largest bounded at 2 by
    the engine), the weights spread around 1 by that factor in log space, and each gradient differs
    from the placebo's."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT, REWRITTEN_TIS

    doses = {c: p for c, p in REWRITE_EXPONENT.items() if REWRITTEN_TIS[c] == "group_mean_permuted"}
    assert sorted(doses.values()) == [0.5, 2.0, 3.5, 6.0]
    permuted, *dosed = (pool1.run(_one_step, c, temperature=1.5, trainer_temperature=1.0, seed=2)[0]
                        for c in ("token_tis_group_permuted", *doses))
    assert permuted["is_weight_min"] < 1 < permuted["is_weight_max"]
    for arm, p in zip(dosed, doses.values()):
        assert arm["is_weight_min"] == pytest.approx(permuted["is_weight_min"] ** p, rel=1e-5), p
        largest = min(permuted["is_weight_max"] ** p, 2.0)  # the engine's bound
        assert arm["is_weight_max"] == pytest.approx(largest, rel=1e-5), p
        assert arm["reward_mean"] == permuted["reward_mean"]
        assert abs(arm["grad_norm"] - permuted["grad_norm"]) > 1e-4 * permuted["grad_norm"], p


def test_the_shuffled_weights_doses_raise_them_to_a_power_per_token(pool1):
    """Each dose of the shuffled weights (powers 1/10, 1/4, 1/2 and 2) raises the shuffled arm's token
    weights to its power: on the same first step its smallest and largest weight are the shuffled
    arm's to that power (the double dose's largest bounded at 2 by the engine), and each gradient
    differs from the shuffled arm's. With GRPO groups split across micro-batches (8 prompts x 3
    samples, micro-batches of 8) they train as the shuffled arm does: a permutation needs no whole
    groups."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT, REWRITTEN_TIS

    doses = {c: p for c, p in REWRITE_EXPONENT.items() if REWRITTEN_TIS[c] == "shuffle"}
    assert sorted(doses.values()) == [0.1, 0.25, 0.5, 2.0]
    for fields in ({}, dict(prompts_per_step=8, samples_per_prompt=3, micro_batch_size=8)):
        shuffled, *dosed = (
            pool1.run(_one_step, c, temperature=1.5, trainer_temperature=1.0, seed=2, **fields)[0]
            for c in ("token_tis_shuffled", *doses))
        assert shuffled["is_weight_min"] < 1 < shuffled["is_weight_max"]
        for arm, p in zip(dosed, doses.values()):
            assert arm["is_weight_min"] == pytest.approx(shuffled["is_weight_min"] ** p, rel=1e-5), (fields, p)
            largest = min(shuffled["is_weight_max"] ** p, 2.0)  # the engine's bound
            assert arm["is_weight_max"] == pytest.approx(largest, rel=1e-5), (fields, p)
            assert arm["reward_mean"] == shuffled["reward_mean"]
            assert abs(arm["grad_norm"] - shuffled["grad_norm"]) > 1e-4 * shuffled["grad_norm"], (fields, p)


def _steps(correction: str, steps: int, **fields):
    """``steps`` demo steps (fp32 rollouts, the DemoConfig ``fields``) under ``correction``: their records."""
    from megatron_mis.testbed.demo.train import GRPOTrainer, arm_spec, megatron_state

    cfg = DemoConfig(steps=steps, correction=correction, **fields, **_SMALL)
    with torch.random.fork_rng(devices=[]), megatron_state(cfg):
        trainer = GRPOTrainer(cfg, arm_spec(correction, cfg))
        records = [trainer.step(k) for k in range(1, steps + 1)]
        trainer.close()
    return records


def test_the_null_diagnostic_trains_exactly_as_none(pool1):
    """The null arm trains through decoupled PPO and the MIS engine, as every diagnostic does, with
    each weight rewritten to exactly 1: its rollouts, losses and gradients equal none's bit for bit
    on every step (the second step's rollout samples from the first update's weights), so the
    diagnostics differ from none by their weights alone. Only the engine's mismatch metrics, of the
    rewritten pairs, differ (K3 0)."""
    fields = dict(temperature=1.5, trainer_temperature=1.0, seed=4)
    (none,), (unit,) = (pool1.run(_steps, c, 3, **fields) for c in ("none", "token_tis_unit"))
    for a, b in zip(none, unit):
        for key in ("reward_mean", "loss", "pg_loss", "entropy", "grad_norm", "response_length_mean",
                    "logprob_abs_diff_max", "is_weight_mean", "is_weight_min", "is_weight_max"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["mis_k3_kl"] == 0.0 < a["mis_k3_kl"]
    assert none[0]["grad_norm"] > 0 and none[1]["reward_mean"] != none[2]["reward_mean"]


def test_trainer_truncation_is_validated():
    from megatron_mis.config.base import ConfigError

    with pytest.raises(ConfigError, match="trainer_truncation needs top_p < 1 or top_k > 0"):
        DemoConfig(trainer_truncation=True)
    with pytest.raises(ConfigError, match="set rollout_logprobs: processed"):
        DemoConfig(trainer_truncation=True, top_p=0.9)
    with pytest.raises(ConfigError, match=r"replay_entropy='full' needs trainer_truncation"):
        DemoConfig(replay_entropy="full", top_k=16, rollout_logprobs="processed")
    with pytest.raises(ConfigError, match=r"replay_entropy='all' is not one of 'kept', 'full'"):
        DemoConfig(replay_entropy="all", trainer_truncation=True, top_k=16, rollout_logprobs="processed")
    assert DemoConfig(replay_entropy="full", trainer_truncation=True, top_k=16,
                      rollout_logprobs="processed").replay_entropy == "full"
