#include "engine/cuda_ipc.h"

#include <unistd.h>

#include <random>

#include "common/host.h"
#include "engine/protocol.h"
#include "engine/schedule.h"
#include "ferry/device.h"

namespace ferry::engine {

std::string host_identity() { return common::this_host().host; }

uint64_t process_token() {
  static const uint64_t token = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  }();
  return token;
}

std::string encode_cuda_ipc(const CudaIpcExport& e) {
  return encode_fields({"ferry-cuda-ipc-2", e.host, u64_field(e.pid), u64_field(static_cast<uint64_t>(e.device)),
                        u64_field(e.ptr), u64_field(e.bytes), e.handle, u64_field(e.process)});
}

Result<CudaIpcExport> decode_cuda_ipc(std::string_view blob) {
  auto f = decode_fields(blob, 8);
  if (!f.ok()) return f.status().with_context("cuda ipc export");
  if ((*f)[0] != "ferry-cuda-ipc-2") return corrupt("cuda ipc export: not one");
  CudaIpcExport e;
  e.host = (*f)[1];
  uint64_t* fields[] = {&e.pid, nullptr, &e.ptr, &e.bytes};
  for (int k = 0; k < 4; ++k) {
    auto v = parse_u64_field((*f)[static_cast<size_t>(2 + k)]);
    if (!v.ok()) return v.status().with_context("cuda ipc export");
    if (k == 1) {
      if (*v > 1024) return corrupt("cuda ipc export: device {}", *v);
      e.device = static_cast<int>(*v);
    } else {
      *fields[k] = *v;
    }
  }
  e.handle = (*f)[6];
  auto token = parse_u64_field((*f)[7]);
  if (!token.ok()) return token.status().with_context("cuda ipc export");
  e.process = *token;
  if (e.handle.size() != kCudaIpcHandleBytes) {
    return corrupt("cuda ipc export: a handle of {} bytes, not {}", e.handle.size(), kCudaIpcHandleBytes);
  }
  return e;
}

Result<std::shared_ptr<std::byte>> map_cuda_ipc(const CudaIpcExport& e, Device device) {
  if (e.host != host_identity()) return unavailable("the producer's staging is on another host ({})", e.host);
  if (e.process == process_token()) {
    if (device.index != e.device) {
      return unavailable("the producer's staging is on cuda:{} of this process, the params on {}", e.device,
                         device_str(device));
    }
    return std::shared_ptr<std::byte>(reinterpret_cast<std::byte*>(e.ptr), [](std::byte*) {});
  }
  return cuda_ipc_open(device, e.handle);
}

Result<std::unique_ptr<CudaIpcLane>> CudaIpcLane::create(int rank, Device device, uint64_t ring_bytes) {
  auto dev = device_alloc(device, ring_bytes);
  if (!dev.ok()) return dev.status().with_context(fmt::format("consumer {}: the GPU receive ring", rank));
  return std::unique_ptr<CudaIpcLane>(new CudaIpcLane(rank, device, *dev, ring_bytes));
}

void CudaIpcLane::connect(int p, std::string_view exported) {
  Mapped m;
  if (!exported.empty()) {
    auto e = decode_cuda_ipc(exported);
    auto mapped = e.ok() ? map_cuda_ipc(*e, device_) : Result<std::shared_ptr<std::byte>>(e.status());
    if (mapped.ok()) {
      m.staging = *mapped;
      m.bytes = e->bytes;
    } else {
      m.why = mapped.status().message();
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  peers_[p] = std::move(m);
}

void CudaIpcLane::disconnect(int p) {
  std::lock_guard<std::mutex> lk(mu_);
  // Unmapped once no copy holds it (copy keeps a reference).
  if (auto it = peers_.find(p); it != peers_.end()) it->second.staging.reset();
}

bool CudaIpcLane::viable(int p) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(p);
  return it != peers_.end() && it->second.staging != nullptr;
}

std::string CudaIpcLane::why_not(int p) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(p);
  return it == peers_.end() ? std::string() : it->second.why;
}

Status CudaIpcLane::copy(int p, uint64_t remote, uint64_t ring_offset, uint64_t n, int group) {
  // From the producer's GPU staging, device to device (the slot was packed and
  // synchronised before it was announced).
  std::shared_ptr<std::byte> from;  // held for the copy: a failure may unmap it meanwhile
  uint64_t limit = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto it = peers_.find(p); it != peers_.end()) {
      from = it->second.staging;
      limit = it->second.bytes;
    }
  }
  if (!from) return peer_failed("consumer {} group {}: producer {} failed (its GPU staging is unmapped)", rank_, group, p);
  if (remote > limit || n > limit - remote) {
    return out_of_range("consumer {} group {}: bytes [{}, +{}) outside producer {}'s GPU staging of {} bytes", rank_,
                        group, remote, n, p, limit);
  }
  if (ring_offset > ring_bytes_ || n > ring_bytes_ - ring_offset) {
    return out_of_range("consumer {} group {}: bytes [{}, +{}) outside its GPU receive ring of {} bytes", rank_, group,
                        ring_offset, n, ring_bytes_);
  }
  return device_memcpy(ring_.get() + ring_offset, from.get() + remote, n)
      .with_context(fmt::format("consumer {} copying group {} from producer {}'s GPU staging", rank_, group, p));
}

Status CudaIpcLane::post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
                         std::vector<Completion>& /*ops: done on return*/) {
  const SubRead& sr = *t.read;
  if (sr.region >= 0 || sr.param)
    return invalid_argument("consumer {} group {}: the CUDA IPC lane moves staged bytes into the receive ring only", rank_,
                            t.group);
  return copy(t.producer, staging_offset + sr.remote + at, slot_offset + sr.recv_offset + at, n, t.group);
}

}  // namespace ferry::engine
