"""The slime and Miles examples: every megatron_mis dotted path they name imports to a callable,
every YAML they name validates (all sections of a shared host YAML), every patch they name is
shipped, and the scripts are valid bash."""

from __future__ import annotations

import importlib
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from megatron_mis.config.sections import load_sections

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "examples").glob("*/run-*.sh"))
HOST_SCRIPTS = [p for p in SCRIPTS if p.parent.name in ("slime", "miles")]


def test_both_hosts_have_examples():
    assert {p.parent.name for p in HOST_SCRIPTS} == {"slime", "miles"}


@pytest.mark.parametrize("script", HOST_SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_dotted_paths_import(script):
    text = script.read_text()
    paths = set(re.findall(r"\bmegatron_mis(?:\.[A-Za-z_]\w*)+", text))
    assert "megatron_mis.compute_mis_weights_with_cp" in paths
    for dotted in sorted(paths):
        module, _, attr = dotted.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        assert callable(obj), dotted


@pytest.mark.parametrize("script", HOST_SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_configs_validate_and_patches_exist(script):
    text = script.read_text()
    yamls = re.findall(r'--custom-config-path\s+"?\$\{SCRIPT_DIR\}/([\w./-]+)"?', text)
    assert yamls, "the example must name its --custom-config-path"
    for name in yamls:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # shipped configs carry no ineffective settings
            sections = load_sections(script.parent / name)
        assert sections["mis"].use_tis
    for patch in re.findall(r"patches/([\w.-]+\.patch)", text + "".join((script.parent / y).read_text() for y in yamls)):
        assert (REPO / "patches" / patch).is_file(), patch


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
