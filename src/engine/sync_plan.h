// engine/sync_plan.h — one attempt of a sync, planned before it starts (internal). Pure
// functions of the schedule (engine/schedule.h), the routes, who takes part and each
// producer's lanes (engine/lane.h): no transport call, no store, no thread. Every
// decision the two sides used to make inline while moving bytes is made here once per
// attempt, so the producer and consumer only follow the plan and handle membership:
//   * consumer: which lane moves each transfer (CUDA IPC when every producer of the
//     attempt is mapped and nothing lands in place or in params, else the transport),
//     which transfers wait for an announcement (staged), which are read as soon as the
//     receive slot is ours (in place into the slot) and which are read ahead whenever
//     the consumer would otherwise wait (in place into params, lowest group first);
//     the relay lane's copy of each whole group (relay on, host ring) and, under delta,
//     the patch read of each producer's segment. The control plane decides only
//     whether to take those two (the relay offered the group; the producer sent a patch
//     against a version this consumer holds);
//   * producer: which consumers each group is packed for (the targets), and in push,
//     the writes to each of them, reused from the previous attempt's plan for a consumer
//     instance and routes already planned.
// sync_plan_test.cpp runs plans against a fake lane and checks every consumer's params
// equal a direct load.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/in_place.h"
#include "engine/lane.h"
#include "engine/push_writes.h"
#include "engine/schedule.h"

namespace ferry::engine {

// ---------------------------------------------------------------------------------------
// Consumer.

// A transfer whose read the plan made (not one of the schedule's): `transfer.read`
// points at `read`, so a PlannedRead is never copied (ConsumerAttemptPlan is move-only).
struct PlannedRead {
  SubRead read;
  Transfer transfer;
};

struct ConsumerGroupPlan {
  std::vector<int> from;  // producers with bytes for the group, ascending
  // Per producer, in schedule order:
  std::map<int, std::vector<Transfer>> staged;     // from its staging: after it announced the group
  std::map<int, std::vector<Transfer>> to_slot;    // in place into the receive slot: once the slot is ours
  std::map<int, std::vector<Transfer>> to_params;  // in place into params: read ahead (see above)
  // The relay lane's copy of the group's receive-slot bytes from the slot this host's
  // relay offers (none without a relay lane, or when the attempt lands on the GPU).
  std::unique_ptr<PlannedRead> relayed;
  // Delta, per producer whose segment of the group is one read: that segment's bytes
  // as a patch, from where the producer staged the patch (its announcement's offset) into
  // the segment's place in the slot. A patch is read for its length (<= the segment's).
  std::map<int, std::unique_ptr<PlannedRead>> patch;
};

struct ConsumerAttemptPlan {
  std::vector<ConsumerGroupPlan> groups;  // per layer group
  // Every staged transfer goes by the CUDA IPC lane: groups land in (and are unpacked
  // from) its device receive ring.
  bool cuda_ipc = false;
  // For the report: producers whose GPU staging was offered but is not mapped here, why.
  std::vector<std::string> notes;
  uint64_t transfers() const;  // how many, all groups
};

// `ipc`: the consumer's CUDA IPC lane (null: none). `rank` names it in notes. `route`
// (the consumer's plan route, null: no patch reads) gives each group's slot bytes and
// its producers' segments; `relay`: its relay lane (null: relay off).
ConsumerAttemptPlan make_consumer_attempt_plan(int rank, const ConsumerSchedule& schedule, const Lane* ipc,
                                               const PlanRoute* route = nullptr, const Lane* relay = nullptr);

// The read-ahead backlog from the moment producer p is known to be in the sync (its
// first announcement, at group `group`): its in-place transfers into params of groups
// `group` and later, lowest group first (the consumer posts them a chunk at a time while
// it has nothing else to do, and what is left of a group before it hands it to unpack).
std::vector<const Transfer*> read_ahead(const ConsumerAttemptPlan& plan, int p, int group);

// ---------------------------------------------------------------------------------------
// Producer.

struct ProducerGroupPlan {
  std::vector<int> targets;  // member consumers whose plan class the group serves, ascending
};

struct ProducerAttemptPlan {
  uint64_t routes_hash = 0;
  std::vector<ProducerGroupPlan> groups;  // per layer group
  // Push, per member consumer: the lease instance its writes were planned for, and its
  // writes per layer group (engine/push_writes.h); shared with later plans that reuse them.
  struct Writes {
    std::string instance;
    std::shared_ptr<const std::vector<std::vector<PushWrite>>> by_group;
  };
  std::map<int, Writes> writes;
  // Consumer c's writes of group g; empty when there are none.
  const std::vector<PushWrite>& writes_of(int c, int g) const;
  uint64_t heap_bytes() const;  // for MemoryUse
};

struct ProducerPlanInputs {
  const Routes* routes = nullptr;
  uint64_t routes_hash = 0;
  int rank = 0;
  const ProducerSchedule* schedule = nullptr;
  // Per consumer: takes part in this attempt (a live member that has not committed it).
  std::vector<bool> members;
  bool push = false;
  // Push, per consumer (null / "" for non-members): its lease's ParamTable and the
  // lease it came from (the instance). Writes of an instance already planned under the
  // same routes are taken from `previous` rather than rebuilt.
  std::vector<const ParamTable*> tables;
  std::vector<std::string> instances;
  const std::vector<Holdings>* holdings = nullptr;  // every producer's
  const InPlaceTable* in_place = nullptr;           // this producer's (empty: all staged)
  const ProducerAttemptPlan* previous = nullptr;
};

ProducerAttemptPlan make_producer_attempt_plan(const ProducerPlanInputs& in);

}  // namespace ferry::engine
