// engine/delta_applier.h — a consumer's side of delta syncs (internal): whether a patch
// of a layer group can be taken here, and applying one in the receive slot (its base
// gathered from the live params, then the patch). The producer's side is the
// DeltaEncoder (engine/delta_encoder.h). With delta off it takes no patch, so the
// consumer asks it either way.
//
// Threading: the consumer's sync thread only. Errors: kCorrupt (a patch that fails its
// structure or content hash; the caller repairs with the dense bytes), naming the
// consumer, the group and the producer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <vector>

#include "engine/param_set.h"
#include "ferry/route.h"

namespace ferry::engine {

class DeltaApplier {
 public:
  DeltaApplier(int rank, bool enabled) : rank_(rank), enabled_(enabled) {}

  // A new sync: every group's params still hold the version they held when it began.
  void begin_sync() { landed_.clear(); }
  // An attempt begins; `ring_on_device`: it receives into a GPU ring (CUDA IPC), where
  // no patch is applied (producers then send the dense bytes).
  void begin_attempt(bool ring_on_device) { on_device_ = ring_on_device; }
  // Group g was unpacked: its params no longer hold the version the sync began with.
  void landed(int g) {
    if (enabled_) landed_.insert(g);
  }

  // Whether a patch of group g against version `base` can be applied here: delta on, host
  // params whose live version is `base`, intact (not torn, not mixed, group g not
  // unpacked this sync), a host receive ring.
  bool takes_patch(const ParamSet& params, int g, uint64_t base) const;
  // Push: the version to ask producers for patches of group g against (READY), if any.
  std::optional<uint64_t> patch_base(const ParamSet& params, int g) const;

  // Applies the patch of `patch_bytes` that lies at the start of producer p's segment
  // (`read`) of group g in the receive slot `slot` (`group_bytes` long, laid out by
  // `unpack`): the segment's base is gathered from the live params, then patched; the
  // segment then holds the new bytes.
  Status apply(const ParamSet& params, const PlanRoute& unpack, int g, int p, const Read& read, uint64_t patch_bytes,
               uint64_t group_bytes, std::byte* slot);

 private:
  int rank_;
  bool enabled_;
  bool on_device_ = false;
  std::set<int> landed_;          // groups unpacked during this sync (any attempt)
  std::vector<std::byte> copy_;   // a patch moved out of the receive slot to be applied
};

}  // namespace ferry::engine
