"""Host conformance on 2 gloo ranks: the drop-in under context parallelism, called exactly as
slime 624b824a and Miles 31f1ca96 call it, and the per-rollout hooks in the order the hosts run
them across a rollout with several optimizer steps. Each test names the host file:line it models
(full commit hashes in docs/hosts.md).

The expectations do not come from the package's own layout code: the per-rank pieces, the
reassembly and the hosts' loss reducer are written out below from the hosts' arithmetic (their
``get_logits_and_tokens_offset_with_cp`` / ``get_sum_of_sample_mean``), and the reference is the
drop-in called once at CP = 1 with whole sequences, in this (single) process. One 2-rank pool
(``pool2``, tests/conftest.py) serves the whole module.
"""

from __future__ import annotations

import importlib
import math
import warnings
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

# ------------------------------------------------------------------ the hosts, written out
DROP_IN = "megatron_mis.integrations.{host}.compute_mis_weights_with_cp"


def _load_function(path: str):
    """slime/utils/misc.py:39-47 (Miles misc.py:45-60 the same, plus a registry): the dotted path
    is imported on every call."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _host_args(**keys) -> Namespace:
    """``args`` as the hosts leave it: their defaults for the flags the call path reads, then the
    YAML keys set on it (slime arguments.py:2013-2019, Miles arguments.py:3475-3480)."""
    base = dict(custom_config_path=None, qkv_format="thd", allgather_cp=False, use_rollout_logprobs=False,
                calculate_per_token_loss=False, tis_clip=2.0, tis_clip_low=0.0, get_mismatch_metrics=False,
                use_tis=False)
    base.update(keys)
    return Namespace(**base)


def host_response_index(total: int, resp: int, cp_size: int, cp_rank: int, chunk: int) -> list[int]:
    """Response positions (0 .. resp-1) of this CP rank's local log-prob piece, in local order.

    slime cp_utils.py:9-44 / Miles cp_utils.py:19-67: rank r holds the token chunks r and
    2c-1-r (``chunk`` = ceil(total / 2c) for thd, ceil(max_seq_len / 2c) for bshd); the log-prob
    of token t sits at logit t-1, and the response logits are prompt-1 .. total-2. The slicers
    (slime cp_utils.py:212-236, Miles cp_utils.py:411-437) take those logits, chunk 0 first."""
    prompt = total - resp
    out: list[int] = []
    for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo, hi = max(k * chunk, prompt - 1), min((k + 1) * chunk, total - 1)
        out += [p - (prompt - 1) for p in range(lo, hi)]
    return out


def host_reduce(x: torch.Tensor, pieces: list[list[int]], masks: list[torch.Tensor], denoms: list[float]) -> float:
    """The hosts' ``sum_of_sample_mean`` at CP > 1 (slime cp_utils.py:91-112, Miles
    cp_utils.py:136-156): per sample, the local chunk of the FULL mask times the local values,
    divided by that sample's denominator; this rank's share of the sum."""
    total, offset = 0.0, 0
    for idx, m, d in zip(pieces, masks, denoms):
        n = len(idx)
        local_mask = m.double()[idx] if n else m.double()[:0]
        total += float((x[offset:offset + n].double() * local_mask).sum()) / max(d, 1.0)
        offset += n
    assert offset == x.numel()
    return total


@dataclass
class GroupInfo:
    """Miles' GroupInfo (miles/utils/ft_utils/process_group_utils.py:20-27): rank, size, group."""

    rank: int
    size: int
    group: Any
    gloo_group: Any = None


@dataclass
class MilesParallelState:
    """The fields of Miles' ParallelState (miles/backends/training_utils/parallel.py:33-64) that a
    TIS function receives as ``parallel_state`` (losses.py:92, 257)."""

    intra_dp: GroupInfo
    intra_dp_cp: GroupInfo
    cp: GroupInfo
    tp: GroupInfo
    pp: GroupInfo
    ep: GroupInfo
    etp: GroupInfo
    indep_dp: GroupInfo
    meshes: dict = field(default_factory=dict)
    cp_comm_type: Any = None
    is_pp_last_stage: bool = True

    @property
    def effective_dp(self) -> GroupInfo:
        # parallel.py:52-58: intra DP unless independent DP is in use
        return self.intra_dp if (self.indep_dp.size == 1) else self.indep_dp


def miles_parallel_state(*, cp: GroupInfo | None = None, dp: GroupInfo | None = None) -> MilesParallelState:
    one = GroupInfo(0, 1, None)
    cp, dp = cp or one, dp or one
    return MilesParallelState(intra_dp=dp, intra_dp_cp=one, cp=cp, tp=one, pp=one, ep=one, etp=one, indep_dp=one)


# ------------------------------------------------------------------------------- the batch
#  sample: total, response.  s1's two response logits (positions 6, 7) both lie in CP rank 1's
#  chunks under thd (chunk 3): rank 0 holds none of it and must still join every collective.
TOTALS = [11, 9, 6, 13]
RESPS = [7, 2, 5, 8]
MAX_SEQ_LEN = 16  # Miles data.py:77-90: the rollout's longest sequence padded (here to a multiple of 8)


def make_batch():
    g = torch.Generator().manual_seed(2024)
    train, rollout, masks = [], [], []
    for r in RESPS:
        t = -torch.rand(r, generator=g) * 2.0 - 0.1
        train.append(t)
        rollout.append(t + torch.randn(r, generator=g) * 0.15)
        masks.append(torch.ones(r, dtype=torch.int32))
    masks[0][2] = 0  # multi-turn holes
    masks[3][5:7] = 0
    rollout[3][1] = train[3][1] + 4.0  # ratio e^-4 < 0.05: the veto rejects sample 3 (with use_rs)
    pg = [torch.linspace(-1.0, 1.0, r) + 0.1 * i for i, r in enumerate(RESPS)]
    return train, rollout, masks, pg


CONFIGS = {
    # token TIS, geometric RS and its veto, micro-batch self-normalisation over the loss mask
    "token_tis_geometric_rs_veto_bn": dict(
        use_tis=True, tis_upper_bound=1.5, use_rs=True, rs_level="geometric", rs_lower_bound=0.85,
        rs_upper_bound=1.2, rs_veto_threshold=0.05, tis_batch_normalize=True),
    # sequence clip, token RS
    "sequence_clip_token_rs": dict(
        use_tis=True, tis_level="sequence", tis_mode="clip", tis_lower_bound=0.5, tis_upper_bound=1.8,
        use_rs=True, rs_level="token", rs_lower_bound=0.8, rs_upper_bound=1.25),
    # --get-mismatch-metrics without --use-tis
    "metrics_only": dict(get_mismatch_metrics=True),
}


def _chunk(layout: str, total: int, cp: int) -> int:
    return -(-(MAX_SEQ_LEN if layout == "bshd" else total) // (2 * cp))


def _host_call(host: str, args: Namespace, cp_size: int, cp_rank: int, parallel_state: Any, layout: str):
    """One micro-batch, the kwargs built as the host builds them (slime loss.py:1064-1078,
    Miles losses.py:249-261), this rank's pieces cut as the host cuts them."""
    train, rollout, masks, pg = make_batch()
    pieces = [host_response_index(t, r, cp_size, cp_rank, _chunk(layout, t, cp_size)) for t, r in zip(TOTALS, RESPS)]

    def local(xs):
        return [x[idx] for x, idx in zip(xs, pieces)]

    kwargs = dict(args=args, pg_loss=torch.cat(local(pg)), train_log_probs=local(train),
                  rollout_log_probs=local(rollout), loss_masks=masks, total_lengths=TOTALS, response_lengths=RESPS)
    if host == "miles":
        kwargs.update(parallel_state=parallel_state,
                      max_seq_lens=[MAX_SEQ_LEN] * len(RESPS) if layout == "bshd" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, new_masks, metrics = _load_function(DROP_IN.format(host=host))(**kwargs)
    orig = [float(m.sum()) for m in masks]  # rollout_mask_sums: slime loss.py:1090
    mod = [float(m.sum()) for m in new_masks]  # Miles without rollout_mask_sums: losses.py:272 -> cp_utils.py:111-112
    return dict(
        rank=cp_rank, pieces=pieces, loss=loss.detach(), masks=[m.clone() for m in new_masks],
        metrics={k: v.detach() for k, v in metrics.items()},
        # the loss reducer rebuilt from the returned masks (slime loss.py:1086-1092, Miles losses.py:265-273)
        loss_mask_sums=host_reduce(loss.detach(), pieces, new_masks, orig),
        loss_modified_sums=host_reduce(loss.detach(), pieces, new_masks, mod),
        # metrics with the ORIGINAL reducer (slime loss.py:1059, 1156-1163; Miles losses.py:239, 379-386)
        reduced_metrics={k: host_reduce(v.detach(), pieces, masks, orig) for k, v in metrics.items()},
    )


def slime_cp2_call(cfg_name: str, allgather_cp: bool):
    """slime: no parallel_state argument; the drop-in reads Megatron's CP group (thd, zigzag)."""
    from megatron.core import parallel_state as mpu

    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(cp=2):
        args = _host_args(allgather_cp=allgather_cp, **CONFIGS[cfg_name])
        return _host_call("slime", args, 2, mpu.get_context_parallel_rank(), None, "thd")


def miles_cp2_call(cfg_name: str, layout: str, allgather_cp: bool):
    """Miles: its ParallelState object as ``parallel_state``; bshd with ``max_seq_lens``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ps = miles_parallel_state(cp=GroupInfo(rank, 2, dist.group.WORLD))
    args = _host_args(qkv_format=layout, allgather_cp=allgather_cp, **CONFIGS[cfg_name])
    return _host_call("miles", args, 2, rank, ps, layout)


def _reference(host: str, cfg_name: str, layout: str):
    """The same call at CP = 1 (whole sequences), in this process."""
    args = _host_args(qkv_format=layout, **CONFIGS[cfg_name])
    ps = miles_parallel_state() if host == "miles" else None
    return _host_call(host, args, 1, 0, ps, layout)


def _assert_cp_equals_cp1(results: list[dict], ref: dict, cfg_name: str):
    changed = [not torch.equal(m.int(), o) for m, o in zip(ref["masks"], make_batch()[2])]
    assert any(changed) == (cfg_name != "metrics_only")  # the configs reject something; metrics-only nothing
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert len(results[0]["pieces"][1]) == 0  # rank 0 holds none of s1's response (thd chunk 3, bshd chunk 4)
    n = sum(RESPS)
    offsets = torch.tensor([0] + RESPS).cumsum(0).tolist()
    full_loss = torch.full((n,), float("nan"))
    full_metrics = {k: torch.full((n,), float("nan")) for k in ref["metrics"]}
    for r in results:
        assert set(r["metrics"]) == set(ref["metrics"])
        # the FULL-length masks are right on every rank (Miles' denominators read all of them)
        assert [m.tolist() for m in r["masks"]] == [m.tolist() for m in ref["masks"]], r["rank"]
        where = torch.tensor([offsets[i] + j for i, idx in enumerate(r["pieces"]) for j in idx], dtype=torch.long)
        full_loss[where] = r["loss"]
        for k, v in r["metrics"].items():
            full_metrics[k][where] = v
    # fp32 per-sequence partial sums on two ranks vs one pass: rounding only
    torch.testing.assert_close(full_loss, ref["loss"], rtol=1e-6, atol=1e-7)
    for k, v in full_metrics.items():
        torch.testing.assert_close(v, ref["metrics"][k], rtol=1e-5, atol=1e-6, msg=k)
    for key in ("loss_mask_sums", "loss_modified_sums"):
        assert sum(r[key] for r in results) == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    for k, v in ref["reduced_metrics"].items():
        assert sum(r["reduced_metrics"][k] for r in results) == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("allgather_cp", [False, True], ids=["thd", "allgather"])
def test_slime_thd_cp2_call_equals_cp1(pool2, cfg_name, allgather_cp):
    """slime, CP = 2, thd (zigzag, packed): ``train_log_probs`` / ``rollout_log_probs`` are this
    rank's pieces (rollout ones sliced by slice_log_prob_with_cp at actor.py:284-299, train ones
    cut by get_responses at loss.py:168-188), ``loss_masks`` full length, no parallel_state
    (loss.py:1064-1078): loss weights, masks and every metric equal the CP = 1 call, and so do the
    loss and metrics after slime's reducers (rollout_mask_sums denominators, loss.py:1086-1092;
    metrics over the original masks, loss.py:1156-1163). With --allgather-cp slime redistributes
    the contiguous split into the same zigzag pieces before the loss (loss.py:596-602 ->
    _allgather_cp_redistribute, loss.py:194-271)."""
    ref = _reference("slime", cfg_name, "thd")
    _assert_cp_equals_cp1(pool2.run(slime_cp2_call, cfg_name, allgather_cp), ref, cfg_name)


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("layout, allgather_cp", [("bshd", False), ("thd", True), ("bshd", True)],
                         ids=["bshd", "allgather-thd", "allgather-bshd"])
def test_miles_cp2_call_equals_cp1(pool2, cfg_name, layout, allgather_cp):
    """Miles, CP = 2, called with its ParallelState and ``max_seq_lens`` (losses.py:249-261).
    bshd: the zigzag split of the padded batch maximum (``chunk = ceil(max_seq_len / 4)``,
    max_seq_lens from data.py:77-90, rollout pieces from data.py:91-110). All-gather CP
    (``--allgather-cp``): the host redistributes the contiguous split back into the zigzag pieces
    of ``args.qkv_format`` before the loss (logit_processors.py:200-207 ->
    cp_utils.py:330-408), so the function sees the same pieces with ``args.allgather_cp`` true.
    Equal to the CP = 1 call, also after Miles' reducer without ``rollout_mask_sums``
    (denominators from the returned full masks, losses.py:272 -> cp_utils.py:111-112)."""
    ref = _reference("miles", cfg_name, layout)
    results = pool2.run(miles_cp2_call, cfg_name, layout, allgather_cp)
    _assert_cp_equals_cp1(results, ref, cfg_name)


# ------------------------------------------------------------- the hooks' call order (DP = 2)
def _scheduler():
    """Megatron-Core's OptimizerParamScheduler as slime / Miles build it (slime model.py:181-234,
    Miles model.py:68-113): constant rate 1.0 here."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=1.0, lr_warmup_steps=0,
                                    lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=100, wd_incr_style="constant")
    return opt, sched


HOOK_KEYS = dict(use_tis=True, tis_upper_bound=20.0, tis_batch_normalize=True, tis_batch_normalize_scope="global",
                 length_decay_enabled=True, length_decay_trigger="start", length_decay_period=2)
#  per DP rank: the samples' token ratios (each token of a sample has its sample's ratio) and
#  response lengths. Rollout r multiplies every ratio by r + 1.
RATIOS = {0: [2.0, 1.0, 4.0, 1.0], 1: [3.0, 2.0, 1.0, 2.0]}
LENGTHS = {0: [1, 2, 1, 2], 1: [1, 1, 2, 2]}
NUM_ROLLOUTS, STEPS, MICRO = 4, 2, 2  # 2 optimizer steps of 2 micro-batches (1 sample each) per rollout


def _rollout_data(dp_rank: int, rollout_id: int) -> dict:
    rollout = [torch.full((n,), -1.0) for n in LENGTHS[dp_rank]]
    log_probs = [r + math.log(k * (rollout_id + 1)) for r, k in zip(rollout, RATIOS[dp_rank])]
    n = len(rollout)
    return dict(log_probs=log_probs, rollout_log_probs=rollout, loss_masks=[torch.ones(k, dtype=torch.int32) for k in LENGTHS[dp_rank]],
                total_lengths=[k + 3 for k in LENGTHS[dp_rank]], response_lengths=list(LENGTHS[dp_rank]),
                partition=list(range(n)))


def _train(args, rollout_id, rollout_data, opt, sched, call, before_step=None):
    """slime model.py:827-839 / Miles model.py:776-792: for each optimizer step, the before-step hook
    (slime model.py:557-561, Miles model.py:457-461), the micro-batches' loss calls, then
    optimizer.step() and opt_param_scheduler.step (slime model.py:681-686, Miles model.py:624-628).
    Records, per micro-batch, the learning rate the step's update uses and the loss weights."""
    events = []
    for step_id in range(STEPS):
        if before_step is not None:
            before_step(args, rollout_id, step_id, None, opt, sched)
        for mb in range(MICRO):
            i = step_id * MICRO + mb
            n = rollout_data["response_lengths"][i]
            batch = {k: [v[i]] for k, v in rollout_data.items() if k != "partition"}
            loss, _, _ = call(args=args, pg_loss=torch.ones(n), train_log_probs=batch["log_probs"],
                              rollout_log_probs=batch["rollout_log_probs"], loss_masks=batch["loss_masks"],
                              total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
            events.append(dict(rollout=rollout_id, step=step_id, sample=i, lr=opt.param_groups[0]["lr"],
                               weights=loss.tolist()))
        opt.step()
        sched.step(increment=MICRO)
    return events


def slime_rollouts():
    """slime with the hooks only: actor.py:473-488 recomputes pi_old once per rollout, then
    actor.py:505-506 calls --rollout-data-postprocess-path (megatron_mis' rollout_data_postprocess:
    the response length for the length decay, then the global mean), then train() (actor.py:524-533)."""
    from megatron.core import parallel_state as mpu

    from megatron_mis.integrations import slime
    from megatron_mis.integrations.state import state_of
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel():  # DP = 2
        dp = mpu.get_data_parallel_rank()
        args = _host_args(**HOOK_KEYS)
        opt, sched = _scheduler()
        fn = _load_function("megatron_mis.integrations.slime.compute_mis_weights_with_cp")
        events, lengths = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for rollout_id in range(NUM_ROLLOUTS):
                data = _rollout_data(dp, rollout_id)
                postprocess = _load_function("megatron_mis.integrations.slime.rollout_data_postprocess")
                postprocess(args, rollout_id, data)
                lengths.append(state_of(args).lr.last_response_length)
                events += _train(args, rollout_id, data, opt, sched, fn, before_step=slime.before_train_step)
            try:  # a micro-batch of a 5th rollout whose hook did not run
                _train(args, NUM_ROLLOUTS, _rollout_data(dp, NUM_ROLLOUTS), opt, sched, fn)
                stale = None
            except RuntimeError as exc:
                stale = str(exc)
        return dict(dp=dp, events=events, lengths=lengths, stale=stale)


def miles_rollouts(with_hook: bool = False):
    """Miles with both patches, applied in their documented order (length-decay, then
    global-mis-normalizer; line numbers of the patched files): the first wraps the scheduler
    where Miles builds it (model.py:113-118) and calls observe_rollout right after the rollout-data
    hook (actor.py:563-564, then 566-572); the second calls prepare_global_normalizer after
    log_rollout_data, before train() (actor.py:576-581, train at 587); the drop-in gets Miles'
    parallel_state (loss_hub/losses.py:257). No before-train-step hook: the wrapper is the host's
    scheduler and model.py:635 (628 unpatched) steps it after optimizer.step(). ``with_hook``: the
    user also sets --custom-megatron-before-train-step-hook-path to megatron_mis' before_train_step
    (called with the wrapper, model.py:457-461): it must change nothing."""
    import functools

    import torch.distributed as dist

    from megatron_mis.integrations import miles
    from megatron_mis.integrations.state import state_of

    dp = dist.get_rank()
    ps = miles_parallel_state(dp=GroupInfo(dp, 2, dist.group.WORLD))
    args = _host_args(**HOOK_KEYS)
    opt, inner = _scheduler()
    events, lengths = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = miles.wrap_opt_param_scheduler(args, inner)  # get_optimizer_param_scheduler, patched
        fn = functools.partial(_load_function("megatron_mis.integrations.miles.compute_mis_weights_with_cp"),
                               parallel_state=ps, max_seq_lens=None)
        for rollout_id in range(NUM_ROLLOUTS):
            data = _rollout_data(dp, rollout_id)
            miles.observe_rollout(args, rollout_id, data, group=ps.effective_dp.group)  # length-decay patch
            lengths.append(state_of(args).lr.last_response_length)
            miles.prepare_global_normalizer(args, rollout_id, data, parallel_state=ps)  # normaliser patch
            events += _train(args, rollout_id, data, opt, sched, fn,
                             before_step=miles.before_train_step if with_hook else None)
        try:
            _train(args, NUM_ROLLOUTS, _rollout_data(dp, NUM_ROLLOUTS), opt, sched, fn)
            stale = None
        except RuntimeError as exc:
            stale = str(exc)
    return dict(dp=dp, events=events, lengths=lengths, stale=stale)


@pytest.mark.parametrize("host", ["slime", "miles", "miles+before-step-hook"])
def test_hooks_in_host_order_across_rollouts_of_several_steps(pool2, host):
    """A rollout of 2 optimizer steps x 2 micro-batches on 2 DP ranks, 4 rollouts, the hooks in
    the host's order (see slime_rollouts / miles_rollouts for the file:line of each call).

    Hand-derived: the token ratios of rollout r are (r + 1) x [2, 1, 4, 1] (rank 0, lengths
    1, 2, 1, 2) and (r + 1) x [3, 2, 1, 2] (rank 1, lengths 1, 1, 2, 2), so the global mean over
    the 12 loss tokens is (r + 1) x 21 / 12 = 1.75 (r + 1) and every normalised weight is
    ratio / 1.75 in every rollout (a mean left from the previous rollout would be off by
    (r + 1) / r). The global mean response length is 12 / 8 = 1.5. Length decay from the start
    with period 2: the learning rate of rollout r (step r + 1) is 1, 0.5, 0.5, 0.25, at every
    micro-batch of both optimizer steps. A 5th rollout trained without its hook is refused."""
    results = pool2.run(slime_rollouts) if host == "slime" else pool2.run(miles_rollouts, host != "miles")
    lrs = [1.0, 0.5, 0.5, 0.25]
    for res in results:
        dp = res["dp"]
        assert res["lengths"] == [pytest.approx(1.5)] * NUM_ROLLOUTS
        assert len(res["events"]) == NUM_ROLLOUTS * STEPS * MICRO
        for ev in res["events"]:
            i = ev["sample"]
            assert ev["lr"] == pytest.approx(lrs[ev["rollout"]]), ev
            assert ev["weights"] == pytest.approx([RATIOS[dp][i] / 1.75] * LENGTHS[dp][i], rel=1e-6), ev
        assert res["stale"] is not None and "stale" in res["stale"] and f"rollout {NUM_ROLLOUTS - 1}" in res["stale"]
