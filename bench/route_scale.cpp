// Routing at many FSDP ranks (issue 30), side by side in one run: Llama-3.1-8B under
// fsdp=N -> tp=8, routed whole on one thread (the router as it was, less its other
// changes), whole on every thread, and as an engine rank builds its own routes (a
// producer: its packs; a consumer: its class's unpacks and every producer's packs;
// RouterOptions::packs_of / unpacks_of). Rates are cut pieces per second (reported in
// the bytes/s column), so each ratio is a speed-up in routing time.
//
//   build/bench/bench_route_scale                      (fsdp=1024)
//   FERRY_BENCH_FSDP=4096 build/bench/bench_route_scale
#include <cstdlib>
#include <string>

#include <benchmark/benchmark.h>

#include "ratio_reporter.h"

#include "ferry/models.h"
#include "ferry/route.h"

namespace {

using namespace ferry;

struct Job {
  std::vector<TensorDecl> meta;
  std::vector<Holdings> holdings;
  std::vector<Plan> plans;
  RouterInput input;
  std::string error;

  Job() {
    const char* env = std::getenv("FERRY_BENCH_FSDP");
    const std::string fsdp = env ? env : "1024";
    Status s = [&]() -> Status {
      FERRY_ASSIGN_OR_RETURN(auto cfg, ModelConfig::load(std::string(FERRY_CONFIGS_DIR) + "/llama-3.1-8b.json"));
      FERRY_ASSIGN_OR_RETURN(auto il, InferenceLayout::parse("tp=8"));
      FERRY_ASSIGN_OR_RETURN(auto loader, make_model_loader(cfg, il, LoaderOptions{}));
      meta = loader->checkpoint();
      FERRY_ASSIGN_OR_RETURN(auto layout, TrainerLayout::parse("fsdp=" + fsdp));
      FERRY_ASSIGN_OR_RETURN(auto th, make_holdings(meta, layout, model_info_from_config(cfg.json())));
      holdings = std::move(th.ranks);
      for (int r = 0; r < il.world_size(); ++r) {
        FERRY_ASSIGN_OR_RETURN(auto p, record_plan(*loader, r));
        plans.push_back(std::move(p));
      }
      return Status::Ok();
    }();
    if (!s.ok()) error = s.to_string();
    input.metadata = meta;
    input.producers = holdings;
    for (const auto& p : plans) input.consumers.push_back(&p);
  }
};

Job& job() {
  static Job j;
  return j;
}

void route(benchmark::State& state, RouterOptions options) {
  Job& j = job();
  if (!j.error.empty()) {
    state.SkipWithError(j.error.c_str());
    return;
  }
  uint64_t pieces = 0;
  for (auto _ : state) {
    auto r = build_routes(j.input, options);
    if (!r.ok()) {
      state.SkipWithError(r.status().to_string().c_str());
      return;
    }
    pieces = r->stats.num_pieces;
    benchmark::DoNotOptimize(r->stats.num_pack_ops);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * pieces));
  state.counters["pieces"] = static_cast<double>(pieces);
}

void BM_WholeOneThread(benchmark::State& s) { route(s, RouterOptions{.threads = 1}); }
void BM_Whole(benchmark::State& s) { route(s, RouterOptions{}); }
void BM_ProducerRank(benchmark::State& s) {
  route(s, RouterOptions{.packs_of = 0, .unpacks_of = RouterOptions::kNoRank});
}
void BM_ConsumerRank(benchmark::State& s) { route(s, RouterOptions{.unpacks_of = 0}); }
void BM_NoOps(benchmark::State& s) {  // what ferry plan builds
  route(s, RouterOptions{.packs_of = RouterOptions::kNoRank, .unpacks_of = RouterOptions::kNoRank});
}

BENCHMARK(BM_WholeOneThread)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_Whole)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_ProducerRank)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_ConsumerRank)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_NoOps)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

int main(int argc, char** argv) {
  return ferry_bench::run_with_ratios(argc, argv,
                                      {{"BM_Whole", "BM_WholeOneThread", 1.0, "M pieces/s", 1e6},
                                       {"BM_ProducerRank", "BM_WholeOneThread", 1.0, "M pieces/s", 1e6},
                                       {"BM_ConsumerRank", "BM_WholeOneThread", 1.0, "M pieces/s", 1e6},
                                       {"BM_NoOps", "BM_WholeOneThread", 1.0, "M pieces/s", 1e6}});
}
