// engine/staging_ring.h — where a producer stages its bytes (internal): the host ring
// peers read (pull) or the producer writes from (push), the optional GPU ring with its
// CUDA IPC export (ProducerOptions::staging_device), the in-place table of boxes served
// from the trainer's own memory (ProducerOptions::source_regions), and packing one
// layer group into one slot with its checksums. The producer's data plane: which slot a
// group goes to, who reads it and when it is free again stay in producer.cpp.
//
// Ownership: the ring owns its host memory (from a RingMemory: the transport in a
// producer, plain heap memory in tests) and its GPU memory. It borrows the RingMemory,
// the holdings and the caller's source regions (their memory): all must outlive it.
// Threading: not synchronised. create() and pack() run on one thread (the producer's
// caller); the const accessors may be called from any thread, and a slot's bytes may be
// read by peers while another slot is packed (the producer's slot protocol keeps a slot
// from being packed while it is read).
// Errors: Status naming the producer rank and the group, and where one is at fault the
// tensor (with its box), the staging device or the slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/in_place.h"
#include "engine/registered_buffer.h"
#include "engine/schedule.h"
#include "ferry/source.h"

namespace ferry::engine {

struct StagingRingOptions {
  int rank = 0;               // the producer's rank, named in errors
  uint64_t slot_bytes = 0;    // bytes per slot (staging_ring(), memory.h)
  int slots = 0;              // slots in the ring
  // ProducerOptions::staging_device: a CUDA device stages in its memory too (every box
  // must be on it; packed there, then each slot copied to the host ring).
  Device staging_device;
  // ProducerOptions::source_regions and direct_min_bytes: the in-place table.
  std::vector<MemoryRegion> source_regions;
  uint64_t direct_min_bytes = 0;
  bool checksums = true;      // EngineOptions::checksums: pack() returns them
  // Delta syncs (EngineOptions::delta): bytes after the slots in the same registered
  // host region for the producer's kept copy of what it packed last (peers read a
  // group's dense bytes there when they lack a patch's base). 0: none.
  uint64_t kept_bytes = 0;
};

class StagingRing final {
 public:
  // Per plan class: xxHash64 of the producer's segment as that class receives it.
  using Checksums = std::map<uint32_t, uint64_t>;

  // `staging_device` usable here (cuda_unusable); host is. kUnavailable naming the
  // option, the device and why. A local check for a producer to make before any
  // rendezvous.
  static Status check_device(int rank, Device staging_device);

  // Allocates and registers slots * slot_bytes of host memory from `memory` (zeroed;
  // its key exported) and, with a CUDA staging device, as many bytes there (exported
  // with CUDA IPC). With source regions, materialises every group of `source` once and
  // records which region holds each box (host memory, contiguous boxes only; the
  // regions' keys exported from `memory`). Errors: kInvalidArgument for an empty ring,
  // the allocation's, registration's or export's error.
  static Result<std::unique_ptr<StagingRing>> create(RingMemory& memory, WeightSource& source,
                                                     const Holdings& holdings, const StagingRingOptions& options);

  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Packs layer group `group` of `schedule` (ProducerGroupSchedule::pack: the boxes in
  // place are not packed) from `boxes` (WeightSource::materialize(group)) into slot
  // `slot`, and returns its checksums over ProducerGroupSchedule::checksum_spans (none
  // with options.checksums off). Boxes in GPU memory are packed by a kernel: into the
  // GPU ring and then copied to the host slot with a staging device, else straight into
  // the host slot (made visible to that device on the first such box, for the ring's
  // life). Errors: kOutOfRange for a group or slot out of range; kFailedPrecondition
  // for a group larger than a slot or an in-place box that moved since create();
  // kInvalidArgument for a box off the staging device; pack_group's errors (a box not
  // materialized, or of the wrong shape or dtype, naming the tensor) and CUDA's.
  Result<Checksums> pack(const ProducerSchedule& schedule, int group, size_t slot, const std::vector<LocalBox>& boxes);

  int slots() const { return slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // Offset of slot `s` in the host ring (what an Announce names).
  uint64_t slot_offset(size_t s) const { return static_cast<uint64_t>(s) * slot_bytes_; }
  // Host bytes of slot `s` (slot_bytes of them).
  std::span<std::byte> slot(size_t s) { return {host_.data + slot_offset(s), slot_bytes_}; }
  std::span<const std::byte> slot(size_t s) const { return {host_.data + slot_offset(s), slot_bytes_}; }
  // The kept copy (StagingRingOptions::kept_bytes) after the slots, in the same region:
  // its offset there (what an Announce's dense_offset adds a group's place to) and bytes.
  uint64_t kept_offset() const { return static_cast<uint64_t>(slots_) * slot_bytes_; }
  std::span<std::byte> kept() { return {host_.data + kept_offset(), kept_bytes_}; }
  uint64_t kept_bytes() const { return kept_bytes_; }
  // The registered host ring, its size as allocated, and its exported key.
  const MemoryRegion& host_region() const { return host_.region; }
  uint64_t host_bytes() const { return host_.bytes; }
  const std::string& host_key() const { return host_key_; }
  // Where a run of a group lies: the host ring for region < 0 (at slot_offset + the
  // run's offset), else source region `region` (at the run's offset). `region` must be
  // < source_regions.size().
  const MemoryRegion& region(int32_t region) const;
  // The boxes served in place (empty without source regions).
  const InPlaceTable& in_place() const { return in_place_; }
  // The GPU ring as a lease carries it (encode_cuda_ipc), or "" with host staging only.
  const std::string& cuda_ipc() const { return cuda_ipc_; }

 private:
  StagingRing(const Holdings& holdings, const StagingRingOptions& options);
  Status locate_in_place(RingMemory& memory, WeightSource& source);
  Status check_in_place(int group, const std::vector<LocalBox>& boxes) const;
  Checksums checksums(const ProducerGroupSchedule& gs, std::span<const std::byte> staging) const;

  const Holdings& holdings_;
  const int rank_;
  const uint64_t slot_bytes_;
  const int slots_;
  const Device staging_device_;
  const std::vector<MemoryRegion> source_regions_;
  const uint64_t direct_min_bytes_;
  const bool checksums_;
  const uint64_t kept_bytes_;
  RegisteredBuffer host_;
  std::string host_key_;
  std::shared_ptr<std::byte> device_;  // the GPU ring (host_.bytes), or null
  std::string cuda_ipc_;
  InPlaceTable in_place_;
};

}  // namespace ferry::engine
