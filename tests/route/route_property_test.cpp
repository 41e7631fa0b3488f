// Property test: random small models, random Megatron and FSDP trainer layouts (uneven
// FSDP included), random inference layouts. The routes, executed in process (pack on
// producers from SyntheticSource, read = memcpy of the segment, unpack on consumers),
// must rebuild exactly the direct-load result of every consumer (its plan executed on
// the full tensors); every consumer element must come from exactly one producer; bytes
// moved must equal bytes_min; rebuilding is deterministic and the encoding round-trips.
#include <cstring>

#include <gtest/gtest.h>

#include "route/synthetic_model.h"

namespace ferry {
namespace {

using testing::InferSpec;
using testing::ModelSpec;
using testing::Rng;

ModelSpec random_spec(Rng& rng) {
  ModelSpec m;
  m.head_dim = rng.pick<int64_t>({4, 8});
  m.heads = rng.pick<int64_t>({4, 8});
  m.kv_heads = rng.pick<int64_t>({1, 2, 4});
  m.hidden = rng.pick<int64_t>({8, 16, 24});
  m.inter = rng.pick<int64_t>({8, 16});
  m.vocab = rng.uniform(5, 50);
  m.layers = rng.uniform(1, 4);
  m.experts = rng.coin(0.45) ? rng.pick<int64_t>({4, 8}) : 0;
  m.moe_inter = rng.pick<int64_t>({8, 16});
  m.fused_experts = m.experts > 0 && rng.coin(0.4);
  m.phi3 = m.experts == 0 && rng.coin(0.3);
  m.qkv_bias = !m.phi3 && rng.coin(0.3);
  m.scalar = rng.coin(0.3);
  m.tied = rng.coin(0.2);
  m.dtype = rng.pick<DType>({DType::kBF16, DType::kF32, DType::kF16});
  return m;
}

std::string random_trainer(Rng& rng, const ModelSpec& m) {
  if (rng.coin(0.35)) return fmt::format("fsdp={}", rng.uniform(1, 7));
  const int tp = static_cast<int>(rng.pick<int64_t>({1, 2, 4}));
  const int pp = static_cast<int>(rng.uniform(1, std::min<int64_t>(3, m.layers)));
  int ep = 1, etp = 1;
  if (m.experts > 0) {
    ep = static_cast<int>(rng.pick<int64_t>({1, 2, 4}));
    etp = static_cast<int>(rng.pick<int64_t>({1, 2}));
  }
  std::string s = fmt::format("tp={},pp={},ep={},etp={}", tp, pp, ep, etp);
  const int dp = static_cast<int>(rng.uniform(1, 3));
  if ((tp * dp) % (ep * etp) == 0 && rng.coin()) s += fmt::format(",dp={}", dp);
  return s;
}

InferSpec random_infer(Rng& rng, const ModelSpec& m) {
  InferSpec is;
  is.tp = static_cast<int>(rng.pick<int64_t>({1, 2, 4}));
  is.dp = static_cast<int>(rng.pick<int64_t>({1, 1, 2}));
  is.replicas = static_cast<int>(rng.uniform(1, 3));
  is.ep = m.experts > 0 && m.experts % (is.tp * is.dp) == 0 && rng.coin();
  return is;
}

// Per element of each param, how many unpack ops write it; must equal the plan's own
// copy coverage (1 where a copy writes, 0 on padding).
void check_exactly_once(const PlanRoute& pr, const Plan& plan) {
  std::vector<std::vector<int>> got(pr.params.size()), want(pr.params.size());
  for (size_t i = 0; i < pr.params.size(); ++i) {
    got[i].assign(static_cast<size_t>(shape_numel(pr.params[i].shape)), 0);
    want[i] = got[i];
  }
  auto mark = [](std::vector<int>& v, const Layout& l) {
    Shape idx(l.shape.size(), 0);
    for (int64_t e = 0; e < l.numel(); ++e) {
      v[static_cast<size_t>(l.offset_of(idx))]++;
      for (size_t k = idx.size(); k-- > 0;) {
        if (++idx[k] < l.shape[k]) break;
        idx[k] = 0;
      }
    }
  };
  for (const auto& g : pr.groups) {
    for (const auto& op : g.unpacks) mark(got[op.param], op.dst);
  }
  for (const Copy& c : plan.copies()) mark(want[c.param], c.dst);
  for (size_t i = 0; i < pr.params.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "param " << pr.params[i].name;
    for (int x : got[i]) ASSERT_LE(x, 1) << "param " << pr.params[i].name;
  }
  // Every unpack op lies inside exactly one read (one producer).
  for (const auto& g : pr.groups) {
    for (const auto& op : g.unpacks) {
      const uint64_t end = op.offset + static_cast<uint64_t>(op.dst.numel()) * dtype_size(op.src_dtype);
      int inside = 0;
      for (const auto& r : g.reads) inside += op.offset >= r.recv_offset && end <= r.recv_offset + r.length;
      ASSERT_EQ(inside, 1);
    }
  }
}

// Routes built with only producer `p`'s packs and consumer `c`'s plan class's unpacks
// (and with none, and with the two sides' usual scopes) against the whole routes.
void check_own_routes(const RouterInput& in, const Routes& whole, int p, int c) {
  const int kN = RouterOptions::kNoRank, kE = RouterOptions::kEveryRank;
  const std::pair<int, int> scopes[] = {{p, c}, {kN, kN}, {p, kN}, {kE, c}, {kN, kE}};
  for (auto [packs_of, unpacks_of] : scopes) {
    SCOPED_TRACE(fmt::format("packs of {}, unpacks of {}", packs_of, unpacks_of));
    auto own = build_routes(in, RouterOptions{.packs_of = packs_of, .unpacks_of = unpacks_of});
    ASSERT_TRUE(own.ok()) << own.status().to_string();
    ASSERT_TRUE(own->validate().ok()) << own->validate().to_string();
    EXPECT_EQ(own->fingerprint(), whole.fingerprint());
    EXPECT_EQ(own->stats.num_pack_ops, whole.stats.num_pack_ops);
    EXPECT_EQ(own->stats.num_unpack_ops, whole.stats.num_unpack_ops);
    EXPECT_EQ(own->stats.bytes_moved, whole.stats.bytes_moved);
    EXPECT_EQ(own->stats.max_producer_bytes, whole.stats.max_producer_bytes);
    ASSERT_EQ(own->producers.size(), whole.producers.size());
    ASSERT_EQ(own->plans.size(), whole.plans.size());
    EXPECT_EQ(own->consumer_plan, whole.consumer_plan);
    for (size_t q = 0; q < whole.producers.size(); ++q) {
      const bool kept = packs_of == kE || packs_of == static_cast<int>(q);
      EXPECT_EQ(own->has_packs(q), kept || [&] {  // a producer with no packs elides none
        for (const auto& g : whole.producers[q].groups)
          if (!g.packs.empty()) return false;
        return true;
      }()) << "producer " << q;
      for (size_t g = 0; g < whole.producers[q].groups.size(); ++g) {
        const ProducerGroup& a = own->producers[q].groups[g];
        const ProducerGroup& b = whole.producers[q].groups[g];
        ASSERT_EQ(a.staging_bytes, b.staging_bytes);
        ASSERT_EQ(a.segments, b.segments);
        if (kept) {
          ASSERT_EQ(a.packs, b.packs) << "producer " << q << " group " << g;
          ASSERT_EQ(a.elided_packs, 0u);
        } else {
          ASSERT_TRUE(a.packs.empty());
          ASSERT_EQ(a.elided_packs, b.packs.size()) << "producer " << q << " group " << g;
        }
      }
    }
    const int kept_plan = unpacks_of >= 0 ? static_cast<int>(whole.consumer_plan[static_cast<size_t>(unpacks_of)]) : -1;
    for (size_t k = 0; k < whole.plans.size(); ++k) {
      const bool kept = unpacks_of == kE || kept_plan == static_cast<int>(k);
      EXPECT_EQ(own->plans[k].params, whole.plans[k].params);
      for (size_t g = 0; g < whole.plans[k].groups.size(); ++g) {
        const PlanGroup& a = own->plans[k].groups[g];
        const PlanGroup& b = whole.plans[k].groups[g];
        ASSERT_EQ(a.recv_bytes, b.recv_bytes);
        ASSERT_EQ(a.reads, b.reads);
        if (kept) {
          ASSERT_EQ(a.unpacks, b.unpacks) << "plan " << k << " group " << g;
        } else {
          ASSERT_TRUE(a.unpacks.empty());
          ASSERT_EQ(a.elided_unpacks, b.unpacks.size()) << "plan " << k << " group " << g;
        }
      }
    }
    // Version 2 encoding round-trips what was elided.
    auto decoded = Routes::decode(own->encode());
    ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
    EXPECT_TRUE(*decoded == *own);
    EXPECT_EQ(decoded->fingerprint(), whole.fingerprint());
  }
}

TEST(RouteProperty, RoutesRebuildDirectLoads) {
  constexpr int kTrials = 160;
  int megatron = 0, fsdp = 0, uneven = 0, moe = 0, refined = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    Rng rng(1000 + static_cast<uint64_t>(trial));
    const ModelSpec m = random_spec(rng);
    const auto meta = testing::make_metadata(m);
    const std::string trainer = random_trainer(rng, m);
    const InferSpec is = random_infer(rng, m);
    SCOPED_TRACE(fmt::format("trial {}: trainer {} inference tp={},dp={},replicas={},ep={} layers={} experts={}{}{}",
                             trial, trainer, is.tp, is.dp, is.replicas, is.ep, m.layers, m.experts,
                             m.fused_experts ? " fused" : "", m.phi3 ? " phi3" : ""));
    auto layout = TrainerLayout::parse(trainer);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    ModelInfo info{m.q_rows(), m.kv_rows()};
    auto th = make_holdings(meta, *layout, info);
    ASSERT_TRUE(th.ok()) << th.status().to_string();
    std::vector<Holdings> holdings = th->ranks;
    if (layout->kind == TrainerLayout::Kind::kFsdp) {
      ++fsdp;
      uneven += m.vocab % layout->fsdp != 0;
    } else {
      ++megatron;
    }
    moe += m.experts > 0;
    // Sometimes add an extra producer holding a box that partially overlaps others
    // (forces refinement into cells).
    if (rng.coin(0.2)) {
      Holdings extra;
      const TensorDecl& d = meta[0];  // embed_tokens [V, H]
      const int64_t a = rng.uniform(0, d.shape[0] - 1);
      const int64_t n = rng.uniform(1, d.shape[0] - a);
      ASSERT_TRUE(extra.add(d, Box{{a, 1}, {n, d.shape[1] - 1}}).ok());
      holdings.push_back(extra);
      ++refined;
    }
    std::vector<Plan> plans;
    for (int c = 0; c < is.world(); ++c) {
      auto plan = testing::record_synthetic_plan(m, meta, is, c);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      plans.push_back(std::move(*plan));
    }
    RouterInput in;
    in.metadata = meta;
    in.producers = holdings;
    for (const auto& p : plans) in.consumers.push_back(&p);
    auto routes = build_routes(in);
    ASSERT_TRUE(routes.ok()) << routes.status().to_string();
    ASSERT_TRUE(routes->validate().ok()) << routes->validate().to_string();
    EXPECT_EQ(routes->stats.bytes_moved, routes->stats.bytes_min);
    // Replicas share routes.
    for (int c = 0; c < is.world(); ++c) {
      EXPECT_EQ(routes->consumer_plan[c], routes->consumer_plan[c % (is.tp * is.dp)]);
    }
    // Deterministic on any number of threads; encoding round-trips.
    for (int threads : {1, 3}) {
      auto again = build_routes(in, RouterOptions{.threads = threads});
      ASSERT_TRUE(again.ok());
      ASSERT_EQ(again->encode(), routes->encode()) << threads << " threads";
    }
    auto decoded = Routes::decode(routes->encode());
    ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
    ASSERT_TRUE(*decoded == *routes);
    ASSERT_EQ(decoded->hash(), routes->hash());
    ASSERT_EQ(decoded->fingerprint(), routes->fingerprint());
    // A rank's own routes (RouterOptions::packs_of / unpacks_of): every segment and read
    // and the stats as the whole routes have them, its own ops equal, the others' elided
    // with their counts, and the same fingerprint.
    check_own_routes(in, *routes, static_cast<int>(rng.uniform(0, static_cast<int64_t>(holdings.size()) - 1)),
                     static_cast<int>(rng.uniform(0, is.world() - 1)));
    if (HasFatalFailure()) return;

    for (size_t k = 0; k < routes->plans.size(); ++k) {
      size_t c = 0;
      while (routes->consumer_plan[c] != k) ++c;
      check_exactly_once(routes->plans[k], plans[c]);
      if (HasFatalFailure()) return;
    }
    const uint64_t seed = 77 + static_cast<uint64_t>(trial);
    for (uint64_t version : {uint64_t{1}, uint64_t{2}}) {
      auto got = testing::run_routes(*routes, meta, holdings, seed, version);
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      for (int c = 0; c < is.world(); ++c) {
        auto want = testing::direct_load(plans[static_cast<size_t>(c)], meta, seed, version);
        ASSERT_TRUE(want.ok()) << want.status().to_string();
        for (const auto& d : plans[static_cast<size_t>(c)].params()) {
          const Tensor& a = (*got)[static_cast<size_t>(c)].at(d.name);
          const Tensor& b = want->at(d.name);
          ASSERT_EQ(std::memcmp(a.data_ptr().value(), b.data_ptr().value(), static_cast<size_t>(a.nbytes())), 0)
              << "consumer " << c << " param " << d.name << " version " << version;
        }
      }
    }
  }
  // The generator covered what it should.
  EXPECT_GT(megatron, 40);
  EXPECT_GT(fsdp, 20);
  EXPECT_GT(uneven, 10);
  EXPECT_GT(moe, 30);
  EXPECT_GT(refined, 10);
}

}  // namespace
}  // namespace ferry
