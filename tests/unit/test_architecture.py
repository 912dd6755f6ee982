"""Architecture rules that keep the tree a map: pure math never imports Megatron, and importing the
package, its configs or the rollout-side helpers stays cheap (no Megatron, no Transformer Engine,
no SGLang)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


def _module_imports(path: Path, module: str) -> set[str]:
    """Every ``megatron_mis`` module imported anywhere in the file (module level, inside
    functions, under ``if TYPE_CHECKING``), resolved to the module it names."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("megatron_mis")}


def test_package_has_no_import_cycle():
    """Imports between the package's modules form a DAG (module- and function-level imports
    both count: a function-level import of a module that imports you back is still a cycle).
    ``from pkg import name`` counts as an import of ``pkg.name`` where that is a module, else of
    ``pkg``; a package's ``__init__`` imports are its own edges."""
    root = REPO / "megatron_mis"
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _module_imports(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    # ancestors' __init__ run first but do not make a cycle by themselves; only module edges count
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


LIBRARY = ("core", "parallel", "integrations", "routing", "monitor", "config")
#: What users import: the library, the dump analysis and the CPU / test helpers, and the top-level
#: modules (presets, registry, lr_schedule); NOT the testbed (demo, study, CPU models), the CLI or
#: anything private (``_version``, ``_``-prefixed names).
PUBLIC = LIBRARY + ("analysis", "testing")


def test_library_never_imports_the_testbed():
    root = REPO / "megatron_mis"
    files = [p for sub in PUBLIC for p in sorted((root / sub).rglob("*.py"))]
    files += [p for p in sorted(root.glob("*.py"))]  # top-level modules; cli/ is a package, not listed
    assert len(files) > 20 and (root / "testbed").is_dir()
    offenders = {}
    for path in files:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        bad = sorted(m for m in _module_imports(path, module)
                     if m == "megatron_mis.testbed" or m.startswith("megatron_mis.testbed."))
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert not offenders, offenders


def _is_public(module: str) -> bool:
    """``megatron_mis`` itself, a module of a PUBLIC package, or a public top-level module."""
    parts = module.split(".")
    if parts[0] != "megatron_mis" or any(p.startswith("_") for p in parts[1:]):
        return False
    if len(parts) == 1 or parts[1] in PUBLIC:
        return True
    return len(parts) <= 3 and (REPO / "megatron_mis" / f"{parts[1]}.py").is_file()


def _resolves(name: str) -> bool:
    """``name`` is an importable module or an attribute of one."""
    import importlib
    import importlib.util

    module, attr = name, None
    while module:
        try:
            if importlib.util.find_spec(module) is not None:
                break
        except ModuleNotFoundError:  # a parent is a module, not a package
            pass
        module, _, attr = module.rpartition(".")
    if not module:
        return False
    rest = name[len(module) + 1 :]
    obj = importlib.import_module(module)
    for part in rest.split(".") if rest else []:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _example_offenders(paths: list[Path]) -> dict[str, list[str]]:
    offenders: dict[str, list[str]] = {}
    for path in paths:
        for m in sorted(_module_imports(path, "examples." + path.stem)):
            if not _is_public(m) or not _resolves(m):
                offenders.setdefault(path.name, []).append(m)
    return offenders


def test_examples_import_only_the_public_api(tmp_path):
    """A user copies an example into their job: every ``megatron_mis`` import in ``examples/``
    names a module (or a name in one) that exists and belongs to the public API, never the
    testbed, the CLI or a private module. The rule catches planted imports."""
    examples = sorted((REPO / "examples").rglob("*.py"))
    assert examples, "no Python examples found"
    assert not _example_offenders(examples)
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from megatron_mis.testbed.demo.train import run_rank\n"
        "from megatron_mis.integrations.megatron import MegatronRLLoss, NoSuchName\n"
        "def f():\n    import megatron_mis._version\n    from megatron_mis.cli import demo\n"
    )
    assert _example_offenders([planted]) == {"planted.py": [
        "megatron_mis._version", "megatron_mis.cli", "megatron_mis.cli.demo",
        "megatron_mis.integrations.megatron.NoSuchName", "megatron_mis.testbed.demo.train",
        "megatron_mis.testbed.demo.train.run_rank",
    ]}


def test_tests_live_in_their_tiers():
    """Every test file sits in one tier directory, pytest's default run covers exactly the three
    tiers, and CI runs that default run (``make test`` -> ``python -m pytest``)."""
    import configparser

    tests = REPO / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "test files belong in tests/unit, distributed or e2e"
    tiers = ["tests/unit", "tests/distributed", "tests/e2e", "tests/fakecuda", "tests/host"]
    for tier in tiers:
        assert sorted((REPO / tier).glob("test_*.py")), tier
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    assert ini["pytest"]["testpaths"].split() == tiers
    assert "$(BIN)/python -m pytest\n" in (REPO / "Makefile").read_text()
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"
