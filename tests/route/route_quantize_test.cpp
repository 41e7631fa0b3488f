// Producer-side block quantisation (issue 29): the tile regions against an oracle, and
// routes that quantise on the producers (RouterOptions::quantize_on) rebuilding, bit for
// bit, what the consumer's own FP8 post-processing keeps, with real model loaders.
#include <set>

#include <gtest/gtest.h>

#include "ferry/models.h"
#include "route/synthetic_model.h"
#include "route/tiles.h"
#include "test_paths.h"

namespace ferry {
namespace {

using route_detail::TileGrid;
using route_detail::TileRegion;
using testing::Rng;

// Sets tile (b, br, bc) of `g` to `id` (through mark_run on its first element).
void set_tile(TileGrid& g, int64_t b, int64_t br, int64_t bc, int32_t id) {
  const int64_t flat = (b * g.rows() + br * g.trows()) * g.cols() + bc * g.block();
  g.mark_run(flat, 1, [&](int32_t& t, int64_t, int64_t, int64_t, int64_t) { t = id; });
}

// Runs of elements (partial rows, whole rows, across matrices) marked as runs of tiles
// give every tile the id a tile-by-tile marking of each element gives; each tile row's
// runs cover it and neighbours differ.
TEST(TileGrid, MarksEveryTileARunTouchesAgainstAnOracle) {
  for (int trial = 0; trial < 300; ++trial) {
    Rng rng(5000 + static_cast<uint64_t>(trial));
    const int64_t batch = rng.uniform(1, 3), rows = rng.uniform(1, 30), cols = rng.uniform(1, 30);
    const int64_t trows = rng.pick<int64_t>({1, 2, 4, 8}), block = rng.pick<int64_t>({1, 2, 3, 8});
    TileGrid g(Shape{batch, rows, cols}, trows, block);
    const int64_t brows = (rows + trows - 1) / trows, bcols = (cols + block - 1) / block;
    std::vector<int32_t> oracle(static_cast<size_t>(batch * brows * bcols), TileGrid::kNone);
    auto combine = [](int32_t t, int32_t id) { return t == TileGrid::kNone || t == id ? id : -2; };
    const int64_t numel = batch * rows * cols;
    for (int m = static_cast<int>(rng.uniform(1, 6)); m > 0; --m) {
      const int64_t flat = rng.uniform(0, numel - 1), n = rng.uniform(1, numel - flat);
      const auto id = static_cast<int32_t>(rng.uniform(0, 2));
      g.mark_run(flat, n, [&](int32_t& t, int64_t, int64_t, int64_t, int64_t) { t = combine(t, id); });
      for (int64_t e = flat; e < flat + n; ++e) {
        const int64_t b = e / (rows * cols), r = e % (rows * cols) / cols, c = e % cols;
        int32_t& t = oracle[static_cast<size_t>((b * brows + r / trows) * bcols + c / block)];
        t = combine(t, id);
      }
    }
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t br = 0; br < brows; ++br) {
        const auto& runs = g.runs(b, br);
        ASSERT_FALSE(runs.empty());
        EXPECT_EQ(runs.front().bc0, 0);
        EXPECT_EQ(runs.back().bc1, bcols);
        for (size_t i = 1; i < runs.size(); ++i) {
          EXPECT_EQ(runs[i].bc0, runs[i - 1].bc1);
          EXPECT_NE(runs[i].id, runs[i - 1].id);
        }
        for (int64_t bc = 0; bc < bcols; ++bc)
          ASSERT_EQ(g.id(b, br, bc), oracle[static_cast<size_t>((b * brows + br) * bcols + bc)])
              << "trial " << trial << " tile " << b << "," << br << "," << bc;
      }
    EXPECT_EQ(g.count(TileGrid::kNone),
              static_cast<uint64_t>(std::count(oracle.begin(), oracle.end(), TileGrid::kNone)));
  }
}

TEST(TileRegions, PartitionTheTilesByIdAgainstAnOracle) {
  int merged_batches = 0, split = 0;
  for (int trial = 0; trial < 400; ++trial) {
    Rng rng(7000 + static_cast<uint64_t>(trial));
    const int64_t batch = rng.uniform(1, 3), rows = rng.uniform(1, 40), cols = rng.uniform(1, 40);
    const int64_t trows = rng.pick<int64_t>({1, 2, 4, 8}), block = rng.pick<int64_t>({1, 2, 3, 4, 8});
    TileGrid g(Shape{batch, rows, cols}, trows, block);
    SCOPED_TRACE(fmt::format("trial {}: [{}, {}, {}] tiles {}x{}", trial, batch, rows, cols, trows, block));
    // A base id painted over with a few rectangles of others (mergeable runs, as routes give).
    const int32_t base = static_cast<int32_t>(rng.uniform(0, 2));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t br = 0; br < g.tile_rows(); ++br)
        for (int64_t bc = 0; bc < g.tile_cols(); ++bc) set_tile(g, b, br, bc, base);
    for (int64_t n = rng.uniform(0, 3); n > 0; --n) {
      const int64_t b = rng.uniform(0, batch - 1), r0 = rng.uniform(0, g.tile_rows() - 1),
                    c0 = rng.uniform(0, g.tile_cols() - 1);
      const int64_t r1 = rng.uniform(r0, g.tile_rows() - 1), c1 = rng.uniform(c0, g.tile_cols() - 1);
      const auto id = static_cast<int32_t>(rng.uniform(0, 3));
      for (int64_t br = r0; br <= r1; ++br)
        for (int64_t bc = c0; bc <= c1; ++bc) set_tile(g, b, br, bc, id);
    }
    const uint64_t max = rng.coin(0.5) ? (uint64_t{1} << 40)
                                       : static_cast<uint64_t>(trows * block * rng.uniform(1, 6));
    const std::vector<TileRegion> regions = route_detail::tile_regions(g, max);
    EXPECT_EQ(regions, route_detail::tile_regions(g, max));  // deterministic
    std::vector<int> covered(g.tiles(), 0);
    for (size_t i = 0; i < regions.size(); ++i) {
      const TileRegion& r = regions[i];
      if (i) {
        const TileRegion& p = regions[i - 1];
        EXPECT_LT(std::tie(p.b0, p.r0, p.c0), std::tie(r.b0, r.r0, r.c0));
      }
      ASSERT_GT(r.nb * r.nr * r.nc, 0);
      ASSERT_EQ(r.r0 % trows, 0);
      ASSERT_EQ(r.c0 % block, 0);
      ASSERT_TRUE(r.nr % trows == 0 || r.r0 + r.nr == rows) << r.r0 << "+" << r.nr;
      ASSERT_TRUE(r.nc % block == 0 || r.c0 + r.nc == cols) << r.c0 << "+" << r.nc;
      ASSERT_LE(r.b0 + r.nb, batch);
      ASSERT_LE(r.r0 + r.nr, rows);
      ASSERT_LE(r.c0 + r.nc, cols);
      const bool one_tile = r.nb == 1 && r.nr <= trows && r.nc <= block;
      EXPECT_TRUE(r.numel() <= max || one_tile) << r.numel() << " > " << max;
      split += max < (uint64_t{1} << 40);
      merged_batches += r.nb > 1;
      for (int64_t b = r.b0; b < r.b0 + r.nb; ++b)
        for (int64_t br = r.r0 / trows; br * trows < r.r0 + r.nr; ++br)
          for (int64_t bc = r.c0 / block; bc * block < r.c0 + r.nc; ++bc) {
            EXPECT_EQ(g.id(b, br, bc), r.id);
            covered[static_cast<size_t>((b * g.tile_rows() + br) * g.tile_cols() + bc)]++;
          }
    }
    for (size_t t = 0; t < covered.size(); ++t) ASSERT_EQ(covered[t], 1) << "tile " << t;
  }
  EXPECT_GT(merged_batches, 10);
  EXPECT_GT(split, 10);
}

TEST(TileRegions, OneIdIsOneRegion) {
  TileGrid g(Shape{4, 300, 260}, 128, 128);
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t br = 0; br < 3; ++br)
      for (int64_t bc = 0; bc < 3; ++bc) set_tile(g, b, br, bc, 5);
  EXPECT_EQ(route_detail::tile_regions(g, uint64_t{1} << 30),
            (std::vector<TileRegion>{TileRegion{0, 4, 0, 300, 0, 260, 5}}));
  // Bounded: a matrix each, then 2 tile rows of 128 (the last 44 rows alone).
  const auto small = route_detail::tile_regions(g, 2 * 128 * 260);
  ASSERT_EQ(small.size(), 8u);
  EXPECT_EQ(small[0], (TileRegion{0, 1, 0, 256, 0, 260, 5}));
  EXPECT_EQ(small[1], (TileRegion{0, 1, 256, 44, 0, 260, 5}));
}

// ---------------------------------------------------------------------------------------
// Routes with real model loaders.

struct Built {
  std::unique_ptr<ModelLoader> loader;
  std::vector<TensorDecl> meta;
  TrainerHoldings holdings;
  std::vector<Plan> plans;
};

Result<Built> build(const std::string& config, const InferenceLayout& il, const LoaderOptions& lo,
                    const std::string& trainer) {
  Built b;
  FERRY_ASSIGN_OR_RETURN(auto cfg, ModelConfig::load(config));
  FERRY_ASSIGN_OR_RETURN(auto shrunk, shrink_config(cfg, il, lo));
  FERRY_ASSIGN_OR_RETURN(b.loader, make_model_loader(shrunk.config, il, lo));
  b.meta = b.loader->checkpoint();
  FERRY_ASSIGN_OR_RETURN(auto layout, TrainerLayout::parse(trainer));
  FERRY_ASSIGN_OR_RETURN(b.holdings, make_holdings(b.meta, layout, model_info_from_config(shrunk.config.json())));
  for (int r = 0; r < il.world_size(); ++r) {
    FERRY_ASSIGN_OR_RETURN(Plan p, record_plan(*b.loader, r));
    b.plans.push_back(std::move(p));
  }
  return b;
}

Result<Routes> route(const Built& b, QuantizeOn on, int packs_of = RouterOptions::kEveryRank) {
  RouterInput in;
  in.metadata = b.meta;
  in.producers = b.holdings.ranks;
  for (const auto& p : b.plans) in.consumers.push_back(&p);
  RouterOptions ro;
  ro.quantize_on = on;
  ro.packs_of = packs_of;
  return build_routes(in, ro);
}

// Every rank's params through the routes and the loader's post-processing equal its
// direct load (which quantises on the consumer), bit for bit.
void expect_rebuilds(const Built& b, const Routes& routes, const InferenceLayout& il, uint64_t seed) {
  auto got = testing::run_routes(routes, b.meta, b.holdings.ranks, seed, 1);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  TensorMap checkpoint;
  for (const auto& d : b.meta) checkpoint.emplace(d.name, synthetic_tensor(seed, 1, d));
  for (int r = 0; r < il.world_size(); ++r) {
    auto rl = b.loader->rank(r);
    ASSERT_TRUE(rl.ok());
    TensorMap& params = (*got)[static_cast<size_t>(r)];
    for (size_t g = 0; g < (*rl)->groups().size(); ++g) {
      ASSERT_TRUE((*rl)->process_weights_after_loading(static_cast<int>(g), params).ok());
    }
    auto direct = load_rank_direct(*b.loader, r, checkpoint);
    ASSERT_TRUE(direct.ok()) << direct.status().to_string();
    auto mm = compare_params((*rl)->final_params(), *direct, params);
    ASSERT_TRUE(mm.ok()) << mm.status().to_string();
    ASSERT_FALSE(mm->has_value()) << "rank " << r << ": param " << (*mm)->param << " index " << (*mm)->index << " "
                                  << (*mm)->detail;
  }
}

TEST(RouteQuantize, ProducerQuantisationRebuildsTheConsumersBits) {
  struct Case {
    std::string config;
    std::vector<int64_t> tps;
  };
  const std::vector<Case> cases = {
      {std::string(FERRY_CONFIGS_DIR) + "/llama-3.1-8b.json", {1, 2, 4}},
      {std::string(FERRY_CONFIGS_DIR) + "/qwen3-30b-a3b.json", {1, 2}},
      {std::string(FERRY_CONFIGS_DIR) + "/deepseek-v3.json", {1, 2}},
      {std::string(FERRY_TEST_CONFIGS_DIR) + "/qwen3-0.6b.json", {1, 2}},
  };
  constexpr int kTrials = 16;
  int routed = 0;
  uint64_t quantized = 0, on_producer = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    Rng rng(900 + static_cast<uint64_t>(trial));
    const Case& c = cases[static_cast<size_t>(trial) % cases.size()];
    InferenceLayout il;
    il.tp = static_cast<int>(rng.pick(c.tps));
    il.replicas = static_cast<int>(rng.uniform(1, 2));
    LoaderOptions lo;
    lo.quantize = rng.pick<Quantize>({Quantize::kFp8, Quantize::kFp8Ue8m0, Quantize::kMxfp8});
    const std::string trainer =
        rng.coin(0.2) ? fmt::format("fsdp={}", rng.uniform(1, 3))
                      : fmt::format("tp={},pp={},dp={}", rng.pick<int64_t>({1, 2}), rng.uniform(1, 2), rng.uniform(1, 2));
    SCOPED_TRACE(fmt::format("trial {}: {} inference {} quantize {} trainer {}", trial, c.config, il.to_string(),
                             quantize_name(lo.quantize), trainer));
    auto b = build(c.config, il, lo, trainer);
    if (!b.ok()) continue;  // a trainer TP the shrunk dims don't divide
    auto routes = route(*b, QuantizeOn::kProducer);
    ASSERT_TRUE(routes.ok()) << routes.status().to_string();
    ASSERT_TRUE(routes->validate().ok()) << routes->validate().to_string();
    EXPECT_EQ(routes->stats.bytes_moved, routes->stats.bytes_min);
    quantized += routes->stats.quantized_params;
    on_producer += routes->stats.quantized_on_producer;
    expect_rebuilds(*b, *routes, il, 41 + static_cast<uint64_t>(trial));
    if (HasFatalFailure()) return;
    // Round trip, and the same fingerprint whichever producer's packs were made.
    auto back = Routes::decode(routes->encode());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(*back, *routes);
    auto elided = route(*b, QuantizeOn::kProducer, 0);
    ASSERT_TRUE(elided.ok());
    EXPECT_EQ(elided->fingerprint(), routes->fingerprint());
    ++routed;
  }
  EXPECT_GT(routed, kTrials / 2);
  EXPECT_GT(on_producer, quantized / 2);  // most params: TP shards of 128-multiples
  std::printf("routed %d; %llu of %llu quantised params on the producers\n", routed,
              static_cast<unsigned long long>(on_producer), static_cast<unsigned long long>(quantized));
}

// Matching TP: every linear from one producer, quantised there; the wire carries about
// half the bytes, and into-param landing (the e4m3 values) works on the consumer.
TEST(RouteQuantize, MatchingTpQuantisesEveryLinearOnTheProducers) {
  InferenceLayout il;
  il.tp = 2;
  il.replicas = 2;
  LoaderOptions lo;
  lo.quantize = Quantize::kFp8;
  auto b = build(std::string(FERRY_CONFIGS_DIR) + "/qwen3-30b-a3b.json", il, lo, "tp=2,dp=2");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  auto dense = route(*b, QuantizeOn::kConsumer);
  auto fp8 = route(*b, QuantizeOn::kProducer);
  ASSERT_TRUE(dense.ok() && fp8.ok());
  EXPECT_GT(fp8->stats.quantized_params, 0u);
  EXPECT_EQ(fp8->stats.quantized_on_producer, fp8->stats.quantized_params);
  EXPECT_EQ(dense->stats.quantized_on_producer, 0u);
  EXPECT_LT(fp8->stats.bytes_moved, dense->stats.bytes_moved * 6 / 10);
  std::printf("bytes moved: %llu dense, %llu with fp8 on the producers (%.3fx); %llu regions\n",
              static_cast<unsigned long long>(dense->stats.bytes_moved),
              static_cast<unsigned long long>(fp8->stats.bytes_moved),
              static_cast<double>(fp8->stats.bytes_moved) / static_cast<double>(dense->stats.bytes_moved),
              static_cast<unsigned long long>(fp8->stats.quant_regions));
  // The consumer's params: every quantised one e4m3 with its scales, as the loader keeps.
  auto rl = b->loader->rank(0);
  ASSERT_TRUE(rl.ok());
  std::map<std::string, TensorDecl> want;
  for (const TensorDecl& d : (*rl)->final_params()) want[d.name] = d;
  for (const TensorDecl& d : fp8->consumer(0).params) {
    ASSERT_TRUE(want.count(d.name)) << d.name;
    EXPECT_EQ(want[d.name], d);
  }
  EXPECT_EQ(fp8->consumer(0).params.size(), want.size());
  // The DP replicas share the regions: each producer quantises some.
  std::set<uint32_t> quantising;
  for (uint32_t p = 0; p < fp8->producers.size(); ++p)
    for (const ProducerGroup& g : fp8->producers[p].groups)
      if (!g.quants.empty()) quantising.insert(p);
  EXPECT_EQ(quantising.size(), 4u);
  expect_rebuilds(*b, *fp8, il, 5);
}

// A block that straddles two trainer ranks' boxes leaves the param to the consumer, and
// the rest still quantise on the producers.
TEST(RouteQuantize, StraddledTilesStayOnTheConsumer) {
  InferenceLayout il;  // tp=1: the consumer's params are whole; the trainer's TP=4 shards
  LoaderOptions lo;    // of a shrunk 8B are not multiples of 128 rows where heads are few
  lo.quantize = Quantize::kFp8;
  auto b = build(std::string(FERRY_CONFIGS_DIR) + "/llama-3.1-8b.json", il, lo, "tp=4");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  auto fp8 = route(*b, QuantizeOn::kProducer);
  ASSERT_TRUE(fp8.ok()) << fp8.status().to_string();
  EXPECT_LT(fp8->stats.quantized_on_producer, fp8->stats.quantized_params);
  expect_rebuilds(*b, *fp8, il, 6);
}

TEST(RouteQuantize, ConsumerSideLeavesTheRoutesAsTheyWere) {
  InferenceLayout il;
  il.tp = 2;
  LoaderOptions lo;
  lo.quantize = Quantize::kFp8;
  auto b = build(std::string(FERRY_CONFIGS_DIR) + "/llama-3.1-8b.json", il, lo, "tp=2,pp=2");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  auto with = route(*b, QuantizeOn::kConsumer);
  for (Plan& p : b->plans) ASSERT_TRUE(p.set_quantized({}).ok());
  auto without = route(*b, QuantizeOn::kProducer);  // nothing asked: nothing to quantise
  ASSERT_TRUE(with.ok() && without.ok());
  for (size_t k = 0; k < with->plans.size(); ++k) with->plans[k].plan_hash = without->plans[k].plan_hash;
  EXPECT_EQ(*with, *without);
  EXPECT_EQ(with->encode(), without->encode());
}

TEST(RouteQuantize, DecodingRefusesCorruptQuantOps) {
  InferenceLayout il;
  il.tp = 2;
  LoaderOptions lo;
  lo.quantize = Quantize::kFp8Ue8m0;
  auto b = build(std::string(FERRY_TEST_CONFIGS_DIR) + "/qwen3-0.6b.json", il, lo, "tp=2");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  auto routes = route(*b, QuantizeOn::kProducer);
  ASSERT_TRUE(routes.ok());
  ASSERT_GT(routes->stats.quantized_on_producer, 0u);
  const std::string good = routes->encode();
  Rng rng(3);
  for (int i = 0; i < 3000; ++i) {
    std::string bad = good;
    const auto at = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(good.size()) - 1));
    bad[at] = static_cast<char>(bad[at] ^ (1 << rng.uniform(0, 7)));
    auto r = Routes::decode(bad);
    if (r.ok()) {
      EXPECT_TRUE(r->validate().ok());
    }
  }
  for (size_t n = 0; n < good.size(); n += 1 + good.size() / 500) EXPECT_FALSE(Routes::decode(good.substr(0, n)).ok());
  // A quant op whose fills no longer cover its region is refused by name.
  Routes broken = *routes;
  for (auto& p : broken.producers)
    for (auto& g : p.groups)
      if (!g.quants.empty()) {
        g.quants[0].fills.pop_back();
        goto done;
      }
done:
  const Status st = broken.validate();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("of its region's"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace ferry
