// `ferry serve` serving a safetensors checkpoint in place from its mapping, `ferry fetch`
// verifying what it received bit for bit against a direct load of the same checkpoint:
// every rank a process (UCX on loopback), the store in this process. Pull and push.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/report_json.h"
#include "ferry/device.h"
#include "ferry/models.h"
#include "ferry/safetensors.h"
#include "ferry/store.h"
#include "tools/job_model.h"
#include "tools/rank_entry.h"
#include "tools/subprocess.h"
#include "test_paths.h"

namespace ferry::tools {
namespace {

using namespace std::chrono_literals;

constexpr const char* kTrainer = "tp=2";
constexpr const char* kInference = "tp=2";

// config.json + model.safetensors of a 2-layer Llama with random weights.
std::string make_checkpoint() {
  char tmpl[] = "/tmp/ferry-serve-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  auto m = make_job_model(std::string(FERRY_SOURCE_DIR) + "/configs/llama-3.1-8b.json", kTrainer, kInference, true,
                          R"({"num_hidden_layers": 2})");
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return dir;
  std::ofstream(dir + "/config.json") << m->config.dump();
  auto ckpt = random_checkpoint(m->metadata, 11);
  EXPECT_TRUE(ckpt.ok());
  std::vector<SafetensorsEntry> entries;
  for (const auto& d : m->metadata) entries.push_back({d.name, ckpt->at(d.name)});
  EXPECT_TRUE(write_safetensors(dir + "/model.safetensors", entries).ok());
  return dir;
}

std::vector<nlohmann::json> json_lines(const std::string& log) {
  std::vector<nlohmann::json> out;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '{') out.push_back(nlohmann::json::parse(line, nullptr, false));
  }
  return out;
}

std::string random_token() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}", rd(), rd(), rd());
}

// The keys of every report (the one serialiser's, engine/report_json.h).
std::set<std::string> report_keys() {
  const nlohmann::json j = ferry::engine::sync_report_json(ferry::SyncReport{});
  std::set<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.insert(k);
  return keys;
}

class ServeCliTest : public ::testing::TestWithParam<const char*> {};

// Each trainer rank reports bytes served from the mapping (sent_in_place > 0: the
// checkpoint's contiguous boxes, neither packed nor staged), and each inference rank
// verifies bit for bit, every sync.
TEST_P(ServeCliTest, ServesTheMappingInPlaceAndFetchVerifies) {
  const std::string mode = GetParam();
  const std::string dir = make_checkpoint();
  StoreServerOptions so;
  so.token = random_token();
  auto server = StoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  const std::vector<std::string> env = environment_with("FERRY_TOKEN", so.token);
  const std::vector<std::string> common = {"--store", (*server)->url(), "--trainer", kTrainer, "--inference", kInference,
                                           "--job", "serve-" + mode, "--mode", mode, "--checksums", "--syncs", "2",
                                           "--timeout", "20000", "--rendezvous-timeout", "30000"};
  std::vector<Child> ranks;
  for (int r = 0; r < 2; ++r) {
    for (const char* role : {"serve", "fetch"}) {
      ProcessSpec ps;
      ps.argv = {FERRY_BIN, role, "--rank", std::to_string(r)};
      ps.argv.insert(ps.argv.end(), common.begin(), common.end());
      if (std::string(role) == "serve") {
        ps.argv.insert(ps.argv.end(), {"--checkpoint", dir});
      } else {
        ps.argv.insert(ps.argv.end(), {"--model", dir + "/config.json", "--verify", dir});
        // Push fetches under the shadow commit policy: each sync lands beside the live
        // params and commits at its end (issue 27), verified the same.
        if (mode == "push") ps.argv.insert(ps.argv.end(), {"--commit", "shadow"});
      }
      ps.env = env;
      ps.log = fmt::format("{}/{}-{}-{}.log", dir, role, r, mode);
      ps.name = fmt::format("{} {}", role, r);
      auto c = spawn(ps);
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      ranks.push_back(*c);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  for (Child& c : ranks) {
    const std::string name = c.name;
    auto st = wait_exit(c, deadline);
    const std::string log = read_log(c);
    if (!st) kill_now(c);
    ASSERT_TRUE(st.has_value()) << name << " did not exit:\n" << log;
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << name << " exit status " << *st << ":\n" << log;
    const auto lines = json_lines(log);
    ASSERT_EQ(lines.size(), 2u) << name << ":\n" << log;
    for (const auto& j : lines) {
      ASSERT_TRUE(j.is_object()) << log;
      EXPECT_TRUE(j.value("ok", false)) << name << ": " << j.dump();
      // The one serialiser's keys (engine/report_json.h) and the rank's own.
      std::set<std::string> keys, want;
      for (const auto& [k, v] : j.items()) keys.insert(k);
      want = report_keys();
      want.insert({"role", "rank", "transport"});
      if (j.value("role", "") == "inference") want.insert({"torn", "verified", "received_version"});
      EXPECT_EQ(keys, want) << name << ": " << j.dump();
      if (j.value("role", "") == "inference") {
        EXPECT_TRUE(j.value("committed", false)) << name << ": " << j.dump();
        EXPECT_EQ(j.value("live_version", 0), j.value("version", -1)) << name << ": " << j.dump();
        EXPECT_TRUE(j["received_version"].is_null()) << name << ": " << j.dump();
        EXPECT_EQ(j["memory"].value("shadow", uint64_t{0}) > 0, mode == "push") << name << ": " << j.dump();
      }
      if (j.value("role", "") == "trainer") {
        EXPECT_GT(j.value("sent_in_place", uint64_t{0}), 0u) << name << " served nothing from the mapping: " << j.dump();
        EXPECT_LE(j.value("sent_in_place", uint64_t{0}), j.value("bytes", uint64_t{0})) << j.dump();
      } else {
        EXPECT_TRUE(j.value("verified", false)) << name << ": " << j.dump();
        EXPECT_GT(j.value("received_into_params", uint64_t{0}), 0u) << name << ": " << j.dump();
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// Weights and params in GPU memory, every rank a process (on a machine without a GPU:
// under the emulated CUDA plugin, label emulated-cuda). Trainer ranks copy their boxes
// onto cuda:0 and stage there (--gpu-staging, exported by CUDA IPC); inference rank 0
// copies device to device from that staging (received_via_cuda_ipc is every byte it
// received), rank 1 reads the host copy through the transport (--no-cuda-ipc); both
// verify bit for bit, two syncs.
TEST(GpuServeCli, ServesGpuMemoryByCudaIpcAndThroughTheTransport) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device (or FERRY_CUDA_PLUGIN=emulated); " << cuda_status().detail;
  const std::string dir = make_checkpoint();
  StoreServerOptions so;
  so.token = random_token();
  auto server = StoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  const std::vector<std::string> env = environment_with("FERRY_TOKEN", so.token);
  const std::vector<std::string> common = {"--store", (*server)->url(), "--trainer", kTrainer, "--inference", kInference,
                                           "--job", "serve-gpu", "--syncs", "2", "--timeout", "20000",
                                           "--rendezvous-timeout", "30000", "--device", "cuda:0"};
  std::vector<Child> ranks;
  for (int r = 0; r < 2; ++r) {
    for (const char* role : {"serve", "fetch"}) {
      ProcessSpec ps;
      ps.argv = {FERRY_BIN, role, "--rank", std::to_string(r)};
      ps.argv.insert(ps.argv.end(), common.begin(), common.end());
      if (std::string(role) == "serve") {
        ps.argv.insert(ps.argv.end(), {"--checkpoint", dir, "--gpu-staging"});
      } else {
        ps.argv.insert(ps.argv.end(), {"--model", dir + "/config.json", "--verify", dir});
        if (r == 1) ps.argv.push_back("--no-cuda-ipc");
      }
      ps.env = env;
      ps.log = fmt::format("{}/{}-{}-gpu.log", dir, role, r);
      ps.name = fmt::format("{} {}", role, r);
      auto c = spawn(ps);
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      ranks.push_back(*c);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  for (Child& c : ranks) {
    const std::string name = c.name;
    auto st = wait_exit(c, deadline);
    const std::string log = read_log(c);
    if (!st) kill_now(c);
    ASSERT_TRUE(st.has_value()) << name << " did not exit:\n" << log;
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << name << " exit status " << *st << ":\n" << log;
    const auto lines = json_lines(log);
    ASSERT_EQ(lines.size(), 2u) << name << ":\n" << log;
    for (const auto& j : lines) {
      ASSERT_TRUE(j.is_object()) << log;
      EXPECT_TRUE(j.value("ok", false)) << name << ": " << j.dump();
      // The one serialiser's keys (engine/report_json.h) and the rank's own.
      std::set<std::string> keys, want;
      for (const auto& [k, v] : j.items()) keys.insert(k);
      want = report_keys();
      want.insert({"role", "rank", "transport"});
      if (j.value("role", "") == "inference") want.insert({"torn", "verified", "received_version"});
      EXPECT_EQ(keys, want) << name << ": " << j.dump();
      if (j.value("role", "") != "inference") continue;
      EXPECT_TRUE(j.value("verified", false)) << name << ": " << j.dump();
      const uint64_t bytes = j.value("bytes", uint64_t{0});
      EXPECT_GT(bytes, 0u) << j.dump();
      EXPECT_EQ(j.value("received_via_cuda_ipc", uint64_t{1}), name == "fetch 0" ? bytes : 0u) << name << ": " << j.dump();
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// A job whose ranks are threads of this process (serve_rank / fetch_rank): its store and
// the RankSpec every rank starts from.
struct ThreadRanks {
  std::unique_ptr<StoreServer> server;
  RankSpec base;
  void start(const std::string& job, int syncs, int timeout_ms) {
    StoreServerOptions so;
    so.token = random_token();
    auto s = StoreServer::start(so);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    server = std::move(*s);
    base.store = server->url();
    base.token = so.token;
    base.job = job;
    base.trainer = kTrainer;
    base.inference = kInference;
    base.syncs = syncs;
    base.timeout_ms = timeout_ms;
    base.rendezvous_ms = 30000;
  }
};

// What the CLI runs (keep_reports off): every report goes to the sink as it comes and
// none is kept, so a serve or fetch of many syncs holds no more memory at the last than at
// the first (12,000 syncs grew 24-28 MB keeping them; issue 49). The library's callers
// (keep_reports on) get every report back. Ranks are threads of this process.
TEST(ServeReports, TheCliKeepsNoReportTheSinkSawEveryOne) {
  const std::string dir = make_checkpoint();
  ThreadRanks job;
  ASSERT_NO_FATAL_FAILURE(job.start("serve-reports", 3, 20000));
  const RankSpec& base = job.base;
  std::vector<std::optional<Result<std::vector<RankReport>>>> results(4);
  std::vector<std::atomic<int>> seen(4);
  std::vector<std::thread> th;
  for (int i = 0; i < 4; ++i) {
    th.emplace_back([&, i] {
      RankSpec s = base;
      s.rank = i % 2;
      s.keep_reports = s.rank == 1;  // rank 0 of each side as the CLI runs it
      auto sink = [&, i](const RankReport& r) { seen[static_cast<size_t>(i)] += r.ok ? 1 : 0; };
      if (i < 2) {
        s.checkpoint = dir;
        results[static_cast<size_t>(i)].emplace(serve_rank(s, sink));
      } else {
        s.model = dir + "/config.json";
        results[static_cast<size_t>(i)].emplace(fetch_rank(s, sink));
      }
    });
  }
  for (auto& t : th) t.join();
  for (int i = 0; i < 4; ++i) {
    const auto& r = results[static_cast<size_t>(i)];
    ASSERT_TRUE(r && r->ok()) << i << ": " << (r ? r->status().to_string() : "not run");
    EXPECT_EQ(seen[static_cast<size_t>(i)].load(), 3) << i;
    EXPECT_EQ((*r)->size(), i % 2 == 1 ? 3u : 0u) << i;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// The checkpoint file changes between syncs (here: its mtime moves, as a rewrite in place
// would leave it): serve's check before the next sync stops serving and says which file
// and why, instead of serving bytes that may no longer be the checkpoint (or faulting on
// a shorter file). Ranks are threads of this process (serve_rank / fetch_rank); the
// change is made from serve rank 0's report of sync 1, so it lands before rank 0's check
// for sync 2. The fetch ranks then fail sync 2 within their timeout, naming no version
// they do not hold.
// Two ways the file changes: a new mtime (a rewrite), and bytes overwritten in place with
// the size kept and the mtime set back (issue 49, finding 5: that one was served; the
// status change time gives it away).
class ServeChangedFile : public ::testing::TestWithParam<const char*> {};

TEST_P(ServeChangedFile, ServeStopsNamingTheFileThatChanged) {
  const std::string dir = make_checkpoint();
  ThreadRanks job;
  ASSERT_NO_FATAL_FAILURE(job.start("serve-changed", 2, 4000));
  const RankSpec& base = job.base;
  const std::string file = dir + "/model.safetensors";
  std::vector<std::optional<Result<std::vector<RankReport>>>> served(2), fetched(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r) {
    th.emplace_back([&, r] {
      RankSpec s = base;
      s.rank = r;
      s.checkpoint = dir;
      served[static_cast<size_t>(r)].emplace(serve_rank(s, [&, r](const RankReport& rep) {
        if (r != 0 || rep.version != 1) return;
        struct stat st {};
        ASSERT_EQ(::stat(file.c_str(), &st), 0);
        timespec times[2] = {st.st_atim, st.st_mtim};
        if (std::string(GetParam()) == "mtime") {
          times[1].tv_sec += 1;  // a new mtime, a second later than the mapped one: what a rewrite leaves
        } else {  // one byte near the end (a weight's) flipped in place, then the times set back (touch -r)
          const int fd = ::open(file.c_str(), O_RDWR);
          ASSERT_GE(fd, 0);
          char b = 0;
          ASSERT_EQ(::pread(fd, &b, 1, st.st_size - 2), 1);
          b = static_cast<char>(b ^ 0x40);
          ASSERT_EQ(::pwrite(fd, &b, 1, st.st_size - 2), 1);
          ::close(fd);
        }
        ASSERT_EQ(::utimensat(AT_FDCWD, file.c_str(), times, 0), 0);
      }));
    });
    th.emplace_back([&, r] {
      RankSpec s = base;
      s.rank = r;
      s.model = dir + "/config.json";
      s.checkpoint = dir;  // verify
      fetched[static_cast<size_t>(r)].emplace(fetch_rank(s));
    });
  }
  for (auto& t : th) t.join();
  ASSERT_TRUE(served[0] && served[0]->ok()) << (served[0] ? served[0]->status().to_string() : "not run");
  const std::vector<RankReport>& reps0 = **served[0];
  ASSERT_EQ(reps0.size(), 2u);
  EXPECT_TRUE(reps0[0].ok) << reps0[0].error.to_string();
  const RankReport& stopped = reps0[1];
  EXPECT_FALSE(stopped.ok);
  EXPECT_EQ(stopped.error.code(), StatusCode::kFailedPrecondition) << stopped.error.to_string();
  EXPECT_NE(stopped.error.message().find(file), std::string::npos) << stopped.error.to_string();
  EXPECT_NE(stopped.error.message().find("changed since serve mapped it"), std::string::npos) << stopped.error.to_string();
  EXPECT_NE(rank_report_json(stopped).dump().find("changed since serve mapped it"), std::string::npos);
  for (int r = 0; r < 2; ++r) {
    const auto& f = fetched[static_cast<size_t>(r)];
    ASSERT_TRUE(f && f->ok()) << (f ? f->status().to_string() : "not run");
    const auto& reps = **f;
    ASSERT_EQ(reps.size(), 2u);
    EXPECT_TRUE(reps[0].ok && reps[0].verified.value_or(false)) << "fetch " << r << ": " << reps[0].error.to_string();
    EXPECT_FALSE(reps[1].ok) << "fetch " << r << " committed a version served from a changed file";
    // A failed sync's JSON line says how long it took and what it moved, like any other.
    const nlohmann::json j = rank_report_json(reps[1]);
    EXPECT_GT(j.value("seconds", 0.0), 0.0) << j.dump();
    EXPECT_TRUE(j.contains("bytes") && j["bytes"].is_number()) << j.dump();
    EXPECT_FALSE(j.value("ok", true)) << j.dump();
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

INSTANTIATE_TEST_SUITE_P(Changes, ServeChangedFile, ::testing::Values("mtime", "overwrite_in_place_mtime_kept"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

// The checkpoint file is truncated *during* a sync (from the producer's hook before it
// materialises group 1 of version 1, after serve's check before the sync passed): the
// next touch of a page past the new end (packing a strided box, or serving a read of an
// in-place one) faulted, and serve died of SIGBUS (exit 135, issue 30). Now the fault in
// the watched mapping ends the process with exit 1 and a message naming the file. The
// whole job runs in a death-test child (threads of one process, as above, forked from
// this one before any thread starts), which the fault ends.
TEST(ServeTruncatedFile, TruncatedDuringASyncIsAnErrorExitNotSigbus) {
  const std::string dir = make_checkpoint();
  const std::string file = dir + "/model.safetensors";
  const auto job = [&] {
    StoreServerOptions so;
    so.token = random_token();
    auto server = StoreServer::start(so);
    if (!server.ok()) std::_Exit(90);
    RankSpec base;
    base.store = (*server)->url();
    base.token = so.token;
    base.job = "serve-truncated";
    base.trainer = kTrainer;
    base.inference = kInference;
    base.syncs = 1;
    base.timeout_ms = 10000;
    base.rendezvous_ms = 30000;
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r) {
      th.emplace_back([&, r] {
        RankSpec s = base;
        s.rank = r;
        s.checkpoint = dir;
        s.before_materialize = [&, r](uint64_t, int group) {
          if (r == 0 && group == 1) std::filesystem::resize_file(file, 16);
        };
        (void)serve_rank(s);
      });
      th.emplace_back([&, r] {
        RankSpec s = base;
        s.rank = r;
        s.model = dir + "/config.json";
        (void)fetch_rank(s);
      });
    }
    for (auto& t : th) t.join();
    std::_Exit(91);  // the sync ended without touching the truncated pages: not what this tests
  };
  EXPECT_EXIT(job(), ::testing::ExitedWithCode(1),
              "checkpoint file /tmp/ferry-serve-.*/model.safetensors was truncated while it was served .*\\(byte [0-9]+ "
              "of the [0-9]+ mapped\\)");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// A job of two serve ranks (tp=2) and replicas (two by default) of a tp=1 engine over a fresh
// checkpoint, the store in this process; start() spawns one rank (fetch ranks verify
// against the checkpoint).
struct ReplicaJob {
  std::string dir = make_checkpoint();
  StoreServerOptions so;
  Result<std::unique_ptr<StoreServer>> server = Status(StatusCode::kInternal, "not started");
  std::vector<std::string> env, common;
  explicit ReplicaJob(const std::string& job, int replicas = 2, std::vector<std::string> extra = {}) {
    so.token = random_token();
    server = StoreServer::start(so);
    if (!server.ok()) return;
    env = environment_with("FERRY_TOKEN", so.token);
    common = {"--store", (*server)->url(), "--trainer", kTrainer, "--inference", fmt::format("tp=1,replicas={}", replicas),
              "--job", job, "--timeout", "20000", "--rendezvous-timeout", "30000"};
    common.insert(common.end(), extra.begin(), extra.end());
  }
  ~ReplicaJob() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  Result<Child> start(const std::string& role, int r, const std::vector<std::string>& extra, const std::string& tag = "") {
    ProcessSpec ps;
    ps.argv = {FERRY_BIN, role, "--rank", std::to_string(r)};
    ps.argv.insert(ps.argv.end(), common.begin(), common.end());
    if (role == "serve") {
      ps.argv.insert(ps.argv.end(), {"--checkpoint", dir});
    } else {
      ps.argv.insert(ps.argv.end(), {"--model", dir + "/config.json", "--verify", dir});
    }
    ps.argv.insert(ps.argv.end(), extra.begin(), extra.end());
    ps.env = env;
    ps.log = fmt::format("{}/{}-{}{}.log", dir, role, r, tag);
    ps.name = fmt::format("{} {}{}", role, r, tag);
    return spawn(ps);
  }
};

// Scaling in from the command line: of two replicas, fetch rank 1 takes one sync and
// leaves (`--leave`); the serve ranks' second sync goes on without it, ok, naming it in
// "left" and in no "missed"; fetch rank 0 verifies both syncs. Every rank a process (UCX
// on loopback): the LEAVE goes over the real transport.
TEST(ServeCliLeave, AFetchThatLeavesIsNamedLeftNotMissed) {
  ReplicaJob job("leave");
  ASSERT_TRUE(job.server.ok()) << job.server.status().to_string();
  std::vector<Child> ranks;
  for (const auto& [role, r] : std::vector<std::pair<std::string, int>>{{"serve", 0}, {"serve", 1}, {"fetch", 0}, {"fetch", 1}}) {
    std::vector<std::string> extra = {"--syncs", role == "fetch" && r == 1 ? "1" : "2"};
    if (role == "fetch" && r == 1) extra.push_back("--leave");
    auto c = job.start(role, r, extra);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ranks.push_back(*c);
  }
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  for (Child& c : ranks) {
    const std::string name = c.name;
    auto st = wait_exit(c, deadline);
    const std::string log = read_log(c);
    if (!st) kill_now(c);
    ASSERT_TRUE(st.has_value()) << name << " did not exit:\n" << log;
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << name << " exit status " << *st << ":\n" << log;
    const auto lines = json_lines(log);
    ASSERT_EQ(lines.size(), name == "fetch 1" ? 1u : 2u) << name << ":\n" << log;
    for (const auto& j : lines) {
      ASSERT_TRUE(j.is_object()) << log;
      EXPECT_TRUE(j.value("ok", false)) << name << ": " << j.dump();
      if (j.value("role", "") == "inference") {
        EXPECT_TRUE(j.value("verified", false)) << name << ": " << j.dump();
      } else {
        EXPECT_TRUE(j["missed"].empty()) << name << ": " << j.dump();
        EXPECT_EQ(j["left"], j.value("version", 0) == 2 ? nlohmann::json::array({1}) : nlohmann::json::array())
            << name << ": " << j.dump();
      }
    }
  }
}

// Joining a running job from the command line (issue 45): of three replicas, fetch rank 2
// takes sync 1 and exits; fetch rank 1 is SIGKILLed (its lease, of a 10 s ttl, still
// says it holds version 1); a new `ferry fetch --catch-up --syncs 0` in rank 2 asks fetch
// 1 first (the tree's order for version 1), finds it dead, and reads the live version
// from fetch rank 0's params (processes over UCX), verified against the checkpoint, with
// nothing from the serve ranks, its line naming the dead one in a catch-up event. The
// serve ranks and fetch 0 and 1 stay up after their sync (--metrics-linger: they keep
// their leases and params) and are stopped after.
TEST(ServeCliCatchUp, AFetchJoiningARunningJobReadsFromALiveReplicaPastAKilledOne) {
  ReplicaJob job("catch-up", 3, {"--lease-ttl", "10000"});
  ASSERT_TRUE(job.server.ok()) << job.server.status().to_string();
  const std::vector<std::string> stay = {"--syncs", "1", "--metrics-port", "0", "--metrics-linger", "120"};
  std::vector<Child> staying;
  for (const auto& [role, r] : std::vector<std::pair<std::string, int>>{{"serve", 0}, {"serve", 1}, {"fetch", 0}, {"fetch", 1}}) {
    auto c = job.start(role, r, stay);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    staying.push_back(*c);
  }
  struct Stop {
    std::vector<Child>& ranks;
    ~Stop() {
      for (Child& c : ranks) kill_now(c);
    }
  } stop{staying};
  auto first = job.start("fetch", 2, {"--syncs", "1"});
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  auto exits_ok = [&](Child& c, size_t lines) -> std::vector<nlohmann::json> {
    auto st = wait_exit(c, deadline);
    const std::string log = read_log(c);
    if (!st) kill_now(c);
    EXPECT_TRUE(st.has_value()) << c.name << " did not exit:\n" << log;
    EXPECT_TRUE(st && WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << c.name << ":\n" << log;
    auto got = json_lines(log);
    EXPECT_EQ(got.size(), lines) << c.name << ":\n" << log;
    return got;
  };
  const auto one = exits_ok(*first, 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_TRUE(one[0].value("verified", false)) << one[0].dump();
  // fetch 0 and 1 hold version 1 once they printed their lines (they linger, serving).
  for (size_t i : {size_t{2}, size_t{3}}) {
    while (json_lines(read_log(staying[i])).empty() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(50ms);
    ASSERT_EQ(json_lines(read_log(staying[i])).size(), 1u) << read_log(staying[i]);
  }
  kill_now(staying[3]);  // fetch 1: dead, its lease not lapsed yet
  auto joiner = job.start("fetch", 2, {"--catch-up", "--syncs", "0"}, " (joiner)");
  ASSERT_TRUE(joiner.ok()) << joiner.status().to_string();
  const auto lines = exits_ok(*joiner, 1);
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& j = lines[0];
  EXPECT_TRUE(j.value("ok", false)) << j.dump();
  EXPECT_TRUE(j.value("verified", false)) << j.dump();
  EXPECT_EQ(j.value("version", 0), 1) << j.dump();
  EXPECT_EQ(j.value("catch_up_source", -1), 0) << j.dump();
  EXPECT_GT(j.value("received_from_replicas", uint64_t{0}), 0u) << j.dump();
  EXPECT_EQ(j.value("received_from_replicas", uint64_t{0}), j.value("bytes_received", uint64_t{1})) << j.dump();
  EXPECT_TRUE(j["bytes_per_peer"].empty()) << "read from serve ranks: " << j.dump();
  bool named = false;
  for (const auto& e : j["events"]) named |= e.value("kind", "") == "catch-up" && e.value("peer", -1) == 1;
  EXPECT_TRUE(named) << "no catch-up event names the killed replica: " << j.dump();
  for (size_t i = 0; i < 3; ++i) {
    const auto got = json_lines(read_log(staying[i]));
    ASSERT_EQ(got.size(), 1u) << staying[i].name << ":\n" << read_log(staying[i]);
    EXPECT_TRUE(got[0].value("ok", false)) << staying[i].name << ": " << got[0].dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ServeCliTest, ::testing::Values("pull", "push"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

}  // namespace
}  // namespace ferry::tools
