# ferry — quick start: `make demo`, `make test`.
BUILD      ?= build
BUILD_ASAN ?= build-asan
JOBS       ?= $(shell nproc)
# Tests at a time: twice the cores. The tests wait more than they compute (leases,
# timeouts, other processes; two thirds of the CPU idle at -j2 on a 2-core box,
# docs/RESULTS.md "CI time"); the multi-process fault tests still run alone (RUN_SERIAL).
CTEST_JOBS ?= $(shell echo $$(( $(JOBS) * 2 )))
FUZZ_SECONDS ?= 30
CMAKE_FLAGS ?=

FERRY := $(BUILD)/src/cli/ferry

.PHONY: all deps build test demo soak asan asan-build fuzz bench clean

all: build

deps:
	@scripts/install-deps.sh

# The dev builds treat warnings as errors (FERRY_WERROR; a plain cmake build does not),
# and compile the libraries and the ferry binary in unity batches (FERRY_UNITY_BUILD, see
# CMakeLists.txt): `make demo` from a fresh clone compiles ~40% less (docs/RESULTS.md). A
# plain cmake build (a user's, and scripts/check-install.sh's Release build) compiles file
# by file, which keeps every file compiling on its own includes.
DEV_FLAGS := -DFERRY_WERROR=ON -DFERRY_UNITY_BUILD=ON

# A compiler cache when one is installed (scripts/install-deps.sh installs Debian's
# ccache): each build configured here compiles through it (decided when it is first
# configured, after deps). CCACHE_BASEDIR turns the paths under this clone into relative
# ones and no compile command names the clone's folder (tests find their paths at run
# time: tests/test_paths.h), so a fresh clone in another folder reuses what any earlier
# build on this machine compiled (docs/RESULTS.md, "CI time"). CCACHE_NOHASHDIR: the
# object of another clone keeps that clone's folder in its debug info (paths in
# backtraces stay relative to the source tree either way).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true
LAUNCHER = $$(command -v ccache >/dev/null && echo -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)

$(BUILD)/build.ninja: CMakeLists.txt Makefile | deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(DEV_FLAGS) $(LAUNCHER) $(CMAKE_FLAGS) >/dev/null

build: deps $(BUILD)/build.ninja
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(CTEST_JOBS) $(CTEST_ARGS)

# The main job: trainer and inference ranks as local processes, several verified syncs
# of a shrunk Qwen3-30B-A3B, one inference rank killed and caught up (ferry demo --help).
# Builds only the ferry binary (and ferry-mpi-bcast, which it depends on): every process
# the demo starts is that binary (`ferry worker`, `ferry store`), so no test or benchmark
# is built first.
demo: deps $(BUILD)/build.ninja
	@cmake --build $(BUILD) -j $(JOBS) --target ferry
	$(FERRY) demo

# 200 consecutive multi-process syncs: every one verified, RSS and descriptors flat; then
# 200 syncs with a random SIGSTOP/SIGCONT of a rank or the store every other sync (seeded:
# FERRY_PAUSE_SOAK_SEED), every report true.
soak: build
	@cd $(BUILD) && FERRY_SOAK_SYNCS=200 ctest -R 'EngineMultiProcess.Soak' --output-on-failure
	@cd $(BUILD) && FERRY_PAUSE_SOAK_SYNCS=200 ctest -R 'EnginePauseSoak' --output-on-failure -V | grep -A12 'pause soak'

# The sanitizer build (clang, AddressSanitizer + UndefinedBehaviorSanitizer, -O1; the
# tests' own sources at -O0, half the compile time for glue around the libraries; no CUDA
# plugin, which only a GPU runs) in one tree for both the tests and the libFuzzer targets
# (FERRY_FUZZ: the libraries carry libFuzzer's coverage instrumentation, which the tests
# run through unused): every test
# binary again under the sanitizers, but for the ones that only move more bytes through
# paths other tests cover: the 1 GiB transfers (TransportTest.OneGiBReadAndWrite; every
# backend's smaller transfers run), the two-size memory measurement (under ASan RSS
# measures shadow memory and the quarantine, not the engine; memory_mp_test's other
# test runs, its reported kinds checked) and the soak tier (its loops repeat syncs the
# other tiers run once each). `make test` runs them all; ASAN_CTEST_EXCLUDE= and
# ASAN_CTEST_LABEL_EXCLUDE= run everything here too.
ASAN_CTEST_EXCLUDE ?= MemoryMp\.ExtraMemoryBoundedAtTwoSizes|OneGiBReadAndWrite
ASAN_CTEST_LABEL_EXCLUDE ?= soak
ASAN_CFLAGS := -O1 -g1 -fno-omit-frame-pointer
$(BUILD_ASAN)/build.ninja: CMakeLists.txt Makefile | deps
	@CC=clang CXX=clang++ cmake -S . -B $(BUILD_ASAN) -G Ninja -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_C_FLAGS_DEBUG="$(ASAN_CFLAGS)" -DCMAKE_CXX_FLAGS_DEBUG="$(ASAN_CFLAGS)" \
	  -DFERRY_SANITIZE=ON -DFERRY_FUZZ=ON -DFERRY_BENCH=OFF -DFERRY_CUDA=OFF -DFERRY_TEST_COMPILE_OPTIONS=-O0 \
	  $(DEV_FLAGS) $(LAUNCHER) $(CMAKE_FLAGS) >/dev/null

asan-build: deps $(BUILD_ASAN)/build.ninja
	@cmake --build $(BUILD_ASAN) -j $(JOBS)

asan: asan-build
	@cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/lsan-ucx.supp ctest --output-on-failure -j $(CTEST_JOBS) \
	  $(if $(ASAN_CTEST_EXCLUDE),-E '$(ASAN_CTEST_EXCLUDE)') $(if $(ASAN_CTEST_LABEL_EXCLUDE),-LE '$(ASAN_CTEST_LABEL_EXCLUDE)') \
	  $(CTEST_ARGS)

# libFuzzer targets of the sanitizer build, each run for FUZZ_SECONDS.
fuzz: deps $(BUILD_ASAN)/build.ninja
	@cmake --build $(BUILD_ASAN) -j $(JOBS) --target fuzz_targets
	@scripts/run-fuzz.sh $(BUILD_ASAN)/fuzz $(FUZZ_SECONDS)

bench: build
	@for b in $(BUILD)/bench/bench_*; do echo "== $$b"; $$b; done

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
