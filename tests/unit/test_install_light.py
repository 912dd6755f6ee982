"""The install a training container gets (`pip install megatron-mis`, no extras): the host entry
modules load nothing that only the demo, the study, the plots or `analyze` need, and the command
line names the `[demo]` extra instead of failing with a traceback when it is missing (issue 30)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_mis

PACKAGE_DIR = str(Path(megatron_mis.__file__).resolve().parent)

#: Packages of the [demo] extra (setup.py): a fresh process blocks them, as a light install lacks them.
DEMO_EXTRA = ("matplotlib", "tqdm")
#: Our own modules only the command line, `analyze` and the testbed use.
OUR_EXTRAS = ("megatron_mis.cli", "megatron_mis.analysis", "megatron_mis.testbed")

#: Runs in a fresh interpreter: a finder in front of sys.meta_path makes the [demo] packages
#: unimportable (as in a light install) and records which module asked for one; then the entry
#: module is imported. torch itself tries `import tqdm` (torch/hub.py, falling back when absent):
#: only an import written in one of our files counts.
_PROBE = r"""
import importlib, importlib.abc, json, sys

package_dir, entry, blocked = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(","))
asked = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in blocked:
            return None
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        asked.append([name, frame.f_code.co_filename if frame is not None else "?"])
        raise ModuleNotFoundError(f"No module named {name!r} (blocked: a light install)", name=name)

sys.meta_path.insert(0, Block())
importlib.import_module(entry)
print(json.dumps({
    "asked": asked,
    "loaded": sorted(n for n in sys.modules if n.split(".")[0] in blocked
                     or n.startswith(("megatron_mis.cli", "megatron_mis.analysis", "megatron_mis.testbed"))),
}))
"""


def _probe(entry: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, PACKAGE_DIR, entry, ",".join(DEMO_EXTRA)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"importing {entry} without {DEMO_EXTRA} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "entry",
    ["megatron_mis", "megatron_mis.integrations.slime", "megatron_mis.integrations.miles",
     "megatron_mis.integrations.megatron"],
)
def test_host_entry_modules_load_no_demo_module(entry):
    result = _probe(entry)
    ours = [(name, where) for name, where in result["asked"] if where.startswith(PACKAGE_DIR)]
    assert ours == [], f"{entry}: our modules import {ours} (a [demo] package) at import time"
    assert result["loaded"] == [], f"{entry} loaded {result['loaded']}"


def test_probe_sees_an_import_from_our_package(tmp_path):
    """The probe is not blind: a module of ours that imports tqdm is caught (and its import fails,
    as in a light install)."""
    # a stand-in package whose files live under the package dir given to the probe
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("try:\n    import tqdm\nexcept ImportError:\n    pass\nimport megatron_mis.cli\n")
    code = _PROBE
    # PYTHONPATH: the stand-in package, then the checkout (where megatron_mis is on PYTHONPATH
    # rather than installed, as on the GPU machine) and whatever the run had before
    proc = subprocess.run(
        [sys.executable, "-c", code, str(pkg), "fakepkg", ",".join(DEMO_EXTRA)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path for path in (
            str(tmp_path), str(Path(PACKAGE_DIR).parent), os.environ.get("PYTHONPATH", "")) if path)},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [name for name, where in result["asked"] if where.startswith(str(pkg))] == ["tqdm"]
    assert "megatron_mis.cli" in result["loaded"]


@pytest.mark.parametrize(
    "argv, missing",
    [
        (["demo", "--quick"], "matplotlib and tqdm, which are"),
        (["study", "--quick"], "matplotlib and tqdm, which are"),
        (["analyze"], "tqdm, which is"),
        (["analyze", "--plot", "x.png"], "tqdm and matplotlib, which are"),
    ],
)
def test_cli_names_the_demo_extra_when_missing(monkeypatch, capsys, argv, missing):
    from megatron_mis.cli import main

    for name in DEMO_EXTRA:  # import of a None entry fails; importlib.util.find_spec gives None
        monkeypatch.setitem(sys.modules, name, None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"megatron-mis {argv[0]} needs {missing} not installed" in err, err
    assert 'pip install "megatron-mis[demo]"' in err and "Traceback" not in err


def test_cli_validate_needs_no_demo_extra(monkeypatch, capsys):
    from megatron_mis.cli import main

    for name in DEMO_EXTRA:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["validate", "configs/presets/token_tis.yaml"]) == 0
    assert "valid" in capsys.readouterr().out


def test_cli_names_the_extra_when_a_late_import_fails(monkeypatch, capsys):
    """A [demo] import that fails inside a sub-command (past the up-front check) gives the same
    message, not a traceback."""
    from megatron_mis.cli import analyze, main

    def run(args):
        import tqdm  # noqa: F401 - fails: blocked below

    monkeypatch.setattr(analyze, "run", run)
    import megatron_mis.cli as cli

    monkeypatch.setattr(cli, "_missing_packages", lambda args: [])
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert main(["analyze"]) == 2
    assert 'megatron-mis analyze needs tqdm, which is not installed' in capsys.readouterr().err
