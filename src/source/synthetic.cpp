// The synthetic in-memory WeightSource: values derivable from (seed, version, name, index).
#include <xxhash.h>

#include "ferry/source.h"

namespace ferry {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t name_key(uint64_t seed, uint64_t version, std::string_view name) {
  return mix(XXH3_64bits(name.data(), name.size()) ^ mix(seed ^ mix(version + 0x1234567)));
}

double value_of(uint64_t key, int64_t index, DType dtype) {
  const uint64_t h = mix(key ^ (static_cast<uint64_t>(index) * 0xd6e8feb86659fd93ull));
  switch (dtype) {
    case DType::kF32: return static_cast<double>(static_cast<int64_t>(h % (1u << 21)) - (1 << 20)) / 8.0;
    case DType::kBF16:
    case DType::kF16: return static_cast<double>(static_cast<int64_t>(h % 128) - 64) / 8.0;
    case DType::kF8E4M3:
    case DType::kF8E5M2: return static_cast<double>(static_cast<int64_t>(h % 32) - 16) / 4.0;
    case DType::kI8:
    case DType::kI16:
    case DType::kI32:
    case DType::kI64: return static_cast<double>(static_cast<int64_t>(h % 201) - 100);
    case DType::kU8: return static_cast<double>(h % 256);
    case DType::kBool: return static_cast<double>(h & 1);
  }
  return 0;
}

// Fills `out` (contiguous, box-shaped) with the box's elements of `decl`.
void fill_box(uint64_t key, const TensorDecl& decl, const Box& box, std::byte* out) {
  const size_t es = dtype_size(decl.dtype);
  const int64_t n = box.numel();
  if (n == 0) return;
  const Shape strides = contiguous_strides(decl.shape);
  const size_t nd = box.size.size();
  Shape idx(nd, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = 0;
    for (size_t k = 0; k < nd; ++k) flat += (box.start[k] + idx[k]) * strides[k];
    store_element(out + static_cast<size_t>(i) * es, decl.dtype, value_of(key, flat, decl.dtype));
    for (size_t k = nd; k-- > 0;) {
      if (++idx[k] < box.size[k]) break;
      idx[k] = 0;
    }
  }
}

}  // namespace

double synthetic_value(uint64_t seed, uint64_t version, std::string_view name, int64_t index, DType dtype) {
  return value_of(name_key(seed, version, name), index, dtype);
}

Tensor synthetic_tensor(uint64_t seed, uint64_t version, const TensorDecl& decl) {
  Tensor t = Tensor::empty(decl.shape, decl.dtype, decl.name);
  fill_box(name_key(seed, version, decl.name), decl, full_box(decl.shape), t.data_ptr().value());
  return t;
}

SyntheticSource::SyntheticSource(std::vector<TensorDecl> metadata, std::shared_ptr<const std::vector<Holdings>> holdings,
                                 int rank, uint64_t seed)
    : metadata_(std::move(metadata)), holdings_(std::move(holdings)), groups_(metadata_), rank_(rank), seed_(seed) {}

Result<Holdings> SyntheticSource::holdings(int rank) const {
  if (rank < 0 || rank >= world_size()) {
    return out_of_range("synthetic source: rank {} is outside the trainer's {} ranks", rank, world_size());
  }
  return (*holdings_)[static_cast<size_t>(rank)];
}

Result<std::vector<LocalBox>> SyntheticSource::materialize(int group) {
  if (group < 0 || group >= groups_.size()) {
    return out_of_range("synthetic source: group {} is outside the model's {} groups", group, groups_.size());
  }
  if (rank_ < 0 || rank_ >= world_size()) return out_of_range("synthetic source: rank {} has no holdings", rank_);
  const Holdings& h = (*holdings_)[static_cast<size_t>(rank_)];
  std::vector<LocalBox> out;
  for (size_t i = 0; i < h.boxes.size(); ++i) {
    const TensorDecl& d = h.tensors[h.boxes[i].tensor];
    if (groups_.of_name(d.name) != group) continue;
    Tensor t = Tensor::empty(h.boxes[i].box.size, d.dtype, d.name);
    FERRY_ASSIGN_OR_RETURN(std::byte * p, t.data_ptr());
    fill_box(name_key(seed_, version_, d.name), d, h.boxes[i].box, p);
    out.push_back(LocalBox{static_cast<uint32_t>(i), std::move(t)});
  }
  return out;
}

}  // namespace ferry
