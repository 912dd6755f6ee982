"""One entry module per host.

- every ``megatron_mis.*`` dotted path named in the README, docs, examples, configs and patches
  resolves, and resolves WITHOUT a deprecation warning (the docs point at the new homes);
- the slime / Miles / plain-Megatron entry modules expose every path their flags and patches take;
- the old paths of unreleased 0.1 drafts are gone (no shims): they fail to import.
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


REMOVED = [
    ("megatron_mis.integrations.hosts", None),
    ("megatron_mis.monitor.scheduler", None),
    ("megatron_mis._deprecated", None),
    ("megatron_mis.integrations.scheduler_hooks", "slime_rollout_data_postprocess"),
    ("megatron_mis.monitor", "LengthDecayParamScheduler"),
    ("megatron_mis.monitor", "build_lr_schedule"),
]


@pytest.mark.parametrize(("module", "attr"), REMOVED, ids=[f"{m}.{a}" if a else m for m, a in REMOVED])
def test_removed_paths_are_gone(module, attr):
    """The package was never released: the draft paths have no shims (nothing warns, nothing
    forwards); a flag naming one fails at once with Python's own error."""
    if attr is None:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
    else:
        with pytest.raises(AttributeError, match=attr):
            getattr(importlib.import_module(module), attr)


def test_every_module_s_all_names_only_what_it_defines():
    """``from megatron_mis.X import *`` works for every module: each name in a module's ``__all__`` is
    an attribute of it (``core.segments`` once listed ``expand``, a method of ``SegmentLayout``, so its
    star import raised AttributeError). The ``__main__`` modules run the CLI and are left out."""
    import pkgutil

    import megatron_mis

    checked, missing = 0, []
    for info in pkgutil.walk_packages(megatron_mis.__path__, "megatron_mis."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        module = importlib.import_module(info.name)
        names = getattr(module, "__all__", ())
        checked += bool(names)
        missing += [(info.name, n) for n in names if not hasattr(module, n)]
    assert checked > 50  # the walk found the library's modules
    assert not missing, missing
