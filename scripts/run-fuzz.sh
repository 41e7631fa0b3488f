#!/usr/bin/env bash
# Runs every libFuzzer target in DIR for SECONDS each, on a corpus kept under DIR, FUZZ_JOBS
# targets at a time (default: the cores; each target is one process on one core).
# Usage: scripts/run-fuzz.sh DIR [SECONDS]
set -euo pipefail
dir=$1; seconds=${2:-30}
jobs=${FUZZ_JOBS:-$(nproc)}
seeds_root="$(cd "$(dirname "$0")/.." && pwd)/fuzz/seeds"
targets=()
for f in "$dir"/fuzz_*; do
  [ -x "$f" ] && [ -f "$f" ] && targets+=("$f")
done
if [ ${#targets[@]} -eq 0 ]; then
  echo "fuzz: no fuzz_* targets in $dir" >&2
  exit 1
fi

run_one() {  # run_one TARGET: its log in DIR/NAME.log, its status in DIR/NAME.status
  local f=$1 name corpus
  name=$(basename "$f")
  corpus="$dir/corpus/$name"
  mkdir -p "$corpus"
  local args=("$corpus")
  [ -d "$seeds_root/$name" ] && args+=("$seeds_root/$name")
  if "$f" -max_total_time="$seconds" -print_final_stats=0 -artifact_prefix="$dir/$name-" "${args[@]}" >"$dir/$name.log" 2>&1; then
    echo 0 >"$dir/$name.status"
  else
    echo 1 >"$dir/$name.status"
  fi
}

echo "fuzz: ${#targets[@]} targets, ${seconds}s each, $jobs at a time"
running=0
for f in "${targets[@]}"; do
  run_one "$f" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

status=0
for f in "${targets[@]}"; do
  name=$(basename "$f")
  if [ "$(cat "$dir/$name.status" 2>/dev/null)" != 0 ]; then
    echo "fuzz: $name FAILED"; tail -40 "$dir/$name.log"; status=1
  else
    echo "fuzz: $name: $(grep -E "^Done|^#[0-9]+.*DONE" "$dir/$name.log" | tail -1 || true)"
  fi
done
exit $status
