// Patch codec (src/delta/patch.h) on 4 MiB of bf16: encode and apply throughput, in GB/s
// of dense bytes, per encoding (and the automatic choice), at change fractions 0.05%..100%,
// scattered (each element on its own) and clustered (contiguous runs); the counter
// `ratio` is the patch's size over the dense bytes. BM_Memcpy of the same bytes is the
// reference. Single-threaded, like the codec.
//
//   build/bench/bench_delta_patch --benchmark_min_time=0.2
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "delta/patch.h"

namespace {

using namespace ferry::delta;
using Bytes = std::vector<std::byte>;

constexpr size_t kElems = size_t{2} << 20;  // 2 Mi bf16 = 4 MiB
constexpr size_t kEs = 2;
constexpr size_t kDense = kElems * kEs;

struct Pair {
  Bytes base, next;
};

// Same generator as tests/delta/patch_test.cpp: scattered = each element changed with
// probability f; clustered = runs of 1..12288 elements at random places.
Pair make_pair(double f, bool clustered, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Pair p;
  p.base.resize(kDense);
  for (size_t i = 0; i < kDense; i += 8) {
    const uint64_t v = rng();
    std::memcpy(&p.base[i], &v, 8);
  }
  p.next = p.base;
  auto change = [&](size_t i) { p.next[i * kEs + rng() % kEs] ^= std::byte(1 + rng() % 255); };
  if (f >= 1) {
    for (size_t i = 0; i < kElems; ++i) change(i);
  } else if (!clustered) {
    std::bernoulli_distribution pick(f);
    for (size_t i = 0; i < kElems; ++i)
      if (pick(rng)) change(i);
  } else {
    const size_t target = static_cast<size_t>(std::llround(f * kElems));
    std::vector<bool> done(kElems);
    size_t count = 0;
    while (count < target) {
      const size_t len = 1 + rng() % 12288, start = rng() % kElems;
      for (size_t i = start; i < std::min(kElems, start + len) && count < target; ++i) {
        if (done[i]) continue;
        done[i] = true;
        change(i);
        ++count;
      }
    }
  }
  return p;
}

const Pair& pair_for(double f, bool clustered) {
  static std::map<std::pair<double, bool>, Pair> cache;
  auto it = cache.find({f, clustered});
  if (it == cache.end()) it = cache.emplace(std::make_pair(f, clustered), make_pair(f, clustered, 42)).first;
  return it->second;
}

void BM_Memcpy(benchmark::State& state) {
  const Pair& p = pair_for(0.01, false);
  Bytes dst(kDense, std::byte(1));
  for (auto _ : state) {
    std::memcpy(dst.data(), p.next.data(), kDense);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kDense));
}

void BM_Encode(benchmark::State& state, double f, bool clustered, PatchChoice choice) {
  const Pair& p = pair_for(f, clustered);
  Bytes out(2 * kDense + 64);  // a forced positions patch may exceed dense
  size_t bytes = 0;
  for (auto _ : state) {
    ferry::Result<PatchInfo> info = encode_patch_into(p.base, p.next, kEs, out, choice);
    if (!info.ok()) {
      state.SkipWithError(info.status().to_string().c_str());
      return;
    }
    bytes = info->bytes;
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kDense));
  state.counters["ratio"] = static_cast<double>(bytes) / kDense;
}

void BM_Apply(benchmark::State& state, double f, bool clustered, PatchChoice choice) {
  const Pair& p = pair_for(f, clustered);
  ferry::Result<Bytes> patch = encode_patch(p.base, p.next, kEs, choice);
  if (!patch.ok()) {
    state.SkipWithError(patch.status().to_string().c_str());
    return;
  }
  // Applying a patch to its own result gives the result again, so one target serves
  // every iteration.
  Bytes target = p.base;
  for (auto _ : state) {
    ferry::Status st = apply_patch(target, *patch);
    if (!st.ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kDense));
  state.counters["ratio"] = static_cast<double>(patch->size()) / kDense;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark("BM_Memcpy", BM_Memcpy);
  const std::pair<const char*, PatchChoice> choices[] = {{"auto", PatchChoice::kSmallest},
                                                         {"dense", PatchChoice::kDense},
                                                         {"bitmap", PatchChoice::kBitmap},
                                                         {"positions", PatchChoice::kPositions}};
  const std::pair<const char*, double> fractions[] = {{"0.05%", 0.0005}, {"1%", 0.01},   {"2%", 0.02},
                                                      {"10%", 0.10},     {"50%", 0.50}, {"100%", 1.0}};
  for (bool clustered : {false, true}) {
    for (const auto& [fname, f] : fractions) {
      for (const auto& [cname, c] : choices) {
        const std::string suffix =
            std::string("/") + (clustered ? "clustered" : "scattered") + "/" + fname + "/" + cname;
        benchmark::RegisterBenchmark(("BM_Encode" + suffix).c_str(), BM_Encode, f, clustered, c);
        benchmark::RegisterBenchmark(("BM_Apply" + suffix).c_str(), BM_Apply, f, clustered, c);
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
