// engine/registered_buffer.h — zeroed host memory allocated and registered by a
// Transport (Transport::allocate_memory), owned for the engine's staging and receive
// rings (internal). Over UCX shared memory, peers map such memory and copy directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include <optional>

#include "ferry/device.h"
#include "ferry/transport.h"

namespace ferry::engine {

struct RegisteredBuffer {
  Transport* transport = nullptr;
  std::byte* data = nullptr;
  uint64_t bytes = 0;
  MemoryRegion region;
  std::optional<Device> cuda_visible;  // also registered with this CUDA device (make_cuda_visible)
  RegisteredBuffer() = default;
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  ~RegisteredBuffer() { reset(); }
  // At least `n` bytes (rounded up to a page), zeroed.
  Status allocate(Transport& t, uint64_t n);
  // Lets kernels on `device` pack into / unpack from this buffer (ferry/device.h's
  // register_host_for_cuda), once; a second device is refused (one GPU per rank).
  Status make_cuda_visible(Device device);
  void reset();
};

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ferry::engine
