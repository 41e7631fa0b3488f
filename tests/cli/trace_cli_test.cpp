// `ferry demo --trace FILE` and `ferry trace`: the trace of a real multi-process demo is
// valid Chrome trace-event JSON, has every transfer of the ranks' reports exactly once,
// with bytes summing to the reports' (each rank's, and each producer's sends equal to
// what its consumers received, two processes' records of the same bytes), and
// `ferry trace --plot` draws it.
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/run_command.h"
#include "engine/report_json.h"
#include "tools/trace_file.h"
#include "test_paths.h"

namespace {

using ferry_cli_test::run_command;

const std::string kDemo =
    std::string(FERRY_BIN) + " demo --model " + FERRY_SOURCE_DIR + "/configs/llama-3.1-8b.json --config-overrides "
    "'{\"num_hidden_layers\": 2, \"hidden_size\": 256, \"intermediate_size\": 512, \"vocab_size\": 1024, "
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64}' "
    "--trainer tp=2 --inference tp=2,replicas=2 --syncs 2 --kill-sync 0 --checksums";

std::set<std::string> keys_of(const nlohmann::json& j) {
  std::set<std::string> k;
  for (const auto& [key, v] : j.items()) k.insert(key);
  return k;
}

// The keys every report has (the one serialiser's).
std::set<std::string> report_keys() { return keys_of(ferry::engine::sync_report_json(ferry::SyncReport{})); }

// version -> bytes, from the demo's table ("version bytes seconds ...").
std::map<uint64_t, uint64_t> table_bytes(const std::string& out) {
  std::map<uint64_t, uint64_t> rows;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long v = 0, b = 0;
    char rest = 0;
    if (std::sscanf(line.c_str(), " %llu %llu %c", &v, &b, &rest) == 3) rows[v] = b;
  }
  return rows;
}

class DemoTrace : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = ::testing::TempDir() + "/ferry_demo_trace." + std::to_string(::getpid()) + ".json";
    run_ = run_command(std::string(kDemo) + " --trace " + path_);
  }
  static void TearDownTestSuite() { std::remove(path_.c_str()); }
  static std::string path_;
  static ferry_cli_test::CommandRun run_;
};
std::string DemoTrace::path_;
ferry_cli_test::CommandRun DemoTrace::run_;

TEST_F(DemoTrace, EveryTransferOfTheReportsOnceWithTheirBytes) {
  ASSERT_EQ(run_.exit_code, 0) << run_.out << run_.err;
  auto t = ferry::tools::read_trace_file(path_);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const nlohmann::json& j = *t;
  ASSERT_TRUE(j.contains("ferryReports"));
  // 2 trainer + 4 inference ranks, 2 syncs each.
  ASSERT_EQ(j["ferryReports"].size(), 12u) << j["ferryReports"].dump();
  std::map<int, std::pair<std::string, int>> rank_of;  // pid -> (role, rank)
  for (const auto& r : j["ferryReports"]) {
    const bool producer = r["role"] == "trainer";
    rank_of[ferry::engine::chrome_process(producer, r["rank"]).pid] = {r["role"], r["rank"]};
  }
  // (pid, version) -> transfers by (group, peer, lane, into_params, attempt); bytes per peer.
  using Key = std::tuple<int, int, std::string, bool, int>;
  std::map<std::pair<int, uint64_t>, std::map<Key, uint64_t>> transfers;
  std::map<std::pair<int, uint64_t>, std::map<int, uint64_t>> per_peer;
  // (version, producer, consumer, group) -> bytes sent / received.
  std::map<std::tuple<uint64_t, int, int, int>, uint64_t> sent, received;
  std::set<std::string> phases;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    phases.insert(e["name"].get<std::string>().substr(0, e["name"].get<std::string>().find(' ')));
    if (e["cat"] != "transfer") continue;
    const auto& a = e["args"];
    ASSERT_TRUE(a["counted"].get<bool>()) << "no failover in this run: " << e.dump();
    const int pid = e["pid"];
    ASSERT_TRUE(rank_of.count(pid)) << "a process without reports: " << e.dump();
    const uint64_t v = a["version"];
    const Key k{a["group"], a["peer"], a["lane"], a["into_params"], a["attempt"]};
    EXPECT_TRUE((transfers[{pid, v}].emplace(k, a["bytes"].get<uint64_t>()).second)) << "twice: " << e.dump();
    per_peer[{pid, v}][a["peer"].get<int>()] += a["bytes"].get<uint64_t>();
    const bool producer = rank_of[pid].first == "trainer";
    const int me = rank_of[pid].second, peer = a["peer"], g = a["group"];
    (producer ? sent[{v, me, peer, g}] : received[{v, peer, me, g}]) += a["bytes"].get<uint64_t>();
  }
  for (const char* p : {"wait", "materialize", "pack", "announce", "send", "read", "receive", "unpack", "commit"})
    EXPECT_TRUE(phases.count(p)) << "no " << p << " slice";
  std::map<uint64_t, uint64_t> received_per_version;
  for (const auto& r : j["ferryReports"]) {
    const bool producer = r["role"] == "trainer";
    const int pid = ferry::engine::chrome_process(producer, r["rank"]).pid;
    const uint64_t v = r["version"];
    EXPECT_TRUE(r["ok"].get<bool>()) << r.dump();
    uint64_t sum = 0;
    for (const auto& [k, b] : transfers[{pid, v}]) sum += b;
    EXPECT_EQ(sum, r["bytes"].get<uint64_t>()) << r.dump();
    EXPECT_GT(sum, 0u) << r.dump();
    std::map<int, uint64_t> want;
    for (const auto& [peer, b] : r["bytes_per_peer"].items()) want[std::stoi(peer)] = b;
    EXPECT_EQ((per_peer[{pid, v}]), want) << r.dump();
    if (!producer) received_per_version[v] += sum;
    // The one serialiser's keys, with the trace file's role and rank.
    auto k = keys_of(r);
    k.erase("role");
    k.erase("rank");
    EXPECT_EQ(k, report_keys());
  }
  // Two processes' records of the same bytes agree: each producer's sends to a consumer
  // in a group are what that consumer received from it there.
  EXPECT_EQ(sent, received);
  // And the demo's own table (from the workers' results) says the same bytes.
  EXPECT_EQ(table_bytes(run_.out), received_per_version) << run_.out;
}

// Every report's stage record sums to its seconds; the demo prints the stall and the
// slowest receiver over its syncs and the stage record of the last sync's slowest rank,
// its stages summing to that rank's seconds.
TEST_F(DemoTrace, StageRecordsSumToTheSecondsAndTheStallIsPrinted) {
  ASSERT_EQ(run_.exit_code, 0) << run_.out << run_.err;
  auto t = ferry::tools::read_trace_file(path_);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  for (const auto& r : (*t)["ferryReports"]) {
    ASSERT_TRUE(r.contains("stages")) << r.dump();
    double sum = 0;
    for (const auto& [name, secs] : r["stages"].items()) sum += secs.get<double>();
    EXPECT_NEAR(sum, r["seconds"].get<double>(), 1e-6) << r.dump();
    EXPECT_GT(sum - r["stages"]["unattributed"].get<double>(), 0.0) << r.dump();
  }
  EXPECT_NE(run_.out.find("stall (commit in_place: "), std::string::npos) << run_.out;
  EXPECT_NE(run_.out.find("(2 syncs)"), std::string::npos) << run_.out;
  const size_t at = run_.out.find("stage record of sync 2, consumer");
  ASSERT_NE(at, std::string::npos) << run_.out;
  const std::string line = run_.out.substr(at, run_.out.find('\n', at) - at);
  // "... (S s): rendezvous x, routing x, ...; sum S s": the two S agree (4 decimals).
  const size_t open = line.find(" ("), s_end = line.find(" s): ");
  const size_t sum_at = line.rfind("; sum ");
  ASSERT_TRUE(open != std::string::npos && s_end != std::string::npos && sum_at != std::string::npos) << line;
  EXPECT_EQ(line.substr(open + 2, s_end - open - 2), line.substr(sum_at + 6, line.size() - sum_at - 8)) << line;
  for (const char* stage : {"rendezvous", "routing", "registration", "wire", "receive", "transform", "commit",
                            "unattributed"})
    EXPECT_NE(line.find(stage), std::string::npos) << line;
}

TEST_F(DemoTrace, FerryTraceSummarisesAndPlots) {
  ASSERT_EQ(run_.exit_code, 0) << run_.out << run_.err;
  auto s = run_command(std::string(FERRY_BIN) + " trace " + path_);
  EXPECT_EQ(s.exit_code, 0) << s.out << s.err;
  EXPECT_NE(s.out.find("every transfer once, bytes equal to the reports'"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("inference 1"), std::string::npos) << s.out;
  if (run_command("/usr/bin/python3 -c 'import matplotlib'").exit_code != 0)
    GTEST_SKIP() << "python3-matplotlib is not installed: --plot cannot draw (apt-get install python3-matplotlib)";
  const std::string png = path_ + ".png";
  auto p = run_command(std::string(FERRY_BIN) + " trace " + path_ + " --plot " + png);
  ASSERT_EQ(p.exit_code, 0) << p.out << p.err;
  std::ifstream f(png, std::ios::binary);
  char magic[8] = {};
  f.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::remove(png.c_str());
}

TEST(FerryTrace, NamesAFileThatIsNotATrace) {
  const std::string bad = ::testing::TempDir() + "/ferry_bad_trace." + std::to_string(::getpid()) + ".json";
  std::ofstream(bad) << R"({"traceEvents": [{"ph": "X", "name": "x", "pid": 1, "ts": 0}]})";
  auto r = run_command(std::string(FERRY_BIN) + " trace " + bad);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find(bad), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("dur"), std::string::npos) << r.err;
  std::remove(bad.c_str());
}

}  // namespace
