#!/usr/bin/env python3
"""Every CTest test of a build carries exactly one tier label (README, "Tests"), and no
test is registered twice (two tier filters of one binary that both select it).

Usage: check_tiers.py CTEST BUILD_DIR TIER...
Lists the build's tests with `ctest --show-only=json-v1` and names each test with no tier
label or with more than one; exits 1 if there is any.
"""
import json
import subprocess
import sys


def main() -> int:
    ctest, build, tiers = sys.argv[1], sys.argv[2], set(sys.argv[3:])
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, check=True, capture_output=True, text=True).stdout
    tests = json.loads(out)["tests"]
    bad = []
    counts = {t: 0 for t in sorted(tiers)}
    seen = set()
    for t in tests:
        if t["name"] in seen:
            bad.append(f"{t['name']}: registered twice")
        seen.add(t["name"])
        labels = []
        for p in t.get("properties", []):
            if p["name"] == "LABELS":
                labels = p["value"]
        mine = [l for l in labels if l in tiers]
        if len(mine) != 1:
            bad.append(f"{t['name']}: labels {labels}")
        else:
            counts[mine[0]] += 1
    print(f"{len(tests)} tests: " + ", ".join(f"{n} {t}" for t, n in counts.items()))
    for b in bad:
        print(f"not exactly one tier ({', '.join(sorted(tiers))}): {b}")
    if not tests:
        print("no tests listed")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
