// Ranks-as-threads tests of the engine: in-process TCP store server, real model
// loaders, synthetic trainer data; every consumer verified bit for bit against a direct
// load of the same version. One suite, instantiated per transport (inproc; UCX over
// sm,tcp,self, every rank its own Transport in this process) and per mode (pull, push,
// pull with the trainer's weights served in place); tests of what only one transport
// has (inproc's failure injection) are instantiated for that transport only.
//
// This file: the parameterised suites' instantiations (every suite's tests, wherever they
// live, run under these) and the syncs every transport and mode runs: dense and MoE
// models, hooks and staging budget, checksums, zero copy into params, producers serving
// in place. Beside it: engine_failure_test.cpp (inproc's failure injection),
// engine_user_plan_test.cpp (consumers from hand-written plans),
// engine_coordination_test.cpp (creation, world sizes, versions, reports, leases, the
// store) and engine_device_test.cpp (weights in GPU memory); engine_test_util.h holds
// what they share.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "engine/engine_test_util.h"
#include "engine/group_order.h"
#include "engine/testing.h"

namespace ferry::engine_tests {
namespace {

// --- suites ----------------------------------------------------------------------------

// Every suite instantiated here, in one place (fixtures in engine_test_util.h); their tests
// register from each source in the order CMakeLists.txt lists them, which keeps the order
// of the test list.
// The two broad suites over covering sets of the feature matrix (feature_matrix.h,
// issue 43), not products: every pair of values of transport, mode, in-place serving,
// commit policy (in place; shadow: a failed sync never tears; groups: each layer group
// made live whole), group order (layer; rotated: cohorts reading the PP stages' groups in
// turn, producers serving them in paced waves) and relay appears in at least one case.
// EngineInprocTest: inproc only (its failure injection). EngineMatrixTest
// (engine_matrix_test.cpp) covers the pairs of all ten features.
INSTANTIATE_TEST_SUITE_P(Cover, EngineTest, ::testing::ValuesIn(covering_cases(plain())), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cover, EngineInprocTest, ::testing::ValuesIn(covering_cases(plain({{"backend", {"inproc"}}}))),
                         case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineZeroCopyTest,
                         cases(kAllBackends, {Mode::kPull, Mode::kInPlace, Mode::kPush, Mode::kPushInPlace}), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EnginePushZeroCopyTest, cases({Backend::kInproc}, {Mode::kPush, Mode::kPushInPlace}),
                         case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineInPlaceTest, cases(kAllBackends, {Mode::kInPlace}), case_name_of);

TEST_P(EngineTest, DenseGqaTwoReplicas) {
  Cluster k(GetParam());
  { auto st_ = k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=2,replicas=2"); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  const Routes& routes = k.prod[0]->routes();
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    uint64_t got = 0, served = 0, in_place = 0, relayed = 0;
    for (auto& c : o.c) {
      got += (**c).bytes_received;
      relayed += (**c).received_via_relay;  // (relay: copied from a replica on this host, not sent)
    }
    for (auto& p : o.p) {
      served += (**p).bytes_sent;
      in_place += (**p).sent_in_place;
      EXPECT_GT((**p).bytes_sent, 0u) << "every TP shard holder serves its own shard";
    }
    EXPECT_EQ(got, routes.stats.bytes_moved);
    EXPECT_EQ(served + relayed, got);
    EXPECT_EQ(got, routes.stats.bytes_min) << "exactly the bytes each consumer keeps";
    if (k.relay) {
      // (Under the rotated order too: replicas relaying on one host share a cohort.)
      EXPECT_EQ(2 * relayed, got) << "one replica of each rank copies everything from the other";
    }
    if (k.relay || k.groups) {
      // Relay: the members copy from the relay's receive ring; groups: each group lands in
      // the shadow of the groups in flight. Either way nothing lands in params directly.
      for (auto& c : o.c) EXPECT_EQ((**c).received_into_params, 0u) << "every byte passes the ring";
      continue;
    }
    // Zero copy: most bytes are read (pull) or written (push) straight into the params;
    // what is left (small pieces) went through the receive ring and was unpacked, and
    // the params verified.
    for (auto& c : o.c) {
      EXPECT_GT((**c).received_into_params, 0u);
      EXPECT_LT((**c).received_into_params, (**c).bytes_received);
    }
    // In place: producers serve most bytes from the trainer's memory, small pieces (the
    // norms, under direct_min_bytes) from staging.
    if (is_in_place(mode())) {
      EXPECT_GT(in_place, 0u);
      EXPECT_LT(in_place, served);
    } else {
      EXPECT_EQ(in_place, 0u);
    }
  }
  // Every participant built the same routes.
  for (auto& c : k.cons) EXPECT_EQ(c->routes().fingerprint(), routes.fingerprint());
  for (auto& p : k.prod) EXPECT_EQ(p->routes().fingerprint(), routes.fingerprint());
}

// Zero copy into params, whatever the threshold: every piece (0), the default, or none
// (everything through the receive ring); params allocated by the consumer or by the
// caller (registered one by one); with checksums, which then cover bytes that landed in
// params. Pull reads them there; push writes them there (from staging, or in place from
// the trainer's memory: neither side stages them). Every consumer verified bit for bit,
// every sync.
TEST_P(EngineZeroCopyTest, ReadsIntoParams) {
  struct Case {
    uint64_t min_bytes;
    bool caller_params;
  };
  for (Case t : {Case{0, false}, Case{0, true}, Case{4096, true}, Case{64 * 1024, false}, Case{UINT64_MAX, false}}) {
    SCOPED_TRACE(fmt::format("direct_min_bytes {} caller_params {}", t.min_bytes, t.caller_params));
    Cluster k(GetParam());
    k.caller_params = t.caller_params;
    k.tweak_consumer = [&](ConsumerOptions& co, int) {
      co.direct_min_bytes = t.min_bytes;
      co.checksums = true;
    };
    k.tweak_producer = [&](ProducerOptions& po, int) { po.checksums = true; };
    { auto st_ = k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=2,replicas=2"); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
    for (uint64_t v = 1; v <= 2; ++v) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      uint64_t in_place = 0, served = 0;
      for (auto& p : o.p) {
        in_place += (**p).sent_in_place;
        served += (**p).bytes_sent;
      }
      if (is_in_place(mode())) {
        EXPECT_GT(in_place, 0u) << "producers serve from the trainer's memory";
      } else {
        EXPECT_EQ(in_place, 0u);
      }
      EXPECT_LE(in_place, served);
      for (auto& c : o.c) {
        if (t.min_bytes == UINT64_MAX) {
          EXPECT_EQ((**c).received_into_params, 0u);
        } else if (t.min_bytes == 0) {
          // Llama has no dtype conversion and no shared source bytes: all of it.
          EXPECT_EQ((**c).received_into_params, (**c).bytes_received);
        } else {
          EXPECT_GT((**c).received_into_params, 0u);
        }
      }
    }
  }
}

// Issue 29: a trainer holding fp32 master weights, inference ranks keeping bf16. The
// producers convert as they pack, so each consumer receives exactly the bytes it keeps
// (half of what converting on the consumer moves), all of it straight into its params,
// nothing served from the trainer's memory in place (a converted piece is packed), and
// every param bit for bit what a direct load of the fp32 checkpoint gives.
TEST_P(EngineZeroCopyTest, Fp32TrainerIntoBf16ParamsSendsWhatTheyKeep) {
  for (ConvertOn where : {ConvertOn::kProducer, ConvertOn::kConsumer}) {
    SCOPED_TRACE(convert_on_name(where));
    Cluster k(GetParam());
    k.eo.convert_on = where;
    k.tweak_consumer = [&](ConsumerOptions& co, int) {
      co.direct_min_bytes = 0;
      co.checksums = true;
    };
    k.tweak_producer = [&](ProducerOptions& po, int) { po.checksums = true; };
    { auto st_ = k.start(cfg("llama-3.1-8b.json"), "tp=2,dtype=fp32", "tp=2"); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
    for (uint64_t v = 1; v <= 2; ++v) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      for (int c = 0; c < k.C(); ++c) {
        const SyncReport& r = **o.c[static_cast<size_t>(c)];
        auto rl = k.model.loader->rank(c);
        ASSERT_TRUE(rl.ok());
        uint64_t kept = 0;
        for (const ParamInfo& p : (*rl)->params()) kept += static_cast<uint64_t>(shape_numel(p.decl.shape)) * 2;
        if (where == ConvertOn::kProducer) {
          EXPECT_EQ(r.bytes_received, kept) << "consumer " << c;
          EXPECT_EQ(r.received_into_params, r.bytes_received) << "consumer " << c;
        } else {
          EXPECT_EQ(r.bytes_received, 2 * kept) << "consumer " << c;
          EXPECT_EQ(r.received_into_params, 0u) << "consumer " << c << ": fp32 bytes are converted as they unpack";
        }
      }
      if (where == ConvertOn::kProducer) {
        for (auto& p : o.p) EXPECT_EQ((**p).sent_in_place, 0u) << "converted pieces are packed";
      }
    }
  }
}

TEST_P(EngineTest, MoeWithExpertParallelism) {
  Cluster k(GetParam());
  Status s = k.start(cfg("qwen3-30b-a3b.json"), "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2");
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (uint64_t v = 1; v <= 2; ++v) k.expect_all_ok(k.sync(v), v);
}

TEST_P(EngineTest, HooksAndSmallStagingBudget) {
  std::atomic<int> before{0}, after{0}, groups{0};
  {
    // Budget 1 byte is refused (smaller than a group): check the error, then use a
    // budget of one slot.
    Cluster k(GetParam());
    k.eo.rendezvous_timeout = 2s;
    k.tweak_producer = [](ProducerOptions& o, int) { o.staging_budget = 1; };
    Status s = k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2");
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("staging budget"), std::string::npos) << s.to_string();
  }
  Cluster k2(GetParam());
  k2.tweak_producer = [](ProducerOptions& o, int) { o.staging_budget = 64ull << 20; };
  k2.tweak_consumer = [&](ConsumerOptions& o, int) {
    o.before_sync = [&](uint64_t) { ++before; };
    o.after_group = [&](uint64_t, int) { ++groups; };
    o.after_sync = [&](uint64_t) { ++after; };
  };
  ASSERT_TRUE(k2.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k2.expect_all_ok(k2.sync(5), 5);
  EXPECT_EQ(before.load(), 2);
  EXPECT_EQ(after.load(), 2);
  EXPECT_EQ(groups.load(), 2 * k2.prod[0]->routes().num_groups());
}

TEST_P(EngineTest, ChecksumDetectsCorruptSegment) {
  Cluster k(GetParam());
  k.eo.checksums = true;
  k.tweak_producer = [](ProducerOptions& o, int p) {
    if (p == 0) {
      engine::TestHooks hooks;
      hooks.corrupt_group = 1;
      hooks.corrupt_version = 2;
      o.test_hooks = engine::make_test_hooks(std::move(hooks));
    }
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  auto o = k.sync(2);
  int corrupt = 0;
  for (size_t c = 0; c < o.c.size(); ++c) {
    if (!o.c[c]->ok()) {
      EXPECT_EQ(o.c[c]->status().code(), StatusCode::kCorrupt) << o.c[c]->status().to_string();
      EXPECT_NE(o.c[c]->status().message().find("producer 0"), std::string::npos);
      // In place the failed sync tore the params; under shadow the live params are still
      // version 1, bit for bit, and the report says so; under groups each layer group is
      // whole, version 2 where the report says it went live, else 1.
      EXPECT_EQ(k.cons[c]->state().torn, !k.shadow && !k.groups);
      EXPECT_EQ(k.cons[c]->last_report().live_version, std::optional<uint64_t>(1));
      if (k.shadow) k.expect_verified(static_cast<int>(c), 1);
      if (k.groups) k.expect_groups_live(static_cast<int>(c), 1, 2);
      EXPECT_EQ(k.cons[c]->state().version, 1u);
      ++corrupt;
    }
  }
  EXPECT_GT(corrupt, 0);
  for (auto& p : o.p) EXPECT_TRUE(p->ok());
  k.expect_all_ok(k.sync(3), 3);
}

// Producers serve from the trainer's memory in place (ProducerOptions::source_regions):
// pieces that are contiguous runs of a box are neither packed nor staged; consumers read
// them from the source region, into params or the ring. Every consumer verified bit for
// bit, with checksums (which then cover in-place bytes), at thresholds from every piece
// to none; in push too (the producer writes them from the source region, into params or
// the receive ring).
TEST_P(EngineInPlaceTest, ServesWithoutStaging) {
  struct Case {
    uint64_t min_bytes;
    SyncMode mode;
    uint64_t consumer_min;
  };
  for (Case t : {Case{0, SyncMode::kPull, 0}, Case{4096, SyncMode::kPull, 64 * 1024},
                 Case{0, SyncMode::kPull, UINT64_MAX}, Case{UINT64_MAX, SyncMode::kPull, 0},
                 Case{0, SyncMode::kPush, 0}, Case{0, SyncMode::kPush, UINT64_MAX}}) {
    SCOPED_TRACE(fmt::format("producer min {} mode {} consumer min {}", t.min_bytes, sync_mode_name(t.mode),
                             t.consumer_min));
    Cluster k(GetParam());
    k.in_place = true;
    k.eo.mode = t.mode;
    k.eo.checksums = true;
    k.tweak_producer = [&](ProducerOptions& po, int) { po.direct_min_bytes = t.min_bytes; };
    k.tweak_consumer = [&](ConsumerOptions& co, int) { co.direct_min_bytes = t.consumer_min; };
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=4").ok());
    for (uint64_t v = 1; v <= 3; ++v) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      uint64_t served = 0, in_place = 0;
      for (auto& p : o.p) {
        served += (**p).bytes_sent;
        in_place += (**p).sent_in_place;
      }
      if (t.min_bytes == UINT64_MAX) {
        EXPECT_EQ(in_place, 0u);
      } else {
        EXPECT_GT(in_place, 0u);
        EXPECT_LT(in_place, served) << "tp=2 -> tp=4: row-parallel pieces are strided in the trainer's box";
      }
    }
  }
}

// The order layer groups move in (EngineOptions::group_order) on a trainer with two PP
// stages, one lane each: in layer order every consumer receives all of stage 0's groups
// before any of stage 1's; rotated, the two cohorts start at different stages, so both
// stages' producers send from the first step to the last, at the same time (the
// consumers' per-transfer timing, from their traces). Every consumer verified.
TEST_P(EngineInprocTest, RotatedOrderStagesSendTogether) {
  Cluster k(GetParam());
  { auto st_ = k.start(cfg("llama-3.1-8b.json"), "tp=1,pp=2", "tp=2,replicas=2"); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  const Routes& routes = k.prod[0]->routes();
  const engine::GroupOrder order = engine::make_group_order(routes, {GroupOrderKind::kRotated, true});
  ASSERT_EQ(order.num_lanes(), 2) << "one lane per PP stage";
  std::vector<double> shares;  // per sync: the share of it during which both stages send
  for (uint64_t v = 1; v <= 5; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    // Per stage: the union of every consumer's receive spans, on one clock.
    struct Span {
      int64_t t0, t1;
    };
    std::vector<std::vector<Span>> spans(2);
    int first_from[2] = {0, 0};  // consumers whose first transfer came from each stage
    for (auto& c : o.c) {
      const SyncReport& rep = **c;
      int64_t first = INT64_MAX;
      int first_lane = -1;
      for (const TraceEvent& e : rep.trace) {
        // (Relay: a member's copies come from a consumer on its host, not from a stage.)
        if (e.phase != TracePhase::kReceive || e.peer < 0 || !e.counted || e.lane == TraceLane::kRelay) continue;
        const int lane = order.lane_of_producer[static_cast<size_t>(e.peer)];
        ASSERT_GE(lane, 0);
        spans[static_cast<size_t>(lane)].push_back({rep.start_unix_ns + e.t0_ns, rep.start_unix_ns + e.t1_ns});
        if (e.t0_ns < first) {
          first = e.t0_ns;
          first_lane = lane;
        }
      }
      if (first_lane < 0 && k.relay && rep.received_via_relay == rep.bytes_received) continue;  // a member
      ASSERT_GE(first_lane, 0);
      ++first_from[first_lane];
    }
    // Time during which both stages send, against the whole sync's.
    auto covered = [](std::vector<Span> s) {
      std::sort(s.begin(), s.end(), [](const Span& a, const Span& b) { return a.t0 < b.t0; });
      std::vector<Span> out;
      for (const Span& x : s) {
        if (!out.empty() && x.t0 <= out.back().t1) {
          out.back().t1 = std::max(out.back().t1, x.t1);
        } else {
          out.push_back(x);
        }
      }
      return out;
    };
    const auto a = covered(spans[0]), b = covered(spans[1]);
    ASSERT_FALSE(a.empty());
    ASSERT_FALSE(b.empty());
    int64_t both = 0;
    for (const Span& x : a)
      for (const Span& y : b) both += std::max<int64_t>(0, std::min(x.t1, y.t1) - std::max(x.t0, y.t0));
    const int64_t whole = std::max(a.back().t1, b.back().t1) - std::min(a.front().t0, b.front().t0);
    const double together = static_cast<double>(both) / static_cast<double>(std::max<int64_t>(whole, 1));
    SCOPED_TRACE(fmt::format("sync {}: both stages send {:.0f}% of the sync; first transfers from stage 0: {}, "
                             "stage 1: {}", v, 100 * together, first_from[0], first_from[1]));
    shares.push_back(together);
    if (k.rotated) {
      EXPECT_GT(first_from[0], 0);
      EXPECT_GT(first_from[1], 0) << "a cohort starts at stage 1";
    } else {
      EXPECT_EQ(first_from[1], 0) << "layer order starts at stage 0 everywhere";
    }
  }
  // How long both stages send at once is timing, which no pass/fail may depend on (a
  // shared box, syncs of ~15 ms; measured medians of five: layer 0-13%, rotated 30-79%):
  // printed here, measured where it means something (docs/RESULTS.md, emulated hosts at
  // 1 Gbit/s). The order itself is checked above.
  std::sort(shares.begin(), shares.end());
  const double median = shares[shares.size() / 2];
  std::printf("both stages send during %.0f%% of the sync (median of %zu syncs, %s order)\n", 100 * median,
              shares.size(), k.rotated ? "rotated" : "layer");
}

// A source that breaks its in-place promise (a box at another address) fails the sync
// with an error naming the tensor, and the consumers do not commit.
TEST_P(EngineInPlaceTest, BoxThatMovedFailsTheSync) {
  Cluster k(GetParam());
  k.eo.timeout = 3s;
  k.eo.stall_timeout = 3s;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  k.in_place_src[0]->move_box = true;
  auto o = k.sync(2);
  ASSERT_FALSE(o.p[0]->ok());
  EXPECT_NE(o.p[0]->status().message().find("moved"), std::string::npos) << o.p[0]->status().to_string();
  for (auto& c : o.c) EXPECT_FALSE(c->ok());
  for (auto& c : k.cons) EXPECT_EQ(c->state().version, 1u);
}

}  // namespace
}  // namespace ferry::engine_tests
