"""The RL loss in a real Megatron-Core training loop on CPU: a tiny GPT, gloo, Megatron's DDP and
``get_forward_backward_func()`` with several micro-batches and a few optimizer steps (SGD with
momentum: its update is linear in the gradients, so rounding stays rounding; Adam would turn
gradient entries at rounding level into full-size steps of random sign). TP=2 and DP=2
runs give the same losses and parameter updates as the single-process run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.testbed.models.gpt import GPTSpec
from megatron_mis.testing.distributed import ProcessGroupPool

SPEC = GPTSpec(vocab_size=48, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=64)
NUM_STEPS = 3
LR = 0.05


@pytest.fixture(scope="module")
def pool1():
    with ProcessGroupPool(1) as pool:
        yield pool


def make_micro_batches(num_micro_batches: int, seed: int = 0, with_rollout: bool = True):
    """Deterministic packed micro-batches: 2-3 sequences each, varied prompt / response lengths,
    some masked tokens, GRPO advantages over groups of two, old / rollout / ref log-probs near the
    untrained model's (about -log V)."""
    from megatron_mis.core.advantages import compute_advantages
    from megatron_mis.integrations.megatron_loss import RLMicroBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_micro_batches):
        num_seq = 2 + i % 2
        prompts = torch.randint(1, 5, (num_seq,), generator=g)
        responses = torch.randint(1, 8, (num_seq,), generator=g)
        if i == 1:
            responses[0] = 0  # an empty response
        totals = prompts + responses
        cu = torch.nn.functional.pad(torch.cumsum(totals, 0), (1, 0))
        tokens = torch.randint(0, SPEC.vocab_size, (int(totals.sum()),), generator=g)
        num_resp = int(responses.sum())
        rewards = torch.randint(0, 2, (num_seq,), generator=g).float() + 0.1 * i
        adv_seq = compute_advantages(rewards, group_ids=torch.arange(num_seq) // 2).advantages
        advantages = torch.repeat_interleave(adv_seq, responses)
        loss_mask = (torch.rand(num_resp, generator=g) < 0.85).float()
        base = -math.log(SPEC.vocab_size)
        old = base + 0.4 * torch.randn(num_resp, generator=g)
        out.append(
            RLMicroBatch(
                tokens=tokens,
                cu_seqlens=cu.int(),
                response_lengths=responses,
                loss_mask=loss_mask,
                advantages=advantages,
                old_log_probs=old,
                rollout_log_probs=(old + 0.3 * torch.randn(num_resp, generator=g)) if with_rollout else None,
                ref_log_probs=base + 0.4 * torch.randn(num_resp, generator=g),
            )
        )
    return out


def _full_params(model, attr=None):
    """Every parameter (or its ``attr``, e.g. ``main_grad``) gathered over the TP group to its
    full (TP=1) shape."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        t = (p if attr is None else getattr(p, attr)).detach().clone().float()  # on the device here
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.cpu()
    return out


def train(tp: int, micro_batches, loss_cfg: dict, mis_cfg: dict | None, return_num_tokens=True, per_token=False, cp=1,
          device="cpu", params_dtype=torch.float32):
    """Build the GPT, run NUM_STEPS optimizer steps with the RL loss; the micro-batches are split
    over the data-parallel ranks (consecutive blocks; every CP rank of a DP rank gets the same
    ones). Returns per-step metrics, the full parameters before / after, and the first step's
    recomputed log-probs (all on the CPU). ``device="cuda"``: the model on this rank's GPU (the
    micro-batches stay on the host, as a trainer's data loader gives them); ``params_dtype``
    ``torch.bfloat16``: bf16 parameters in Megatron's ``Float16Module`` (fp32 logits out), as
    Megatron trains in bf16."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mis.config.loss import LossConfig
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=tp, cp=cp, seed=21):
        model = build_gpt(SPEC, calculate_per_token_loss=per_token, params_dtype=params_dtype)
        if device != "cpu":
            model.to(device)
        wrapped = model
        if params_dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            wrapped = Float16Module(model.config, model)
        ddp = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
            wrapped,
        )
        model.config.finalize_model_grads_func = finalize_model_grads
        params = list(ddp.parameters())
        opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
        rl = MegatronRLLoss(
            LossConfig.from_dict(loss_cfg),
            MISConfig.from_dict(mis_cfg) if mis_cfg is not None else None,
            return_num_tokens=return_num_tokens,
        )
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per_rank = len(micro_batches) // dp
        mine = micro_batches[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        before = _full_params(model)
        recomputed = rl.recompute_log_probs([ddp], mine)
        history, first_grads = [], None
        for _ in range(NUM_STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            den = rl.count_denominators(mine)
            store = get_forward_backward_func()(
                forward_step_func=rl.forward_step(den, num_microbatches=len(mine)),
                data_iterator=iter(mine),
                model=[ddp],
                num_microbatches=len(mine),
                seq_length=0,
                micro_batch_size=1,
                forward_only=False,
            )
            history.append(rl.reduce_metrics(store, den))
            if first_grads is None:
                first_grads = _full_params(model, "main_grad")
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
            opt.step()
        return {
            "history": history, "before": before, "after": _full_params(model), "grads": first_grads,
            "recomputed": [r.cpu() for r in recomputed], "dp_rank": dp_rank, "dp": dp,
        }


LOSS_CASES = {
    # name: (LossConfig keys, MISConfig keys or None)
    "ppo_token_mean": (dict(policy_loss="ppo", loss_aggregation="token_mean"), None),
    "ppo_seq_mean_kl_entropy_opsm": (
        dict(
            policy_loss="ppo",
            loss_aggregation="seq_mean_token_mean",
            eps_clip_high=0.28,
            eps_clip_c=3.0,
            use_kl_loss=True,
            kl_loss_coef=0.05,
            use_unbiased_kl=True,
            entropy_coef=0.01,
            use_opsm=True,
            opsm_delta=0.0,
        ),
        None,
    ),
    "decoupled_token_tis_rs_rejected_out": (
        dict(policy_loss="decoupled_ppo", loss_aggregation="seq_mean_token_mean", rejected_in_denominator=False),
        dict(use_tis=True, tis_upper_bound=1.5, use_rs=True, rs_lower_bound=0.7, rs_upper_bound=1.4),
    ),
    "reinforce_geometric_mis_normalised": (
        dict(policy_loss="reinforce", loss_aggregation="token_mean"),
        dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_upper_bound=1.2, tis_batch_normalize=True),
    ),
    # GSPO: sequence ratios CP-exact (one all-reduce shared with OPSM), sequence-level TIS so the
    # IS weight is one per sequence like the ratio, dual clip and OPSM on
    "gspo_seq_mean_sequence_tis_opsm": (
        dict(
            policy_loss="gspo", loss_aggregation="seq_mean_token_mean", eps_clip=0.2, eps_clip_high=0.28,
            eps_clip_c=3.0, use_opsm=True, opsm_delta=0.0,
        ),
        dict(use_tis=True, tis_level="sequence", tis_upper_bound=2.0),
    ),
    # CISPO without a lower bound (MiniMax-M1), token TIS and an entropy bonus
    "cispo_token_mean_token_tis": (
        dict(policy_loss="cispo", loss_aggregation="token_mean", eps_clip=1.0, eps_clip_high=0.28, entropy_coef=0.01),
        dict(use_tis=True, tis_upper_bound=1.5),
    ),
    "bypass_seq_sum_geometric_rs_veto": (
        dict(policy_loss="bypass_ppo", loss_aggregation="seq_mean_token_sum", rollout_temperature=0.9),
        dict(use_rs=True, rs_level="geometric", rs_upper_bound=1.15, rs_lower_bound=0.87, rs_veto_threshold=0.5),
    ),
}


EXTRA_KEYS = (
    "num_rejected_tokens", "num_opsm_tokens", "num_opsm_sequences", "num_denominator_sequences", "mis_k3_kl",
    "mis_k3_kl_max", "mis_ratio", "mis_ratio_min", "mis_ratio_max", "is_weight_min", "is_weight_max",
    "mis_log_ppl_abs_diff", "num_seq_ratio_sequences", "num_seq_clipped_low", "num_seq_clipped_high",
    "pg_seq_clipfrac",
)


def _compare(run, ref, what, extra=False):
    """Same full weights and data, reductions split differently over ranks (TP: matmuls and the
    vocabulary softmax; DP: gradient all-reduce): float32 rounding only, ~1e-6 relative (measured
    worst 1.4e-6 for losses, 6e-7 for gradients, 5e-6 for three SGD-with-momentum updates, each
    relative to the largest entry of the parameter). Tolerances 1e-5 / 1e-5 / 1e-4: a wrong loss
    scale, denominator or reduction is a factor, not a rounding error."""
    for step, (a, b) in enumerate(zip(run["history"], ref["history"])):
        for key in ("loss", "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "num_valid_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"{what}: step {step} {key}"
        if extra:
            assert set(a) == set(b), f"{what}: metric names differ: {sorted(set(a) ^ set(b))}"
            for key in EXTRA_KEYS:
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"{what}: step {step} {key}"
    for name, p in ref["before"].items():
        torch.testing.assert_close(run["before"][name], p, rtol=0, atol=0)
        g_ref = ref["grads"][name]
        torch.testing.assert_close(
            run["grads"][name], g_ref, rtol=0, atol=1e-5 * float(g_ref.abs().max()) + 1e-12,
            msg=lambda m: f"{what}: first-step gradient of {name}: {m}",
        )
        upd_ref = ref["after"][name] - p
        upd_run = run["after"][name] - run["before"][name]
        assert float(upd_ref.abs().max()) > 0, f"{name} did not move"
        # an update is the difference of two float32 parameters: it carries their rounding, one
        # ulp of the parameter's magnitude (a norm weight near 1 moved by 1e-4 has a 6e-8 grain)
        ulp = torch.finfo(torch.float32).eps * float(ref["after"][name].abs().max())
        torch.testing.assert_close(
            upd_run, upd_ref, rtol=0, atol=1e-4 * float(upd_ref.abs().max()) + ulp,
            msg=lambda m: f"{what}: update of {name} after {NUM_STEPS} steps: {m}",
        )


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_tp2_and_dp2_match_single_process(pool1, pool2, case):
    cfg, mis = LOSS_CASES[case]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    assert all(math.isfinite(h["loss"]) for h in ref["history"])
    # the parameters really moved and the loss changed between steps
    assert ref["history"][0]["loss"] != ref["history"][-1]["loss"]
    if mis is not None and (mis.get("use_rs") or mis.get("tis_mode") == "mask"):
        first = ref["history"][0]
        # the engine really rejected something, and its metrics came through
        assert first["num_rejected_tokens"] > 0 and "mis_rejected_token_fraction" in first
    tp2 = pool2.run(train, 2, batches, cfg, mis)
    dp2 = pool2.run(train, 1, batches, cfg, mis)
    for r, run in enumerate(tp2):
        _compare(run, ref, f"TP=2 rank {r}")
    for r, run in enumerate(dp2):
        _compare(run, ref, f"DP=2 rank {r}")


def _check_recomputed(run, ref, batches, what):
    """pi_old recomputed under the run's layout: every DP rank's micro-batches, full length, equal
    to the single-process recompute to fp32 rounding (CP alone: the same bits, see
    docs/demo_internals.md; with TP the matmuls split differently)."""
    per_rank = len(batches) // run["dp"]
    mine = ref["recomputed"][run["dp_rank"] * per_rank : (run["dp_rank"] + 1) * per_rank]
    assert len(run["recomputed"]) == len(mine)
    for a, b in zip(run["recomputed"], mine):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=lambda m: f"{what}: recomputed log-probs: {m}")


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_cp2_matches_single_process(pool1, pool2, case):
    """Context parallelism: every sequence split zigzag over 2 ranks (lengths 2..11, none a
    multiple of 4, one empty response); losses, metrics, gradients and updates equal the
    single-process run."""
    cfg, mis = LOSS_CASES[case]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    for r, run in enumerate(pool2.run(train, 1, batches, cfg, mis, cp=2)):
        _compare(run, ref, f"CP=2 rank {r}", extra=True)
        _check_recomputed(run, ref, batches, f"CP=2 rank {r}")
    if cfg.get("use_opsm"):
        assert ref["history"][0]["num_opsm_sequences"] > 0  # OPSM really dropped sequences


def test_gspo_cp4_matches_single_process(pool1, pool4):
    """GSPO's sequence ratio with every sequence split over 4 CP ranks (lengths 2..11: many ranks
    hold no response token of a sequence and still join the statistics all-reduce): losses, the
    sequence-level clip counts, gradients and updates equal the single-process run."""
    cfg, mis = LOSS_CASES["gspo_seq_mean_sequence_tis_opsm"]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    first = ref["history"][0]
    # the sequence clip acts on some sequences and not on all; OPSM drops some
    assert 0 < first["num_seq_clipped_low"] + first["num_seq_clipped_high"] < first["num_seq_ratio_sequences"]
    assert first["num_opsm_sequences"] > 0
    for r, run in enumerate(pool4.run(train, 1, batches, cfg, mis, cp=4)):
        _compare(run, ref, f"GSPO CP=4 rank {r}", extra=True)


def test_tp2_cp2_and_dp2_cp2_match_single_process(pool1, pool4):
    """Token-level RS under CP needs the extra rejection-bit all-reduce; rejected tokens leave
    the denominators, so the engine also runs (over the CP group) while counting them."""
    cfg, mis = LOSS_CASES["decoupled_token_tis_rs_rejected_out"]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    for r, run in enumerate(pool4.run(train, 2, batches, cfg, mis, cp=2)):
        _compare(run, ref, f"TP=2 x CP=2 rank {r}", extra=True)
        _check_recomputed(run, ref, batches, f"TP=2 x CP=2 rank {r}")
    for r, run in enumerate(pool4.run(train, 1, batches, cfg, mis, cp=2)):
        _compare(run, ref, f"DP=2 x CP=2 rank {r}", extra=True)
        _check_recomputed(run, ref, batches, f"DP=2 x CP=2 rank {r}")


def test_cp2_legacy_two_tuple_and_per_token_mode(pool1, pool2):
    """The 2-tuple path multiplies by the CP size in the schedule: the loss divides it out."""
    cfg, mis = LOSS_CASES["reinforce_geometric_mis_normalised"]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    for r, run in enumerate(pool2.run(train, 1, batches, cfg, mis, False, cp=2)):
        _compare(run, ref, f"2-tuple CP=2 rank {r}")
    for r, run in enumerate(pool2.run(train, 1, batches, cfg, mis, True, True, cp=2)):
        _compare(run, ref, f"calculate_per_token_loss CP=2 rank {r}")


def test_legacy_two_tuple_and_per_token_mode_give_the_same_step(pool1, pool2):
    cfg, mis = LOSS_CASES["decoupled_token_tis_rs_rejected_out"]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    legacy = pool2.run(train, 1, batches, cfg, mis, False)
    per_token = pool2.run(train, 1, batches, cfg, mis, True, True)
    for r in range(2):
        _compare(legacy[r], ref, f"2-tuple DP=2 rank {r}")
        _compare(per_token[r], ref, f"calculate_per_token_loss DP=2 rank {r}")


def test_loss_value_equals_direct_computation(pool1):
    """The metric 'loss' of the first step equals compute_rl_loss on the whole batch at once."""
    cfg, _ = LOSS_CASES["ppo_seq_mean_kl_entropy_opsm"]
    batches = make_micro_batches(4)
    got = pool1.run(_first_step_loss_direct, batches, cfg)[0]
    assert got["schedule"] == pytest.approx(got["direct"], rel=1e-6)


def _first_step_loss_direct(batches, loss_cfg):
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.losses import compute_rl_loss
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss, response_positions
    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs
    from megatron_mis.testing.distributed import megatron_parallel

    schedule = train(1, batches, loss_cfg, None)["history"][0]["loss"]
    with megatron_parallel(tp=1, seed=21):
        model = build_gpt(SPEC)
        cfg = LossConfig.from_dict(loss_cfg)
        rl = MegatronRLLoss(cfg)
        den = rl.count_denominators(batches)
        cat = {k: [] for k in ("lp", "ent", "adv", "mask", "old", "ref", "cu")}
        offset = 0
        with torch.no_grad():
            for mb in batches:
                cu = mb.cu_seqlens.long()
                pos = torch.cat([torch.arange(int(n)) for n in cu[1:] - cu[:-1]])
                # run each sequence alone (no packing) as an independent check of the thd path
                logits = torch.cat(
                    [model(mb.tokens[a:b][None], pos[a:b][None], None)[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
                )
                rows, targets = response_positions(mb.cu_seqlens, mb.response_lengths)
                lp, ent = vocab_parallel_log_probs(
                    logits[rows], mb.tokens[targets], temperature=cfg.rollout_temperature, with_entropy=True
                )
                cat["lp"].append(lp)
                cat["ent"].append(ent)
                cat["adv"].append(mb.advantages)
                cat["mask"].append(mb.loss_mask)
                cat["old"].append(mb.old_log_probs)
                cat["ref"].append(mb.ref_log_probs)
                cat["cu"].append(mb.response_cu_seqlens[1:] + offset)
                offset += int(mb.response_lengths.sum())
        cu_all = torch.cat([torch.zeros(1, dtype=torch.long)] + cat["cu"])
        out = compute_rl_loss(
            torch.cat(cat["lp"]),
            torch.cat(cat["adv"]),
            torch.cat(cat["mask"]),
            cu_all,
            cfg,
            den,
            old_log_probs=torch.cat(cat["old"]),
            ref_log_probs=torch.cat(cat["ref"]),
            entropy=torch.cat(cat["ent"]),
        )
        return {"schedule": schedule, "direct": float(out.loss)}


# ------------------------------------------------- decoupled PPO + MIS at T != 1, independently
DIRECT_T = 0.7
DIRECT_LOSS = dict(policy_loss="decoupled_ppo", loss_aggregation="seq_mean_token_mean", rollout_temperature=DIRECT_T)
DIRECT_MIS = dict(use_tis=True, tis_upper_bound=1.5, use_rs=True, rs_lower_bound=0.6, rs_upper_bound=1.6)


def _sequence_logits(model, mb):
    """``[R, V]`` logits of ``mb``'s response positions, every sequence run alone (no packing:
    an independent check of the thd path)."""
    from megatron_mis.integrations.megatron_loss import response_positions

    cu = mb.cu_seqlens.long()
    pos = torch.cat([torch.arange(int(n)) for n in cu[1:] - cu[:-1]])
    logits = torch.cat(
        [model(mb.tokens[a:b][None], pos[a:b][None], None)[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    )
    rows, targets = response_positions(mb.cu_seqlens, mb.response_lengths)
    return logits[rows], mb.tokens[targets]


def _log_probs_at(logits, targets, temperature):
    """log softmax(logits / T) at the targets, by torch directly (not the package's function)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _decoupled_mis_step_and_direct(batches, loss_cfg, mis_cfg):
    """One forward-backward of MegatronRLLoss in Megatron's schedule (no DDP: gradients in
    ``p.grad``) against the same loss assembled from the parts: log pi_theta by torch's
    log_softmax(logits / T) of each sequence run alone, ``compute_mis`` on the whole batch,
    ``compute_rl_loss`` with its IS weights and keep mask; loss values and gradients of both.

    pi_old is the model's own log-probs at T (detached) plus a small offset, so the PPO ratio
    pi_theta / pi_old is near 1 and most tokens carry a gradient; pi_rollout is pi_old plus noise
    of 0.3, so the IS weights pi_old / pi_rollout vary widely (and some are truncated at 1.5 and
    some tokens rejected by RS)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mis.config.loss import LossConfig
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.core.aggregation import Denominators
    from megatron_mis.core.engine import compute_mis
    from megatron_mis.core.losses import compute_rl_loss
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    cfg, mis = LossConfig.from_dict(loss_cfg), MISConfig.from_dict(mis_cfg)
    g = torch.Generator().manual_seed(4)
    with megatron_parallel(tp=1, seed=21):
        model = build_gpt(SPEC)
        with torch.no_grad():
            # spread the untrained model's near-uniform logits (std ~0.1) so the temperature matters
            model.output_layer.weight.mul_(20.0)
            lp_t = [_log_probs_at(*_sequence_logits(model, mb), cfg.rollout_temperature) for mb in batches]
        staged = []
        for mb, lp in zip(batches, lp_t):
            old = lp + 0.05 * torch.randn(lp.shape, generator=g)
            rollout = old + 0.3 * torch.randn(lp.shape, generator=g)
            staged.append(dataclasses.replace(mb, old_log_probs=old, rollout_log_probs=rollout))
        batches = staged

        rl = MegatronRLLoss(cfg, mis)
        den = rl.count_denominators(batches)
        model.zero_grad()
        store = get_forward_backward_func()(
            forward_step_func=rl.forward_step(den, num_microbatches=len(batches)),
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=0,
            micro_batch_size=1,
            forward_only=False,
        )
        metrics = rl.reduce_metrics(store, den)
        grads_schedule = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

        model.zero_grad()
        cat = {k: [] for k in ("lp", "adv", "mask", "old", "rollout", "cu")}
        offset = 0
        for mb in batches:
            cat["lp"].append(_log_probs_at(*_sequence_logits(model, mb), cfg.rollout_temperature))
            for key, value in (("adv", mb.advantages), ("mask", mb.loss_mask), ("old", mb.old_log_probs),
                               ("rollout", mb.rollout_log_probs)):
                cat[key].append(value)
            cat["cu"].append(mb.response_cu_seqlens[1:] + offset)
            offset += int(mb.response_lengths.sum())
        full = {k: torch.cat(v) for k, v in cat.items() if k != "cu"}
        cu = torch.cat([torch.zeros(1, dtype=torch.long)] + cat["cu"])
        res = compute_mis(full["old"], full["rollout"], full["mask"], cu, mis)
        # the step's denominators by hand: loss tokens (kept ones only when rejected tokens leave them)
        in_den = full["mask"].bool() & (True if cfg.rejected_in_denominator else res.keep_mask)
        per_seq = torch.stack([in_den[a:b].sum() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        den_direct = Denominators(float(in_den.sum()), float((per_seq > 0).sum()))
        out = compute_rl_loss(
            full["lp"], full["adv"], full["mask"], cu, cfg, den_direct,
            old_log_probs=full["old"], rollout_log_probs=full["rollout"],
            is_weights=res.weights, keep_mask=res.keep_mask,
        )
        out.loss.backward()
        grads_direct = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        kept = res.keep_mask & full["mask"].bool()
        return {
            "schedule": metrics["loss"], "direct": float(out.loss.detach()),
            "den": (den.num_tokens, den.num_sequences), "den_direct": (den_direct.num_tokens, den_direct.num_sequences),
            "metrics": metrics,
            # the reduced metrics by hand: loss-token means of the engine's token metrics, extremes
            # of the raw ratio pi_old / pi_rollout over loss tokens and of the applied weights over
            # the tokens in the loss
            "metrics_direct": {
                "mis_k3_kl": float(res.summary["mis_k3_kl"]), "mis_tv": float(res.summary["mis_tv"]),
                "mis_ratio_min": float((full["old"] - full["rollout"])[full["mask"].bool()].exp().min()),
                "mis_ratio_max": float((full["old"] - full["rollout"])[full["mask"].bool()].exp().max()),
                "is_weight_min": float(res.weights[kept].min()), "is_weight_max": float(res.weights[kept].max()),
            },
            "grads_schedule": grads_schedule, "grads_direct": grads_direct,
            "weights_kept": res.weights[kept], "num_rejected": int((full["mask"].bool() & ~res.keep_mask).sum()),
            "num_loss_tokens": int(full["mask"].sum()),
        }


@pytest.mark.parametrize("rejected_in_denominator", [True, False])
def test_decoupled_ppo_with_mis_at_temperature_equals_the_parts(pool1, rejected_in_denominator):
    """Issue 33: MegatronRLLoss with all-ones IS weights, or ignoring rollout_temperature, passed
    every test that compared it with itself under another layout. Here the expectation is built
    from the parts (torch's log_softmax at T, compute_mis, compute_rl_loss, the denominators
    counted by hand): loss and every gradient entry agree to float32 rounding of the packed vs
    one-sequence-at-a-time forward."""
    loss_cfg = {**DIRECT_LOSS, "rejected_in_denominator": rejected_in_denominator}
    got = pool1.run(_decoupled_mis_step_and_direct, make_micro_batches(4), loss_cfg, DIRECT_MIS)[0]
    assert got["den"] == got["den_direct"]
    w = got["weights_kept"]
    # the IS weights really vary (all-ones weights would change the loss), truncation and RS act
    assert float(w.min()) < 0.8 and float(w.max()) == pytest.approx(1.5) and 0 < got["num_rejected"] < got["num_loss_tokens"]
    assert got["schedule"] == pytest.approx(got["direct"], rel=1e-5, abs=1e-7)
    for key, value in got["metrics_direct"].items():
        # per-micro-batch sums / extremes reduced over the step: float32 values, float64 sums
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5), key
    for name, g_ref in got["grads_direct"].items():
        assert float(g_ref.abs().max()) > 0, f"{name} has no gradient"
        # packed thd forward vs one sequence at a time: float32 rounding (~1e-6 of the largest entry)
        torch.testing.assert_close(
            got["grads_schedule"][name], g_ref, rtol=0, atol=1e-5 * float(g_ref.abs().max()) + 1e-12,
            msg=lambda m: f"gradient of {name}: {m}",
        )


# ------------------------------------------------------------------------------ errors
def _construct(loss_cfg, mis_cfg):
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=1):
        try:
            MegatronRLLoss(LossConfig.from_dict(loss_cfg), MISConfig.from_dict(mis_cfg) if mis_cfg is not None else None)
        except ConfigError as exc:
            return str(exc)
    return None


def test_config_conflicts(pool1):
    msg = pool1.run(_construct, {"policy_loss": "decoupled_ppo"}, None)[0]
    assert "multiplies by IS weights: give a MISConfig" in msg
    msg = pool1.run(_construct, {"policy_loss": "bypass_ppo"}, {"use_tis": True})[0]
    assert "count it twice" in msg
    assert pool1.run(_construct, {"policy_loss": "bypass_ppo"}, {"use_rs": True})[0] is None


def _construct_warnings(loss_cfg, mis_cfg):
    import warnings

    from megatron_mis.config.loss import LossConfig
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MegatronRLLoss(LossConfig.from_dict(loss_cfg), MISConfig.from_dict(mis_cfg))
    return [str(w.message) for w in caught if "mixing a sequence-level ratio" in str(w.message)]


def test_gspo_with_token_level_is_weights_warns(pool1):
    gspo = {"policy_loss": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4}
    msgs = pool1.run(_construct_warnings, gspo, {"use_tis": True, "tis_level": "token"})[0]
    assert len(msgs) == 1 and "tis_level 'sequence' or 'geometric'" in msgs[0]
    assert pool1.run(_construct_warnings, gspo, {"use_tis": True, "tis_level": "geometric"})[0] == []
    assert pool1.run(_construct_warnings, {**gspo, "policy_loss": "cispo"}, {"use_tis": True})[0] == []


def test_micro_batch_validation():
    from megatron_mis.integrations.megatron_loss import RLMicroBatch, response_positions

    good = make_micro_batches(1)[0]
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), expected \[\d+\]"):
        RLMicroBatch(good.tokens, good.cu_seqlens, good.response_lengths, good.loss_mask, torch.zeros(3))
    with pytest.raises(ValueError, match="at least one prompt token"):
        response_positions(torch.tensor([0, 3]), torch.tensor([3]))
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        RLMicroBatch(good.tokens, torch.tensor([0, 2]), torch.tensor([1]), torch.ones(1), torch.zeros(1))
    rows, targets = response_positions(torch.tensor([0, 4, 7]), torch.tensor([2, 1]))
    assert targets.tolist() == [2, 3, 6] and rows.tolist() == [1, 2, 5]


def _mismatched_denominators(batches):
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.aggregation import Denominators
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with megatron_parallel(tp=1):
        model = build_gpt(SPEC)
        rl = MegatronRLLoss(LossConfig(policy_loss="ppo"))
        den = rl.count_denominators(batches)
        wrong = Denominators(den.num_tokens + 1, den.num_sequences)
        store = get_forward_backward_func()(
            forward_step_func=rl.forward_step(wrong, num_microbatches=len(batches)),
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=0,
            micro_batch_size=1,
            forward_only=True,
        )
        try:
            rl.reduce_metrics(store, wrong)
        except ValueError as exc:
            return str(exc)
    return None


def test_denominators_not_from_this_data_are_reported(pool1):
    msg = pool1.run(_mismatched_denominators, make_micro_batches(2))[0]
    assert "were not computed from this step's micro-batches" in msg


# --------------------------------------------------------------------------- pipeline parallel
def train_pp2_one_step(micro_batches, loss_cfg: dict, mis_cfg: dict | None):
    """One forward-backward with PP=2 (the 1F1B schedule, p2p over gloo) from the same full weights
    as the single-process model; returns per-stage metrics and gradients under global names."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mis.config.loss import LossConfig
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=1, seed=21):
        full = {n: p.detach().clone() for n, p in build_gpt(SPEC).named_parameters()}
    with megatron_parallel(tp=1, pp=2, seed=21):
        # packed micro-batches differ in length: the p2p exchange must send shapes first
        model = build_gpt(SPEC, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        offset = ps.get_pipeline_model_parallel_rank() * (SPEC.num_layers // 2)

        def global_name(name: str) -> str:
            if name.startswith("decoder.layers."):
                i, rest = name[len("decoder.layers.") :].split(".", 1)
                return f"decoder.layers.{int(i) + offset}.{rest}"
            return name

        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(full[global_name(name)])
        rl = MegatronRLLoss(LossConfig.from_dict(loss_cfg), MISConfig.from_dict(mis_cfg) if mis_cfg else None)
        den = rl.count_denominators(micro_batches)
        store = get_forward_backward_func()(
            forward_step_func=rl.forward_step(den, num_microbatches=len(micro_batches)),
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(int(mb.tokens.numel()) for mb in micro_batches),
            micro_batch_size=1,
            forward_only=False,
        )
        return {
            "last_stage": ps.is_pipeline_last_stage(),
            "store_size": len(store),
            "metrics": rl.reduce_metrics(store, den),
            "grads": {global_name(n): p.grad.detach().clone() for n, p in model.named_parameters()},
        }


def test_pp2_loss_only_on_last_stage_and_equal_to_single_process(pool1, pool2):
    cfg, mis = LOSS_CASES["decoupled_token_tis_rs_rejected_out"]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    first, last = pool2.run(train_pp2_one_step, batches, cfg, mis)
    assert not first["last_stage"] and last["last_stage"]
    # the schedule calls loss_func on the last stage only; metrics exist only there
    assert first["store_size"] == 0 and first["metrics"] == {}
    assert last["store_size"] == len(batches)
    for key in ("loss", "pg_loss", "pg_clipfrac", "num_valid_tokens", "num_rejected_tokens"):
        assert last["metrics"][key] == pytest.approx(ref["history"][0][key], rel=1e-5, abs=1e-6)
    grads = {**first["grads"], **last["grads"]}
    assert set(grads) == set(ref["grads"])
    for name, g_ref in ref["grads"].items():
        # same weights, same arithmetic split over two processes: float32 rounding only
        torch.testing.assert_close(grads[name], g_ref, rtol=0, atol=1e-5 * float(g_ref.abs().max()) + 1e-12)


# --------------------------------------------------------- top-p / top-k replay (rollout support)
def _with_supports(batches, seed=7):
    """Each response token gets a rollout support: 1-6 random ids plus the sampled one (70% of
    tokens), or none (the whole vocabulary)."""
    import dataclasses

    from megatron_mis.integrations.megatron_loss import response_positions
    from megatron_mis.parallel.tp_logprobs import TokenSupport

    g = torch.Generator().manual_seed(seed)
    out = []
    for mb in batches:
        _, target_pos = response_positions(mb.cu_seqlens, mb.response_lengths)
        supports = []
        for tok in mb.tokens[target_pos].tolist():
            if float(torch.rand((), generator=g)) < 0.7:
                k = int(torch.randint(1, 7, (), generator=g))
                supports.append(sorted(set(torch.randperm(SPEC.vocab_size, generator=g)[:k].tolist()) | {tok}))
            else:
                supports.append([])
        out.append(dataclasses.replace(mb, rollout_support=TokenSupport.from_lists(supports)))
    return out


def test_rollout_support_is_replayed_under_tp_cp_and_dp(pool1, pool2):
    """The trainer's log-probs over the rollout's support: pi_old recomputed with the support is
    log p renormalised over a subset (>= the untruncated log-prob, equal where a token has no
    support, larger where it has one), and TP=2, CP=2 and DP=2 equal one process (loss, metrics,
    gradients, updates, recomputed pi_old)."""
    cfg, mis = dict(policy_loss="decoupled_ppo", loss_aggregation="token_mean"), dict(use_tis=True, tis_upper_bound=2.0)
    plain = make_micro_batches(4)
    batches = _with_supports(plain)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    base = pool1.run(train, 1, plain, cfg, mis)[0]
    for mb, with_s, without in zip(batches, ref["recomputed"], base["recomputed"]):
        has = (mb.rollout_support.offsets[1:] > mb.rollout_support.offsets[:-1])
        assert torch.equal(with_s[~has], without[~has])
        assert bool((with_s[has] > without[has] + 1e-4).all())  # 2-7 of 48 ids kept: a large renormalisation
    assert ref["history"][0]["loss"] != base["history"][0]["loss"]
    for r, run in enumerate(pool2.run(train, 2, batches, cfg, mis)):
        _compare(run, ref, f"support TP=2 rank {r}")
    for r, run in enumerate(pool2.run(train, 1, batches, cfg, mis, cp=2)):
        _compare(run, ref, f"support CP=2 rank {r}", extra=True)
        _check_recomputed(run, ref, batches, f"support CP=2 rank {r}")
    for r, run in enumerate(pool2.run(train, 1, batches, cfg, mis)):
        _compare(run, ref, f"support DP=2 rank {r}")


def test_the_replayed_entropy_is_the_whole_softmax_s_as_slime_s_or_the_kept_ids_(pool1, pool2):
    """With a rollout support the log-probs are the renormalised distribution's, and the entropy (bonus and metric) is
    by default the whole softmax's, as slime's top-p replay computes it: its keep-mask reaches the log-probs only
    (slime/backends/megatron_utils/loss.py:531-532, and :556 where the mask is built, at 624b824a); replay_entropy
    kept gives the renormalised distribution's. At the first step (same weights) the default's entropy is the run
    without a support's and its policy loss the kept run's; the kept ids' entropy is lower; the entropy's gradient
    differs; and TP=2 and CP=2 equal one process under both."""
    cfg = dict(policy_loss="decoupled_ppo", loss_aggregation="token_mean", entropy_coef=0.05)
    mis = dict(use_tis=True, tis_upper_bound=2.0)
    plain = make_micro_batches(4)
    batches = _with_supports(plain)
    full = pool1.run(train, 1, batches, cfg, mis)[0]
    kept = pool1.run(train, 1, batches, {**cfg, "replay_entropy": "kept"}, mis)[0]
    base = pool1.run(train, 1, plain, cfg, mis)[0]
    first = {name: run["history"][0] for name, run in (("full", full), ("kept", kept), ("base", base))}
    assert first["full"]["entropy_loss"] == pytest.approx(first["base"]["entropy_loss"], rel=1e-6)
    assert first["kept"]["entropy_loss"] < first["full"]["entropy_loss"] - 0.5  # 2-7 of 48 ids kept on 70% of tokens
    assert first["full"]["pg_loss"] == pytest.approx(first["kept"]["pg_loss"], rel=1e-6)
    assert first["full"]["pg_loss"] != pytest.approx(first["base"]["pg_loss"], rel=1e-4)  # the replayed log-probs
    assert any(not torch.allclose(full["grads"][n], kept["grads"][n], rtol=1e-3, atol=0) for n in full["grads"])
    for name, ref, extra_cfg in (("full", full, {}), ("kept", kept, {"replay_entropy": "kept"})):
        for r, run in enumerate(pool2.run(train, 2, batches, {**cfg, **extra_cfg}, mis)):
            _compare(run, ref, f"{name} entropy TP=2 rank {r}")
        for r, run in enumerate(pool2.run(train, 1, batches, {**cfg, **extra_cfg}, mis, cp=2)):
            _compare(run, ref, f"{name} entropy CP=2 rank {r}", extra=True)


def test_rollout_support_is_validated():
    from megatron_mis.parallel.tp_logprobs import TokenSupport

    mb = make_micro_batches(1)[0]
    import dataclasses

    with pytest.raises(ValueError, match="rollout_support covers 1 tokens, expected"):
        dataclasses.replace(mb, rollout_support=TokenSupport.from_lists([[1]]))
    with pytest.raises(ValueError, match="rollout_support must be a TokenSupport"):
        dataclasses.replace(mb, rollout_support=[[1]])


# ------------------------------------------------------------------ on a GPU (skipped without)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL; the GPT on the GPU)")


@pytest.fixture(scope="module")
def pool_nccl():
    with ProcessGroupPool(1, cpu_compat=False, backend="nccl") as pool:
        yield pool


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", ["decoupled_token_tis_rs_rejected_out", "gspo_seq_mean_sequence_tis_opsm",
                                  "bypass_seq_sum_geometric_rs_veto", "ppo_seq_mean_kl_entropy_opsm"])
def test_on_the_gpu_over_nccl_equals_the_cpu_run(pool1, pool_nccl, case):
    """The same steps with the GPT on the GPU, Megatron's DDP over NCCL and the micro-batches on
    the host: the losses, metrics, gradients and updates of the CPU run over gloo, to float32
    rounding (the tolerances of :func:`_compare`: a GPU's kernels round differently, as TP's
    split reductions do; a wrong device path is a factor or a NaN)."""
    cfg, mis = LOSS_CASES[case]
    batches = make_micro_batches(4)
    ref = pool1.run(train, 1, batches, cfg, mis)[0]
    run = pool_nccl.run(train, 1, batches, cfg, mis, device="cuda")[0]
    _compare(run, ref, f"CUDA over NCCL ({case})", extra=True)
    for a, b in zip(run["recomputed"], ref["recomputed"]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=lambda m: f"recomputed log-probs on the GPU: {m}")


def _check_bf16_against_fp32(pool, device):
    """bf16 parameters in Megatron's Float16Module (Megatron's bf16 training) on ``device``:
    every loss, gradient and update finite, the recomputed log-probs within 0.01 nats of the fp32
    model's (bf16 keeps 8 significant bits, a rounding of 2^-9 relative per operation; measured
    1.4e-3 on the CPU on 2026-11-27), and the parameters moved."""
    cfg, mis = LOSS_CASES["decoupled_token_tis_rs_rejected_out"]
    batches = make_micro_batches(4)
    fp32 = pool.run(train, 1, batches, cfg, mis, device=device)[0]
    bf16 = pool.run(train, 1, batches, cfg, mis, device=device, params_dtype=torch.bfloat16)[0]
    assert all(math.isfinite(h["loss"]) for h in bf16["history"]), bf16["history"]
    assert all(g.isfinite().all() for g in bf16["grads"].values())
    assert all(p.isfinite().all() for p in bf16["after"].values())
    assert any(not torch.equal(bf16["after"][n], p) for n, p in bf16["before"].items())
    gap = max(float((a - b).abs().max()) for a, b in zip(bf16["recomputed"], fp32["recomputed"]))
    assert 0 < gap <= 0.01, f"bf16 vs fp32 recomputed log-probs differ by {gap:.3g} nats"


def test_bf16_training_is_finite_and_near_fp32(pool1):
    _check_bf16_against_fp32(pool1, "cpu")


@pytest.mark.cuda
@needs_cuda
def test_bf16_training_on_the_gpu_is_finite_and_near_fp32(pool_nccl):
    _check_bf16_against_fp32(pool_nccl, "cuda")
