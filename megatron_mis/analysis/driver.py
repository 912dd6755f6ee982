"""Drive an analysis over many dump files: read one file at a time (tqdm progress bar), run the
engine per configuration, merge rows by rollout id, replay the monitor and the surge detector.
Bad files are reported and skipped; the rest is analysed."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_mis.analysis.history import RATIO_EDGES, RowAccumulator, analysis_config, process_batch, replay_monitor
from megatron_mis.analysis.readers import DumpBatch, DumpError, DumpReader, DumpSkipped, expand_paths
from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import MISResult

__all__ = ["HistoryResult", "analyze_history"]

MAIN = "config"


@dataclass
class HistoryResult:
    """``report``: the plain-Python report (see docs/analyze.md for its keys); ``single``: the
    engine result and samples of the only batch when exactly one file gave exactly one batch (for
    the detailed single-batch report), else ``None``."""

    report: dict[str, Any]
    single: tuple[MISResult, Any] | None


def analyze_history(
    paths: Sequence[str],
    config: MISConfig,
    config_source: str,
    *,
    compare: Mapping[str, MISConfig] | None = None,
    format: str = "auto",
    trust_pickle: bool = False,
    schedule=None,
    progress: bool = True,
    sample=None,
) -> HistoryResult:
    """Analyse every file named by ``paths`` (files, directories, globs).

    Args:
        config: the configuration whose effect is reported per row (rejected / vetoed fractions).
        compare: name -> configuration for the what-if table.
        schedule: :class:`megatron_mis.monitor.ScheduleConfigs` (surge, decay, monitor); defaults.
        progress: show a tqdm bar over files (on stderr).
        sample: a :class:`~megatron_mis.analysis.single.LogProbSamples` analysed as rollout 0 in
            place of files (the built-in sample).

    Raises:
        DumpError: only when no file at all could be analysed (the first error).
    """
    from tqdm import tqdm

    from megatron_mis.monitor import LengthDecayConfig, MonitorConfig, SurgeConfig

    configs = {MAIN: analysis_config(config)}
    for name, cfg in (compare or {}).items():
        configs[f"compare:{name}"] = analysis_config(cfg)
    notes: list[str] = []
    if config.normalizes and config.tis_batch_normalize_scope == "global":
        notes.append("tis_batch_normalize_scope 'global': each rollout (file) is normalised as one global batch")
    files, errors = expand_paths(list(paths))
    num_path_errors = len(errors)
    reader = DumpReader(format, trust_pickle=trust_pickle)
    rows: dict[int, RowAccumulator] = {}
    analysed: list[str] = []
    single: list[tuple[MISResult, Any]] = []  # kept only while one batch has been seen
    num_batches = 0
    unnumbered = 0
    engine_warnings: list[str] = []
    skipped: list[DumpError] = []

    def sources():
        if sample is not None:
            analysed.append(sample.source)
            yield [DumpBatch(sample.source, "built-in", 0, sample.train_log_probs, sample.rollout_log_probs,
                             sample.loss_masks, [int(t.numel()) for t in sample.train_log_probs])]
        for path in tqdm(files, desc="analyze", unit="file", disable=not progress or len(files) < 2, leave=False):
            try:
                batches = reader.read(path)
            except DumpSkipped as exc:
                skipped.append(exc)
                continue
            except DumpError as exc:
                errors.append(exc)
                continue
            analysed.append(str(path))
            yield batches

    for batches in sources():
        for batch in batches:
            rid = batch.rollout_id
            if rid is None:
                rid = unnumbered
                unnumbered += 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                row, result = process_batch(
                    rid, batch.source, batch.train_log_probs, batch.rollout_log_probs, batch.loss_masks,
                    batch.response_lengths, configs, MAIN,
                )
                result.scalars()  # emits the engine's non-finite warning, once
            engine_warnings.extend(f"{batch.source}: {w.message}" for w in caught)
            num_batches += 1
            if num_batches == 1:
                single.append((result, batch))
            else:
                single.clear()  # several batches: no single-batch report; hold no token tensors
            if rid in rows:
                rows[rid].merge(row)
            else:
                rows[rid] = row
    _, pending_errors = reader.finish()
    errors.extend(pending_errors)
    if not rows:
        errors.extend(skipped)
        if errors:
            raise errors[0] if len(errors) == 1 else DumpError(
                errors[0].path, f"{errors[0].detail} (and {len(errors) - 1} more problem(s): no file could be analysed)"
            )
        raise DumpError(", ".join(paths) or "(no path)", "no file to analyse")
    if unnumbered and len(rows) > 1:
        notes.append(f"{unnumbered} batch(es) carry no rollout id; numbered from 0 in file order")
    if skipped:
        notes.append(
            f"{len(skipped)} file(s) without trainer log-probs skipped (pipeline stages other than the last), "
            f"e.g. {skipped[0].path}"
        )
    if reader.num_duplicates:
        notes.append(f"{reader.num_duplicates} duplicate sample copies (tensor-parallel ranks) skipped by sample index")
    notes.extend(engine_warnings)

    ordered = [rows[k] for k in sorted(rows)]
    row_dicts = [r.summary(MAIN) for r in ordered]
    overall_acc = RowAccumulator(rollout_id=-1)
    for r in ordered:
        overall_acc.merge(r)
    overall = overall_acc.summary(MAIN)
    overall.pop("sources", None)
    overall["rollout_id"] = None

    schedule_cfgs = schedule
    surge_cfg = schedule_cfgs.surge if schedule_cfgs else SurgeConfig()
    decay_cfg = schedule_cfgs.decay if schedule_cfgs else LengthDecayConfig()
    monitor_cfg = schedule_cfgs.monitor if schedule_cfgs else MonitorConfig(
        monitor_trend_metrics=["mis_k3_kl", "mis_log_ppl_abs_diff"], monitor_emit="none"
    )
    if monitor_cfg.monitor_emit != "none":
        import dataclasses

        monitor_cfg = dataclasses.replace(monitor_cfg, monitor_emit="none")
    monitor_warnings, surge = replay_monitor(row_dicts, monitor_cfg, surge_cfg, decay_cfg)

    def bucket_slice(accs: list[RowAccumulator]) -> dict[str, Any] | None:
        if not accs:
            return None
        acc = RowAccumulator(rollout_id=-1)
        for a in accs:
            acc.merge(a)
        return acc.bucket_means()

    third = max(1, len(ordered) // 3)
    buckets = {"all": overall_acc.bucket_means()}
    if len(ordered) >= 3:
        buckets["first_third"] = bucket_slice(ordered[:third])
        buckets["last_third"] = bucket_slice(ordered[-third:])

    compare_rows = []
    for name in configs:
        if name == MAIN:
            continue
        label = name.split(":", 1)[1]
        entry = {"config": label, **overall_acc.configs[name].summary()}
        entry["per_rollout"] = [
            {"rollout_id": r.rollout_id, **r.configs[name].summary()} for r in ordered
        ]
        compare_rows.append(entry)

    for row, acc in zip(row_dicts, ordered):
        row["config_effect"] = acc.configs[MAIN].summary()
    report: dict[str, Any] = {
        "format": reader.kind or ("built-in" if sample is not None else None),
        "num_files": len(files) + num_path_errors + (1 if sample is not None else 0),
        "num_files_analysed": len(analysed),
        "config": config_source,
        "rows": row_dicts,
        "overall": overall,
        "buckets": buckets,
        "weights": {
            "log10_edges": RATIO_EDGES.tolist(),
            "ratio_counts": overall_acc.ratio_hist.tolist(),
            "final_weight_counts": overall_acc.weight_hist.tolist(),
            "note": "counts per log10 bin; the first entry counts values below the first edge (and zeros), the last those above the last edge",
        },
        "monitor": {"warnings": monitor_warnings, "config": monitor_cfg.to_dict()},
        "surge": surge,
        "compare": compare_rows,
        "errors": [{"file": e.path, "error": str(e)} for e in errors],
        "notes": notes,
        "k3_p99_note": "p99 from a log-spaced histogram (100 bins per decade): within 1.2% of the exact quantile",
    }
    only = single[0] if single and len(analysed) == 1 else None
    if only is not None:
        report["metrics"] = only[0].scalars()
        report["bucket_table"] = {k: v.tolist() for k, v in only[0].bucket_table.items()}
    return HistoryResult(report, only)
