"""The pure-math entry points on fake ``cuda:0`` tensors: no host synchronisation per call, no
CPU tensor returned, and the same values as the plain CPU run (the shadows are real tensors).

The MIS engine is run at the seed-000 default and across every IS level, mode, RS level, veto,
non-finite policy and metric setting; ``compute_rl_loss`` across every policy loss, aggregation
mode, KL / entropy term and OPSM, forward and (walked by hand) backward."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.config.loss import LossConfig
from megatron_mis.core.aggregation import Denominators, local_denominators
from megatron_mis.core.engine import compute_mis, compute_mis_from_lists
from megatron_mis.core.losses import compute_rl_loss
from megatron_mis.testing.fake_cuda import backward, shadow


def _batch(n=6, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = n * length
    train = torch.randn(t, generator=g) * 0.3 - 1.5
    rollout = train + torch.randn(t, generator=g) * 0.2
    mask = torch.rand(t, generator=g) > 0.15
    lengths = [length] * n
    return train, rollout, mask, torch.tensor([0] + list(itertools.accumulate(lengths)))


ENGINE_CONFIGS = [
    {},
    dict(mis_metrics="none"),
    dict(use_tis=True, tis_level="token", tis_mode="clip"), dict(use_tis=True, tis_level="token", tis_mode="mask"),
    dict(use_tis=True, tis_level="sequence", tis_mode="truncate"), dict(use_tis=True, tis_level="geometric", tis_mode="mask"),
    dict(use_rs=True, rs_level="token"), dict(use_rs=True, rs_level="geometric"),
    dict(rs_veto_threshold=1e-3), dict(prob_veto_threshold=1e-6),
    dict(nonfinite_policy="reject"), dict(use_tis=True, tis_batch_normalize=True),
]


@pytest.mark.parametrize("overrides", ENGINE_CONFIGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_compute_mis_has_no_host_synchronisation(probe, overrides):
    try:
        cfg = MISConfig(**overrides)
    except Exception as exc:  # a combination the config refuses is not an engine path
        pytest.skip(f"config refused: {exc}")
    train, rollout, mask, cu = _batch()
    with probe.paused():
        ref = compute_mis(train, rollout, mask, cu, cfg)
    for offsets in (probe.cuda(cu), cu.tolist()):  # device offsets, and host offsets (a list)
        probe.clear()
        out = compute_mis(*probe.cuda((train, rollout, mask)), offsets, cfg)
        probe.check_outputs([out.weights, out.keep_mask, out.seq_weights, out.token_metrics, out.summary])
        probe.assert_clean(what=f"compute_mis({overrides})")
        probe.assert_matches(out.weights, ref.weights)
        for name, value in ref.summary.items():
            probe.assert_matches(out.summary[name], value, equal_nan=True)


def test_compute_mis_from_lists_has_no_host_synchronisation(probe):
    train, rollout, mask, cu = _batch()
    parts = [list(torch.split(x, torch.diff(cu).tolist())) for x in (train, rollout, mask)]
    out = compute_mis_from_lists(*[probe.cuda(p) for p in parts], MISConfig())
    probe.check_outputs([out.weights, out.keep_mask, out.summary])
    probe.assert_clean(what="compute_mis_from_lists")


LOSS_CONFIGS = [
    dict(policy_loss="ppo"), dict(policy_loss="decoupled_ppo"), dict(policy_loss="bypass_ppo"),
    dict(policy_loss="reinforce"),
    dict(policy_loss="decoupled_ppo", loss_aggregation="seq_mean_token_mean"),
    dict(policy_loss="decoupled_ppo", loss_aggregation="seq_mean_token_sum"),
    dict(policy_loss="ppo", use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
    dict(policy_loss="ppo", use_opsm=True, opsm_delta=0.01),
    dict(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
    dict(policy_loss="gspo", eps_clip=0.05, eps_clip_c=3.0, loss_aggregation="seq_mean_token_mean", use_opsm=True, opsm_delta=0.01),
    dict(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.28),
]


@pytest.mark.parametrize("overrides", LOSS_CONFIGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_compute_rl_loss_forward_and_backward_have_no_host_synchronisation(probe, overrides):
    cfg = LossConfig(**overrides)
    train, rollout, mask, cu = _batch(seed=1)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(train.shape, generator=g)
    entropy = torch.rand(train.shape, generator=g)
    ref_lp = train + 0.1
    uses_w = cfg.policy_loss in ("decoupled_ppo", "reinforce", "gspo", "cispo")
    kwargs = dict(old_log_probs=train, rollout_log_probs=rollout, ref_log_probs=ref_lp, entropy=entropy,
                  is_weights=torch.rand(train.shape, generator=g) + 0.5 if uses_w else None,
                  keep_mask=mask | (torch.arange(train.numel()) % 5 == 0))
    dens = Denominators(float(mask.sum()), 6.0)
    lp_cpu = (train + 0.05).requires_grad_()
    with probe.paused():
        ref = compute_rl_loss(lp_cpu, adv, mask, cu, cfg, dens, **kwargs)
        ref.loss.backward()
    lp = probe.cuda((train + 0.05).requires_grad_())
    out = compute_rl_loss(lp, *probe.cuda((adv, mask, cu)), cfg, dens, **probe.cuda(kwargs))
    probe.check_outputs([out.loss, out.shares, out.token_sums, out.counts, out.pg_mask, out.valid_mask])
    backward(out.loss)
    probe.assert_clean(what=f"compute_rl_loss({overrides}) forward + backward")
    torch.testing.assert_close(shadow(out.loss.detach()), ref.loss.detach())
    torch.testing.assert_close(shadow(lp.grad), lp_cpu.grad)
    for name, value in ref.counts.items():
        torch.testing.assert_close(shadow(out.counts[name]), value, msg=name)


def test_gspo_with_cp_sum_has_no_host_synchronisation(probe):
    """GSPO and OPSM under context parallelism: the per-sequence statistics go through cp_sum
    (here the sum with a second "rank"'s statistics, on the device) once, with no read."""
    from megatron_mis.core.losses import sequence_ratio_stats

    cfg = LossConfig(policy_loss="gspo", eps_clip=0.05, use_opsm=True, opsm_delta=0.0)
    train, _, mask, cu = _batch(seed=3)
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(train.shape, generator=g)
    w = torch.rand(train.shape, generator=g) + 0.5
    old = train - 0.05
    other = torch.cat([sequence_ratio_stats(train + 0.1, old, adv, mask, cu), torch.ones(cu.numel() - 1, 2, dtype=torch.float64)], 1)
    dens = Denominators(float(mask.sum()), 6.0)
    lp_cpu = (train + 0.02).requires_grad_()
    with probe.paused():
        ref = compute_rl_loss(lp_cpu, adv, mask, cu, cfg, dens, old_log_probs=old, is_weights=w, cp_sum=lambda t: t + other)
        ref.loss.backward()
    other_dev = probe.cuda(other)
    calls = []

    def cp_sum(t):
        calls.append(t.device.type)
        return t + other_dev

    lp = probe.cuda((train + 0.02).requires_grad_())
    out = compute_rl_loss(lp, *probe.cuda((adv, mask, cu)), cfg, dens, old_log_probs=probe.cuda(old), is_weights=probe.cuda(w), cp_sum=cp_sum)
    probe.check_outputs([out.loss, out.shares, out.token_sums, out.counts, out.pg_mask, out.valid_mask])
    backward(out.loss)
    probe.assert_clean(what="compute_rl_loss(gspo + opsm, cp_sum) forward + backward")
    assert calls == ["cuda"]
    torch.testing.assert_close(shadow(out.loss.detach()), ref.loss.detach())
    torch.testing.assert_close(shadow(lp.grad), lp_cpu.grad)
    for name, value in ref.counts.items():
        torch.testing.assert_close(shadow(out.counts[name]), value, msg=name)


def test_local_denominators_reads_once(probe):
    """A per-step function: at most the one documented read."""
    _, _, mask, cu = _batch()
    dens = local_denominators(*probe.cuda((mask, cu)))
    probe.assert_clean(allowed=1, what="local_denominators")
    assert dens == local_denominators(mask, cu)


def test_per_step_functions_read_at_most_once(probe):
    """compute_advantages (device rewards: one copy over, results back non-blocking),
    log_probs_from_shards (one read for the range check), pack_sequences(device="cuda") (no
    read: the model's tensors go over pinned and non-blocking)."""
    from megatron_mis.core.advantages import compute_advantages
    from megatron_mis.parallel.packing import pack_sequences
    from megatron_mis.parallel.tp_logprobs import log_probs_from_shards

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, float("nan"), 2.0])
    with probe.paused():
        ref = compute_advantages(rewards, group_size=2)
    with pytest.warns(RuntimeWarning, match="non-finite reward"):
        out = compute_advantages(probe.cuda(rewards), group_size=2)
    probe.check_outputs([out.advantages, out.valid])
    probe.assert_clean(allowed=1, what="compute_advantages")
    probe.assert_matches(out.advantages, ref.advantages)
    assert out.advantages.device.type == "cuda" and out.num_nonfinite_rewards == 1

    probe.clear()
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)]
    targets = torch.tensor([0, 7, 3, 4, 6])
    with probe.paused():
        ref_lp = log_probs_from_shards(shards, targets)
    lp = log_probs_from_shards(probe.cuda(shards), probe.cuda(targets))
    probe.check_outputs([lp])
    probe.assert_clean(allowed=1, what="log_probs_from_shards")
    probe.assert_matches(lp, ref_lp)

    probe.clear()
    pack = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], device="cuda")
    probe.check_outputs([pack.tokens, pack.position_ids, pack.labels, pack.label_mask])
    probe.assert_clean(what="pack_sequences(device='cuda')")
    assert pack.tokens.device.type == "cuda" and pack.packed_seq_params.cu_seqlens_q.device.type == "cuda"


def test_debug_flag_turns_value_checks_on_for_device_tensors(probe, monkeypatch):
    """MEGATRON_MIS_DEBUG_CHECKS=1: the checks that read values run on device tensors too (and
    so synchronise); an unknown value of the flag is refused."""
    from megatron_mis.core.checks import DEBUG_ENV, reads_values

    x = probe.cuda(torch.ones(2))
    assert reads_values(torch.ones(2), None) and not reads_values(x, torch.ones(2))
    train, _, mask, cu = _batch()
    cfg = LossConfig(policy_loss="ppo")
    dens = Denominators(float(mask.sum()), 6.0)
    adv = torch.full(train.shape, 3e38)  # finite per token; their sum overflows float32
    # the overflow check: silent (no read) on the device by default ...
    compute_rl_loss(probe.cuda(train.clone()), *probe.cuda((adv, mask, cu)), cfg, dens, old_log_probs=probe.cuda(train.clone()))
    probe.assert_clean(what="compute_rl_loss without the debug flag")
    # ... and raised, after a read, with the flag
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert reads_values(x)
    with pytest.raises(ValueError, match="overflows"):
        compute_rl_loss(probe.cuda(train.clone()), *probe.cuda((adv, mask, cu)), cfg, dens, old_log_probs=probe.cuda(train.clone()))
    assert probe.count() >= 1
    monkeypatch.setenv(DEBUG_ENV, "yes")
    with pytest.raises(ValueError, match="MEGATRON_MIS_DEBUG_CHECKS='yes'"):
        reads_values(x)
