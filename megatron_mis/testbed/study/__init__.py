"""``megatron-mis study``: the demo's GRPO run over arms (corrections, references) x seeds on one
machine, with bootstrap statistics and a report (see ``docs/study.md``).

- :mod:`~megatron_mis.testbed.study.config`: ``StudyConfig``, the settings (mismatch sources) and
  the arms (no torch import);
- :mod:`~megatron_mis.testbed.study.runner`: the runs in parallel worker processes, one JSONL
  file per run, finished runs reused;
- :mod:`~megatron_mis.testbed.study.stats`: per-run metrics, bootstrap confidence intervals,
  paired differences;
- :mod:`~megatron_mis.testbed.study.report`: the markdown table, the verdicts and the PNG.
"""
