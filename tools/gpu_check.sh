#!/usr/bin/env bash
# The checks that need a GPU, for a machine with CUDA and the package importable (PYTHONPATH or an
# install): the real-device tests, then the fake-CUDA tier's tests on the real device under
# torch.cuda.set_sync_debug_mode (megatron_mis/testing/real_cuda.py). Writes LOG_DIR/gpu_tier.log.
# Usage: tools/gpu_check.sh [LOG_DIR]   (default: .)
set -u
out=${1:-.}
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"
MEGATRON_MIS_REAL_CUDA_TIER=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} timeout ${TIER_TIMEOUT:-300} \
  python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/fakecuda 2>&1 | tee "$out/gpu_tier.log" | tail -40
# What matters on the GPU is the synchronisations. The tier's value checks compare bitwise with a
# CPU reference (exact on the fake device, which computes on the CPU); on a GPU they may fail at
# fp32 rounding (kernels differ), which is not a synchronisation.
echo "tests that recorded a host synchronisation on the GPU: $(grep -c 'host synchronisation(s) on the GPU' "$out/gpu_tier.log")"
echo "tests whose value check differs from the CPU reference: $(grep -c 'not equal!\|comparison failed' "$out/gpu_tier.log")"
