#!/usr/bin/env bash
# The device checks of issue #19 that exist so far, for a machine with a CUDA GPU (the
# `device` tool's lent H200): the GPU tests, then plan replay on the device against
# cudaMemcpy device to device (bench_device_copy). Run from the repository root with a
# build folder made here (make build: the CUDA plugin is built when nvcc is found):
#
#   scripts/device-check.sh [BUILD]      # default build; prints figures, exits non-zero on a failure
#
# Bounded: each step has its own timeout; the whole script takes about 4 minutes on an H200.
# Check 2 runs ferry serve / fetch as processes with weights and params on cuda:0, once
# staging in GPU memory read by CUDA IPC, once through pinned host memory over UCX, and
# prints GB/s per sync beside the device's own copy rates (ferry devices --bandwidth).
# CHECK_MODEL / CHECK_OVERRIDES choose its model (a dry run here, under the emulated
# plugin: FERRY_CUDA_PLUGIN=build/tests/tensor/libferry_cuda_emulated.so
# CHECK_OVERRIDES='{"num_hidden_layers": 1, "num_experts": 8}' scripts/device-check.sh).
set -euo pipefail
B="${1:-build}"
cd "$(dirname "$0")/.."
export FERRY_CUDA_PLUGIN="${FERRY_CUDA_PLUGIN:-$PWD/$B/lib/ferry/libferry_cuda.so}"
echo "== plugin: $FERRY_CUDA_PLUGIN"
echo "== nvidia-smi"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
echo "== GPU tests (the CPU ones beside them)"
timeout 120 "$B/tests/tensor/device_test" --gtest_color=no
timeout 120 "$B/tests/route/route_test" --gtest_color=no --gtest_filter='*Gpu*:*Pack*'
timeout 120 "$B/tests/models/models_fp8_test" --gtest_color=no --gtest_filter='Fp8.*'
timeout 180 "$B/tests/engine/engine_test" --gtest_color=no --gtest_filter='EngineDevice.*'
timeout 120 "$B/tests/engine/engine_parts_test" --gtest_color=no --gtest_filter='StagingRingDevice.*'
timeout 120 "$B/tests/cli/serve_cli_test" --gtest_color=no --gtest_filter='GpuServeCli.*'
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  (cd tests/python && PYTHONPATH="$PWD/../../$B/python" timeout 120 python3 test_device.py -v)
else
  echo "python: torch with CUDA not importable here; test_device.py's GPU case not run"
fi
echo "== bench_device_copy (plan replay on the device vs cudaMemcpy D2D, medians of 5)"
timeout 300 "$B/bench/bench_device_copy" --benchmark_min_time=0.2
echo "== copy rates of the device (device to device, pinned host <-> device; 1 GiB, medians of 5)"
timeout 120 "$B/src/cli/ferry" devices --bandwidth $((1 << 30))
echo "== check 2: a multi-process sync on the GPU (2 serve + 2 fetch processes)"
CK=$(mktemp -d /tmp/ferry-device-check-XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$CK"' EXIT
OV='{"num_hidden_layers": 2}'
if [ -n "${CHECK_OVERRIDES:-}" ]; then OV="$CHECK_OVERRIDES"; fi
echo "model ${CHECK_MODEL:-configs/qwen3-30b-a3b.json}, overrides $OV"
timeout 240 "$B/src/cli/ferry" checkpoint --model "${CHECK_MODEL:-configs/qwen3-30b-a3b.json}" --config-overrides "$OV" \
  --out "$CK/ckpt"
export FERRY_TOKEN="device-check-$(date +%s)-$$-token"
"$B/src/cli/ferry" store --port 29517 > "$CK/store.log" 2>&1 &
sleep 1
sync_case() {  # name, serve flags, fetch flags
  local name="$1" sflags="$2" fflags="$3" pids=()
  for r in 0 1; do
    timeout 300 "$B/src/cli/ferry" serve --store tcp://127.0.0.1:29517 --job "$name" --trainer tp=2 --inference tp=2 \
      --rank $r --checkpoint "$CK/ckpt" --syncs 3 --device cuda:0 $sflags > "$CK/$name-serve-$r.log" 2>&1 & pids+=($!)
    timeout 300 "$B/src/cli/ferry" fetch --store tcp://127.0.0.1:29517 --job "$name" --trainer tp=2 --inference tp=2 \
      --rank $r --model "$CK/ckpt/config.json" --verify "$CK/ckpt" --syncs 3 --device cuda:0 $fflags \
      > "$CK/$name-fetch-$r.log" 2>&1 & pids+=($!)
  done
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  python3 - "$CK" "$name" <<'PY'
import json, sys, glob
ck, name = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(f"{ck}/{name}-fetch-*.log")):
    for line in open(path):
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        gbps = j.get("bytes", 0) / j["seconds"] / 1e9 if j.get("seconds") else 0
        print(f"{name} inference rank {j['rank']} version {j['version']}: ok {j['ok']} verified {j.get('verified')} "
              f"{j.get('bytes', 0)} bytes in {j.get('seconds', 0):.4f} s = {gbps:.2f} GB/s, "
              f"via CUDA IPC {j.get('received_via_cuda_ipc', 0)} bytes")
PY
  if [ "$failed" != 0 ]; then echo "$name: a rank failed; logs:"; tail -n 5 "$CK/$name"-*.log; return 1; fi
}
sync_case cuda-ipc "--gpu-staging" ""
sync_case pinned-host "" "--no-cuda-ipc"
