"""Offline mismatch analysis (what ``megatron-mis analyze`` runs).

- :mod:`~megatron_mis.analysis.readers`: slime, Miles and megatron-mis dumps, one file at a time;
- :mod:`~megatron_mis.analysis.history`: per-rollout rows from per-file sums, the monitor and
  surge-detector replay;
- :mod:`~megatron_mis.analysis.driver`: :func:`analyze_history` over files / directories / globs;
- :mod:`~megatron_mis.analysis.report`: terminal table, strict JSON, PNG;
- :mod:`~megatron_mis.analysis.single`: one batch as a whole (:func:`load_samples`,
  :func:`analyze`, :func:`format_report`); :func:`builtin_sample` when no file is given.

See ``docs/analyze.md``.
"""

from megatron_mis.analysis.driver import HistoryResult, analyze_history
from megatron_mis.analysis.readers import FORMATS, DumpBatch, DumpError, DumpReader, detect_format, expand_paths
from megatron_mis.analysis.report import format_compare, format_history, json_safe, plot_history, to_json
from megatron_mis.analysis.sample import builtin_sample
from megatron_mis.analysis.single import LogProbSamples, analyze, format_report, load_samples

__all__ = [
    "FORMATS",
    "DumpBatch",
    "DumpError",
    "DumpReader",
    "HistoryResult",
    "LogProbSamples",
    "analyze",
    "analyze_history",
    "builtin_sample",
    "detect_format",
    "expand_paths",
    "format_compare",
    "format_history",
    "format_report",
    "json_safe",
    "load_samples",
    "plot_history",
    "to_json",
]
