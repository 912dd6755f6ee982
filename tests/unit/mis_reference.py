"""A deliberately naive, per-sequence, per-token reference of the MIS semantics (plain Python
loops over floats). It shares no code with ``megatron_mis.core`` — only the specification:

- valid token: in the loss mask with finite train and rollout log-probs;
- log r = train - rollout on valid tokens (0 elsewhere), clamped to +-bound before exp;
- token IS / RS decisions use the clamped per-token ratio; the ratio veto compares the raw
  log r with log(threshold); the probability veto compares the raw log-prob of the chosen source;
- sequence / geometric IS and RS use exp(clamp(sum)) / exp(clamp(sum / n_valid)) of raw log r;
- self-normalisation divides by the mean bounded weight over kept tokens (token level) or kept
  sequences (sequence / geometric level);
- icepop (token level): weight 0 outside [L, U], the token stays kept;
- divergence criteria (``rs_criteria`` under ``use_rs``, in place of the ratio band): per token
  k1 = -log r (a ratio band on r, over loss-mask tokens, ratio 1 where non-finite), k2 = (log r)^2 / 2,
  k3 = r - 1 - log r of the clamped log r (float64 here); per sequence the sum / mean (over valid
  tokens) / max of k2, k3, and for k1 the sequence / geometric ratio; ``seq_zscore_k1`` rejects a
  sequence of n valid tokens whose mean log r (the clamped geometric log-ratio) lies more than
  z * sqrt(2 K / n) from -K, K fixed or (``batch``) the mean k3 over every valid token of the call,
  at least 1e-8.

Per-token ratios are evaluated in float32 exactly like an fp32 implementation would (via torch on
single values), so accept / reject decisions never differ by rounding; every sum is a Python
float (double) sum.
"""

from __future__ import annotations

import math

import torch


def _f32_exp(x: float) -> float:
    return float(torch.exp(torch.tensor(x, dtype=torch.float32)))


def _f32_sub(a: float, b: float) -> float:
    return float(torch.tensor(a, dtype=torch.float32) - torch.tensor(b, dtype=torch.float32))


def reference_mis(train, rollout, masks, cfg):
    """Returns a dict with per-sequence lists ``weights``, ``keep`` and batch ``metrics``."""
    B = cfg.log_ratio_bound
    L, U = cfg.tis_lower, cfg.tis_upper_bound
    rl, ru = cfg.rs_lower, cfg.rs_upper
    band = cfg.use_rs and not cfg.rs_criteria  # the ratio band at rs_level
    criteria = [(b.name, b.lower, b.upper) for b in cfg.rs_bounds()]
    seqs = []
    for a_seq, b_seq, m_seq in zip(train, rollout, masks):
        toks = []
        for a, b, m in zip(a_seq.tolist(), b_seq.tolist(), m_seq.tolist()):
            m = m != 0
            finite = math.isfinite(a) and math.isfinite(b)
            valid = m and finite
            raw = _f32_sub(a, b) if valid else 0.0
            lrc = max(-B, min(B, raw))
            r = _f32_exp(lrc)
            k2 = 0.5 * lrc * lrc if valid else 0.0
            k3 = math.expm1(lrc) - lrc if valid else 0.0
            toks.append(dict(m=m, valid=valid, nonfinite=m and not finite, raw=raw, lrc=lrc, r=r, a=a, b=b, k2=k2, k3=k3))
        seqs.append(toks)

    all_valid = [t for toks in seqs for t in toks if t["valid"]]
    batch_k3 = max(sum(t["k3"] for t in all_valid) / max(len(all_valid), 1), 1e-8)
    out_weights, out_keep = [], []
    seq_info = []
    for toks in seqs:
        n_valid = sum(t["valid"] for t in toks)
        s = sum(t["raw"] for t in toks if t["valid"])
        seq_log = max(-B, min(B, s))
        geo_log = max(-B, min(B, s / n_valid if n_valid else 0.0))
        level_log = {"sequence": seq_log, "geometric": geo_log}
        seq_rej = False
        w_seq_unb = w_seq = None
        if cfg.use_tis and cfg.tis_level != "token":
            w_seq_unb = math.exp(level_log[cfg.tis_level])
            if cfg.tis_mode == "truncate":
                w_seq = min(w_seq_unb, U)
            elif cfg.tis_mode == "clip":
                w_seq = min(max(w_seq_unb, L), U)
            else:
                inside = L <= w_seq_unb <= U
                w_seq = w_seq_unb if inside else 0.0
                if n_valid and not inside:
                    seq_rej = True
        failed = {}
        for name, lo, hi in criteria:
            reduce, k = name.rsplit("_k", 1)
            if reduce == "token":
                continue
            if not n_valid:
                failed[name] = False
            elif reduce == "seq_zscore":
                ref_k3 = batch_k3 if lo == 0.0 else lo
                failed[name] = abs(geo_log + ref_k3) > hi * math.sqrt(2.0 * ref_k3 / n_valid)
            elif k == "1":
                ratio = math.exp(seq_log if reduce == "seq_sum" else geo_log)
                failed[name] = ratio < lo or ratio > hi
            else:
                vals = [t["k" + k] for t in toks if t["valid"]]
                value = {"seq_sum": sum(vals), "seq_mean": sum(vals) / len(vals), "seq_max": max(vals)}[reduce]
                failed[name] = value > hi
            seq_rej = seq_rej or failed[name]
        if band and cfg.rs_level != "token" and n_valid:
            ratio = math.exp(level_log[cfg.rs_level])
            if ratio < rl or ratio > ru:
                seq_rej = True
        if cfg.rs_veto_threshold is not None:
            if any(t["valid"] and t["raw"] < math.log(cfg.rs_veto_threshold) for t in toks):
                seq_rej = True
        if cfg.prob_veto_threshold is not None:
            key = "b" if cfg.prob_veto_source == "rollout" else "a"
            if any(t["m"] and t[key] < math.log(cfg.prob_veto_threshold) for t in toks):
                seq_rej = True
        for t in toks:
            tok_rej = False
            if cfg.nonfinite_policy == "reject" and t["nonfinite"]:
                tok_rej = True
            t["w"] = None
            if cfg.use_tis and cfg.tis_level == "token":
                w = t["r"]
                if cfg.tis_mode == "truncate":
                    t["w"] = min(w, U)
                elif cfg.tis_mode == "clip":
                    t["w"] = min(max(w, L), U)
                else:  # mask / icepop
                    inside = L <= w <= U
                    t["w"] = w if inside else 0.0
                    if cfg.tis_mode == "mask" and t["valid"] and not inside:
                        tok_rej = True
            if band and cfg.rs_level == "token" and t["valid"] and (t["r"] < rl or t["r"] > ru):
                tok_rej = True
            t["failed"] = {}
            for name, lo, hi in criteria:
                if name == "token_k1":
                    t["failed"][name] = t["m"] and (t["r"] < lo or t["r"] > hi)
                elif name in ("token_k2", "token_k3"):
                    t["failed"][name] = t["valid"] and t["k" + name[-1]] > hi
                else:
                    continue
                tok_rej = tok_rej or t["failed"][name]
            t["tok_kept"] = t["m"] and not tok_rej
            t["keep"] = t["tok_kept"] and not seq_rej
        kept_seq = (not seq_rej) and any(t["tok_kept"] for t in toks)
        seq_info.append(dict(n_valid=n_valid, s=s, seq_log=seq_log, geo_log=geo_log, rej=seq_rej, kept=kept_seq,
                             w_seq=w_seq, w_seq_unb=w_seq_unb, failed=failed))

    # normalisation
    mean = 1.0
    if cfg.use_tis and cfg.tis_batch_normalize:
        if cfg.tis_level == "token":
            ws = [t["w"] for toks in seqs for t in toks if t["keep"]]
        else:
            ws = [info["w_seq"] for info in seq_info if info["kept"]]
        mean = sum(ws) / len(ws) if ws else 1.0

    for toks, info in zip(seqs, seq_info):
        w_list, k_list = [], []
        for t in toks:
            if not t["keep"]:
                w_list.append(0.0)
            elif not cfg.use_tis:
                w_list.append(1.0)
            elif cfg.tis_level == "token":
                w_list.append(t["w"] / mean)
            else:
                w_list.append(info["w_seq"] / mean)
            k_list.append(t["keep"])
        out_weights.append(w_list)
        out_keep.append(k_list)

    # metrics (summary semantics: token metrics over loss-mask tokens, sequence metrics over
    # sequences with loss-mask tokens)
    all_t = [t for toks in seqs for t in toks]
    n_mask = sum(t["m"] for t in all_t)
    seq_with_mask = [(toks, info) for toks, info in zip(seqs, seq_info) if any(t["m"] for t in toks)]

    def tok_mean(f):
        return sum(f(t) for t in all_t if t["m"]) / n_mask if n_mask else 0.0

    def seq_mean(f):
        return sum(f(toks, info) for toks, info in seq_with_mask) / len(seq_with_mask) if seq_with_mask else 0.0

    def mean_lp(toks, key):
        vals = [t[key] for t in toks if t["valid"]]
        return sum(vals) / len(vals) if vals else 0.0

    metrics = {
        "mis_k3_kl": tok_mean(lambda t: (t["r"] - 1 - t["lrc"]) if t["valid"] else 0.0),
        "mis_kl": tok_mean(lambda t: -t["raw"]),
        "mis_tv": tok_mean(lambda t: 0.5 * abs(t["r"] - 1) if t["valid"] else 0.0),
        "mis_nonfinite_token_fraction": tok_mean(lambda t: float(t["nonfinite"])),
        "mis_rejected_token_fraction": tok_mean(lambda t: float(not t["keep"])),
        "mis_rejected_seq_fraction": seq_mean(lambda toks, info: float(not info["kept"])),
        "mis_training_log_ppl": seq_mean(lambda toks, info: -mean_lp(toks, "a")),
        "mis_rollout_log_ppl": seq_mean(lambda toks, info: -mean_lp(toks, "b")),
        "mis_log_ppl_abs_diff": seq_mean(lambda toks, info: abs(mean_lp(toks, "b") - mean_lp(toks, "a"))),
        "mis_chi2_token": seq_mean(
            lambda toks, info: (sum(t["r"] ** 2 for t in toks if t["valid"]) / info["n_valid"] - 1) if info["n_valid"] else 0.0
        ),
        "mis_chi2_seq": seq_mean(lambda toks, info: (math.exp(2 * info["seq_log"]) - 1) if info["n_valid"] else 0.0),
    }
    rs = [t["r"] for t in all_t if t["valid"]]
    metrics["mis_ess_token"] = (sum(rs) ** 2 / (len(rs) * sum(x * x for x in rs))) if rs else 1.0
    sw = [math.exp(info["seq_log"]) for info in seq_info if info["n_valid"]]
    metrics["mis_ess_seq"] = (sum(sw) ** 2 / (len(sw) * sum(x * x for x in sw))) if sw else 1.0
    if cfg.use_tis and cfg.tis_batch_normalize:
        metrics["mis_batch_norm_factor"] = mean

    # ---- every further summary metric, each from its definition (docs/metrics.md) -------------
    cap = lambda x: max(-80.0, min(80.0, x))  # noqa: E731 - ppl-like exponents are capped at +-80

    def mean_log_r(toks, info):
        return info["s"] / info["n_valid"] if info["n_valid"] else 0.0

    metrics["mis_training_ppl"] = seq_mean(lambda toks, info: math.exp(cap(-mean_lp(toks, "a"))))
    metrics["mis_rollout_ppl"] = seq_mean(lambda toks, info: math.exp(cap(-mean_lp(toks, "b"))))
    metrics["mis_log_ppl_diff"] = seq_mean(lambda toks, info: -mean_log_r(toks, info))
    metrics["mis_ppl_ratio"] = seq_mean(lambda toks, info: math.exp(cap(-mean_log_r(toks, info))))
    metrics["num_sequences"] = float(len(seqs))
    metrics["num_loss_tokens"] = float(n_mask)
    metrics["num_kept_tokens"] = float(sum(t["keep"] for t in all_t))
    metrics["num_kept_sequences"] = float(sum(info["kept"] for info in seq_info))
    full = getattr(cfg, "mis_metrics", "standard") == "full"

    for name, _, _ in criteria:
        if name.startswith("token_"):
            metrics[f"mis_rs_{name}_fraction"] = tok_mean(lambda t, name=name: float(t["failed"][name]))
        else:
            metrics[f"mis_rs_{name}_fraction"] = seq_mean(lambda toks, info, name=name: float(info["failed"][name]))
    if band:
        if cfg.rs_level == "token":
            metrics["mis_rs_mask_fraction_low"] = tok_mean(lambda t: float(t["r"] < rl))
            metrics["mis_rs_mask_fraction_high"] = tok_mean(lambda t: float(t["r"] > ru))
        else:
            def rs_ratio(info):
                return math.exp(info["seq_log"] if cfg.rs_level == "sequence" else info["geo_log"])

            metrics["mis_rs_mask_fraction_low"] = seq_mean(lambda toks, info: float(info["n_valid"] > 0 and rs_ratio(info) < rl))
            metrics["mis_rs_mask_fraction_high"] = seq_mean(lambda toks, info: float(info["n_valid"] > 0 and rs_ratio(info) > ru))
    if cfg.rs_veto_threshold is not None:
        thr = math.log(cfg.rs_veto_threshold)
        metrics["mis_rs_catastrophic_token_fraction"] = tok_mean(lambda t: float(t["valid"] and t["raw"] < thr))
        metrics["mis_rs_catastrophic_seq_fraction"] = seq_mean(
            lambda toks, info: float(any(t["valid"] and t["raw"] < thr for t in toks)))
    if cfg.prob_veto_threshold is not None:
        key = "b" if cfg.prob_veto_source == "rollout" else "a"
        thr = math.log(cfg.prob_veto_threshold)
        metrics["mis_prob_veto_token_fraction"] = tok_mean(lambda t: float(t[key] < thr))
        metrics["mis_prob_veto_seq_fraction"] = seq_mean(lambda toks, info: float(any(t["m"] and t[key] < thr for t in toks)))

    if cfg.use_tis:
        def bound(w):
            if cfg.tis_mode == "truncate":
                return min(w, U)
            if cfg.tis_mode == "clip":
                return min(max(w, L), U)
            return w if L <= w <= U else 0.0

        low_name, high_name = {"truncate": (None, "mis_tis_truncate_fraction"),
                               "clip": ("mis_tis_clip_fraction_low", "mis_tis_clip_fraction_high"),
                               "mask": ("mis_tis_mask_fraction_low", "mis_tis_mask_fraction_high"),
                               "icepop": ("mis_tis_zero_weight_fraction_low", "mis_tis_zero_weight_fraction_high")}[cfg.tis_mode]
        if cfg.tis_level == "token":
            # a loss-mask token with a non-finite log-prob counts with ratio 1 (t["r"] is 1 there)
            host = lambda t: t["r"] if cfg.tis_mode == "mask" else bound(t["r"])  # noqa: E731
            metrics["mis_tis_weight_before_bound"] = tok_mean(lambda t: t["r"] if t["valid"] else 0.0)
            metrics["mis_tis_weight_after_bound"] = tok_mean(host)
            metrics["mis_is_ratio_mean_after_tis_rs"] = metrics["mis_tis_weight_after_bound"]
            if full:
                metrics["mis_weight_after_bound_kept"] = tok_mean(lambda t: bound(t["r"]))
            if low_name:
                metrics[low_name] = tok_mean(lambda t: float(t["r"] < L))
            metrics[high_name] = tok_mean(lambda t: float(t["r"] > U))

            def final(toks, info, f):
                vals = [host(t) / mean for t in toks if t["m"]]
                return f(vals) if vals else 0.0

            metrics["mis_is_ratio_mean_final"] = seq_mean(lambda toks, info: final(toks, info, lambda v: sum(v) / len(v)))
            metrics["mis_is_ratio_min_final"] = seq_mean(lambda toks, info: final(toks, info, min))
            metrics["mis_is_ratio_max_final"] = seq_mean(lambda toks, info: final(toks, info, max))
            if full:
                def kept_final(toks, info, f):
                    vals = [t["w"] / mean for t in toks if t["tok_kept"]]
                    return f(vals) if info["kept"] else 0.0

                metrics["mis_kept_weight_mean_final"] = seq_mean(lambda toks, info: kept_final(toks, info, lambda v: sum(v) / len(v)))
                metrics["mis_kept_weight_min_final"] = seq_mean(lambda toks, info: kept_final(toks, info, min))
                metrics["mis_kept_weight_max_final"] = seq_mean(lambda toks, info: kept_final(toks, info, max))
            before = [t["r"] for t in all_t if t["valid"]]
            after = [t["w"] for t in all_t if t["keep"]]
        else:
            host_seq = lambda info: info["w_seq_unb"] if cfg.tis_mode == "mask" else info["w_seq"]  # noqa: E731
            metrics["mis_tis_weight_before_bound"] = seq_mean(lambda toks, info: info["w_seq_unb"])
            metrics["mis_tis_weight_after_bound"] = seq_mean(lambda toks, info: host_seq(info))
            metrics["mis_is_ratio_mean_after_tis_rs"] = metrics["mis_tis_weight_after_bound"]
            if full:
                metrics["mis_weight_after_bound_kept"] = seq_mean(lambda toks, info: info["w_seq"])
            if low_name:
                metrics[low_name] = seq_mean(lambda toks, info: float(info["n_valid"] > 0 and info["w_seq_unb"] < L))
            metrics[high_name] = seq_mean(lambda toks, info: float(info["n_valid"] > 0 and info["w_seq_unb"] > U))
            for part in ("mean", "min", "max"):
                metrics[f"mis_is_ratio_{part}_final"] = seq_mean(lambda toks, info: host_seq(info) / mean)
                if full:
                    metrics[f"mis_kept_weight_{part}_final"] = seq_mean(
                        lambda toks, info: info["w_seq"] / mean if info["kept"] else 0.0)
            before = [info["w_seq_unb"] for info in seq_info if info["n_valid"]]
            after = [info["w_seq"] for info in seq_info if info["kept"]]
        # batch statistics: before bounds over valid tokens / sequences with a valid token; after
        # bounds over kept tokens (of sequences not rejected) / kept sequences; 0 when there are none
        for name, vals in (("before_bound", before), ("after_bound", after)):
            metrics[f"mis_weight_{name}_mean"] = sum(vals) / len(vals) if vals else 0.0
            metrics[f"mis_weight_{name}_min"] = min(vals) if vals else 0.0
            metrics[f"mis_weight_{name}_max"] = max(vals) if vals else 0.0
        for part in ("mean", "min", "max"):
            metrics[f"mis_weight_final_{part}"] = metrics[f"mis_weight_after_bound_{part}"] / mean
    return {"weights": out_weights, "keep": out_keep, "metrics": metrics, "normalizer": mean}
