"""Host conformance under a sequence-level PPO ratio: the drop-in called as slime 624b824a calls
it with ``--advantage-estimator gspo`` (docs/hosts.md, "GSPO"; Miles 31f1ca96 is the same,
loss_hub/losses.py:141-179 and 248-261).

What slime does there (slime/backends/megatron_utils/loss.py at 624b824a):

- :992-1009 ``need_full_log_probs``: pi_theta and pi_old of every sequence are all-gathered over
  the CP ranks;
- :1021-1027 with slime/utils/ppo_utils.py:95-121: ONE ratio per sequence,
  s = exp(mean over its loss-mask tokens of log pi_theta - log pi_old), expanded to this rank's
  tokens; ppo_utils.py:125-148: ``pg_loss = max(-s A, -clip(s, 1 - eps, 1 + eps_high) A)``;
- :987-989, :1064-1078: the TIS function gets this rank's CP PIECES of pi_old (not the gathered
  ones), the full-length masks, ``args`` (with ``advantage_estimator == "gspo"``);
- :1086-1105 with cp_utils.py:47-: the returned ``pg_loss`` is reduced per sample, each rank
  summing its local chunk of the returned mask, divided by precomputed denominators
  (``rollout_mask_sums``, from the original masks), then summed over the CP ranks.

The sequences below are hand-chosen so that every expected loss is a closed form (the
docstrings derive them); CP = 2 runs on real Megatron-Core parallel state (gloo) and must equal
CP = 1 and the closed form.
"""

from __future__ import annotations

import math
import warnings
from argparse import Namespace

import pytest
import torch

# three sequences: (prompt, response, loss mask, log pi_old - log pi_rollout, log pi_theta - log pi_old, advantage)
# sequence 1 has a mask hole whose (huge) log-ratios must be ignored; sequence 2 has a prompt longer
# than a CP chunk, so one CP rank holds none of its response.
SEQUENCES = [
    (4, 4, [1, 1, 1, 1], [0.3, 0.1, -0.2, 0.2], [0.02] * 4, 1.0),
    (3, 6, [1, 1, 0, 1, 1, 1], [0.5, -0.1, 9.0, 0.0, 0.1, 1.0], [-0.05, -0.05, 3.0, -0.05, -0.05, -0.05], -0.5),
    (10, 2, [1, 1], [0.2, 0.0], [0.1, 0.1], 2.0),
]
EPS_CLIP, EPS_CLIP_HIGH = 0.2, 0.28
#: slime's rollout_mask_sums for groups of one sample: the original mask sums.
DENOMINATORS = [4.0, 5.0, 2.0]

GEOMETRIC_TIS = dict(use_tis=True, tis_level="geometric", tis_mode="truncate", tis_upper_bound=2.0)
GEOMETRIC_TIS_RS = dict(GEOMETRIC_TIS, use_rs=True, rs_level="geometric", rs_lower_bound=0.8, rs_upper_bound=1.25)
TOKEN_TIS = dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0)  # configs/presets/token_tis.yaml
TOKEN_RS = dict(GEOMETRIC_TIS, use_rs=True, rs_level="token", rs_lower_bound=0.5, rs_upper_bound=2.0)


def _full():
    """Per sequence: (total length, response length, mask, log pi_rollout, log pi_old, log pi_theta, A)."""
    out = []
    for prompt, resp, mask, old_minus_rollout, theta_minus_old, adv in SEQUENCES:
        rollout = torch.linspace(-2.0, -0.5, resp)
        old = rollout + torch.tensor(old_minus_rollout)
        theta = old + torch.tensor(theta_minus_old)
        out.append((prompt + resp, resp, torch.tensor(mask), rollout, old, theta, adv))
    return out


def _slime_gspo_step(keys: dict, estimator: str = "gspo"):
    """One micro-batch of slime's ``policy_loss_function`` with ``--advantage-estimator gspo``
    on this CP rank (Megatron-Core parallel state when initialised, else CP = 1), down to the
    reduced ``pg_loss``. Returns (loss summed over CP ranks, returned masks, warning messages)."""
    import torch.distributed as dist

    import megatron_mis
    from megatron_mis.parallel.layout import local_response_layout

    cp_size, cp_rank, cp_group = 1, 0, None
    try:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            cp_size, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
            cp_group = mpu.get_context_parallel_group()
    except ImportError:
        pass
    seqs = _full()
    totals = [s[0] for s in seqs]
    resps = [s[1] for s in seqs]
    masks = [s[2] for s in seqs]
    lay = local_response_layout(totals, resps, cp_size, cp_rank)

    def local(full: torch.Tensor, i: int) -> torch.Tensor:
        pieces = [full[a:b] for a, b in lay.ranges[i].tolist()]
        return torch.cat(pieces) if pieces else full[:0]

    rollout_local = [local(s[3], i) for i, s in enumerate(seqs)]
    old_local = [local(s[4], i) for i, s in enumerate(seqs)]  # batch["log_probs"]: this rank's pieces
    theta_local = [local(s[5], i) for i, s in enumerate(seqs)]
    # loss.py:996-1009 all_gather_with_cp gives back the full sequences; ppo_utils.py:114-118
    kl = [((s[4] - s[5]) * s[2]).sum() / torch.clamp_min(s[2].sum(), 1) for s in seqs]
    ppo_kl = torch.cat([k.expand_as(t) for k, t in zip(kl, theta_local)])
    advantages = torch.cat([torch.full_like(t, s[6]) for t, s in zip(theta_local, seqs)])
    ratio = (-ppo_kl).exp()  # ppo_utils.py:132-136
    pg_loss = torch.maximum(-ratio * advantages, -ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP_HIGH) * advantages)
    args = Namespace(custom_config_path=None, qkv_format="thd", use_rollout_logprobs=False,
                     calculate_per_token_loss=False, advantage_estimator=estimator, **keys)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two micro-batches: the warning comes once per args
            new_pg, new_masks, metrics = megatron_mis.compute_mis_weights_with_cp(
                args, pg_loss=pg_loss, train_log_probs=old_local, rollout_log_probs=rollout_local,
                loss_masks=masks, total_lengths=totals, response_lengths=resps,
            )
    assert all(v.shape == new_pg.shape for v in metrics.values())
    # loss.py:1086-1105 / cp_utils.py: local chunk of the returned mask, precomputed denominators
    loss = torch.zeros((), dtype=torch.float64)
    offset = 0
    for i in range(len(seqs)):
        n = int(lay.local_lengths[i])
        loss = loss + (new_pg[offset:offset + n].double() * local(new_masks[i], i).double()).sum() / DENOMINATORS[i]
        offset += n
    if cp_group is not None:
        dist.all_reduce(loss, group=cp_group)
    return float(loss), [m.tolist() for m in new_masks], [str(w.message) for w in caught]


def gspo_step_cp2(keys: dict, estimator: str = "gspo"):
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(cp=2):
        return _slime_gspo_step(keys, estimator)


def _pg():
    """Per sequence, the GSPO loss on each of its tokens: -s A (every s is inside the clip band)."""
    pg = []
    for _, _, mask, _, theta_minus_old, adv in SEQUENCES:
        mean = sum(d for d, m in zip(theta_minus_old, mask) if m) / sum(mask)
        s = math.exp(mean)
        assert 1 - EPS_CLIP < s < 1 + EPS_CLIP_HIGH
        pg.append(-s * adv)
    return pg


def _geometric():
    """Per sequence, exp(mean log pi_old / pi_rollout over its loss-mask tokens)."""
    return [math.exp(sum(d for d, m in zip(r, mask) if m) / sum(mask)) for _, _, mask, r, _, _ in SEQUENCES]


@pytest.fixture(scope="module")
def cp2(pool2):
    """The four configurations at CP = 2 (one pool run each, real Megatron parallel state)."""
    return {name: pool2.run(gspo_step_cp2, keys) for name, keys in
            (("geometric", GEOMETRIC_TIS), ("geometric_rs", GEOMETRIC_TIS_RS), ("token", TOKEN_TIS),
             ("token_rs", TOKEN_RS))}


def _expect_equal(ranks, single, expected):
    for loss, masks, _ in ranks:
        assert loss == pytest.approx(single[0], rel=1e-6, abs=1e-7)
        assert masks == single[1]
    assert single[0] == pytest.approx(expected, rel=1e-6)  # float32 inputs: 1e-6 relative


def test_geometric_weights_scale_each_sequence_of_the_gspo_loss(cp2):
    """slime loss.py:1021-1027 + 1064-1105 (GSPO, CP = 2 as in slime's run-glm4.7-355B-A32B.sh).
    tis_level: geometric gives one weight per sequence: w_i = exp(mean log r_t) over its mask
    tokens (0.1, 0.3, 0.1 here, none above 2), on its tokens of BOTH CP ranks, so the per-sample
    mean is w_i * pg_i:
    L = e^0.1 (-e^0.02) + e^0.3 (0.5 e^-0.05) + e^0.1 (-2 e^0.1) = -e^0.12 + 0.5 e^0.25 - 2 e^0.2.
    No warning: nothing is token-level."""
    expected = -math.exp(0.12) + 0.5 * math.exp(0.25) - 2 * math.exp(0.2)
    assert sum(w * p for w, p in zip(_geometric(), _pg())) == pytest.approx(expected, rel=1e-12)  # the derivation
    single = _slime_gspo_step(GEOMETRIC_TIS)
    _expect_equal(cp2["geometric"], single, expected)
    for _, _, caught in cp2["geometric"] + [single]:
        assert not [m for m in caught if "one per sequence" in m], caught


def test_geometric_rejection_drops_whole_sequences_on_every_cp_rank(cp2):
    """The same with geometric RS in [0.8, 1.25]: sequence 1 (e^0.3 = 1.35) is rejected as a whole
    on both CP ranks (its full-length mask all 0 everywhere, slime loss.py:1086-1092 reduces
    with it): L = -e^0.12 - 2 e^0.2."""
    expected = -math.exp(0.12) - 2 * math.exp(0.2)
    single = _slime_gspo_step(GEOMETRIC_TIS_RS)
    _expect_equal(cp2["geometric_rs"], single, expected)
    assert single[1] == [[1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1]]


def test_token_weights_under_gspo_warn_once_and_scale_by_their_mean(cp2):
    """configs/presets/token_tis.yaml under GSPO (what slime's built-in vanilla_tis_function, loss.py:884-905,
    does there too): applied as written, so each sequence is scaled by the MEAN of its token
    weights min(r_t, 2) over its mask tokens (the masked e^9 never counts; e^1.0 is truncated to 2):
    L = -e^0.02 (e^0.3 + e^0.1 + e^-0.2 + e^0.2) / 4 + 0.5 e^-0.05 (e^0.5 + e^-0.1 + 1 + e^0.1 + 2) / 5
        - 2 e^0.1 (e^0.2 + 1) / 2.
    The first call warns (once per args, on each rank), naming the sequence-level settings and presets."""
    e = math.exp
    expected = (-e(0.02) * (e(0.3) + e(0.1) + e(-0.2) + e(0.2)) / 4
                + 0.5 * e(-0.05) * (e(0.5) + e(-0.1) + 1 + e(0.1) + 2) / 5
                - 2 * e(0.1) * (e(0.2) + 1) / 2)
    single = _slime_gspo_step(TOKEN_TIS)
    _expect_equal(cp2["token"], single, expected)
    for _, _, caught in cp2["token"] + [single]:
        hits = [m for m in caught if "one per sequence" in m]
        assert len(hits) == 1, caught
        assert "advantage_estimator='gspo'" in hits[0] and "mean of its token weights" in hits[0]
        assert "tis_level: geometric" in hits[0] and "geometric_tis, geometric_rs, sequence_tis, sequence_mis" in hits[0]


def test_token_rejection_under_gspo_warns_that_the_token_stays_in_the_ratio(cp2):
    """rs_level: token under GSPO: sequence 1's last token (r = e^1.0 > 2) leaves the mask on the
    rank that holds it and in the full-length mask of every rank; its log-prob still enters the
    host's sequence ratio (loss.py:1021-1027), which the warning says. Loss: sequence 1 keeps 4
    of its 5 mask tokens: L = -e^0.12 + (4/5) 0.5 e^0.25 - 2 e^0.2."""
    expected = -math.exp(0.12) + 0.8 * 0.5 * math.exp(0.25) - 2 * math.exp(0.2)
    single = _slime_gspo_step(TOKEN_RS)
    _expect_equal(cp2["token_rs"], single, expected)
    assert single[1][1] == [1, 1, 0, 1, 1, 0]
    for _, _, caught in cp2["token_rs"] + [single]:
        hits = [m for m in caught if "one per sequence" in m]
        assert len(hits) == 1 and "rs_level='token'" in hits[0] and "still enters the sequence ratio" in hits[0]
        assert "tis_level='token'" not in hits[0]  # the IS weights are geometric here


def test_the_same_config_under_grpo_does_not_warn():
    """The warning is about the ratio, not the config: under --advantage-estimator grpo (slime's
    default, arguments.py:940-951) the token ratio and token weights have the same granularity."""
    _, _, caught = _slime_gspo_step(TOKEN_TIS, estimator="grpo")
    assert not [m for m in caught if "one per sequence" in m]
