// engine/registered_buffer.h — zeroed host memory allocated and registered by a
// Transport (Transport::allocate_memory), owned for the engine's staging and receive
// rings (internal). Over UCX shared memory, peers map such memory and copy directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/transport.h"

namespace ferry::engine {

struct RegisteredBuffer {
  Transport* transport = nullptr;
  std::byte* data = nullptr;
  uint64_t bytes = 0;
  MemoryRegion region;
  RegisteredBuffer() = default;
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  ~RegisteredBuffer() { reset(); }
  // At least `n` bytes (rounded up to a page), zeroed.
  Status allocate(Transport& t, uint64_t n);
  void reset();
};

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ferry::engine
