#!/usr/bin/env bash
# Pauses ranks at random moments of a long `ferry serve` / `ferry fetch` run (issue 49).
#
# PAUSE_ROLE=serve (the default; finding 1: a rank must not blame others for its own
# pause): a random trainer rank gets SIGSTOP for PAUSE_MS at a random moment, then
# SIGCONT. Every fetch must verify every sync; no fetch rank may be dropped.
#
# PAUSE_ROLE=fetch (finding 2: a hung consumer): fetch rank PAUSE_RANK (default 1) is
# stopped instead. It is dropped from the syncs it hangs in; every other rank must verify
# every sync, and each producer's drop of the hung rank is listed with when it came (ms
# into the sync), to compare with the straggler bound set (--straggler-floor in EXTRA).
#
# Defaults: two serve ranks (tp=2) and four fetch ranks (tp=2 x 2 replicas) of a shrunk
# Qwen3-30B-A3B syncing back to back; TRAINER, INFERENCE, SERVE_RANKS, FETCH_RANKS and
# EXTRA (options every rank gets) change that. Pauses come 0-2 s apart.
#
#   scripts/pause-soak.sh [PAUSES=30] [PAUSE_MS=6000] [BUILD=build]
#
# Prints each pause, then per rank the syncs it ran, failed and was dropped from; exits 1
# if a healthy rank failed or was dropped from a sync, 0 otherwise. Logs under $OUT
# (default: a fresh /tmp/pause-soak.XXXXXX). Bounded: the run ends 3 s after the last pause.
set -euo pipefail
PAUSES=${1:-30}
PAUSE_MS=${2:-6000}
BUILD=${3:-build}
PAUSE_ROLE=${PAUSE_ROLE:-serve}
PAUSE_RANK=${PAUSE_RANK:-1}
TRAINER=${TRAINER:-tp=2}
INFERENCE=${INFERENCE:-tp=2,replicas=2}
SERVE_RANKS=${SERVE_RANKS:-2}
FETCH_RANKS=${FETCH_RANKS:-4}
read -r -a extra <<< "${EXTRA:-}"
case "$PAUSE_ROLE" in serve|fetch) ;; *) echo "pause-soak: PAUSE_ROLE must be serve or fetch, not '$PAUSE_ROLE'" >&2; exit 2;; esac
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
common=(--store "$STORE" --trainer "$TRAINER" --inference "$INFERENCE" --syncs "$SYNCS" --job soak "${extra[@]}")
serve=()
for r in $(seq 0 $((SERVE_RANKS - 1))); do
  "$FERRY" serve "${common[@]}" --rank $r --checkpoint "$OUT/ck" > "$OUT/serve$r.log" 2>&1 &
  serve+=($!); pids+=($!)
done
fetch=()
for r in $(seq 0 $((FETCH_RANKS - 1))); do
  "$FERRY" fetch "${common[@]}" --rank $r --model "$OUT/ck/config.json" --verify "$OUT/ck" > "$OUT/fetch$r.log" 2>&1 &
  fetch+=($!); pids+=($!)
done
what="a random serve rank"
[ "$PAUSE_ROLE" = fetch ] && what="fetch rank $PAUSE_RANK"
echo "pause-soak: store $STORE, logs in $OUT; $PAUSES pauses of $PAUSE_MS ms of $what"
sleep 3
for i in $(seq 1 "$PAUSES"); do
  for p in "${serve[@]}" "${fetch[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "pause-soak: rank pid $p exited early; see $OUT" >&2; exit 1; }
  done
  if [ "$PAUSE_ROLE" = serve ]; then r=$((RANDOM % SERVE_RANKS)); pid=${serve[$r]}; else r=$PAUSE_RANK; pid=${fetch[$r]}; fi
  # A random moment: 0-2 s after the last resume, in ms steps.
  sleep "$(awk -v m=$((RANDOM % 2000)) 'BEGIN { printf "%.3f", m / 1000 }')"
  kill -STOP "$pid"
  sleep "$(awk -v m="$PAUSE_MS" 'BEGIN { printf "%.3f", m / 1000 }')"
  kill -CONT "$pid"
  echo "pause $i: $PAUSE_ROLE rank $r stopped for $PAUSE_MS ms"
done
sleep 3
for p in "${serve[@]}" "${fetch[@]}"; do kill -INT "$p" 2>/dev/null || true; done
sleep 2
cleanup
trap - EXIT
python3 - "$OUT" "$PAUSE_ROLE" "$PAUSE_RANK" <<'PY'
import collections, glob, json, os, sys
out, role, hung = sys.argv[1], sys.argv[2], int(sys.argv[3])
bad = False
# The run ends with SIGINT to every rank at once: a sync in flight then fails on some
# ranks (peers gone, the store closed). Syncs after the last one every rank finished ok
# are the shutdown's, not the pauses'.
last_ok = []
for f in glob.glob(os.path.join(out, "*.log")):
    if os.path.basename(f) in ("store.log", f"fetch{hung}.log" if role == "fetch" else ""):
        continue
    vs = [0]
    for line in open(f, errors="replace"):
        if line.startswith("{") and '"ok":true' in line:
            try:
                vs.append(json.loads(line)["version"])
            except ValueError:
                pass
    last_ok.append(max(vs))
cut = min(last_ok) if last_ok else 0
drop_ms = collections.defaultdict(dict)  # sync -> producer -> ms into the sync it dropped the hung rank
healthy_s = collections.defaultdict(float)  # sync -> the slowest healthy fetch's seconds
for f in sorted(glob.glob(os.path.join(out, "*.log"))):
    name = os.path.basename(f)[:-4]
    if name == "store":
        continue
    paused = role == "fetch" and name == f"fetch{hung}"
    ok = failed = unverified = 0
    drops, errors = [], []
    for line in open(f, errors="replace"):
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue  # the line a SIGINT cut short
        v = r.get("version")
        if v > cut:
            continue
        ok += bool(r.get("ok"))
        if not r.get("ok"):
            failed += 1
            errors.append(f"sync {v}: {r.get('error')}")
        if r.get("role") == "inference" and r.get("ok") and not r.get("verified"):
            unverified += 1
        if r.get("role") == "inference" and not paused:
            healthy_s[v] = max(healthy_s[v], r.get("seconds", 0))
        events = [e for e in r.get("events", []) if isinstance(e, dict) and e.get("kind") == "drop"]
        for e in events:
            if role == "fetch" and e.get("peer") == hung and r.get("role") == "trainer":
                drop_ms[v][r.get("rank")] = e.get("t_ns", 0) / 1e6
        others = [d for d in r.get("dropped", []) if not (role == "fetch" and d == hung)]
        if others:
            drops.append(f"sync {v}: dropped {others}: " + "; ".join(e.get("message", "") for e in events)[:300])
    print(f"{name}: {ok} syncs ok, {failed} failed, {unverified} ok but not verified, {len(drops)} with healthy ranks dropped"
          + (" (the paused rank)" if paused else ""))
    if paused:
        continue
    # A trainer rank's report of a sync the hung rank missed is not ok: that is the verdict, not a fault.
    if role == "fetch" and name.startswith("serve"):
        errors = [e for e in errors if f"consumers {hung} " not in e and f"consumer {hung} " not in e]
        failed = len(errors)
    for line in (drops + errors)[:5]:
        print("  " + line[:400])
    bad = bad or failed or unverified or drops or ok == 0
if role == "fetch":
    for v in sorted(drop_ms):
        by = drop_ms[v]
        print(f"sync {v}: producers dropped fetch rank {hung} at " + ", ".join(f"{p}: {by[p]:.0f} ms" for p in sorted(by))
              + f"; the slowest healthy fetch took {healthy_s.get(v, 0) * 1000:.0f} ms")
print("pause-soak: FAILED" if bad else "pause-soak: no healthy rank dropped, every healthy sync ok and verified")
sys.exit(1 if bad else 0)
PY
