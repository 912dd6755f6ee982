"""The rollout engine against the Megatron trainer: fp32 log-probs agree to fp32 rounding,
bf16 / fp16 / int8 give a real mismatch, and the true-on-policy path is bitwise identical to the
trainer's recompute under TP=1 and TP=2."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.testbed.demo.rollout import RolloutConfig, _filter, quantize_int4_per_channel, quantize_int8_per_channel
from megatron_mis.testbed.models.gpt import GPTSpec

SPEC = GPTSpec(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, max_sequence_length=64)
EOS = 3


def _prompts(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, SPEC.vocab_size, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(n)]


def _model(tp: int, gated: bool):
    """A GPT with nonzero biases (the default init leaves them 0), identical on every rank."""
    import torch.nn.functional as F

    from megatron_mis.testbed.models.gpt import build_gpt

    kwargs = dict(gated_linear_unit=True, activation_func=F.silu) if gated else {}
    model = build_gpt(SPEC, **kwargs)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _k3(train: torch.Tensor, rollout: torch.Tensor) -> float:
    log_r = (train - rollout).double()
    return float((log_r.exp() - 1 - log_r).mean())


def _engine_vs_trainer(tp: int, precisions: list[str], gated: bool, temperature: float):
    from megatron.core import parallel_state as ps

    from megatron_mis.testbed.demo.rollout import RolloutEngine, weights_from_megatron
    from megatron_mis.testbed.demo.scoring import trainer_log_probs
    from megatron_mis.parallel.packing import pack_sequences
    from megatron_mis.testing.distributed import megatron_parallel

    out = {}
    with megatron_parallel(tp=tp, seed=3):
        tp_group = ps.get_tensor_model_parallel_group()
        model = _model(tp, gated)
        weights = weights_from_megatron(model, tp_group=tp_group)
        for precision in precisions:
            cfg = RolloutConfig(precision=precision, max_new_tokens=12, eos_token_id=EOS, temperature=temperature)
            # 16 prompts x 12 tokens of a near-uniform policy over 32 ids: some responses end
            # with EOS, some hit the cap (a sequence finishes with probability ~0.3)
            batch = RolloutEngine(weights, cfg).generate(_prompts(16), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                train = trainer_log_probs(
                    model, pack_sequences(batch.sequences), batch.response_lengths, tp_group=tp_group, temperature=temperature
                )
            t, r = torch.cat(train), torch.cat(batch.rollout_log_probs)
            out[precision] = dict(
                max_abs=float((t - r).abs().max()),
                k3=_k3(t, r),
                lengths=batch.response_lengths.tolist(),
                finished=batch.finished.tolist(),
                responses=[x.tolist() for x in batch.responses],
                num_tokens=t.numel(),
            )
    return out


@pytest.mark.parametrize("tp, gated, temperature", [(1, False, 1.0), (2, False, 0.7), (2, True, 1.0)])
def test_fp32_rollout_matches_trainer_and_low_precision_does_not(pool2, tp, gated, temperature):
    results = pool2.run(_engine_vs_trainer, tp, ["fp32", "bf16", "fp16", "int8", "int4"], gated, temperature)
    assert results[0] == results[1]  # the engine is replicated on both ranks
    res = results[0]
    fp32 = res["fp32"]
    # Same weights, different kernels and shapes (KV-cache decode vs full forward): fp32 rounding
    # only (measured 4.8e-7 max on log-probs of magnitude ~3, K3 ~6e-15).
    assert fp32["max_abs"] < 5e-6
    assert fp32["k3"] < 1e-12
    for precision in ("bf16", "fp16", "int8", "int4"):
        # a real mismatch, orders of magnitude above fp32 rounding (measured max |diff| 1.9e-4
        # (fp16) .. 3.6e-3 (int8), K3 1.8e-9 (fp16) .. 5e-7 (int8))
        assert res[precision]["max_abs"] > 5e-5, precision
        assert res[precision]["k3"] > 1e-10 and res[precision]["k3"] > 100 * fp32["k3"], precision
    # 4-bit weights (15 levels) against 8-bit (255): a quantisation step 17x coarser, a far larger K3
    assert res["int4"]["k3"] > 10 * res["int8"]["k3"]
    # EOS handling: finished responses end with EOS and contain no other, the rest hit the cap
    for resp, done in zip(fp32["responses"], fp32["finished"]):
        if done:
            assert resp[-1] == EOS and EOS not in resp[:-1]
        else:
            assert len(resp) == 12 and EOS not in resp
    assert any(fp32["finished"])
    assert not all(fp32["finished"])


def _aligned_vs_trainer(tp: int, micro_batch_size: int | None, gated: bool):
    from megatron.core import parallel_state as ps

    from megatron_mis.core.bitwise import compare_log_probs
    from megatron_mis.testbed.demo.rollout import RolloutEngine
    from megatron_mis.testbed.demo.scoring import trainer_log_probs
    from megatron_mis.parallel.packing import pack_sequences
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=tp, seed=4):
        tp_group = ps.get_tensor_model_parallel_group()
        model = _model(tp, gated)
        cfg = RolloutConfig(
            precision="fp32", true_on_policy=True, max_new_tokens=6, eos_token_id=EOS, micro_batch_size=micro_batch_size
        )
        engine = RolloutEngine.from_megatron(model, cfg, tp_group=tp_group)
        batch = engine.generate(_prompts(7), generator=torch.Generator().manual_seed(2))
        train = []
        with torch.no_grad():
            for mb in batch.micro_batches():
                seqs = [batch.sequences[i] for i in mb]
                packed = pack_sequences(seqs, slot_length=batch.slot_length)
                train += trainer_log_probs(model, packed, batch.response_lengths[list(mb)], tp_group=tp_group)
        exact = [torch.equal(a, b) for a, b in zip(train, batch.rollout_log_probs)]
        report = compare_log_probs(train, batch.rollout_log_probs)
        # the fast fp32 path on the same tokens is close but (generally) not bitwise equal
        fast = RolloutEngine(engine.weights, RolloutConfig(precision="fp32"))
        fast_lp = fast.score(batch.sequences, batch.response_lengths)
        fast_report = compare_log_probs(train, fast_lp)
        scored = engine.score(batch.sequences, batch.response_lengths, slot_length=batch.slot_length)
        return exact, report.to_dict(), fast_report.to_dict(), [torch.equal(a, b) for a, b in zip(train, scored)]


@pytest.mark.parametrize("tp, micro_batch_size, gated", [(1, None, False), (2, None, False), (2, 3, True)])
def test_true_on_policy_is_bitwise_equal_to_trainer(pool2, tp, micro_batch_size, gated):
    for exact, report, fast_report, scored in pool2.run(_aligned_vs_trainer, tp, micro_batch_size, gated):
        assert all(exact) and len(exact) == 7
        assert report["bitwise_equal"] and report["max_abs_diff"] == 0.0 and report["num_tokens"] > 0
        assert all(scored)
        assert not fast_report["bitwise_equal"] and fast_report["max_abs_diff"] < 5e-6


def _unsupported():
    from megatron_mis.testbed.demo.rollout import weights_from_megatron
    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=1, seed=1):
        model = build_gpt(SPEC, rotary_interleaved=True)
        try:
            weights_from_megatron(model)
        except ValueError as e:
            return str(e)
    return None


def test_unsupported_model_is_rejected(pool2):
    assert all(m is not None and "rotary_interleaved=True is not supported" in m for m in pool2.run(_unsupported))


def test_config_validation():
    with pytest.raises(ConfigError) as e:
        RolloutConfig(precision="bf16", true_on_policy=True, temperature=0.0, top_p=1.5, max_new_tokens=0)
    text = str(e.value)
    for part in ("needs precision='fp32'", "temperature=0.0", "top_p=1.5", "max_new_tokens=0"):
        assert part in text
    with pytest.raises(ConfigError, match="one of 'fp32', 'bf16', 'fp16', 'int8'"):
        RolloutConfig(precision="fp8")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        RolloutConfig(micro_batch_size=4)
    assert any("no effect" in str(x.message) for x in w)


def test_int4_quantisation_hand_values():
    w = torch.tensor([[1.2, -2.0, 0.5, 0.1], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_int4_per_channel(w)
    assert q.dtype == torch.int8 and scale.tolist() == pytest.approx([2 / 7, 1.0])
    # 1.2 / (2/7) = 4.2 -> 4; 0.5 / (2/7) = 1.75 -> 2; 0.1 / (2/7) = 0.35 -> 0
    assert q.tolist() == [[4, -7, 2, 0], [0, 0, 0, 0]]
    assert int(q.abs().max()) <= 7


def test_int8_quantisation_hand_values():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.tolist() == pytest.approx([2 / 127, 1.0])
    # 1 / (2/127) = 63.5 rounds half to even -> 64; 0.5 / (2/127) = 31.75 -> 32
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


def test_top_k_top_p_filtering():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(_filter(logp, 2, 1.0)).tolist() == [[True, True, False, False]]
    # nucleus 0.75: 0.5 + 0.3 reaches it, the rest goes
    assert torch.isfinite(_filter(logp, 0, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter(logp, 0, 0.79)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter(logp, 0, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(_filter(logp, 0, 0.1)).tolist() == [[True, False, False, False]]
    # exactly at the boundary: the two most likely tokens hold exactly top_p (the same float32
    # arithmetic as the filter), the smallest set reaching top_p is those two
    probs = logp.softmax(-1)
    exact = float((probs.cumsum(-1) - probs)[0, 2])
    assert torch.isfinite(_filter(logp, 0, exact)).tolist() == [[True, True, False, False]]


def test_shard_log_probs_single_rank_equal_the_trainer_function_bitwise():
    """TP = 1: log_probs_from_shards is vocab_parallel_log_probs' code; the full log-softmax it
    samples from agrees with it at every target, bit for bit, for any chunking of the rows."""
    from megatron_mis.parallel.tp_logprobs import log_probs_from_shards, log_softmax_from_shards, vocab_parallel_log_probs

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(37, 11, generator=g)
    labels = torch.randint(0, 11, (37,), generator=g)
    ours = log_probs_from_shards([logits], labels, temperature=0.7)
    full = log_softmax_from_shards([logits], temperature=0.7)
    assert torch.equal(full.gather(-1, labels[:, None]).squeeze(-1), ours)
    for chunk in (-1, 1, 5, 1024):
        ref, _ = vocab_parallel_log_probs(logits, labels, temperature=0.7, chunk_size=chunk)
        assert torch.equal(ours, ref), chunk
    # rows computed alone or in another batch: the same bits (what the engine relies on)
    assert torch.equal(log_probs_from_shards([logits[5:9]], labels[5:9], temperature=0.7), ours[5:9])
    torch.testing.assert_close(ours, torch.log_softmax(logits / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="temperature=0"):
        log_probs_from_shards([logits], labels, temperature=0)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 11\)"):
        log_probs_from_shards([logits], labels + 11)


def _vocab_parallel_tp2():
    import torch.distributed as dist

    from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs

    g = torch.Generator().manual_seed(1)
    full = torch.randn(9, 16, generator=g)
    labels = torch.randint(0, 16, (9,), generator=g)
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    shard = full[:, rank * 8 : (rank + 1) * 8].clone()
    return [vocab_parallel_log_probs(shard, labels, group=group, temperature=1.3, chunk_size=c)[0] for c in (-1, 4)]


def test_shard_log_probs_equal_tp2_all_reduce_bitwise(pool2):
    from megatron_mis.parallel.tp_logprobs import log_probs_from_shards, log_softmax_from_shards

    g = torch.Generator().manual_seed(1)
    full = torch.randn(9, 16, generator=g)
    labels = torch.randint(0, 16, (9,), generator=g)
    shards = [full[:, :8], full[:, 8:]]
    ours = log_probs_from_shards(shards, labels, temperature=1.3)
    assert torch.equal(log_softmax_from_shards(shards, temperature=1.3).gather(-1, labels[:, None]).squeeze(-1), ours)
    for rank_results in pool2.run(_vocab_parallel_tp2):
        for lp in rank_results:
            assert torch.equal(lp, ours)
