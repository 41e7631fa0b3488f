// The synthetic in-memory WeightSource: values derivable from (seed, version, name, index).
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ferry/source.h"

namespace ferry {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t name_hash(std::string_view name) { return XXH3_64bits(name.data(), name.size()); }
uint64_t key_of(uint64_t seed, uint64_t version, uint64_t hn) { return mix(hn ^ mix(seed ^ mix(version + 0x1234567))); }

// SyntheticChanges: the version an element (or a whole tensor, `index` -1) was last
// redrawn at: floor(version * fraction + phase), its phase a hash in [0, 1) of (seed,
// name, index) alone. fraction 1 gives `version` itself (phase < 1).
uint64_t phase_base(uint64_t seed, uint64_t hn) { return hn ^ mix(seed ^ 0x5eed0fdeu); }
uint64_t phase_bits_from(uint64_t base, int64_t index) {
  return mix(base ^ (static_cast<uint64_t>(index) * 0x9fb21c651e98df25ull));
}
uint64_t phase_bits(uint64_t seed, uint64_t hn, int64_t index) { return phase_bits_from(phase_base(seed, hn), index); }
uint64_t epoch_of(uint64_t version, double fraction, uint64_t bits) {
  const double phase = static_cast<double>(bits >> 11) * 0x1.0p-53;
  return static_cast<uint64_t>(std::floor(static_cast<double>(version) * fraction + phase));
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

// The encoded bytes of every value value_of can give a dtype: for every dtype but f32
// it draws from a small set (h % modulus), so filling is a table lookup instead of a
// double conversion per element. modulus 0: no table (f32).
struct ValueTable {
  uint64_t modulus = 0;
  size_t size = 0;  // element bytes
  std::vector<std::byte> bytes;
};

ValueTable value_table(DType dtype) {
  ValueTable t;
  t.size = dtype_size(dtype);
  switch (dtype) {
    case DType::kF32: return t;
    case DType::kBF16:
    case DType::kF16: t.modulus = 128; break;
    case DType::kF8E4M3:
    case DType::kF8E5M2: t.modulus = 32; break;
    case DType::kI8:
    case DType::kI16:
    case DType::kI32:
    case DType::kI64: t.modulus = 201; break;
    case DType::kU8: t.modulus = 256; break;
    case DType::kBool: t.modulus = 2; break;
  }
  t.bytes.resize(t.modulus * t.size);
  // value_of(key, index) depends on h only through h % modulus: feed it each residue.
  for (uint64_t r = 0; r < t.modulus; ++r) {
    double v = 0;
    switch (dtype) {
      case DType::kBF16:
      case DType::kF16: v = static_cast<double>(static_cast<int64_t>(r) - 64) / 8.0; break;
      case DType::kF8E4M3:
      case DType::kF8E5M2: v = static_cast<double>(static_cast<int64_t>(r) - 16) / 4.0; break;
      case DType::kI8:
      case DType::kI16:
      case DType::kI32:
      case DType::kI64: v = static_cast<double>(static_cast<int64_t>(r) - 100); break;
      default: v = static_cast<double>(r); break;
    }
    store_element(t.bytes.data() + r * t.size, dtype, v);
  }
  return t;
}

// Writes the elements of flat indices [flat, flat + n) to out.
void fill_run(uint64_t key, DType dtype, const ValueTable& t, int64_t flat, int64_t n, std::byte* out) {
  if (t.modulus == 0) {
    for (int64_t j = 0; j < n; ++j) store_element(out + static_cast<size_t>(j) * t.size, dtype, value_of(key, flat + j, dtype));
    return;
  }
  const bool pow2 = (t.modulus & (t.modulus - 1)) == 0;
  const std::byte* tb = t.bytes.data();
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t h = mix(key ^ (static_cast<uint64_t>(flat + j) * 0xd6e8feb86659fd93ull));
    const uint64_t r = pow2 ? (h & (t.modulus - 1)) : h % t.modulus;
    std::byte* dst = out + static_cast<size_t>(j) * t.size;
    switch (t.size) {  // constant-size copies
      case 1: *dst = tb[r]; break;
      case 2: std::memcpy(dst, tb + r * 2, 2); break;
      case 4: std::memcpy(dst, tb + r * 4, 4); break;
      default: std::memcpy(dst, tb + r * t.size, t.size); break;
    }
  }
}

// Scattered changes: each element's key from the version it was last redrawn at. An
// element's epoch is floor(version * fraction) or one more (its phase is below 1), so
// the two keys are worked out once per tensor; the per-element cost is the phase's hash
// and the value's.
struct Scatter {
  uint64_t seed = 0, version = 0, hn = 0;
  double fraction = 1;
};

void fill_run_scattered(const Scatter& sc, DType dtype, const ValueTable& t, int64_t flat, int64_t n, std::byte* out) {
  const uint64_t base = phase_base(sc.seed, sc.hn);
  const uint64_t e0 = epoch_of(sc.version, sc.fraction, 0);
  const uint64_t key0 = key_of(sc.seed, e0, sc.hn), key1 = key_of(sc.seed, e0 + 1, sc.hn);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = flat + j;
    const uint64_t e = epoch_of(sc.version, sc.fraction, phase_bits_from(base, i));
    const uint64_t key = e == e0 ? key0 : e == e0 + 1 ? key1 : key_of(sc.seed, e, sc.hn);
    std::byte* dst = out + static_cast<size_t>(j) * t.size;
    if (t.modulus == 0) {
      store_element(dst, dtype, value_of(key, i, dtype));
      continue;
    }
    const uint64_t h = mix(key ^ (static_cast<uint64_t>(i) * 0xd6e8feb86659fd93ull));
    std::memcpy(dst, t.bytes.data() + (h % t.modulus) * t.size, t.size);
  }
}

// Fills `out` (contiguous, box-shaped) with the box's elements of `decl`, one
// innermost-dimension run at a time: every element from `key`, or with `scatter` each
// from the key of the version it was last redrawn at.
void fill_box(uint64_t key, const TensorDecl& decl, const Box& box, std::byte* out, const Scatter* scatter = nullptr) {
  const size_t es = dtype_size(decl.dtype);
  const int64_t n = box.numel();
  if (n == 0) return;
  const ValueTable table = value_table(decl.dtype);
  auto run = [&](int64_t flat, int64_t len, std::byte* dst) {
    if (scatter) {
      fill_run_scattered(*scatter, decl.dtype, table, flat, len, dst);
    } else {
      fill_run(key, decl.dtype, table, flat, len, dst);
    }
  };
  const Shape strides = contiguous_strides(decl.shape);
  const size_t nd = box.size.size();
  if (nd == 0) {
    run(0, 1, out);
    return;
  }
  const int64_t inner = box.size[nd - 1];
  Shape idx(nd - 1, 0);  // outer index within the box
  for (int64_t row = 0; row < n / inner; ++row) {
    int64_t flat = box.start[nd - 1] * strides[nd - 1];
    for (size_t k = 0; k + 1 < nd; ++k) flat += (box.start[k] + idx[k]) * strides[k];
    run(flat, inner, out + static_cast<size_t>(row * inner) * es);
    for (size_t k = nd - 1; k-- > 0;) {
      if (++idx[k] < box.size[k]) break;
      idx[k] = 0;
    }
  }
}

// Fills a box of `decl` at `version` under `changes`.
void fill_changed(uint64_t seed, uint64_t version, const SyntheticChanges& changes, const TensorDecl& decl,
                  const Box& box, std::byte* out) {
  const uint64_t hn = name_hash(decl.name);
  if (changes.fraction >= 1.0) {
    fill_box(key_of(seed, version, hn), decl, box, out);
  } else if (changes.clustered) {
    fill_box(key_of(seed, epoch_of(version, changes.fraction, phase_bits(seed, hn, -1)), hn), decl, box, out);
  } else {
    const Scatter sc{seed, version, hn, changes.fraction};
    fill_box(0, decl, box, out, &sc);
  }
}

}  // namespace

Status check_synthetic_changes(const SyntheticChanges& changes) {
  if (!(changes.fraction >= 0.0 && changes.fraction <= 1.0))
    return invalid_argument("synthetic changes: fraction {} is outside [0, 1]", changes.fraction);
  return Status::Ok();
}

double synthetic_value(uint64_t seed, uint64_t version, std::string_view name, int64_t index, DType dtype,
                       const SyntheticChanges& changes) {
  const uint64_t hn = name_hash(name);
  uint64_t at = version;
  if (changes.fraction < 1.0) at = epoch_of(version, changes.fraction, phase_bits(seed, hn, changes.clustered ? -1 : index));
  return value_of(key_of(seed, at, hn), index, dtype);
}

Tensor synthetic_tensor(uint64_t seed, uint64_t version, const TensorDecl& decl, const SyntheticChanges& changes) {
  Tensor t = Tensor::empty(decl.shape, decl.dtype, decl.name);
  fill_changed(seed, version, changes, decl, full_box(decl.shape), t.data_ptr().value());
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
    fill_changed(seed_, version_, changes_, d, h.boxes[i].box, p);
    out.push_back(LocalBox{static_cast<uint32_t>(i), std::move(t)});
  }
  return out;
}

}  // namespace ferry
