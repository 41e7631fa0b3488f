#!/usr/bin/env bash
# ferry's UCX read/write bandwidth against ucx_perftest (ucp_get / ucp_put_bw), same
# message sizes, same UCX_TLS, same window, run side by side (interleaved per size,
# best of REPEAT runs each), for shm and tcp on loopback.
#
#   bench/transport_vs_perftest.sh [BUILD_DIR]        (default: build)
#   env: SIZES="65536 ... 67108864"  BYTES_PER_SIZE=1073741824  WINDOW=16  REPEAT=3
#        TLS_LIST="sm,self sm,tcp,self tcp,self"  SM_BYTES_PER_SIZE=16*BYTES_PER_SIZE
# Prints a table: size, perftest MB/s, ferry MB/s, ratio (MB = 2^20 bytes).
# Shared memory moves ~30x more per second than tcp on loopback, so it gets 16x the
# bytes: with 256 MiB a run of 1 MiB sm reads was timed over ~6 ms, and one preemption
# on the shared machine halved either tool's figure.
set -euo pipefail
BUILD=${1:-build}
BIN=$BUILD/bench/bench_transport_ucx
SIZES=${SIZES:-"65536 262144 1048576 4194304 16777216 67108864"}
BYTES_PER_SIZE=${BYTES_PER_SIZE:-1073741824}
SM_BYTES_PER_SIZE=${SM_BYTES_PER_SIZE:-$((16 * BYTES_PER_SIZE))}
WINDOW=${WINDOW:-16}
REPEAT=${REPEAT:-3}
TLS_LIST=${TLS_LIST:-"sm,self sm,tcp,self tcp,self"}

command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (Debian: ucx-utils)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "$BIN not built (cmake --build $BUILD --target bench_transport_ucx)" >&2; exit 1; }

export UCX_NET_DEVICES=lo

best() { sort -g | tail -1; }

# perftest TEST SIZE ITERS -> overall MB/s
perftest() {
  local test=$1 size=$2 iters=$3 port out
  for attempt in 1 2 3; do
    port=$((20000 + RANDOM % 30000))
    # -e: error-handling (PEER) endpoints, as ferry's. With shared memory in UCX_TLS,
    # ferry reads and writes on a mode-NONE shared-memory endpoint (its messages and
    # failure reports go on a second, tcp one): so perftest runs without -e there, over
    # shared memory too.
    local errmode="-e"
    [[ "$UCX_TLS" == *sm* || "$UCX_TLS" == *posix* || "$UCX_TLS" == *sysv* || "$UCX_TLS" == *cma* ]] && errmode=""
    ucx_perftest -p "$port" $errmode >/dev/null 2>&1 &
    local server=$!
    sleep 0.3
    out=$(timeout 120 ucx_perftest 127.0.0.1 -p "$port" $errmode -t "$test" -s "$size" -n "$iters" \
          -w $((iters / 10 + 2)) -O "$WINDOW" 2>/dev/null | awk '/Final:/ {print $7}') || true
    wait "$server" 2>/dev/null || true
    if [ -n "$out" ]; then echo "$out"; return; fi
  done
  echo 0
}

# ferry OP SIZE ITERS -> MB/s
ferry() {
  local op=$1 size=$2 iters=$3
  timeout 120 "$BIN" --tls "$UCX_TLS" --op "$op" --sizes "$size" --iters "$iters" --window "$WINDOW" 2>/dev/null \
    | awk '/^ferry/ {print $4}' || echo 0
}

echo "ferry UCX vs ucx_perftest — window $WINDOW, best of $REPEAT, bytes per size $BYTES_PER_SIZE (sm: $SM_BYTES_PER_SIZE), $(nproc) cores, $(ucx_info -v | awk '/Version/ {print "UCX " $3}'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
for tls in $TLS_LIST; do
  export UCX_TLS=$tls
  bytes=$BYTES_PER_SIZE
  [[ "$tls" == *sm* || "$tls" == *posix* || "$tls" == *sysv* || "$tls" == *cma* ]] && bytes=$SM_BYTES_PER_SIZE
  for pair in "read ucp_get" "write ucp_put_bw"; do
    set -- $pair
    op=$1 test=$2
    echo
    echo "UCX_TLS=$tls  ferry $op vs ucx_perftest -t $test"
    printf "%10s %14s %12s %7s\n" size perftest_MB/s ferry_MB/s ratio
    for size in $SIZES; do
      iters=$((bytes / size)); [ "$iters" -lt 8 ] && iters=8
      p=(); f=()
      for r in $(seq "$REPEAT"); do
        p+=("$(perftest "$test" "$size" "$iters")")
        f+=("$(ferry "$op" "$size" "$iters")")
      done
      pb=$(printf "%s\n" "${p[@]}" | best)
      fb=$(printf "%s\n" "${f[@]}" | best)
      ratio=$(awk -v a="$fb" -v b="$pb" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }')
      printf "%10s %14.1f %12.1f %7s\n" "$size" "$pb" "$fb" "$ratio"
    done
  done
done
