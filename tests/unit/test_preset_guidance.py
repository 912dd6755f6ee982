"""Every shipped preset says when to use it (issue 29, item 4: the presets say which correction fits which
measured K3 and response length): a ``# When`` comment that either quotes the study (docs/study.md) or says the
study did not run it, and the README's preset table carries the same verdict. Whether the study ran a preset is
read from the study's arms, and every interval a comment quotes must be one docs/study.md quotes (where the
study's tests recompute it from the run archives and reports)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_mis.presets import configs_dir, preset_names

REPO = Path(__file__).resolve().parents[2]
_INTERVAL = re.compile(r"[+-]\d+\.\d+ \[[+-]\d+\.\d+, [+-]\d+\.\d+\]")


def _when(name: str) -> str:
    """The ``# When`` comment of a preset, as one line of prose (from ``# When`` to the first non-comment line or
    the next comment that is not its continuation)."""
    lines = (configs_dir() / "presets" / f"{name}.yaml").read_text().splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith("# When")), None)
    assert start is not None, f"configs/presets/{name}.yaml has no '# When' comment"
    out = []
    for x in lines[start:]:
        if not x.startswith("#") or (out and x.startswith("# When")):
            break
        out.append(x.lstrip("#").strip())
    return " ".join(" ".join(out).split())


def _studied() -> set[str]:
    """The presets some study arm runs (its ``correction``)."""
    from megatron_mis.testbed.study.config import ARMS

    return {arm.overrides.get("correction") for arm in ARMS.values()}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_says_when_to_use_it_from_the_study(name):
    when = _when(name)
    study = " ".join((REPO / "docs" / "study.md").read_text().split())
    if name in _studied():
        assert when.startswith("When (measured in the study, docs/study.md"), when
        assert "not run in the study" not in when
    else:
        assert when.startswith("When: not run in the study (docs/study.md)"), when
        assert not _INTERVAL.search(when), when  # no figure for what was not run
    missing = [f for f in _INTERVAL.findall(when) if f not in study]
    assert not missing, (name, missing)


def test_the_readme_s_preset_table_carries_each_preset_s_verdict():
    readme = (REPO / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|.*\| ([^|]+) \|$", readme, re.M)
            if m.group(1) in preset_names()}
    assert sorted(rows) == preset_names()
    studied = _studied()
    for name, cell in rows.items():
        assert ("not run in the study" in cell) == (name not in studied), (name, cell)
    study = " ".join((REPO / "docs" / "study.md").read_text().split())
    missing = [f for cell in rows.values() for f in _INTERVAL.findall(cell) if f not in study]
    assert not missing, missing
