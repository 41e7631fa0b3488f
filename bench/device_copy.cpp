// Plan replay on a CUDA device vs cudaMemcpy device to device of the same bytes,
// side by side in one run (device check 1 of docs/RESULTS.md, "Weights in GPU memory"):
//   * 8 TP shards cut by rows out of a 1 GiB bf16 tensor, and 8 cut by columns;
//   * one decoder layer of Qwen3-30B-A3B (128 experts) for inference rank 0 of tp=4,
//     from the model's own loader (the plan ferry replays for that rank).
//
//   build/bench/bench_device_copy      (5 repetitions, randomly interleaved, medians)
// Every byte moves in device memory; copy_batch and device_memcpy both return when the
// copies have finished. Without a CUDA device it says why and exits 0 having run nothing.
#include <cstdio>
#include <memory>

#include <benchmark/benchmark.h>

#include "ratio_reporter.h"
#include "shard_plans.h"

#include "ferry/device.h"
#include "ferry/models.h"
#include "ferry/plan.h"

namespace {

using namespace ferry;
using namespace ferry_bench;

const Device kGpu = Device::cuda(0);

// The bench cannot go on without its setup: say what failed and exit 1.
void or_die(const Status& st, const char* what) {
  if (st.ok()) return;
  std::fprintf(stderr, "bench_device_copy: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}
template <typename T>
T or_die(Result<T> r, const char* what) {
  or_die(r.status(), what);
  return std::move(*r);
}

std::shared_ptr<std::byte> alloc_or_die(size_t bytes) {
  auto p = or_die(device_alloc(kGpu, bytes), "device_alloc");
  // Touch every page (and make the bytes non-zero) before timing.
  std::vector<std::byte> pattern(std::min<size_t>(bytes, 64 << 20), std::byte{0x5a});
  for (size_t at = 0; at < bytes; at += pattern.size()) {
    or_die(device_memcpy(p.get() + at, pattern.data(), std::min(pattern.size(), bytes - at)), "device_memcpy");
  }
  return p;
}

// The copies of layer 0's sources in rank 0's plan (tp=4), as a plan of its own.
Plan qwen_layer_plan() {
  auto config = or_die(ModelConfig::load(FERRY_SOURCE_DIR "/configs/qwen3-30b-a3b.json"), "qwen3-30b-a3b config");
  auto loader = or_die(make_model_loader(config, or_die(InferenceLayout::parse("tp=4"), "layout")), "loader");
  const Plan full = or_die(record_plan(*loader, 0), "record_plan");
  Plan sub;
  for (const Copy& c : full.copies()) {
    const TensorDecl& s = full.sources()[c.source];
    if (s.name.find("layers.0.") == std::string::npos) continue;
    Copy k = c;
    k.source = or_die(sub.declare_source(s), "declare_source");
    k.param = or_die(sub.declare_param(full.params()[c.param]), "declare_param");
    or_die(sub.add_copy(k), "add_copy");
  }
  for (const Zero& z : full.zeros()) {
    const TensorDecl& p = full.params()[z.param];
    if (p.name.find("layers.0.") == std::string::npos) continue;
    Zero k = z;
    k.param = or_die(sub.declare_param(p), "declare_param");
    or_die(sub.add_zero(k), "add_zero");
  }
  sub.canonicalize();
  return sub;
}

struct Bound {
  Plan plan;
  TensorMap sources, params;
};

// Device tensors for every source and param `plan` names.
Bound bind(Plan plan, std::vector<std::shared_ptr<std::byte>>& keep) {
  Bound b{std::move(plan), {}, {}};
  for (const auto* side : {&b.plan.sources(), &b.plan.params()}) {
    for (const TensorDecl& d : *side) {
      const size_t bytes = static_cast<size_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
      keep.push_back(alloc_or_die(bytes));
      Tensor t = Tensor::borrow_device(keep.back().get(), d.shape, d.dtype, kGpu, keep.back(), d.name);
      (side == &b.plan.sources() ? b.sources : b.params)[d.name] = t;
    }
  }
  return b;
}

struct Fixture {
  std::vector<std::shared_ptr<std::byte>> keep;
  std::shared_ptr<std::byte> source, copy;
  std::vector<Plan> row_plans, col_plans;
  std::shared_ptr<std::byte> shard;
  Bound qwen;
  uint64_t qwen_bytes = 0;
  std::shared_ptr<std::byte> qwen_src, qwen_dst;

  Fixture() {
    source = alloc_or_die(kBytes);
    copy = alloc_or_die(kBytes);
    shard = alloc_or_die(kBytes / kTp);
    for (int r = 0; r < kTp; ++r) {
      row_plans.push_back(shard_plan(r, 0));
      col_plans.push_back(shard_plan(r, 1));
    }
    qwen = bind(qwen_layer_plan(), keep);
    qwen_bytes = qwen.plan.stats().bytes;
    qwen_src = alloc_or_die(qwen_bytes);
    qwen_dst = alloc_or_die(qwen_bytes);
    std::printf("qwen3-30b-a3b layer 0, tp=4 rank 0: %zu copies, %zu zeros, %.1f MB\n", qwen.plan.copies().size(),
                qwen.plan.zeros().size(), static_cast<double>(qwen_bytes) / 1e6);
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void check(benchmark::State& state, const Status& st) {
  if (!st.ok()) state.SkipWithError(st.to_string().c_str());
}

void BM_CudaMemcpy1GiB(benchmark::State& state) {
  Fixture& f = fixture();
  for (auto _ : state) check(state, device_memcpy(f.copy.get(), f.source.get(), kBytes));
  state.SetBytesProcessed(state.iterations() * kBytes);
}

void replay_shards(benchmark::State& state, const std::vector<Plan>& plans, int dim) {
  Fixture& f = fixture();
  const int64_t n = (dim == 0 ? kRows : kCols) / kTp;
  const Shape shape = dim == 0 ? Shape{n, kCols} : Shape{kRows, n};
  const Tensor w = Tensor::borrow_device(f.source.get(), {kRows, kCols}, DType::kBF16, kGpu, nullptr, "w");
  const Tensor s = Tensor::borrow_device(f.shard.get(), shape, DType::kBF16, kGpu, nullptr, "shard");
  for (auto _ : state) {
    for (int r = 0; r < kTp; ++r) check(state, execute(plans[static_cast<size_t>(r)], {{"w", w}}, {{"shard", s}}));
  }
  state.SetBytesProcessed(state.iterations() * kBytes);
}
void BM_ReplayRows(benchmark::State& state) { replay_shards(state, fixture().row_plans, 0); }
void BM_ReplayCols(benchmark::State& state) { replay_shards(state, fixture().col_plans, 1); }

void BM_CudaMemcpyQwenLayer(benchmark::State& state) {
  Fixture& f = fixture();
  for (auto _ : state) check(state, device_memcpy(f.qwen_dst.get(), f.qwen_src.get(), f.qwen_bytes));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(f.qwen_bytes));
}
void BM_ReplayQwenLayer(benchmark::State& state) {
  Fixture& f = fixture();
  for (auto _ : state) check(state, execute(f.qwen.plan, f.qwen.sources, f.qwen.params));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(f.qwen_bytes));
}

BENCHMARK(BM_CudaMemcpy1GiB)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayRows)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayCols)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CudaMemcpyQwenLayer)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayQwenLayer)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  const CudaStatus& cs = cuda_status();
  std::printf("cuda: %s\n", cs.detail.c_str());
  if (!cs.usable()) {
    std::printf("no CUDA device: nothing measured\n");
    return 0;
  }
  return ferry_bench::run_with_ratios(argc, argv, {{"BM_ReplayRows", "BM_CudaMemcpy1GiB"}, {"BM_ReplayCols", "BM_CudaMemcpy1GiB"}, {"BM_ReplayQwenLayer", "BM_CudaMemcpyQwenLayer"}});
}
