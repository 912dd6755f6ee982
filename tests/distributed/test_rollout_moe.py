"""The rollout engine's MoE path and rollout routing replay (R3) in the demo trainer.

- the engine records the routed experts in SGLang's layout (``[P + R - 1, num_layers, topk]``,
  compact dtype, distinct ids per row, filler on dense layers) and the SGLang wire encoding
  decodes back to the same routes;
- the fp32 engine mirrors the Megatron MoE GPT (log-probs to fp32 rounding, expert choices equal
  to the trainer's router up to near-ties), bf16 / int4 flip expert choices, and the flips counted
  by the library's agreement metric equal a count by hand;
- the demo trainer with ``routing_replay`` makes every router use the rollout's experts (100 % at
  replayed tokens) in the pi_old recompute; without it the flips are measured.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.testbed.models.gpt import GPTSpec

E, K = 8, 2
SPEC = GPTSpec(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=64,
               num_moe_experts=E, moe_router_topk=K)
EOS = 3


@pytest.fixture(scope="module")
def pool1():
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(1) as pool:
        yield pool


def _prompts(n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, SPEC.vocab_size, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(n)]


def _trainer_routes(model, sequences):
    """Teacher-forced trainer forward (packed thd): log-probs per token and the natural routes
    ``{layer: [T, k]}`` (sorted ids) of the concatenated sequences."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_mis.parallel.packing import pack_sequences

    maps = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, layer=int(m.layer_number) - 1: maps.__setitem__(layer, o[1].clone()))
             for m in model.modules() if isinstance(m, TopKRouter)]
    pack = pack_sequences(sequences)
    with torch.no_grad():
        logits = model(pack.tokens, pack.position_ids, None, packed_seq_params=pack.packed_seq_params)
    for h in hooks:
        h.remove()
    routes = {layer: m.nonzero()[:, 1].view(m.shape[0], K) for layer, m in maps.items()}
    return logits[0].float(), routes


def _engine_vs_trainer(moe_layer_freq: int):
    from megatron_mis.routing import agreement_counts, decode_routed_experts
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.testbed.demo.rollout import RolloutConfig, RolloutEngine, weights_from_megatron
    from megatron_mis.testing.distributed import megatron_parallel

    out = {}
    with megatron_parallel(seed=3):
        model = build_cpu_moe_gpt(SPEC, moe_layer_freq=moe_layer_freq)
        weights = weights_from_megatron(model)
        out["moe_layers"] = list(weights.arch.moe_layers)
        for precision in ("fp32", "bf16", "int4"):
            cfg = RolloutConfig(precision=precision, max_new_tokens=10, eos_token_id=EOS)
            batch = RolloutEngine(weights, cfg).generate(_prompts(24), generator=torch.Generator().manual_seed(1))
            logits, natural = _trainer_routes(model, batch.sequences)
            res = {"shapes_ok": True, "distinct": True, "decoded_equal": True, "dense_filler": True}
            offsets = torch.cumsum(batch.total_lengths, 0) - batch.total_lengths
            by_layer = {layer: [] for layer in natural}
            max_abs = 0.0
            for i, routes in enumerate(batch.routed_experts):
                t = int(batch.total_lengths[i])
                res["shapes_ok"] &= tuple(routes.shape) == (t - 1, SPEC.num_layers, K) and routes.dtype == torch.uint8
                res["distinct"] &= bool((routes[..., 0] != routes[..., 1]).all()) and int(routes.max()) < E
                meta = batch.sglang_meta_info(i)
                decoded = decode_routed_experts(meta, num_tokens=t, num_layers=SPEC.num_layers, topk=K, num_experts=E)
                res["decoded_equal"] &= torch.equal(decoded, routes)
                for layer in range(SPEC.num_layers):
                    if layer not in batch.moe_layers:  # dense layer: spread filler ids
                        res["dense_filler"] &= bool((routes[:, layer, 0] != routes[:, layer, 1]).all())
                off = int(offsets[i])
                for layer in natural:
                    by_layer[layer].append((routes[:, layer].long(), natural[layer][off : off + t - 1]))
                r = batch.response_lengths[i].item()
                lp = torch.log_softmax(logits[off + t - r - 1 : off + t - 1], -1).gather(-1, batch.sequences[i][t - r :, None])
                max_abs = max(max_abs, float((lp.squeeze(-1) - batch.rollout_log_probs[i]).abs().max()))
            flips_lib, flips_hand, pairs = 0.0, 0, 0
            for layer, items in by_layer.items():
                rollout = torch.cat([a for a, _ in items])
                trainer = torch.cat([b for _, b in items])
                s, c = agreement_counts(rollout, trainer).tolist()
                flips_lib += (c - s) * K  # experts not chosen by the trainer
                for a, b in zip(rollout.tolist(), trainer.tolist()):
                    flips_hand += len(set(a) - set(b))
                pairs += rollout.shape[0]
            res.update(max_abs=max_abs, flips_lib=round(flips_lib), flips_hand=flips_hand, pairs=pairs,
                       num_sequences=batch.num_sequences)
            out[precision] = res
    return out


@pytest.mark.parametrize("moe_layer_freq", [1, 2])
def test_moe_rollout_records_sglang_routes_and_flips_are_counted(pool1, moe_layer_freq):
    (res,) = pool1.run(_engine_vs_trainer, moe_layer_freq)
    assert res["moe_layers"] == ([0, 1] if moe_layer_freq == 1 else [0])
    for precision in ("fp32", "bf16", "int4"):
        r = res[precision]
        assert r["shapes_ok"] and r["distinct"] and r["decoded_equal"] and r["dense_filler"], (precision, r)
        assert r["flips_lib"] == r["flips_hand"], precision  # the library's agreement counts the same flips
    # fp32: the engine mirrors the trainer (fp32 rounding; measured max |diff| ~1e-6) and routes
    # like it except at exact near-ties (measured: no flip)
    assert res["fp32"]["max_abs"] < 1e-5
    assert res["fp32"]["flips_hand"] <= 1
    # bf16 / int4: a real numeric mismatch; int4 flips expert choices
    assert res["bf16"]["max_abs"] > 1e-4 and res["int4"]["max_abs"] > 1e-3
    assert res["int4"]["flips_hand"] > res["fp32"]["flips_hand"]


def test_r3_replay_in_trainer_single_process(tmp_path):
    from megatron_mis.testbed.demo.launch import _run_in_group
    from megatron_mis.testbed.demo.config import DemoConfig

    records = {}
    for replay in (True, False):
        cfg = DemoConfig(
            steps=2, prompts_per_step=4, samples_per_prompt=4, micro_batch_size=8, updates_per_step=2,
            rollout_precision="int4", num_moe_experts=E, moe_router_topk=K, routing_replay=replay,
            correction="token_tis", out_dir=str(tmp_path), name=f"r3-{replay}", progress=False, plot=False, threads=1,
        )
        (result,) = _run_in_group(cfg, 0, 1, str(tmp_path / f"store-{replay}"))
        records[replay] = result.records
        lines = [json.loads(x) for x in (tmp_path / cfg.name / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2
    for rec in records[True]:
        # every router used exactly the rollout's experts at every token with a rollout route
        assert rec["route_replay_match"] == 1.0
        assert 0.0 <= rec["route_flip_fraction"] <= 1.0
        assert rec["route_agreement"] == pytest.approx(1.0 - rec["route_flip_fraction"])
    for rec in records[False]:
        assert "route_replay_match" not in rec
        assert 0.0 <= rec["route_tokens_flipped"] <= 1.0 and 0.0 <= rec["route_flip_fraction"] <= rec["route_tokens_flipped"]
    # same seed, same first rollout (step 1), but not the same flip count: with replay the deeper
    # routers see the hidden states produced by the replayed experts of the layers before
    assert records[True][0]["reward_mean"] == records[False][0]["reward_mean"]
    # replaying the rollout's experts brings the trainer's pi_old closer to the rollout's log-probs
    assert records[True][0]["mis_k3_kl"] < records[False][0]["mis_k3_kl"]


def test_moe_config_errors():
    from megatron_mis.testbed.demo.config import DemoConfig

    with pytest.raises(ConfigError) as e:
        DemoConfig(routing_replay=True, num_moe_experts=None)
    assert "routing_replay=True needs an MoE model" in str(e.value)
    with pytest.raises(ConfigError) as e:
        DemoConfig(num_moe_experts=4, moe_router_topk=5, tp=2, true_on_policy=True)
    text = str(e.value)
    assert "moe_router_topk=5" in text and "tp=2" in text and "true_on_policy with num_moe_experts" in text


def _router_noise_flips():
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.testbed.demo.rollout import RolloutConfig, RolloutEngine, weights_from_megatron
    from megatron_mis.testing.distributed import megatron_parallel

    out = {}
    with megatron_parallel(seed=3):
        model = build_cpu_moe_gpt(SPEC, moe_layer_freq=1)
        weights = weights_from_megatron(model)
        batches = {}
        for sigma in (None, 0.0, 0.1, 0.5):
            cfg = RolloutConfig(precision="fp32", max_new_tokens=10, eos_token_id=EOS,
                                **({} if sigma is None else {"router_noise": sigma}))
            batches[sigma] = RolloutEngine(weights, cfg).generate(_prompts(24), generator=torch.Generator().manual_seed(1))
        for sigma, batch in batches.items():
            _, natural = _trainer_routes(model, batch.sequences)
            offsets = torch.cumsum(batch.total_lengths, 0) - batch.total_lengths
            flips = pairs = 0
            for i, routes in enumerate(batch.routed_experts):
                t, off = int(batch.total_lengths[i]), int(offsets[i])
                for layer in natural:
                    for a, b in zip(routes[:, layer].tolist(), natural[layer][off: off + t - 1].tolist()):
                        flips += len(set(a) - set(b))
                        pairs += K
            out[sigma] = flips / pairs
        out["same_at_zero"] = all(torch.equal(a, b) for a, b in zip(batches[None].sequences, batches[0.0].sequences)) and all(
            torch.equal(a, b) for a, b in zip(batches[None].rollout_log_probs, batches[0.0].rollout_log_probs))
    return out


def test_router_noise_flips_expert_choices_at_a_rate_that_grows_with_it(pool1):
    """rollout router noise (the moe-noise sweep's dose): 0 is exactly the noiseless engine (same
    tokens, log-probs, no generator draw), and the share of the rollout's experts the fp32 trainer
    would not choose grows with sigma (fp32 rollouts: the noise is the only routing mismatch)."""
    (res,) = pool1.run(_router_noise_flips)
    assert res["same_at_zero"]
    assert res[None] == res[0.0] <= 0.01
    assert res[0.0] < res[0.1] < res[0.5], res
    assert res[0.1] > 0.02 and res[0.5] > 0.15, res


def test_r3_removes_the_router_noise_mismatch(tmp_path):
    """With fp32 rollouts and router noise, R3 (the trainer replays the rollout's experts) leaves
    only fp32 rounding between pi_old and the rollout; without it the flips show in K3."""
    from megatron_mis.testbed.demo.launch import _run_in_group
    from megatron_mis.testbed.demo.config import DemoConfig

    k3 = {}
    for replay in (True, False):
        cfg = DemoConfig(
            steps=2, prompts_per_step=4, samples_per_prompt=4, micro_batch_size=8, rollout_precision="fp32",
            num_moe_experts=E, moe_router_topk=K, routing_replay=replay, rollout_router_noise=0.5,
            correction="none", out_dir=str(tmp_path), name=f"noise-{replay}", progress=False, plot=False, threads=1,
        )
        (result,) = _run_in_group(cfg, 0, 1, str(tmp_path / f"store-{replay}"))
        k3[replay] = [rec["mis_k3_kl"] for rec in result.records]
        flips = [rec["route_flip_fraction"] for rec in result.records]
        assert all(f > 0.05 for f in flips), flips  # the rollout's choices differ from the trainer's own
    assert max(k3[True]) < 1e-9 < 1e-5 < min(k3[False]), k3
    with pytest.raises(ConfigError, match="rollout_router_noise=0.1 needs an MoE model"):
        DemoConfig(rollout_router_noise=0.1)
    with pytest.raises(ConfigError, match=r"rollout_router_noise=-1.0 must lie in \[0, 10\]"):
        DemoConfig(rollout_router_noise=-1.0, num_moe_experts=E)
