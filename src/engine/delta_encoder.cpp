#include "engine/delta_encoder.h"

#include <algorithm>
#include <cstring>

#include "delta/patch.h"
#include "engine/memory.h"
#include "engine/schedule.h"

namespace ferry::engine {

DeltaEncoder::DeltaEncoder(StagingRing& staging, const EngineOptions& options)
    : staging_(staging), on_(options.delta), same_host_(options.delta_same_host),
      block_bytes_(options.delta_block_bytes), full_every_(options.delta_full_every) {}

void DeltaEncoder::install(const ProducerRoute& route) {
  if (!on_) return;
  kept_at_ = kept_layout(route);
  fits_ = block_bytes_ ? staging_.kept_bytes() >= staging_.kept_offset() : kept_at_.back() <= staging_.kept_bytes();
  kept_version_.assign(route.groups.size(), std::nullopt);
  kept_blocks_.assign(route.groups.size(), {});
  if (block_bytes_) {  // the patch scratch at its size for the largest segment, once (what memory.h predicts)
    uint64_t largest = 0;
    for (const ProducerGroup& g : route.groups)
      for (const Segment& seg : g.segments) largest = std::max<uint64_t>(largest, seg.bytes);
    std::vector<std::byte>(delta::max_block_patch_bytes(largest, block_bytes_)).swap(scratch_);
  }
}

void DeltaEncoder::begin_sync() {
  ++syncs_started_;
  full_sync_ = full_every_ > 0 && syncs_started_ % full_every_ == 0;
}

void DeltaEncoder::begin_attempt(const std::vector<uint32_t>& consumer_plan, const std::vector<bool>& members,
                                 const std::vector<bool>& on_this_host) {
  dense_classes_.clear();
  if (!on_ || same_host_) return;
  std::set<uint32_t> remote;
  for (size_t c = 0; c < consumer_plan.size() && c < members.size() && c < on_this_host.size(); ++c) {
    if (members[c]) (on_this_host[c] ? dense_classes_ : remote).insert(consumer_plan[c]);
  }
  for (uint32_t cls : remote) dense_classes_.erase(cls);
}

bool DeltaEncoder::all_dense(const ProducerGroup& grp) const {
  for (const Segment& seg : grp.segments)
    if (seg.bytes > 0 && !dense_classes_.contains(seg.plan)) return false;
  return true;
}

DeltaPack DeltaEncoder::pack(int g, size_t s, uint64_t v, const ProducerGroup& grp) {
  DeltaPack out;
  if (!on_ || !fits_ || grp.staging_bytes == 0) return out;
  const size_t gi = static_cast<size_t>(g);
  if (all_dense(grp)) {  // (its kept copy, or block hashes, stay as they were: no base any more)
    kept_version_[gi] = std::nullopt;
    return out;
  }
  if (block_bytes_) return pack_blocks(g, s, v, grp);
  std::byte* slot = staging_.slot(s).data();
  std::byte* keep = staging_.kept().data() + kept_at_[gi];
  const std::optional<uint64_t> had = kept_version_[gi];
  const bool patch = had && *had != v && !full_sync_;
  for (const Segment& seg : grp.segments) {
    if (seg.bytes == 0) continue;
    if (patch && !dense_classes_.contains(seg.plan)) {
      // Elements of the segment's narrowest dtype (every piece's bytes are a multiple).
      size_t es = 4;
      for (const PackOp& op : grp.packs)
        if (op.offset >= seg.offset && op.offset < seg.offset + seg.bytes) es = std::min(es, dtype_size(op.dtype));
      if (seg.bytes % es != 0) es = 1;
      scratch_.resize(std::max<size_t>(scratch_.size(), delta::max_patch_bytes(seg.bytes)));
      auto info = delta::encode_patch_into({keep + seg.offset, seg.bytes}, {slot + seg.offset, seg.bytes}, es, scratch_);
      if (info.ok()) {
        out.compared += seg.bytes / es;
        out.changed += info->changed;
        if (info->bytes < seg.bytes) {
          std::memcpy(keep + seg.offset, slot + seg.offset, seg.bytes);
          std::memcpy(slot + seg.offset, scratch_.data(), info->bytes);
          out.patch_bytes[seg.plan] = info->bytes;
          continue;
        }
      }
    }
    std::memcpy(keep + seg.offset, slot + seg.offset, seg.bytes);
  }
  kept_version_[gi] = v;
  if (!out.patch_bytes.empty()) {
    out.base = had;
    out.patch_offset = staging_.slot_offset(s);
    out.dense_offset = staging_.kept_offset() + kept_at_[gi];
  }
  return out;
}

// Counts blocks, not elements.
DeltaPack DeltaEncoder::pack_blocks(int g, size_t s, uint64_t v, const ProducerGroup& grp) {
  DeltaPack out;
  const size_t gi = static_cast<size_t>(g);
  const uint64_t bb = block_bytes_;
  std::byte* slot = staging_.slot(s).data();
  std::byte* area = staging_.kept().data() + s * staging_.slot_bytes();  // slot s's patch area
  std::vector<std::vector<uint64_t>>& hashes = kept_blocks_[gi];
  const std::optional<uint64_t> had = kept_version_[gi];
  const bool patch = had && *had != v && !full_sync_ && hashes.size() == grp.segments.size();
  hashes.resize(grp.segments.size());
  for (size_t i = 0; i < grp.segments.size(); ++i) {
    const Segment& seg = grp.segments[i];
    const std::span<const std::byte> dense(slot + seg.offset, seg.bytes);
    if (seg.bytes == 0) continue;
    if (patch && !dense_classes_.contains(seg.plan) && hashes[i].size() == (seg.bytes + bb - 1) / bb) {
      scratch_.resize(std::max<size_t>(scratch_.size(), delta::max_block_patch_bytes(seg.bytes, bb)));
      std::vector<uint64_t> next;
      auto info = delta::encode_changed_blocks(hashes[i], dense, bb, scratch_, &next);
      if (info.ok()) {
        out.compared += hashes[i].size();
        out.changed += info->changed;
        hashes[i] = std::move(next);
        if (info->bytes < seg.bytes) {
          std::memcpy(area + seg.offset, scratch_.data(), info->bytes);
          out.patch_bytes[seg.plan] = info->bytes;
        }
        continue;
      }
    }
    auto h = delta::block_hashes(dense, bb);
    hashes[i] = h.ok() ? std::move(*h) : std::vector<uint64_t>{};
  }
  kept_version_[gi] = v;
  if (!out.patch_bytes.empty()) {
    out.base = had;
    out.patch_offset = staging_.kept_offset() + s * staging_.slot_bytes();
    out.dense_offset = staging_.slot_offset(s);
  }
  return out;
}

uint64_t DeltaEncoder::state_bytes() const {
  if (!on_ || !block_bytes_) return 0;
  auto heap = heap_block_bytes;  // (as memory.h's estimates count each allocation)
  uint64_t n = heap(kept_blocks_.capacity() * sizeof(kept_blocks_[0])) + heap(scratch_.capacity());
  for (const auto& group : kept_blocks_) {
    n += heap(group.capacity() * sizeof(group[0]));
    for (const std::vector<uint64_t>& h : group) n += heap(h.capacity() * sizeof(uint64_t));
  }
  return n;
}

std::vector<MemoryRegion> regions_served_in_place(const std::vector<MemoryRegion>& source_regions, bool delta) {
  return delta ? std::vector<MemoryRegion>{} : source_regions;
}

}  // namespace ferry::engine
