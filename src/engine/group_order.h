// engine/group_order.h — the order in which layer groups move in a sync (internal):
// each consumer's read order and each producer's pack order, worked out once from the
// routes. A pure function of the routes (no transport, no store, no thread): every
// participant computes the same order, as it computes the same routes, so nothing of it
// crosses the wire. docs/group-order.md is the design.
//
// The engine reads and packs in layer order by default (EngineOptions::group_order =
// kLayer): consumer.cpp's sync_groups walks g = 0..G-1 and producer.cpp's attempt packs
// its groups in the same order. Under pipeline parallelism a group's bytes leave only
// through its stage's trainer NICs, so in layer order about one stage sends at a time
// (issue 26). Under kRotated the consumer walks GroupOrder::consumer[rank] and each
// producer serves its reads in serve_waves' paced waves (producer.cpp).
//
// kRotated: the producers are split into *lanes*, the connected components of "serves a
// layer group with": under Megatron PP a lane is one pipeline stage, under pure DP or
// FSDP there is one lane (and the order is the layer order). Round r holds the r-th
// group (in layer order) of every lane that has one; each consumer belongs to a
// *cohort*, one per lane, and reads round 0's groups starting with its cohort's lane and
// going round, then round 1's the same way, and so on. At every step of a round with
// every lane, each lane serves one cohort, so every stage's producers send at once
// (uneven lanes leave the last rounds with fewer); cohorts are chosen from the routes so that
// within a cohort no producer serves more than its share (replicas of one rank, which
// read the same holder, go to different cohorts; so do EP ranks whose experts one
// trainer rank holds).
//
// Paced (the default with kRotated): a producer serves its reads (a consumer reading one
// of its groups) in the order of the step at which the consumer reads that group (the
// group's position in the consumer's order, counting served groups): those of the
// earliest step first, the next step's once every one of those finished reading from it,
// whichever group they read. Without it, cohorts that drift one step apart meet in one
// lane, share its producers, and stay together (stable: both slow down alike), and the
// sync is back in layer order's time; paced, the one ahead waits for its turn and the
// cohorts keep apart. (Pacing each group on its own is not enough: a cohort done with a
// round starts the lane's next group while the cohort behind still reads the lane's
// last one.) Every producer applies the same rule to the same order, with no message
// between producers.
//
// Invariants (checked by check_group_order, relied on by the producer's staging ring):
//   * every consumer's order holds every layer group exactly once;
//   * restricted to one producer's groups, every consumer's order is that producer's
//     pack order, which is ascending layer order: a lane's groups are read round by
//     round, so a producer still packs group g+n (n staging slots) once every reader
//     released group g, and packs each group exactly once per attempt;
//   * every consumer reads round r of every lane before round r+1 of any, and every
//     consumer's rounds cover the same steps: each wait (a consumer for a producer's
//     pack, a pack for a slot's release, a paced read for earlier steps' reads) is on a
//     strictly earlier step, so none is circular (no deadlock with one or more staging
//     slots).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/engine.h"
#include "ferry/route.h"
#include "ferry/status.h"

namespace ferry::engine {

// kLayer: every consumer in layer order; kRotated: cohorts start at different lanes and
// go round (above). The public enum (EngineOptions::group_order).
using ::ferry::GroupOrderKind;

struct GroupOrderOptions {
  GroupOrderKind kind = GroupOrderKind::kLayer;
  bool paced = true;  // kRotated: producers serve a group's readers step by step (above)
  // Per consumer (empty: none): its relay group (rendezvous.h, relay_groups: the lowest
  // consumer of its plan class relaying within its host), or -1. A group's consumers go
  // to one cohort, where only one of them loads the producers (the relay reads across
  // the network, the others copy from it): replicas on one host relay under the rotated
  // order too, instead of reading one holder at different times.
  std::vector<int> relay_group;
};
// "layer" | "rotated" | "rotated-unpaced"; kInvalidArgument naming them otherwise.
Result<GroupOrderOptions> parse_group_order(std::string_view text);
std::string group_order_name(const GroupOrderOptions& options);

struct GroupOrder {
  GroupOrderKind kind = GroupOrderKind::kLayer;
  bool paced = false;  // kRotated and GroupOrderOptions::paced
  // Per producer: its lane (-1: it serves no group). Lanes are numbered by their first
  // group in layer order.
  std::vector<int> lane_of_producer;
  // Per layer group: its lane (-1: no producer serves it).
  std::vector<int> lane_of_group;
  // Per lane: its groups in layer order.
  std::vector<std::vector<int>> lanes;
  // Per round: its groups, one per lane that has an r-th group, in lane order.
  std::vector<std::vector<int>> rounds;
  // Per consumer: its cohort, the lane its every round starts with (0 under kLayer).
  std::vector<int> cohort;
  // Per consumer: every layer group once, in the order it reads them. A group no
  // producer serves follows the group before it in layer order (it only post-processes).
  std::vector<std::vector<int>> consumer;
  // Per producer: the groups it serves, in the order it packs them.
  std::vector<std::vector<int>> producer;
  // Per consumer, per group: where the group stands in its order (its step).
  std::vector<std::vector<int>> step;

  int num_lanes() const { return static_cast<int>(lanes.size()); }
  // Its shape, as `ferry plan` and `ferry simulate` print it: groups per lane, lanes
  // per round, consumers per cohort; and the one line "L lanes of a/b groups, R rounds
  // of x/y lanes, cohorts of p/q consumers".
  std::vector<int> lane_sizes() const;
  std::vector<int> round_sizes() const;
  std::vector<int> cohort_sizes() const;
  std::string summary() const;
};

// One read a producer serves: consumer `consumer` reads group `group` from it.
struct ServedRead {
  int consumer = 0;
  int group = 0;
  friend bool operator==(const ServedRead&, const ServedRead&) = default;
};
// Producer p's reads (from the routes: every consumer that reads a group from it) in the
// waves it serves them in. Paced: one wave per step, ascending; a wave is served once
// every read of the waves before it finished. Otherwise: one wave per group in pack
// order, each served as soon as the group is packed (the engine today).
std::vector<std::vector<ServedRead>> serve_waves(const Routes& routes, const GroupOrder& order, int p);

// The order of `routes` (Routes::consumer_plan gives the consumers, Routes::producers the
// producers). Deterministic: the same routes and options give the same order everywhere.
GroupOrder make_group_order(const Routes& routes, const GroupOrderOptions& options = {});

// The invariants above, against `routes`: kInternal naming the consumer, producer and
// groups at fault.
Status check_group_order(const Routes& routes, const GroupOrder& order);

// What the order asks of the busiest producer and consumer at each step k, if every
// consumer read its k-th group at the same time (no rates: bytes). The sum over steps of
// max(busiest producer, busiest consumer) is the order's "lockstep" bytes; the layer
// order's is what `ferry simulate` calls groups in lockstep.
struct OrderStep {
  uint64_t max_producer_bytes = 0;
  uint64_t max_consumer_bytes = 0;
};
std::vector<OrderStep> order_steps(const Routes& routes, const GroupOrder& order);

}  // namespace ferry::engine
