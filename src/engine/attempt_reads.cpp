#include "engine/attempt_reads.h"

#include <algorithm>

#include <fmt/format.h>

#include "engine/param_set.h"
#include "ferry/device.h"

namespace ferry::engine {

AttemptReads::~AttemptReads() {
  for (auto& [k, ops] : posted_) wait_all(ops, drain_limit_).ignore();
}

Status AttemptReads::post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
                          std::vector<Completion>& ops) {
  Lane& lane = t.lane == LaneKind::kCudaIpc && ipc_ ? *ipc_ : t.lane == LaneKind::kRelay && relay_ ? *relay_ : transport_;
  Status st = lane.post(t, at, n, staging_offset, slot_offset, ops);
  if (!st.ok()) failed_ = t.producer;
  return st;
}

Status AttemptReads::begin_group(int g, uint64_t slot_offset) {
  if (paced_) return Status::Ok();
  for (int p : plan_.groups[static_cast<size_t>(g)].from)
    if (in_sync_.count(p)) FERRY_RETURN_IF_ERROR(post_to_slot(g, p, slot_offset));
  return Status::Ok();
}

Status AttemptReads::announced(int g, int p, uint64_t slot_offset) {
  if (paced_) {
    FERRY_RETURN_IF_ERROR(post_to_slot(g, p, slot_offset));
    enter_group(p, g);
  } else if (in_sync_.insert(p).second) {
    FERRY_RETURN_IF_ERROR(post_to_slot(g, p, slot_offset));
    enter(p, g);
  }
  return Status::Ok();
}

Status AttemptReads::post_patch(int g, int p, uint64_t staging_offset, uint64_t patch_bytes, uint64_t slot_offset,
                                std::vector<Completion>& ops) {
  const ConsumerGroupPlan& gp = plan_.groups[static_cast<size_t>(g)];
  auto it = gp.patch.find(p);
  if (it == gp.patch.end()) return not_found("group {}: no patch read planned from producer {}", g, p);
  if (patch_bytes > it->second->read.length)
    return out_of_range("group {}: a patch of {} bytes from producer {} is longer than its segment ({} bytes)", g,
                        patch_bytes, p, it->second->read.length);
  return post(it->second->transfer, 0, patch_bytes, staging_offset, slot_offset, ops);
}

Status AttemptReads::post_relayed(int g, uint64_t offered, uint64_t slot_offset, std::vector<Completion>& ops) {
  const ConsumerGroupPlan& gp = plan_.groups[static_cast<size_t>(g)];
  if (!relay_ || !gp.relayed) return not_found("group {}: no relay copy planned", g);
  return post(gp.relayed->transfer, 0, gp.relayed->read.length, offered, slot_offset, ops);
}

Status AttemptReads::post_to_slot(int g, int p, uint64_t slot_offset) {
  const ConsumerGroupPlan& gp = plan_.groups[static_cast<size_t>(g)];
  auto it = gp.to_slot.find(p);
  if (it == gp.to_slot.end()) return Status::Ok();
  std::vector<Completion>& ops = posted_[{g, p}];
  for (const Transfer& t : it->second) FERRY_RETURN_IF_ERROR(post(t, 0, t.read->length, 0, slot_offset, ops));
  return Status::Ok();
}

Status AttemptReads::post_staged(int g, int p, uint64_t staging_offset, uint64_t slot_offset,
                                 std::vector<Completion>& ops) {
  const ConsumerGroupPlan& gp = plan_.groups[static_cast<size_t>(g)];
  auto it = gp.staged.find(p);
  if (it == gp.staged.end()) return Status::Ok();
  for (const Transfer& t : it->second) FERRY_RETURN_IF_ERROR(post(t, 0, t.read->length, staging_offset, slot_offset, ops));
  return Status::Ok();
}

void AttemptReads::enter(int p, int g) {
  for (const Transfer* t : read_ahead(plan_, p, g)) backlog_[t->group].push_back(Item{t, 0});
}

void AttemptReads::enter_group(int p, int g) {
  const ConsumerGroupPlan& gp = plan_.groups[static_cast<size_t>(g)];
  auto it = gp.to_params.find(p);
  if (it == gp.to_params.end()) return;
  for (const Transfer& t : it->second) backlog_[g].push_back(Item{&t, 0});
}

Status AttemptReads::work_one() {
  auto it = backlog_.begin();
  Item& item = it->second.front();
  const uint64_t n = std::min(kChunk, item.t->read->length - item.done);
  FERRY_RETURN_IF_ERROR(post(*item.t, item.done, n, 0, 0, posted_[{it->first, item.t->producer}]));
  item.done += n;
  if (item.done == item.t->read->length) {
    it->second.pop_front();
    if (it->second.empty()) backlog_.erase(it);
  }
  return Status::Ok();
}

std::vector<Completion> AttemptReads::take(int g, int p) {
  auto it = posted_.find({g, p});
  if (it == posted_.end()) return {};
  std::vector<Completion> out = std::move(it->second);
  posted_.erase(it);
  return out;
}

Status verify_group(int rank, int g, const std::string& group_name, const ConsumerGroupSchedule& gs,
                    const std::map<int, uint64_t>& sums, std::byte* slot, const std::byte* device_slot,
                    uint64_t slot_bytes, const ParamSet& params) {
  if (sums.empty()) return Status::Ok();
  if (device_slot) {
    FERRY_RETURN_IF_ERROR(device_memcpy(slot, device_slot, slot_bytes)
                              .with_context(fmt::format("consumer {} group {}: GPU ring to host, to verify", rank, g)));
  }
  for (const auto& [p, expect] : sums) {
    SegmentHash h;
    if (auto it = gs.checksum_order.find(p); it != gs.checksum_order.end()) {
      for (uint32_t k : it->second) {
        const SubRead& sr = gs.reads[k];
        h.update(sr.param ? params.landing(sr).data : slot + sr.recv_offset, sr.length);
      }
    }
    const uint64_t got = h.digest();
    if (got != expect)
      return corrupt("consumer {}: checksum mismatch on the segment of producer {} in group {} ({}): got {:016x}, "
                     "sent {:016x}", rank, p, g, group_name, got, expect);
  }
  return Status::Ok();
}

}  // namespace ferry::engine
