// engine/schedule.h — what each side does per layer group of a sync, worked out once
// from the routes (internal). Pure functions of the routes, the holdings, the
// producers' in-place tables and the consumer's registered params: no transport call,
// no store, no thread. Producer, consumer and `ferry bench` all take their slot sizes,
// pack lists, read lists and checksum layouts from here, so the two sides of a sync
// agree by construction (schedule_test.cpp checks them against each other).
//
// Vocabulary: a *layer group* is one step of a sync (Routes::group_names); a
// *post-processing group* is a loader's unit of process_weights_after_loading
// (RankLoader::groups()), run once every param it covers has landed.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "engine/in_place.h"
#include "ferry/engine.h"

namespace ferry::engine {

// ---------------------------------------------------------------------------------------
// Slot sizes.

// A ring slot for `largest` bytes (at least 64, 64-byte aligned).
uint64_t slot_bytes_for(uint64_t largest);
// The consumer's receive slot: its plan class's largest group (any routing of the same
// plans reads the same bytes per group, so failover never needs a larger one).
uint64_t consumer_slot_bytes(const PlanRoute& plan_route);
// Producer `rank`'s staging slot: its largest group under `routes`; with failover, for
// each group with boxes it shares with another producer (a replica it may take over
// from), the worst case: its staging now plus every plan class reading all of those
// shared boxes (what it alone holds is staged under any routes).
uint64_t producer_slot_bytes(const Routes& routes, int rank, const std::vector<TensorDecl>& metadata,
                             const std::vector<Holdings>& holdings, bool failover);
// Per producer, per layer group: the bytes of its boxes that another producer also holds
// (what a failover may move to it). One pass over every box.
std::vector<std::vector<uint64_t>> shared_held_bytes(const std::vector<TensorDecl>& metadata,
                                                     const std::vector<Holdings>& holdings);
// The same slot from that producer's row of shared_held_bytes (empty without failover).
uint64_t producer_slot_bytes(const Routes& routes, int rank, const std::vector<uint64_t>& shared, bool failover);

// Delta syncs (EngineOptions::delta): where each layer group of a producer's route lies
// in its kept copy (64-byte aligned, in group order), and the copy's bytes (the last
// entry: one past every group).
std::vector<uint64_t> kept_layout(const ProducerRoute& route);
inline uint64_t kept_copy_bytes(const ProducerRoute& route) { return kept_layout(route).back(); }
// The one read of a plan class's group from `producer` (its segment: what one patch
// covers), or nullptr when there is none or several.
const Read* single_read_from(const PlanGroup& group, uint32_t producer);

// ---------------------------------------------------------------------------------------
// Checksums (EngineOptions::checksums): xxHash64 over the bytes of one producer's
// segment for one plan class, in staging order, wherever each piece lies.
class SegmentHash {
 public:
  SegmentHash();
  ~SegmentHash();
  SegmentHash(const SegmentHash&) = delete;
  SegmentHash& operator=(const SegmentHash&) = delete;
  void update(const std::byte* data, uint64_t bytes);
  uint64_t digest() const;

 private:
  void* state_;
};

// A run of a producer's segment as it is hashed: staging bytes (region < 0, `offset`
// into the group's staging) or source-region bytes served in place.
struct SegmentSpan {
  int32_t region = -1;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// ---------------------------------------------------------------------------------------
// Producer.

struct ProducerGroupSchedule {
  // The group's route with the packs of in-place runs removed: what pack_group packs.
  ProducerGroup pack;
  // Staging runs consumers read from the source regions instead (sorted, disjoint).
  std::vector<InPlacePiece> in_place;
  // Per plan class: bytes this producer serves in the group, and of those in place.
  std::map<uint32_t, uint64_t> served;
  std::map<uint32_t, uint64_t> served_in_place;
  // Per plan class: the spans its checksum covers, in staging order.
  std::map<uint32_t, std::vector<SegmentSpan>> checksum_spans;
};

struct ProducerSchedule {
  std::vector<ProducerGroupSchedule> groups;  // per layer group
};

// kFailedPrecondition when a group needs more staging than `slot_bytes` (0: unchecked).
Result<ProducerSchedule> make_producer_schedule(const Routes& routes, int rank, const Holdings& holdings,
                                                const InPlaceTable& in_place, uint64_t slot_bytes);

// ---------------------------------------------------------------------------------------
// Consumer.

// One read (or part of one): receive bytes [recv_offset, +length) of the layer group,
// from the producer's staging at Read::offset + (recv_offset - Read::recv_offset),
// landing in the receive slot (param == nullptr) or at param_offset of a param: `param`
// is its placement (registration index, offset, bytes: no address), which the
// consumer's ParamSet turns into memory (engine/param_set.h) and a push producer into a
// remote key and offset (the consumer's lease's ParamTable).
// region >= 0: the bytes come from the producer's source region `region` at `remote`
// (served in place), not from its staging.
struct SubRead {
  uint32_t read = 0;  // index into PlanGroup::reads
  uint64_t recv_offset = 0, length = 0;
  const ParamTable::Param* param = nullptr;
  uint64_t param_offset = 0;
  int32_t region = -1;
  uint64_t remote = 0;  // region offset (region >= 0) or group staging offset
  uint32_t producer = 0;
};

struct ConsumerGroupSchedule {
  std::vector<SubRead> reads;
  // Per producer: indices into `reads` in staging order (what its checksum covers).
  std::map<int, std::vector<uint32_t>> checksum_order;
  uint64_t received = 0, direct = 0;  // bytes, and of those read straight into params
  std::map<int, uint64_t> received_from;  // producer -> bytes (every producer with bytes for the group)
  std::vector<int> post_groups;  // post-processing groups complete after this group
};

struct ConsumerSchedule {
  std::vector<ConsumerGroupSchedule> groups;  // per layer group
  // The order the consumer reads its layer groups in (ConsumerScheduleInputs::order;
  // layer order without one).
  std::vector<int> order;
  PlanRoute unpack;                           // the plan route less what lands in params directly
};

struct ConsumerScheduleInputs {
  const Routes* routes = nullptr;
  int rank = 0;
  // Zero copy: a piece of a read that unpacks as a plain byte copy (same dtype,
  // contiguous destination, not shared with another unpack) of at least this many bytes
  // is read (pull) or written by the producer (push) straight into the param's memory;
  // the rest goes through the receive ring and is unpacked on the consumer's background
  // thread. This saves one full copy of almost every byte (routes lay segments out in
  // destination order, so most pieces are contiguous runs of a param).
  uint64_t direct_min_bytes = 0;
  // Placements of the params that may be landed in directly, by name (ParamSet::placements
  // on the consumer, the lease's ParamTable::params on a push producer); SubRead::param
  // points into this map (keep it alive).
  const std::map<std::string, ParamTable::Param>* params = nullptr;
  const std::vector<Holdings>* holdings = nullptr;  // per producer
  // Per producer: its in-place table when its source regions are imported; null: staged.
  std::vector<const InPlaceTable*> in_place;
  // Post-processing: param name -> its post-processing group (-1: none), and how many
  // groups there are. Empty: no post-processing.
  std::map<std::string, int> post_group_of;
  size_t num_post_groups = 0;
  // The consumer's order of the layer groups (engine/group_order.h); null: layer order. A
  // post-processing group completes after the last group in this order that writes one
  // of its params.
  const std::vector<int>* order = nullptr;
};

ConsumerSchedule make_consumer_schedule(const ConsumerScheduleInputs& in);

// CommitPolicy::kGroups: the bounded shadow a consumer's sync lands in, and when each
// layer group's params are made live. A *commit unit* is a post-processing group
// (`post_group_of`: param -> unit; a param without one is a unit of its own): its params
// are made live together, after the last layer group in `order` (null: layer order)
// that writes one of them, once post-processed. A param the routes write (an unpack of
// `plan_route`; every byte goes through the receive ring under this policy) holds room
// in the shadow from the first layer group that writes it until its unit is made live;
// params whose times overlap get disjoint room (first fit, 64-byte aligned), host and
// device params each in their own shadow (`on_device`, per plan_route.params; empty: all
// on the host). Pure; used by the consumer (ParamSet::set_group_shadow) and
// predict_memory alike, so the shadow's size is predicted exactly.
struct GroupShadow {
  static constexpr uint64_t kNone = ~0ull;
  std::vector<uint64_t> offset;  // per plan_route.params: in its shadow; kNone: the routes never write it
  std::vector<bool> on_device;   // per plan_route.params
  // Per position in the order: params whose room opens there (written first there, so
  // filled from the live params before that group is unpacked), params made live
  // after it, and the units those make up (post-processing groups; a param alone is
  // -1 - its index).
  std::vector<std::vector<uint32_t>> opens, commits;
  std::vector<std::vector<int>> units;
  uint64_t host_bytes = 0, device_bytes = 0;  // each shadow's size: its peak
};
GroupShadow group_shadow_layout(const PlanRoute& plan_route, const std::vector<int>* order,
                                const std::map<std::string, int>& post_group_of, const std::vector<bool>& on_device);

}  // namespace ferry::engine
