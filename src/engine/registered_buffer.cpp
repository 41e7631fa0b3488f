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

void RegisteredBuffer::reset() {
  if (data && transport) transport->deregister_memory(region).ignore();
  data = nullptr;
  bytes = 0;
  transport = nullptr;
}

}  // namespace ferry::engine
