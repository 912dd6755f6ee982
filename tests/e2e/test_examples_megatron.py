"""``examples/megatron/train_grpo.py`` launched the documented way, ``torchrun --standalone
--nproc-per-node 2``, on CPU (gloo) for three short steps. Pipeline parallelism (PP=2) here
because the demo tests cover TP and CP: the rollout engine gathers the two stages' weights, and
its fp32 log-probs agree with the pipelined trainer's recompute to fp32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron" / "train_grpo.py"


def _torchrun(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchrun_two_processes_pipeline_parallel(tmp_path):
    proc = _torchrun(
        "--pp", "2", "--quick", "--rollout-precision", "fp32", "--no-progress", "--out-dir", str(tmp_path),
        "--name", "ex", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TP=1 CP=1 PP=2 DP=1: 2 process(es) on gloo" in proc.stdout
    records = [json.loads(x) for x in (tmp_path / "ex" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        # the engine mirrors the two-stage model: fp32 rounding only (a stage missing from the
        # gathered weights would give differences of order 1)
        assert 0 < r["logprob_abs_diff_max"] < 5e-6
        assert r["mis_k3_kl"] < 1e-12
        assert r["grad_norm"] > 0 and r["loss"] == r["loss"]
    assert (tmp_path / "ex" / "report.png").stat().st_size > 10_000


def test_bad_layout_is_refused_before_any_process_group(tmp_path):
    proc = _torchrun("--tp", "4", "--quick", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "WORLD_SIZE=2 is not a multiple of tp x cp x pp = 4" in proc.stderr
