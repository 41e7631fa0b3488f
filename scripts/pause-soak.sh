#!/usr/bin/env bash
# Pauses a trainer rank at random moments of a long `ferry serve` / `ferry fetch` run and
# counts the healthy inference ranks it drops (issue 49, finding 1: a rank must not blame
# others for its own pause). Two serve ranks (tp=2) and four fetch ranks (tp=2 x 2
# replicas) of a shrunk Qwen3-30B-A3B sync back to back on defaults; PAUSES times, a
# random serve rank gets SIGSTOP for PAUSE_MS at a random moment, then SIGCONT, with a
# random gap between pauses. Every fetch verifies every sync against the checkpoint.
#
#   scripts/pause-soak.sh [PAUSES=30] [PAUSE_MS=6000] [BUILD=build]
#
# Prints each pause, then per rank the syncs it ran and the drops its reports name; exits
# 1 if any rank failed or any fetch rank was dropped from a sync (by a paused producer or
# any other), 0 otherwise. Logs under $OUT (default: a fresh /tmp/pause-soak.XXXXXX).
# Bounded: the run ends after the last pause plus one sync's timeout.
set -euo pipefail
PAUSES=${1:-30}
PAUSE_MS=${2:-6000}
BUILD=${3:-build}
cd "$(dirname "$0")/.."
FERRY=$PWD/$BUILD/src/cli/ferry
[ -x "$FERRY" ] || { echo "pause-soak: no $FERRY (make build first)" >&2; exit 2; }
OUT=${OUT:-$(mktemp -d /tmp/pause-soak.XXXXXX)}
export FERRY_TOKEN=pause-soak-token-$RANDOM$RANDOM$RANDOM
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

"$FERRY" checkpoint --model ../shared/models/qwen3-30b-a3b.json --shrink --out "$OUT/ck" > /dev/null
"$FERRY" store --port 0 > "$OUT/store.log" 2>&1 &
pids+=($!)
port=""
for _ in $(seq 1 100); do
  port=$(grep -oE '127\.0\.0\.1:[0-9]+' "$OUT/store.log" | head -1 | cut -d: -f2 || true)
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "pause-soak: the store did not start: $(cat "$OUT/store.log")" >&2; exit 1; }
STORE=tcp://127.0.0.1:$port
# Enough syncs to outlast every pause: a sync of this model takes milliseconds, so the
# run is ended by the script (SIGTERM after the last pause), not by --syncs.
SYNCS=1000000
common=(--store "$STORE" --trainer tp=2 --inference tp=2,replicas=2 --syncs "$SYNCS" --job soak)
serve=()
for r in 0 1; do
  "$FERRY" serve "${common[@]}" --rank $r --checkpoint "$OUT/ck" > "$OUT/serve$r.log" 2>&1 &
  serve+=($!); pids+=($!)
done
fetch=()
for r in 0 1 2 3; do
  "$FERRY" fetch "${common[@]}" --rank $r --model "$OUT/ck/config.json" --verify "$OUT/ck" > "$OUT/fetch$r.log" 2>&1 &
  fetch+=($!); pids+=($!)
done
echo "pause-soak: store $STORE, logs in $OUT; $PAUSES pauses of $PAUSE_MS ms of a random serve rank"
sleep 3
for i in $(seq 1 "$PAUSES"); do
  for p in "${serve[@]}" "${fetch[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "pause-soak: rank pid $p exited early; see $OUT" >&2; exit 1; }
  done
  r=$((RANDOM % 2))
  # A random moment: 0-2 s after the last resume, in ms steps.
  sleep "$(awk -v m=$((RANDOM % 2000)) 'BEGIN { printf "%.3f", m / 1000 }')"
  kill -STOP "${serve[$r]}"
  sleep "$(awk -v m="$PAUSE_MS" 'BEGIN { printf "%.3f", m / 1000 }')"
  kill -CONT "${serve[$r]}"
  echo "pause $i: serve rank $r stopped for $PAUSE_MS ms"
done
sleep 3
for p in "${serve[@]}" "${fetch[@]}"; do kill -INT "$p" 2>/dev/null || true; done
sleep 2
cleanup
trap - EXIT
python3 - "$OUT" <<'PY'
import glob, json, os, sys
bad = False
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.log"))):
    name = os.path.basename(f)[:-4]
    if name == "store":
        continue
    ok = failed = unverified = 0
    drops, errors = [], []
    for line in open(f, errors="replace"):
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue  # the line a SIGINT cut short
        ok += bool(r.get("ok"))
        if not r.get("ok"):
            failed += 1
            errors.append(f"sync {r.get('version')}: {r.get('error')}")
        if r.get("role") == "inference" and r.get("ok") and not r.get("verified"):
            unverified += 1
        if r.get("dropped"):
            drops.append(f"sync {r.get('version')}: dropped {r['dropped']}: " +
                         "; ".join(e.get("detail", str(e)) if isinstance(e, dict) else str(e) for e in r.get("events", []))[:300])
    print(f"{name}: {ok} syncs ok, {failed} failed, {unverified} ok but not verified, {len(drops)} with drops")
    for line in (drops + errors)[:5]:
        print("  " + line[:400])
    bad = bad or failed or unverified or drops or ok == 0
print("pause-soak: FAILED" if bad else "pause-soak: no rank dropped, every sync ok and verified")
sys.exit(1 if bad else 0)
PY
