// engine/registered_buffer.h — zeroed host memory registered for peers' reads and
// writes, owned for the engine's staging and receive rings (internal), and where such
// memory comes from (RingMemory): a Transport (Transport::allocate_memory; over UCX
// shared memory, peers map such memory and copy directly), or plain heap memory where
// no peer reads it (unit tests of the engine's parts).
#pragma once

#include <cstddef>
#include <cstdint>

#include <memory>
#include <optional>
#include <string>

#include "ferry/device.h"
#include "ferry/transport.h"

namespace ferry::engine {

// Where a ring's host memory comes from and how peers reach it. Threading: as the
// implementation's (a Transport's calls may come from any thread).
class RingMemory {
 public:
  virtual ~RingMemory() = default;
  // At least `bytes` bytes of host memory, registered (its error names the bytes).
  virtual Result<MemoryRegion> allocate(uint64_t bytes) = 0;
  // Frees a region allocate() returned.
  virtual void release(const MemoryRegion& region) = 0;
  // The remote key of `region` (one allocate() returned, or the caller's registered
  // memory) for a peer to import.
  virtual Result<std::string> export_key(const MemoryRegion& region) = 0;
};

// RingMemory over a Transport, which must outlive it.
class TransportRingMemory final : public RingMemory {
 public:
  explicit TransportRingMemory(Transport& transport) : transport_(transport) {}
  Result<MemoryRegion> allocate(uint64_t bytes) override;
  void release(const MemoryRegion& region) override;
  Result<std::string> export_key(const MemoryRegion& region) override;

 private:
  Transport& transport_;
};

// Page-aligned heap memory that no peer can reach: its "keys" only name the region
// ("heap:<id>:<length>"). `live()` counts regions allocated and not yet released.
class HeapRingMemory final : public RingMemory {
 public:
  ~HeapRingMemory() override;
  Result<MemoryRegion> allocate(uint64_t bytes) override;
  void release(const MemoryRegion& region) override;
  Result<std::string> export_key(const MemoryRegion& region) override;
  size_t live() const { return live_; }

 private:
  uint64_t next_id_ = 1;
  size_t live_ = 0;
};

struct RegisteredBuffer {
  RingMemory* memory = nullptr;  // what `data` came from, until reset()
  std::byte* data = nullptr;
  uint64_t bytes = 0;
  MemoryRegion region;
  std::optional<Device> cuda_visible;  // also registered with this CUDA device (make_cuda_visible)
  RegisteredBuffer() = default;
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  ~RegisteredBuffer() { reset(); }
  // At least `n` bytes (rounded up to a page), zeroed, from `m` (which must outlive the
  // buffer's memory) or from transport `t`.
  Status allocate(RingMemory& m, uint64_t n);
  Status allocate(Transport& t, uint64_t n);
  // Lets kernels on `device` pack into / unpack from this buffer (ferry/device.h's
  // register_host_for_cuda), once; a second device is refused (one GPU per rank).
  Status make_cuda_visible(Device device);
  void reset();

 private:
  Status take(RingMemory& m, uint64_t n);
  std::unique_ptr<TransportRingMemory> own_memory_;  // allocate(Transport&)
};

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ferry::engine
