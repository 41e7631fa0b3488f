// Routing at many trainer ranks (issue 30): FSDP routing used to scan every holder box
// per copy and per box (quadratic in the ranks). The near-linear router must build the
// very same routes: hashes of Routes::encode() recorded with the quadratic router (at
// the commit before the change) for real configs, and routes at many FSDP ranks
// executed in process must rebuild the loader's direct load (the oracle).
#include <gtest/gtest.h>

#include "ferry/models.h"
#include "route/synthetic_model.h"
#include "test_paths.h"

namespace ferry {
namespace {

struct Built {
  std::vector<TensorDecl> meta;
  TrainerHoldings holdings;
  std::vector<Plan> plans;
  Routes routes;
  std::shared_ptr<const ModelLoader> loader;
};

Result<Built> build(const std::string& config, const std::string& trainer, const std::string& inference, bool shrink) {
  FERRY_ASSIGN_OR_RETURN(auto cfg, ModelConfig::load(config));
  FERRY_ASSIGN_OR_RETURN(auto il, InferenceLayout::parse(inference));
  LoaderOptions lo;
  if (shrink) {
    FERRY_ASSIGN_OR_RETURN(auto s, shrink_config(cfg, il, lo));
    cfg = s.config;
  }
  Built b;
  FERRY_ASSIGN_OR_RETURN(auto loader, make_model_loader(cfg, il, lo));
  b.loader = std::move(loader);
  b.meta = b.loader->checkpoint();
  FERRY_ASSIGN_OR_RETURN(auto layout, TrainerLayout::parse(trainer));
  FERRY_ASSIGN_OR_RETURN(b.holdings, make_holdings(b.meta, layout, model_info_from_config(cfg.json())));
  for (int r = 0; r < il.world_size(); ++r) {
    FERRY_ASSIGN_OR_RETURN(auto p, record_plan(*b.loader, r));
    b.plans.push_back(std::move(p));
  }
  RouterInput in;
  in.metadata = b.meta;
  in.producers = b.holdings.ranks;
  for (const auto& p : b.plans) in.consumers.push_back(&p);
  FERRY_ASSIGN_OR_RETURN(b.routes, build_routes(in));
  return b;
}

struct Golden {
  const char* config;
  const char* trainer;
  const char* inference;
  bool shrink;
  uint64_t hash;  // Routes::hash() from the quadratic router
};

TEST(RouteScale, RoutesEqualTheQuadraticRoutersOnes) {
  const std::string configs = FERRY_CONFIGS_DIR, test_configs = FERRY_TEST_CONFIGS_DIR;
  const Golden cases[] = {
      {"/llama-3.1-8b.json", "fsdp=256", "tp=8", false, 0x2cb2a76a0967898b},
      {"/llama-3.1-8b.json", "fsdp=7", "tp=4,replicas=2", true, 0xdd14eae351a3f2d6},
      {"/llama-3.1-8b.json", "tp=2,pp=2,dp=2", "tp=4", true, 0xba1ceb09c6c6d9cf},
      {"/qwen3-30b-a3b.json", "fsdp=96", "tp=4,ep=4", true, 0xb6ccd3cfb4ac8e33},
      {"/qwen3-30b-a3b.json", "tp=2,pp=2,ep=4,etp=1,dp=2", "tp=2,dp=2,ep=4", true, 0xc0674a8ab0e3d277},
      {"T/phi-3-mini-4k.json", "fsdp=33", "tp=4", true, 0x4c7ece878660a7be},
      {"T/phi-3-mini-4k.json", "tp=4,pp=1", "tp=2", true, 0xb27d75ffe9282c80},
  };
  for (const Golden& g : cases) {
    const std::string path = g.config[0] == 'T' ? test_configs + (g.config + 1) : configs + g.config;
    SCOPED_TRACE(fmt::format("{} {} -> {}", path, g.trainer, g.inference));
    auto b = build(path, g.trainer, g.inference, g.shrink);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_EQ(b->routes.stats.bytes_moved, b->routes.stats.bytes_min);
    EXPECT_EQ(b->routes.hash(), g.hash) << fmt::format("0x{:016x}", b->routes.hash());
  }
}

// The oracle at many ranks: a shrunk Llama over FSDP ranks that outnumber many of its
// tensors' rows (most ranks hold a row or nothing of the small ones), every consumer's
// params rebuilt from the routes equal the loader's direct load.
TEST(RouteScale, ManyFsdpRanksRebuildTheDirectLoad) {
  for (const char* trainer : {"fsdp=61", "fsdp=200", "fsdp=1000"}) {
    SCOPED_TRACE(trainer);
    auto b = build(std::string(FERRY_CONFIGS_DIR) + "/llama-3.1-8b.json", trainer, "tp=4", true);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    const uint64_t seed = 5, version = 2;
    auto got = testing::run_routes(b->routes, b->meta, b->holdings.ranks, seed, version);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    TensorMap checkpoint;
    for (const auto& d : b->meta) checkpoint.emplace(d.name, synthetic_tensor(seed, version, d));
    for (int r = 0; r < static_cast<int>(b->plans.size()); ++r) {
      auto direct = load_rank_direct(*b->loader, r, checkpoint);
      ASSERT_TRUE(direct.ok()) << direct.status().to_string();
      auto rl = b->loader->rank(r);
      ASSERT_TRUE(rl.ok());
      auto mm = compare_params((*rl)->final_params(), *direct, (*got)[static_cast<size_t>(r)]);
      ASSERT_TRUE(mm.ok()) << mm.status().to_string();
      ASSERT_FALSE(mm->has_value()) << "rank " << r << ": param " << (*mm)->param << " index " << (*mm)->index;
    }
  }
}

}  // namespace
}  // namespace ferry
