// The per-group schedule (engine/schedule.h) on its own, with no transport: producers
// pack what their schedule says, consumers copy what theirs says from staging or the
// trainer's memory into the receive slot or straight into params, unpack the rest, and
// every consumer must equal a direct load bit for bit; both sides' byte counts and
// checksums must agree. Instantiated over models, layouts and modes (pull with and
// without in-place serving and reads into params; push, which writes in place into params
// by the same schedule).
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <set>

#include "engine/in_place.h"
#include "engine/memory.h"
#include "engine/param_set.h"
#include "engine/registered_buffer.h"
#include "engine/schedule.h"
#include "routes_fixture.h"
#include "tools/job_model.h"

namespace ferry::engine {
namespace {

using tools::JobModel;
using tools::make_job_model;
using tools::verify_params;

using testing::cfg;
using testing::ProducerSide;

struct ScheduleCase {
  const char* name;
  const char* config;
  const char* trainer;
  const char* inference;
  SyncMode mode;               // what the case stands for: the schedule is the same in both modes
  bool in_place;              // producers' boxes laid out in one source region each
  uint64_t direct_min_bytes;  // UINT64_MAX: nothing read into params
};

class ScheduleTest : public ::testing::TestWithParam<ScheduleCase> {};

Routes build(const JobModel& m, std::vector<Plan>& plans) { return testing::build_job_routes(m, plans); }

TEST_P(ScheduleTest, MovesEveryByteAndBothSidesAgree) {
  const ScheduleCase& k = GetParam();
  auto model = make_job_model(cfg(k.config), k.trainer, k.inference, true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const JobModel& m = *model;
  std::vector<Plan> plans;
  const Routes routes = build(m, plans);
  const int C = m.inference.world_size(), G = routes.num_groups();
  const uint64_t seed = 5, version = 1;

  std::vector<ProducerSide> prod;
  ASSERT_NO_FATAL_FAILURE(testing::make_producer_sides(m, routes, k.in_place, seed, version, prod));

  uint64_t in_place_bytes = 0, direct_bytes = 0;
  for (int c = 0; c < C; ++c) {
    auto rl = m.loader->rank(c);
    ASSERT_TRUE(rl.ok());
    // Where the bytes land: the consumer's param set (every param its own, zeroed, in one
    // arena of plain host memory), as the engine lands them.
    std::vector<TensorDecl> decls;
    for (const ParamInfo& pi : (*rl)->params()) decls.push_back(pi.decl);
    auto set = ParamSet::create(ParamSetOptions{c, false, k.direct_min_bytes}, decls, {}, host_param_memory());
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    TensorMap params = (*set)->loaded();  // handles: unpack writes the set's buffers
    ConsumerScheduleInputs in;
    in.routes = &routes;
    in.rank = c;
    in.direct_min_bytes = k.direct_min_bytes;
    in.params = &(*set)->placements();
    in.holdings = m.holdings.get();
    for (const ProducerSide& ps : prod) in.in_place.push_back(k.in_place ? &ps.table : nullptr);
    const ConsumerSchedule cs = make_consumer_schedule(in);
    ASSERT_EQ(cs.groups.size(), static_cast<size_t>(G));
    const PlanRoute& plan_route = routes.consumer(static_cast<size_t>(c));
    const uint32_t cls = routes.consumer_plan[static_cast<size_t>(c)];
    std::vector<std::byte> ring(consumer_slot_bytes(plan_route));
    for (int g = 0; g < G; ++g) {
      const ConsumerGroupSchedule& gs = cs.groups[static_cast<size_t>(g)];
      ASSERT_LE(plan_route.groups[static_cast<size_t>(g)].recv_bytes, ring.size());
      std::fill(ring.begin(), ring.end(), std::byte{0xCD});
      std::map<int, uint64_t> got, got_in_place;
      for (const SubRead& sr : gs.reads) {
        const ProducerSide& ps = prod[sr.producer];
        const std::byte* from = sr.region >= 0 ? ps.region.data() + sr.remote
                                               : ps.staging[static_cast<size_t>(g)].data() + sr.remote;
        std::byte* to = sr.param ? (*set)->landing(sr).data : ring.data() + sr.recv_offset;
        if (sr.region < 0) {
          ASSERT_LE(sr.remote + sr.length, ps.staging[static_cast<size_t>(g)].size());
        }
        std::memcpy(to, from, sr.length);
        got[static_cast<int>(sr.producer)] += sr.length;
        if (sr.region >= 0) got_in_place[static_cast<int>(sr.producer)] += sr.length;
        if (sr.param) direct_bytes += sr.length;
      }
      uint64_t total = 0;
      for (const auto& [p, bytes] : gs.received_from) {
        const ProducerGroupSchedule& ps = prod[static_cast<size_t>(p)].schedule.groups[static_cast<size_t>(g)];
        ASSERT_TRUE(ps.served.count(cls)) << "consumer " << c << " reads from producer " << p << " which serves it nothing";
        EXPECT_EQ(got[p], ps.served.at(cls)) << "consumer " << c << " producer " << p << " group " << g;
        EXPECT_EQ(gs.received_from.at(p), ps.served.at(cls));
        const uint64_t ip = ps.served_in_place.count(cls) ? ps.served_in_place.at(cls) : 0;
        EXPECT_EQ(got_in_place[p], ip) << "consumer " << c << " producer " << p << " group " << g;
        in_place_bytes += got_in_place[p];
        total += got[p];
        // Checksums: the consumer hashes where the bytes landed, in its checksum order;
        // the producer hashes its spans. They must agree.
        SegmentHash mine;
        for (uint32_t i : gs.checksum_order.at(p)) {
          const SubRead& sr = gs.reads[i];
          mine.update(sr.param ? (*set)->landing(sr).data : ring.data() + sr.recv_offset, sr.length);
        }
        SegmentHash theirs;
        for (const SegmentSpan& x : ps.checksum_spans.at(cls)) {
          const ProducerSide& side = prod[static_cast<size_t>(p)];
          theirs.update((x.region < 0 ? side.staging[static_cast<size_t>(g)].data() : side.region.data()) + x.offset,
                        x.bytes);
        }
        EXPECT_EQ(mine.digest(), theirs.digest()) << "consumer " << c << " producer " << p << " group " << g;
      }
      EXPECT_EQ(total, gs.received);
      ASSERT_TRUE(unpack_group(cs.unpack, g, std::span<const std::byte>(ring.data(), ring.size()), params).ok());
    }
    auto mismatch = verify_params(m, c, params, seed, version);
    ASSERT_TRUE(mismatch.ok()) << mismatch.status().to_string();
    EXPECT_FALSE(mismatch->has_value()) << "consumer " << c << ": " << **mismatch;
  }
  // The case's premise holds: in-place and direct paths are taken when the case asks.
  if (k.in_place) {
    EXPECT_GT(in_place_bytes, 0u);
  }
  if (!k.in_place) {
    EXPECT_EQ(in_place_bytes, 0u);
  }
  if (k.direct_min_bytes != UINT64_MAX) {
    EXPECT_GT(direct_bytes, 0u);
  }
  if (k.direct_min_bytes == UINT64_MAX) {
    EXPECT_EQ(direct_bytes, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ScheduleTest,
    ::testing::Values(
        ScheduleCase{"DenseStaged", "llama-3.1-8b.json", "tp=2", "tp=4", SyncMode::kPull, false, UINT64_MAX},
        ScheduleCase{"DenseIntoParams", "llama-3.1-8b.json", "tp=2", "tp=4", SyncMode::kPull, false, 0},
        ScheduleCase{"DenseInPlace", "llama-3.1-8b.json", "tp=2", "tp=4", SyncMode::kPull, true, 1024},
        ScheduleCase{"DenseInPlaceStagedReads", "llama-3.1-8b.json", "tp=4", "tp=2,replicas=2", SyncMode::kPull, true,
                     UINT64_MAX},
        ScheduleCase{"DensePush", "llama-3.1-8b.json", "tp=2", "tp=4", SyncMode::kPush, true, 0},
        ScheduleCase{"MoeInPlace", "qwen3-30b-a3b.json", "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2", SyncMode::kPull,
                     true, 64 * 1024},
        ScheduleCase{"MoeReplicasPush", "qwen3-30b-a3b.json", "tp=2,dp=2", "tp=2,ep=2", SyncMode::kPush, true,
                     64 * 1024},
        ScheduleCase{"FsdpIntoParams", "llama-3.1-8b.json", "fsdp=4", "tp=2", SyncMode::kPull, false, 0}),
    [](const ::testing::TestParamInfo<ScheduleCase>& i) { return std::string(i.param.name); });

// Slot sizes: every group fits; with failover, a producer's slot fits what it serves
// after any replica of it is gone.
TEST(ScheduleSlots, FitEveryGroupAndEveryFailover) {
  auto model = make_job_model(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2,replicas=2", true,
                              R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  std::vector<Plan> plans;
  const Routes routes = build(*model, plans);
  const int P = model->trainer.world_size();
  for (int c = 0; c < model->inference.world_size(); ++c) {
    const uint64_t slot = consumer_slot_bytes(routes.consumer(static_cast<size_t>(c)));
    EXPECT_EQ(slot % 64, 0u);
    for (const PlanGroup& g : routes.consumer(static_cast<size_t>(c)).groups) {
      EXPECT_LE(g.recv_bytes, slot);
    }
  }
  for (int p = 0; p < P; ++p) {
    const uint64_t with = producer_slot_bytes(routes, p, model->metadata, *model->holdings, true);
    const uint64_t without = producer_slot_bytes(routes, p, model->metadata, *model->holdings, false);
    EXPECT_GE(with, without);
    EXPECT_GT(with, without) << "producer " << p << " has a replica: its slot must cover a takeover";
    for (int dead = 0; dead < P; ++dead) {
      if (dead == p) continue;
      RouterInput in;
      in.metadata = model->metadata;
      in.producers = *model->holdings;
      in.producers[static_cast<size_t>(dead)] = Holdings{};
      for (const Plan& pl : plans) in.consumers.push_back(&pl);
      auto r = build_routes(in);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      Holdings h = (*model->holdings)[static_cast<size_t>(p)];
      auto s = make_producer_schedule(*r, p, h, InPlaceTable{}, with);
      EXPECT_TRUE(s.ok()) << "producer " << p << " without producer " << dead << ": " << s.status().to_string();
    }
    // A slot too small is refused, naming the group.
    auto small = make_producer_schedule(routes, p, (*model->holdings)[static_cast<size_t>(p)], InPlaceTable{}, 64);
    ASSERT_FALSE(small.ok());
    EXPECT_EQ(small.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(small.status().message().find("staging bytes"), std::string::npos);
  }
}

// Post-processing groups run once, after the last layer group that writes one of their params.
TEST(ScheduleSlots, PostProcessingGroupsRunOnceAfterTheirLastParam) {
  auto model = make_job_model(cfg("qwen3-235b-a22b-fp8.json"), "tp=1", "tp=2", true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  std::vector<Plan> plans;
  const Routes routes = build(*model, plans);
  auto rl = model->loader->rank(0);
  ASSERT_TRUE(rl.ok());
  std::map<std::string, ParamTable::Param> none;
  ConsumerScheduleInputs in;
  in.routes = &routes;
  in.params = &none;
  in.holdings = model->holdings.get();
  for (const ParamInfo& p : (*rl)->params()) in.post_group_of[p.decl.name] = p.group;
  in.num_post_groups = (*rl)->groups().size();
  ASSERT_GT(in.num_post_groups, 0u) << "the FP8 loader post-processes";
  const ConsumerSchedule cs = make_consumer_schedule(in);
  std::vector<int> runs(in.num_post_groups, 0);
  std::map<std::string, int> last;
  const PlanRoute& pr = routes.consumer(0);
  for (size_t g = 0; g < pr.groups.size(); ++g)
    for (const UnpackOp& u : pr.groups[g].unpacks) last[pr.params[u.param].name] = static_cast<int>(g);
  for (size_t g = 0; g < cs.groups.size(); ++g) {
    for (int k : cs.groups[g].post_groups) {
      ++runs[static_cast<size_t>(k)];
      for (const ParamInfo& p : (*rl)->params()) {
        if (p.group == k && last.count(p.decl.name)) {
          EXPECT_LE(last[p.decl.name], static_cast<int>(g)) << p.decl.name;
        }
      }
    }
  }
  for (size_t k = 0; k < runs.size(); ++k) {
    EXPECT_EQ(runs[k], 1) << "post-processing group " << k;
  }
}

// In a consumer's own order (the rotated order, engine/group_order.h), a post-processing
// group runs after the last group *in that order* that writes one of its params: here
// the layer order reversed, so each runs after the lowest such group.
TEST(ScheduleSlots, PostProcessingGroupsFollowTheConsumersOrder) {
  auto model = make_job_model(cfg("qwen3-235b-a22b-fp8.json"), "tp=1", "tp=2", true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  std::vector<Plan> plans;
  const Routes routes = build(*model, plans);
  auto rl = model->loader->rank(0);
  ASSERT_TRUE(rl.ok());
  std::map<std::string, ParamTable::Param> none;
  ConsumerScheduleInputs in;
  in.routes = &routes;
  in.params = &none;
  in.holdings = model->holdings.get();
  for (const ParamInfo& p : (*rl)->params()) in.post_group_of[p.decl.name] = p.group;
  in.num_post_groups = (*rl)->groups().size();
  std::vector<int> order(static_cast<size_t>(routes.num_groups()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(order.size() - 1 - i);
  in.order = &order;
  const ConsumerSchedule cs = make_consumer_schedule(in);
  std::map<std::string, int> first;  // param -> the lowest group writing it (the last in `order`)
  const PlanRoute& pr = routes.consumer(0);
  for (size_t g = pr.groups.size(); g-- > 0;)
    for (const UnpackOp& u : pr.groups[g].unpacks) first[pr.params[u.param].name] = static_cast<int>(g);
  std::vector<int> runs(in.num_post_groups, 0);
  for (size_t g = 0; g < cs.groups.size(); ++g) {
    for (int k : cs.groups[g].post_groups) {
      ++runs[static_cast<size_t>(k)];
      for (const ParamInfo& p : (*rl)->params()) {
        if (p.group == k && first.count(p.decl.name)) {
          EXPECT_GE(first[p.decl.name], static_cast<int>(g)) << p.decl.name;
        }
      }
    }
  }
  for (size_t k = 0; k < runs.size(); ++k) EXPECT_EQ(runs[k], 1) << "post-processing group " << k;
}

// The staging ring a budget gives (memory.h): the budget bounds the ring whenever it
// holds the largest group under the routes now; below that it is refused naming bytes.
// The bounded shadow's layout (CommitPolicy::kGroups) against an oracle over random
// routes: each written param's time in the shadow is [first group writing it, last group
// writing any param of its unit] in the consumer's order; params whose times meet never
// share bytes; each param opens and commits once, at those positions; each unit goes live
// once, where its last param is written; the size is each place's peak, at least what
// is held at once.
TEST(GroupShadowLayout, MatchesAnOracleOverRandomRoutes) {
  std::mt19937_64 rng(27);
  auto pick = [&](int lo, int hi) { return static_cast<int>(std::uniform_int_distribution<int>(lo, hi)(rng)); };
  for (int trial = 0; trial < 300; ++trial) {
    const int N = pick(1, 24), G = pick(1, 8);
    PlanRoute pr;
    for (int p = 0; p < N; ++p) pr.params.push_back(TensorDecl{fmt::format("p{}", p), DType::kU8, {pick(1, 3000)}});
    pr.groups.resize(static_cast<size_t>(G));
    std::vector<std::set<int>> writers(static_cast<size_t>(N));  // param -> layer groups writing it
    for (int p = 0; p < N; ++p) {
      for (int w = pick(0, 3); w > 0; --w) writers[static_cast<size_t>(p)].insert(pick(0, G - 1));
      for (int g : writers[static_cast<size_t>(p)])
        pr.groups[static_cast<size_t>(g)].unpacks.emplace_back().param = static_cast<uint32_t>(p);
    }
    std::map<std::string, int> unit_of;
    std::vector<bool> on_device;
    for (int p = 0; p < N; ++p) {
      if (const int u = pick(-2, 3); u > -2) unit_of[pr.params[static_cast<size_t>(p)].name] = u;
      on_device.push_back(pick(0, 3) == 0);
    }
    std::vector<int> order(static_cast<size_t>(G));
    std::iota(order.begin(), order.end(), 0);
    const bool ordered = pick(0, 1);
    if (ordered) std::shuffle(order.begin(), order.end(), rng);
    const GroupShadow l = group_shadow_layout(pr, ordered ? &order : nullptr, unit_of, on_device);
    // The oracle.
    std::vector<int> at(static_cast<size_t>(G));
    for (int i = 0; i < G; ++i) at[static_cast<size_t>(order[static_cast<size_t>(i)])] = i;
    auto unit = [&](int p) {
      auto it = unit_of.find(pr.params[static_cast<size_t>(p)].name);
      return it != unit_of.end() && it->second >= 0 ? it->second : -1 - p;
    };
    std::vector<int> first(static_cast<size_t>(N), -1), close(static_cast<size_t>(N), -1);
    for (int p = 0; p < N; ++p) {
      for (int g : writers[static_cast<size_t>(p)]) {
        first[static_cast<size_t>(p)] = first[static_cast<size_t>(p)] < 0 ? at[static_cast<size_t>(g)]
                                                                           : std::min(first[static_cast<size_t>(p)], at[static_cast<size_t>(g)]);
      }
    }
    for (int p = 0; p < N; ++p) {
      if (first[static_cast<size_t>(p)] < 0) continue;
      for (int q = 0; q < N; ++q)
        if (unit(q) == unit(p))
          for (int g : writers[static_cast<size_t>(q)]) close[static_cast<size_t>(p)] = std::max(close[static_cast<size_t>(p)], at[static_cast<size_t>(g)]);
    }
    auto bytes = [&](int p) { return (shape_numel(pr.params[static_cast<size_t>(p)].shape) + 63) / 64 * 64; };
    uint64_t peak[2] = {0, 0}, held_at_once[2] = {0, 0};
    std::vector<int> opened(static_cast<size_t>(N), 0), committed(static_cast<size_t>(N), 0);
    for (int i = 0; i < G; ++i) {
      for (uint32_t p : l.opens[static_cast<size_t>(i)]) {
        ++opened[p];
        EXPECT_EQ(first[p], i) << "trial " << trial << " param " << p;
      }
      for (uint32_t p : l.commits[static_cast<size_t>(i)]) {
        ++committed[p];
        EXPECT_EQ(close[p], i) << "trial " << trial << " param " << p;
        EXPECT_NE(std::find(l.units[static_cast<size_t>(i)].begin(), l.units[static_cast<size_t>(i)].end(), unit(static_cast<int>(p))),
                  l.units[static_cast<size_t>(i)].end());
      }
      uint64_t now[2] = {0, 0};
      for (int p = 0; p < N; ++p)
        if (first[static_cast<size_t>(p)] >= 0 && first[static_cast<size_t>(p)] <= i && i <= close[static_cast<size_t>(p)])
          now[on_device[static_cast<size_t>(p)] ? 1 : 0] += bytes(p);
      for (int d = 0; d < 2; ++d) held_at_once[d] = std::max(held_at_once[d], now[d]);
    }
    std::set<int> units_live;
    for (const auto& us : l.units)
      for (int u : us) EXPECT_TRUE(units_live.insert(u).second) << "trial " << trial << ": unit " << u << " twice";
    for (int p = 0; p < N; ++p) {
      const bool written = first[static_cast<size_t>(p)] >= 0;
      EXPECT_EQ(l.offset[static_cast<size_t>(p)] != GroupShadow::kNone, written) << "trial " << trial << " param " << p;
      EXPECT_EQ(opened[static_cast<size_t>(p)], written ? 1 : 0);
      EXPECT_EQ(committed[static_cast<size_t>(p)], written ? 1 : 0);
      if (!written) continue;
      const int d = on_device[static_cast<size_t>(p)] ? 1 : 0;
      peak[d] = std::max(peak[d], l.offset[static_cast<size_t>(p)] + bytes(p));
      for (int q = p + 1; q < N; ++q) {
        if (first[static_cast<size_t>(q)] < 0 || on_device[static_cast<size_t>(q)] != on_device[static_cast<size_t>(p)]) continue;
        const bool meet = first[static_cast<size_t>(p)] <= close[static_cast<size_t>(q)] &&
                          first[static_cast<size_t>(q)] <= close[static_cast<size_t>(p)];
        const bool apart = l.offset[static_cast<size_t>(p)] + bytes(p) <= l.offset[static_cast<size_t>(q)] ||
                           l.offset[static_cast<size_t>(q)] + bytes(q) <= l.offset[static_cast<size_t>(p)];
        EXPECT_TRUE(!meet || apart) << "trial " << trial << ": params " << p << " and " << q << " share bytes";
      }
    }
    EXPECT_EQ(l.host_bytes, peak[0]) << "trial " << trial;
    EXPECT_EQ(l.device_bytes, peak[1]) << "trial " << trial;
    EXPECT_GE(l.host_bytes, held_at_once[0]) << "trial " << trial;
    EXPECT_GE(l.device_bytes, held_at_once[1]) << "trial " << trial;
  }
}

TEST(StagingRing, BudgetBoundsTheRing) {
  const uint64_t needed = 1000 * 64, worst = 4000 * 64;
  auto dflt = staging_ring(0, needed, worst, 0);
  ASSERT_TRUE(dflt.ok());
  EXPECT_EQ(dflt->slot_bytes, worst);
  EXPECT_EQ(dflt->slots, 2);
  auto roomy = staging_ring(0, needed, worst, 3 * worst);
  ASSERT_TRUE(roomy.ok());
  EXPECT_EQ(roomy->slot_bytes, worst);
  EXPECT_EQ(roomy->slots, 3);
  // Between one needed slot and one worst-case slot: two slots as large as fit.
  for (uint64_t budget : {needed, 2 * needed, 3 * needed + 100, worst - 64}) {
    auto r = staging_ring(0, needed, worst, budget);
    ASSERT_TRUE(r.ok()) << budget;
    EXPECT_GE(r->slot_bytes, needed) << budget;
    EXPECT_LE(r->slot_bytes * static_cast<uint64_t>(r->slots), budget) << budget;
    EXPECT_GE(r->slots, 1) << budget;
  }
  auto tight = staging_ring(3, needed, worst, needed - 1);
  ASSERT_FALSE(tight.ok());
  EXPECT_EQ(tight.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tight.status().message().find("producer 3"), std::string::npos) << tight.status().to_string();
  EXPECT_NE(tight.status().message().find(std::to_string(needed)), std::string::npos) << tight.status().to_string();
}

}  // namespace
}  // namespace ferry::engine
