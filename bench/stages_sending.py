#!/usr/bin/env python3
"""How much of each sync every pipeline stage's producers send at once, from a trace.

Reads a trace file of `ferry demo --trace FILE` (docs/trace.md: Chrome trace events,
one process per rank), takes every byte movement from a trainer rank as the trace times
it (pull: an inference rank's `read` of a group from producer `peer`, from the
announcement's arrival to the end of its reads and release; push: a trainer rank's
`push-write` of a group to a consumer), and prints per sync: its window (first to last
event of that version on any rank), each stage's share of the window with at least one
transfer in flight, and the share during which every stage sends at once (issue 26,
docs/group-order.md). A producer's `send` events are not used: they run from when it
served a group to the release, waiting included.

    ferry demo --hosts 4 --link rate=1gbit --group-order rotated --trainer tp=1,pp=2 \\
        --inference tp=1,replicas=2 --kill-sync 0 --syncs 3 --trace /tmp/pp2.json
    bench/stages_sending.py /tmp/pp2.json --tp 1

A trainer rank's stage is its rank // tp (the demo's Megatron layouts number ranks TP
fastest, then PP, with no DP).
"""
import argparse
import json
import sys
from collections import defaultdict


def union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(spans):
    return sum(b - a for a, b in spans)


def intersect(x, y):
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append([a, b])
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--tp", type=int, default=1, help="the trainer's tensor parallel size (stage = rank // tp)")
    a = ap.parse_args()
    with open(a.trace) as f:
        d = json.load(f)
    events = d["traceEvents"] if isinstance(d, dict) else d
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    window = defaultdict(lambda: [float("inf"), float("-inf")])
    sends = defaultdict(lambda: defaultdict(list))  # version -> stage -> spans
    for e in events:
        if e.get("ph") != "X":
            continue
        v = e.get("args", {}).get("version")
        if v is None:
            continue
        t0, t1 = e["ts"], e["ts"] + e.get("dur", 0)
        w = window[v]
        w[0], w[1] = min(w[0], t0), max(w[1], t1)
        who = names.get(e["pid"], "")
        peer = e.get("args", {}).get("peer")
        if who.startswith("inference ") and e["name"].startswith("read ") and peer is not None and peer >= 0:
            sends[v][peer // a.tp].append([t0, t1])
        elif who.startswith("trainer ") and e["name"].startswith("push-write"):
            sends[v][int(who.split()[1]) // a.tp].append([t0, t1])
    if not sends:
        print("no trainer sends in", a.trace, file=sys.stderr)
        return 1
    stages = sorted({s for per in sends.values() for s in per})
    print(f"{'version':>7} {'window s':>9} " + " ".join(f"{'stage ' + str(s):>8}" for s in stages) +
          f" {'all at once':>11}")
    for v in sorted(sends):
        w0, w1 = window[v]
        per = {s: union(sends[v].get(s, [])) for s in stages}
        together = per[stages[0]]
        for s in stages[1:]:
            together = intersect(together, per[s])
        span = w1 - w0
        print(f"{v:>7} {span / 1e6:>9.3f} " + " ".join(f"{length(per[s]) / span:>8.0%}" for s in stages) +
              f" {length(together) / span:>11.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
