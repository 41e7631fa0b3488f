// The order layer groups move in (engine/group_order.h), on real routes of shrunk jobs:
// the layer order is today's; the rotated order starts each cohort of consumers at its
// own lane (a PP stage) and goes round, keeps every invariant the producer's staging
// ring relies on, and at every step asks no producer for more than the layer order does
// (and, with stages, far less in sum). The producer's Pacer serves its waves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <set>

#include "engine/group_order.h"
#include "engine/pacer.h"
#include "engine/rendezvous.h"
#include "routes_fixture.h"
#include "tools/job_model.h"

namespace ferry::engine {
namespace {

using testing::cfg;
using tools::JobModel;
using tools::make_job_model;

struct Job {
  JobModel m;
  std::vector<Plan> plans;
  Routes routes;
};

void make_job(const char* config, const char* trainer, const char* inference, const char* overrides, Job& job) {
  auto model = make_job_model(cfg(config), trainer, inference, true, overrides);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  job.m = std::move(*model);
  job.routes = testing::build_job_routes(job.m, job.plans);
}

uint64_t lockstep(const std::vector<OrderStep>& steps) {
  uint64_t n = 0;
  for (const OrderStep& s : steps) n += std::max(s.max_producer_bytes, s.max_consumer_bytes);
  return n;
}

// The trainer's PP stage of producer p (Megatron ranks: stage-major).
int stage_of(const JobModel& m, int p) { return p / m.trainer.stage_size(); }

TEST(GroupOrder, ParsesItsNames) {
  for (const char* name : {"layer", "rotated", "rotated-unpaced"}) {
    auto o = parse_group_order(name);
    ASSERT_TRUE(o.ok()) << name;
    EXPECT_EQ(group_order_name(*o), name);
  }
  EXPECT_EQ(parse_group_order("rotated")->kind, GroupOrderKind::kRotated);
  EXPECT_TRUE(parse_group_order("rotated")->paced);
  EXPECT_FALSE(parse_group_order("rotated-unpaced")->paced);
  auto bad = parse_group_order("random");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'random'"), std::string::npos) << bad.status().to_string();
  EXPECT_NE(bad.status().message().find("layer, rotated, rotated-unpaced"), std::string::npos);
}

TEST(GroupOrder, LayerOrderIsTodays) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(make_job("llama-3.1-8b.json", "tp=2,pp=2", "tp=2,replicas=2", R"({"num_hidden_layers": 4})", j));
  const GroupOrder o = make_group_order(j.routes);
  ASSERT_TRUE(check_group_order(j.routes, o).ok()) << check_group_order(j.routes, o).to_string();
  std::vector<int> all(static_cast<size_t>(j.routes.num_groups()));
  std::iota(all.begin(), all.end(), 0);
  ASSERT_EQ(o.consumer.size(), 4u);
  for (const auto& c : o.consumer) EXPECT_EQ(c, all);
  EXPECT_EQ(o.num_lanes(), 1);
  for (int c : o.cohort) EXPECT_EQ(c, 0);
  EXPECT_FALSE(o.paced);
  // As today: a group to all its readers at once, as soon as it is packed.
  const auto waves = serve_waves(j.routes, o, 0);
  ASSERT_EQ(waves.size(), o.producer[0].size());
  for (size_t w = 0; w < waves.size(); ++w)
    for (const ServedRead& r : waves[w]) EXPECT_EQ(r.group, o.producer[0][w]);
}

// Dense PP: each stage is a lane, each lane's producers pack their own groups in layer
// order, and consumers are spread evenly over the cohorts.
TEST(GroupOrder, RotatedStartsCohortsAtEveryStage) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(
      make_job("llama-3.1-8b.json", "tp=1,pp=4", "tp=1,replicas=4", R"({"num_hidden_layers": 8})", j));
  const GroupOrder o = make_group_order(j.routes, {GroupOrderKind::kRotated, true});
  ASSERT_TRUE(check_group_order(j.routes, o).ok()) << check_group_order(j.routes, o).to_string();
  ASSERT_EQ(o.num_lanes(), 4);
  for (int p = 0; p < 4; ++p) EXPECT_EQ(o.lane_of_producer[static_cast<size_t>(p)], stage_of(j.m, p)) << p;
  std::set<int> cohorts(o.cohort.begin(), o.cohort.end());
  EXPECT_EQ(cohorts, (std::set<int>{0, 1, 2, 3}));
  // Rounds: round r holds every lane's r-th group. Stage 0 has the embedding and stage 3
  // the head besides their two layers: the last round has those two lanes only.
  ASSERT_EQ(o.rounds.size(), 3u);
  EXPECT_EQ(o.rounds[0].size(), 4u);
  EXPECT_EQ(o.rounds[1].size(), 4u);
  EXPECT_EQ(o.rounds[2], (std::vector<int>{o.lanes[0][2], o.lanes[3][2]}));
  // Where a round has every lane, cohort k starts at lane k and goes round.
  size_t at = 0;
  for (const auto& round : o.rounds) {
    if (round.size() == 4) {
      for (size_t c = 0; c < o.consumer.size(); ++c) {
        const int k = o.cohort[c];
        EXPECT_EQ(o.lane_of_group[static_cast<size_t>(o.consumer[c][at])], k) << c;
        EXPECT_EQ(o.lane_of_group[static_cast<size_t>(o.consumer[c][at + 1])], (k + 1) % 4) << c;
      }
    }
    at += round.size();
  }
  // Paced: producer 0 (stage 0, the only producer of its lane) serves its reads one step
  // at a time: in a round with every lane one cohort (here one consumer) a step, its own
  // cohort first; in the round of two lanes, two cohorts at one step.
  ASSERT_TRUE(o.paced);
  const auto waves = serve_waves(j.routes, o, 0);
  ASSERT_EQ(waves.size(), 4u + 4u + 2u);
  for (size_t w = 0; w < 8; ++w) {
    ASSERT_EQ(waves[w].size(), 1u) << w;
    const ServedRead& r = waves[w][0];
    EXPECT_EQ(r.group, o.rounds[w / 4][0]) << w;
  }
  EXPECT_EQ(o.cohort[static_cast<size_t>(waves[0][0].consumer)], 0);  // lane 0's own cohort first
  for (size_t w = 1; w < waves.size(); ++w) {
    const ServedRead& a = waves[w - 1][0];
    const ServedRead& b = waves[w][0];
    EXPECT_LT(o.step[static_cast<size_t>(a.consumer)][static_cast<size_t>(a.group)],
              o.step[static_cast<size_t>(b.consumer)][static_cast<size_t>(b.group)]);
  }
  EXPECT_EQ(waves[8].size(), 2u);
  EXPECT_EQ(waves[9].size(), 2u);
  // Every producer packs what it serves in layer order (the staging ring's order today).
  for (size_t p = 0; p < o.producer.size(); ++p) {
    EXPECT_TRUE(std::is_sorted(o.producer[p].begin(), o.producer[p].end())) << p;
    EXPECT_FALSE(o.producer[p].empty()) << p;
  }
  // In a round with every stage, each stage serves one consumer at each step: the
  // busiest producer sends what one consumer reads of a group. In a round with three,
  // one serves two. In layer order one stage serves all four at once.
  const auto rotated = order_steps(j.routes, o), layer = order_steps(j.routes, make_group_order(j.routes));
  ASSERT_EQ(rotated.size(), layer.size());
  size_t k = 0;
  for (const auto& round : o.rounds) {
    for (size_t i = 0; i < round.size(); ++i, ++k) {
      const uint64_t share = round.size() == 4 ? 1 : 2;
      EXPECT_LE(rotated[k].max_producer_bytes, share * rotated[k].max_consumer_bytes) << k;
    }
  }
  EXPECT_LT(lockstep(rotated) * 2, lockstep(layer)) << lockstep(rotated) << " vs " << lockstep(layer);
}

// Pure data parallelism (every producer holds every group): one lane, the layer order.
TEST(GroupOrder, OneLaneWithoutStages) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(make_job("llama-3.1-8b.json", "tp=2,dp=2", "tp=2,replicas=2", R"({"num_hidden_layers": 4})", j));
  const GroupOrder rotated = make_group_order(j.routes, {GroupOrderKind::kRotated, true});
  ASSERT_TRUE(check_group_order(j.routes, rotated).ok());
  EXPECT_EQ(rotated.num_lanes(), 1);
  EXPECT_EQ(rotated.consumer, make_group_order(j.routes).consumer);
}

// Relay groups (rendezvous.h, relay_groups): consumers of one plan class relaying on one
// host, named by their lowest rank; one alone on its host, or not relaying, is in none.
// Under the rotated order a group shares a cohort (its members copy from its relay as the
// groups land), and the producers' load is counted once for it, so two ranks' groups
// still start at different stages (issue 46: before, a rank's replicas went to different
// cohorts and never relayed under pipeline stages).
TEST(GroupOrder, RelayGroupsShareACohort) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(make_job("llama-3.1-8b.json", "tp=1,pp=2", "tp=2,replicas=3", R"({"num_hidden_layers": 4})", j));
  // Consumers 0..5: rank r of replica k is 2k + r. Replicas 0 and 1 on host a, replica 2
  // on host b; consumer 5 does not relay.
  RouteInputs in;
  in.relay_hosts = {"a", "a", "a", "a", "b", ""};
  const std::vector<int> groups = relay_groups(in, j.routes.consumer_plan);
  EXPECT_EQ(groups, (std::vector<int>{0, 1, 0, 1, -1, -1}));
  const GroupOrder o = make_group_order(j.routes, {GroupOrderKind::kRotated, true, groups});
  ASSERT_TRUE(check_group_order(j.routes, o).ok());
  ASSERT_EQ(o.num_lanes(), 2);
  EXPECT_EQ(o.cohort[0], o.cohort[2]);
  EXPECT_EQ(o.cohort[1], o.cohort[3]);
  EXPECT_NE(o.cohort[0], o.cohort[1]);
  EXPECT_EQ(o.consumer[0], o.consumer[2]) << "a relay and its member read in one order";
  // Other hosts or no relay: no group, whatever the plan class.
  in.relay_hosts = {"a", "b", "c", "d", "", ""};
  EXPECT_EQ(relay_groups(in, j.routes.consumer_plan), (std::vector<int>(6, -1)));
  in.relay_hosts.clear();  // (no consumer relays)
  EXPECT_EQ(relay_groups(in, j.routes.consumer_plan), (std::vector<int>(6, -1)));
  // Two replicas of one rank: spread over the two cohorts without a relay group (they read
  // one holder), in one with it.
  Job two;
  ASSERT_NO_FATAL_FAILURE(make_job("llama-3.1-8b.json", "tp=1,pp=2", "tp=1,replicas=2", R"({"num_hidden_layers": 4})", two));
  EXPECT_NE(make_group_order(two.routes, {GroupOrderKind::kRotated, true}).cohort,
            (std::vector<int>{0, 0}));
  in.relay_hosts = {"a", "a"};
  EXPECT_EQ(make_group_order(two.routes, {GroupOrderKind::kRotated, true, relay_groups(in, two.routes.consumer_plan)}).cohort,
            (std::vector<int>{0, 0}));
}

// MoE with EP on trainer and inference: the consumers that read one trainer rank's
// experts (its EP peers and their replicas) are spread over the cohorts, so no producer
// serves two of them at one step while it has a cohort to spare.
TEST(GroupOrder, RotatedSpreadsConsumersOfOneHolder) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(make_job("qwen3-30b-a3b.json", "tp=1,pp=2,ep=2", "tp=1,ep=2,dp=2,replicas=2",
                                   R"({"num_hidden_layers": 4})", j));
  const GroupOrder o = make_group_order(j.routes, {GroupOrderKind::kRotated, true});
  ASSERT_TRUE(check_group_order(j.routes, o).ok()) << check_group_order(j.routes, o).to_string();
  ASSERT_EQ(o.num_lanes(), 2);
  // Two cohorts of two: each plan class (an EP rank, read by its replicas from one holder)
  // has one consumer in each cohort.
  std::map<uint32_t, std::set<int>> cohorts_of_class;
  for (size_t c = 0; c < o.cohort.size(); ++c) cohorts_of_class[j.routes.consumer_plan[c]].insert(o.cohort[c]);
  for (const auto& [k, cs] : cohorts_of_class) EXPECT_EQ(cs.size(), 2u) << "plan class " << k;
  const auto rotated = order_steps(j.routes, o), layer = order_steps(j.routes, make_group_order(j.routes));
  for (size_t k = 0; k < rotated.size(); ++k) EXPECT_LE(rotated[k].max_producer_bytes, layer[k].max_producer_bytes) << k;
  EXPECT_LT(lockstep(rotated), lockstep(layer));
}

// The checker refuses an order a producer's staging ring would deadlock or repack on.
TEST(GroupOrder, CheckRefusesOrdersTheStagingRingCannotServe) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(
      make_job("llama-3.1-8b.json", "tp=1,pp=2", "tp=1,replicas=2", R"({"num_hidden_layers": 4})", j));
  const GroupOrder good = make_group_order(j.routes, {GroupOrderKind::kRotated, true});
  ASSERT_TRUE(check_group_order(j.routes, good).ok());
  {
    GroupOrder o = good;  // one producer's groups out of its pack order
    auto& c0 = o.consumer[0];
    const auto& lane = o.lanes[static_cast<size_t>(o.cohort[0])];
    std::iter_swap(std::find(c0.begin(), c0.end(), lane[0]), std::find(c0.begin(), c0.end(), lane[1]));
    Status s = check_group_order(j.routes, o);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("consumer 0"), std::string::npos) << s.to_string();
  }
  {
    GroupOrder o = good;  // a group twice
    o.consumer[1][1] = o.consumer[1][0];
    Status s = check_group_order(j.routes, o);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("twice"), std::string::npos) << s.to_string();
  }
  {
    GroupOrder o = good;  // a producer that packs in another order than it serves
    std::reverse(o.producer[0].begin(), o.producer[0].end());
    EXPECT_FALSE(check_group_order(j.routes, o).ok());
  }
}

// The producer's Pacer (engine/pacer.h) over the waves above: a read's turn comes when
// every read of the waves before it finished (released, or finished by the producer's
// own account: its consumer dropped, done or moved), waves open in order and only once
// per attempt, and a new attempt starts at the first wave again. Under the layer order
// there are no waves: every turn is now and groups pack in layer order.
TEST(Pacer, OpensWavesOnlyOnceEveryReadBeforeThemFinished) {
  Job j;
  ASSERT_NO_FATAL_FAILURE(
      make_job("llama-3.1-8b.json", "tp=1,pp=4", "tp=1,replicas=4", R"({"num_hidden_layers": 8})", j));
  auto layer = Pacer::make(j.routes, 0, {GroupOrderKind::kLayer});
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  for (int g = 0; g < j.routes.num_groups(); ++g) {
    EXPECT_EQ(layer->pack_position(g), g);
    for (int c = 0; c < 4; ++c) EXPECT_TRUE(layer->turn(c, g));
  }
  EXPECT_TRUE(layer->open([](const ServedRead&) { return false; }).empty());
  EXPECT_EQ(layer->heap_bytes(), 0u);

  const GroupOrder o = make_group_order(j.routes, {GroupOrderKind::kRotated, true});
  const auto waves = serve_waves(j.routes, o, 0);
  ASSERT_EQ(waves.size(), 10u);  // (RotatedStartsCohortsAtEveryStage)
  auto made = Pacer::make(j.routes, 0, {GroupOrderKind::kRotated});
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Pacer& pacer = *made;
  EXPECT_GT(pacer.heap_bytes(), 0u);
  const std::vector<int>& mine = o.producer[0];
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(pacer.pack_position(mine[i]), static_cast<int>(i));
  auto turns = [&](size_t w) {
    for (const ServedRead& r : waves[w])
      if (!pacer.turn(r.consumer, r.group)) return false;
    return true;
  };
  auto none = [](const ServedRead&) { return false; };
  pacer.begin_attempt();
  EXPECT_TRUE(turns(0));
  EXPECT_FALSE(turns(1));
  EXPECT_TRUE(pacer.open(none).empty());  // wave 0 not finished
  // Wave 0 released: wave 1 opens, and only it (its own read is not finished).
  for (const ServedRead& r : waves[0]) pacer.note_released(r.consumer, r.group);
  EXPECT_EQ(pacer.open(none), waves[1]);
  EXPECT_TRUE(turns(1));
  EXPECT_FALSE(turns(2));
  EXPECT_TRUE(pacer.open(none).empty());  // (opened once)
  // Wave 1's consumer finished by the producer's account (dropped): wave 2 opens.
  const ServedRead gone = waves[1][0];
  auto dropped = [&](const ServedRead& r) { return r.consumer == gone.consumer; };
  std::vector<ServedRead> opened = pacer.open(dropped);
  ASSERT_FALSE(opened.empty());
  EXPECT_EQ(std::vector<ServedRead>(opened.begin(), opened.begin() + static_cast<long>(waves[2].size())), waves[2]);
  for (const ServedRead& r : opened) EXPECT_TRUE(pacer.turn(r.consumer, r.group));
  // Everything finished: every remaining wave opens at once.
  auto all = [](const ServedRead&) { return true; };
  pacer.open(all);
  EXPECT_TRUE(turns(waves.size() - 1));
  // A new attempt: back to wave 0, releases forgotten.
  pacer.begin_attempt();
  EXPECT_TRUE(turns(0));
  EXPECT_FALSE(turns(1));
  EXPECT_FALSE(pacer.released(waves[0][0].consumer, waves[0][0].group));
}

}  // namespace
}  // namespace ferry::engine
