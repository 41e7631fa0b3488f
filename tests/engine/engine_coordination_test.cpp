// Ranks-as-threads tests of the engine's coordination: creation, world sizes, versions,
// reports that never lie, stragglers, leases and the store going away; and the tables
// that travel in the leases (in-place and param tables), decoded against malformed
// bytes. Fixtures in engine_test_util.h, instantiated in engine_test.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine_test_util.h"
#include "engine/in_place.h"
#include "engine/protocol.h"
#include "engine/testing.h"

namespace ferry::engine_tests {
namespace {

// --- coordination: creation, world sizes, versions, reports that never lie -------------

// 20 times: every rank syncs the moment its own create() returns (no barrier between
// creation and the first sync). Creation returns only once every participant can
// receive, so no producer reports ok with nothing delivered and every consumer verifies.
TEST_P(EngineInprocTest, SyncRightAfterCreation) {
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE(fmt::format("trial {}", trial));
    Cluster k(GetParam());
    StoreServerOptions sso;
    sso.token = "engine-test-token-0123456789";
    auto server = StoreServer::start(sso);
    ASSERT_TRUE(server.ok());
    k.server = std::move(*server);
    auto model = tools::make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2", true, "");
    ASSERT_TRUE(model.ok());
    k.model = std::move(*model);
    k.eo.job = fmt::format("race{}", trial);
    k.eo.num_producers = k.P();
    k.eo.num_consumers = k.C();
    k.ptr.resize(2), k.pst.resize(2), k.src.resize(2), k.in_place_src.resize(2), k.gpu_src.resize(2), k.prod.resize(2);
    k.ctr.resize(2), k.cst.resize(2), k.cons.resize(2);
    std::vector<std::optional<Result<SyncReport>>> pr(2), cr(2);
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        Status s = k.start_producer(p);
        if (!s.ok()) return pr[static_cast<size_t>(p)].emplace(s), void();
        k.src[static_cast<size_t>(p)]->set_version(1);
        pr[static_cast<size_t>(p)].emplace(k.prod[static_cast<size_t>(p)]->sync(1));
      });
    }
    for (int c = 0; c < 2; ++c) {
      th.emplace_back([&, c] {
        Status s = k.start_consumer(c);
        if (!s.ok()) return cr[static_cast<size_t>(c)].emplace(s), void();
        cr[static_cast<size_t>(c)].emplace(k.cons[static_cast<size_t>(c)]->sync(1));
      });
    }
    for (auto& t : th) t.join();
    for (auto& r : pr) {
      ASSERT_TRUE(r->ok()) << r->status().to_string();
      EXPECT_TRUE((*r)->ok()) << (*r)->to_string();
      EXPECT_GT((*r)->bytes_sent, 0u) << (*r)->to_string();
    }
    for (int c = 0; c < 2; ++c) {
      ASSERT_TRUE(cr[static_cast<size_t>(c)]->ok()) << cr[static_cast<size_t>(c)]->status().to_string();
      k.expect_verified(c, 1);
    }
  }
}

// num_producers / num_consumers that disagree between ranks: an InvalidArgument naming
// both numbers, from the world-size check (not the rendezvous timeout, kept long here).
TEST(EngineCoordination, WrongWorldSizesNameBothNumbers) {
  {
    Cluster k;
    k.eo.rendezvous_timeout = 60s;
    k.tweak_producer = [](ProducerOptions& o, int) { o.num_consumers = 1; };  // 2 consumers run
    ASSERT_FALSE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=2").ok());
    bool named = false;
    for (const Status& s : k.started) {
      if (s.ok()) continue;
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      named |= s.message().find("num_consumers=1") != std::string::npos &&
               s.message().find("num_consumers=2") != std::string::npos;
    }
    EXPECT_TRUE(named);
  }
  {
    Cluster k;
    k.eo.rendezvous_timeout = 60s;
    k.tweak_consumer = [](ConsumerOptions& o, int) { o.num_producers = 1; };  // 2 producers run
    ASSERT_FALSE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1").ok());
    for (const Status& s : k.started) {
      if (s.ok()) continue;
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find("num_producers=1"), std::string::npos) << s.to_string();
      EXPECT_NE(s.message().find("num_producers=2"), std::string::npos) << s.to_string();
    }
  }
}

// Versions: a consumer syncing another version than the producers fails at once naming
// both (and the producers' reports are not ok, naming it); a rollback to an earlier
// version on every rank syncs it; committed_versions() says what each rank holds.
TEST_P(EngineInprocTest, VersionsMismatchRollbackAndCommitted) {
  Cluster k(GetParam());
  auto mode_of_case = [&] { return k.eo.mode; };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  k.expect_all_ok(k.sync(2), 2);
  // Consumer 1 asks for 4 while the trainer serves 3.
  Cluster::Outcome o;
  o.p.resize(2), o.c.resize(2);
  {
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        o.p[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    th.emplace_back([&] { o.c[0] = k.cons[0]->sync(3); });
    th.emplace_back([&] { o.c[1] = k.cons[1]->sync(4); });
    for (auto& t : th) t.join();
  }
  ASSERT_TRUE(o.c[0]->ok()) << o.c[0]->status().to_string();
  ASSERT_FALSE(o.c[1]->ok());
  // Pull: the consumer sees the producers' announcements of 3. Push: the producers see
  // its requests for 4 and drop it, saying why.
  const Status& why = o.c[1]->status();
  EXPECT_EQ(why.code(), mode_of_case() == SyncMode::kPush ? StatusCode::kCancelled : StatusCode::kFailedPrecondition)
      << why.to_string();
  EXPECT_NE(why.message().find("syncs version 4 but"), std::string::npos) << why.to_string();
  EXPECT_NE(why.message().find("serves version 3"), std::string::npos) << why.to_string();
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_FALSE((*p)->ok()) << (*p)->to_string();
    EXPECT_EQ((*p)->missed, std::vector<int>{1}) << (*p)->to_string();
  }
  k.expect_verified(0, 3);
  EXPECT_EQ(k.cons[1]->state().version, 2u);
  auto cv = committed_versions(*k.pst[0], k.eo.job, 2);
  ASSERT_TRUE(cv.ok()) << cv.status().to_string();
  EXPECT_EQ(*cv, (std::vector<std::optional<uint64_t>>{3, 2}));
  // Every rank rolls back to version 1: synced and verified, not ignored as stale.
  k.expect_all_ok(k.sync(1), 1);
  for (int c = 0; c < 2; ++c) EXPECT_EQ(k.cons[static_cast<size_t>(c)]->state().version, 1u);
  cv = committed_versions(*k.pst[0], k.eo.job, 2);
  ASSERT_TRUE(cv.ok());
  EXPECT_EQ(*cv, (std::vector<std::optional<uint64_t>>{1, 1}));
}

// Push: consumer 1's requests for 4 reach the producers before their sync of 3 begins
// (held until it sent them); they drop it at once, under its version, naming both.
TEST(EngineCoordination, PushVersionMismatchAskedBeforeTheProducersBegan) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPush});
  std::promise<void> asked;
  std::atomic<bool> armed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&](int g, int phase) {
      if (g == 0 && phase == 1 && armed.exchange(false)) asked.set_value();
    };
    o.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  Cluster::Outcome o;
  o.p.resize(2), o.c.resize(2);
  {
    armed = true;
    std::thread late([&] { o.c[1] = k.cons[1]->sync(4); });
    asked.get_future().wait();
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        o.p[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    th.emplace_back([&] { o.c[0] = k.cons[0]->sync(3); });
    for (auto& t : th) t.join();
    late.join();
  }
  ASSERT_TRUE(o.c[0]->ok()) << o.c[0]->status().to_string();
  ASSERT_FALSE(o.c[1]->ok());
  const Status& why = o.c[1]->status();
  EXPECT_EQ(why.code(), StatusCode::kCancelled) << why.to_string();
  EXPECT_NE(why.message().find("syncs version 4 but this producer serves version 3"), std::string::npos)
      << why.to_string();
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_EQ((*p)->missed, std::vector<int>{1}) << (*p)->to_string();
    EXPECT_EQ((*p)->dropped, std::vector<int>{1}) << (*p)->to_string();
  }
  k.expect_verified(0, 3);
  EXPECT_EQ(k.cons[1]->state().version, 1u);
  k.expect_all_ok(k.sync(2), 2);
}

// Pull: the producers' announcements of 3 reach consumer 1 before its sync of 4 begins
// (it starts once consumer 0 reads group 1, so every announcement of group 0 was
// delivered); it fails at once naming both versions, not at its timeout.
TEST(EngineCoordination, PullVersionMismatchAnnouncedBeforeTheConsumerBegan) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull});
  std::promise<void> announced;
  std::atomic<bool> armed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 0) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&](int g, int phase) {
      if (g == 1 && phase == 1 && armed.exchange(false)) announced.set_value();
    };
    o.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  Cluster::Outcome o;
  o.p.resize(2), o.c.resize(2);
  {
    armed = true;
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        o.p[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    th.emplace_back([&] { o.c[0] = k.cons[0]->sync(3); });
    announced.get_future().wait();
    o.c[1] = k.cons[1]->sync(4);
    for (auto& t : th) t.join();
  }
  ASSERT_TRUE(o.c[0]->ok()) << o.c[0]->status().to_string();
  ASSERT_FALSE(o.c[1]->ok());
  const Status& why = o.c[1]->status();
  EXPECT_EQ(why.code(), StatusCode::kFailedPrecondition) << why.to_string();
  EXPECT_NE(why.message().find("syncs version 4 but"), std::string::npos) << why.to_string();
  EXPECT_NE(why.message().find("serves version 3"), std::string::npos) << why.to_string();
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_EQ((*p)->missed, std::vector<int>{1}) << (*p)->to_string();
  }
  k.expect_verified(0, 3);
  EXPECT_EQ(k.cons[1]->state().version, 1u);
  k.expect_all_ok(k.sync(2), 2);
}

// Consumer `victim` stops before waiting for group 1 of every sync while `stall` is set
// (a paused or slow rank, through the consumer's test hook), until a producer has dropped
// it from sync `v` or `at_most` passed. Waiting for the drop, not a fixed time: a victim
// that woke before the drop (a loaded machine) raced it, and could finish its reads and
// commit (through its relay) before the drop reached it.
void stall_at_group_1(Cluster& k, int victim, std::chrono::milliseconds at_most, const std::atomic<bool>& stall,
                      uint64_t v = 2) {
  k.tweak_consumer = [&k, &stall, victim, at_most, v](ConsumerOptions& o, int c) {
    if (c != victim) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&k, &stall, victim, at_most, v](int g, int phase) {
      if (!stall || g != 1 || phase != 0) return;
      const auto until = std::chrono::steady_clock::now() + at_most;
      while (!engine::knows_dropped(*k.cons[static_cast<size_t>(victim)], v) &&
             std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    };
    o.test_hooks = hooks;
  };
}

// A consumer that is a member of the job but absent from a sync (its lease gone) is
// named in every report of the producers that serve it, which are then not ok; one that
// stalls is dropped and told why.
TEST(EngineCoordination, AbsentAndDroppedConsumersAreNamed) {
  Cluster k;
  k.eo.stall_timeout = 600ms;
  std::atomic<bool> stall{false};
  stall_at_group_1(k, 1, 10s, stall);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  stall = true;
  auto o = k.sync(2);
  stall = false;
  ASSERT_TRUE(o.p[0]->ok());
  EXPECT_FALSE((*o.p[0])->ok());
  EXPECT_EQ((*o.p[0])->missed, std::vector<int>{1});
  EXPECT_EQ((*o.p[0])->dropped, std::vector<int>{1});
  ASSERT_FALSE(o.c[1]->ok());
  EXPECT_NE(o.c[1]->status().message().find("dropped from sync 2 by producer 0: stalled"), std::string::npos)
      << o.c[1]->status().to_string();
  k.expect_verified(0, 2);
  // Consumer 1 leaves (its lease released): the next sync names it.
  k.cons[1].reset();
  std::vector<std::thread> th;
  std::optional<Result<SyncReport>> pr, cr;
  th.emplace_back([&] {
    k.src[0]->set_version(3);
    pr = k.prod[0]->sync(3);
  });
  th.emplace_back([&] { cr = k.cons[0]->sync(3); });
  for (auto& t : th) t.join();
  ASSERT_TRUE(cr->ok()) << cr->status().to_string();
  ASSERT_TRUE(pr->ok());
  EXPECT_FALSE((*pr)->ok());
  EXPECT_EQ((*pr)->missed, std::vector<int>{1});
  EXPECT_NE((*pr)->to_string().find("consumer 1 is not a member of sync 3"), std::string::npos) << (*pr)->to_string();
  // It restarts: the next sync is whole again.
  ASSERT_TRUE(k.start_consumer(1).ok());
  auto o4 = k.sync(4);
  k.expect_all_ok(o4, 4);
  EXPECT_TRUE((*o4.p[0])->ok()) << (*o4.p[0])->to_string();
}

// RL timing is not a fault (issue 30). Inference ranks enter a sync seconds apart after
// their rollouts: consumer 2 enters sync 2 three straggler floors after the others (it
// was dropped as a straggler 2 s after the others released group 0). And one may
// post-process every group for a while: in sync 3 consumer 2's after_group takes 0.65 x
// the floor on groups 1-3. Neither is dropped: a consumer lags only from its own entry
// (JOIN) and its own last progress. Every sync verifies everywhere.
// What these check is relative (a consumer late by three straggler floors, a join
// window four times shorter than its lateness): pull runs them at their real lengths,
// push at half (scaled()), which halves the seconds they wait out.
class EngineRlTiming : public ::testing::TestWithParam<Mode> {
 protected:
  std::chrono::milliseconds scaled(int ms) const { return std::chrono::milliseconds(GetParam() == Mode::kPull ? ms : ms / 2); }
};
INSTANTIATE_TEST_SUITE_P(Modes, EngineRlTiming, ::testing::Values(Mode::kPull, Mode::kPush),
                         [](const auto& info) { return info.param == Mode::kPull ? "pull" : "push_half_length"; });

TEST_P(EngineRlTiming, LateEntryAndSlowPostProcessingAreNoStragglers) {
  Cluster k({Backend::kInproc, GetParam()});
  k.eo.straggler_floor = scaled(2000);
  std::atomic<int> mode{0};  // 1: enter late, 2: slow after_group
  const auto late = scaled(6000), slow = scaled(1300);
  k.tweak_consumer = [&mode, late, slow](ConsumerOptions& o, int c) {
    if (c != 2) return;
    o.before_sync = [&mode, late](uint64_t) {
      if (mode == 1) std::this_thread::sleep_for(late);
    };
    o.after_group = [&mode, slow](uint64_t, int g) {
      if (mode == 2 && g >= 1 && g <= 3) std::this_thread::sleep_for(slow);
    };
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=3").ok());
  k.expect_all_ok(k.sync(1), 1);
  for (int m : {1, 2}) {
    mode = m;
    const uint64_t v = 1 + static_cast<uint64_t>(m);
    auto o = k.sync(v);
    mode = 0;
    k.expect_all_ok(o, v);
    ASSERT_TRUE(o.p[0]->ok());
    EXPECT_TRUE((*o.p[0])->ok()) << "sync " << v << ": " << (*o.p[0])->to_string();
    EXPECT_TRUE((*o.p[0])->dropped.empty()) << "sync " << v << ": " << (*o.p[0])->to_string();
    for (int c = 0; c < 3; ++c) k.expect_verified(c, v);
  }
}

// A consumer that closes right after its sync returned ok (it committed: DONE) while the
// producer is still in that sync (another consumer is slow on the last group) is not
// "dropped" by the producer: the producer's report is ok, drops no one and names no one
// (issue 30: it said ok while its text said it dropped consumer 1).
TEST_P(EngineRlTiming, ConsumerClosingRightAfterItsSyncIsNotCalledDropped) {
  Cluster k({Backend::kInproc, GetParam()});
  std::atomic<int> last{-1};
  k.tweak_consumer = [&last](ConsumerOptions& o, int c) {
    if (c != 0) return;
    o.after_group = [&last](uint64_t v, int g) {
      if (v == 2 && g == last) std::this_thread::sleep_for(1000ms);
    };
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  last = k.prod[0]->routes().num_groups() - 1;
  k.expect_all_ok(k.sync(1), 1);
  std::optional<Result<SyncReport>> pr, c0, c1;
  std::thread producer([&] {
    k.src[0]->set_version(2);
    pr = k.prod[0]->sync(2);
  });
  std::thread slow([&] { c0 = k.cons[0]->sync(2); });
  std::thread closing([&] {
    c1 = k.cons[1]->sync(2);
    k.cons[1].reset();  // closes while consumer 0 still holds the producer in sync 2
  });
  producer.join();
  slow.join();
  closing.join();
  ASSERT_TRUE(c0->ok()) << c0->status().to_string();
  ASSERT_TRUE(c1->ok()) << c1->status().to_string();
  ASSERT_TRUE(pr->ok()) << pr->status().to_string();
  EXPECT_TRUE((*pr)->ok()) << (*pr)->to_string();
  EXPECT_TRUE((*pr)->dropped.empty()) << (*pr)->to_string();
  EXPECT_TRUE((*pr)->missed.empty()) << (*pr)->to_string();
  EXPECT_EQ((*pr)->to_string().find("dropped consumer 1"), std::string::npos) << (*pr)->to_string();
}

// A consumer that has not entered the sync is dropped once it lags the others by the
// join window (here 1.5 s; it enters 6 s late), told it was absent, named in the
// producer's report, and catches up at the next sync.
TEST_P(EngineRlTiming, ConsumerLaterThanTheJoinWindowIsDroppedAsAbsent) {
  Cluster k({Backend::kInproc, GetParam()});
  k.eo.straggler_floor = scaled(500);
  k.eo.join_window = scaled(1500);
  std::atomic<bool> late{false};
  const auto lateness = scaled(6000);
  k.tweak_consumer = [&late, lateness](ConsumerOptions& o, int c) {
    if (c != 2) return;
    o.before_sync = [&late, lateness](uint64_t) {
      if (late) std::this_thread::sleep_for(lateness);
    };
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=3").ok());
  k.expect_all_ok(k.sync(1), 1);
  late = true;
  auto o = k.sync(2);
  late = false;
  ASSERT_TRUE(o.p[0]->ok()) << o.p[0]->status().to_string();
  EXPECT_EQ((*o.p[0])->dropped, std::vector<int>{2}) << (*o.p[0])->to_string();
  EXPECT_NE((*o.p[0])->to_string().find("dropped consumer 2: absent: did not enter the sync"), std::string::npos)
      << (*o.p[0])->to_string();
  ASSERT_FALSE(o.c[2]->ok());
  EXPECT_NE(o.c[2]->status().message().find("absent"), std::string::npos) << o.c[2]->status().to_string();
  k.expect_verified(0, 2);
  k.expect_verified(1, 2);
  k.expect_all_ok(k.sync(3), 3);
  k.expect_verified(2, 3);
}

// A sink (EngineOptions::sink) as a metrics exporter would be: every control decision
// and every report, from the engine's threads.
class RecordingSink final : public SyncSink {
 public:
  struct Seen {
    std::string side;
    int rank;
    uint64_t version;
    ControlEvent event;
  };
  void on_control(const SyncSource& from, const ControlEvent& e) override {
    std::lock_guard<std::mutex> lk(mu);
    controls.push_back({from.side, from.rank, from.version, e});
  }
  void on_report(const SyncSource& from, const SyncReport& r) override {
    std::lock_guard<std::mutex> lk(mu);
    reports.push_back({from.side, from.rank, r.version, r.ok()});
  }
  struct Told {
    std::string side;
    int rank;
    uint64_t version;
    bool ok;
  };
  std::mutex mu;
  std::vector<Seen> controls;
  std::vector<Told> reports;
};

// A straggler (one consumer of three stops at group 1 until it is dropped) is dropped once it lags
// the other two by the straggler bound, long before stall_timeout (20 s here): the drop
// says "straggler", the others verify, and it catches up at the next sync.
TEST_P(EngineInprocTest, StragglerIsDroppedEarlyAndCatchesUp) {
  Cluster k(GetParam());
  std::atomic<bool> stall{false};
  k.eo.straggler_floor = 500ms;
  stall_at_group_1(k, 2, 15s, stall);  // (under stall_timeout: dropped early or not at all)
  auto sink = std::make_shared<RecordingSink>();
  k.eo.sink = sink;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=3").ok());
  k.expect_all_ok(k.sync(1), 1);
  stall = true;
  auto o = k.sync(2);
  stall = false;
  ASSERT_TRUE(o.p[0]->ok()) << o.p[0]->status().to_string();
  EXPECT_EQ((*o.p[0])->dropped, std::vector<int>{2}) << (*o.p[0])->to_string();
  EXPECT_EQ((*o.p[0])->missed, std::vector<int>{2});
  EXPECT_NE((*o.p[0])->to_string().find("dropped consumer 2: straggler"), std::string::npos) << (*o.p[0])->to_string();
  // The drop is a typed event of the report (its line in failures made from it), and the
  // sink heard it from producer 0 in sync 2 as it was made.
  const SyncReport& pr = **o.p[0];
  ASSERT_FALSE(pr.events.empty()) << pr.to_string();
  EXPECT_EQ(pr.events[0].kind, ControlKind::kDrop);
  EXPECT_EQ(pr.events[0].peer, 2);
  ASSERT_EQ(pr.failures.size(), pr.events.size());
  for (size_t i = 0; i < pr.events.size(); ++i) EXPECT_EQ(pr.failures[i], pr.events[i].message);
  {
    std::lock_guard<std::mutex> lk(sink->mu);
    bool heard = false;
    for (const auto& s : sink->controls)
      heard |= s.side == "producer" && s.rank == 0 && s.version == 2 && s.event.kind == ControlKind::kDrop &&
               s.event.peer == 2 && s.event.message == pr.events[0].message;
    EXPECT_TRUE(heard) << sink->controls.size() << " control events heard";
    // Every rank's report of syncs 1 and 2, each as it returned: of sync 2, consumer 2's
    // failed and producer 0's is not ok (a consumer missed it).
    int told = 0;
    for (const auto& r : sink->reports) {
      if (r.version > 2) continue;
      ++told;
      const bool not_ok = r.version == 2 && (r.side == "producer" || r.rank == 2);
      EXPECT_EQ(r.ok, !not_ok) << r.side << " " << r.rank << " sync " << r.version;
    }
    EXPECT_EQ(told, 2 * 4);
  }
  ASSERT_FALSE(o.c[2]->ok());
  EXPECT_NE(o.c[2]->status().message().find("straggler"), std::string::npos) << o.c[2]->status().to_string();
  k.expect_verified(0, 2);
  k.expect_verified(1, 2);
  auto o3 = k.sync(3);
  k.expect_all_ok(o3, 3);
  EXPECT_TRUE((*o3.p[0])->ok()) << (*o3.p[0])->to_string();
}

// Issue 49, finding 1: a consumer held by one producer's pending reads is no straggler
// to another. Producer 0 stands for a stopped trainer rank: consumer 1's reads of its
// group 1 stay pending for 2 s (TestHooks::hold_reads), and it judges no one
// (straggler_floor 0, as a stopped process cannot). Producer 1 announces group 1 only once
// consumer 1 is held, so consumer 0 releases it and consumer 1 cannot: the 300 ms bound
// would drop it 1.7 s before the reads complete, but
// consumer 1 says it is in the sync (JOINs) while it waits, and every report is ok.
TEST(EngineCoordination, ConsumerHeldByOneProducersReadsIsNoStragglerToAnother) {
  Cluster k;
  k.eo.straggler_floor = 300ms;
  k.eo.lease_ttl = 200ms;
  k.eo.stall_timeout = 30s;
  std::atomic<bool> held{false}, armed{false};
  k.tweak_producer = [&](ProducerOptions& o, int p) {
    if (p == 0) {
      o.straggler_floor = 0ms;
      return;
    }
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->before_materialize = [&](uint64_t v, int g) {
      if (v != 2 || g != 1) return;
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (!held && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
    };
    o.test_hooks = hooks;
  };
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->hold_reads = [&](uint64_t v, int g, int p) -> std::chrono::milliseconds {
      if (!armed || v != 2 || g != 1 || p != 0 || held.exchange(true)) return 0ms;
      return 2000ms;
    };
    o.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  armed = true;
  auto o = k.sync(2);
  EXPECT_TRUE(held) << "consumer 1 never read group 1 of producer 0";
  k.expect_all_ok(o, 2);
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_TRUE((**p).dropped.empty()) << (**p).to_string();
  }
  k.expect_verified(0, 2);
  k.expect_verified(1, 2);
}

// Issue 49, finding 2: a consumer that hangs after its last release, before it commits,
// is dropped by every producer once the others committed and it stayed silent for the
// straggler bound (300 ms here), not waited for to stall_timeout (30 s) while the
// healthy consumers' next sync waits for the producers. Its sync thread stops right
// after it released its last group (so no JOIN comes: a hung process sends nothing)
// until a producer dropped it.
TEST(EngineCoordination, ConsumerHungBeforeItCommitsIsDroppedByEveryProducerAtTheBound) {
  Cluster k;
  k.eo.straggler_floor = 300ms;
  k.eo.stall_timeout = 30s;
  std::atomic<int> last_group{-1};
  std::atomic<bool> armed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&](int g, int phase) {
      if (phase != 2) return;
      if (!armed) {
        last_group = std::max(last_group.load(), g);
        return;
      }
      if (g != last_group) return;
      const auto until = std::chrono::steady_clock::now() + 20s;
      while (!engine::knows_dropped(*k.cons[1], 2) && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(5ms);
    };
    o.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  ASSERT_GE(last_group.load(), 0);
  armed = true;
  auto o = k.sync(2);
  armed = false;
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_EQ((**p).dropped, std::vector<int>{1}) << (**p).to_string();
    // Its own verdict, or the ABORT of a consumer another producer's verdict reached first
    // (it names that verdict): the same evidence either way.
    EXPECT_NE((**p).to_string().find("straggler: did not commit the sync"), std::string::npos) << (**p).to_string();
  }
  k.expect_verified(0, 2);
  k.expect_all_ok(k.sync(3), 3);
}

// The same with two PP stages and four replicas (rotated: two cohorts of two, each
// reading one stage's group while the other reads the other's): the consumer that stalls
// is dropped as a straggler by the producer it holds up, the others verify.
TEST_P(EngineInprocTest, StragglerIsDroppedEarlyUnderPipelineStages) {
  Cluster k(GetParam());
  std::atomic<bool> stall{false};
  k.eo.straggler_floor = 500ms;
  stall_at_group_1(k, 2, 15s, stall);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1,pp=2", "tp=1,replicas=4").ok());
  k.expect_all_ok(k.sync(1), 1);
  stall = true;
  auto o = k.sync(2);
  stall = false;
  std::string reports;
  bool straggler = false;
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    reports += (**p).to_string() + "\n";
    straggler |= (**p).to_string().find("dropped consumer 2: straggler") != std::string::npos;
  }
  EXPECT_TRUE(straggler) << reports;
  // (Dropped by a producer it had already read everything from, it may still commit.)
  if (o.c[2]->ok()) k.expect_verified(2, 2);
  for (int c : {0, 1, 3}) k.expect_verified(c, 2);
  k.expect_all_ok(k.sync(3), 3);
}

// A lease lost while its holder was paused (the key expired: removed here) heals: the
// consumer is named as missing in at most one sync and verifies again within two.
TEST(EngineCoordination, LostLeaseHealsWithinTwoSyncs) {
  Cluster k;
  k.eo.lease_ttl = 300ms;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  ASSERT_TRUE(k.pst[0]->remove(engine::JobKeys(k.eo.job).consumer(1)).ok());
  ASSERT_TRUE(k.pst[0]->remove(engine::JobKeys(k.eo.job).producer(0)).ok());
  auto o2 = k.sync(2);  // consumer 1 may be missed here, never silently
  ASSERT_TRUE(o2.p[0]->ok());
  if (!(*o2.p[0])->ok()) {
    EXPECT_EQ((*o2.p[0])->missed, std::vector<int>{1}) << (*o2.p[0])->to_string();
  }
  ASSERT_TRUE(o2.c[0]->ok()) << "a producer whose lease lapsed keeps serving: " << o2.c[0]->status().to_string();
  std::this_thread::sleep_for(300ms);  // a heartbeat (ttl/3) has run
  auto o3 = k.sync(3);
  k.expect_all_ok(o3, 3);
  EXPECT_TRUE((*o3.p[0])->ok()) << (*o3.p[0])->to_string();
}

// The store goes away (its server stopped): every rank's next sync fails within the
// store's connect_timeout with an error naming the store's URL. Restarted on the same
// port without its data, the store is reconnected to: the next sync succeeds everywhere
// (leases healed, and the rendezvous keys every rank published once re-published), and a
// rank started afterwards finds what it needs to rendezvous.
TEST(EngineCoordination, StoreAwayFailsNamingItThenRestartedStoreRecovers) {
  Cluster k;
  k.store_connect_timeout = 1000ms;
  k.eo.lease_ttl = 300ms;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2", R"({"num_hidden_layers": 2})").ok());
  k.expect_all_ok(k.sync(1), 1);
  const uint16_t port = k.server->port();
  const std::string url = k.server->url();
  k.server->stop();
  k.server.reset();
  auto away = k.sync(2);
  for (size_t p = 0; p < away.p.size(); ++p) {
    ASSERT_FALSE(away.p[p]->ok()) << "producer " << p << " synced without its store";
    EXPECT_NE(away.p[p]->status().message().find(url), std::string::npos) << away.p[p]->status().to_string();
  }
  for (size_t c = 0; c < away.c.size(); ++c) {
    ASSERT_FALSE(away.c[c]->ok()) << "consumer " << c << " synced without its store";
    EXPECT_NE(away.c[c]->status().message().find(url), std::string::npos) << away.c[c]->status().to_string();
    EXPECT_FALSE(k.cons[c]->state().torn);
  }
  std::printf("store away: %s\n", away.c[0]->status().to_string().c_str());

  StoreServerOptions sso;
  sso.token = "engine-test-token-0123456789";
  sso.port = port;
  auto restarted = StoreServer::start(sso);
  ASSERT_TRUE(restarted.ok()) << restarted.status().to_string();
  k.server = std::move(*restarted);
  auto o3 = k.sync(3);
  for (size_t p = 0; p < o3.p.size(); ++p) {
    ASSERT_TRUE(o3.p[p]->ok()) << "producer " << p << ": " << o3.p[p]->status().to_string();
    EXPECT_TRUE((*o3.p[p])->ok()) << (*o3.p[p])->to_string();
  }
  for (size_t c = 0; c < o3.c.size(); ++c) {
    ASSERT_TRUE(o3.c[c]->ok()) << "consumer " << c << ": " << o3.c[c]->status().to_string();
    k.expect_verified(static_cast<int>(c), 3);
  }
  const engine::JobKeys keys(k.eo.job);
  auto check = k.store();
  ASSERT_TRUE(check.ok());
  EXPECT_TRUE((*check)->get(keys.meta()).ok()) << "metadata re-published";
  for (int p = 0; p < k.P(); ++p) EXPECT_TRUE((*check)->get(keys.holdings(p)).ok()) << "holdings of " << p;
  for (int c = 0; c < k.C(); ++c) EXPECT_TRUE((*check)->get(keys.plan(c)).ok()) << "plan of " << c;
  // A new instance of consumer 1 rendezvouses with the re-published keys and syncs.
  ASSERT_TRUE(k.start_consumer(1).ok());
  k.expect_all_ok(k.sync(4), 4);
}

// --- what travels in the leases ------------------------------------------------------

// The in-place table travels in the producer's lease: decoding it is bounds-checked.
// InPlaceTable: protocol_test.cpp (engine_parts_test), with its bounds.

// A push consumer's param table travels in its lease: decoding it is bounds-checked.
TEST(ParamTable, RoundTripAndMalformedBytes) {
  engine::ParamTable t;
  t.min_bytes = 4096;
  t.keys = {"k0", "k1"};
  t.params["a"] = {0, 0, 128};
  t.params["b"] = {1, 64, 4096};
  const std::string bytes = t.encode();
  auto d = engine::ParamTable::decode(bytes);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->min_bytes, 4096u);
  EXPECT_EQ(d->keys, t.keys);
  ASSERT_EQ(d->params.size(), 2u);
  EXPECT_EQ(d->params.at("b").key, 1u);
  EXPECT_EQ(d->params.at("b").offset, 64u);
  EXPECT_EQ(d->params.at("b").bytes, 4096u);
  EXPECT_TRUE(engine::ParamTable::decode("")->empty());  // nothing registered
  for (size_t n = 1; n < bytes.size(); ++n)
    EXPECT_FALSE(engine::ParamTable::decode(bytes.substr(0, n)).ok()) << "truncated at " << n;
  // A flip consumer's second set (push): as many keys, or none.
  t.other_keys = {"o0", "o1"};
  auto two = engine::ParamTable::decode(t.encode());
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->other_keys, t.other_keys);
  EXPECT_EQ(two->keys, t.keys);
  t.other_keys = {"o0"};
  EXPECT_EQ(engine::ParamTable::decode(t.encode()).status().code(), StatusCode::kCorrupt);
  t.other_keys.clear();
  t.params["c"] = {2, 0, 8};  // names a registration the table lacks
  EXPECT_EQ(engine::ParamTable::decode(t.encode()).status().code(), StatusCode::kCorrupt);
  t.params.erase("c");
  t.params["d"] = {0, UINT64_MAX, 2};  // offset + bytes overflows
  EXPECT_EQ(engine::ParamTable::decode(t.encode()).status().code(), StatusCode::kCorrupt);
}

}  // namespace
}  // namespace ferry::engine_tests

namespace ferry::engine_tests {
namespace {

// The same version synced twice (a rollback to the version just synced: "a sync like any
// other", docs/engine.md) moves the bytes again. Before, each producer counted every
// consumer as done from the DONE of the first sync: its second sync(1) reported ok with
// 0 bytes sent at once, and the consumers timed out waiting for announcements (issue
// 30). Consumer 0's params are scribbled over in between: they must be version 1 again.
TEST_P(EngineInprocTest, SameVersionAgainIsSyncedAgain) {
  Cluster k(GetParam());
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  for (const auto& [name, t] : k.cons[0]->params()) {
    auto p = t.data_ptr();
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    std::memset(*p, 0x7f, t.nbytes());
  }
  auto o = k.sync(1);
  k.expect_all_ok(o, 1);
  for (size_t p = 0; p < o.p.size(); ++p) {
    EXPECT_TRUE((*o.p[p])->ok()) << (*o.p[p])->to_string();
    EXPECT_GT((*o.p[p])->bytes_sent, 0u) << (*o.p[p])->to_string();
  }
  k.expect_all_ok(k.sync(2), 2);  // and on from there
}

}  // namespace
// A consumer that enters sync 2 after the producers have moved on to sync 3 (it was
// dropped from 2 as absent, and the trainer already holds version 3) writes nothing: its
// sync 2 fails naming the version the producers serve, and its params stay bit for bit
// version 1 (issue 30: a late consumer's failed sync(2) wrote version 3 bytes into 10 of
// its 39 params). Then it syncs 3 with the others... after they finished: it catches up
// at sync 4. In place too, where the bytes a consumer reads are the trainer's own.
class EngineLateConsumer : public ::testing::TestWithParam<Mode> {};
INSTANTIATE_TEST_SUITE_P(Modes, EngineLateConsumer,
                         ::testing::Values(Mode::kPull, Mode::kPush, Mode::kInPlace, Mode::kPushInPlace),
                         [](const auto& info) {
                           switch (info.param) {
                             case Mode::kPull: return "pull";
                             case Mode::kPush: return "push";
                             case Mode::kInPlace: return "in_place";
                             default: return "push_in_place";
                           }
                         });

TEST_P(EngineLateConsumer, WritesNoBytesOfAVersionItWasNotAskedFor) {
  Cluster k({Backend::kInproc, GetParam()});
  k.eo.straggler_floor = 500ms;
  k.eo.join_window = 1000ms;
  std::promise<void> entered_promise;
  auto entered = entered_promise.get_future().share();
  std::atomic<bool> late{false};
  std::atomic<bool> hold{false};
  std::promise<void> go_promise;
  auto go = go_promise.get_future().share();
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c == 2) {
      o.before_sync = [&, go](uint64_t) {
        if (late) go.wait();  // until the producers are in sync 3
      };
      return;
    }
    // Consumers 0 and 1 hold sync 3 open at group 1 until consumer 2 has tried sync 2.
    o.after_group = [&, entered](uint64_t v, int g) {
      if (v == 3 && g == 1 && hold) entered.wait_for(std::chrono::seconds(15));
    };
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=3").ok());
  k.expect_all_ok(k.sync(1), 1);
  late = true;
  std::optional<Result<SyncReport>> c2;
  std::thread t2([&] {
    c2 = k.cons[2]->sync(2);
    entered_promise.set_value();
  });
  // Sync 2 without consumer 2 (dropped as absent after the join window).
  {
    std::optional<Result<SyncReport>> p0, c0, c1;
    std::thread tp([&] {
      k.src[0]->set_version(2);
      p0 = k.prod[0]->sync(2);
    });
    std::thread tc0([&] { c0 = k.cons[0]->sync(2); });
    std::thread tc1([&] { c1 = k.cons[1]->sync(2); });
    tp.join(), tc0.join(), tc1.join();
    ASSERT_TRUE(p0->ok()) << p0->status().to_string();
    EXPECT_EQ((**p0).dropped, std::vector<int>{2}) << (**p0).to_string();
    ASSERT_TRUE(c0->ok()) << c0->status().to_string();
    ASSERT_TRUE(c1->ok()) << c1->status().to_string();
  }
  // Sync 3 begins (the trainer holds version 3); consumer 2 enters sync 2 only now.
  hold = true;
  std::optional<Result<SyncReport>> p3, c30, c31;
  std::thread tp([&] {
    k.src[0]->set_version(3);
    p3 = k.prod[0]->sync(3);
  });
  std::thread tc0([&] { c30 = k.cons[0]->sync(3); });
  std::thread tc1([&] { c31 = k.cons[1]->sync(3); });
  std::this_thread::sleep_for(300ms);  // (the producer is in sync 3 either way: consumers hold it)
  go_promise.set_value();
  t2.join();
  tp.join(), tc0.join(), tc1.join();
  hold = false;
  late = false;
  ASSERT_TRUE(c2.has_value());
  ASSERT_FALSE(c2->ok()) << "a consumer synced version 2 after every producer had moved to 3";
  // It says why: dropped from 2 as absent (or, had that word not come yet, that the
  // producer serves 3).
  const std::string why = c2->status().message();
  EXPECT_TRUE(why.find("dropped from sync 2") != std::string::npos ||
              why.find("producer 0 serves version 3") != std::string::npos)
      << c2->status().to_string();
  EXPECT_EQ(k.cons[2]->state().version, 1u);
  // Not one byte of version 3 (or anything else) in its params: bit for bit version 1.
  k.expect_verified(2, 1);
  ASSERT_TRUE(c30->ok()) << c30->status().to_string();
  ASSERT_TRUE(c31->ok()) << c31->status().to_string();
  k.expect_verified(0, 3);
  k.expect_verified(1, 3);
  k.expect_all_ok(k.sync(4), 4);
}

}  // namespace ferry::engine_tests
