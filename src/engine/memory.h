// engine/memory.h — what the engine's own memory costs (internal): ring sizes as the
// engine allocates them, and the heap bytes of its metadata (routes, plans, holdings,
// schedules) estimated from element counts. Producer, Consumer, predict_memory and
// `ferry bench` take their MemoryUse figures from here, so prediction and report agree.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/schedule.h"
#include "ferry/engine.h"

namespace ferry::engine {

// Bytes RegisteredBuffer::allocate(n) really takes (at least 64, whole pages).
uint64_t registered_bytes(uint64_t n);

// A producer's staging slots (StagingRing's size, engine/staging_ring.h): `needed` is the slot its largest group needs under the
// routes now, `worst` the slot a failover may need (producer_slot_bytes). No budget: two
// worst-case slots. A budget that holds a worst-case slot: as many of those as fit (at
// most 64). A budget between one needed slot and one worst-case slot: slots as large as
// two fit in it (at least `needed`): within the budget, and a failover that needs more
// fails that sync naming the bytes. Smaller than `needed`: kInvalidArgument naming the
// bytes needed.
struct StagingSlots {
  uint64_t slot_bytes = 0;
  int slots = 0;
};
Result<StagingSlots> staging_ring(int rank, uint64_t needed, uint64_t worst, uint64_t staging_budget);
// The bytes a producer keeps after its slots for delta syncs (StagingRingOptions::
// kept_bytes, MemoryUse::kept_copy): none without `options.delta`, a patch area as large
// as the slots with `delta_block_bytes`, else the kept copy of what `route` stages.
uint64_t delta_kept_bytes(const EngineOptions& options, const ProducerRoute& route, const StagingSlots& slots);
// With `delta_block_bytes`: the heap a producer keeps beside that patch area (in
// MemoryUse::kept_copy): an XXH3-64 per block of every segment `route` stages, and one
// segment's patch while it is encoded (DeltaEncoder::state_bytes, as built). 0 otherwise.
uint64_t delta_block_state_bytes(const EngineOptions& options, const ProducerRoute& route);
// A glibc malloc block for n bytes: 8 bytes of header, 16-byte granules, 32 at least (0
// for none): how the estimates here count each heap allocation.
inline uint64_t heap_block_bytes(uint64_t n) { return n ? std::max<uint64_t>(32, (n + 8 + 15) / 16 * 16) : 0; }

// The router options a rank builds its routes with: its own ops and those it derives its
// peers' reads from. A producer: its packs, and in push mode every plan class's unpacks
// (the reads into params it writes, push_writes). A consumer: its plan class's unpacks
// and every producer's packs (the pieces a producer serves in place, in_place_pieces).
RouterOptions producer_router_options(const EngineOptions& options, int rank);
RouterOptions consumer_router_options(const EngineOptions& options, int rank);
// kInternal naming what is missing where `routes` lack an op `options` asked for (a rank
// must never derive reads from ops it elided: they would be silently empty).
Status check_routes_hold(const Routes& routes, const RouterOptions& options);

// Heap bytes (malloc blocks included) of the metadata a rank keeps after rendezvous:
// the trainer's metadata, every producer's holdings, every consumer's plan, the routes.
uint64_t metadata_heap_bytes(const Routes& routes, const std::vector<TensorDecl>& metadata,
                             const std::vector<Holdings>& holdings, const std::vector<const Plan*>& plans);
uint64_t metadata_heap_bytes(const Routes& routes, const std::vector<TensorDecl>& metadata,
                             const std::vector<Holdings>& holdings, const std::vector<Plan>& plans);
// ... of one consumer plan (what recording it holds: `ferry plan --every-rank` records one
// per inference rank, and refuses what would not fit before it starts).
uint64_t plan_heap_bytes(const Plan& plan);
// ... and of a rank's schedule (what make_*_schedule built).
uint64_t schedule_heap_bytes(const ProducerSchedule& s);
uint64_t schedule_heap_bytes(const ConsumerSchedule& s);
// A producer's schedule before it is built: about its own route (prediction).
uint64_t predicted_schedule_bytes(const ProducerRoute& route);
uint64_t predicted_schedule_bytes(const PlanRoute& route);

}  // namespace ferry::engine
