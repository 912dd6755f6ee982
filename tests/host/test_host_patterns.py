"""Host conformance: the drop-in called as slime 624b824a and Miles 31f1ca96 call it, in the flag
combinations their users run. Each test names the host file:line it models (read at those
commits; full hashes in docs/hosts.md). Single process, CP = 1: the hosts' CP layouts and the
hooks' order across rollouts are in test_host_cp_and_hooks.py (2 gloo ranks).

The hosts call ``fn(args=..., pg_loss=..., train_log_probs=..., rollout_log_probs=...,
loss_masks=..., total_lengths=..., response_lengths=...)`` once per micro-batch, after setting
every key of ``--custom-config-path`` on ``args`` (slime arguments.py:2013-2019, Miles
arguments.py:3475-3480), and Megatron pickles that same ``args`` into every checkpoint
(``state_dict['args'] = args``).
"""

from __future__ import annotations

import io
import math
import pickle
import threading
import warnings
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.integrations import miles, slime, tis_functions
from megatron_mis.integrations.state import REGISTRY


def _args(**keys) -> Namespace:
    """``args`` as the hosts leave it: their flags plus the YAML keys set on it."""
    base = dict(custom_config_path=None, qkv_format="thd", use_rollout_logprobs=False, calculate_per_token_loss=False)
    base.update(keys)
    return Namespace(**base)


def _call(args, train, rollout, masks=None, pg=None):
    """One micro-batch at CP = 1: every sample is one response of len(train[i]) tokens after a
    3-token prompt."""
    resp = [len(r) for r in rollout]
    masks = masks if masks is not None else [torch.ones(n) for n in resp]
    pg = pg if pg is not None else torch.ones(sum(resp))
    return slime.compute_mis_weights_with_cp(
        args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
        total_lengths=[n + 3 for n in resp], response_lengths=resp,
    )


def _lp(*log_ratios):
    """(train, rollout) pieces of one sample whose token log-ratios are ``log_ratios``."""
    rollout = torch.full((len(log_ratios),), -1.0)
    return rollout + torch.tensor(log_ratios, dtype=torch.float32), rollout


class _UnpicklableEvent:
    """Stands in for the ``torch.cuda.Event`` a DeferredCount holds on a GPU (engine.py:218):
    like it, it cannot be pickled. This CPU build cannot make a real one."""

    def __init__(self):
        self.lock = threading.Lock()

    def query(self):
        return True


def test_checkpoint_save_of_args_after_every_kind_of_drop_in_state(monkeypatch):
    """Megatron's checkpoint save (``state_dict['args'] = args``, pickled by torch.save) after the
    calls a slime job makes: the per-rollout hook with global normalisation (slime
    actor.py:~447, --rollout-data-postprocess-path), micro-batch calls with a non-finite
    rollout log-prob (the deferred count, whose GPU form holds a CUDA event), warn-once messages,
    and the LR hooks. Before the fix all of it lived on ``args`` and the event made
    ``pickle.dumps(args)`` raise TypeError."""
    import megatron_mis.core.engine as engine

    real_init = engine.DeferredCount.__init__

    def cuda_like(self, count):
        real_init(self, count)
        self._event = _UnpicklableEvent()

    monkeypatch.setattr(engine.DeferredCount, "__init__", cuda_like)
    args = _args(use_tis=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.5, rs_upper_bound=2.0,
                 tis_upper_bound=2.0, tis_batch_normalize=True, tis_batch_normalize_scope="global",
                 rs_veto_threshold=1e-4, length_decay_enabled=True)
    from megatron_mis.integrations import scheduler_hooks

    scheduler_hooks.host_state(args)  # the LR / monitor hooks' state (slime before-train-step hook)
    t0, r0 = _lp(0.1, -0.2, 0.3)
    t1, r1 = _lp(0.0, float("nan"))
    r1 = torch.tensor([-1.0, float("nan")])
    data = {"log_probs": [t0, t1], "rollout_log_probs": [r0, r1], "loss_masks": [torch.ones(3), torch.ones(2)],
            "total_lengths": [6, 5], "response_lengths": [3, 2]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tis_functions.prepare_global_normalizer(args, 0, data)  # what slime.rollout_data_postprocess runs first
        args.use_rollout_logprobs = True  # one bypass call: its warn-once is remembered
        _call(args, [t0], [r0])
        args.use_rollout_logprobs = False
        _call(args, [t0], [r0])
        _call(args, [t1], [r1])
    state = REGISTRY.peek(args)
    assert state is not None and state.pending_nonfinite is not None and state.lr is not None and state.warned
    assert isinstance(state.pending_nonfinite._event, _UnpicklableEvent)
    assert [k for k in vars(args) if k.startswith("_megatron_mis")] == []
    restored = pickle.loads(pickle.dumps(args))
    assert vars(restored) == vars(args)
    buf = io.BytesIO()
    torch.save({"args": args}, buf)
    buf.seek(0)
    assert vars(torch.load(buf, weights_only=False)["args"]) == vars(args)


def test_log_prob_reuse_with_global_normalisation_is_refused_naming_the_flag():
    """slime skips the pi_old recompute when it can reuse the training forward's log-probs
    (``can_reuse_log_probs_in_loss``, slime/backends/megatron_utils/actor.py:461-475): the
    rollout data then has no ``log_probs`` when the per-rollout hook runs. Before, every ratio was
    taken as 1 and the 'global mean' was 1.0 (weights 1.6487 after 'normalisation' in the issue's
    repro); now the hook refuses and names the fix."""
    args = _args(use_tis=True, tis_upper_bound=5.0, tis_batch_normalize=True, tis_batch_normalize_scope="global")
    t, r = _lp(0.5, 0.5, 0.5)
    data = {"rollout_log_probs": [r], "loss_masks": [torch.ones(3)], "total_lengths": [6], "response_lengths": [3]}
    with pytest.raises(RuntimeError, match=r"no 'log_probs'.*--get-mismatch-metrics.*tis_batch_normalize_scope: micro_batch"):
        slime.rollout_data_postprocess(args, 0, data)
    # Miles --skip-actor-forward-only (miles/backends/megatron_utils/actor.py) names its own flag
    miles_args = _args(use_tis=True, tis_upper_bound=5.0, tis_batch_normalize=True, tis_batch_normalize_scope="global",
                       skip_actor_forward_only=True)
    with pytest.raises(RuntimeError, match=r"--skip-actor-forward-only"):
        tis_functions.prepare_global_normalizer(miles_args, 0, data)
    # micro-batch scope stays exact under reuse: pi_old is the training forward's own log-probs
    ok = _args(use_tis=True, tis_upper_bound=5.0, tis_batch_normalize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _, _ = _call(ok, [t], [r])
    assert torch.allclose(loss, torch.ones(3))  # three equal weights e^0.5, normalised to mean 1


def test_a_stale_global_mean_is_refused():
    """The per-rollout hook must run for every rollout (slime actor.py, rollout_data_postprocess
    before train): the micro-batches of rollout 1 trained with rollout 0's mean were silently
    accepted before."""
    args = _args(use_tis=True, tis_upper_bound=5.0, tis_batch_normalize=True, tis_batch_normalize_scope="global")
    t, r = _lp(0.5, 0.0)
    data = {"log_probs": [t], "rollout_log_probs": [r], "loss_masks": [torch.ones(2)], "total_lengths": [5],
            "response_lengths": [2]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slime.rollout_data_postprocess(args, 0, data)
        loss, _, _ = _call(args, [t], [r])
    mean = (math.exp(0.5) + 1.0) / 2
    assert loss.tolist() == pytest.approx([math.exp(0.5) / mean, 1.0 / mean], rel=1e-6)
    with pytest.raises(RuntimeError, match=r"stale.*rollout 0"):
        _call(args, [t], [r])  # rollout 1's micro-batch, no hook call in between


def test_slime_bypass_does_not_apply_the_ratio_twice():
    """slime --use-rollout-logprobs: the PPO ratio is already pi_theta / pi_rollout and slime passes
    pi_theta.detach() as train_log_probs (slime/backends/megatron_utils/loss.py:985-989). Before,
    the drop-in multiplied by min(pi_theta / pi_rollout, U) again (effective -r^2 A). Now the IS
    weight is 1 and only rejection acts (docs/hosts.md, bypass)."""
    args = _args(use_tis=True, tis_upper_bound=2.0, use_rollout_logprobs=True, use_rs=True, rs_level="token",
                 rs_lower_bound=0.5, rs_upper_bound=1.5)
    t, r = _lp(0.3, 1.0, -0.1)  # ratios 1.35 (kept, weight would be 1.35), e (rejected by RS), 0.905
    pg = torch.tensor([2.0, 3.0, 5.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, masks, _ = _call(args, [t], [r], pg=pg)
    assert loss.tolist() == [2.0, 0.0, 5.0]
    assert masks[0].tolist() == [1.0, 0.0, 1.0]


def test_miles_bypass_without_pi_old_refuses_rejection_naming_the_fix():
    """Miles passes train_log_probs=None with --use-rollout-logprobs unless pi_old is recomputed
    (miles/backends/megatron_utils/loss_hub/losses.py:127-132): a ratio-based rejection cannot be
    computed, and says so instead of rejecting nothing."""
    args = _args(use_tis=True, use_rollout_logprobs=True, use_rs=True, rs_level="token", rs_lower_bound=0.5,
                 rs_upper_bound=1.5)
    _, r = _lp(0.3, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"train_log_probs is None.*--get-mismatch-metrics"):
            _call(args, None, [r])


def test_miles_tis_clip_flags_keep_their_meaning():
    """Miles' scripts set --tis-clip-low 0.5 --tis-clip 2.0 (its built-in TIS is
    clamp(r, tis_clip_low, tis_clip), miles/backends/megatron_utils/loss_hub/corrections.py:24;
    defaults 0.0 / 2.0 in its arguments.py). Before, megatron-mis read only tis_*_bound: ratio e
    with tis_clip=1.5 gave weight 2.0, and the same keys in the YAML raised 'unknown MIS key'."""
    args = _args(use_tis=True, tis_clip=1.5, tis_clip_low=0.5)
    t, r = _lp(1.0, -2.0, 0.0)  # ratios e, e^-2, 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _, _ = _call(args, [t], [r])
    assert loss.tolist() == pytest.approx([1.5, 0.5, 1.0])
    clash = _args(use_tis=True, tis_clip=1.5, tis_upper_bound=3.0)
    with pytest.raises(ConfigError, match=r"tis_clip=1.5.*tis_upper_bound=3.0 disagree"):
        _call(clash, [t], [r])


def test_miles_yaml_may_carry_its_own_bound_keys(tmp_path):
    """The same two keys in the YAML given to --custom-config-path (set on args by Miles) are
    read with Miles' meaning, not refused as unknown MIS keys."""
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_clip: 1.5\n")
    args = _args(custom_config_path=str(path), use_tis=True, tis_clip=1.5)
    t, r = _lp(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _, _ = _call(args, [t], [r])
    assert loss.tolist() == pytest.approx([1.5])


def test_tis_batch_normalize_keeps_the_hosts_meaning():
    """The hosts' mis.py divide by the mean over every loss-mask sequence (rejected ones
    included with their bounded weight). Sequence TIS, RS rejecting 3 of 4 sequences: the
    survivor (ratio 1) gets 1 / mean(1, 2, 3, 4) = 0.4; megatron-mis' kept-only mean (1.0) is
    still there under tis_batch_normalize_over: kept."""
    keys = dict(use_tis=True, tis_level="sequence", tis_upper_bound=10.0, use_rs=True, rs_level="sequence",
                rs_lower_bound=0.5, rs_upper_bound=1.5, tis_batch_normalize=True)
    samples = [_lp(math.log(k)) for k in (1, 2, 3, 4)]
    train, rollout = [s[0] for s in samples], [s[1] for s in samples]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host, _, _ = _call(_args(**keys), train, rollout)
        kept, _, _ = _call(_args(**keys, tis_batch_normalize_over="kept"), train, rollout)
    assert host.tolist() == pytest.approx([0.4, 0.0, 0.0, 0.0], rel=1e-6)
    assert kept.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0], rel=1e-6)


def test_rs_veto_threshold_acts_only_inside_rs_as_in_the_hosts():
    """slime's and Miles' mis.py apply rs_veto_threshold inside rejection sampling only; without
    use_rs it is inert there (and here, with a warning), unless rs_veto_without_rs."""
    t, r = _lp(0.0, -12.0)  # second token's ratio e^-12 < 1e-4: a veto would reject the sequence
    keys = dict(use_tis=True, tis_upper_bound=2.0, rs_veto_threshold=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _, _ = _call(_args(**keys), [t], [r])
    assert loss.tolist() == pytest.approx([1.0, math.exp(-12.0)], rel=1e-5)
    assert any("rs_veto_threshold" in str(w.message) and "use_rs is false" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vetoed, _, _ = _call(_args(**keys, rs_veto_without_rs=True), [t], [r])
    assert vetoed.tolist() == [0.0, 0.0]


def test_one_sequence_micro_batch_normalisation_warns():
    """Dynamic batch size with long answers puts one sequence in a micro-batch; sequence-level
    self-normalisation per micro-batch then divides the weight by itself (the issue's
    [1.196, 1.196, 1.196, 0.412] -> [1, 1, 1, 1]): said, once."""
    args = _args(use_tis=True, tis_level="sequence", tis_upper_bound=5.0, tis_batch_normalize=True)
    t, r = _lp(0.2, -0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _call(args, [t], [r])
        _call(args, [t], [r])
    hits = [w for w in caught if "one sequence" in str(w.message)]
    assert len(hits) == 1 and "tis_batch_normalize_scope: global" in str(hits[0].message)


def test_the_geometric_rs_preset_acts_on_the_hosts_and_in_the_engine():
    """configs/presets/geometric_rs.yaml used to set use_tis: false, which slime sets on args over
    --use-tis and then never calls the function (slime/backends/megatron_utils/loss.py:1050). It
    now keeps use_tis: true with apply_is_weights: false: the host calls it, RS rejects, every
    weight is 1 — in the drop-in and in the engine called directly (analyze, the testbed)."""
    from pathlib import Path

    import yaml

    from megatron_mis import MISConfig, compute_mis_from_lists

    path = Path(__file__).resolve().parents[2] / "configs" / "presets" / "geometric_rs.yaml"
    keys = yaml.safe_load(path.read_text())
    assert keys["use_tis"] is True
    inside, outside = _lp(0.0005, 0.0005), _lp(0.01, 0.01)  # geometric ratios e^0.0005 (kept), e^0.01 (rejected)
    train, rollout = [inside[0], outside[0]], [inside[1], outside[1]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, masks, _ = _call(_args(custom_config_path=str(path), **keys), train, rollout)
        direct = compute_mis_from_lists(train, rollout, [torch.ones(2), torch.ones(2)], MISConfig.from_yaml(path))
    assert loss.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert [m.tolist() for m in masks] == [[1.0, 1.0], [0.0, 0.0]]
    assert direct.weights.tolist() == [1.0, 1.0, 0.0, 0.0] and direct.keep_mask.tolist() == [True, True, False, False]


# ----------------------------------------------------------------- metrics only (a)
def _host_metric(values: torch.Tensor, masks: list[torch.Tensor]) -> float:
    """slime's / Miles' ``sum_of_sample_mean`` at CP = 1 over the ORIGINAL masks (slime
    cp_utils.py:71-80, Miles cp_utils.py:116-125): per sample the mean over its loss-mask tokens,
    summed over samples."""
    out, offset = 0.0, 0
    for m in masks:
        n = m.numel()
        out += float((values[offset:offset + n].double() * m.double()).sum()) / max(float(m.sum()), 1.0)
        offset += n
    return out


def _k3(x: float) -> float:
    return math.exp(x) - 1.0 - x


@pytest.mark.parametrize("host", ["slime", "miles"])
def test_get_mismatch_metrics_without_use_tis_reports_and_leaves_the_loss(host):
    """--get-mismatch-metrics without --use-tis. slime: the flag needs
    --custom-tis-function-path (slime/utils/arguments.py:1857-1860) and makes slime recompute
    pi_old (slime/backends/megatron_utils/actor.py:461-488: can_reuse_log_probs_in_loss is false);
    the loss calls the function (loss.py:1050), trains on the pg_loss it returns (loss.py:1078),
    rebuilds its reducer from the returned masks (loss.py:1086-1092) and reports every metric
    reduced over the ORIGINAL masks (loss.py:1059, 1156-1163). Miles, the same at
    miles/backends/training_utils/loss_hub/losses.py:230-273 and 379-386, here with
    --use-rollout-logprobs, where --get-mismatch-metrics is what recomputes pi_old
    (miles/backends/megatron_utils/actor.py:523-540) so train_log_probs is not None
    (losses.py:130-132).

    Returned: the very pg_loss (its gradient intact) and the masks as given, whatever RS keys
    the YAML holds (said in a warning, not silently); the metrics, after the host's reduction,
    equal the hand-derived values: sample 0 log-ratios (0.1, -0.2, masked 0.3), sample 1
    (0.0, 0.4); rollout log-probs -1."""
    keys = dict(get_mismatch_metrics=True, use_tis=False, use_rs=True, rs_level="token", rs_lower_bound=0.9,
                rs_upper_bound=1.1)  # RS would reject 0.1, -0.2 and 0.4 if it acted
    if host == "miles":
        keys["use_rollout_logprobs"] = True
    args = _args(**keys)
    t0, r0 = _lp(0.1, -0.2, 0.3)
    t1, r1 = _lp(0.0, 0.4)
    masks = [torch.tensor([1, 1, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)]
    pg = torch.tensor([0.5, -1.0, 2.0, 3.0, -0.25], requires_grad=True)
    assert args.get_mismatch_metrics or args.use_tis  # loss.py:1050 / losses.py:230: the host calls
    fn = (miles if host == "miles" else slime).compute_mis_weights_with_cp
    kwargs = {}
    if host == "miles":  # Miles always passes its ParallelState (losses.py:257); CP = 1 here
        one = SimpleNamespace(rank=0, size=1, group=None)
        kwargs = dict(parallel_state=SimpleNamespace(cp=one, tp=one, intra_dp=one, is_pp_last_stage=True),
                      max_seq_lens=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, new_masks, metrics = fn(
            args=args, pg_loss=pg, train_log_probs=[t0, t1], rollout_log_probs=[r0, r1], loss_masks=masks,
            total_lengths=[6, 5], response_lengths=[3, 2], **kwargs)
    assert torch.equal(loss, pg) and loss.requires_grad
    loss.sum().backward()
    assert pg.grad.tolist() == [1.0] * 5
    assert [m.tolist() for m in new_masks] == [[1, 1, 0], [1, 1]]
    assert any("use_rs has no effect without use_tis" in str(w.message) for w in caught)
    expected = {
        "mis_k3_kl": (_k3(0.1) + _k3(-0.2)) / 2 + (_k3(0.0) + _k3(0.4)) / 2,
        "mis_tv": (abs(math.exp(0.1) - 1) + abs(math.exp(-0.2) - 1)) / 4 + (0 + abs(math.exp(0.4) - 1)) / 4,
        "mis_kl": (-0.1 + 0.2) / 2 + (0.0 - 0.4) / 2,
        "mis_training_log_ppl": (0.9 + 1.2) / 2 + (1.0 + 0.6) / 2,  # -mean(train log-prob), per sample
        "mis_rollout_log_ppl": 1.0 + 1.0,
        "mis_log_ppl_abs_diff": 0.05 + 0.2,
        "mis_rejected_token_fraction": 0.0,
    }
    for key, value in expected.items():
        assert _host_metric(metrics[key], masks) == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert all(v.shape == (5,) and torch.isfinite(v).all() for v in metrics.values())  # aligned with pg_loss


# ---------------------------------------------------------- log-prob reuse, micro-batch (b)
def test_slime_log_prob_reuse_without_global_normalisation_weights_are_right():
    """slime's can_reuse_log_probs_in_loss (slime/backends/megatron_utils/actor.py:461-471: one
    optimizer step, kl_coef 0, no --get-mismatch-metrics, ...) skips the pi_old recompute
    (actor.py:473-488), so the batch has no 'log_probs' and the loss passes the training forward's
    own log-probs, detached, as train_log_probs (loss.py:985-989) — pi_old itself, since the
    parameters have not moved. The rollout-data hook (actor.py:505-506) runs on that data and, at
    micro-batch scope, does nothing; the micro-batch weights are min(r, 2) normalised by their mean
    over the loss mask: r = e^0.5, e^1, e^-0.3 -> (1.6487, 2, 0.7408) / 1.4632; the gradient reaches
    pg_loss times those weights."""
    keys = dict(use_tis=True, tis_upper_bound=2.0, tis_batch_normalize=True, length_decay_enabled=False)
    args = _args(**keys)
    pi_theta, rollout = _lp(0.5, 1.0, -0.3)
    data = {"rollout_log_probs": [rollout], "loss_masks": [torch.ones(3, dtype=torch.int32)], "total_lengths": [6],
            "response_lengths": [3]}  # no 'log_probs'
    pg = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slime.rollout_data_postprocess(args, 0, data)
        loss, masks, _ = slime.compute_mis_weights_with_cp(
            args=args, pg_loss=pg, train_log_probs=[pi_theta.detach()], rollout_log_probs=data["rollout_log_probs"],
            loss_masks=data["loss_masks"], total_lengths=data["total_lengths"], response_lengths=data["response_lengths"])
    w = [math.exp(0.5), 2.0, math.exp(-0.3)]
    mean = sum(w) / 3
    loss.backward(torch.ones(3))
    assert pg.grad.tolist() == pytest.approx([x / mean for x in w], rel=1e-6)
    assert loss.tolist() == pytest.approx([p * x / mean for p, x in zip([1.0, -2.0, 0.5], w)], rel=1e-6)
    assert masks[0].tolist() == [1, 1, 1]


@pytest.mark.parametrize("bypass", [False, True], ids=["skip-forward", "skip-forward+use-rollout-logprobs"])
def test_miles_skip_actor_forward_only_weights_are_right(bypass):
    """Miles --skip-actor-forward-only (one optimizer step; no rollout-data or before-train-step
    hook allowed: miles/utils/arguments.py:3526-3580) passes the training forward's log-probs,
    detached, as train_log_probs, with or without --use-rollout-logprobs
    (miles/backends/training_utils/loss_hub/losses.py:127-132, 249-261). Without bypass: token
    TIS weights min(r, 2) per micro-batch, r = e^0.5, e^1, e^-0.3. With --use-rollout-logprobs
    (the PPO ratio is already pi_theta / pi_rollout): weight 1, and token RS [0.5, 1.7] acts on the
    ratio of those log-probs: e^1 is rejected, e^0.5 and e^-0.3 kept."""
    keys = dict(use_tis=True, tis_upper_bound=2.0, skip_actor_forward_only=True, use_rs=True, rs_level="token",
                rs_lower_bound=0.5, rs_upper_bound=1.7 if bypass else 5.0, use_rollout_logprobs=bypass)
    pi_theta, rollout = _lp(0.5, 1.0, -0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, masks, _ = _call(_args(**keys), [pi_theta.detach()], [rollout])
    if bypass:
        assert loss.tolist() == [1.0, 0.0, 1.0] and masks[0].tolist() == [1.0, 0.0, 1.0]
    else:
        assert loss.tolist() == pytest.approx([math.exp(0.5), 2.0, math.exp(-0.3)], rel=1e-6)
        assert masks[0].tolist() == [1.0, 1.0, 1.0]


# ------------------------------------------------------------ YAML overriding CLI flags (d)
def _launch(tmp_path, cli: dict, yaml_text: str, *, inline: bool = False) -> Namespace:
    """``args`` after the host's argument parsing: the host's defaults, the command-line flags,
    then every key of ``--custom-config-path`` set on ``args`` as-is, overriding a flag of the
    same name (slime/utils/arguments.py:2013-2019; Miles miles/utils/arguments.py:3475-3480,
    whose resolve_file_arg also takes an inline ``base64:`` payload, miles/utils/file_arg_utils.py:7-11)."""
    import base64

    import yaml

    if inline:
        path = "base64:" + base64.b64encode(yaml_text.encode()).decode()
    else:
        path = str(tmp_path / "mis.yaml")
        (tmp_path / "mis.yaml").write_text(yaml_text)
    args = _args(use_tis=False, get_mismatch_metrics=False, tis_clip=2.0, tis_clip_low=0.0,
                 custom_tis_function_path="megatron_mis.compute_mis_weights_with_cp")
    for k, v in cli.items():
        setattr(args, k, v)
    args.custom_config_path = path
    for k, v in (yaml.safe_load(yaml_text) or {}).items():
        setattr(args, k, v)
    return args


def test_yaml_use_tis_false_overrides_the_use_tis_flag(tmp_path):
    """--use-tis on the command line, ``use_tis: false`` in the YAML: the YAML wins (slime
    arguments.py:2013-2019), so slime calls the function only with --get-mismatch-metrics
    (loss.py:1050) and the drop-in then reports metrics only; the YAML's RS keys are said to do
    nothing, in a warning, not silently ignored."""
    text = "use_tis: false\nuse_rs: true\nrs_level: token\nrs_lower_bound: 0.5\nrs_upper_bound: 1.5\n"
    args = _launch(tmp_path, dict(use_tis=True), text)
    assert args.use_tis is False and not (args.get_mismatch_metrics or args.use_tis)  # never called
    args = _launch(tmp_path, dict(use_tis=True, get_mismatch_metrics=True), text)
    t, r = _lp(1.0, 0.0)  # RS would reject ratio e
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, masks, _ = _call(args, [t], [r], pg=torch.tensor([2.0, 3.0]))
    assert loss.tolist() == [2.0, 3.0] and masks[0].tolist() == [1.0, 1.0]
    assert any("use_rs has no effect without use_tis" in str(w.message) and "rs_without_tis" in str(w.message)
               for w in caught)


@pytest.mark.parametrize("inline", [False, True], ids=["file", "miles-base64"])
def test_yaml_bound_flags_override_the_command_line(tmp_path, inline):
    """``--tis-clip 3.0`` on the command line, ``tis_clip: 1.5`` and ``tis_clip_low: 0.5`` in the
    YAML: args holds the YAML's values (slime arguments.py:2013-2019, Miles
    arguments.py:3475-3480) and the drop-in bounds with them (the hosts' clamp): ratios e, e^-2,
    1 -> 1.5, 0.5, 1."""
    args = _launch(tmp_path, dict(use_tis=True, tis_clip=3.0), "tis_clip: 1.5\ntis_clip_low: 0.5\n", inline=inline)
    t, r = _lp(1.0, -2.0, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _, _ = _call(args, [t], [r])
    assert loss.tolist() == pytest.approx([1.5, 0.5, 1.0])


@pytest.mark.parametrize("inline", [False, True], ids=["file", "miles-base64"])
def test_yaml_keys_that_would_be_silently_ignored_are_errors(tmp_path, inline):
    """The hosts set every YAML key on args without checking it (slime arguments.py:2013-2019,
    Miles arguments.py:3475-3480), so a misspelt MIS key would just sit there. The drop-in reads
    the file again and refuses it on the first call, naming the key and the likely one; and a
    command-line --tis-clip that disagrees with the YAML's tis_upper_bound is refused naming both
    (neither is dropped)."""
    args = _launch(tmp_path, dict(use_tis=True), "tis_upper_bund: 1.5\n", inline=inline)
    t, r = _lp(1.0)
    with pytest.raises(ConfigError, match=r"unknown MIS key 'tis_upper_bund' \(did you mean 'tis_upper_bound'\?\)"):
        _call(args, [t], [r])
    args = _launch(tmp_path, dict(use_tis=True, tis_clip=3.0), "tis_upper_bound: 1.5\n", inline=inline)
    with pytest.raises(ConfigError, match=r"tis_clip=3.0 .*tis_upper_bound=1.5 disagree"):
        _call(args, [t], [r])


def test_yaml_tis_clip_at_its_default_beside_another_upper_bound_is_an_error(tmp_path):
    """``tis_clip: 2.0`` and ``tis_upper_bound: 3.0`` in one YAML (set on args by slime
    arguments.py:2013-2019): two upper bounds that disagree. docs/hosts.md counts a YAML key as
    set when present, so this must be refused naming both (the drop-in used to take 3.0 silently,
    weight e for ratio e, because 2.0 equals the command-line default; MISConfig.from_host_args
    now counts a YAML key as set)."""
    args = _launch(tmp_path, dict(use_tis=True), "tis_clip: 2.0\ntis_upper_bound: 3.0\n")
    t, r = _lp(1.0)
    with pytest.raises(ConfigError, match=r"tis_clip=2.0 .*tis_upper_bound=3.0 disagree"):
        _call(args, [t], [r])


def test_yaml_use_tis_over_the_use_rollout_logprobs_flag_is_bypass(tmp_path):
    """slime refuses --use-rollout-logprobs with --use-tis (arguments.py:1854-1855), but that
    check runs before the YAML is applied (arguments.py:2013-2019), so ``use_tis: true`` in the
    YAML reaches the loss together with --use-rollout-logprobs: the PPO ratio is already
    pi_theta / pi_rollout, so the drop-in applies no IS weight (and says so); RS still acts."""
    args = _launch(tmp_path, dict(use_rollout_logprobs=True),
                   "use_tis: true\nuse_rs: true\nrs_level: token\nrs_lower_bound: 0.5\nrs_upper_bound: 1.5\n")
    t, r = _lp(0.3, 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, masks, _ = _call(args, [t], [r])
    assert loss.tolist() == [1.0, 0.0] and masks[0].tolist() == [1.0, 0.0]
    assert any("--use-rollout-logprobs is set" in str(w.message) for w in caught)


# ------------------------------------------------- checkpoint save with the CUDA branches run
class _UnpicklableCudaEvent:
    """Installed as ``torch.cuda.Event`` inside fake CUDA: what the CUDA branch of DeferredCount
    (core/engine.py:215-219) creates; like a real CUDA event it refuses to be pickled."""

    def __init__(self, *args, **kwargs):
        self.lock = threading.Lock()

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


def _checkpoint_args():
    return _args(use_tis=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.5, rs_upper_bound=2.0,
                 tis_upper_bound=2.0, tis_batch_normalize=True, tis_batch_normalize_scope="global",
                 rs_veto_threshold=1e-4, length_decay_enabled=True)


def _slime_job_on_the_device(args, cu):
    """A slime job's calls with every tensor moved by ``cu`` (to ``cuda:0``): the per-rollout
    hook, a bypass call, a call with a NaN rollout log-prob (a deferred count), and one more call
    that polls it. Returns (the state, the first deferred count's event, the warnings)."""
    from megatron_mis.integrations import scheduler_hooks

    t0, r0 = _lp(0.1, -0.2, 0.3)
    t1 = torch.tensor([-1.0, -1.0])
    r1 = torch.tensor([-1.0, float("nan")])
    data = {"log_probs": cu([t0, t1]), "rollout_log_probs": cu([r0, r1]),
            "loss_masks": cu([torch.ones(3), torch.ones(2)]), "total_lengths": [6, 5], "response_lengths": [3, 2]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler_hooks.host_state(args)
        tis_functions.prepare_global_normalizer(args, 0, data)
        args.use_rollout_logprobs = True  # one bypass call: its warn-once is remembered
        slime.compute_mis_weights_with_cp(args, pg_loss=cu(torch.ones(3)), train_log_probs=cu([t0]),
                                          rollout_log_probs=cu([r0]), loss_masks=cu([torch.ones(3)]),
                                          total_lengths=[6], response_lengths=[3])
        args.use_rollout_logprobs = False
        slime.compute_mis_weights_with_cp(args, pg_loss=cu(torch.ones(2)), train_log_probs=cu([t1]),
                                          rollout_log_probs=cu([r1]), loss_masks=cu([torch.ones(2)]),
                                          total_lengths=[5], response_lengths=[2])
        state = REGISTRY.peek(args)
        first_event = state.pending_nonfinite._event
        slime.compute_mis_weights_with_cp(args, pg_loss=cu(torch.ones(3)), train_log_probs=cu([t0]),
                                          rollout_log_probs=cu([r0]), loss_masks=cu([torch.ones(3)]),
                                          total_lengths=[6], response_lengths=[3])
    return state, first_event, caught


def _check_saved_unchanged(args, before, state, caught):
    assert any("1 loss-mask token(s) had NaN or inf" in str(w.message) for w in caught)  # polled via the event
    assert state.global_mean is not None and state.global_mean.mean.device.type == "cuda"
    assert state.lr is not None and state.warned
    with pytest.raises((TypeError, RuntimeError, pickle.PicklingError)):
        pickle.dumps(state.pending_nonfinite)  # on args, this would break every checkpoint
    assert vars(args) == before
    assert vars(pickle.loads(pickle.dumps(args))) == before
    buf = io.BytesIO()
    torch.save({"args": args}, buf)
    buf.seek(0)
    assert vars(torch.load(buf, weights_only=False)["args"]) == before


def test_checkpoint_save_of_args_after_the_cuda_branches_created_state():
    """The same checkpoint save (Megatron's ``state_dict['args'] = args``, torch.save) after a
    slime job's calls made on ``cuda:0`` tensors, so the CUDA branches create the state: the
    per-rollout hook's global mean (a device tensor), the deferred non-finite count (pinned host
    copy + torch.cuda.Event, core/engine.py:215-219, then polled through the event on the next
    call), bypass / veto warn-once keys and the LR hooks' state. Fake CUDA
    (megatron_mis/testing/fake_cuda.py) stands in for the GPU; torch.cuda.Event refuses pickling.
    The state is unpicklable, and args still pickles and saves unchanged."""
    from megatron_mis.testing.fake_cuda import fake_cuda, fake_cuda_unavailable_reason

    reason = fake_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"fake CUDA unavailable: {reason}")
    args = _checkpoint_args()
    before = dict(vars(args))
    with fake_cuda() as probe:
        torch.cuda.Event = _UnpicklableCudaEvent  # fake_cuda() restores the real one on exit
        state, first_event, caught = _slime_job_on_the_device(args, probe.cuda)
    assert isinstance(first_event, _UnpicklableCudaEvent)  # made by the CUDA branch, not injected
    assert isinstance(state.pending_nonfinite._event, _UnpicklableCudaEvent)
    _check_saved_unchanged(args, before, state, caught)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real torch.cuda.Event state)")
def test_checkpoint_save_of_args_after_drop_in_calls_on_a_gpu():
    """The same job on a real GPU: the deferred counts hold real ``torch.cuda.Event`` objects,
    and ``args`` still pickles and saves unchanged."""
    from torch.utils._pytree import tree_map

    args = _checkpoint_args()
    before = dict(vars(args))
    state, first_event, caught = _slime_job_on_the_device(
        args, lambda t: tree_map(lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, t))
    torch.cuda.synchronize()
    assert isinstance(first_event, torch.cuda.Event) and isinstance(state.pending_nonfinite._event, torch.cuda.Event)
    _check_saved_unchanged(args, before, state, caught)
