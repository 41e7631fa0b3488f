#include "engine/staging_ring.h"

#include <unistd.h>

#include <fmt/format.h>

#include "engine/cuda_ipc.h"
#include "ferry/device.h"

namespace ferry::engine {

Status StagingRing::check_device(int rank, Device staging_device) {
  if (!staging_device.is_cuda()) return Status::Ok();
  if (auto why = cuda_unusable(staging_device)) {
    return unavailable("producer {}: staging_device {} cannot be used here: {}", rank, device_str(staging_device),
                       *why);
  }
  return Status::Ok();
}

StagingRing::StagingRing(const Holdings& holdings, const StagingRingOptions& o)
    : holdings_(holdings),
      rank_(o.rank),
      slot_bytes_(o.slot_bytes),
      slots_(o.slots),
      staging_device_(o.staging_device),
      source_regions_(o.source_regions),
      direct_min_bytes_(o.direct_min_bytes),
      checksums_(o.checksums),
      kept_bytes_(o.kept_bytes) {}

Result<std::unique_ptr<StagingRing>> StagingRing::create(RingMemory& memory, WeightSource& source,
                                                         const Holdings& holdings, const StagingRingOptions& o) {
  if (o.slots <= 0 || o.slot_bytes == 0)
    return invalid_argument("producer {}: a staging ring of {} slots of {} bytes", o.rank, o.slots, o.slot_bytes);
  std::unique_ptr<StagingRing> ring(new StagingRing(holdings, o));
  if (!o.source_regions.empty()) FERRY_RETURN_IF_ERROR(ring->locate_in_place(memory, source));
  const uint64_t ring_bytes = o.slot_bytes * static_cast<uint64_t>(o.slots);
  FERRY_RETURN_IF_ERROR(ring->host_.allocate(memory, ring_bytes + o.kept_bytes));
  FERRY_ASSIGN_OR_RETURN(ring->host_key_, memory.export_key(ring->host_.region));
  if (o.staging_device.is_cuda()) {
    // The same layout as the host ring, exported with CUDA IPC for consumers on this
    // host with GPU params (ConsumerOptions::cuda_ipc).
    auto dev = device_alloc(o.staging_device, ring_bytes);  // the slots (the kept copy stays on the host)
    if (!dev.ok()) return dev.status().with_context(fmt::format("producer {}: GPU staging ring", o.rank));
    ring->device_ = *dev;
    auto handle = cuda_ipc_export(o.staging_device, ring->device_.get());
    if (!handle.ok()) return handle.status().with_context(fmt::format("producer {}: GPU staging ring", o.rank));
    ring->cuda_ipc_ = encode_cuda_ipc(CudaIpcExport{host_identity(), static_cast<uint64_t>(getpid()), process_token(),
                                                    o.staging_device.index,
                                                    reinterpret_cast<uint64_t>(ring->device_.get()), ring_bytes,
                                                    *handle});
  }
  return ring;
}

const MemoryRegion& StagingRing::region(int32_t region) const {
  return region < 0 ? host_.region : source_regions_[static_cast<size_t>(region)];
}

// Materialises every group once and records which source region holds each box
// (contiguous boxes only); exports the regions' keys.
Status StagingRing::locate_in_place(RingMemory& memory, WeightSource& source) {
  InPlaceTable t;
  t.min_bytes = direct_min_bytes_;
  t.boxes.resize(holdings_.boxes.size());
  for (const MemoryRegion& r : source_regions_) {
    FERRY_ASSIGN_OR_RETURN(auto key, memory.export_key(r));
    t.keys.push_back(std::move(key));
  }
  const Groups groups(source.metadata());
  for (int g = 0; g < groups.size(); ++g) {
    auto boxes = source.materialize(g);
    if (!boxes.ok()) return boxes.status().with_context(fmt::format("producer {} materialize group {}", rank_, g));
    for (const LocalBox& lb : *boxes) {
      if (lb.box >= t.boxes.size() || !lb.data.is_real() || !lb.data.is_contiguous()) continue;
      // A box in GPU memory is packed on the device, never served in place (as GPU
      // params are never read into: consumer.cpp); host regions only.
      if (!lb.data.device().is_host()) continue;
      auto ptr = lb.data.data_ptr();
      if (!ptr.ok()) continue;
      const uint64_t bytes = static_cast<uint64_t>(lb.data.numel()) * dtype_size(lb.data.dtype());
      for (size_t r = 0; r < source_regions_.size(); ++r) {
        if (source_regions_[r].kind != MemoryKind::kHost) continue;
        const auto* base = static_cast<const std::byte*>(source_regions_[r].base);
        if (*ptr >= base && *ptr + bytes <= base + source_regions_[r].length) {
          t.boxes[lb.box] = InPlaceTable::At{static_cast<int32_t>(r), static_cast<uint64_t>(*ptr - base)};
          break;
        }
      }
    }
  }
  in_place_ = std::move(t);
  return Status::Ok();
}

// In place: the boxes of group g must be where create() found them.
Status StagingRing::check_in_place(int g, const std::vector<LocalBox>& boxes) const {
  if (in_place_.empty()) return Status::Ok();
  for (const LocalBox& lb : boxes) {
    if (lb.box >= in_place_.boxes.size() || in_place_.boxes[lb.box].region < 0) continue;
    const InPlaceTable::At& at = in_place_.boxes[lb.box];
    auto ptr = lb.data.data_ptr();
    const auto* expected = static_cast<const std::byte*>(source_regions_[static_cast<size_t>(at.region)].base) + at.offset;
    if (!ptr.ok() || *ptr != expected || !lb.data.is_contiguous())
      return failed_precondition(
          "producer {}: tensor '{}' box {} of group {} moved since create() (source_regions promise weights in place)",
          rank_, holdings_.tensors[holdings_.boxes[lb.box].tensor].name, holdings_.boxes[lb.box].box.to_string(), g);
  }
  return Status::Ok();
}

// xxHash64 of every segment of the group as consumers receive it: staged bytes, and the
// in-place runs from the source memory.
StagingRing::Checksums StagingRing::checksums(const ProducerGroupSchedule& gs, std::span<const std::byte> staging) const {
  Checksums sums;
  for (const auto& [cls, spans] : gs.checksum_spans) {
    SegmentHash h;
    for (const SegmentSpan& x : spans) {
      const std::byte* base =
          x.region < 0 ? staging.data() : static_cast<const std::byte*>(source_regions_[static_cast<size_t>(x.region)].base);
      h.update(base + x.offset, x.bytes);
    }
    sums[cls] = h.digest();
  }
  return sums;
}

Result<StagingRing::Checksums> StagingRing::pack(const ProducerSchedule& schedule, int g, size_t s,
                                                 const std::vector<LocalBox>& boxes) {
  if (g < 0 || static_cast<size_t>(g) >= schedule.groups.size())
    return out_of_range("producer {}: pack group {} of {}", rank_, g, schedule.groups.size());
  if (s >= static_cast<size_t>(slots_))
    return out_of_range("producer {} group {}: staging slot {} of {}", rank_, g, s, slots_);
  const ProducerGroupSchedule& gs = schedule.groups[static_cast<size_t>(g)];
  if (gs.pack.staging_bytes > slot_bytes_)
    return failed_precondition("producer {} group {}: needs {} staging bytes, a slot has {}", rank_, g,
                               gs.pack.staging_bytes, slot_bytes_);
  std::span<std::byte> staging = slot(s).first(gs.pack.staging_bytes);
  FERRY_RETURN_IF_ERROR(check_in_place(g, boxes));
  if (device_) {
    // GPU staging: every box on the staging device, packed there by a kernel, then the
    // slot copied to host staging for the transport's readers.
    for (const LocalBox& lb : boxes) {
      if (lb.data.device() != staging_device_) {
        return invalid_argument("producer {} group {}: {} is not on the staging device {} "
                                "(ProducerOptions::staging_device takes boxes on that device only)",
                                rank_, g, lb.data.describe(), device_str(staging_device_));
      }
    }
    std::span<std::byte> on_device(device_.get() + slot_offset(s), staging.size());
    // Quant ops write host memory: they run after the copy, into host staging.
    Status st = pack_group_packs(gs.pack, static_cast<uint32_t>(rank_), g, holdings_, boxes, on_device);
    if (!st.ok()) return st.with_context(fmt::format("producer {} pack group {}", rank_, g));
    st = device_memcpy(staging.data(), on_device.data(), staging.size());
    if (!st.ok()) return st.with_context(fmt::format("producer {} group {}: GPU staging to host staging", rank_, g));
    st = quantize_group(gs.pack, static_cast<uint32_t>(rank_), g, holdings_, boxes, staging);
    if (!st.ok()) return st.with_context(fmt::format("producer {} quantise group {}", rank_, g));
  } else {
    // Boxes in GPU memory are packed by a kernel into the (host) staging ring: the
    // first such box makes the ring visible to its device, for the ring's life.
    for (const LocalBox& lb : boxes) {
      if (!lb.data.device().is_cuda()) continue;
      Status vis = host_.make_cuda_visible(lb.data.device());
      if (!vis.ok()) return vis.with_context(fmt::format("producer {} group {}: staging for {}", rank_, g, lb.data.describe()));
    }
    Status st = pack_group(gs.pack, static_cast<uint32_t>(rank_), g, holdings_, boxes, staging);
    if (!st.ok()) return st.with_context(fmt::format("producer {} pack group {}", rank_, g));
  }
  if (!checksums_) return Checksums{};
  return checksums(gs, staging);
}

}  // namespace ferry::engine
