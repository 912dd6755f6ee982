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


LIBRARY = ("core", "parallel", "integrations", "routing", "monitor", "config")


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file imports, absolute names (relative imports resolved against ``package``)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_library_never_imports_the_testbed():
    root = REPO / "megatron_mis"
    files = [p for sub in LIBRARY for p in sorted((root / sub).rglob("*.py"))]
    files += [p for p in sorted(root.glob("*.py"))]  # top-level modules; cli/ is a package, not listed
    assert len(files) > 20 and (root / "testbed").is_dir()
    offenders = {}
    for path in files:
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        package = ".".join(parts if parts[-1] == "__init__" else parts[:-1])
        bad = sorted(m for m in _imported_modules(path, package)
                     if m == "megatron_mis.testbed" or m.startswith("megatron_mis.testbed."))
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert not offenders, offenders
