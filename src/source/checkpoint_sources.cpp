// The checkpoint's WeightSources (source/checkpoint_sources.h).
#include "source/checkpoint_sources.h"

#include <fmt/format.h>

namespace ferry {

CheckpointSource::CheckpointSource(const std::vector<TensorDecl>& metadata, const std::vector<Holdings>& holdings,
                                   SafetensorsDir dir, int rank)
    : metadata_(metadata), holdings_(holdings), dir_(std::move(dir)), groups_(metadata), rank_(rank) {}

Result<Holdings> CheckpointSource::holdings(int rank) const {
  if (rank < 0 || rank >= world_size()) return out_of_range("checkpoint source: rank {} is outside 0..{}", rank, world_size() - 1);
  return holdings_[static_cast<size_t>(rank)];
}

Result<std::vector<LocalBox>> CheckpointSource::materialize(int group) {
  const Holdings& h = holdings_[static_cast<size_t>(rank_)];
  std::vector<LocalBox> out;
  for (size_t i = 0; i < h.boxes.size(); ++i) {
    const TensorDecl& d = h.tensors[h.boxes[i].tensor];
    if (groups_.of_name(d.name) != group) continue;
    FERRY_ASSIGN_OR_RETURN(Tensor t, dir_.get(d.name));
    const Box& b = h.boxes[i].box;
    for (size_t dim = 0; dim < b.start.size(); ++dim) {
      if (b.start[dim] != 0 || b.size[dim] != d.shape[dim]) t = t.narrow(static_cast<int64_t>(dim), b.start[dim], b.size[dim]);
    }
    out.push_back(LocalBox{static_cast<uint32_t>(i), std::move(t)});
  }
  return out;
}

Result<std::unique_ptr<DeviceCopySource>> DeviceCopySource::make(WeightSource& host, Device device, int groups) {
  auto out = std::unique_ptr<DeviceCopySource>(new DeviceCopySource(host));
  out->by_group_.resize(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    FERRY_ASSIGN_OR_RETURN(std::vector<LocalBox> boxes, host.materialize(g));
    for (const LocalBox& lb : boxes) {
      const Tensor c = lb.data.contiguous();
      const size_t bytes = static_cast<size_t>(c.numel()) * dtype_size(c.dtype());
      FERRY_ASSIGN_OR_RETURN(auto mem, device_alloc(device, bytes));
      FERRY_ASSIGN_OR_RETURN(const std::byte* src, c.data_ptr());
      FERRY_RETURN_IF_ERROR(device_memcpy(mem.get(), src, bytes).with_context(
          fmt::format("serve: copying {} onto {}", lb.data.describe(), device_str(device))));
      out->by_group_[static_cast<size_t>(g)].push_back(
          LocalBox{lb.box, Tensor::borrow_device(mem.get(), c.shape(), c.dtype(), device, mem)});
    }
  }
  return out;
}

Result<std::vector<LocalBox>> DeviceCopySource::materialize(int group) {
  if (group < 0 || static_cast<size_t>(group) >= by_group_.size()) return out_of_range("materialize: group {}", group);
  return by_group_[static_cast<size_t>(group)];
}

}  // namespace ferry
