#!/usr/bin/env bash
# Runs every libFuzzer target in DIR for SECONDS each, on a corpus kept under build.
set -euo pipefail
dir=$1; seconds=${2:-30}
status=0
for f in "$dir"/fuzz_*; do
  [ -x "$f" ] || continue
  name=$(basename "$f")
  corpus="$dir/corpus/$name"
  mkdir -p "$corpus"
  seeds="$(dirname "$0")/../fuzz/seeds/$name"
  args=("$corpus")
  [ -d "$seeds" ] && args+=("$seeds")
  echo "fuzz: $name for ${seconds}s"
  if ! "$f" -max_total_time="$seconds" -print_final_stats=0 -artifact_prefix="$dir/" "${args[@]}" >"$dir/$name.log" 2>&1; then
    echo "fuzz: $name FAILED"; tail -40 "$dir/$name.log"; status=1
  else
    grep -E "^Done|^#[0-9]+.*DONE" "$dir/$name.log" | tail -1 || true
  fi
done
exit $status
