// Plan replay vs memcpy: cutting 8 TP shards (by rows, and by columns) out of a 1 GiB
// bf16 tensor with the single-threaded executor, against single-thread memcpy of the
// same bytes, measured side by side in one run. Prints the ratios at the end.
//
//   build/bench/bench_plan_replay            (5 repetitions, randomly interleaved, medians)
// Repetitions are interleaved so that drift on a shared machine hits all three alike.
#include <cstring>
#include <memory>

#include <benchmark/benchmark.h>

#include "ratio_reporter.h"
#include "shard_plans.h"

#include "ferry/plan.h"
#include "tensor/convert_kernels.h"

namespace {

using namespace ferry;
using namespace ferry_bench;


struct Fixture {
  Tensor source = Tensor::empty({kRows, kCols}, DType::kBF16);
  std::vector<Tensor> row_shards, col_shards;
  std::vector<Plan> row_plans, col_plans;
  std::unique_ptr<std::byte[]> memcpy_dst{new std::byte[kBytes]};

  Fixture() {
    std::byte* p = *source.data_ptr();
    for (int64_t i = 0; i < kBytes; i += 4096) p[i] = static_cast<std::byte>(i >> 12);
    std::memset(memcpy_dst.get(), 1, kBytes);  // fault the pages in before timing
    for (int r = 0; r < kTp; ++r) {
      row_plans.push_back(shard_plan(r, 0));
      col_plans.push_back(shard_plan(r, 1));
      row_shards.push_back(Tensor::empty({kRows / kTp, kCols}, DType::kBF16, "shard"));
      col_shards.push_back(Tensor::empty({kRows, kCols / kTp}, DType::kBF16, "shard"));
    }
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_Memcpy(benchmark::State& state) {
  Fixture& f = fixture();
  const std::byte* src = *f.source.data_ptr();
  for (auto _ : state) {
    std::memcpy(f.memcpy_dst.get(), src, kBytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kBytes);
}

void replay(benchmark::State& state, const std::vector<Plan>& plans, const std::vector<Tensor>& shards) {
  Fixture& f = fixture();
  ExecuteOptions single{1, 0};
  for (auto _ : state) {
    for (int r = 0; r < kTp; ++r) {
      Status st = execute(plans[r], {{"w", f.source}}, {{"shard", shards[r]}}, single);
      if (!st.ok()) state.SkipWithError(st.message().c_str());
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kBytes);
}

void BM_ReplayRows(benchmark::State& state) { replay(state, fixture().row_plans, fixture().row_shards); }
void BM_ReplayCols(benchmark::State& state) { replay(state, fixture().col_plans, fixture().col_shards); }

// fp32 masters -> the bf16 an engine keeps (issue 29): strided_copy's conversion of 64 Mi
// elements (256 MiB in, 128 MiB out), single thread, against memcpy of the 256 MiB read.
// torch's `.to(torch.bfloat16)` on the same size: bench/convert_vs_torch.py.
constexpr int64_t kConvElems = int64_t(64) << 20;
struct ConvertFixture {
  std::unique_ptr<float[]> src{new float[kConvElems]};
  std::unique_ptr<uint16_t[]> dst{new uint16_t[kConvElems]};
  std::unique_ptr<float[]> copy{new float[kConvElems]};
  ConvertFixture() {
    for (int64_t i = 0; i < kConvElems; ++i) src[i] = static_cast<float>(i % 9973) * 0.37f - 1000.0f;
    std::memset(dst.get(), 1, kConvElems * 2);
    std::memset(copy.get(), 1, kConvElems * 4);
  }
};
ConvertFixture& convert_fixture() {
  static ConvertFixture f;
  return f;
}

void BM_ConvertF32ToBf16(benchmark::State& state) {
  ConvertFixture& f = convert_fixture();
  for (auto _ : state) {
    strided_copy(reinterpret_cast<const std::byte*>(f.src.get()), Layout::contiguous({kConvElems}), DType::kF32,
                 reinterpret_cast<std::byte*>(f.dst.get()), Layout::contiguous({kConvElems}), DType::kBF16);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kConvElems * 4);  // bytes read
}

// Each f32 -> bf16 kernel this CPU runs (tensor/convert_kernels.h), side by side: what
// strided_copy takes is the first (widest).
void BM_ConvertKernel(benchmark::State& state, size_t which) {
  ConvertFixture& f = convert_fixture();
  const auto kernels = detail::f32_to_bf16_kernels();
  if (which >= kernels.size()) {
    state.SkipWithError("this CPU lacks the kernel");
    return;
  }
  for (auto _ : state) {
    const int64_t done = kernels[which].run(reinterpret_cast<const std::byte*>(f.src.get()),
                                            reinterpret_cast<std::byte*>(f.dst.get()), kConvElems);
    benchmark::DoNotOptimize(done);
    benchmark::ClobberMemory();
  }
  state.SetLabel(kernels[which].isa);
  state.SetBytesProcessed(state.iterations() * kConvElems * 4);
}

void BM_MemcpyF32(benchmark::State& state) {
  ConvertFixture& f = convert_fixture();
  for (auto _ : state) {
    std::memcpy(f.copy.get(), f.src.get(), kConvElems * 4);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kConvElems * 4);
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ConvertF32ToBf16)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemcpyF32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_ConvertKernel, widest, size_t{0})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_ConvertKernel, second, size_t{1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayRows)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayCols)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  return ferry_bench::run_with_ratios(argc, argv, {{"BM_ReplayRows", "BM_Memcpy"},
                                                        {"BM_ReplayCols", "BM_Memcpy"},
                                                        {"BM_ConvertF32ToBf16", "BM_MemcpyF32"}});
}
