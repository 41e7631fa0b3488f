// Shared by the benchmarks that print ratios measured side by side in one run: a
// console reporter that keeps each benchmark's bytes/s (the median with repetitions)
// and prints `name rate = ratio x base` lines at the end, and a main that runs 5
// randomly interleaved repetitions (so drift on a shared machine hits all alike).
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

namespace ferry_bench {

struct Ratio {
  std::string name;  // benchmark function name, e.g. "BM_ReplayRows"
  std::string base;  // the one it is divided by
  double target = 0.80;
  const char* unit = "GB/s";  // how the rates print: bytes/s divided by `scale`
  double scale = 1e9;
};

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  explicit RatioReporter(std::vector<Ratio> ratios) : ratios_(std::move(ratios)) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      if (aggregate || !seen_aggregate_) rates_[r.run_name.function_name] = it->second.value;
      seen_aggregate_ |= aggregate;
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n");
    for (const Ratio& q : ratios_) {
      if (!rates_.count(q.name) || !rates_.count(q.base)) continue;
      std::printf("%-20s %8.2f %s = %.2fx %s (%.2f %s; target >= %.2fx)\n", q.name.c_str(), rates_[q.name] / q.scale,
                  q.unit, rates_[q.name] / rates_[q.base], q.base.c_str(), rates_[q.base] / q.scale, q.unit, q.target);
    }
  }

 private:
  std::vector<Ratio> ratios_;
  std::map<std::string, double> rates_;
  bool seen_aggregate_ = false;
};

// 5 repetitions, randomly interleaved, aggregates only; flags the user passes win.
inline int run_with_ratios(int argc, char** argv, std::vector<Ratio> ratios) {
  std::vector<char*> args(argv, argv + argc);
  std::string reps = "--benchmark_repetitions=5", inter = "--benchmark_enable_random_interleaving=true";
  std::string agg = "--benchmark_report_aggregates_only=true";
  args.insert(args.begin() + 1, {reps.data(), inter.data(), agg.data()});
  argc = static_cast<int>(args.size());
  argv = args.data();
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter(std::move(ratios));
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}

}  // namespace ferry_bench
