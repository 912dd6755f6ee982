"""The baseline for ``bench_mis.py``: the same MIS semantics and the same full set of metrics,
written the way per-sequence implementations in RL frameworks are (a Python loop over sequences,
torch ops inside, boolean indexing and ``.item()`` per sequence). ``tests/e2e/test_bench_reference.py``
checks that it produces the engine's weights, masks and every token metric, so the benchmark
compares equal work.
"""

from __future__ import annotations

import math

import torch


def _mean(x: torch.Tensor, m: torch.Tensor) -> float:
    n = int(m.sum().item())
    return float(x[m].double().sum().item()) / n if n else 0.0


def naive_mis(train_list, rollout_list, mask_list, cfg):
    """Returns ``(weights list, keep list, token_metrics dict of per-sequence lists)``."""
    bound = cfg.log_ratio_bound
    lo, hi = cfg.tis_lower, cfg.tis_upper_bound
    rs_lo, rs_hi = cfg.rs_lower, cfg.rs_upper
    per_seq = []
    for train, rollout, mask in zip(train_list, rollout_list, mask_list):
        train, rollout = train.float(), rollout.float()
        m = mask != 0
        finite = torch.isfinite(train) & torch.isfinite(rollout)
        valid = m & finite
        zero = torch.zeros_like(train)
        log_r = torch.where(valid, train - rollout, zero)
        lrc = log_r.clamp(-bound, bound)
        r = torch.exp(lrc)
        n_valid = int(valid.sum().item())
        s = float(log_r[valid].double().sum().item()) if n_valid else 0.0
        seq_log = max(-bound, min(bound, s))
        geo_log = max(-bound, min(bound, s / n_valid)) if n_valid else 0.0
        level_log = {"sequence": seq_log, "geometric": geo_log}
        tok_rej = torch.zeros_like(m)
        seq_rej = False
        met: dict[str, torch.Tensor] = {}
        full = lambda v: torch.full_like(r, float(v))  # noqa: E731
        w = torch.ones_like(r)
        if cfg.use_tis:
            if cfg.tis_level == "token":
                w_unb = r
                low, high = valid & (w_unb < lo), valid & (w_unb > hi)
            else:
                wu = math.exp(level_log[cfg.tis_level])
                w_unb = full(wu)
                low, high = full(n_valid > 0 and wu < lo), full(n_valid > 0 and wu > hi)
            if cfg.tis_mode == "truncate":
                w = w_unb.clamp(max=hi)
                met["mis_tis_truncate_fraction"] = high.float()
            elif cfg.tis_mode == "clip":
                w = w_unb.clamp(lo, hi)
                met["mis_tis_clip_fraction_low"], met["mis_tis_clip_fraction_high"] = low.float(), high.float()
            else:
                outside = (w_unb < lo) | (w_unb > hi)
                w = torch.where(outside, zero, w_unb)
                met["mis_tis_mask_fraction_low"], met["mis_tis_mask_fraction_high"] = low.float(), high.float()
                if cfg.tis_level == "token":
                    tok_rej |= valid & outside
                elif n_valid and bool(outside[0].item() if outside.numel() else False):
                    seq_rej = True
            met["mis_tis_weight_before_bound"] = w_unb * valid if cfg.tis_level == "token" else w_unb
            # the hosts' definition: bounded weight, the raw one in mask mode, over loss-mask tokens
            host = w_unb if cfg.tis_mode == "mask" else w
            met["mis_tis_weight_after_bound"] = torch.where(m, host, zero) if cfg.tis_level == "token" else host.clone()
            met["mis_is_ratio_mean_after_tis_rs"] = met["mis_tis_weight_after_bound"].clone()
        if cfg.use_rs:
            if cfg.rs_level == "token":
                rl, rh = valid & (r < rs_lo), valid & (r > rs_hi)
                tok_rej |= rl | rh
                met["mis_rs_mask_fraction_low"], met["mis_rs_mask_fraction_high"] = rl.float(), rh.float()
            else:
                ratio = math.exp(level_log[cfg.rs_level])
                rl, rh = n_valid > 0 and ratio < rs_lo, n_valid > 0 and ratio > rs_hi
                seq_rej |= rl or rh
                met["mis_rs_mask_fraction_low"], met["mis_rs_mask_fraction_high"] = full(rl), full(rh)
        if cfg.rs_veto_threshold is not None:
            cat = valid & (log_r < math.log(cfg.rs_veto_threshold))
            vetoed = bool(cat.any().item())
            seq_rej |= vetoed
            met["mis_rs_catastrophic_token_fraction"] = cat.float()
            met["mis_rs_catastrophic_seq_fraction"] = full(vetoed)
        tok_kept = m & ~tok_rej
        keep = tok_kept & (not seq_rej)
        # mismatch metrics, per-sequence means expanded over the tokens
        tm, rm = _mean(train, valid), _mean(rollout, valid)
        met.update({
            "mis_training_log_ppl": full(-tm),
            "mis_training_ppl": full(math.exp(-tm)),
            "mis_rollout_log_ppl": full(-rm),
            "mis_rollout_ppl": full(math.exp(-rm)),
            "mis_kl": -log_r,
            "mis_k3_kl": torch.where(valid, r - 1 - lrc, zero),
            "mis_log_ppl_diff": full(rm - tm),
            "mis_log_ppl_abs_diff": full(abs(rm - tm)),
            "mis_ppl_ratio": full(math.exp(rm - tm)),
            "mis_chi2_token": full(_mean(r * r, valid) - 1 if n_valid else 0.0),
            "mis_chi2_seq": full(math.exp(2 * seq_log) - 1 if n_valid else 0.0),
            "mis_tv": torch.where(valid, 0.5 * (r - 1).abs(), zero),
            "mis_nonfinite_token_fraction": (m & ~finite).float(),
        })
        per_seq.append(dict(w=w, r=r, valid=valid, m=m, keep=keep, tok_kept=tok_kept, seq_rej=seq_rej,
                            seq_log=seq_log, n_valid=n_valid, met=met,
                            host=(w_unb if cfg.tis_mode == "mask" else w) if cfg.use_tis else None))

    # batch-level quantities: a second pass over the sequences
    norm = 1.0
    if cfg.use_tis and cfg.tis_batch_normalize:
        if cfg.tis_level == "token":
            total = sum(float(p["w"][p["keep"]].double().sum().item()) for p in per_seq)
            count = sum(int(p["keep"].sum().item()) for p in per_seq)
        else:
            kept = [p for p in per_seq if (not p["seq_rej"]) and bool(p["tok_kept"].any().item())]
            total = sum(float(p["w"][0].item()) for p in kept)
            count = len(kept)
        norm = total / count if count else 1.0
    sum_r = sum(float(p["r"][p["valid"]].double().sum().item()) for p in per_seq)
    sum_r2 = sum(float((p["r"][p["valid"]].double() ** 2).sum().item()) for p in per_seq)
    nv = sum(p["n_valid"] for p in per_seq)
    ess_token = sum_r**2 / (nv * sum_r2) if nv else 1.0
    sw = [math.exp(p["seq_log"]) for p in per_seq if p["n_valid"]]
    ess_seq = sum(sw) ** 2 / (len(sw) * sum(x * x for x in sw)) if sw else 1.0

    weights, keeps = [], []
    metrics: dict[str, list[torch.Tensor]] = {}
    for p in per_seq:
        if cfg.use_tis:
            wf = torch.where(p["keep"], p["w"] / norm, torch.zeros_like(p["w"]))
        else:
            wf = p["keep"].float()
        weights.append(wf)
        keeps.append(p["keep"])
        met = p["met"]
        full = lambda v, ref=p["r"]: torch.full_like(ref, float(v))  # noqa: E731
        kept_any = (not p["seq_rej"]) and bool(p["tok_kept"].any().item())
        if cfg.use_tis:  # the hosts' definition: over every loss-mask token of the after-bound weight
            hw = p["host"][p["m"]].double() / norm
            any_m = hw.numel() > 0
            met["mis_is_ratio_mean_final"] = full(float(hw.mean().item()) if any_m else 0.0)
            met["mis_is_ratio_min_final"] = full(float(hw.min().item()) if any_m else 0.0)
            met["mis_is_ratio_max_final"] = full(float(hw.max().item()) if any_m else 0.0)
        met["mis_rejected_token_fraction"] = (p["m"] & ~p["keep"]).float()
        met["mis_rejected_seq_fraction"] = full(bool(p["m"].any().item()) and not kept_any)
        met["mis_ess_token"] = full(ess_token)
        met["mis_ess_seq"] = full(ess_seq)
        if cfg.use_tis and cfg.tis_batch_normalize:
            met["mis_batch_norm_factor"] = full(norm)
        for k, v in met.items():
            metrics.setdefault(k, []).append(v)
    return weights, keeps, metrics
