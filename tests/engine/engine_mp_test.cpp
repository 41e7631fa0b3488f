// Multi-process end-to-end tests: every trainer and inference rank is a `ferry worker`
// process, data over UCX on loopback, rendezvous through the embedded TCP store or a
// private redis-server; every consumer verified bit for bit against a direct load.
// Processes need UCX, so these run on UCX only; pull and push (and the store, or the
// workers' UCX_TLS for the SIGKILL tests) are parameters of one suite.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "ferry/models.h"
#include "tools/demo.h"
#include "store/redis_server.h"
#include "test_paths.h"
#include "sanitizers.h"

namespace ferry {
namespace {

std::string cfg(const char* name) { return std::string(FERRY_SOURCE_DIR) + "/configs/" + name; }

tools::DemoSpec spec(const char* model, const char* trainer, const char* inference) {
  tools::DemoSpec d;
  d.worker_binary = FERRY_BINARY;
  d.model = cfg(model);
  d.trainer = trainer;
  d.inference = inference;
  d.overrides = R"({"num_hidden_layers": 2})";
  d.syncs = 3;
  d.quiet = true;
  d.timeout_ms = 60000;
  return d;
}

void expect_ok(const tools::DemoResult& r, int syncs) {
  EXPECT_TRUE(r.all_verified) << r.error;
  ASSERT_EQ(static_cast<int>(r.rows.size()), syncs) << r.error;
  for (const auto& row : r.rows) {
    std::string why;
    for (const auto& e : row.errors) why += "\n  " + e;
    for (const auto& f : row.failures) why += "\n  " + f;
    EXPECT_EQ(row.verified, row.expected) << "sync " << row.version << why;
    EXPECT_GT(row.bytes, 0u);
    EXPECT_LT(row.bytes, row.broadcast_bytes);
  }
}

// --- cases -----------------------------------------------------------------------------
// Every test below is one parameterised test: pull and push (and, for the tests that
// do not SIGKILL, the embedded TCP store and a private redis-server; for those that do,
// the workers' UCX_TLS) are parameters, not copies.

enum class StoreKind { kTcp, kRedis };

struct MpCase {
  const char* mode;                    // "pull" | "push"
  StoreKind store = StoreKind::kTcp;   // the rendezvous store
  const char* tls = "sm,tcp,self";     // the workers' UCX_TLS
  const char* group_order = "layer";   // every rank's EngineOptions::group_order
};

const char* store_name(StoreKind s) { return s == StoreKind::kTcp ? "tcpstore" : "redis"; }
std::string tls_name(const char* tls) {
  std::string out = tls;
  std::replace(out.begin(), out.end(), ',', '_');
  return out;
}
void PrintTo(const MpCase& c, std::ostream* os) { *os << c.mode << " " << store_name(c.store) << " " << c.tls; }
// Case names say what varies in the suite: "pull_redis" (EngineMpTest), "push_tcp_self"
// (EngineMpFaultTest).
std::string mode_store_name(const ::testing::TestParamInfo<MpCase>& i) {
  return fmt::format("{}_{}", i.param.mode, store_name(i.param.store));
}
std::string mode_tls_name(const ::testing::TestParamInfo<MpCase>& i) {
  return fmt::format("{}_{}", i.param.mode, tls_name(i.param.tls));
}

class EngineMpTest : public ::testing::TestWithParam<MpCase> {
 protected:
  bool pull() const { return std::string(GetParam().mode) == "pull"; }
  // The spec for this case; a redis store is started here and lives as long as the test.
  tools::DemoSpec spec_for(const char* model, const char* trainer, const char* inference) {
    auto d = spec(model, trainer, inference);
    d.mode = GetParam().mode;
    d.ucx_tls = GetParam().tls;
    d.group_order = GetParam().group_order;
    if (GetParam().store == StoreKind::kRedis) {
      auto r = testing::RedisServer::start("engine-mp-token-0123");
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      if (r.ok()) {
        redis_ = std::move(*r);
        d.store = fmt::format("redis://:engine-mp-token-0123@127.0.0.1:{}/enginemp", redis_->port());
      }
    }
    return d;
  }
  std::unique_ptr<testing::RedisServer> redis_;
};
// Ranks SIGKILLed: over UCX sm,tcp,self (bytes over shared memory, messages over tcp) and
// over tcp,self (this side serves the peers' reads and writes by message while they die).
class EngineMpFaultTest : public EngineMpTest {};

INSTANTIATE_TEST_SUITE_P(Ucx, EngineMpTest,
                         ::testing::Values(MpCase{"pull", StoreKind::kTcp}, MpCase{"push", StoreKind::kTcp},
                                           MpCase{"pull", StoreKind::kRedis}, MpCase{"push", StoreKind::kRedis}),
                         mode_store_name);
INSTANTIATE_TEST_SUITE_P(Ucx, EngineMpFaultTest,
                         ::testing::Values(MpCase{"pull", StoreKind::kTcp, "sm,tcp,self"},
                                           MpCase{"push", StoreKind::kTcp, "sm,tcp,self"},
                                           MpCase{"pull", StoreKind::kTcp, "tcp,self"},
                                           MpCase{"push", StoreKind::kTcp, "tcp,self"}),
                         mode_tls_name);
// The same with every rank under the rotated group order (issue 26, docs/group-order.md).
INSTANTIATE_TEST_SUITE_P(Rotated, EngineMpTest,
                         ::testing::Values(MpCase{"pull", StoreKind::kTcp, "sm,tcp,self", "rotated"},
                                           MpCase{"push", StoreKind::kTcp, "sm,tcp,self", "rotated"}),
                         mode_store_name);
INSTANTIATE_TEST_SUITE_P(Rotated, EngineMpFaultTest,
                         ::testing::Values(MpCase{"pull", StoreKind::kTcp, "sm,tcp,self", "rotated"},
                                           MpCase{"push", StoreKind::kTcp, "sm,tcp,self", "rotated"}),
                         mode_tls_name);

TEST_P(EngineMpTest, DenseGqa) {
  auto d = spec_for("llama-3.1-8b.json", "tp=2,pp=2", "tp=2,replicas=2");
  ASSERT_FALSE(HasFailure());
  expect_ok(tools::run_demo(d), d.syncs);
}

TEST_P(EngineMpTest, MoeExpertParallelChecksums) {
  auto d = spec_for("qwen3-30b-a3b.json", "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2");
  ASSERT_FALSE(HasFailure());
  d.checksums = true;
  expect_ok(tools::run_demo(d), d.syncs);
}

// MLA + MoE end to end: DeepSeek-V3 and Kimi-K2 (same architecture) shrunk (MLA q/kv
// LoRA, 1 dense + 3 MoE layers, routed experts; bf16, their FP8 block scales would not
// split over trainer TP), trainer TP/PP/EP shards read where they lie (every trainer
// rank serves), 2 inference replicas of tp=2 with EP.
void expect_mla(const tools::DemoSpec& d) {
  auto r = tools::run_demo(d);
  expect_ok(r, d.syncs);
  for (const auto& row : r.rows) {
    EXPECT_EQ(row.verified, 4) << "sync " << row.version;
    for (size_t p = 0; p < row.producer_bytes.size(); ++p)
      EXPECT_GT(row.producer_bytes[p], 0u) << "sync " << row.version << " trainer rank " << p;
  }
}
TEST_P(EngineMpTest, MlaDeepseekV3) {
  auto d = spec_for("deepseek-v3.json", "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2");
  ASSERT_FALSE(HasFailure());
  d.overrides = R"({"quantization_config": null, "num_hidden_layers": 4})";
  expect_mla(d);
}
TEST_P(EngineMpTest, MlaKimiK2) {
  auto d = spec_for("kimi-k2-instruct.json", "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2");
  ASSERT_FALSE(HasFailure());
  d.overrides = R"({"quantization_config": null, "num_hidden_layers": 4})";
  expect_mla(d);
}

// SIGKILL inference rank 1 at many points of a sync (every other sync); the others
// complete every sync, the restarted rank verifies at the next one; bounded in time.
// Points (group * 4 + phase, 6 groups x 4 phases): pull over shared memory, 0 to 19 in
// turn; the other cases, 8 points spread over every group (0, 3, ..., 21).
// When messages went over UCX 1.13 shared memory too, a victim killed while its progress
// thread wrote the message it had just posted (RELEASE precedes points 2 and 3) left an
// entry of the receiver's FIFO reserved and never published; that producer then heard
// from no consumer again, dropped them all as stalled and overran the driver's wait
// (about 1 run in 10 of the 20-point pull case).
TEST_P(EngineMpFaultTest, ConsumerSigkill) {
  auto d = spec_for("llama-3.1-8b.json", "tp=2,pp=2", "tp=2,replicas=2");
  d.overrides = R"({"num_hidden_layers": 4})";  // 6 groups x 4 phases = 24 points
  const bool every_point = pull() && std::string(GetParam().tls) == "sm,tcp,self";
  const int points = every_point ? 20 : 8;
  d.syncs = 2 * points + 1;
  for (int i = 0; i < points; ++i) d.kills.push_back({2 * i + 1, every_point ? i : 3 * i});
  d.timeout_ms = 30000;
  auto r = tools::run_demo(d);
  expect_ok(r, d.syncs);
  EXPECT_EQ(r.ucx_tls, GetParam().tls);
  for (const auto& row : r.rows) {
    const int expected = row.version % 2 == 1 && row.version < d.syncs ? 3 : 4;
    EXPECT_EQ(row.expected, expected) << "sync " << row.version;
  }
}

// Delta syncs (docs/delta.md) between processes: inference rank 1 SIGKILLed in sync 2 and
// restarted reads dense bytes at sync 3 (a new instance holds no base) while the others
// take patches, then patches again at sync 4; every sync verified bit for bit.
TEST_P(EngineMpFaultTest, DeltaConsumerKilledGetsDenseThenPatches) {
  auto d = spec_for("llama-3.1-8b.json", "tp=2", "tp=2,replicas=2");
  d.delta = true;
  d.delta_same_host = true;  // (one host: patches over shared memory too)
  d.changed_fraction = 0.01;
  d.syncs = 4;
  d.kills = {{2, 5}};
  d.timeout_ms = 30000;
  auto r = tools::run_demo(d);
  expect_ok(r, d.syncs);
  auto patch_bytes = [&](const tools::DemoSyncRow& row, const std::string& who) -> int64_t {
    auto it = row.results.find(who);
    if (it == row.results.end()) return -1;
    auto j = nlohmann::json::parse(it->second, nullptr, false);
    return j.is_object() ? j.value("patch_bytes", int64_t{-1}) : -1;
  };
  for (const auto& row : r.rows) {
    for (int c = 0; c < 4; ++c) {
      const std::string who = fmt::format("consumer{}", c);
      const int64_t pb = patch_bytes(row, who);
      if (row.version == 1) {
        EXPECT_EQ(pb, 0) << who << " sync 1: nothing kept yet";
      } else if (row.version == 3 && c == 1) {
        EXPECT_EQ(pb, 0) << "the restarted instance holds no base";
      } else if (row.version >= 3) {
        EXPECT_GT(pb, 0) << who << " sync " << row.version;
      }
    }
  }
}

// SIGKILL trainer rank 1 (tp=2,dp=2: rank 3 holds the same boxes) while it serves a sync,
// before each group it serves in turn (1, 2, 3 in syncs 2, 4, 6; group 0 is read from its
// replica; restarted for the next sync): the consumers fail over to the DP replica and
// the sync completes, every consumer verified bit for bit; the restarted rank rejoins at
// the next sync (full routes), verified.
TEST_P(EngineMpFaultTest, ProducerSigkillFailoverToDpReplica) {
  auto d = spec_for("llama-3.1-8b.json", "tp=2,dp=2", "tp=2,replicas=2");
  d.kill_role = "producer";
  d.kill_rank = 1;
  const int groups = 3;
  d.syncs = 2 * groups + 1;
  for (int g = 1; g <= groups; ++g) d.kills.push_back({2 * g, g});  // before it materialises group g
  d.timeout_ms = 30000;
  auto r = tools::run_demo(d);
  expect_ok(r, d.syncs);
  ASSERT_EQ(static_cast<int>(r.rows.size()), d.syncs);
  for (const auto& row : r.rows) {
    EXPECT_EQ(row.expected, 4) << "sync " << row.version;
    EXPECT_EQ(row.failed, 0) << "sync " << row.version;
    EXPECT_EQ(row.torn, 0) << "sync " << row.version;
    if (row.version % 2 == 0) {
      bool failover = false;
      for (const auto& f : row.failures) failover |= f.find("failover") != std::string::npos;
      EXPECT_TRUE(failover) << "sync " << row.version << " completed without a failover";
    } else if (row.version > 1) {
      EXPECT_GT(row.producer_bytes[1], 0u) << "the restarted producer serves again at sync " << row.version;
    }
  }
}

// SIGKILL trainer rank 1 of tp=2 (the only holder of its shards) during sync 2, before it
// materialises group 3 of 4: every consumer that needed it fails with an error naming it
// and reports torn state; the others' report is verified; with the rank restarted, sync 3
// recovers and verifies everywhere. (Rank 1 reaches group 3 only once every consumer
// released its group 1, so a consumer reading from it there has group 1 landed: torn.)
TEST_P(EngineMpFaultTest, ProducerSigkillOnlyHolderThenRecovers) {
  auto d = spec_for("llama-3.1-8b.json", "tp=2", "tp=2,replicas=2");
  d.kill_role = "producer";
  d.kill_rank = 1;
  d.kills = {{2, 3}};
  d.timeout_ms = 30000;
  auto r = tools::run_demo(d);
  ASSERT_EQ(r.rows.size(), 3u) << r.error;
  EXPECT_FALSE(r.all_verified) << "sync 2 cannot complete without producer 1";
  EXPECT_EQ(r.rows[0].verified, 4);
  const auto& bad = r.rows[1];
  EXPECT_EQ(bad.expected, 4);
  EXPECT_GT(bad.failed, 0);
  EXPECT_EQ(bad.failed + bad.verified, bad.expected);
  // Pull: a RELEASE proves the group was read. Push: a slot is free once PUSHED was sent,
  // and a SIGKILL may lose a message still queued, so only "some" is certain.
  if (pull()) {
    EXPECT_EQ(bad.torn, bad.failed);
  } else {
    EXPECT_GT(bad.torn, 0);
    EXPECT_LE(bad.torn, bad.failed);
  }
  ASSERT_EQ(bad.errors.size(), static_cast<size_t>(bad.failed)) << "one error per failed consumer";
  for (const auto& e : bad.errors) {
    EXPECT_NE(e.find("producer 1"), std::string::npos) << e;
    EXPECT_NE(e.find("no failover"), std::string::npos) << e;
  }
  EXPECT_EQ(r.rows[2].verified, 4) << r.error;
  EXPECT_EQ(r.rows[2].expected, 4);
  EXPECT_EQ(r.rows[2].torn, 0);
  if (!bad.errors.empty()) std::printf("sync 2: %s\n", bad.errors[0].c_str());
}

// What each shadow consumer's reader did during sync `row`: every one read the live params
// at least once (a reader that never read checks nothing) and no read saw a mix.
void expect_readers_read(const tools::DemoSyncRow& row, int consumers) {
  EXPECT_EQ(row.mixed_reads, 0u) << "sync " << row.version;
  for (int c = 0; c < consumers; ++c) {
    const auto it = row.results.find(fmt::format("consumer{}", c));
    ASSERT_NE(it, row.results.end()) << "sync " << row.version << ": no result of consumer " << c;
    const auto j = nlohmann::json::parse(it->second, nullptr, false);
    EXPECT_GT(j.value("reads", uint64_t{0}), 0u) << "sync " << row.version << " consumer " << c << ": " << it->second;
  }
}

// Producer 1, the only holder of its boxes, SIGKILLed mid-sync 2 of inference ranks under
// `commit` ("shadow" or "groups"), each with a reader thread checking every read of its
// live params during the syncs: every consumer fails sync 2, never torn, its live params
// bit for bit what the policy promises (the worker's live_verified), no read ever saw a
// mix, and sync 3 (producer restarted) commits everywhere. Pull and push.
void expect_producer_sigkill_keeps_the_promise(const char* commit) {
  for (const char* mode : {"pull", "push"}) {
    SCOPED_TRACE(mode);
    auto d = spec("llama-3.1-8b.json", "tp=2", "tp=2,replicas=2");
    d.mode = mode;
    d.commit = commit;
    d.kill_role = "producer";
    d.kill_rank = 1;
    d.kills = {{2, 3}};
    d.timeout_ms = 30000;
    auto r = tools::run_demo(d);
    ASSERT_EQ(r.rows.size(), 3u) << r.error;
    EXPECT_EQ(r.rows[0].verified, 4);
    const auto& bad = r.rows[1];
    EXPECT_GT(bad.failed, 0);
    EXPECT_EQ(bad.torn, 0) << "a failed sync under " << commit << " never tears";
    EXPECT_EQ(bad.live_verified, bad.failed) << "a failed consumer's live params are not what " << commit << " promises";
    EXPECT_EQ(r.rows[2].verified, 4) << r.error;
    for (const auto& row : r.rows) {
      EXPECT_EQ(row.mixed_reads, 0u) << "sync " << row.version;
      if (row.version > 1) expect_readers_read(row, 4);  // (sync 1: nothing committed to read)
    }
  }
}

// Atomic versions across processes (issue 27), shadow: every read is exactly the
// committed version; the failed sync leaves the live params bit for bit version 1.
TEST(EngineMpShadow, ProducerSigkillLeavesTheLiveVersionAndReadersSeeOneVersion) {
  expect_producer_sigkill_keeps_the_promise("shadow");
}

// The bounded shadow (CommitPolicy::kGroups): every layer group of each read is whole;
// the failed sync leaves the groups its report names (groups_live) at version 2 and every
// other group at 1, bit for bit.
TEST(EngineMpShadow, GroupsProducerSigkillLeavesTheGroupsItNamesNew) {
  expect_producer_sigkill_keeps_the_promise("groups");
}

// Issue 27 across processes, a checksum mismatch: trainer rank 0 flips a byte of group 1's
// staging in sync 2, after checksumming (checksums on). The consumers that read that
// segment fail sync 2 with kCorrupt naming producer 0 and group 1, their live params bit
// for bit version 1 (not torn); the others commit 2; every reader saw one version; sync 3
// commits everywhere. Pull and push.
TEST(EngineMpShadow, ChecksumMismatchLeavesTheLiveVersion) {
  for (const char* mode : {"pull", "push"}) {
    SCOPED_TRACE(mode);
    auto d = spec("llama-3.1-8b.json", "tp=2", "tp=2,replicas=2");
    d.mode = mode;
    d.commit = "shadow";
    d.checksums = true;
    d.corrupt_sync = 2;
    d.corrupt_group = 1;
    d.corrupt_rank = 0;
    d.timeout_ms = 30000;
    auto r = tools::run_demo(d);
    ASSERT_EQ(r.rows.size(), 3u) << r.error;
    EXPECT_EQ(r.rows[0].verified, 4);
    const auto& bad = r.rows[1];
    EXPECT_EQ(bad.expected, 4);
    EXPECT_GT(bad.failed, 0) << "no consumer caught the corrupt segment";
    EXPECT_LT(bad.failed, 4) << "the segment is one plan class's: the others' sync 2 commits";
    EXPECT_EQ(bad.verified + bad.failed, 4);
    EXPECT_EQ(bad.torn, 0) << "a failed sync under shadow never tears";
    EXPECT_EQ(bad.live_verified, bad.failed) << "every failed consumer still holds version 1, bit for bit";
    ASSERT_EQ(bad.errors.size(), static_cast<size_t>(bad.failed)) << "one error per failed consumer";
    for (const auto& e : bad.errors) {
      EXPECT_NE(e.find(": Corrupt: "), std::string::npos) << e;
      EXPECT_NE(e.find("producer 0"), std::string::npos) << e;
      EXPECT_NE(e.find("group 1"), std::string::npos) << e;
    }
    EXPECT_TRUE(bad.untrue.empty()) << bad.untrue.front();
    EXPECT_EQ(r.rows[2].verified, 4) << r.error;
    EXPECT_EQ(r.rows[2].failed, 0);
    for (const auto& row : r.rows) {
      EXPECT_EQ(row.torn, 0) << "sync " << row.version;
      if (row.version > 1) expect_readers_read(row, 4);  // (sync 1: nothing committed to read)
    }
  }
}

// Issue 27 across processes, the caller discarding: every consumer syncs version 2 with
// commit=false, then discard()s it while its reader goes on reading: the live params
// stay bit for bit version 1 (no read ever saw 2), state().received is empty after the
// discard, the producers' reports are ok; sync 3 commits everywhere. Pull and push.
TEST(EngineMpShadow, DiscardLeavesTheLiveVersion) {
  for (const char* mode : {"pull", "push"}) {
    SCOPED_TRACE(mode);
    auto d = spec("llama-3.1-8b.json", "tp=2", "tp=2,replicas=2");
    d.mode = mode;
    d.commit = "shadow";
    d.discard_sync = 2;
    d.timeout_ms = 30000;
    auto r = tools::run_demo(d);
    EXPECT_TRUE(r.all_verified) << r.error;
    ASSERT_EQ(r.rows.size(), 3u) << r.error;
    EXPECT_EQ(r.rows[0].verified, 4);
    const auto& disc = r.rows[1];
    EXPECT_EQ(disc.expected, 4);
    EXPECT_EQ(disc.failed, 0);
    EXPECT_EQ(disc.discarded, 4) << "every consumer received 2 (state().received) and discarded it (then none)";
    EXPECT_EQ(disc.live_verified, 4) << "every consumer's live params are still version 1, bit for bit";
    EXPECT_EQ(disc.verified, 0) << "no consumer's live params are version 2";
    EXPECT_EQ(disc.producers_ok, 2);
    EXPECT_TRUE(disc.untrue.empty()) << disc.untrue.front();
    EXPECT_EQ(r.rows[2].verified, 4) << r.error;
    EXPECT_EQ(r.rows[2].discarded, 0);
    for (const auto& row : r.rows) {
      EXPECT_EQ(row.torn, 0) << "sync " << row.version;
      if (row.version > 1) expect_readers_read(row, 4);
    }
  }
}

// Many consecutive syncs: every one verified, worker RSS flat, no leaked descriptors
// (registrations are per engine, so a leak would show as growth too). FERRY_SOAK_SYNCS
// sets the count (`make soak`: 200).
TEST(EngineMultiProcess, Soak) {
  auto d = spec("llama-3.1-8b.json", "tp=2,pp=2", "tp=2,replicas=2");
  d.syncs = 40;
  if (const char* n = std::getenv("FERRY_SOAK_SYNCS")) d.syncs = std::max(4, std::atoi(n));
  const auto t0 = std::chrono::steady_clock::now();
  auto r = tools::run_demo(d);
  expect_ok(r, d.syncs);
#if FERRY_TEST_ASAN
  // ASan's quarantine (256 MiB by default) keeps freed memory resident, so RSS is no
  // leak signal there; LeakSanitizer checks the workers for leaks instead.
  constexpr int64_t kMaxGrowthKib = 512 * 1024;
#else
  constexpr int64_t kMaxGrowthKib = 8 * 1024;
#endif
  EXPECT_LE(r.max_rss_growth_kib, kMaxGrowthKib) << "RSS grew by " << r.max_rss_growth_kib << " KiB";
  EXPECT_LE(r.max_fd_growth, 0) << "open descriptors grew by " << r.max_fd_growth;
  std::printf("soak: %d syncs in %.1f s, max RSS growth %lld KiB, max fd growth %lld\n", d.syncs,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              static_cast<long long>(r.max_rss_growth_kib), static_cast<long long>(r.max_fd_growth));
}

}  // namespace
}  // namespace ferry
