// A joiner catches up from the replicas (issue 45, Consumer::catch_up), ranks as threads:
// a new instance of an inference rank reads the live version from the live params of a
// replica of its plan class, not from the trainer, and is verified bit for bit before
// the next sync, under every commit policy, with post-processing (FP8) and delta syncs
// after it; several joiners fan out as a tree; a source killed after its offer leaves
// the joiner to the next one and disturbs nobody else; with no replica of its class
// holding the version nothing changes and the next sync serves it. The hold itself
// (offer, DONE answered intact, a hold given up as the source's sync begins) is
// ReplicaServer.* below.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <set>
#include <thread>

#include "engine/engine_test_util.h"
#include "engine/protocol.h"
#include "engine/replica_server.h"
#include "engine/testing.h"

namespace ferry::engine_tests {
namespace {

bool has(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

// Consumer c's catch-up: ok, the live version, every byte from the replicas (none from a
// producer), verified bit for bit.
void expect_caught_up(Cluster& k, int c, const Result<SyncReport>& r, uint64_t v) {
  ASSERT_TRUE(r.ok()) << "consumer " << c << ": " << r.status().to_string();
  EXPECT_EQ(r->version, v);
  EXPECT_TRUE(r->committed);
  EXPECT_GT(r->bytes_received, 0u);
  EXPECT_EQ(r->received_from_replicas, r->bytes_received) << r->to_json();
  EXPECT_TRUE(r->bytes_per_peer.empty()) << "read from producers: " << r->to_json();
  EXPECT_GE(r->catch_up_source, 0);
  EXPECT_NE(r->catch_up_source, c);
  EXPECT_EQ(r->live_version, std::optional<uint64_t>(v));
  k.expect_verified(c, v);
}

// Two syncs, consumer 2 replaced by a new instance, its catch-up from consumer 0 or 1,
// then a sync of everyone (the producers name it joined; a delta sync patches against the
// version it caught up to). Per commit policy, and with FP8 post-processing on the
// consumer (the joiner quantises as the replica did); over UCX (shared memory and tcp on
// one host), pulled, and pushed into a shadow that flips.
TEST(CatchUp, AJoinerReadsTheLiveVersionFromAReplicaNotTheTrainer) {
  struct Case {
    const char* name;
    bool shadow, groups, delta, fp8;
    Backend backend = Backend::kInproc;
    Mode mode = Mode::kPull;
  };
  for (const Case& cs : {Case{"in place", false, false, false, false}, Case{"shadow", true, false, false, false},
                         Case{"groups", false, true, false, false}, Case{"delta", false, false, true, false},
                         Case{"fp8 on the consumer", false, false, false, true},
                         Case{"ucx, in place", false, false, false, false, Backend::kUcx},
                         Case{"ucx, push, shadow", true, false, false, false, Backend::kUcx, Mode::kPush}}) {
    SCOPED_TRACE(cs.name);
    Cluster k(EngineCase{cs.backend, cs.mode});
    k.shadow = cs.shadow;
    k.groups = cs.groups;
    if (cs.delta) {
      k.eo.delta = true;
      k.eo.delta_same_host = true;
      k.changes = {0.01, false};
    }
    if (cs.fp8) {
      k.loader_options.quantize = Quantize::kFp8;
      k.eo.quantize_on = QuantizeOn::kConsumer;
    }
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=3").ok());
    k.expect_all_ok(k.sync(1), 1);
    k.expect_all_ok(k.sync(2), 2);
    k.cons[2].reset();
    ASSERT_TRUE(k.start_consumer(2).ok());
    EXPECT_FALSE(k.cons[2]->state().has_version);
    auto r = k.cons[2]->catch_up();
    expect_caught_up(k, 2, r, 2);
    auto o = k.sync(3);
    k.expect_all_ok(o, 3);
    for (int c = 0; c < 3; ++c) k.expect_verified(c, 3);
    EXPECT_EQ((*o.p[0])->joined, std::vector<int>{2}) << (*o.p[0])->to_string();
    if (cs.delta) {
      EXPECT_GT((*o.c[2])->patch_bytes, 0u) << "the joiner took no patch against its caught-up base";
    }
  }
}

// Three joiners at once with one replica holding the version: a tree, not all from one
// replica: round one 0 -> 1, round two 0 -> 2 and 1 -> 3 (the joiners' marks set first,
// as three instances that all registered before any began reading).
TEST(CatchUp, SeveralJoinersFanOutAsATree) {
  Cluster k;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=4").ok());
  k.expect_all_ok(k.sync(1), 1);
  auto st = k.store();
  ASSERT_TRUE(st.ok());
  const engine::JobKeys keys(k.eo.job);
  for (int c = 1; c < 4; ++c) {
    k.cons[static_cast<size_t>(c)].reset();
    ASSERT_TRUE(k.start_consumer(c).ok());
    ASSERT_TRUE((*st)->set(keys.catching_up(c), "test", 20000ms).ok());
  }
  std::vector<std::optional<Result<SyncReport>>> r(4);
  std::vector<std::thread> th;
  for (int c = 1; c < 4; ++c) th.emplace_back([&, c] { r[static_cast<size_t>(c)] = k.cons[static_cast<size_t>(c)]->catch_up(); });
  for (auto& t : th) t.join();
  for (int c = 1; c < 4; ++c) expect_caught_up(k, c, *r[static_cast<size_t>(c)], 1);
  // Which one each read from depends on who finished first (a joiner that holds the
  // version by the time another looks is a holder to it); the tree itself is
  // CatchUpTree.* below. Each read from the replica or from a joiner that held it first.
  std::set<int> sources;
  for (int c = 1; c < 4; ++c) {
    const int s = (*r[static_cast<size_t>(c)])->catch_up_source;
    sources.insert(s);
    EXPECT_TRUE(s == 0 || (s >= 1 && s <= 3 && s != c)) << "joiner " << c << " read from " << s;
  }
  std::printf("joiners 1, 2, 3 read from %d, %d, %d\n", (*r[1])->catch_up_source, (*r[2])->catch_up_source,
              (*r[3])->catch_up_source);
  k.expect_all_ok(k.sync(2), 2);
}

// The tree: for 1-5 holders and up to 40 joiners, every joiner reads from an earlier
// place, one that holds the version a round before it; within a round no place serves two
// joiners; and the rounds double (40 joiners from 1 holder: 6 rounds, not 40).
TEST(CatchUpTree, EachRoundDoublesTheSourcesOneJoinerEach) {
  for (size_t holders = 1; holders <= 5; ++holders) {
    for (size_t joiners = 1; joiners <= 40; ++joiners) {
      // The round of place p: 0 for a holder, else r where p lies in [holders 2^(r-1), holders 2^r).
      auto round = [&](size_t p) {
        size_t r = 0;
        for (size_t n = holders; p >= n; n *= 2) ++r;
        return r;
      };
      std::map<size_t, std::set<size_t>> served;  // round -> parents
      for (size_t i = 0; i < joiners; ++i) {
        const size_t p = holders + i;
        const size_t parent = engine::catch_up_parent(holders, i);
        ASSERT_LT(parent, p);
        EXPECT_LT(round(parent), round(p)) << holders << " holders, joiner " << i;
        EXPECT_TRUE(served[round(p)].insert(parent).second) << "place " << parent << " serves two joiners in round "
                                                            << round(p) << " (" << holders << " holders)";
      }
      size_t rounds = round(holders + joiners - 1);
      size_t bound = 1;
      while ((holders << bound) < holders + joiners) ++bound;
      EXPECT_EQ(rounds, bound) << holders << " holders, " << joiners << " joiners";
    }
  }
}

// The replica that offered is killed before the joiner reads: the joiner reads from the
// other replica (a catch_up event names the first), verified; the producers' next sync
// names the killed one missed (true) and nobody else; its restart syncs again.
TEST(CatchUp, ASourceKilledAfterItsOfferLeavesTheJoinerToAnother) {
  Cluster k;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=3").ok());
  k.expect_all_ok(k.sync(1), 1);
  k.cons[2].reset();
  std::atomic<int> killed{-1};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 2) return;
    engine::TestHooks hooks;
    hooks.catch_up_offered = [&](uint64_t, int source) {
      int none = -1;
      if (killed.compare_exchange_strong(none, source))
        engine::TestAccess::simulate_crash(*k.cons[static_cast<size_t>(source)]);
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start_consumer(2).ok());
  auto r = k.cons[2]->catch_up();
  expect_caught_up(k, 2, r, 1);
  ASSERT_GE(killed.load(), 0);
  const int survivor = killed.load() == 0 ? 1 : 0;
  EXPECT_EQ(r->catch_up_source, survivor);
  bool named = false;
  for (const ControlEvent& e : r->events) named |= e.kind == ControlKind::kCatchUp && e.peer == killed.load();
  EXPECT_TRUE(named) << r->to_json();
  // The next sync without the killed replica: the producer reports it missed, only it.
  const int dead = killed.load();
  auto o2 = k.sync_with(2, {survivor, 2});
  for (int c : {survivor, 2}) {
    ASSERT_TRUE(o2.c[static_cast<size_t>(c)]->ok()) << o2.c[static_cast<size_t>(c)]->status().to_string();
    k.expect_verified(c, 2);
  }
  const auto& p2 = o2.p[0];
  ASSERT_TRUE(p2->ok()) << p2->status().to_string();
  EXPECT_EQ((*p2)->missed, std::vector<int>{dead}) << (*p2)->to_string();
  k.cons[static_cast<size_t>(dead)].reset();
  ASSERT_TRUE(k.start_consumer(dead).ok());
  k.expect_all_ok(k.sync(3), 3);
}

// The joiner is killed after the replica's offer, before it reads: the replica's hold
// ends with the joiner's connection (its next sync does not wait for it, and gives no
// hold up); the next sync of everyone else is ok and the producer names the killed joiner
// missed, nobody else; a new instance of it catches up from the replica again.
TEST(CatchUp, AJoinerKilledDuringItsCatchUpDisturbsNobody) {
  Cluster k;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  k.cons[1].reset();
  std::atomic<bool> armed{true};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    engine::TestHooks hooks;
    hooks.catch_up_offered = [&](uint64_t, int) {
      if (armed.exchange(false)) engine::TestAccess::simulate_crash(*k.cons[1]);
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start_consumer(1).ok());
  auto r = k.cons[1]->catch_up();
  ASSERT_FALSE(r.ok()) << "a crashed joiner caught up";
  EXPECT_FALSE(k.cons[1]->state().has_version);
  // The replica and the producer sync 2 without it.
  auto o2 = k.sync_with(2, {0});
  const auto& p2 = o2.p[0];
  const auto& c2 = o2.c[0];
  ASSERT_TRUE(c2->ok()) << c2->status().to_string();
  for (const ControlEvent& e : (*c2)->events)
    EXPECT_NE(e.kind, ControlKind::kCatchUp) << "the replica gave a hold up: " << e.message;
  k.expect_verified(0, 2);
  ASSERT_TRUE(p2->ok()) << p2->status().to_string();
  EXPECT_EQ((*p2)->missed, std::vector<int>{1}) << (*p2)->to_string();
  // A new instance of the joiner catches up to 2 from the replica, then everyone syncs.
  k.tweak_consumer = nullptr;
  k.cons[1].reset();
  ASSERT_TRUE(k.start_consumer(1).ok());
  expect_caught_up(k, 1, k.cons[1]->catch_up(), 2);
  k.expect_all_ok(k.sync(3), 3);
}

// A consumer that already holds a version and whose catch-up fails before it reads
// anything (its one source killed after the offer): its params are as they were, the
// version it held, whole (before, the failed catch-up took the last sync's writes for its
// own and said torn); and it serves that version again: a new instance of the killed
// source catches up from it.
TEST(CatchUp, AFailedCatchUpOfAHeldVersionLeavesItWholeAndServing) {
  Cluster k;
  std::atomic<bool> armed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    engine::TestHooks hooks;
    hooks.catch_up_offered = [&](uint64_t, int source) {
      if (armed.exchange(false)) engine::TestAccess::simulate_crash(*k.cons[static_cast<size_t>(source)]);
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  armed = true;
  auto r = k.cons[1]->catch_up();
  ASSERT_FALSE(r.ok()) << "caught up from a source killed at its offer";
  EXPECT_TRUE(has(r.status(), "consumer 0")) << r.status().to_string();
  EXPECT_FALSE(k.cons[1]->state().torn);
  k.expect_verified(1, 1);
  k.tweak_consumer = nullptr;
  k.cons[0].reset();
  ASSERT_TRUE(k.start_consumer(0).ok());
  auto back = k.cons[0]->catch_up();
  expect_caught_up(k, 0, back, 1);
  EXPECT_EQ(back->catch_up_source, 1);
}

// Nothing to catch up from: before any sync (no rank holds a version), and a rank whose
// plan class no other replica shares (tp=2, one replica): kNotFound, the params untouched,
// and the next sync serves it from the producers.
TEST(CatchUp, WithNoReplicaOfItsClassTheNextSyncServesIt) {
  Cluster k;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=2").ok());
  auto early = k.cons[1]->catch_up();
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), StatusCode::kNotFound) << early.status().to_string();
  EXPECT_TRUE(has(early.status(), "no other inference rank holds a version yet")) << early.status().to_string();
  k.expect_all_ok(k.sync(1), 1);
  k.cons[1].reset();
  ASSERT_TRUE(k.start_consumer(1).ok());
  auto r = k.cons[1]->catch_up();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().to_string();
  EXPECT_TRUE(has(r.status(), "no replica of its plan class holds the live version 1")) << r.status().to_string();
  EXPECT_FALSE(k.cons[1]->state().has_version);
  EXPECT_FALSE(k.cons[1]->state().torn);
  k.expect_all_ok(k.sync(2), 2);
}

// The hold, alone: an ask is offered while open (set and table as served), a DONE is
// answered intact; an ask of another version or plan, or while closed, is refused; a hold
// that close() gives up after its bound is named, and that joiner's DONE is answered
// revoked; a joiner that fails ends its hold at once (close returns without waiting).
TEST(ReplicaServer, HoldsTheLiveParamsUntilDoneAndGivesThemUpWhenClosed) {
  using engine::Replica;
  using engine::ReplicaServer;
  std::mutex mu;
  std::vector<std::pair<PeerId, Replica>> sent;
  std::condition_variable cv;
  ReplicaServer server(
      0, 77, [](int c) -> Result<PeerId> { return static_cast<PeerId>(100 + c); },
      [&](PeerId to, const Replica& m) {
        std::lock_guard<std::mutex> lk(mu);
        sent.emplace_back(to, m);
        cv.notify_all();
        return Status::Ok();
      });
  auto answer = [&](size_t n) {
    std::unique_lock<std::mutex> lk(mu);
    EXPECT_TRUE(cv.wait_for(lk, 10s, [&] { return sent.size() >= n; }));
    return sent.size() >= n ? sent[n - 1] : std::pair<PeerId, Replica>{};
  };
  server.serve(5, 1, 0xabc);
  server.on_message(101, Replica{1, 5, 77, Replica::kAsk, 0, 0});
  auto [to, offer] = answer(1);
  EXPECT_EQ(to, 101u);
  EXPECT_EQ(offer.kind, Replica::kOffer);
  EXPECT_EQ(offer.set, 1);
  EXPECT_EQ(offer.table, 0xabcu);
  EXPECT_EQ(server.holds(), 1u);
  server.on_message(101, Replica{1, 5, 77, Replica::kDone, 0, 0});
  EXPECT_EQ(answer(2).second.kind, Replica::kIntact);
  EXPECT_EQ(server.holds(), 0u);
  server.on_message(102, Replica{2, 4, 77, Replica::kAsk, 0, 0});  // another version
  EXPECT_EQ(answer(3).second.kind, Replica::kRefuse);
  server.on_message(102, Replica{2, 5, 78, Replica::kAsk, 0, 0});  // another plan class
  EXPECT_EQ(answer(4).second.kind, Replica::kRefuse);
  server.on_message(103, Replica{3, 5, 77, Replica::kAsk, 0, 0});
  EXPECT_EQ(answer(5).second.kind, Replica::kOffer);
  EXPECT_EQ(server.close(50ms), std::vector<int>{3});
  server.on_message(103, Replica{3, 5, 77, Replica::kDone, 0, 0});
  EXPECT_EQ(answer(6).second.kind, Replica::kRevoked);
  server.on_message(101, Replica{1, 5, 77, Replica::kAsk, 0, 0});  // closed
  EXPECT_EQ(answer(7).second.kind, Replica::kRefuse);
  server.serve(6, 0, 0xdef);
  server.on_message(101, Replica{1, 6, 77, Replica::kAsk, 0, 0});
  EXPECT_EQ(answer(8).second.kind, Replica::kOffer);
  server.peer_failed(101, peer_failed("gone"));
  EXPECT_TRUE(server.close(60s).empty());  // (the failed joiner's hold ended: no wait)
  // A joiner's side: an answer taken by kind; a failed source ends the wait with its failure.
  server.on_message(104, Replica{4, 6, 77, Replica::kRefuse, 0, 0});
  auto got = server.await_answer(104, {Replica::kOffer, Replica::kRefuse}, engine::Clock::now() + 10s, {});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->kind, Replica::kRefuse);
  server.peer_failed(104, peer_failed("source died"));
  auto failed = server.await_answer(104, {Replica::kIntact}, engine::Clock::now() + 10s, {});
  EXPECT_EQ(failed.status().code(), StatusCode::kPeerFailed);
}

}  // namespace
}  // namespace ferry::engine_tests
