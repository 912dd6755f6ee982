"""The host-facing per-micro-batch entry points on fake ``cuda:0`` tensors: the slime / Miles
drop-ins at CP = 1, :func:`vocab_parallel_log_probs` (forward + backward), and
:class:`MegatronRLLoss` (``forward_step``, ``loss_func``, backward). No host synchronisation,
no CPU tensor returned for CUDA inputs."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs
from megatron_mis.testing.fake_cuda import backward, shadow

MIS_ARGS = [
    dict(use_tis=True),
    dict(use_tis=True, tis_level="sequence", tis_mode="mask", use_rs=True, rs_level="geometric"),
    dict(use_tis=False),
]


def _samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    train = [torch.randn(k, generator=g) * 0.2 - 1.0 for k in lengths]
    rollout = [t + torch.randn(t.shape, generator=g) * 0.1 for t in train]
    masks = [(torch.rand(k, generator=g) > 0.2).float() for k in lengths]
    return lengths, train, rollout, masks


@pytest.mark.parametrize("mis", MIS_ARGS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("entry", ["compute_mis_weights_fsdp", "compute_mis_weights_with_cp"])
def test_drop_in_at_cp1_has_no_host_synchronisation(probe, mis, entry):
    from megatron_mis.integrations import tis_functions

    lengths, train, rollout, masks = _samples()
    args = Namespace(custom_config_path=None, **mis)
    fn = getattr(tis_functions, entry)
    kwargs = {}
    if entry == "compute_mis_weights_with_cp":
        trivial = SimpleNamespace(size=1, rank=0, group=None)
        kwargs = dict(total_lengths=[k + 2 for k in lengths], response_lengths=lengths,
                      parallel_state=SimpleNamespace(cp=trivial, tp=trivial, intra_dp=trivial, is_pp_last_stage=True))
    pg = torch.randn(sum(lengths))
    with probe.paused():
        ref_loss, ref_masks, ref_metrics = fn(Namespace(custom_config_path=None, **mis), pg_loss=pg, train_log_probs=train,
                                              rollout_log_probs=rollout, loss_masks=masks, **kwargs)
    loss, new_masks, metrics = fn(args, pg_loss=probe.cuda(pg), train_log_probs=probe.cuda(train),
                                  rollout_log_probs=probe.cuda(rollout), loss_masks=probe.cuda(masks), **kwargs)
    probe.check_outputs([loss, new_masks, metrics])
    probe.assert_clean(what=f"{entry}({mis})")
    probe.assert_matches(loss, ref_loss)
    for a, b in zip(new_masks, ref_masks):
        probe.assert_matches(a, b)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_vocab_parallel_log_probs_forward_and_backward(probe, with_entropy):
    g = torch.Generator().manual_seed(3)
    logits_cpu = torch.randn(7, 11, generator=g).requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=g)
    with probe.paused():
        ref_lp, ref_ent = vocab_parallel_log_probs(logits_cpu, targets, with_entropy=with_entropy, chunk_size=3)
        (ref_lp.sum() + (ref_ent.sum() if with_entropy else 0)).backward()
    logits = probe.cuda(logits_cpu.detach().clone().requires_grad_())
    lp, ent = vocab_parallel_log_probs(logits, probe.cuda(targets), with_entropy=with_entropy, chunk_size=3)
    backward(lp.sum() + (ent.sum() if with_entropy else 0))
    probe.check_outputs([lp, ent, logits.grad])
    probe.assert_clean(what="vocab_parallel_log_probs forward + backward")
    torch.testing.assert_close(shadow(lp.detach()), ref_lp.detach())
    torch.testing.assert_close(shadow(logits.grad), logits_cpu.grad)


def test_vocab_parallel_log_probs_with_a_rollout_support(probe):
    """Top-p replay: the sparse support ids live on the device, the offsets on the host; the
    chunked mask is built without a read, forward and backward."""
    from megatron_mis.parallel.tp_logprobs import TokenSupport

    g = torch.Generator().manual_seed(4)
    logits_cpu = torch.randn(7, 11, generator=g).requires_grad_()
    supports = [[1, 2, 5], [], [0], [3, 4, 9, 10], [], [6, 7], [2]]
    targets = torch.tensor([2, 8, 0, 9, 1, 7, 2])
    with probe.paused():
        host = TokenSupport.from_lists(supports)
        ref_lp, ref_ent = vocab_parallel_log_probs(logits_cpu, targets, with_entropy=True, chunk_size=3, support=host)
        (ref_lp.sum() + ref_ent.sum()).backward()
    dev = TokenSupport(ids=probe.cuda(host.ids), token_index=probe.cuda(host.token_index), offsets=host.offsets)
    logits = probe.cuda(logits_cpu.detach().clone().requires_grad_())
    lp, ent = vocab_parallel_log_probs(logits, probe.cuda(targets), with_entropy=True, chunk_size=3, support=dev)
    backward(lp.sum() + ent.sum())
    probe.check_outputs([lp, ent, logits.grad])
    probe.assert_clean(what="vocab_parallel_log_probs(support=...) forward + backward")
    torch.testing.assert_close(shadow(lp.detach()), ref_lp.detach())
    torch.testing.assert_close(shadow(logits.grad), logits_cpu.grad)


class _TinyModel:
    """``logits[1, S, V] = weight[tokens]``: the smallest callable with Megatron's GPT signature
    and a parameter on the (fake) device."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def parameters(self):
        return iter([self.weight])

    def __call__(self, tokens, position_ids, attention_mask, packed_seq_params=None):
        return self.weight.index_select(0, tokens.reshape(-1))[None]


def _micro_batch(vocab: int, seed: int = 0, support: bool = False):
    from megatron_mis.integrations.rl_batch import RLMicroBatch
    from megatron_mis.parallel.tp_logprobs import TokenSupport

    g = torch.Generator().manual_seed(seed)
    prompts = torch.tensor([3, 2, 4])
    responses = torch.tensor([5, 4, 6])
    totals = prompts + responses
    num = int(responses.sum())
    old = torch.randn(num, generator=g) * 0.3 - 2.0
    tokens = torch.randint(0, vocab, (int(totals.sum()),), generator=g)
    rollout_support = None
    if support:  # top-p replay: a few ids per token (every third token untruncated)
        rollout_support = TokenSupport.from_lists([[] if t % 3 == 2 else [(5 * t) % vocab, (5 * t + 1) % vocab] for t in range(num)])
    return RLMicroBatch(
        tokens=tokens,
        rollout_support=rollout_support,
        cu_seqlens=torch.nn.functional.pad(torch.cumsum(totals, 0), (1, 0)).int(),
        response_lengths=responses,
        loss_mask=(torch.rand(num, generator=g) > 0.2).float(),
        advantages=torch.randn(num, generator=g),
        old_log_probs=old,
        rollout_log_probs=old + torch.randn(num, generator=g) * 0.1,
        ref_log_probs=old + 0.05,
    )


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loss", [dict(policy_loss="decoupled_ppo"), dict(policy_loss="ppo", use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, use_opsm=True),
                                  dict(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4, use_opsm=True),
                                  dict(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.28),
                                  dict(policy_loss="decoupled_ppo", entropy_coef=0.01, support=True),
                                  dict(policy_loss="decoupled_ppo", entropy_coef=0.01, support=True, replay_entropy="kept")],
                         ids=["decoupled_ppo", "ppo+kl+entropy+opsm", "gspo+opsm", "cispo", "decoupled_ppo+entropy+rollout_support",
                              "decoupled_ppo+kept_entropy+rollout_support"])
def test_megatron_rl_loss_step_has_no_host_synchronisation(probe, one_rank_group, loss):
    from megatron_mis import MISConfig
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.integrations.rl_metrics import reduce_metric_store

    vocab = 13
    loss = dict(loss)
    support = loss.pop("support", False)
    mbs = [_micro_batch(vocab, seed=s, support=support) for s in range(2)]
    with probe.paused():
        rl_ref = MegatronRLLoss(LossConfig(**loss), MISConfig(use_tis=True), tp_group=one_rank_group, cp_group=one_rank_group, dp_group=one_rank_group)
        den = rl_ref.count_denominators(mbs)
        w_cpu = (torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(9)) * 0.5).requires_grad_()
        model_ref = _TinyModel(w_cpu)
        step = rl_ref.forward_step(den, num_microbatches=len(mbs))
        it = iter(mbs)
        ref_store = []
        for _ in mbs:
            out, fn = step(it, model_ref)
            l, _, m = fn(out)
            l.backward()
            ref_store.append(m)
        ref_metrics = reduce_metric_store(ref_store, den, lambda b, op="sum": b)
    rl = MegatronRLLoss(LossConfig(**loss), MISConfig(use_tis=True), tp_group=one_rank_group, cp_group=one_rank_group, dp_group=one_rank_group)
    weight = probe.cuda(w_cpu.detach().clone().requires_grad_())
    step = rl.forward_step(den, num_microbatches=len(mbs))
    it = iter(mbs)  # host micro-batches, as the data iterator yields them
    store = []
    for _ in mbs:
        out, fn = step(it, _TinyModel(weight))
        l, num_tokens, m = fn(out)
        backward(l)
        probe.check_outputs([l, m])
        store.append(m)
    probe.assert_clean(what=f"MegatronRLLoss forward_step + loss_func + backward ({loss})")
    torch.testing.assert_close(shadow(weight.grad), w_cpu.grad)
    # per step: the denominators are read once, from device masks too
    probe.clear()
    dev_mbs = [dataclasses.replace(mb, loss_mask=probe.cuda(mb.loss_mask), advantages=probe.cuda(mb.advantages)) for mb in mbs]
    assert rl.count_denominators(dev_mbs) == den
    probe.assert_clean(allowed=1, what="count_denominators on device masks")
    probe.clear()
    # per step: the metrics are read once (and the deferred non-finite counts cost nothing)
    assert rl.warn_nonfinite() == 0
    metrics = reduce_metric_store(store, den, lambda b, op="sum": b)
    probe.assert_clean(allowed=1, what="reduce_metric_store")
    assert metrics.keys() == ref_metrics.keys()
    for k in metrics:
        probe.assert_metric_matches(metrics[k], ref_metrics[k], k)


def test_recompute_log_probs_and_reduce_metrics(probe, one_rank_group):
    """MegatronRLLoss.recompute_log_probs (forward-only, per micro-batch: no read) and
    reduce_metrics (per step: one read), with Megatron's parallel state initialised on one rank
    and a schedule that calls forward_step / loss_func per micro-batch as Megatron's does."""
    from megatron_mis import MISConfig
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss
    from megatron_mis.testing.distributed import megatron_parallel

    def schedule(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size, forward_only, **kw):
        store = []
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(data_iterator, model[0])
            *_, metrics = loss_func(output)
            store.append(metrics)
        return store

    vocab = 13
    mbs = [_micro_batch(vocab, seed=s) for s in range(2)]
    w = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(9))
    with megatron_parallel():
        with probe.paused():
            rl_ref = MegatronRLLoss(LossConfig(policy_loss="decoupled_ppo"), MISConfig(use_tis=True), tp_group=one_rank_group,
                                    cp_group=one_rank_group, dp_group=one_rank_group)
            ref = rl_ref.recompute_log_probs(_TinyModel(w), mbs, forward_backward_func=schedule)
            den = rl_ref.count_denominators(mbs)
            ref_store = schedule(rl_ref.forward_step(den, num_microbatches=2), iter(mbs), [_TinyModel(w)], 2, 0, 1, True)
            ref_metrics = rl_ref.reduce_metrics(ref_store, den)
        rl = MegatronRLLoss(LossConfig(policy_loss="decoupled_ppo"), MISConfig(use_tis=True), tp_group=one_rank_group,
                            cp_group=one_rank_group, dp_group=one_rank_group)
        model = _TinyModel(probe.cuda(w))
        got = rl.recompute_log_probs(model, mbs, forward_backward_func=schedule)
        probe.check_outputs(got)
        probe.assert_clean(what="recompute_log_probs")
        for a, b in zip(got, ref):
            probe.assert_matches(a, b)
        store = schedule(rl.forward_step(den, num_microbatches=2), iter(mbs), [model], 2, 0, 1, True)
        probe.clear()
        metrics = rl.reduce_metrics(store, den)
        probe.assert_clean(allowed=1, what="reduce_metrics")
    assert metrics.keys() == ref_metrics.keys()
    for k in metrics:
        probe.assert_metric_matches(metrics[k], ref_metrics[k], k)


def test_megatron_rl_loss_warns_about_nonfinite_log_probs_once_per_step(probe, one_rank_group):
    """The engine's non-finite count reaches MegatronRLLoss as a DeferredCount (no read per
    micro-batch); warn_nonfinite() (called by reduce_metrics) warns with the step's count, once."""
    from megatron_mis import MISConfig
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.aggregation import Denominators
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss

    vocab = 13
    mbs = [_micro_batch(vocab, seed=s) for s in range(2)]
    for mb in mbs:
        first = int(torch.nonzero(mb.loss_mask)[0, 0])
        mb.rollout_log_probs[first] = float("nan")  # one loss token per micro-batch
    rl = MegatronRLLoss(LossConfig(policy_loss="decoupled_ppo"), MISConfig(use_tis=True), tp_group=one_rank_group,
                        cp_group=one_rank_group, dp_group=one_rank_group)
    den = Denominators(float(sum(mb.loss_mask.sum() for mb in mbs)), 6.0)
    step = rl.forward_step(den, num_microbatches=2)
    it = iter(mbs)
    model = _TinyModel(probe.cuda(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1))))
    for _ in mbs:
        out, fn = step(it, model)
        fn(out)
    probe.assert_clean(what="loss_func with non-finite rollout log-probs")
    with pytest.warns(RuntimeWarning, match=r"2 loss-mask token\(s\) had NaN or inf"):
        assert rl.warn_nonfinite() == 2
    assert rl.warn_nonfinite() == 0  # drained: the next step starts from zero
