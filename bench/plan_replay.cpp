// Plan replay vs memcpy: cutting 8 TP shards (by rows, and by columns) out of a 1 GiB
// bf16 tensor with the single-threaded executor, against single-thread memcpy of the
// same bytes, measured side by side in one run. Prints the ratios at the end.
//
//   build/bench/bench_plan_replay            (5 repetitions, randomly interleaved, medians)
// Repetitions are interleaved so that drift on a shared machine hits all three alike.
#include <cstring>
#include <map>
#include <memory>

#include <benchmark/benchmark.h>

#include "ferry/plan.h"

namespace {

using namespace ferry;

constexpr int64_t kRows = 16384;
constexpr int64_t kCols = 32768;  // 16384 x 32768 bf16 = 1 GiB
constexpr int kTp = 8;
constexpr int64_t kBytes = kRows * kCols * 2;

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
      row_plans.push_back(record(r, 0));
      col_plans.push_back(record(r, 1));
      row_shards.push_back(Tensor::empty({kRows / kTp, kCols}, DType::kBF16, "shard"));
      col_shards.push_back(Tensor::empty({kRows, kCols / kTp}, DType::kBF16, "shard"));
    }
  }

  static Plan record(int rank, int dim) {
    Recorder rec;
    Tensor w = Tensor::source("w", {kRows, kCols}, DType::kBF16);
    const int64_t n = (dim == 0 ? kRows : kCols) / kTp;
    Shape shape = dim == 0 ? Shape{n, kCols} : Shape{kRows, n};
    Status st = Tensor::param("shard", shape, DType::kBF16).copy_(w.narrow(dim, rank * n, n));
    if (!st.ok()) std::abort();
    return *rec.finish();
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

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayRows)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReplayCols)->Unit(benchmark::kMillisecond)->UseRealTime();

// Collects bytes/s per benchmark to print ratios after the run.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      // With repetitions, keep the medians; otherwise the single run.
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      std::string name = r.run_name.function_name;
      if (aggregate || !seen_aggregate_) rates_[name] = it->second.value;
      seen_aggregate_ |= aggregate;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    if (!rates_.count("BM_Memcpy")) return;
    const double memcpy_rate = rates_["BM_Memcpy"];
    std::printf("\nmemcpy (single thread): %.2f GB/s\n", memcpy_rate / 1e9);
    for (auto& [name, rate] : rates_) {
      if (name.rfind("BM_Replay", 0) == 0) {
        std::printf("%-14s %.2f GB/s = %.2fx memcpy (target >= 0.80x)\n", name.c_str(), rate / 1e9, rate / memcpy_rate);
      }
    }
  }

 private:
  std::map<std::string, double> rates_;
  bool seen_aggregate_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::string reps = "--benchmark_repetitions=5", inter = "--benchmark_enable_random_interleaving=true";
  std::string agg = "--benchmark_report_aggregates_only=true";
  args.insert(args.begin() + 1, {reps.data(), inter.data(), agg.data()});  // user flags after ours win
  argc = static_cast<int>(args.size());
  argv = args.data();
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
