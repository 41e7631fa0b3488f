// engine/push_writes.h — push: what a producer writes to one consumer per layer group
// (internal). A pure function of the routes, the holdings, the consumer's ParamTable
// (its lease) and the producer's in-place table, computed once per consumer instance
// and routes; the producer posts them (start_push) from its StagingRing's regions.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/in_place.h"
#include "ferry/route.h"

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
};

// Producer `rank`'s writes to consumer `c` per layer group under `routes`: the
// consumer's own schedule (make_consumer_schedule) rebuilt from its ParamTable, so both
// sides agree on which bytes land in params (and the consumer hashes and unpacks
// accordingly), with this producer's in-place runs (`in_place`, empty when it stages
// everything) written from the source regions. `holdings`: every producer's.
std::vector<std::vector<PushWrite>> push_writes(const Routes& routes, int rank, int c, const ParamTable& table,
                                                const std::vector<Holdings>& holdings, const InPlaceTable& in_place);

}  // namespace ferry::engine
