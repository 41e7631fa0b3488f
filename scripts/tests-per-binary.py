#!/usr/bin/env python3
"""How many of each test binary's tests a ctest selection runs (docs/RESULTS.md, "CI time").

Usage: tests-per-binary.py BUILD_DIR [ctest selection args...]
   e.g. tests-per-binary.py build-asan -E 'MemoryMp\\.|OneGiBReadAndWrite' -LE soak
Lists every test executable the build registered with ctest (gtest binaries, the ferry
command, python3 for the Python tests) with its tests in all and in the selection; exits 1
if a binary has none selected.
"""
import json
import os
import subprocess
import sys
from collections import Counter


def listing(build, args):
    out = subprocess.run(["ctest", "--show-only=json-v1", *args], cwd=build, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["tests"]


def binary(t):
    cmd = t.get("command") or ["?"]
    name = os.path.basename(cmd[0])
    if name.startswith("python"):  # one entry per Python test file
        return "python3 " + os.path.basename(cmd[1]) if len(cmd) > 1 else name
    return name


def main():
    build, args = sys.argv[1], sys.argv[2:]
    every = Counter(binary(t) for t in listing(build, []))
    chosen = Counter(binary(t) for t in listing(build, args))
    missing = 0
    for b in sorted(every):
        mark = "" if chosen[b] else "   <- none selected"
        missing += not chosen[b]
        print(f"{b:40s} {chosen[b]:5d} of {every[b]:5d}{mark}")
    print(f"{len(every)} binaries, {sum(chosen.values())} of {sum(every.values())} tests selected")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
