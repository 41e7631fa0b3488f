// engine/receive_ring.h — a consumer's receive ring (internal): kReceiveSlots slots of
// slot_bytes each in registered host memory (what the transport lane reads into, what a
// relay's members copy from, what push producers write into), and, for an attempt that
// reads over CUDA IPC, the same slots in that lane's ring on the params' GPU. One slot
// index says where a group's bytes land this attempt, whichever ring holds them, so no
// step past the attempt's plan asks which lane moved them.
//
// Threading: set_slot_bytes and allocate at create; land_on by the sync thread between
// attempts (the unpack worker idle); the rest from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "engine/registered_buffer.h"
#include "engine/protocol.h"

namespace ferry::engine {

class ReceiveRing {
 public:
  static constexpr int kSlots = static_cast<int>(kReceiveSlots);

  // The slot size (the largest group this consumer's routes receive), before allocate.
  void set_slot_bytes(uint64_t n) { slot_bytes_ = n; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // The host ring from the transport (registered; exported in the lease).
  Status allocate(Transport& t) { return host_.allocate(t, slot_bytes_ * kSlots); }
  RegisteredBuffer& host() { return host_; }
  const RegisteredBuffer& host() const { return host_; }

  // Slot s's offset in either ring, and its host memory.
  uint64_t offset(int s) const { return static_cast<uint64_t>(s) * slot_bytes_; }
  std::byte* host_slot(int s) const { return host_.data + offset(s); }

  // This attempt's bytes land in `device_ring` (the CUDA IPC lane's ring, laid out
  // alike), or in the host ring when null.
  void land_on(const std::byte* device_ring) { device_.store(device_ring); }
  bool on_device() const { return device_.load() != nullptr; }
  // Slot s on the GPU this attempt, or null when the attempt lands on the host.
  const std::byte* device_slot(int s) const {
    const std::byte* d = device_.load();
    return d ? d + offset(s) : nullptr;
  }
  // Where slot s's bytes are this attempt (what unpack reads).
  const std::byte* landing(int s) const {
    const std::byte* d = device_slot(s);
    return d ? d : host_slot(s);
  }

 private:
  RegisteredBuffer host_;
  uint64_t slot_bytes_ = 0;
  std::atomic<const std::byte*> device_{nullptr};
};

}  // namespace ferry::engine
