"""Architecture rules that keep the tree a map: pure math never imports Megatron, and importing the
package, its configs or the rollout-side helpers stays cheap (no Megatron, no Transformer Engine,
no SGLang)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = sorted(p.stem for p in (REPO / "megatron_mis" / "core").glob("*.py") if p.stem != "__init__")


def _loaded_after(imports: list[str]) -> set[str]:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in imports)
        + "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "imports",
    [
        [f"megatron_mis.core.{m}" for m in CORE],
        ["megatron_mis", "megatron_mis.config", "megatron_mis.config.sections", "megatron_mis.monitor",
         "megatron_mis.routing.sglang", "megatron_mis.routing.routes", "megatron_mis.routing.config"],
    ],
    ids=["core", "package-configs-rollout"],
)
def test_no_heavy_imports(imports):
    loaded = _loaded_after(imports)
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("megatron", "transformer_engine", "sglang", "apex"))
    assert not heavy, heavy
    if imports[0].startswith("megatron_mis.core"):
        ours = {m for m in loaded if m.startswith("torch.distributed")} - _loaded_after(["torch"])
        assert not ours, sorted(ours)
