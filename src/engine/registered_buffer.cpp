#include "engine/registered_buffer.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace ferry::engine {

Status RegisteredBuffer::allocate(Transport& t, uint64_t n) {
  reset();
  n = align_up(std::max<uint64_t>(n, 64), 4096);
  // Transport-allocated: over UCX shared memory, peers map it and copy directly.
  auto r = t.allocate_memory(n);
  if (!r.ok()) return r.status().with_context(fmt::format("allocating {} registered bytes", n));
  transport = &t;
  data = static_cast<std::byte*>(r->base);
  bytes = n;
  region = *r;
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
  if (data && transport) transport->deregister_memory(region).ignore();
  data = nullptr;
  bytes = 0;
  transport = nullptr;
}

}  // namespace ferry::engine
