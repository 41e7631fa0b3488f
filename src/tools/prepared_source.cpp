#include "tools/prepared_source.h"

namespace ferry::tools {

using engine::align_up;

PreparedSource::PreparedSource(const JobModel& m, int rank, uint64_t seed)
    : metadata_(m.metadata), holdings_(m.holdings), rank_(rank), generator_(m.metadata, m.holdings, rank, seed) {}

Result<std::unique_ptr<PreparedSource>> PreparedSource::create(const JobModel& m, int rank, uint64_t seed,
                                                               Transport* in_place, const SyntheticChanges& changes) {
  auto s = std::unique_ptr<PreparedSource>(new PreparedSource(m, rank, seed));
  s->generator_.set_changes(changes);
  const Holdings& h = (*m.holdings)[static_cast<size_t>(rank)];
  const Groups groups(m.metadata);
  s->live_.resize(static_cast<size_t>(groups.size()));
  uint64_t bytes = 0;
  for (const HeldBox& b : h.boxes) bytes += align_up(static_cast<uint64_t>(b.box.numel()) * dtype_size(h.tensors[b.tensor].dtype), 64);
  if (in_place) FERRY_RETURN_IF_ERROR(s->region_.allocate(*in_place, bytes));
  // Boxes in the order SyntheticSource::materialize returns them (holdings order within
  // each group), at consecutive 64-byte-aligned addresses of the region.
  uint64_t at = 0;
  for (size_t i = 0; i < h.boxes.size(); ++i) {
    const HeldBox& b = h.boxes[i];
    const TensorDecl& d = h.tensors[b.tensor];
    const int g = groups.of_name(d.name);
    Tensor t = in_place ? Tensor::borrow(s->region_.data + at, b.box.size, d.dtype) : Tensor::empty(b.box.size, d.dtype, d.name);
    at += align_up(static_cast<uint64_t>(b.box.numel()) * dtype_size(d.dtype), 64);
    s->live_[static_cast<size_t>(g)].push_back(LocalBox{static_cast<uint32_t>(i), t});
  }
  s->held_ = bytes;
  FERRY_RETURN_IF_ERROR(s->set_data_version(1));
  return s;
}

Result<Holdings> PreparedSource::holdings(int rank) const {
  if (rank < 0 || rank >= world_size()) return invalid_argument("rank {} outside world {}", rank, world_size());
  return (*holdings_)[static_cast<size_t>(rank)];
}

Result<std::vector<LocalBox>> PreparedSource::materialize(int group) {
  if (group < 0 || group >= static_cast<int>(live_.size())) return invalid_argument("group {} out of range", group);
  return live_[static_cast<size_t>(group)];
}

Status PreparedSource::set_data_version(uint64_t d) {
  if (d == current_) return Status::Ok();
  generator_.set_version(d);
  for (size_t g = 0; g < live_.size(); ++g) {
    FERRY_ASSIGN_OR_RETURN(auto boxes, generator_.materialize(static_cast<int>(g)));
    if (boxes.size() != live_[g].size())
      return internal_error("prepared source: group {} has {} boxes, the generator gave {}", g, live_[g].size(),
                            boxes.size());
    for (size_t i = 0; i < boxes.size(); ++i) FERRY_RETURN_IF_ERROR(live_[g][i].data.copy_(boxes[i].data));
  }
  current_ = d;
  return Status::Ok();
}

std::vector<MemoryRegion> PreparedSource::regions() const {
  if (!region_.data) return {};
  return {region_.region};
}

}  // namespace ferry::tools
