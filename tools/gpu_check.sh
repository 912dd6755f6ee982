#!/usr/bin/env bash
# The device checks of the GPU issue, for a machine with one CUDA GPU (run from the repository
# root; logs go to $OUT, default /tmp/gpu_check). megatron-core travels as a wheel in .whl/
# (Python 3.12 there); everything else (torch with CUDA, pytest, xdist, hypothesis, numpy,
# matplotlib) is the machine's own. Each phase has its own time limit, so one that hangs cannot
# hide the others. Usage: tools/gpu_check.sh [PHASE ...]  (default: every phase)
# The wheel, fetched once where pip reaches PyPI (.whl/ is ignored by git; carry it to the GPU):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# On 2026-11-27 (one H100): env 20 s, demo 20 s, realcuda 77 s, gpu 150 s, bench 60 s, and the
# suite more than its 220 s; run the suite beside realcuda + gpu (GPU against CPUs) and the bench
# alone: 5 minutes in all, e.g.  tools/gpu_check.sh env demo; tools/gpu_check.sh suite > /tmp/suite.out &
#   tools/gpu_check.sh realcuda gpu; wait; cat /tmp/suite.out; tools/gpu_check.sh bench
#   env       versions and the device
#   realcuda  the fake-CUDA tier on the real device under set_sync_debug_mode (MEGATRON_MIS_REAL_CUDA_TIER=1)
#   gpu       the CUDA-only tests (tests that skip without a GPU: NCCL, Megatron on CUDA, bf16, R3, checkpoint)
#   demo      megatron-mis demo (the CPU testbed) on a machine where CUDA is present
#   bench     benchmarks/bench_gpu.py (engine vs reference with CUDA events, kernels per call,
#             loss_func peak memory, the engine's share of a GPT forward + backward)
#   bench-mis bench_mis.py and bench_logprobs.py on the GPU
#   suite     the rest of the suite with CUDA present (xdist, one file per worker; the cuda-marked
#             tests are the gpu phase)
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ ! -d /tmp/site/megatron ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
phases=${*:-env realcuda gpu demo bench suite}
PYTEST="python3 -m pytest -p no:cacheprovider -o addopts= -ra"
for phase in $phases; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  case $phase in
    env) { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
           python3 -c "import sys, torch, megatron.core as m; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__, torch.cuda.get_device_name())"
           python3 -c "import transformer_engine" 2>&1 | tail -1; nproc; } 2>&1 | tee "$OUT/env.txt" ;;
    realcuda) MEGATRON_MIS_REAL_CUDA_TIER=1 timeout 150 $PYTEST -q tests/fakecuda > "$OUT/realcuda.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/realcuda.log"
              echo "tests that recorded a host synchronisation on the GPU: $(grep -c 'host synchronisation(s) on the GPU' "$OUT/realcuda.log")" ;;
    gpu) timeout 240 $PYTEST -q -m cuda tests > "$OUT/gpu.log" 2>&1; echo "rc=$?"; tail -30 "$OUT/gpu.log" ;;
    demo) timeout 90 python3 -m megatron_mis.cli demo --steps 3 --no-plot --no-progress --out-dir /tmp/gpu_demo > "$OUT/demo.log" 2>&1; echo "rc=$?"; tail -15 "$OUT/demo.log" ;;
    bench) timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_gpu.py > "$OUT/bench.log" 2>&1; echo "rc=$?"; tail -40 "$OUT/bench.log" ;;
    bench-mis) { timeout 120 python3 benchmarks/bench_mis.py --device cuda --repeats 7
                 timeout 60 python3 benchmarks/bench_logprobs.py --device cuda --tokens 16384 --vocab 152064 --chunk 4096 --repeats 5
               } > "$OUT/bench-mis.log" 2>&1; echo "rc=$?"; tail -40 "$OUT/bench-mis.log" ;;
    # -v: each test's name and outcome as it finishes, so a run stopped by its time limit still
    # names its failures (a -q log stopped so holds only dots: 2026-11-27, 35 failures unnamed)
    suite) timeout "${SUITE_TIMEOUT:-300}" $PYTEST -v -n "${SUITE_WORKERS:-14}" --dist loadfile --timeout 150 \
             -m "not cuda" tests/unit tests/host tests/distributed tests/e2e > "$OUT/suite.log" 2>&1; echo "rc=$?"
           grep -E "(FAILED|ERROR) |passed|failed" "$OUT/suite.log" | grep -v PASSED | tail -60 ;;
    *) echo "unknown phase $phase (allowed: env realcuda gpu demo bench bench-mis suite)"; exit 2 ;;
  esac
done
