# ferry — quick start: `make demo`, `make test`.
BUILD      ?= build
BUILD_ASAN ?= build-asan
BUILD_FUZZ ?= build-fuzz
JOBS       ?= $(shell nproc)
FUZZ_SECONDS ?= 30
CMAKE_FLAGS ?=

FERRY := $(BUILD)/src/cli/ferry

.PHONY: all deps build test demo soak asan fuzz bench clean

all: build

deps:
	@scripts/install-deps.sh

# The dev builds treat warnings as errors (FERRY_WERROR; a plain cmake build does not),
# and compile the libraries and the ferry binary in unity batches (FERRY_UNITY_BUILD, see
# CMakeLists.txt): `make demo` from a fresh clone compiles ~40% less (docs/RESULTS.md). A
# plain cmake build (a user's, and scripts/check-install.sh's Release build) compiles file
# by file, which keeps every file compiling on its own includes.
DEV_FLAGS := -DFERRY_WERROR=ON -DFERRY_UNITY_BUILD=ON

$(BUILD)/build.ninja: CMakeLists.txt Makefile | deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(DEV_FLAGS) $(CMAKE_FLAGS) >/dev/null

build: deps $(BUILD)/build.ninja
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

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

# Every test again under AddressSanitizer + UndefinedBehaviorSanitizer, but for the ones
# that only move more bytes through paths other tests cover: the 1 GiB transfers
# (TransportTest.OneGiBReadAndWrite; every backend's smaller transfers run) and the
# memory measurements (MemoryMp: under ASan RSS measures shadow memory and the
# quarantine, not the engine). They took 415 of the suite's 3,753 test-seconds under
# ASan (docs/RESULTS.md, "CI time"); `make test` runs them. ASAN_CTEST_EXCLUDE= runs all.
ASAN_CTEST_EXCLUDE ?= MemoryMp\.|OneGiBReadAndWrite
asan: deps
	@cmake -S . -B $(BUILD_ASAN) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=ON -DFERRY_BENCH=OFF $(DEV_FLAGS) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD_ASAN) -j $(JOBS)
	@cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/lsan-ucx.supp ctest --output-on-failure -j $(JOBS) \
	  $(if $(ASAN_CTEST_EXCLUDE),-E '$(ASAN_CTEST_EXCLUDE)') $(CTEST_ARGS)

# libFuzzer targets (clang), each run for FUZZ_SECONDS.
fuzz: deps
	@CC=clang CXX=clang++ cmake -S . -B $(BUILD_FUZZ) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_FUZZ=ON -DFERRY_SANITIZE=ON -DFERRY_BENCH=OFF -DFERRY_CUDA=OFF $(DEV_FLAGS) >/dev/null
	@cmake --build $(BUILD_FUZZ) -j $(JOBS) --target fuzz_targets
	@scripts/run-fuzz.sh $(BUILD_FUZZ)/fuzz $(FUZZ_SECONDS)

bench: build
	@for b in $(BUILD)/bench/bench_*; do echo "== $$b"; $$b; done

clean:
	rm -rf $(BUILD) $(BUILD_ASAN) $(BUILD_FUZZ)
