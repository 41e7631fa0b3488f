#include "engine/registered_buffer.h"

#include <algorithm>
#include <cstring>
#include <new>

#include <fmt/format.h>

namespace ferry::engine {

Result<MemoryRegion> TransportRingMemory::allocate(uint64_t bytes) {
  // Transport-allocated: over UCX shared memory, peers map it and copy directly.
  auto r = transport_.allocate_memory(bytes);
  if (!r.ok()) return r.status().with_context(fmt::format("allocating {} registered bytes", bytes));
  return r;
}

void TransportRingMemory::release(const MemoryRegion& region) { transport_.deregister_memory(region).ignore(); }

Result<std::string> TransportRingMemory::export_key(const MemoryRegion& region) {
  FERRY_ASSIGN_OR_RETURN(auto key, transport_.export_key(region));
  return std::string(reinterpret_cast<const char*>(key.data()), key.size());
}

HeapRingMemory::~HeapRingMemory() = default;

Result<MemoryRegion> HeapRingMemory::allocate(uint64_t bytes) {
  void* p = ::operator new(bytes, std::align_val_t{4096}, std::nothrow);
  if (p == nullptr) return unavailable("allocating {} heap bytes: out of memory", bytes);
  ++live_;
  MemoryRegion r;
  r.id = next_id_++;
  r.base = p;
  r.length = bytes;
  return r;
}

void HeapRingMemory::release(const MemoryRegion& region) {
  ::operator delete(region.base, std::align_val_t{4096});
  --live_;
}

Result<std::string> HeapRingMemory::export_key(const MemoryRegion& region) {
  return fmt::format("heap:{}:{}", region.id, region.length);
}

Status RegisteredBuffer::allocate(RingMemory& m, uint64_t n) {
  reset();
  return take(m, n);
}

Status RegisteredBuffer::allocate(Transport& t, uint64_t n) {
  reset();
  own_memory_ = std::make_unique<TransportRingMemory>(t);
  return take(*own_memory_, n);
}

Status RegisteredBuffer::take(RingMemory& m, uint64_t n) {
  n = align_up(std::max<uint64_t>(n, 64), 4096);
  FERRY_ASSIGN_OR_RETURN(region, m.allocate(n));
  memory = &m;
  data = static_cast<std::byte*>(region.base);
  bytes = n;
  std::memset(data, 0, n);
  return Status::Ok();
}

Status RegisteredBuffer::make_cuda_visible(Device device) {
  if (cuda_visible) {
    if (*cuda_visible == device) return Status::Ok();
    return invalid_argument("a rank's tensors on {} and {}: ferry stages for one GPU per rank",
                            device_str(*cuda_visible), device_str(device));
  }
  if (data == nullptr) return failed_precondition("make_cuda_visible: the buffer is not allocated");
  FERRY_RETURN_IF_ERROR(register_host_for_cuda(device, data, bytes));
  cuda_visible = device;
  return Status::Ok();
}

void RegisteredBuffer::reset() {
  if (data && cuda_visible) unregister_host_for_cuda(data);
  cuda_visible.reset();
  if (data && memory) memory->release(region);
  data = nullptr;
  bytes = 0;
  memory = nullptr;
  own_memory_.reset();
}

}  // namespace ferry::engine
