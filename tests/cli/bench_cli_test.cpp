// `ferry bench --json` at a tiny size: every key there, sane values, ratios consistent
// with the figures they come from. No timing thresholds (CI machines vary).
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/run_command.h"
#include "engine/report_json.h"
#include "tools/trace_file.h"
#include "test_paths.h"

namespace {

// The keys of every report (the one serialiser's, engine/report_json.h).
std::set<std::string> report_keys() {
  const nlohmann::json j = ferry::engine::sync_report_json(ferry::SyncReport{});
  std::set<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.insert(k);
  return keys;
}

bool mpirun_on_path() {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "");
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && ::access((dir + "/mpirun").c_str(), X_OK) == 0) return true;
  return false;
}

using BenchRun = ferry_cli_test::CommandRun;
using ferry_cli_test::run_command;

BenchRun run_bench(const std::string& extra) {
  const std::string cmd = std::string(FERRY_BIN) + " bench --json --model " + FERRY_SOURCE_DIR +
                          "/configs/llama-3.1-8b.json --config-overrides '{\"num_hidden_layers\": 2, "
                          "\"hidden_size\": 256, \"intermediate_size\": 512, \"vocab_size\": 1024, "
                          "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64}' "
                          "--trainer tp=2 --inference tp=2 --syncs 2 "
                          // No CMA single copy: containers often forbid process_vm_readv.
                          "--mpi-mca '--mca pml ob1 --mca btl self,vader --mca btl_vader_single_copy_mechanism none' " +
                          extra;
  return run_command(cmd);
}

TEST(BenchCli, JsonHasEveryKeyWithSaneValues) {
  if (!mpirun_on_path()) {
    // Without OpenMPI the bench must refuse clearly (CI installs it: scripts/install-deps.sh).
    BenchRun r = run_bench("");
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find("mpirun"), std::string::npos) << r.err;
    GTEST_SKIP() << "mpirun not installed";
  }
  const std::string bin = FERRY_BIN;
  if (::access((bin.substr(0, bin.rfind('/') + 1) + "ferry-mpi-bcast").c_str(), X_OK) != 0) {
    BenchRun r = run_bench("");
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find("built without MPI"), std::string::npos) << r.err;
    GTEST_SKIP() << "ferry-mpi-bcast not built (no MPI at configure time)";
  }
  BenchRun r = run_bench("");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out << "\n" << r.err;
  for (const char* k : {"sync_seconds", "bytes_moved", "gbps", "raw_transport_gbps", "memcpy_gbps", "broadcast_seconds",
                        "speedup_vs_broadcast", "efficiency_vs_raw"}) {
    ASSERT_TRUE(j.contains(k)) << k << " missing: " << r.out;
    ASSERT_TRUE(j[k].is_number()) << k;
    EXPECT_GT(j[k].get<double>(), 0) << k;
    EXPECT_TRUE(std::isfinite(j[k].get<double>())) << k;
  }
  const double sync = j["sync_seconds"], bytes = j["bytes_moved"], gbps = j["gbps"];
  const double raw = j["raw_transport_gbps"], bcast = j["broadcast_seconds"];
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-6 * std::max(std::abs(a), std::abs(b)); };
  EXPECT_TRUE(near(gbps, bytes / sync / 1e9)) << r.out;
  EXPECT_TRUE(near(j["speedup_vs_broadcast"].get<double>(), bcast / sync)) << r.out;
  EXPECT_TRUE(near(j["efficiency_vs_raw"].get<double>(), gbps / raw)) << r.out;
  // Every inference rank keeps 1/tp of the model (tp=2): ferry moves about half of
  // what the broadcast delivers to each of the 2 ranks, and every rank verified.
  EXPECT_EQ(j["consumers"], 2);
  EXPECT_EQ(j["verified_ranks"], 2);
  const double ckpt = j["checkpoint_bytes"];
  EXPECT_GE(bytes, ckpt * 0.99);  // replicated tensors (norms) make it slightly more than 1x
  EXPECT_LT(bytes, ckpt * 1.5);
  EXPECT_EQ(j["broadcast_bytes"].get<double>(), 2 * ckpt);
  EXPECT_EQ(j["trials"].size(), 3u);  // warm-up + 2
  EXPECT_GT(j["staged_seconds"].get<double>(), 0);
  EXPECT_EQ(j["broadcast_mpi"]["ranks"], 3);  // 1 root (trainer pp=1) + 2 inference ranks
  // Zero-copy by default: trainer weights served in place, bytes read into params.
  EXPECT_EQ(j["in_place"], true);
  EXPECT_GT(j["in_place_fraction"].get<double>(), 0) << r.out;
  EXPECT_GT(j["into_params_fraction"].get<double>(), 0) << r.out;
  EXPECT_LE(j["in_place_fraction"].get<double>(), 1);
}

// What `ferry plan` and `ferry bench` predict each rank holds (predict_memory, made before
// any rank starts: "engine_predicted") against what each rank counts from what it built
// (its report's memory): metadata (the routes with the ops that rank makes, plans,
// holdings, its schedule) in pull (a producer its own packs) and push (every class's
// unpacks too), and the shadow and receive ring exactly, rank by rank.
void expect_metadata_as_predicted(const nlohmann::json& j) {
  for (const auto& [side, role] : {std::pair{"producers", "trainer"}, std::pair{"consumers", "inference"}}) {
    const auto& predicted = j["memory"][side];
    int seen = 0;
    for (const auto& r : j["last_sync_reports"]) {
      if (r["role"] != role) continue;
      const size_t rank = r["rank"].get<size_t>();
      ASSERT_LT(rank, predicted.size()) << side;
      // (j["memory"][side][rank]["engine"] is the report's own figure; "engine_predicted"
      // is predict_memory's, made before any rank started.)
      const auto& want = predicted[rank]["engine_predicted"];
      ASSERT_TRUE(want.is_object()) << role << " " << rank;
      // Metadata is an estimate from element counts on both sides; the rank also counts a
      // few small tables the prediction does not model (its order, waves, in-place
      // tables): within 4% or 4 KiB. The shadow and the ring are exact.
      const double got = r["memory"]["metadata"].get<double>(), predicted_metadata = want["metadata"].get<double>();
      EXPECT_NEAR(got, predicted_metadata, std::max(0.04 * predicted_metadata, 4096.0)) << role << " " << rank;
      EXPECT_EQ(r["memory"]["shadow"].get<uint64_t>(), want["shadow"].get<uint64_t>()) << role << " " << rank;
      EXPECT_EQ(r["memory"]["receive_ring"].get<uint64_t>(), want["receive_ring"].get<uint64_t>()) << role << " " << rank;
      ++seen;
    }
    EXPECT_EQ(static_cast<size_t>(seen), predicted.size()) << side;
  }
}

TEST(BenchCli, EachRanksMetadataIsAsPredicted) {
  const std::string bin = FERRY_BIN;
  if (!mpirun_on_path() || ::access((bin.substr(0, bin.rfind('/') + 1) + "ferry-mpi-bcast").c_str(), X_OK) != 0)
    GTEST_SKIP() << "no OpenMPI (see JsonHasEveryKeyWithSaneValues)";
  // Push under the groups commit policy: its bounded shadow as predicted too, rank by rank.
  // And consumer-side FP8 (the loader quantising after loading) under the full shadow.
  for (const char* mode : {"pull", "push --commit groups", "pull --quantize fp8 --commit shadow"}) {
    SCOPED_TRACE(mode);
    BenchRun r = run_bench(std::string("--mode ") + mode);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.out << "\n" << r.err;
    expect_metadata_as_predicted(j);
    EXPECT_EQ(j["verified_ranks"], 2);
    if (std::string(mode).find("fp8") != std::string::npos) {
      EXPECT_EQ(j["quantize"], "fp8");
    }
    if (std::string(mode).find("groups") != std::string::npos) {
      for (const auto& c : j["memory"]["consumers"]) EXPECT_GT(c["engine"]["shadow"].get<uint64_t>(), 0u);
      EXPECT_GT(j["commit_seconds"].get<double>(), 0.0);
      EXPECT_GT(j["stall_seconds_p50"].get<double>(), 0.0);
    }
    // The stall and the slowest receiver over the timed syncs, p50 and p95.
    EXPECT_LE(j["stall_seconds_p50"].get<double>(), j["stall_seconds_p95"].get<double>());
    EXPECT_GT(j["slowest_receiver_seconds_p50"].get<double>(), 0.0);
    EXPECT_LE(j["slowest_receiver_seconds_p50"].get<double>(), j["slowest_receiver_seconds_p95"].get<double>());
  }
}

// --no-in-place: the trainer's weights in ordinary memory, every byte staged; still
// verified bit for bit.
TEST(BenchCli, NoInPlaceStagesEveryByte) {
  const std::string bin = FERRY_BIN;
  if (!mpirun_on_path() || ::access((bin.substr(0, bin.rfind('/') + 1) + "ferry-mpi-bcast").c_str(), X_OK) != 0)
    GTEST_SKIP() << "no OpenMPI (see JsonHasEveryKeyWithSaneValues)";
  const std::string trace = ::testing::TempDir() + "/ferry_bench_trace." + std::to_string(::getpid()) + ".json";
  BenchRun r = run_bench("--no-in-place --trace " + trace);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out << "\n" << r.err;
  EXPECT_EQ(j["in_place"], false);
  EXPECT_EQ(j["in_place_fraction"].get<double>(), 0);
  EXPECT_EQ(j["verified_ranks"], 2);
  // --trace: every rank's sync steps (warm-up + 2 trials), the reports with the one
  // serialiser's keys, their transfers in the merged file once, with their bytes.
  std::set<std::string> want;
  want = report_keys();
  ASSERT_EQ(j["last_sync_reports"].size(), 4u) << r.out;
  for (const auto& rep : j["last_sync_reports"]) {
    for (const auto& k : want) EXPECT_TRUE(rep.contains(k)) << k << " missing: " << rep.dump();
  }
  auto t = ferry::tools::read_trace_file(trace);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ((*t)["ferryReports"].size(), 12u);
  uint64_t reported = 0, traced = 0;
  for (const auto& rep : (*t)["ferryReports"]) reported += rep["bytes"].get<uint64_t>();
  for (const auto& e : (*t)["traceEvents"])
    if (e["ph"] == "X" && e["cat"] == "transfer") traced += e["args"]["bytes"].get<uint64_t>();
  EXPECT_EQ(traced, reported);
  EXPECT_GT(traced, 0u);
  std::remove(trace.c_str());
}

// --delta (docs/delta.md) between versions that differ in 1% of their elements: every
// inference rank verified bit for bit, the bytes on the wire a small share of the dense
// bytes the raw step moved in the same trials, the patches counted on both sides.
TEST(BenchCli, DeltaMovesThePatchesAndVerifies) {
  const std::string bin = FERRY_BIN;
  if (!mpirun_on_path() || ::access((bin.substr(0, bin.rfind('/') + 1) + "ferry-mpi-bcast").c_str(), X_OK) != 0)
    GTEST_SKIP() << "no OpenMPI (see JsonHasEveryKeyWithSaneValues)";
  BenchRun r = run_bench("--delta --delta-same-host --changed-fraction 0.01");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out << "\n" << r.err;
  EXPECT_EQ(j["verified_ranks"], 2);
  ASSERT_TRUE(j.contains("delta")) << r.out;
  const auto& d = j["delta"];
  EXPECT_GT(d["dense_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(d["dense_bytes"], j["raw_bytes"]);
  EXPECT_EQ(d["bytes_moved"], j["bytes_moved"]);
  EXPECT_EQ(d["patch_bytes"], d["bytes_moved"]);  // every segment of this model patched
  EXPECT_LT(d["wire_ratio"].get<double>(), 0.05) << d.dump();
  EXPECT_NEAR(d["changed_fraction_seen"].get<double>(), 0.01, 0.003) << d.dump();
  EXPECT_EQ(d["patches_repaired"], 0);
  // Bad values are refused before anything starts.
  BenchRun bad = run_command(std::string(FERRY_BIN) + " bench --changed-fraction nan");
  EXPECT_NE(bad.exit_code, 0);
  bad = run_command(std::string(FERRY_BIN) + " bench --changed-fraction 1.5");
  EXPECT_NE(bad.exit_code, 0);
  bad = run_command(std::string(FERRY_BIN) + " bench --changes random");
  EXPECT_NE(bad.exit_code, 0);
}

// A model this machine cannot hold is refused with the estimate before any rank starts
// (a ~440 GB Llama: 1000 layers at full width), never left to the OOM killer.
TEST(BenchCli, ModelThatCannotFitIsRefusedWithTheEstimate) {
  const std::string cmd = std::string(FERRY_BIN) + " bench --model " + FERRY_SOURCE_DIR +
                          "/configs/llama-3.1-8b.json --no-shrink --config-overrides '{\"num_hidden_layers\": 1000}' "
                          "--trainer tp=2 --inference tp=4";
  BenchRun est = run_command(cmd + " --memory-estimate");
  EXPECT_EQ(est.exit_code, 1) << est.err;
  auto j = nlohmann::json::parse(est.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << est.out << "\n" << est.err;
  EXPECT_EQ(j["fits"], false);
  EXPECT_GT(j["estimate_bytes"].get<double>(), 400e9);
  EXPECT_GT(j["mem_available_bytes"].get<double>(), 0);
  if (!mpirun_on_path()) return;  // the run itself first needs OpenMPI (MissingMpirunIsAClearError)
  BenchRun r = run_command(cmd);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("needs an estimated"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("MemAvailable"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("trial"), std::string::npos) << "no rank may start: " << r.err;
}

TEST(BenchCli, MissingMpirunIsAClearError) {
  BenchRun r = run_bench("--mpirun /nonexistent/mpirun");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("/nonexistent/mpirun"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("openmpi"), std::string::npos) << r.err;
}

}  // namespace
