// engine/push_writes.h — push: what a producer writes to one consumer per layer group
// (internal), and the producer's push lane that posts them. What to write is a pure
// function of the routes, the holdings, the consumer's ParamTable (its lease) and the
// producer's in-place table, computed once per consumer instance and routes (the
// attempt plan keeps it, engine/sync_plan.h); post_push_writes moves those bytes from
// the StagingRing's regions.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/in_place.h"
#include "ferry/route.h"
#include "ferry/transport.h"

namespace ferry::engine {

// One write of a group to a consumer, from staging (region < 0: `local` is the group's
// staging offset) or in place from source region `region` at `local`, into its receive
// slot (param_key < 0: `remote` is the offset in the slot) or straight into a param
// (its registration `param_key` of the consumer's ParamTable at `remote`).
struct PushWrite {
  int32_t region = -1;
  uint64_t local = 0;
  int32_t param_key = -1;
  uint64_t remote = 0, length = 0;
  friend bool operator==(const PushWrite&, const PushWrite&) = default;
};

// Producer `rank`'s writes to consumer `c` per layer group under `routes`: the
// consumer's own schedule (make_consumer_schedule) rebuilt from its ParamTable, so both
// sides agree on which bytes land in params (and the consumer hashes and unpacks
// accordingly), with this producer's in-place runs (`in_place`, empty when it stages
// everything) written from the source regions. `holdings`: every producer's.
std::vector<std::vector<PushWrite>> push_writes(const Routes& routes, int rank, int c, const ParamTable& table,
                                                const std::vector<Holdings>& holdings, const InPlaceTable& in_place);

class StagingRing;

// Where one push's writes land on a consumer: its receive ring, the receive slot's
// offset in it, and its registered params' imported keys (by ParamTable key index; a
// write naming a key not there lands in the slot, as the consumer's schedule has it).
struct PushTarget {
  PeerId peer = 0;
  RemoteRegion recv;
  uint64_t slot_offset = 0;
  std::vector<RemoteRegion> params;
};

// The producer's push lane: posts `writes` of one group, from `staging` (the group's
// slot at `staging_offset` of the host ring, or the source regions served in place),
// into `to`, then flushes them. `first_error` runs once, at the first failure (a write
// or the flush; writes not posted yet are then not posted); `end` runs exactly once,
// after every posted write has completed and, with no error, the flush: with Ok or the
// first error. Until `end` runs, bytes may still land in the consumer's memory. Both
// may run on the transport's progress thread or on this one.
void post_push_writes(Transport& transport, const StagingRing& staging, uint64_t staging_offset,
                      const std::vector<PushWrite>& writes, const PushTarget& to,
                      std::function<void(const Status&)> first_error, std::function<void(const Status&)> end);

}  // namespace ferry::engine
