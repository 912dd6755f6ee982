"""The README tells the truth: its key tables list every config key with its real default, the
set-up commands are the ones .ci/run and the Makefile use, and the files it names exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megatron_mis.config import MISConfig
from megatron_mis.config.loss import LossConfig
from megatron_mis.monitor import LengthDecayConfig, MonitorConfig, SurgeConfig
from megatron_mis.routing.config import RoutingReplayConfig

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
#: the key tables live in docs/config.md (the README links them)
CONFIG_DOC = (REPO / "docs" / "config.md").read_text(encoding="utf-8")


def _table_rows() -> dict[str, str]:
    """``key -> default cell`` of every `| \\`key\\` | default | meaning |` row."""
    rows = {}
    for m in re.finditer(r"^\| `([a-z_0-9]+)` \| (.*?) \| .* \|$", CONFIG_DOC, re.M):
        rows.setdefault(m.group(1), m.group(2))
    return rows


def _cell(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)):
        return "`" + yaml.safe_dump(value, default_flow_style=True).strip() + "`"
    return f"`{value}`"


@pytest.mark.parametrize("cls", [MISConfig, SurgeConfig, LengthDecayConfig, MonitorConfig, RoutingReplayConfig, LossConfig],
                         ids=lambda c: c.__name__)
def test_every_key_is_in_the_config_reference_with_its_default(cls):
    rows = _table_rows()
    for key, (_, default, doc) in cls.field_docs().items():
        assert key in rows, f"{cls.__name__}.{key} is missing from docs/config.md"
        assert rows[key] == _cell(default), f"{key}: docs/config.md says {rows[key]}, the code says {_cell(default)}"
        assert doc, f"{cls.__name__}.{key} has no documentation"


def test_config_reference_lists_no_stale_keys():
    known = set()
    for cls in (MISConfig, SurgeConfig, LengthDecayConfig, MonitorConfig, RoutingReplayConfig, LossConfig):
        known |= set(cls.field_names())
    rows = _table_rows()
    config_rows = {k for k in rows if not k.startswith(("mis_", "num_")) and k not in {"token", "sequence", "geometric"}}
    assert config_rows <= known, sorted(config_rows - known)


def test_setup_commands_match_ci_and_makefile():
    assert "make demo" in README and "make test" in README
    assert "make test" in (REPO / ".ci" / "run").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "torch==2.13.0" in makefile
    install = re.search(r'-e "\.\[([a-z,]+)\]"', makefile)
    # the demo and the tests need the [demo] extra (matplotlib, tqdm) besides [test]
    assert install and {"test", "demo"} <= set(install.group(1).split(",")), install
    assert makefile.index("torch==2.13.0") < install.start()  # torch first


def test_readme_says_how_to_install_for_training_and_for_the_demo():
    setup = (REPO / "setup.py").read_text()
    assert '"demo": [' in setup and "matplotlib" not in setup.split("extras_require")[0]
    assert 'pip install "megatron-mis[demo]"' in README or "pip install \".[demo]\"" in README


def test_named_files_exist():
    for path in set(re.findall(r"\b((?:examples|patches|configs|docs|benchmarks)/[\w./-]+\.(?:sh|py|yaml|patch|md|png))", README)):
        assert (REPO / path).exists(), path


def test_readme_links_the_config_reference_and_the_engine_math():
    assert "docs/config.md" in README and "docs/engine.md" in README
