// Relay within a host (ConsumerOptions::relay, docs/relay.md), ranks as threads: every
// consumer of these tests is on this one host, so replicas of one rank form a relay
// group; its lowest rank reads each layer group from the producers, the others copy it
// from its receive ring. Every consumer verified bit for bit at every sync; the bytes
// each side reports say that each byte left the producers once per relay group.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "engine/engine_test_util.h"
#include "engine/group_order.h"
#include "engine/rendezvous.h"
#include "engine/testing.h"

namespace ferry::engine_tests {
namespace {

class EngineRelayTest : public EngineTest {};
// (The engine's suites run under relay too: their covering sets hold it, engine_test.cpp.)
// Every pair of transport, mode, in-place serving and group order with relay on.
INSTANTIATE_TEST_SUITE_P(Cover, EngineRelayTest,
                         ::testing::ValuesIn(covering_cases(plain({{"relay", {"on"}}, {"commit", {"in_place"}}}))),
                         case_name_of);

// Trainer tp=2 -> inference tp=2 x 2 replicas: consumers {0, 2} and {1, 3} are replicas
// of one rank each; 0 and 1 relay, 2 and 3 copy. The producers send each byte once.
TEST_P(EngineRelayTest, ReplicasCopyFromTheirRelay) {
  Cluster k(GetParam());
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2", R"({"num_hidden_layers": 4})").ok());
  const Routes& routes = k.prod[0]->routes();
  uint64_t relayed_out = 0, copied = 0;
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    uint64_t sent = 0, relays_got = 0;
    for (auto& p : o.p) sent += (**p).bytes_sent;
    for (int c = 0; c < 4; ++c) {
      const SyncReport& r = **o.c[static_cast<size_t>(c)];
      EXPECT_EQ(r.bytes_received, routes.stats.consumer_bytes[static_cast<size_t>(c)]) << "consumer " << c;
      EXPECT_EQ(r.received_into_params, 0u) << "under relay every byte passes the receive ring";
      if (c < 2) {
        EXPECT_EQ(r.received_via_relay, 0u) << "consumer " << c << " is a relay: " << r.to_string();
        relays_got += r.bytes_received;
        relayed_out += r.relayed_to_peers;
      } else {
        EXPECT_EQ(r.received_via_relay, r.bytes_received) << "consumer " << c << ": " << r.to_string();
        EXPECT_TRUE(r.bytes_per_peer.empty()) << "nothing from the producers: " << r.to_string();
        copied += r.received_via_relay;
      }
    }
    EXPECT_EQ(sent, relays_got) << "each byte left the producers once";
    EXPECT_EQ(2 * sent, routes.stats.bytes_moved);
  }
  // A relay counts what a member confirmed (its release may reach it after its own sync
  // ended: counted in its next report), so over the syncs it is at most what was copied.
  EXPECT_GT(relayed_out, 0u);
  EXPECT_LE(relayed_out, copied);
}

// With pipeline stages under the rotated order (issue 46), replicas relaying on one host
// share a cohort (rendezvous.h, relay_groups), so they read every group at the same step
// and the members copy it from their relay: each byte leaves the producers once per
// host, and both stages still send at once (the two ranks' relay groups take the two
// cohorts). Before, a rank's replicas went to different cohorts and each read for itself.
TEST(EngineRelay, ReplicasOnOneHostShareACohortAndRelayUnderPipelineStages) {
  for (Mode mode : {Mode::kPull, Mode::kPush}) {
    SCOPED_TRACE(mode == Mode::kPull ? "pull" : "push");
    Cluster k({Backend::kInproc, mode, false, true, false, true});
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1,pp=2", "tp=2,replicas=2", R"({"num_hidden_layers": 4})").ok());
    const Routes& routes = k.prod[0]->routes();
    engine::RouteInputs on_one_host;  // (what every rank read at rendezvous: all four relay here)
    on_one_host.relay_hosts.assign(4, "this host");
    const engine::GroupOrder order = engine::make_group_order(
        routes, {GroupOrderKind::kRotated, true, engine::relay_groups(on_one_host, routes.consumer_plan)});
    EXPECT_EQ(order.num_lanes(), 2);
    EXPECT_EQ(order.cohort[0], order.cohort[2]) << "replicas of rank 0 in one cohort";
    EXPECT_EQ(order.cohort[1], order.cohort[3]) << "replicas of rank 1 in one cohort";
    EXPECT_NE(order.cohort[0], order.cohort[1]) << "the two ranks' groups start at different stages";
    for (uint64_t v = 1; v <= 2; ++v) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      uint64_t sent = 0;
      for (auto& p : o.p) sent += (**p).bytes_sent;
      for (int c : {2, 3}) {
        const SyncReport& r = **o.c[static_cast<size_t>(c)];
        EXPECT_EQ(r.received_via_relay, r.bytes_received) << "consumer " << c << ": " << r.to_string();
      }
      EXPECT_EQ(2 * sent, routes.stats.bytes_moved) << "each byte left the producers once";
    }
  }
}

}  // namespace
}  // namespace ferry::engine_tests
