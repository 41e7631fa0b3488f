#!/usr/bin/env bash
# The device checks of issue #19 that exist so far, for a machine with a CUDA GPU (the
# `device` tool's lent H200): the GPU tests, then plan replay on the device against
# cudaMemcpy device to device (bench_device_copy). Run from the repository root with a
# build folder made here (make build: the CUDA plugin is built when nvcc is found):
#
#   scripts/device-check.sh [BUILD]      # default build; prints figures, exits non-zero on a failure
#
# Bounded: each step has its own timeout; the whole script takes about 2 minutes on an H200.
set -euo pipefail
B="${1:-build}"
cd "$(dirname "$0")/.."
export FERRY_CUDA_PLUGIN="${FERRY_CUDA_PLUGIN:-$PWD/$B/lib/ferry/libferry_cuda.so}"
echo "== nvidia-smi"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
echo "== GPU tests (the CPU ones beside them)"
timeout 120 "$B/tests/tensor/device_test" --gtest_color=no
timeout 120 "$B/tests/route/route_test" --gtest_color=no --gtest_filter='*Gpu*:*Pack*'
timeout 120 "$B/tests/models/models_fp8_test" --gtest_color=no --gtest_filter='Fp8.*'
timeout 180 "$B/tests/engine/engine_test" --gtest_color=no --gtest_filter='EngineDevice.*'
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  (cd tests/python && PYTHONPATH="$PWD/../../$B/python" timeout 120 python3 test_device.py -v)
else
  echo "python: torch with CUDA not importable here; test_device.py's GPU case not run"
fi
echo "== bench_device_copy (plan replay on the device vs cudaMemcpy D2D, medians of 5)"
timeout 300 "$B/bench/bench_device_copy" --benchmark_min_time=0.2
