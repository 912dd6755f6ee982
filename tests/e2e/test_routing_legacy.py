"""Routing replay for megatron-core 0.13 - 0.15, against those versions' own source.

The routing code of megatron-core 0.13.1 and 0.15.3 is taken from their PyPI wheels
(``pip download --no-deps``, cached in ``$MEGATRON_MIS_CACHE`` or ``~/.cache/megatron-mis``;
two files per version are kept). Checked here:

- ``patches/megatron-core-0.15.3-router-replay-hook.patch`` applies to 0.15.3 (``git apply
  --check``), and the patched top-k routing replays through our hook and is unchanged without it;
- the runtime legacy patch (:func:`legacy_routing_call`) gives exactly the old functions' outputs
  when it records the natural choice or replays it, and selects the given experts otherwise
  (``topk_routing_with_score_function`` of 0.15.3, ``topk_softmax_with_capacity`` of 0.13.1,
  including token dropping).

The runtime patch is also exercised against the installed 0.16.1 router (backend forced to
``legacy``) in ``test_routing_replay.py``. Without PyPI (and no cached copy) these tests are
skipped with a reason naming the failed download.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

from megatron_mis.routing.replay import _RECORD, _REPLAY, _ReplayHook, legacy_routing_call

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "megatron-core-0.15.3-router-replay-hook.patch"
FILES = ("megatron/core/transformer/moe/moe_utils.py", "megatron/core/transformer/moe/router.py")


def core_source(version: str) -> Path:
    """A folder holding ``FILES`` of megatron-core ``version`` (downloaded once, then cached)."""
    cache = Path(os.environ.get("MEGATRON_MIS_CACHE", Path.home() / ".cache" / "megatron-mis")) / "megatron-core-src" / version
    if all((cache / f).is_file() for f in FILES):
        return cache
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", f"megatron-core=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            # no index reachable (offline machine, proxy): nothing here can be checked, which is
            # not a failure of the package; the reason names the command and its error
            pytest.skip(
                f"megatron-core=={version} source unavailable (no cache in {cache.parent} and "
                f"`{' '.join(cmd)}` -> {proc.returncode}: {proc.stderr.strip()[-300:]}): legacy routing not checked"
            )
        staging = Path(tmp) / "src"
        with zipfile.ZipFile(wheels[0]) as zf:
            for f in FILES:
                zf.extract(f, staging)
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(staging, cache)
    return cache


def load_functions(path: Path, names: list[str]) -> dict:
    """Compile the named top-level functions of an old ``moe_utils.py`` on their own (their
    module imports belong to the old version and are not executed)."""
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for n in nodes:
        n.decorator_list = []
    ns = {"torch": torch, "math": math, "Optional": Optional, "Tuple": Tuple, "HAVE_TE": False,
          "fused_topk_with_score_function": None}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), ns)
    missing = [n for n in names if n not in ns]
    assert not missing, f"{missing} not found in {path}"
    return ns


def _hook(action, target=None):
    h = _ReplayHook(0)
    h.action, h.target = action, target
    return h


def _other_indices(natural: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (natural + 1) % num_experts  # a shift keeps the k ids of a row distinct


CASES_015 = [
    dict(),
    dict(use_pre_softmax=True),
    dict(scaling_factor=2.5),
    dict(num_groups=4, group_topk=2),
    dict(score_function="sigmoid"),
    dict(score_function="sigmoid", expert_bias=torch.linspace(-0.2, 0.2, 16)),
]
CASES_013 = CASES_015 + [
    dict(capacity_factor=1.0, drop_policy="probs"),
    dict(capacity_factor=1.0, drop_policy="position"),
    dict(capacity_factor=1.5, pad_to_capacity=True),
]


@pytest.fixture(scope="module")
def src_015():
    return core_source("0.15.3")


@pytest.fixture(scope="module")
def src_013():
    return core_source("0.13.1")


def _apply(patch: Path, where: Path, check_only: bool) -> subprocess.CompletedProcess:
    if shutil.which("git"):
        cmd = ["git", "apply", "--check" if check_only else "--verbose", str(patch)]
    elif shutil.which("patch"):
        cmd = ["patch", "-p1", "--dry-run" if check_only else "--forward", "-i", str(patch)]
    else:  # pragma: no cover
        pytest.fail("neither git nor patch is installed: cannot check the source patch")
    return subprocess.run(cmd, cwd=where, capture_output=True, text=True, timeout=60)


def test_source_patch_applies_and_replays(src_015, tmp_path):
    shutil.copytree(src_015, tmp_path / "core")
    where = tmp_path / "core"
    check = _apply(PATCH, where, check_only=True)
    assert check.returncode == 0, f"{PATCH.name} does not apply to megatron-core 0.15.3: {check.stderr}"
    assert _apply(PATCH, where, check_only=False).returncode == 0
    assert "router_replay=self.router_replay" in (where / FILES[1]).read_text()
    assert "self.router_replay = None" in (where / FILES[1]).read_text()

    names = ["topk_routing_with_score_function", "group_limited_topk"]
    patched = load_functions(where / FILES[0], names)["topk_routing_with_score_function"]
    original = load_functions(src_015 / FILES[0], names)["topk_routing_with_score_function"]
    assert "router_replay" in inspect.signature(patched).parameters
    logits = torch.randn(12, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for kw in CASES_015:
        natural = original(logits, 4, **kw)
        unhooked = patched(logits, 4, **kw)
        assert all(torch.equal(a, b) for a, b in zip(natural, unhooked))
        target = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:4] for i in range(12)])
        probs, routing_map = patched(logits, 4, router_replay=_hook(_REPLAY, target), **kw)
        want = torch.zeros(12, 16, dtype=torch.bool).scatter(1, target, True)
        assert torch.equal(routing_map, want), kw
        assert bool((probs[~want] == 0).all()) and bool((probs[want] > 0).all())
    probs.sum().backward()
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)  # gradient flows to the router logits


@pytest.mark.parametrize("version", ["0.15.3", "0.13.1"])
def test_runtime_patch_matches_old_routing(version, src_015, src_013):
    src = src_015 if version == "0.15.3" else src_013
    name = "topk_routing_with_score_function" if version == "0.15.3" else "topk_softmax_with_capacity"
    ns = load_functions(src / FILES[0], [name, "group_limited_topk", "get_capacity"])
    original = ns[name]
    sig = inspect.signature(original)
    cases = CASES_015 if version == "0.15.3" else CASES_013
    logits = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    for kw in cases:
        args, kwargs = (logits, 4), dict(kw)
        want = original(*args, **kwargs)
        rec = _hook(_RECORD)
        got = legacy_routing_call(name, sig, rec, args, kwargs)  # natural choice, recorded
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), kw
        again = legacy_routing_call(name, sig, _hook(_REPLAY, rec.recorded), args, kwargs)  # replayed
        assert all(torch.equal(a, b) for a, b in zip(again, want)), kw
        other = _other_indices(rec.recorded, 16)
        probs, routing_map = legacy_routing_call(name, sig, _hook(_REPLAY, other), args, kwargs)[:2]
        chosen = torch.zeros(24, 16, dtype=torch.bool).scatter(1, other, True)
        if "capacity_factor" in kw:
            kept = routing_map & chosen
            assert bool(kept.any()), kw  # the replayed experts are used where capacity allows
            assert bool((probs[~kept] == 0).all()), kw  # no probability outside the replayed, kept slots
            if kw.get("pad_to_capacity"):
                # padded: every expert holds exactly its capacity (unchosen tokens fill it, with probability 0)
                cap = ns["get_capacity"](num_tokens=24 * 4, num_experts=16, capacity_factor=kw["capacity_factor"])
                assert routing_map.sum(0).tolist() == [cap] * 16, kw
            else:
                assert torch.equal(routing_map, kept), kw  # drops only: nothing outside the replayed experts
                assert bool((routing_map.sum(0) <= ns["get_capacity"](
                    num_tokens=24 * 4, num_experts=16, capacity_factor=kw["capacity_factor"])).all()), kw
        else:
            assert torch.equal(routing_map, chosen), kw
        if not kw:  # softmax over the gathered logits, by hand
            ref = torch.zeros(24, 16).scatter(1, other, torch.softmax(logits.gather(1, other), dim=-1))
            assert torch.equal(probs, ref)
