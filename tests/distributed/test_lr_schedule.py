"""The length-decay learning-rate schedule (Beyond Precision (arXiv:2602.01826), Algorithm 1): the 110 -> 198 case, halving
at each period down to the floor, Algorithm 1 verbatim, the Megatron-Core wrapper (warm-up
first), exact resume mid-decay, the global-mean collective and the slime / Miles hooks on 2 gloo
ranks."""

from __future__ import annotations

import argparse
import copy
import io
import json
import pickle

import pytest
import torch

from megatron_mis.config import ConfigError
from megatron_mis.lr_schedule import (
    LR_SCHEDULES,
    LengthDecayParamScheduler,
    LengthDecaySchedule,
    LengthDecayScheduler,
    build_lr_schedule,
)
from megatron_mis.monitor import LengthDecayConfig, SurgeConfig

ETA0 = 1.0e-6  # Beyond Precision (arXiv:2602.01826)'s initial learning rate

# Beyond Precision (arXiv:2602.01826) (section 4.2): the length surges near step 110. The trace jumps 1000 -> 3000 at step
# 110, which the default detector reports on step 112 with onset 110 (see tests/unit/test_surge.py).
# The period is 1.8 x the onset (198); the decay is triggered at the detection step (112).
# (Before issue 13 this trace jumped at 108 and the period came from the detection step.)
SURGE_TRACE = [1000.0] * 109 + [3000.0] * 1000


def seed002_expected_factor(t: int) -> float:
    """Surge at 110, T = round(1.8 * 110) = 198, anchor start, halving, floor 0.1."""
    if t < 198:
        return 1.0
    if t < 396:
        return 0.5
    if t < 594:
        return 0.25
    if t < 792:
        return 0.125
    return 0.1  # 1/16 = 0.0625 < 0.1: the floor from step 792 on


# ------------------------------------------------------------------------------ pure schedule
def test_decay_period_from_the_surge_step():
    cfg = LengthDecayConfig(length_decay_enabled=True)
    assert cfg.resolve_period(110) == 198  # Beyond Precision (arXiv:2602.01826), Qwen3-4B: surge near step 110
    assert cfg.resolve_period(90) == 162  # Qwen3-8B: surge at 90, best period ~160
    on = dict(length_decay_enabled=True)
    assert LengthDecayConfig(length_decay_period_multiple=1.25, **on).resolve_period(2) == 3  # 2.5 rounds up
    assert LengthDecayConfig(length_decay_period=204, **on).resolve_period(110) == 204
    assert LengthDecayConfig(length_decay_period_multiple=0.001, **on).resolve_period(3) == 1  # at least 1


@pytest.mark.parametrize("how", ["detected", "pinned"])
def test_seed002_surge_at_110_halves_every_198_steps_down_to_the_floor(how):
    decay = LengthDecayConfig(
        length_decay_enabled=True, length_decay_surge_step=110 if how == "pinned" else None
    )
    schedule = build_lr_schedule(decay)
    assert isinstance(schedule, LengthDecaySchedule) and schedule.name == "length_decay"
    factors = []
    for t in range(1, 1001):
        event = schedule.observe(t, SURGE_TRACE[t - 1])
        if how == "detected":
            assert (event is not None) == (t == 112)
        factors.append(schedule.factor(t))
    assert schedule.trigger_step == (112 if how == "detected" else 110) and schedule.decay_period == 198
    assert schedule.onset_step == 110
    assert factors == [seed002_expected_factor(t) for t in range(1, 1001)]
    # The halving steps, explicitly: each period ends with exactly one halving.
    drops = [t for t in range(2, 1001) if factors[t - 1] < factors[t - 2]]
    assert drops == [198, 396, 594, 792]
    assert [factors[t - 1] / factors[t - 2] for t in drops[:3]] == [0.5, 0.5, 0.5]
    assert factors[791] == 0.1  # the fourth "halving" stops at the floor
    # never below the floor, however long the run
    assert min(schedule.factor(t) for t in range(1, 20_000, 7)) == 0.1
    assert [schedule.next_decay_step(t) for t in (0, 112, 197, 198, 500, 791, 792)] == [198, 198, 198, 396, 594, 792, None]


@pytest.mark.parametrize("period", [1, 7, 50, 198])
@pytest.mark.parametrize("floor", [0.0, 0.1, 0.3])
def test_trigger_start_is_algorithm_1_verbatim(period, floor):
    # Algorithm 1 of Beyond Precision (arXiv:2602.01826), literally: eta_t <- max(eta_{t-1} / 2, eta_inf) when t mod T == 0.
    schedule = build_lr_schedule(
        LengthDecayConfig(
            length_decay_enabled=True, length_decay_trigger="start", length_decay_period=period,
            length_decay_min_ratio=floor,
        )
    )
    eta_inf = floor * ETA0
    eta = ETA0
    # at most 60 halvings: beyond that, floor 0 drives both into subnormal numbers, where
    # halving is no longer exact
    for t in range(1, min(1200, 60 * period) + 1):
        if t % period == 0:
            eta = max(eta / 2, eta_inf)
        schedule.observe(t, None)
        # Halving is exact in binary floating point, so the closed form must match bit for bit.
        assert ETA0 * schedule.factor(t) == eta, t


def test_anchor_trigger_and_trigger_step_never_decayed():
    pinned = dict(length_decay_enabled=True, length_decay_surge_step=110)
    trig = LengthDecaySchedule(LengthDecayConfig(length_decay_anchor="trigger", **pinned))
    assert trig.decay_period == 198
    drops = [t for t in range(111, 2000) if trig.factor(t) < trig.factor(t - 1)]
    assert drops == [308, 506, 704, 902]  # 110 + k * 198
    assert trig.factor(307) == 1.0 and trig.factor(308) == 0.5
    # anchor start with a period shorter than the surge step (multiple 0.5 -> T = 55): 110 is a
    # multiple of 55, but the trigger step runs undecayed; the first halving is at 165.
    short = LengthDecaySchedule(LengthDecayConfig(length_decay_period_multiple=0.5, **pinned))
    assert short.decay_period == 55
    assert [t for t in range(100, 400) if short.factor(t) < short.factor(t - 1)] == [165, 220, 275, 330]
    assert short.factor(110) == 1.0
    # a custom factor / floor
    custom = LengthDecaySchedule(
        LengthDecayConfig(length_decay_factor=0.8, length_decay_min_ratio=0.5, length_decay_period=10, **pinned)
    )
    assert [custom.factor(t) for t in (119, 120, 130, 140, 150, 160)] == [1.0, 0.8, 0.8**2, 0.8**3, 0.5, 0.5]


def test_disabled_is_the_constant_schedule_and_still_reports_the_trigger():
    schedule = build_lr_schedule(LengthDecayConfig())  # length_decay_enabled: false
    assert schedule.name == "constant" and LR_SCHEDULES.names() == ["constant", "length_decay"]
    for t in range(1, 900):
        schedule.observe(t, SURGE_TRACE[t - 1])
    assert schedule.trigger_step == 112 and schedule.decay_period == 198  # where it would decay
    assert {schedule.factor(t) for t in range(0, 900)} == {1.0}
    assert schedule.next_decay_step(200) is None


def test_config_validation_all_at_once_and_warnings():
    with pytest.raises(ConfigError) as info:
        LengthDecayConfig(
            length_decay_trigger="start",
            length_decay_surge_step=0,
            length_decay_factor=1.0,
            length_decay_min_ratio=1.5,
            length_decay_period_multiple=-1.0,
            length_decay_anchor="end",
        )
    text = str(info.value)
    for piece in (
        "length_decay_anchor='end'", "length_decay_factor=1.0", "length_decay_min_ratio=1.5",
        "length_decay_period_multiple=-1.0", "length_decay_surge_step=0", "needs a fixed length_decay_period",
        "use one or the other",
    ):
        assert piece in text, piece
    with pytest.warns(UserWarning, match="length_decay_enabled is false, so length_decay_period"):
        LengthDecayConfig(length_decay_period=100)
    with pytest.warns(UserWarning, match="length_decay_period_multiple=2.0 is unused"):
        LengthDecayConfig(length_decay_enabled=True, length_decay_period=100, length_decay_period_multiple=2.0)
    schedule = LengthDecaySchedule(LengthDecayConfig(length_decay_enabled=True))
    schedule.observe(3, 10.0)
    with pytest.raises(ValueError, match="steps must increase"):
        schedule.observe(3, 10.0)
    with pytest.raises(ValueError, match="numbered from 1"):
        LengthDecaySchedule().observe(0, 1.0)
    with pytest.raises(ValueError, match="either surge"):
        from megatron_mis.monitor import build_surge_detector

        LengthDecaySchedule(surge=SurgeConfig(), detector=build_surge_detector(SurgeConfig()))


def test_standalone_scheduler_with_and_without_optimizer():
    decay = LengthDecayConfig(length_decay_enabled=True)
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": [params[0]], "lr": 2e-6}, {"params": [params[1]], "lr": 1e-6}])
    with_opt = LengthDecayScheduler(build_lr_schedule(decay), optimizer=opt)
    plain = LengthDecayScheduler(build_lr_schedule(decay), base_lr=ETA0)
    for t in range(1, 801):
        lr = plain.step(SURGE_TRACE[t - 1])
        assert lr == ETA0 * seed002_expected_factor(t) == plain.lr
        assert with_opt.step(SURGE_TRACE[t - 1]) == 2e-6 * seed002_expected_factor(t)
        assert [g["lr"] for g in opt.param_groups] == [2e-6 * seed002_expected_factor(t), 1e-6 * seed002_expected_factor(t)]
    with pytest.raises(ValueError, match="base_lr"):
        LengthDecayScheduler(build_lr_schedule(decay))
    with pytest.raises(TypeError, match="LengthDecaySchedule"):
        LengthDecayScheduler(decay, base_lr=1.0)


@pytest.mark.parametrize("cut", [109, 300])
def test_standalone_resume_mid_run(cut):
    decay = LengthDecayConfig(length_decay_enabled=True)
    full = LengthDecayScheduler(build_lr_schedule(decay), base_lr=ETA0)
    expected = [full.step(SURGE_TRACE[t - 1]) for t in range(1, 701)]
    first = LengthDecayScheduler(build_lr_schedule(decay), base_lr=ETA0)
    got = [first.step(SURGE_TRACE[t - 1]) for t in range(1, cut + 1)]
    resumed = LengthDecayScheduler(build_lr_schedule(decay), base_lr=ETA0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.step(SURGE_TRACE[t - 1]) for t in range(cut + 1, 701)]
    assert got == expected


# ------------------------------------------------------------------- Megatron-Core wrapper
MAX_LR = 1.0e-3
WARMUP = 10


def megatron_scheduler(warmup: int = WARMUP, style: str = "constant"):
    """A real OptimizerParamScheduler (keyword arguments as in megatron-core 0.13-0.16) around a
    torch AdamW with two parameter groups, the second with Megatron's per-group max_lr override."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "max_lr": MAX_LR / 4, "min_lr": 0.0}], lr=0.0)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=MAX_LR,
        min_lr=1.0e-5,
        lr_warmup_steps=warmup,
        lr_decay_steps=5000,
        lr_decay_style=style,
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=5000,
        wd_incr_style="constant",
    )
    return opt, sched


def run_wrapped(wrapper, opt, first: int, last: int, trace=SURGE_TRACE):
    """Plain Megatron-Core loop: observe step t's length, update with the group lrs, step."""
    lrs = []
    for t in range(first, last + 1):
        wrapper.observe(t, trace[t - 1])
        lrs.append(tuple(g["lr"] for g in opt.param_groups))
        opt.step()  # no gradients: a no-op update, kept to mirror the real loop
        wrapper.step(increment=1)
    return lrs


def plain_lrs(last: int, **kwargs):
    opt, sched = megatron_scheduler(**kwargs)
    lrs = []
    for _ in range(last):
        lrs.append(tuple(g["lr"] for g in opt.param_groups))
        sched.step(increment=1)
    return lrs


@pytest.mark.parametrize("style", ["constant", "cosine"])
def test_megatron_wrapper_keeps_warmup_and_base_schedule(style):
    opt, sched = megatron_scheduler(style=style)
    wrapper = LengthDecayParamScheduler(sched, build_lr_schedule(LengthDecayConfig(length_decay_enabled=True)))
    got = run_wrapped(wrapper, opt, 1, 900)
    base = plain_lrs(900, style=style)
    # Exactly the base schedule times the multiplier, for both groups (the multiplication is the
    # only operation, so the comparison is exact).
    assert got == [tuple(x * seed002_expected_factor(t) for x in base[t - 1]) for t in range(1, 901)]
    # Warm-up first: 0 -> max_lr linearly over the first 10 updates, untouched by the schedule.
    assert [lr[0] for lr in got[:11]] == pytest.approx([MAX_LR * k / WARMUP for k in range(11)], rel=1e-12, abs=0)
    assert got[0][0] == 0.0 and got[10][0] == MAX_LR
    if style == "constant":
        assert got[196] == (MAX_LR, MAX_LR / 4)  # step 197
        assert got[197] == (MAX_LR / 2, MAX_LR / 8)  # step 198: the first halving
        assert got[791] == (MAX_LR * 0.1, MAX_LR / 4 * 0.1)  # step 792: the floor
    # hosts log get_lr(): it reports the applied rate
    assert wrapper.get_lr(opt.param_groups[0]) == opt.param_groups[0]["lr"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.01]  # weight decay untouched
    assert wrapper.num_steps == 900 and wrapper.max_lr == MAX_LR  # the rest is the inner's


def test_megatron_wrapper_decay_during_warmup():
    # Triggered before step 1 with period 4: the halvings multiply the warm-up ramp.
    opt, sched = megatron_scheduler()
    decay = LengthDecayConfig(
        length_decay_enabled=True, length_decay_trigger="start", length_decay_period=4, length_decay_min_ratio=0.2
    )
    wrapper = LengthDecayParamScheduler(sched, build_lr_schedule(decay))
    got = [lr[0] for lr in run_wrapped(wrapper, opt, 1, 16)]
    base = [lr[0] for lr in plain_lrs(16)]
    factors = [1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25, 0.2, 0.2, 0.2, 0.2, 0.2]
    assert got == [b * f for b, f in zip(base, factors)]


@pytest.mark.parametrize("cut", [109, 300, 396])
def test_megatron_resume_mid_decay_continues_exactly(cut):
    # 109: the detector is one step into the surge condition (its streak must survive);
    # 300: in the middle of the first decay period; 396: right on a halving step.
    decay = LengthDecayConfig(length_decay_enabled=True)
    opt, sched = megatron_scheduler()
    uninterrupted = LengthDecayParamScheduler(sched, build_lr_schedule(decay))
    expected = run_wrapped(uninterrupted, opt, 1, 900)

    opt1, sched1 = megatron_scheduler()
    first = LengthDecayParamScheduler(sched1, build_lr_schedule(decay))
    got = run_wrapped(first, opt1, 1, cut)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a Megatron checkpoint stores it
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain Python types only

    opt2, sched2 = megatron_scheduler()  # a fresh process: new optimizer, scheduler, wrapper
    resumed = LengthDecayParamScheduler(sched2, build_lr_schedule(decay))
    resumed.load_state_dict(saved)
    got += run_wrapped(resumed, opt2, cut + 1, 900)
    assert got == expected
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_checkpoint_compatibility_with_plain_schedulers():
    decay = LengthDecayConfig(length_decay_enabled=True)
    opt, sched = megatron_scheduler()
    wrapper = LengthDecayParamScheduler(sched, build_lr_schedule(decay))
    run_wrapped(wrapper, opt, 1, 250)
    state = wrapper.state_dict()
    assert LengthDecayParamScheduler.STATE_KEY in state and state["num_steps"] == 250
    # a plain scheduler (megatron-mis switched off) still loads the checkpoint
    opt_plain, plain = megatron_scheduler()
    plain.load_state_dict(state)
    assert plain.num_steps == 250 and opt_plain.param_groups[0]["lr"] == MAX_LR
    # a wrapper loading a plain checkpoint warns and keeps its fresh schedule
    opt3, sched3 = megatron_scheduler()
    fresh = LengthDecayParamScheduler(sched3, build_lr_schedule(decay))
    with pytest.warns(UserWarning, match="no length-decay state"):
        fresh.load_state_dict(plain.state_dict())
    assert fresh.num_steps == 250 and fresh.schedule.trigger_step is None
    with pytest.raises(TypeError, match="only once"):
        LengthDecayParamScheduler(wrapper, build_lr_schedule(decay))
    with pytest.raises(TypeError, match="OptimizerParamScheduler"):
        LengthDecayParamScheduler(object(), build_lr_schedule(decay))


def test_apply_is_idempotent_when_the_host_steps_the_inner_scheduler():
    # Hook mode: the host calls the inner scheduler's step() itself and the hook calls apply()
    # before every step, sometimes twice, and not at all after a skipped (invalid) update.
    decay = LengthDecayConfig(length_decay_enabled=True, length_decay_surge_step=3, length_decay_period=4)
    opt, sched = megatron_scheduler(warmup=0)
    hooked = LengthDecayParamScheduler(sched, build_lr_schedule(decay))
    for t in range(1, 13):
        hooked.observe(t, None)
        hooked.apply()
        hooked.apply()
        assert opt.param_groups[0]["lr"] == MAX_LR * hooked.schedule.factor(t)
        if t != 6:  # step 6's update is skipped by the host: no inner step
            sched.step(increment=1)
    assert hooked.schedule.factor(12) == 0.125  # halvings at 4, 8, 12


# ---------------------------------------------------------------------- distributed (2 ranks)
def _global_mean_case(lengths_per_rank, with_group):
    import torch.distributed as dist

    from megatron_mis.monitor.distributed import global_mean_response_length

    rank = dist.get_rank()
    group = dist.new_group(ranks=[0, 1]) if with_group else None
    local = lengths_per_rank[rank]
    if not with_group:
        try:
            global_mean_response_length(local, group=None)
        except ValueError as exc:
            return str(exc)
        return "no error"
    return (
        global_mean_response_length(local, group=group),
        global_mean_response_length(torch.tensor(local, dtype=torch.int64), group=group),
    )


def test_global_mean_response_length(pool2):
    lengths = [[100, 2000, 300], []]  # rank 1 holds no samples and still takes part
    results = pool2.run(_global_mean_case, lengths, True)
    assert results[0] == results[1] == (800.0, 800.0)
    assert pool2.run(_global_mean_case, [[], []], True) == [(None, None), (None, None)]
    assert all("no WORLD default" in r for r in pool2.run(_global_mean_case, lengths, False))


def _slime_host_case(mode, lengths_by_rollout, num_steps_per_rollout, stop_after=None, saved=None):
    """The slime loop as read at 624b824a (actor.train_actor -> model.train -> train_one_step):
    rollout_data_postprocess(args, rollout_id, rollout_data) on every rank, then per step the
    before-train-step hook, optimizer.step(), opt_param_scheduler.step(increment=gbs)."""
    from megatron_mis.integrations import slime as hooks
    from megatron_mis.testing.distributed import megatron_parallel

    args = argparse.Namespace(length_decay_enabled=True, length_surge_min_steps=5)
    rank = torch.distributed.get_rank()
    with megatron_parallel(tp=1):  # data-parallel size 2
        opt, inner = megatron_scheduler(warmup=24)  # 3 iterations of 8 samples
        sched = hooks.wrap_opt_param_scheduler(args, inner) if mode == "patched" else inner
        if saved is not None:
            sched.load_state_dict(saved)
        first_rollout = 0 if saved is None else saved[LengthDecayParamScheduler.STATE_KEY]["current_step"]
        lrs = []
        for rollout_id in range(first_rollout, len(lengths_by_rollout)):
            # each rank holds half of the rollout's samples
            rollout_data = {"response_lengths": lengths_by_rollout[rollout_id][rank::2]}
            hooks.rollout_data_postprocess(args, rollout_id, rollout_data)
            for step_id in range(num_steps_per_rollout):
                if mode == "hooks":
                    hooks.before_train_step(args, rollout_id, step_id, None, opt, sched)
                lrs.append(opt.param_groups[0]["lr"])
                sched.step(increment=8)
            if stop_after is not None and rollout_id + 1 == stop_after:
                return lrs, sched.state_dict(), sorted(k for k in vars(pickle.loads(pickle.dumps(args))) if k.startswith("_megatron_mis"))
        return lrs, None, None


def _rollout_lengths(num_rollouts):
    # 8 samples per rollout; the mean is 1000 until rollout 19, then 3000 (surge)
    out = []
    for r in range(num_rollouts):
        base = 1000 if r < 19 else 3000
        out.append([base + d for d in (-300, -100, 100, 300, -200, 0, 0, 200)])
    return out


@pytest.mark.parametrize("mode", ["hooks", "patched"])
def test_slime_hooks_on_two_data_parallel_ranks(pool2, mode):
    lengths = _rollout_lengths(90)
    steps_per_rollout = 2
    results = pool2.run(_slime_host_case, mode, lengths, steps_per_rollout)
    lrs0, lrs1 = results[0][0], results[1][0]
    assert lrs0 == lrs1  # every rank applies the same rate

    # Reference in one process: the schedule fed with the global means, step = rollout_id + 1.
    schedule = build_lr_schedule(
        LengthDecayConfig(length_decay_enabled=True), SurgeConfig(length_surge_min_steps=5)
    )
    opt, sched = megatron_scheduler(warmup=24)
    expected = []
    for r, lens in enumerate(lengths):
        schedule.observe(r + 1, sum(lens) / len(lens))
        for _ in range(steps_per_rollout):
            expected.append(sched.optimizer.param_groups[0]["lr"] * schedule.factor(r + 1))
            sched.step(increment=8)
    # the mean triples at step 20 (rollout 19): detected on step 22, onset 20, T = round(1.8 * 20) = 36
    # (before issue 13 the period came from the detection step: 40)
    assert schedule.trigger_step == 22 and schedule.onset_step == 20 and schedule.decay_period == 36
    assert lrs0 == expected
    assert len(set(lrs0)) > 4  # warm-up, plateau and two halvings are all in there


def test_slime_patched_resume_is_exact(pool2):
    lengths = _rollout_lengths(90)
    full = pool2.run(_slime_host_case, "patched", lengths, 1)[0][0]
    part = pool2.run(_slime_host_case, "patched", lengths, 1, 45)  # stop mid-decay (period 40: 40 < 45 < 80)
    lrs_a, saved, pickled_state = part[0]
    assert pickled_state == []  # args pickled into a checkpoint carries nothing of ours
    rest = pool2.run(_slime_host_case, "patched", lengths, 1, None, saved)[0][0]
    assert lrs_a + rest == full


def test_host_state_is_dropped_from_pickled_or_copied_args():
    from megatron_mis.integrations import scheduler_hooks as hooks

    args = argparse.Namespace(length_decay_enabled=True)
    opt, inner = megatron_scheduler()
    hooks.wrap_opt_param_scheduler(args, inner)
    assert isinstance(hooks.host_state(args).scheduler, LengthDecayParamScheduler)
    assert not [k for k in vars(args) if k.startswith("_megatron_mis")]  # nothing of ours on args
    assert not [k for k in vars(pickle.loads(pickle.dumps(args))) if k.startswith("_megatron_mis")]
    copied = copy.deepcopy(args)
    assert hooks.host_state(copied) is not hooks.host_state(args)  # a copy starts afresh from its keys
    assert hooks.host_state(copied).scheduler is None
    with pytest.raises(ConfigError, match="length_decay_factor=2.0"):
        hooks.host_state(argparse.Namespace(length_decay_factor=2.0, length_surge_ratio=0.5))


def _split_surge_lengths(num_rollouts):
    """8 samples per rollout, rank r holding samples r, r+2, ... (as _slime_host_case splits
    them): rank 0's samples grow 2.5x at rollout 15, rank 1's stay at 1000 until rollout 30 and
    then grow 5x. The global mean (1000 -> 1750 -> 3750) surges only at rollout 30; rank 0's
    local mean (1000 -> 2500) already at rollout 15."""
    out = []
    for r in range(num_rollouts):
        even = 2500 if r >= 15 else 1000
        odd = 5000 if r >= 30 else 1000
        out.append([(even if i % 2 == 0 else odd) + d for i, d in enumerate((-40, 40, 20, -20, 0, 0, 20, -20))])
    return out


def _trigger_and_lrs(means, steps_per_rollout=1):
    schedule = build_lr_schedule(LengthDecayConfig(length_decay_enabled=True), SurgeConfig(length_surge_min_steps=5))
    opt, sched = megatron_scheduler(warmup=24)
    lrs = []
    for r, mean in enumerate(means):
        schedule.observe(r + 1, mean)
        for _ in range(steps_per_rollout):
            lrs.append(sched.optimizer.param_groups[0]["lr"] * schedule.factor(r + 1))
            sched.step(increment=8)
    return schedule.trigger_step, lrs


def test_hooks_use_the_global_mean_when_local_means_surge_elsewhere(pool2):
    """Issue 33: with both ranks' halves surging on the same step, a hook that fed the rank-local
    mean passed. Here rank 0's local mean surges 15 rollouts before the global one: every rank
    must follow the global mean's schedule."""
    lengths = _split_surge_lengths(70)
    global_trigger, expected = _trigger_and_lrs([sum(x) / len(x) for x in lengths])
    local0_trigger, local0 = _trigger_and_lrs([sum(x[0::2]) / 4 for x in lengths])
    # the data really separate the two: the global mean triggers after rollout 30, rank 0's
    # local mean near rollout 15, and their learning rates differ
    assert global_trigger is not None and local0_trigger is not None
    assert global_trigger > 30 and local0_trigger < 20 and local0 != expected
    for mode in ("hooks", "patched"):
        results = pool2.run(_slime_host_case, mode, lengths, 1)
        assert results[0][0] == results[1][0], mode  # every rank applies the same rate
        assert results[0][0] == expected, mode
