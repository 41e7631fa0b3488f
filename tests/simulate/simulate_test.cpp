// The cluster format's validation, and the SimGrid platform against closed-form oracles:
// whatever the flow model does, one flow takes bytes / rate + latency, and k flows into
// one NIC take their total / rate (max-min sharing keeps that NIC busy throughout).
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>

#include <gtest/gtest.h>

#include "simulate/cluster.h"
#include "simulate/simulate.h"
#include "simulate/workload.h"
#include "test_paths.h"

namespace ferry::simulate {
namespace {

// SimGrid's engine runs once per process: each simulation runs in a child, which
// sends its result back through a pipe (or NaN when it failed).
double in_child(const std::function<Result<double>()>& fn) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(60);  // bounded even if the simulation never ended
    auto r = fn();
    const double v = r.ok() ? *r : std::nan("");
    if (!r.ok()) std::fprintf(stderr, "simulation failed: %s\n", r.status().to_string().c_str());
    if (::write(fds[1], &v, sizeof(v)) != sizeof(v)) ::_exit(2);
    ::_exit(0);
  }
  ::close(fds[1]);
  double v = std::nan("");
  if (::read(fds[0], &v, sizeof(v)) != sizeof(v)) v = std::nan("");
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return v;
}

ClusterSpec cluster(const std::string& json) {
  auto c = ClusterSpec::parse(json, "test.json");
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? *c : ClusterSpec{};
}

// 2 trainer + 2 inference nodes of 8 GPUs, 100 Gbit/s NICs (12.5 GB/s), 2 us per NIC.
const char* kSmall = R"({"node": {"gpus_per_node": 8, "nic_gbit_s": 100, "nvlink_gbyte_s": 200},
  "trainer": {"nodes": 2}, "inference": {"nodes": 2},
  "fabric": {"topology": "single-switch"}, "latency_us": {"nic": 2, "nvlink": 1, "switch_hop": 0.5}})";

TEST(ClusterSpec, ParsesUnitsAndDefaults) {
  ClusterSpec c = cluster(kSmall);
  EXPECT_EQ(c.trainer.nodes, 2);
  EXPECT_EQ(c.inference.gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(c.trainer.nic_rate, 12.5e9);
  EXPECT_DOUBLE_EQ(c.inference.nvlink_rate, 200e9);
  EXPECT_DOUBLE_EQ(c.latency.nic, 2e-6);
  EXPECT_EQ(c.fabric.topology, Topology::kSingleSwitch);
}

TEST(ClusterSpec, RoleOverridesNodeDefaults) {
  ClusterSpec c = cluster(R"({"node": {"nic_gbit_s": 400}, "trainer": {"nodes": 1, "nic_gbit_s": 200},
    "inference": {"nodes": 1}})");
  EXPECT_DOUBLE_EQ(c.trainer.nic_rate, 25e9);
  EXPECT_DOUBLE_EQ(c.inference.nic_rate, 50e9);
}

TEST(ClusterSpec, ErrorsNameTheField) {
  struct Case {
    const char* json;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"trainer": {"nodes": 1}})", "inference: is required"},
      {R"({"trainer": {"nodes": -1}, "inference": {"nodes": 1}})", "trainer.nodes: must be an integer"},
      {R"({"trainer": {"nodes": 1}, "inference": {}})", "inference.nodes: is required"},
      {R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1, "nic_gbit_s": 0}})", "inference.nic_gbit_s: must be >"},
      {R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1, "nic_gbps": 400}})", "inference.nic_gbps: unknown field"},
      {R"({"node": {"nics_per_gpu": 0.3}, "trainer": {"nodes": 1}, "inference": {"nodes": 1}})", "nics_per_gpu must be"},
      {R"({"node": {"nics_per_gpu": 0.25, "gpus_per_node": 6}, "trainer": {"nodes": 1}, "inference": {"nodes": 1}})",
       "does not divide gpus_per_node 6"},
      {R"({"node": {"nic_efficiency": 1.5}, "trainer": {"nodes": 1}, "inference": {"nodes": 1}})",
       "node.nic_efficiency: must be"},
      {R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1}, "fabric": {"topology": "ring"}})",
       "fabric.topology: unknown topology 'ring'"},
      {R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1}, "fabric": {"oversubscription": 0.5}})",
       "fabric.oversubscription: must be >= 1"},
      {R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1}, "latency_us": {"nic": "fast"}})",
       "latency_us.nic: must be a number"},
      {R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1}, "typo": 1})", "typo: unknown field"},
      {R"([1, 2])", "must be a JSON object"},
      {R"({"trainer": )", "not JSON"},
  };
  for (const Case& c : cases) {
    auto r = ClusterSpec::parse(c.json, "test.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message() << "\n  for " << c.json;
    EXPECT_NE(r.status().message().find("test.json"), std::string::npos) << r.status().message();
  }
  auto missing = ClusterSpec::load("/nonexistent/cluster.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/cluster.json"), std::string::npos);
}

TEST(ClusterSpec, ShippedClustersParse) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(FERRY_SOURCE_DIR) + "/configs/clusters")) {
    if (e.path().extension() != ".json") continue;
    auto c = ClusterSpec::load(e.path().string());
    EXPECT_TRUE(c.ok()) << e.path() << ": " << c.status().to_string();
    ++n;
  }
  EXPECT_GE(n, 4);
}

// Endpoints: trainer ranks 0..15 (nodes 0, 1), inference ranks 16..31 (nodes 2, 3).
constexpr int kP = 16, kC = 16;
constexpr double kRate = 12.5e9;

TEST(SimulateOracle, OneFlowIsBytesOverRatePlusLatency) {
  const ClusterSpec c = cluster(kSmall);
  const uint64_t bytes = 5'000'000'000;
  const double t = in_child([&] { return run_flows(c, kP, kC, {{0, kP + 3, bytes, 1}}); });
  const double latency = 2e-6 + 0.5e-6 + 2e-6;  // NIC out (+ its switch), NIC in
  EXPECT_NEAR(t, bytes / kRate + latency, 0.01 * (bytes / kRate));
}

// A catch-up's rounds run one after another: two rounds of one cross-node flow each end
// at one and two times a flow's time.
TEST(SimulateOracle, CatchUpRoundsEndOneAfterAnother) {
  const ClusterSpec c = cluster(kSmall);
  const uint64_t bytes = 5'000'000'000;
  const double one = bytes / kRate + 2e-6 + 0.5e-6 + 2e-6;
  const double first = in_child([&]() -> Result<double> {
    FERRY_ASSIGN_OR_RETURN(auto ends, run_rounds(c, kP, kC, {{{kP + 0, kP + 9, bytes, 1}}, {{kP + 9, kP + 1, bytes, 1}}}));
    if (ends.size() != 2) return internal_error("{} round ends", ends.size());
    if (std::abs(ends[1] - 2 * ends[0]) > 0.01 * ends[0]) return internal_error("rounds end at {} and {}", ends[0], ends[1]);
    return ends[0];
  });
  EXPECT_NEAR(first, one, 0.01 * one);
}

// The catch-up's flows from a job's routes (workload.h catch_up_rounds): 4 replicas of
// tp=2, the last 3 joining: round 1 replica 0 -> 1, round 2 replica 0 -> 2 and 1 -> 3,
// for each rank (its own plan class), every flow the joiner's params' bytes; 0 or 4
// joiners are refused.
TEST(SimulateWorkload, CatchUpRoundsFollowTheEnginesTree) {
  JobSpec job;
  job.model = std::string(FERRY_SOURCE_DIR) + "/configs/llama-3.1-8b.json";
  job.config_overrides = R"({"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})";
  job.trainer = "tp=2";
  job.inference = "tp=2,replicas=4";
  auto w = build_workload(job, Design::kFerry);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_EQ(w->engine_size, 2);
  auto rounds = catch_up_rounds(*w, 3);
  ASSERT_TRUE(rounds.ok()) << rounds.status().to_string();
  ASSERT_EQ(rounds->size(), 2u);
  const uint32_t P = static_cast<uint32_t>(w->producers);
  auto has = [&](size_t round, int from_replica, int to_replica, int rank) {
    for (const Flow& f : (*rounds)[round]) {
      if (f.from == P + static_cast<uint32_t>(from_replica * 2 + rank) && f.to == P + static_cast<uint32_t>(to_replica * 2 + rank))
        return f.bytes == w->consumer_param_bytes[static_cast<size_t>(to_replica * 2 + rank)] && f.bytes > 0;
    }
    return false;
  };
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(has(0, 0, 1, rank)) << rank;
    EXPECT_TRUE(has(1, 0, 2, rank)) << rank;
    EXPECT_TRUE(has(1, 1, 3, rank)) << rank;
  }
  EXPECT_EQ((*rounds)[0].size(), 2u);
  EXPECT_EQ((*rounds)[1].size(), 4u);
  EXPECT_FALSE(catch_up_rounds(*w, 0).ok());
  EXPECT_FALSE(catch_up_rounds(*w, 4).ok());
}

TEST(SimulateOracle, InsideANodeFlowsUseNvlink) {
  const ClusterSpec c = cluster(kSmall);
  const uint64_t bytes = 4'000'000'000;
  const double t = in_child([&] { return run_flows(c, kP, kC, {{0, 1, bytes, 1}}); });
  EXPECT_NEAR(t, bytes / 200e9, 0.01 * bytes / 200e9);
}

TEST(SimulateOracle, StarOfSendersIntoOneNicIsTotalOverRate) {
  const ClusterSpec c = cluster(kSmall);
  std::mt19937_64 rng(18);
  for (int trial = 0; trial < 5; ++trial) {
    const int k = 1 + static_cast<int>(rng() % 12);
    std::vector<Flow> flows;
    uint64_t total = 0;
    for (int i = 0; i < k; ++i) {
      const uint64_t b = 100'000'000 + rng() % 2'000'000'000;
      flows.push_back({static_cast<uint32_t>(rng() % kP), kP + 5, b, 1});
      total += b;
    }
    const double t = in_child([&] { return run_flows(c, kP, kC, flows); });
    EXPECT_NEAR(t, total / kRate, 0.01 * total / kRate) << "trial " << trial << ", " << k << " senders";
  }
}

TEST(SimulateOracle, OversubscribedLeafUplinkBoundsCrossLeafFlows) {
  // One node per leaf, uplinks at 1/4 of the node's 8 NICs: 8 GPUs of trainer node 0
  // each sending B to a GPU of inference node 0 (another leaf) share 2 NICs' worth.
  const ClusterSpec c = cluster(R"({"node": {"gpus_per_node": 8, "nic_gbit_s": 100},
    "trainer": {"nodes": 2}, "inference": {"nodes": 2},
    "fabric": {"topology": "leaf-spine", "nodes_per_leaf": 1, "oversubscription": 4}})");
  const uint64_t b = 1'000'000'000;
  std::vector<Flow> flows;
  for (uint32_t g = 0; g < 8; ++g) flows.push_back({g, kP + g, b, 1});
  const double t = in_child([&] { return run_flows(c, kP, kC, flows); });
  const double uplink = 8 * kRate / 4;
  EXPECT_NEAR(t, 8 * b / uplink, 0.01 * 8 * b / uplink);
}

TEST(SimulateOracle, RanksBeyondTheClusterAreRefused) {
  const ClusterSpec c = cluster(kSmall);
  const double t = in_child([&] { return run_flows(c, 17, kC, {{0, 17, 1000, 1}}); });
  EXPECT_TRUE(std::isnan(t));
  auto again = [&]() -> Result<double> {
    auto r = run_flows(c, 17, kC, {});
    if (r.ok()) return -1.0;
    return r.status().message().find("17 trainer ranks do not fit") != std::string::npos ? 1.0 : 0.0;
  };
  EXPECT_EQ(in_child(again), 1.0);
}

TEST(SimulateOracle, PipelineOfOneGroupIsFloorPlusPackAndUnpack) {
  // The engine's actors on a hand-made workload: one group, producer 0 -> consumer 0,
  // B bytes: pack (B / copy rate), then the read, then unpack (B / copy rate).
  const ClusterSpec c = cluster(kSmall);
  Workload w;
  w.producers = kP;
  w.consumers = kC;
  GroupWork g;
  const uint64_t b = 2'000'000'000;
  g.pack_bytes.assign(kP, 0);
  g.unpack_bytes.assign(kC, 0);
  g.pack_bytes[0] = b;
  g.unpack_bytes[0] = b;
  g.transfers.push_back({0, 0, b, 1});
  w.groups.push_back(g);
  for (Mode m : {Mode::kPull, Mode::kPush}) {
    const double t = in_child([&]() -> Result<double> {
      SimOptions o;
      o.mode = m;
      FERRY_ASSIGN_OR_RETURN(auto r, run_simulation(c, w, o));
      if (r.seconds + 1e-12 < r.floor_seconds) return -1.0;
      return r.seconds;
    });
    const double expect = b / kRate + 2 * b / c.trainer.device_copy_rate;
    EXPECT_NEAR(t, expect, 0.01 * expect) << mode_name(m);
  }
}

}  // namespace
}  // namespace ferry::simulate
