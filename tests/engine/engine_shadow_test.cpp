// Atomic versions (ConsumerOptions::commit = kShadow), ranks as threads: a reader thread
// per inference rank hashes its live params continuously while syncs stream in; it reads
// under a shared lock that the consumer's before_commit/after_commit hooks take
// exclusively (what a serving engine does), so every hash it sees must be the hash of a
// committed version, never a mix, and after each commit the next hash is the new
// version's. Also: sync(commit=false) then discard() leaves the live version; commit()
// with nothing received is refused; in place, sync(commit=false) is refused. Both ways a
// commit can go: a flip (the consumer owns the params) and a copy (the caller's).
#include <gtest/gtest.h>

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <set>
#include <shared_mutex>
#include <thread>

#include "engine/engine_test_util.h"
#include "engine/protocol.h"
#include "engine/testing.h"

namespace ferry::engine_tests {
namespace {

uint64_t hash_params(const TensorMap& params) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  for (const auto& [name, t] : params) {  // (ordered by name)
    auto data = t.data_ptr();
    if (!data.ok()) continue;
    XXH64_update(st, name.data(), name.size());
    XXH64_update(st, *data, static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

// What consumer c's lease in the store says its params hold: (committed, received).
std::pair<std::optional<uint64_t>, std::optional<uint64_t>> lease_versions(Cluster& k, int c) {
  auto blob = k.cst[0]->get(engine::JobKeys(k.eo.job).consumer(c));
  EXPECT_TRUE(blob.ok()) << blob.status().to_string();
  if (!blob.ok()) return {};
  auto lease = engine::decode_consumer_lease(*blob);
  EXPECT_TRUE(lease.ok()) << lease.status().to_string();
  if (!lease.ok()) return {};
  return {lease->committed, lease->received};
}

using Versions = std::pair<std::optional<uint64_t>, std::optional<uint64_t>>;
constexpr std::optional<uint64_t> kNone = std::nullopt;

// One lock per inference rank (of two): readers share it, the commit hooks take it (what a
// serving engine does), counting the commits.
struct CommitLocks {
  std::vector<std::unique_ptr<std::shared_mutex>> locks;
  std::vector<std::atomic<int>> commits = std::vector<std::atomic<int>>(2);
  explicit CommitLocks(Cluster& k) {
    for (int c = 0; c < 2; ++c) locks.push_back(std::make_unique<std::shared_mutex>());
    k.tweak_consumer = [this](ConsumerOptions& o, int c) {
      o.before_commit = [this, c](uint64_t) { locks[static_cast<size_t>(c)]->lock(); };
      o.after_commit = [this, c](uint64_t) {
        commits[static_cast<size_t>(c)]++;
        locks[static_cast<size_t>(c)]->unlock();
      };
    };
  }
  std::shared_mutex& operator[](int c) { return *locks[static_cast<size_t>(c)]; }
  // A reader thread per rank calling read(c) under the shared lock, over and over until
  // `stop` (bounded: at most a million reads each).
  std::vector<std::thread> read_until(const std::atomic<bool>& stop, std::function<void(int)> read) {
    std::vector<std::thread> readers;
    for (int c = 0; c < 2; ++c) {
      readers.emplace_back([this, &stop, read, c] {
        for (int n = 0; !stop && n < 1'000'000; ++n) {
          std::shared_lock<std::shared_mutex> lk((*this)[c]);
          read(c);
        }
      });
    }
    return readers;
  }
};

class EngineShadowTest : public ::testing::TestWithParam<bool> {};  // caller_params

TEST_P(EngineShadowTest, ReadersNeverSeeAMixOfVersions) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull, true});
  k.caller_params = GetParam();
  CommitLocks locks(k);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  // The hash of each committed version per rank, taken under the lock right after commit
  // (the reader's only legitimate values), and what the readers saw.
  std::vector<std::set<uint64_t>> committed(2);
  std::vector<std::vector<uint64_t>> seen(2);
  std::atomic<bool> stop{false};
  for (int c = 0; c < 2; ++c) {
    std::shared_lock<std::shared_mutex> lk(locks[c]);
    committed[static_cast<size_t>(c)].insert(hash_params(k.cons[static_cast<size_t>(c)]->params()));  // the zeros
  }
  std::vector<std::thread> readers = locks.read_until(
      stop, [&](int c) { seen[static_cast<size_t>(c)].push_back(hash_params(k.cons[static_cast<size_t>(c)]->params())); });
  for (uint64_t v = 1; v <= 4; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    for (int c = 0; c < 2; ++c) {
      const SyncReport& r = **o.c[static_cast<size_t>(c)];
      EXPECT_TRUE(r.committed);
      EXPECT_EQ(r.live_version, std::optional<uint64_t>(v));
      EXPECT_GT(r.memory.shadow, 0u);
      std::shared_lock<std::shared_mutex> lk(locks[c]);
      committed[static_cast<size_t>(c)].insert(hash_params(k.cons[static_cast<size_t>(c)]->params()));
    }
  }
  stop = true;
  for (auto& t : readers) t.join();
  for (int c = 0; c < 2; ++c) {
    EXPECT_EQ(locks.commits[static_cast<size_t>(c)].load(), 4);
    EXPECT_EQ(committed[static_cast<size_t>(c)].size(), 5u);  // zeros + 4 distinct versions
    ASSERT_FALSE(seen[static_cast<size_t>(c)].empty());
    size_t mixed = 0;
    for (uint64_t h : seen[static_cast<size_t>(c)]) mixed += !committed[static_cast<size_t>(c)].count(h);
    EXPECT_EQ(mixed, 0u) << "consumer " << c << ": " << mixed << " of " << seen[static_cast<size_t>(c)].size()
                         << " reads saw a mix of versions";
  }
}

TEST_P(EngineShadowTest, ReceivedThenDiscardedLeavesTheLiveVersion) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull, true});
  k.caller_params = GetParam();
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  for (auto& c : k.cons) EXPECT_EQ(c->commit().status().code(), StatusCode::kFailedPrecondition);
  // Version 2 received, not committed: live params stay 1; discarded.
  auto o = k.sync(2, false);
  auto& pr = o.p;
  auto& cr = o.c;
  for (size_t c = 0; c < k.cons.size(); ++c) {
    ASSERT_TRUE(cr[c]->ok()) << cr[c]->status().to_string();
    EXPECT_FALSE((**cr[c]).committed);
    EXPECT_EQ((**cr[c]).live_version, std::optional<uint64_t>(1));
    EXPECT_EQ(k.cons[c]->state().received, std::optional<uint64_t>(2));
    k.expect_verified(static_cast<int>(c), 1);
    // The lease says so: producers and the store see which version it serves.
    EXPECT_EQ(lease_versions(k, static_cast<int>(c)), Versions(1, 2));
    ASSERT_TRUE(k.cons[c]->discard().ok());
    EXPECT_FALSE(k.cons[c]->state().received.has_value());
    EXPECT_EQ(lease_versions(k, static_cast<int>(c)), Versions(1, kNone));
    k.expect_verified(static_cast<int>(c), 1);
  }
  for (auto& p : pr) {
    EXPECT_TRUE(p->ok()) << p->status().to_string();
    // As sync 2 began every consumer served version 1.
    std::map<int, uint64_t> all_one;
    for (size_t c = 0; c < k.cons.size(); ++c) all_one[static_cast<int>(c)] = 1;
    EXPECT_EQ((**p).consumers_live, all_one);
  }
  // Version 3 received, then committed by hand.
  o = k.sync(3, false);
  for (size_t c = 0; c < k.cons.size(); ++c) {
    ASSERT_TRUE(cr[c]->ok()) << cr[c]->status().to_string();
    k.expect_verified(static_cast<int>(c), 1);
    EXPECT_EQ(lease_versions(k, static_cast<int>(c)), Versions(1, 3));
    auto secs = k.cons[c]->commit();
    ASSERT_TRUE(secs.ok()) << secs.status().to_string();
    EXPECT_GE(*secs, 0.0);
    k.expect_verified(static_cast<int>(c), 3);
    EXPECT_EQ(lease_versions(k, static_cast<int>(c)), Versions(3, kNone));
  }
  auto committed = committed_versions(*k.cst[0], k.eo.job, static_cast<int>(k.cons.size()));
  ASSERT_TRUE(committed.ok());
  for (const auto& v : *committed) EXPECT_EQ(v, std::optional<uint64_t>(3));
  // Received and not committed, then a new sync: the dropped version leaves the lease.
  o = k.sync(5, false);
  for (size_t c = 0; c < k.cons.size(); ++c) EXPECT_EQ(lease_versions(k, static_cast<int>(c)), Versions(3, 5));
  auto six = k.sync(6);  // the received 5 is dropped as it starts
  k.expect_all_ok(six, 6);
  for (size_t c = 0; c < k.cons.size(); ++c) EXPECT_EQ(lease_versions(k, static_cast<int>(c)), Versions(6, kNone));
  for (auto& p : six.p) EXPECT_EQ((**p).consumers_live.size(), k.cons.size());
}

INSTANTIATE_TEST_SUITE_P(Commit, EngineShadowTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "copy" : "flip"; });

// The bounded shadow (CommitPolicy::kGroups): readers hash every layer group of the live
// params under the lock the commit hooks take; each hash must be that group's hash at a
// committed version (the groups may differ in version from each other during a sync, by
// design, but never a group half written). The shadow holds far less than the params.
uint64_t hash_of(const TensorMap& params, const std::vector<std::string>& names) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  for (const std::string& name : names) {
    auto it = params.find(name);
    if (it == params.end()) continue;
    auto data = it->second.data_ptr();
    if (!data.ok()) continue;
    XXH64_update(st, *data, static_cast<size_t>(it->second.numel()) * dtype_size(it->second.dtype()));
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

class EngineGroupsTest : public ::testing::TestWithParam<bool> {};  // caller_params

TEST_P(EngineGroupsTest, ReadersSeeEveryLayerGroupWhole) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull, false, false, true});
  k.caller_params = GetParam();
  CommitLocks locks(k);
  // A vocabulary the loader pads (to a multiple of 64): rows no sync writes, which the
  // bounded shadow must carry over from the live params whatever its room held before.
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2", R"({"vocab_size": 1000})").ok());
  // Each consumer's layer groups (the loader's post-processing groups) and their params.
  std::vector<std::vector<std::pair<std::string, std::vector<std::string>>>> units(2);
  uint64_t param_bytes = 0, largest_unit = 0;
  for (int c = 0; c < 2; ++c) {
    auto rl = k.model.loader->rank(c);
    ASSERT_TRUE(rl.ok());
    for (const auto& g : (*rl)->groups()) units[static_cast<size_t>(c)].push_back({g.name, {}});
    std::vector<uint64_t> unit_bytes((*rl)->groups().size());
    for (const ParamInfo& p : (*rl)->params()) {
      units[static_cast<size_t>(c)][static_cast<size_t>(p.group)].second.push_back(p.decl.name);
      const uint64_t b = shape_numel(p.decl.shape) * dtype_size(p.decl.dtype);
      unit_bytes[static_cast<size_t>(p.group)] += b;
      if (c == 0) param_bytes += b;
    }
    largest_unit = *std::max_element(unit_bytes.begin(), unit_bytes.end());
  }
  auto hashes = [&](int c) {
    std::vector<uint64_t> out;
    for (const auto& [name, params] : units[static_cast<size_t>(c)])
      out.push_back(hash_of(k.cons[static_cast<size_t>(c)]->params(), params));
    return out;
  };
  // Per consumer, per group: the hashes of committed versions (taken under the lock
  // after each sync), and every read the readers made.
  std::vector<std::vector<std::set<uint64_t>>> committed(2);
  std::vector<std::vector<std::vector<uint64_t>>> seen(2);
  auto note_committed = [&](int c) {
    std::shared_lock<std::shared_mutex> lk(locks[c]);
    const auto h = hashes(c);
    committed[static_cast<size_t>(c)].resize(h.size());
    for (size_t u = 0; u < h.size(); ++u) committed[static_cast<size_t>(c)][u].insert(h[u]);
  };
  for (int c = 0; c < 2; ++c) note_committed(c);  // the zeros
  std::atomic<bool> stop{false};
  std::vector<std::thread> readers =
      locks.read_until(stop, [&](int c) { seen[static_cast<size_t>(c)].push_back(hashes(c)); });
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    for (int c = 0; c < 2; ++c) {
      const SyncReport& r = **o.c[static_cast<size_t>(c)];
      EXPECT_TRUE(r.committed);
      EXPECT_EQ(r.live_version, std::optional<uint64_t>(v));
      EXPECT_EQ(r.groups_live.size(), units[static_cast<size_t>(c)].size());  // every group, once
      EXPECT_GT(r.commit_seconds, 0.0);
      EXPECT_EQ(r.received_into_params, 0u);  // every byte through the ring and the shadow
      // Bounded: at least the largest group, far less than the params.
      EXPECT_GE(r.memory.shadow, largest_unit);
      EXPECT_LT(r.memory.shadow, param_bytes / 2);
      EXPECT_FALSE(k.cons[static_cast<size_t>(c)]->state().mixed);
      note_committed(c);
    }
  }
  stop = true;
  for (auto& t : readers) t.join();
  for (int c = 0; c < 2; ++c) {
    // One commit per layer group per sync (a group's params go live together).
    EXPECT_EQ(locks.commits[static_cast<size_t>(c)].load(), 3 * static_cast<int>(units[static_cast<size_t>(c)].size()));
    ASSERT_FALSE(seen[static_cast<size_t>(c)].empty());
    size_t torn_groups = 0;
    for (const auto& read : seen[static_cast<size_t>(c)]) {
      for (size_t u = 0; u < read.size(); ++u) torn_groups += !committed[static_cast<size_t>(c)][u].count(read[u]);
    }
    EXPECT_EQ(torn_groups, 0u) << "consumer " << c << ": " << torn_groups << " group reads saw a group half written";
  }
}

// A sync that fails after some layer groups went live: those (the report's groups_live)
// hold the new version whole, the rest the old; `mixed`, never torn; the next sync, once
// the producer is back, makes every group live again.
TEST_P(EngineGroupsTest, FailedSyncLeavesTheGroupsItNamesNewAndTheRestOld) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull, false, false, true});
  k.caller_params = GetParam();
  std::atomic<bool> armed{false};
  std::atomic<unsigned> live{0};  // bit c: consumer c made layer group 1 of sync 2 live
  k.tweak_consumer = [&](ConsumerOptions& co, int c) {
    co.after_group = [&, c](uint64_t v, int g) {
      if (armed && v == 2 && g == 1) live |= 1u << c;
    };
  };
  k.tweak_producer = [&](ProducerOptions& o, int p) {
    if (p != 1) return;
    engine::TestHooks hooks;
    hooks.before_materialize = [&](uint64_t v, int g) {
      if (v != 2 || g != 2) return;  // (the test's model: pre, layer 0, post)
      for (int i = 0; i < 2000 && live.load() != 3u; ++i) std::this_thread::sleep_for(5ms);  // bounded
      k.ptr[1]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  armed = true;
  auto o = k.sync(2);
  armed = false;
  EXPECT_EQ(live.load(), 3u);
  for (size_t c = 0; c < o.c.size(); ++c) {
    ASSERT_FALSE(o.c[c]->ok());
    EXPECT_EQ(o.c[c]->status().code(), StatusCode::kPeerFailed) << o.c[c]->status().to_string();
    const SyncReport& r = k.cons[c]->last_report();
    EXPECT_FALSE(r.committed);
    EXPECT_EQ(r.live_version, std::optional<uint64_t>(1));
    // The loader's first two groups (the embedding, layer 0) at least, in that order.
    auto rl = k.model.loader->rank(static_cast<int>(c));
    ASSERT_TRUE(rl.ok());
    ASSERT_GE(r.groups_live.size(), 2u);
    EXPECT_EQ(r.groups_live[0], (*rl)->groups()[0].name);
    EXPECT_EQ(r.groups_live[1], (*rl)->groups()[1].name);
    EXPECT_TRUE(k.cons[c]->state().mixed);
    k.expect_groups_live(static_cast<int>(c), 1, 2);
  }
  // The store says so too: a framework asking which version its engines serve learns
  // they are mixed, not that they serve 1.
  auto states = committed_states(*k.cst[0], k.eo.job, static_cast<int>(k.cons.size()));
  ASSERT_TRUE(states.ok()) << states.status().to_string();
  for (const CommittedState& st : *states) {
    EXPECT_EQ(st.version, std::optional<uint64_t>(1));
    EXPECT_TRUE(st.mixed);
    EXPECT_FALSE(st.torn);
    EXPECT_EQ(st.newer, std::optional<uint64_t>(2));
    EXPECT_EQ(st.to_string(), "1 (mixed with 2)");
  }
  auto versions = committed_versions(*k.cst[0], k.eo.job, static_cast<int>(k.cons.size()));
  ASSERT_TRUE(versions.ok());
  for (const auto& v : *versions) EXPECT_EQ(v, std::optional<uint64_t>(1));
  k.tweak_producer = nullptr;
  ASSERT_TRUE(k.start_producer(1).ok());
  k.expect_all_ok(k.sync(3), 3);
  for (auto& c : k.cons) EXPECT_FALSE(c->state().mixed);
  states = committed_states(*k.cst[0], k.eo.job, static_cast<int>(k.cons.size()));
  ASSERT_TRUE(states.ok());
  for (const CommittedState& st : *states) {
    EXPECT_TRUE(st.whole());
    EXPECT_EQ(st.version, std::optional<uint64_t>(3));
    EXPECT_EQ(st.to_string(), "3");
  }
}

// FP8 through the engine under every commit policy, quantised on either side
// (EngineOptions::quantize_on). On the consumer the loader quantises each linear weight
// into 128x128 FP8 tiles and a scale tensor after loading (a param of another dtype, and
// a name of its own: under groups, taken at the sync's end the first time, copied into at
// every later one). On the producers (matching TP: every tile on one trainer rank) the
// e4m3 values and scales cross the wire and land as they are: each consumer receives
// exactly the bytes it keeps. Every rank's final params bit for bit as a direct load
// makes them, three versions.
class EngineFp8Test : public ::testing::TestWithParam<std::tuple<CommitPolicy, QuantizeOn>> {};

TEST_P(EngineFp8Test, QuantisedAfterLoadingBitForBitUnderEveryCommitPolicy) {
  const auto [policy, on] = GetParam();
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull, policy == CommitPolicy::kShadow, false,
                       policy == CommitPolicy::kGroups});
  k.loader_options.quantize = Quantize::kFp8;
  k.eo.quantize_on = on;
  k.tweak_consumer = [](ConsumerOptions& co, int) {
    co.direct_min_bytes = 0;
    co.checksums = true;
  };
  k.tweak_producer = [](ProducerOptions& po, int) { po.checksums = true; };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  auto rl = k.model.loader->rank(0);
  ASSERT_TRUE(rl.ok());
  size_t fp8 = 0;
  for (const TensorDecl& d : (*rl)->final_params()) fp8 += d.dtype == DType::kF8E4M3;
  ASSERT_GT(fp8, 0u) << "the loader quantises nothing";
  uint64_t kept = 0, dense = 0;
  for (const TensorDecl& d : (*rl)->final_params()) kept += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  for (const ParamInfo& p : (*rl)->params()) dense += static_cast<uint64_t>(shape_numel(p.decl.shape)) * dtype_size(p.decl.dtype);
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    for (size_t c = 0; c < k.cons.size(); ++c) {
      size_t held = 0;
      for (const auto& [name, t] : k.cons[c]->params()) held += t.dtype() == DType::kF8E4M3;
      EXPECT_EQ(held, fp8);
      const SyncReport& r = **o.c[c];
      if (on == QuantizeOn::kProducer) {
        EXPECT_EQ(r.bytes_received, kept) << "consumer " << c << ": what it keeps, no more";
        if (policy != CommitPolicy::kGroups) {
          EXPECT_GT(r.received_into_params, 0u) << "consumer " << c;
        }
      } else {
        EXPECT_EQ(r.bytes_received, dense) << "consumer " << c << ": the bf16 it quantises";
      }
    }
    uint64_t quantized = 0;
    for (auto& p : o.p) quantized += (**p).quantized_bytes;
    if (on == QuantizeOn::kProducer) {
      EXPECT_GT(quantized, 0u);
    } else {
      EXPECT_EQ(quantized, 0u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Commit, EngineFp8Test,
                         ::testing::Combine(::testing::Values(CommitPolicy::kInPlace, CommitPolicy::kShadow,
                                                              CommitPolicy::kGroups),
                                            ::testing::Values(QuantizeOn::kProducer, QuantizeOn::kConsumer)),
                         [](const auto& i) {
                           return fmt::format("{}_{}", commit_policy_name(std::get<0>(i.param)),
                                              quantize_on_name(std::get<1>(i.param)));
                         });

INSTANTIATE_TEST_SUITE_P(Commit, EngineGroupsTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "callers" : "own"; });

TEST(EngineInPlaceCommit, SyncWithoutCommitNeedsTheShadowPolicy) {
  Cluster k;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1").ok());
  auto r = k.cons[0]->sync(1, false);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  EXPECT_EQ(k.cons[0]->commit().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(k.cons[0]->discard().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ferry::engine_tests
