"""``examples/megatron/train_grpo.py`` launched the documented way, ``torchrun --standalone
--nproc-per-node 2``, on CPU (gloo).

- Pipeline parallelism (PP=2) with fp32 rollouts for three steps: the rollout samples through
  Megatron's forward-only schedule and the pipeline broadcast of sampled tokens, and its log-probs
  agree with the trainer's fp32 recompute to fp32 rounding (a stage that saw other tokens than
  the last one sampled would give differences of order 1); the loss, Megatron's optimizer (on
  the CPU through :func:`megatron_mis.testing.cpu.cpu_compat`) and the metrics file work.
- Context parallelism (CP=2) with bf16 rollouts for two steps: the mismatch is measured (K3 of
  bf16 rounding, far above the fp32 floor) and training runs.
- Bad flags are all reported at once, before any process group exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron" / "train_grpo.py"


def _torchrun(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # --device cpu: these tests are about the CPU (gloo) path, also on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--device", "cpu", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_pipeline_parallel_fp32_rollouts_match_the_trainer(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _torchrun("--pp", "2", "--steps", "3", "--rollout-dtype", "fp32", "--metrics", str(metrics), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TP=1 CP=1 PP=2 DP=1: 2 process(es) on gloo" in proc.stdout
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 <= r["logprob_abs_diff_max"] < 5e-6
        assert r["mis_k3_kl"] < 1e-12
        assert r["num_loss_tokens"] == 16 * 8 * 3  # prompts x samples x digits, nothing lost
        assert 0 < r["grad_norm"] < 1e3 and r["loss"] == r["loss"]
        assert 0 <= r["reward_mean"] <= 1


def test_context_parallel_bf16_rollouts_show_the_mismatch(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _torchrun("--cp", "2", "--steps", "2", "--metrics", str(metrics), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TP=1 CP=2 PP=1 DP=1: 2 process(es) on gloo; rollouts in bf16" in proc.stdout
    for r in _records(metrics):
        # bf16 logits: |d log p| ~ 1e-3 and K3 ~ 1e-7, orders of magnitude above fp32's ~1e-7 and ~1e-14
        assert 1e-4 < r["logprob_abs_diff_max"] < 0.5
        assert 1e-10 < r["mis_k3_kl"] < 1e-3
        assert r["grad_norm"] > 0


def test_bad_flags_are_refused_together_before_any_process_group(tmp_path):
    proc = _torchrun("--tp", "4", "--mis-config", "no_such_preset", "--lr", "0", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "WORLD_SIZE=2 is not a multiple of tp x cp x pp = 4" in proc.stderr
    assert "no_such_preset" in proc.stderr
    assert "--lr=0.0 must be > 0" in proc.stderr
    assert "TP=" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_refused(tmp_path):
    """``--device cuda`` where torch sees no GPU (this CI machine): refused before any process
    group, naming the flag and the way out."""
    proc = _torchrun("--device", "cuda", "--steps", "1", cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "--device=cuda but CUDA is not available here" in proc.stderr and "use --device cpu" in proc.stderr
    assert "TP=" not in proc.stdout
