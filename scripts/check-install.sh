#!/usr/bin/env bash
# Packaging checks (CI, after the tests; README "Install"): one Release build (gcc,
# warnings not fatal, no tests, no benchmarks) that every step below reuses:
#   1. cmake --install into a temporary prefix: the layout, every installed header
#      compiled alone, `ferry --version`, a relative config found from another directory;
#   2. examples/cpp built against that prefix with find_package(ferry) and run (inproc and
#      ucx), and once more with pkg-config;
#   3. `pip install --no-build-isolation .` into a venv over Debian's Python
#      (--system-site-packages: numpy, torch, setuptools, wheel come from Debian) driven by
#      the same build; `import ferry` with no PYTHONPATH, `python -m ferry`, the `ferry`
#      script, the Python tests and examples against the installed package; `pip wheel .`;
#   4. with --deb (needs root; installs into the system): cpack's .deb packages installed
#      with apt-get, `ferry plan` and the example (pkg-config) run from them, then removed.
# Usage: scripts/check-install.sh [--deb | --build-only]   (BUILD_RELEASE=dir, JOBS=n, CMAKE_FLAGS=...)
#   --build-only: the Release build alone (CI starts it beside the sanitizer tests, then
#   runs the checks with CHECK_INSTALL_REUSE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
B=${BUILD_RELEASE:-build-release}
JOBS=${JOBS:-$(nproc)}
DEB=0
BUILD_ONLY=0
case "${1:-}" in
  --deb) DEB=1 ;;
  --build-only) BUILD_ONLY=1 ;;
  "") ;;
  *) echo "usage: scripts/check-install.sh [--deb | --build-only]" >&2; exit 2 ;;
esac
# Through the compiler cache when there is one, as the Makefile's builds (paths under this
# clone relative: another clone's Release build reuses this one's objects).
LAUNCHER=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=$ROOT CCACHE_NOHASHDIR=true
  LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
WORK=$(mktemp -d /tmp/ferry-install.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
P=$WORK/prefix
PY=/usr/bin/python3
step() { echo "== check-install: $*"; }
SECONDS=0

step "Release build ($B)"
# CHECK_INSTALL_REUSE=1: use $B as it is configured (a developer's build, tests and all).
if [ "${CHECK_INSTALL_REUSE:-0}" != 1 ] || [ ! -f "$B/CMakeCache.txt" ]; then
  # Warnings are shown but not fatal here: this is the build a user makes (-Werror is for
  # the development builds above, make test/asan/fuzz); gcc 12 at -O3 still reports false
  # positives inside the standard library (GCC bug 105329).
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_WERROR=OFF -DFERRY_TESTS=OFF -DFERRY_BENCH=OFF \
    -DPython3_EXECUTABLE=$PY "${LAUNCHER[@]}" ${CMAKE_FLAGS:-} >/dev/null
fi
cmake --build "$B" -j "$JOBS"
echo "   (${SECONDS}s)"
if [ "$BUILD_ONLY" = 1 ]; then
  exit 0
fi

step "cmake --install $B --prefix $P"
cmake --install "$B" --prefix "$P" >/dev/null
for f in bin/ferry include/ferry/engine.h include/ferry/version.h lib/libferry_engine.a \
         lib/cmake/ferry/ferryConfig.cmake lib/cmake/ferry/ferryConfigVersion.cmake lib/cmake/ferry/ferryTargets.cmake \
         lib/pkgconfig/ferry.pc share/ferry/configs/qwen3-30b-a3b.json; do
  [ -e "$P/$f" ] || { echo "check-install: $P/$f is missing" >&2; exit 1; }
done
export PKG_CONFIG_PATH=$P/lib/pkgconfig
for h in "$P"/include/ferry/*.h; do  # each installed header on its own
  echo "#include <ferry/$(basename "$h")>" | c++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror \
    $(pkg-config --cflags ferry) -x c++ - || { echo "check-install: $h does not compile alone" >&2; exit 1; }
done
"$P/bin/ferry" --version
# With nvcc at configure time the CUDA plugin is installed, and the installed ferry finds
# it relative to itself (bin/../lib/ferry/), before the build tree it was built in.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  [ -e "$P/lib/ferry/libferry_cuda.so" ] || { echo "check-install: $P/lib/ferry/libferry_cuda.so is missing" >&2; exit 1; }
  (unset FERRY_CUDA_PLUGIN; "$P/bin/ferry" devices) | tee "$WORK/devices.txt"
  grep -q "cuda plugin: $P/lib/ferry/libferry_cuda.so" "$WORK/devices.txt" ||
    { echo "check-install: the installed ferry does not load its own CUDA plugin" >&2; exit 1; }
fi
# A relative config that exists only in the prefix's share directory, from another directory.
cp "$P/share/ferry/configs/llama-3.1-8b.json" "$P/share/ferry/configs/check-install-only.json"
(cd "$WORK" && "$P/bin/ferry" plan --model configs/check-install-only.json --trainer tp=2 --inference tp=2 | grep "bytes ferry moves")
# ferry simulate with the installed cluster files (share/ferry/configs/clusters/).
(cd "$WORK" && "$P/bin/ferry" simulate --model configs/qwen3-30b-a3b.json --trainer "tp=2" --inference "tp=2" \
   --cluster configs/clusters/emulated-2host-1gbit.json | grep "predicted sync")
echo "   (${SECONDS}s)"

step "examples/cpp against $P (find_package, then pkg-config)"
cmake -S examples/cpp -B "$WORK/example" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$P" >/dev/null
cmake --build "$WORK/example"
"$WORK/example/sync_example" inproc
"$WORK/example/sync_example" ucx
c++ -std=c++20 -O1 examples/cpp/sync_example.cpp $(pkg-config --cflags --libs ferry) -o "$WORK/sync_example_pc"
"$WORK/sync_example_pc" inproc
echo "   (${SECONDS}s)"

step "pip install --no-build-isolation . (venv over Debian's python, reusing $B)"
$PY -m venv --system-site-packages "$WORK/venv"
VPY=$WORK/venv/bin/python
export FERRY_BUILD_DIR=$ROOT/$B PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
"$VPY" -m pip install --no-build-isolation --no-deps -q .
unset PYTHONPATH
(cd "$WORK" && "$VPY" -c "import ferry, sys; print('ferry', ferry.__version__, ferry.__file__); assert ferry.__file__.startswith(sys.prefix)")
(cd "$WORK" && "$VPY" -m ferry --version && "$WORK/venv/bin/ferry" --help >/dev/null)
(cd "$WORK" && "$VPY" -m ferry plan --model configs/qwen3-30b-a3b.json --trainer "tp=2,pp=2,ep=2" --inference "tp=2" | grep "bytes ferry moves")
for t in tests/python/test_*.py; do
  (cd tests/python && OMP_NUM_THREADS=2 "$VPY" "$(basename "$t")") || { echo "check-install: $t failed against the installed package" >&2; exit 1; }
done
"$VPY" -m pip wheel --no-build-isolation --no-deps -q -w "$WORK/wheels" .
ls "$WORK"/wheels/ferry-*.whl
unset FERRY_BUILD_DIR
echo "   (${SECONDS}s)"

if [ "$DEB" = 1 ]; then
  step "cpack -G DEB, apt-get install, smoke run"
  rm -f "$B"/ferry_*.deb "$B"/ferry-dev_*.deb
  (cd "$B" && cpack -G DEB >/dev/null)
  for d in "$B"/ferry_*.deb "$B"/ferry-dev_*.deb; do
    echo "$(basename "$d"): $(dpkg-deb -f "$d" Depends)"
  done
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$ROOT/$B"/ferry_*.deb "$ROOT/$B"/ferry-dev_*.deb >/dev/null
  trap 'DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq ferry ferry-dev >/dev/null; rm -rf "$WORK"' EXIT
  unset PKG_CONFIG_PATH
  (cd "$WORK" && /usr/bin/ferry --version &&
   /usr/bin/ferry plan --model configs/qwen3-30b-a3b.json --trainer "tp=2,pp=2,ep=2" --inference "tp=2" | grep "bytes ferry moves")
  cmake -S examples/cpp -B "$WORK/example-deb" -G Ninja >/dev/null  # find_package finds /usr/lib/cmake/ferry
  c++ -std=c++20 -O1 examples/cpp/sync_example.cpp $(pkg-config --cflags --libs ferry) -o "$WORK/sync_example_deb"
  "$WORK/sync_example_deb" inproc
  echo "   (${SECONDS}s)"
fi
step "ok (${SECONDS}s)"
