// engine/delta_encoder.h — the producer's side of delta syncs (EngineOptions::delta,
// docs/delta.md): the kept copy (StagingRing::kept) laid out for the routes installed,
// the version each group holds there, and the patches of a group just packed. With delta
// off it keeps nothing and every group goes dense, so the sync loop asks it the same way
// either way. Internal.
//
// Threading: the producer's sync thread only (install between attempts, pack after
// StagingRing::pack). Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "engine/staging_ring.h"
#include "ferry/engine.h"
#include "ferry/route.h"

namespace ferry::engine {

// What DeltaEncoder::pack put in a slot: the version its patches are against (none:
// dense), each plan class's patch bytes (a class absent: dense), where the patches lie
// (the slot, or its patch area) and where the group's dense bytes lie (the kept copy, or
// the slot).
struct DeltaPack {
  std::optional<uint64_t> base;
  std::map<uint32_t, uint64_t> patch_bytes;
  uint64_t patch_offset = 0, dense_offset = 0;
  // Plan class `cls`'s patch bytes, if it has a patch.
  std::optional<uint64_t> bytes_for(uint32_t cls) const {
    auto it = patch_bytes.find(cls);
    if (!base || it == patch_bytes.end()) return std::nullopt;
    return it->second;
  }
  // Elements (blocks, under delta_block_bytes) compared, and of those changed: the
  // report's delta_elements / delta_changed.
  uint64_t compared = 0, changed = 0;
};

// The trainer's memory a producer serves in place (StagingRingOptions::source_regions):
// none where delta runs (rendezvous.h, delta_runs), as every byte is packed so that it can
// be patched.
std::vector<MemoryRegion> regions_served_in_place(const std::vector<MemoryRegion>& source_regions, bool delta);

class DeltaEncoder {
 public:
  // `staging` outlives this. Options read: delta, delta_block_bytes, delta_full_every.
  DeltaEncoder(StagingRing& staging, const EngineOptions& options);

  // The routes changed: the kept copy is laid out for `route` afresh, and nothing in it
  // is a base under the new routes.
  void install(const ProducerRoute& route);
  // A sync begins: every delta_full_every-th sends dense bytes only.
  void begin_sync();
  // Whether it keeps and patches at all (the options it was made with: delta_runs).
  bool on() const { return on_; }
  // An attempt begins: per consumer (Routes::consumer_plan), whether it is in it and
  // whether it is on this producer's host. The plan classes whose every consumer in the
  // attempt is on this host go dense (set_dense_classes), unless delta_same_host.
  void begin_attempt(const std::vector<uint32_t>& consumer_plan, const std::vector<bool>& members,
                     const std::vector<bool>& on_this_host);
  // The plan classes sent dense bytes this attempt: not encoded; a group whose every
  // segment is of such a class leaves the kept copy as it was and holds no base after.
  void set_dense_classes(std::set<uint32_t> classes) { dense_classes_ = std::move(classes); }
  // Group g of version v is packed (dense) in slot s. Per plan class segment: a patch
  // against the kept copy's version of it where one is kept (under these routes, of
  // another version, not a full sync) and smaller than the dense bytes; the kept copy
  // then takes the dense bytes (and the version v), and the slot the patch. Without a
  // kept copy (delta_block_bytes): the changed blocks into the slot's patch area, the
  // slot keeping the dense bytes. Delta off: nothing (dense).
  DeltaPack pack(int g, size_t s, uint64_t v, const ProducerGroup& grp);
  // Under delta_block_bytes: the heap its block hashes and its patch scratch hold now
  // (MemoryUse::kept_copy, beside the patch area; memory.h's delta_block_state_bytes
  // predicts it); 0 otherwise.
  uint64_t state_bytes() const;

 private:
  DeltaPack pack_blocks(int g, size_t s, uint64_t v, const ProducerGroup& grp);

  StagingRing& staging_;
  const bool on_;
  const bool same_host_;  // EngineOptions::delta_same_host: no class goes dense for being on this host
  const uint64_t block_bytes_, full_every_;
  // The kept copy laid out for the routes now installed (kept_at per group), whether
  // that fits the ring's kept area, and the version each group holds there (none: not
  // packed under these routes yet).
  bool fits_ = false;
  std::vector<uint64_t> kept_at_;
  std::vector<std::optional<uint64_t>> kept_version_;
  // delta_block_bytes > 0: per group, per segment, the block hashes of what it packed
  // last (no copy); the kept area is then a patch area, one slot's worth per slot.
  std::vector<std::vector<std::vector<uint64_t>>> kept_blocks_;
  std::vector<std::byte> scratch_;  // one segment's patch, before it goes into the slot
  uint64_t syncs_started_ = 0;
  bool full_sync_ = false;  // this sync sends dense bytes only
  std::set<uint32_t> dense_classes_;  // set_dense_classes
  // Whether every segment of `grp` is of a class sent dense (nothing to patch or keep).
  bool all_dense(const ProducerGroup& grp) const;
};

}  // namespace ferry::engine
