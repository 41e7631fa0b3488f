// `ferry simulate` end to end on a small model and the emulated-hosts cluster: the JSON
// parses, its fields are there and sane, the prediction is at least its floor, bytes per
// NIC are exactly what the designs move; bad input exits 2 with a message.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/run_command.h"
#include "test_paths.h"

namespace {

using CliRun = ferry_cli_test::CommandRun;

CliRun run(const std::string& args) { return ferry_cli_test::run_command(std::string(FERRY_BIN) + " simulate " + args); }

// Llama-3.1-8B's structure at toy size (2 layers, hidden 256): 2 trainer ranks (tp=2) on
// one host, 2 inference replicas of tp=2 on the other.
const std::string kJob = std::string("--model ") + FERRY_SOURCE_DIR +
                         "/configs/llama-3.1-8b.json --config-overrides '{\"num_hidden_layers\": 2, "
                         "\"hidden_size\": 256, \"intermediate_size\": 512, \"vocab_size\": 1024, "
                         "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64}' "
                         "--trainer tp=2 ";
const std::string kCluster = std::string("--cluster ") + FERRY_SOURCE_DIR + "/configs/clusters/emulated-2host-1gbit.json ";

nlohmann::json simulate_json(const std::string& extra) {
  CliRun r = run(kJob + kCluster + "--inference tp=2,replicas=2 --json " + extra);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object()) << r.out << "\n" << r.err;
  return j;
}

TEST(SimulateCli, JsonHasEveryFieldAndThePredictionIsAtLeastItsFloor) {
  for (const char* extra : {"--design ferry --mode pull", "--design ferry --mode push", "--design sharded-gather",
                            "--design broadcast"}) {
    SCOPED_TRACE(extra);
    nlohmann::json j = simulate_json(extra);
    if (!j.is_object()) continue;
    for (const char* k : {"seconds", "floor_seconds", "rx_floor_seconds", "critical_path", "busiest_rx_nic",
                          "busiest_tx_nic", "nics", "model_bytes", "max_consumer_bytes", "flows", "simulate_seconds",
                          "peak_rss_bytes", "timeline"}) {
      EXPECT_TRUE(j.contains(k)) << k;
    }
    EXPECT_GT(j["seconds"].get<double>(), 0);
    EXPECT_GT(j["floor_seconds"].get<double>(), 0);
    EXPECT_GE(j["seconds"].get<double>(), j["floor_seconds"].get<double>());
    EXPECT_GT(j["model_bytes"].get<uint64_t>(), 0u);
    EXPECT_GT(j["flows"].get<uint64_t>(), 0u);
    EXPECT_FALSE(j["critical_path"].empty());
    double sum = 0;
    for (const auto& p : j["critical_path"]) sum += p["seconds"].get<double>();
    EXPECT_NEAR(sum, j["seconds"].get<double>(), 1e-6 * j["seconds"].get<double>()) << "phases sum to the sync";
    const auto& rx = j["busiest_rx_nic"];
    EXPECT_GT(rx["rx_utilisation"].get<double>(), 0);
    EXPECT_LE(rx["rx_utilisation"].get<double>(), 1.0 + 1e-9);
  }
}

TEST(SimulateCli, BytesPerNicAreWhatTheDesignMoves) {
  // All inference ranks share the inference host's one link. ferry: each of the 2
  // replicas pulls the whole model across it (its TP ranks each a copy of the
  // replicated norms: a little more than 2x the model). broadcast: the model crosses it
  // once (the chain's next hops stay inside the host).
  nlohmann::json f = simulate_json("--design ferry");
  nlohmann::json b = simulate_json("--design broadcast");
  ASSERT_TRUE(f.is_object() && b.is_object());
  const uint64_t model = f["model_bytes"].get<uint64_t>();
  const uint64_t moved = f["bytes_moved"].get<uint64_t>();
  EXPECT_GE(moved, 2 * model);
  EXPECT_LT(moved, 2 * model + model / 100);
  EXPECT_EQ(f["busiest_rx_nic"]["bytes_in"].get<uint64_t>(), moved);
  EXPECT_EQ(b["busiest_rx_nic"]["bytes_in"].get<uint64_t>(), model);
  // The floor is those bytes over the link's payload rate (1 Gbit/s x 0.956).
  EXPECT_NEAR(f["rx_floor_seconds"].get<double>(), moved / (0.956 * 1e9 / 8), 1e-9);
}

// Relay within a node (--relay, docs/relay.md): the engine's relay groups (one per plan
// class on the inference host), so one replica of each rank reads across the link and the
// other copies inside the host: the link carries each byte once, the prediction halves,
// and the members' critical path is the wait for their relay and the copy.
TEST(SimulateCli, RelayCrossesTheInferenceLinkOnce) {
  nlohmann::json plain = simulate_json("--design ferry");
  nlohmann::json relay = simulate_json("--design ferry --relay");
  ASSERT_TRUE(plain.is_object() && relay.is_object());
  const uint64_t in_plain = plain["busiest_rx_nic"]["bytes_in"].get<uint64_t>();
  const uint64_t in_relay = relay["busiest_rx_nic"]["bytes_in"].get<uint64_t>();
  EXPECT_EQ(2 * in_relay, in_plain) << "each replica's bytes cross once";
  EXPECT_EQ(relay["bytes_moved"], plain["bytes_moved"]) << "the members' bytes are copied inside the host instead";
  EXPECT_LT(relay["seconds"].get<double>(), 0.6 * plain["seconds"].get<double>());
  EXPECT_GE(relay["seconds"].get<double>(), relay["floor_seconds"].get<double>());
  CliRun bad = run(kJob + kCluster + "--inference tp=2,replicas=2 --design broadcast --relay");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--relay: only ferry's design relays"), std::string::npos) << bad.err;
}

// The rotated group order (docs/group-order.md), from the engine's own make_group_order:
// trainer pp=2 on two hosts, two inference replicas on two more. In layer order one
// stage's link sends at a time; rotated, both do, and the same bytes cross every link.
TEST(SimulateCli, RotatedOrderMovesTheSameBytesWithEveryStageSending) {
  const std::string job = std::string("--model ") + FERRY_SOURCE_DIR +
                          "/configs/llama-3.1-8b.json --config-overrides '{\"num_hidden_layers\": 4, "
                          "\"hidden_size\": 256, \"intermediate_size\": 512, \"vocab_size\": 1024, "
                          "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64}' "
                          "--trainer tp=1,pp=2 --inference tp=2,replicas=2 --cluster " + FERRY_SOURCE_DIR +
                          "/configs/clusters/emulated-4host-1gbit.json --json ";
  for (const char* mode : {"pull", "push"}) {
    SCOPED_TRACE(mode);
    CliRun lr = run(job + "--mode " + mode + " --order layer");
    CliRun rr = run(job + "--mode " + mode);  // rotated: the default
    ASSERT_EQ(lr.exit_code, 0) << lr.err;
    ASSERT_EQ(rr.exit_code, 0) << rr.err;
    auto layer = nlohmann::json::parse(lr.out, nullptr, false), rotated = nlohmann::json::parse(rr.out, nullptr, false);
    ASSERT_TRUE(layer.is_object() && rotated.is_object());
    EXPECT_FALSE(layer.contains("order")) << "layer order's output has no order fields";
    EXPECT_EQ(rotated["order"], "rotated");
    EXPECT_EQ(rotated["lanes"], 2);
    EXPECT_EQ(rotated["cohort_sizes"], nlohmann::json::array({2, 2}));
    EXPECT_EQ(rotated["bytes_moved"], layer["bytes_moved"]);
    ASSERT_EQ(rotated["nics"].size(), layer["nics"].size());
    for (size_t i = 0; i < layer["nics"].size(); ++i) {
      EXPECT_EQ(rotated["nics"][i]["bytes_in"], layer["nics"][i]["bytes_in"]) << i;
      EXPECT_EQ(rotated["nics"][i]["bytes_out"], layer["nics"][i]["bytes_out"]) << i;
    }
    const double floor = rotated["floor_seconds"].get<double>();
    EXPECT_EQ(floor, layer["floor_seconds"].get<double>());
    EXPECT_GE(rotated["seconds"].get<double>(), floor);
    EXPECT_LT(rotated["seconds"].get<double>(), 0.75 * layer["seconds"].get<double>());
    EXPECT_LT(rotated["order_lockstep_seconds"].get<double>(), layer["lockstep_seconds"].get<double>());
    double sum = 0;
    for (const auto& p : rotated["critical_path"]) sum += p["seconds"].get<double>();
    EXPECT_NEAR(sum, rotated["seconds"].get<double>(), 1e-6 * rotated["seconds"].get<double>());
  }
}

// A delta sync (--changed-fraction, docs/delta.md): every transfer carries the predicted
// patch (1% scattered bf16: 1.64% of the dense bytes, the codec's measured size) and the
// prediction drops with the bytes; 100% changed sends dense (never more than dense plus a
// patch header per transfer); clustered changes cost less than scattered ones.
TEST(SimulateCli, DeltaSyncMovesThePatchBytes) {
  nlohmann::json dense = simulate_json("");
  nlohmann::json d1 = simulate_json("--changed-fraction 0.01");
  nlohmann::json d1c = simulate_json("--changed-fraction 0.01 --changes clustered");
  nlohmann::json all = simulate_json("--changed-fraction 1");
  ASSERT_TRUE(dense.is_object() && d1.is_object() && d1c.is_object() && all.is_object());
  EXPECT_FALSE(dense.contains("patch_ratio")) << "the dense output is unchanged";
  EXPECT_EQ(d1["changes"], "scattered");
  EXPECT_NEAR(d1["element_bytes"].get<double>(), 2.0, 1e-9);  // the toy Llama is bf16
  const double r = d1["patch_ratio"].get<double>();
  EXPECT_NEAR(r, 0.0164, 0.0005);
  const double moved = dense["bytes_moved"].get<double>();
  EXPECT_NEAR(d1["bytes_moved"].get<double>(), r * moved, 0.001 * moved + 32.0 * d1["flows"].get<double>());
  EXPECT_LT(d1c["bytes_moved"].get<double>(), d1["bytes_moved"].get<double>());
  EXPECT_LT(d1["seconds"].get<double>(), 0.2 * dense["seconds"].get<double>());
  EXPECT_GE(d1["seconds"].get<double>(), d1["floor_seconds"].get<double>());
  EXPECT_EQ(all["patch_ratio"].get<double>(), 1.0);
  EXPECT_GE(all["bytes_moved"].get<double>(), moved);
  EXPECT_LE(all["bytes_moved"].get<double>(), moved + 32.0 * all["flows"].get<double>());
}

// Issue 29: trainer-side FP8 predicted. The toy Llama at tp=2 -> tp=2: every linear's
// shard comes from one trainer rank, so every quantised param (qkv, o, gate_up, down of
// both layers) is quantised on the producer and crosses as FP8 plus an fp32 scale per
// 128x128 tile: per layer and consumer 294,912 elements, 18 tiles, so 589,824 bf16 bytes
// become 294,984 (x 2 layers x 4 consumers saved). Quantising on the consumer moves what
// no quantisation moves.
TEST(SimulateCli, Fp8OnTheProducerMovesTheLinearsAsFp8) {
  nlohmann::json none = simulate_json("");
  nlohmann::json consumer = simulate_json("--quantize fp8 --quantize-on consumer");
  nlohmann::json producer = simulate_json("--quantize fp8");  // (the engine's default side)
  ASSERT_TRUE(none.is_object() && consumer.is_object() && producer.is_object());
  const double moved = none["bytes_moved"].get<double>();
  EXPECT_EQ(consumer["bytes_moved"].get<double>(), moved);
  EXPECT_FALSE(consumer.contains("quantized_params"));
  EXPECT_EQ(producer["quantize_on"], "producer");
  // 4 linears x 2 layers x 2 plan classes (the tp ranks; replicas share theirs).
  EXPECT_EQ(producer["quantized_params"].get<int>(), 16);
  EXPECT_EQ(producer["quantized_on_producer"].get<int>(), 16);
  const double saved = 2.0 * 4 * (589824 - 294984);
  EXPECT_NEAR(moved - producer["bytes_moved"].get<double>(), saved, 64.0 * 8) << "the routes' segment alignment only";
  EXPECT_LT(producer["seconds"].get<double>(), consumer["seconds"].get<double>());
}

TEST(SimulateCli, PlotWritesAPngOrNamesMatplotlib) {
  const std::string png = ::testing::TempDir() + "/simulate_cli_test." + std::to_string(::getpid()) + ".png";
  std::remove(png.c_str());
  CliRun r = run(kJob + kCluster + "--inference tp=2,replicas=2 --plot " + png);
  const bool have = std::system("/usr/bin/python3 -c 'import matplotlib' 2>/dev/null") == 0;
  if (!have) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("apt-get install python3-matplotlib"), std::string::npos) << r.err;
    EXPECT_NE(::access(png.c_str(), F_OK), 0) << "no picture without matplotlib";
    return;
  }
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(png, std::ios::binary);
  char magic[8] = {};
  f.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  std::remove(png.c_str());
}

// --catch-up 1: the second replica joins and reads from the first (inside the inference
// host) against the trainer serving it across the 1 Gbit/s link: both predicted, the
// replicas' far sooner there.
TEST(SimulateCli, CatchUpPredictsTheJoinerFromTheReplicasAndFromTheTrainer) {
  nlohmann::json j = simulate_json("--catch-up 1");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.value("joining_replicas", 0), 1);
  EXPECT_EQ(j.value("holding_replicas", 0), 1);
  EXPECT_EQ(j["rounds_end_seconds"].size(), 1u);
  EXPECT_GT(j.value("max_joiner_bytes", uint64_t{0}), 0u);
  const double replicas = j.value("from_replicas_seconds", 0.0), trainer = j.value("from_trainer_seconds", 0.0);
  EXPECT_GT(replicas, 0);
  EXPECT_GT(trainer, replicas) << j.dump();
  EXPECT_GE(trainer, j.value("from_trainer_floor_seconds", 0.0));
  CliRun bad = run(kJob + kCluster + "--inference tp=2,replicas=2 --catch-up 2");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.err.find("--catch-up 2: between 1 and 1"), std::string::npos) << bad.err;
}

TEST(SimulateCli, BadInputExitsTwoWithAMessage) {
  struct Case {
    std::string args;
    const char* expect;
  };
  const std::string bad_cluster = ::testing::TempDir() + "/simulate_cli_bad_cluster." + std::to_string(::getpid()) + ".json";
  {
    std::ofstream(bad_cluster) << R"({"trainer": {"nodes": 1}, "inference": {"nodes": 1, "nic_gbit_s": -4}})";
  }
  const Case cases[] = {
      {kJob + kCluster + "--inference tp=2 --design nccl", "unknown design 'nccl'"},
      {kJob + kCluster + "--inference tp=2 --mode pushpull", "unknown mode 'pushpull'"},
      {kJob + kCluster + "--inference tp=2 --design broadcast --mode push", "only ferry's design has a push mode"},
      {kJob + kCluster + "--inference tp=2 --order random", "unknown group order 'random'"},
      {kJob + kCluster + "--inference tp=2 --design sharded-gather --order rotated",
       "only ferry's design has a group order"},
      {kJob + kCluster + "--inference tp=2 --changed-fraction 1.5", "--changed-fraction 1.5: must be between 0 and 1"},
      {kJob + kCluster + "--inference tp=2 --changed-fraction 0.01 --changes random",
       "change layout 'random': expected scattered or clustered"},
      {kJob + kCluster + "--inference tp=2 --changed-fraction 0.01 --design broadcast",
       "only ferry's design sends deltas"},
      {kJob + "--cluster /nonexistent/c.json --inference tp=2", "/nonexistent/c.json"},
      {kJob + "--cluster " + bad_cluster + " --inference tp=2", "inference.nic_gbit_s"},
      {kJob + kCluster + "--inference tp=2,pp=3", "unknown key 'pp'"},
      {kJob + kCluster + "--inference tp=2,replicas=4", "8 inference ranks do not fit"},
      {"--model /nonexistent/config.json --trainer tp=1 --inference tp=1 " + kCluster, "/nonexistent/config.json"},
      {kJob + kCluster + "--inference tp=2 --quantize-on producer", "--quantize-on producer needs --quantize fp8"},
      {kJob + kCluster + "--inference tp=2 --quantize fp9", "--quantize"},
      {kJob + kCluster + "--inference tp=2 --quantize fp8 --quantize-on both", "'both' is not consumer or producer"},
      {kJob + kCluster + "--inference tp=2 --quantize fp8 --quantize-on producer --design broadcast",
       "only ferry's design quantises on the producer"},
  };
  for (const Case& c : cases) {
    CliRun r = run(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << "\n" << r.err;
  }
  std::remove(bad_cluster.c_str());
}

}  // namespace
