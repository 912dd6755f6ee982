"""One entry module per host, and the old dotted paths of the 0.1 docs.

- every ``megatron_mis.*`` dotted path named in the README, docs, examples, configs and patches
  resolves, and resolves WITHOUT a deprecation warning (the docs point at the new homes);
- the slime / Miles / plain-Megatron entry modules expose every path their flags and patches take;
- each old path still resolves for one release, with a ``DeprecationWarning`` naming the new
  path, to the very object of the new home (so behaviour is identical by construction).
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = sorted(
    [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*"), *(REPO / "configs").rglob("*.yaml"),
     *(REPO / "patches").glob("*.patch")]
)
DOTTED = re.compile(r"\bmegatron_mis(?:\.[A-Za-z_]\w*)+")


def _resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"nothing of {dotted} imports")


def _documented_paths() -> list[str]:
    found = set()
    for path in DOC_FILES:
        if path.is_file() and path.suffix in (".md", ".py", ".sh", ".yaml", ".patch"):
            found.update(DOTTED.findall(path.read_text()))
    return sorted(found)


def test_every_documented_path_resolves_to_its_current_home():
    paths = _documented_paths()
    assert "megatron_mis.integrations.slime.rollout_data_postprocess" in paths
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        for dotted in paths:
            _resolve(dotted)
    ours = [str(w.message) for w in caught if "will be removed in megatron-mis" in str(w.message)]
    assert not ours, ours


SLIME = ("compute_mis_weights_with_cp", "compute_mis_weights_fsdp", "rollout_data_postprocess", "prepare_global_normalizer",
         "before_train_step", "observe_rollout", "wrap_opt_param_scheduler", "monitor_train_step")
MILES = ("compute_mis_weights_with_cp", "compute_mis_weights_fsdp", "prepare_global_normalizer", "before_train_step",
         "observe_rollout", "wrap_opt_param_scheduler", "monitor_train_step")
MEGATRON = ("MegatronRLLoss", "RLMicroBatch", "response_positions", "compute_global_normalizer", "CPInputs", "RoutingReplay",
            "RoutingReplayConfig", "LengthDecayParamScheduler", "build_lr_schedule", "global_mean_response_length",
            "MismatchMonitor")


@pytest.mark.parametrize(("module", "names"), [("slime", SLIME), ("miles", MILES), ("megatron", MEGATRON)])
def test_entry_modules_expose_every_host_path(module, names):
    mod = importlib.import_module(f"megatron_mis.integrations.{module}")
    assert sorted(mod.__all__) == sorted(names)
    for name in names:
        assert getattr(mod, name) is not None
    # one implementation per function, whichever entry module a user names
    if module != "megatron":
        from megatron_mis.integrations import scheduler_hooks, tis_functions

        assert mod.compute_mis_weights_with_cp is tis_functions.compute_mis_weights_with_cp
        assert mod.before_train_step is scheduler_hooks.before_train_step
    from megatron_mis import compute_mis_weights_with_cp

    from megatron_mis.integrations import tis_functions

    assert compute_mis_weights_with_cp is tis_functions.compute_mis_weights_with_cp


OLD_PATHS = [
    ("megatron_mis.integrations.hosts.compute_mis_weights_with_cp", "megatron_mis.integrations.tis_functions.compute_mis_weights_with_cp"),
    ("megatron_mis.integrations.hosts.compute_mis_weights_fsdp", "megatron_mis.integrations.tis_functions.compute_mis_weights_fsdp"),
    ("megatron_mis.integrations.hosts.prepare_global_normalizer", "megatron_mis.integrations.tis_functions.prepare_global_normalizer"),
    ("megatron_mis.integrations.hosts.config_from_args", "megatron_mis.integrations.tis_functions.config_from_args"),
    ("megatron_mis.integrations.scheduler_hooks.slime_rollout_data_postprocess",
     "megatron_mis.integrations.slime.rollout_data_postprocess"),
    *[(f"megatron_mis.monitor.scheduler.{n}", f"megatron_mis.lr_schedule.{n}")
      for n in ("LengthDecayParamScheduler", "LengthDecayScheduler", "LengthDecaySchedule", "ConstantSchedule", "LR_SCHEDULES",
                "build_lr_schedule")],
    *[(f"megatron_mis.monitor.{n}", f"megatron_mis.lr_schedule.{n}")
      for n in ("LengthDecayParamScheduler", "LengthDecayScheduler", "LengthDecaySchedule", "ConstantSchedule", "LR_SCHEDULES",
                "build_lr_schedule")],
]


@pytest.mark.parametrize(("old", "new"), OLD_PATHS, ids=[o for o, _ in OLD_PATHS])
def test_old_path_warns_and_is_the_same_object(old, new):
    module, _, attr = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=re.escape(new)) as record:
        obj = getattr(importlib.import_module(module), attr)  # how slime / Miles load a flag's value
    assert record[0].filename == __file__  # the warning points at the caller, not the shim
    assert obj is _resolve(new)
    with pytest.warns(DeprecationWarning, match=re.escape(old)):
        exec(f"from {module} import {attr} as imported", ns := {})
    assert ns["imported"] is obj


def test_old_modules_refuse_names_they_never_had():
    from megatron_mis.integrations import hosts, scheduler_hooks
    from megatron_mis.monitor import scheduler

    for mod in (hosts, scheduler_hooks, scheduler):
        with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
            mod.nonexistent  # noqa: B018
