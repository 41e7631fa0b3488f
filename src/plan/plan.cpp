// Plan: declarations, validation, canonicalisation, encoding, coverage.
#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <numeric>

#include <xxhash.h>

#include "ferry/plan.h"

namespace ferry {

namespace {

Result<uint32_t> declare(std::vector<TensorDecl>& decls, std::unordered_map<std::string, uint32_t>& index,
                         const TensorDecl& decl, std::string_view kind) {
  auto it = index.find(decl.name);
  if (it != index.end()) {
    const TensorDecl& have = decls[it->second];
    if (have.dtype != decl.dtype || have.shape != decl.shape) {
      return invalid_argument("{} '{}' declared as {} {} and as {} {}", kind, decl.name, shape_str(have.shape),
                              dtype_name(have.dtype), shape_str(decl.shape), dtype_name(decl.dtype));
    }
    return it->second;
  }
  if (decls.size() >= Plan::kMaxTensors) return out_of_range("too many {} tensors", kind);
  const uint32_t i = static_cast<uint32_t>(decls.size());
  decls.push_back(decl);
  index.emplace(decl.name, i);
  return i;
}

Status check_in_bounds(const Layout& l, const TensorDecl& decl, std::string_view what) {
  if (l.strides.size() != l.shape.size()) {
    return invalid_argument("{} layout of '{}' has {} dims but {} strides", what, decl.name, l.shape.size(), l.strides.size());
  }
  // Sizes, element count and extent first, without overflow, so that numel(),
  // min_offset() and max_offset() below are exact.
  int64_t numel = 1, extent = 0;
  bool empty = false;
  for (size_t d = 0; d < l.shape.size(); ++d) {
    const int64_t s = l.shape[d];
    if (s < 0) return invalid_argument("{} layout of '{}' has a negative size: {}", what, decl.name, l.to_string());
    empty |= s == 0;
    int64_t span = 0;
    const int64_t stride = l.strides[d] < 0 ? -l.strides[d] : l.strides[d];
    if (l.strides[d] == INT64_MIN || __builtin_mul_overflow(stride, s > 0 ? s - 1 : 0, &span) ||
        __builtin_add_overflow(extent, span, &extent) || (s > 0 && __builtin_mul_overflow(numel, s, &numel))) {
      return out_of_range("{} layout {} of '{}' overflows", what, l.to_string(), decl.name);
    }
  }
  if (empty) return Status::Ok();
  if (l.offset < -(int64_t(1) << 62) || l.offset > (int64_t(1) << 62) || extent > (int64_t(1) << 62)) {
    return out_of_range("{} layout {} of '{}' overflows", what, l.to_string(), decl.name);
  }
  const int64_t n = shape_numel(decl.shape);
  if (l.min_offset() < 0 || l.max_offset() >= n) {
    return out_of_range("{} layout {} is outside '{}' {} ({} elements)", what, l.to_string(), decl.name,
                        shape_str(decl.shape), n);
  }
  return Status::Ok();
}

bool dtypes_compatible(DType a, DType b) { return a == b || (is_floating(a) && is_floating(b)); }

// ---- canonical form of one copy / zero -------------------------------------------------

// Flips dims with negative stride in `key`, orders dims by `key` stride descending,
// then coalesces. `others` follow the same permutation.
void normalise(Layout& key, Layout* other) {
  const size_t nd = key.shape.size();
  for (size_t d = 0; d < nd; ++d) {
    if (key.strides[d] < 0 && key.shape[d] > 0) {
      key.offset += key.strides[d] * (key.shape[d] - 1);
      key.strides[d] = -key.strides[d];
      if (other) {
        other->offset += other->strides[d] * (other->shape[d] - 1);
        other->strides[d] = -other->strides[d];
      }
    }
  }
  std::vector<size_t> order(nd);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (key.strides[a] != key.strides[b]) return key.strides[a] > key.strides[b];
    if (other && other->strides[a] != other->strides[b]) return other->strides[a] > other->strides[b];
    return false;
  });
  auto apply = [&](Layout& l) {
    Layout p;
    p.offset = l.offset;
    for (size_t i : order) {
      p.shape.push_back(l.shape[i]);
      p.strides.push_back(l.strides[i]);
    }
    l = std::move(p);
  };
  apply(key);
  if (other) {
    apply(*other);
    coalesce_layouts(*other, key);
  } else {
    coalesce_layout(key);
  }
  // Canonical strides for size-1... none remain after coalescing except 0-d.
}

// Tries to merge b (which follows a in sort order) into a, for layouts listed in the
// same order in both. Returns true when merged.
bool try_merge(std::vector<Layout*> a, std::vector<const Layout*> b) {
  Layout& a0 = *a[0];
  const Layout& b0 = *b[0];
  const size_t n = a.size();
  // (1) Extend a's outermost dim: same inner dims and strides, b starts where a ends.
  if (a0.ndim() >= 1 && a0.ndim() == b0.ndim()) {
    bool ok = true;
    for (size_t k = 0; k < n && ok; ++k) {
      const Layout& x = *a[k];
      const Layout& y = *b[k];
      if (!std::equal(x.shape.begin() + 1, x.shape.end(), y.shape.begin() + 1, y.shape.end())) ok = false;
      else if (!std::equal(x.strides.begin() + 1, x.strides.end(), y.strides.begin() + 1, y.strides.end())) ok = false;
      else if (y.shape[0] > 1 && y.strides[0] != x.strides[0]) ok = false;
      else if (x.shape[0] == 1) ok = false;  // no stride to continue
      else if (y.offset != x.offset + x.shape[0] * x.strides[0]) ok = false;
    }
    if (ok) {
      for (size_t k = 0; k < n; ++k) a[k]->shape[0] += b[k]->shape[0];
      return true;
    }
  }
  // (2) b is one more step of a's outermost dim: a = [m] + S, b = S.
  if (a0.ndim() == b0.ndim() + 1 && a0.shape[0] > 1) {
    bool ok = true;
    for (size_t k = 0; k < n && ok; ++k) {
      const Layout& x = *a[k];
      const Layout& y = *b[k];
      if (!std::equal(x.shape.begin() + 1, x.shape.end(), y.shape.begin(), y.shape.end())) ok = false;
      else if (!std::equal(x.strides.begin() + 1, x.strides.end(), y.strides.begin(), y.strides.end())) ok = false;
      else if (y.offset != x.offset + x.shape[0] * x.strides[0]) ok = false;
    }
    if (ok) {
      for (size_t k = 0; k < n; ++k) a[k]->shape[0] += 1;
      return true;
    }
  }
  // (3) Same shape and strides: a new outer dim of 2 (positive key stride).
  if (a0.shape == b0.shape && b0.offset > a0.offset) {
    bool ok = true;
    for (size_t k = 0; k < n && ok; ++k) {
      if (a[k]->strides != b[k]->strides) ok = false;
    }
    if (ok) {
      for (size_t k = 0; k < n; ++k) {
        const int64_t step = b[k]->offset - a[k]->offset;
        a[k]->shape.insert(a[k]->shape.begin(), 2);
        a[k]->strides.insert(a[k]->strides.begin(), step);
      }
      if (n == 2) coalesce_layouts(*a[0], *a[1]);
      else coalesce_layout(*a[0]);
      return true;
    }
  }
  return false;
}

// ---- binary encoding ---------------------------------------------------------------------

constexpr char kMagic[4] = {'F', 'R', 'Y', 'P'};

class Writer {
 public:
  void raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void uvar(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void svar(int64_t v) { uvar((static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63)); }
  void str(const std::string& s) {
    uvar(s.size());
    raw(s.data(), s.size());
  }
  void layout(const Layout& l) {
    uvar(l.shape.size());
    for (int64_t s : l.shape) uvar(static_cast<uint64_t>(s));
    for (int64_t s : l.strides) svar(s);
    svar(l.offset);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> b) : p_(b.data()), end_(b.data() + b.size()) {}
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  Status raw(void* dst, size_t n) {
    if (left() < n) return corrupt("plan: truncated at byte {} (need {} more)", pos_, n);
    std::memcpy(dst, p_, n);
    p_ += n;
    pos_ += n;
    return Status::Ok();
  }
  Result<uint32_t> u32() {
    unsigned char b[4];
    FERRY_RETURN_IF_ERROR(raw(b, 4));
    return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
  }
  Result<uint64_t> uvar() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) return corrupt("plan: truncated varint at byte {}", pos_);
      const uint8_t b = static_cast<uint8_t>(*p_++);
      pos_++;
      if (shift == 63 && (b & 0x7e) != 0) return corrupt("plan: varint overflows 64 bits at byte {}", pos_);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    return corrupt("plan: varint longer than 10 bytes at byte {}", pos_);
  }
  Result<uint64_t> bounded(uint64_t max, std::string_view what) {
    FERRY_ASSIGN_OR_RETURN(uint64_t v, uvar());
    if (v > max) return corrupt("plan: {} {} exceeds the limit {}", what, v, max);
    return v;
  }
  Result<int64_t> svar() {
    FERRY_ASSIGN_OR_RETURN(uint64_t u, uvar());
    return static_cast<int64_t>((u >> 1) ^ (~(u & 1) + 1));
  }
  Result<std::string> str() {
    FERRY_ASSIGN_OR_RETURN(uint64_t n, bounded(Plan::kMaxNameLength, "name length"));
    std::string s(n, '\0');
    FERRY_RETURN_IF_ERROR(raw(s.data(), n));
    return s;
  }
  Result<Layout> layout() {
    FERRY_ASSIGN_OR_RETURN(uint64_t nd, bounded(Plan::kMaxRank, "rank"));
    Layout l;
    for (uint64_t i = 0; i < nd; ++i) {
      FERRY_ASSIGN_OR_RETURN(uint64_t s, bounded(uint64_t(1) << 48, "dim size"));
      l.shape.push_back(static_cast<int64_t>(s));
    }
    for (uint64_t i = 0; i < nd; ++i) {
      FERRY_ASSIGN_OR_RETURN(int64_t s, svar());
      if (s > (int64_t(1) << 48) || s < -(int64_t(1) << 48)) return corrupt("plan: stride {} out of range", s);
      l.strides.push_back(s);
    }
    FERRY_ASSIGN_OR_RETURN(l.offset, svar());
    if (l.offset > (int64_t(1) << 56) || l.offset < 0) return corrupt("plan: offset {} out of range", l.offset);
    return l;
  }
  size_t pos() const { return pos_; }

 private:
  const std::byte* p_;
  const std::byte* end_;
  size_t pos_ = 0;
};

Result<TensorDecl> read_decl(Reader& r) {
  TensorDecl d;
  FERRY_ASSIGN_OR_RETURN(d.name, r.str());
  uint8_t dt = 0;
  FERRY_RETURN_IF_ERROR(r.raw(&dt, 1));
  if (dt >= kNumDTypes) return corrupt("plan: unknown dtype code {} for '{}'", int(dt), d.name);
  d.dtype = static_cast<DType>(dt);
  FERRY_ASSIGN_OR_RETURN(uint64_t nd, r.bounded(Plan::kMaxRank, "rank"));
  int64_t numel = 1;
  for (uint64_t i = 0; i < nd; ++i) {
    FERRY_ASSIGN_OR_RETURN(uint64_t s, r.bounded(uint64_t(1) << 48, "dim size"));
    d.shape.push_back(static_cast<int64_t>(s));
    // Bound the product of max(size, 1): contiguous strides of the shape must not overflow.
    const int64_t f = std::max<int64_t>(static_cast<int64_t>(s), 1);
    if (numel > (int64_t(1) << 56) / f) return corrupt("plan: '{}' is too large", d.name);
    numel *= f;
  }
  return d;
}

void write_decl(Writer& w, const TensorDecl& d) {
  w.str(d.name);
  const uint8_t dt = static_cast<uint8_t>(d.dtype);
  w.raw(&dt, 1);
  w.uvar(d.shape.size());
  for (int64_t s : d.shape) w.uvar(static_cast<uint64_t>(s));
}

}  // namespace

// ---------------------------------------------------------------------------------------

Result<uint32_t> Plan::declare_source(const TensorDecl& decl) { return declare(sources_, source_index_, decl, "source"); }
Result<uint32_t> Plan::declare_param(const TensorDecl& decl) { return declare(params_, param_index_, decl, "param"); }

Status Plan::set_source_dtype(uint32_t index, DType dtype) {
  if (index >= sources_.size()) return out_of_range("source index {} of {}", index, sources_.size());
  TensorDecl& s = sources_[index];
  auto convertible = [](DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; };
  if (!convertible(s.dtype) || !convertible(dtype)) {
    return invalid_argument("source '{}': can't be read as {} instead of {} (only f32, bf16 and f16 convert)", s.name,
                            dtype_name(dtype), dtype_name(s.dtype));
  }
  s.dtype = dtype;
  return Status::Ok();
}

std::optional<uint32_t> Plan::find_source(std::string_view name) const {
  auto it = source_index_.find(std::string(name));
  if (it == source_index_.end()) return std::nullopt;
  return it->second;
}
std::optional<uint32_t> Plan::find_param(std::string_view name) const {
  auto it = param_index_.find(std::string(name));
  if (it == param_index_.end()) return std::nullopt;
  return it->second;
}

Status Plan::add_copy(Copy c) {
  if (c.source >= sources_.size()) return out_of_range("copy: source index {} of {}", c.source, sources_.size());
  if (c.param >= params_.size()) return out_of_range("copy: param index {} of {}", c.param, params_.size());
  const TensorDecl& s = sources_[c.source];
  const TensorDecl& p = params_[c.param];
  if (c.src.shape != c.dst.shape) {
    return invalid_argument("copy '{}' -> '{}': source shape {} differs from destination shape {}", s.name, p.name,
                            shape_str(c.src.shape), shape_str(c.dst.shape));
  }
  if (!dtypes_compatible(s.dtype, p.dtype)) {
    return invalid_argument("copy '{}' ({}) -> '{}' ({}): dtypes cannot convert", s.name, dtype_name(s.dtype), p.name,
                            dtype_name(p.dtype));
  }
  FERRY_RETURN_IF_ERROR(check_in_bounds(c.src, s, "source"));
  FERRY_RETURN_IF_ERROR(check_in_bounds(c.dst, p, "destination"));
  copies_.push_back(std::move(c));
  return Status::Ok();
}

Status Plan::add_zero(Zero z) {
  if (z.param >= params_.size()) return out_of_range("zero: param index {} of {}", z.param, params_.size());
  FERRY_RETURN_IF_ERROR(check_in_bounds(z.dst, params_[z.param], "zero"));
  zeros_.push_back(std::move(z));
  return Status::Ok();
}

Status Plan::validate() const {
  if (sources_.size() != source_index_.size() || params_.size() != param_index_.size()) {
    return corrupt("plan: duplicate tensor names");
  }
  for (const Copy& c : copies_) {
    if (c.source >= sources_.size() || c.param >= params_.size()) return corrupt("plan: copy names a tensor index out of range");
    const TensorDecl& s = sources_[c.source];
    const TensorDecl& p = params_[c.param];
    if (c.src.shape != c.dst.shape) return corrupt("plan: copy '{}' -> '{}' has unequal shapes", s.name, p.name);
    if (!dtypes_compatible(s.dtype, p.dtype)) return corrupt("plan: copy '{}' -> '{}' has incompatible dtypes", s.name, p.name);
    FERRY_RETURN_IF_ERROR(check_in_bounds(c.src, s, "source"));
    FERRY_RETURN_IF_ERROR(check_in_bounds(c.dst, p, "destination"));
  }
  for (const Zero& z : zeros_) {
    if (z.param >= params_.size()) return corrupt("plan: zero names a param index out of range");
    FERRY_RETURN_IF_ERROR(check_in_bounds(z.dst, params_[z.param], "zero"));
  }
  return Status::Ok();
}

void Plan::canonicalize() {
  // Tensors sorted by name, indices remapped.
  auto sort_decls = [](std::vector<TensorDecl>& decls, std::unordered_map<std::string, uint32_t>& index) {
    std::vector<uint32_t> order(decls.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return decls[a].name < decls[b].name; });
    std::vector<uint32_t> remap(decls.size());
    std::vector<TensorDecl> sorted;
    sorted.reserve(decls.size());
    for (uint32_t i = 0; i < order.size(); ++i) {
      remap[order[i]] = i;
      sorted.push_back(std::move(decls[order[i]]));
    }
    decls = std::move(sorted);
    index.clear();
    for (uint32_t i = 0; i < decls.size(); ++i) index.emplace(decls[i].name, i);
    return remap;
  };
  const auto sremap = sort_decls(sources_, source_index_);
  const auto premap = sort_decls(params_, param_index_);

  std::vector<Copy> copies;
  copies.reserve(copies_.size());
  for (Copy& c : copies_) {
    if (c.src.numel() == 0) continue;
    c.source = sremap[c.source];
    c.param = premap[c.param];
    copies.push_back(std::move(c));
  }
  auto copy_less = [](const Copy& a, const Copy& b) {
    if (a.param != b.param) return a.param < b.param;
    if (a.dst.offset != b.dst.offset) return a.dst.offset < b.dst.offset;
    if (a.source != b.source) return a.source < b.source;
    if (a.src.offset != b.src.offset) return a.src.offset < b.src.offset;
    if (a.dst.shape != b.dst.shape) return a.dst.shape < b.dst.shape;
    if (a.dst.strides != b.dst.strides) return a.dst.strides < b.dst.strides;
    return a.src.strides < b.src.strides;
  };
  // Normalise, sort and merge until nothing changes (a merge can enable another, and
  // leaves dims to re-order); the result is a fixpoint, so canonicalize is idempotent.
  while (true) {
    for (Copy& c : copies) normalise(c.dst, &c.src);
    std::sort(copies.begin(), copies.end(), copy_less);
    std::vector<Copy> merged;
    merged.reserve(copies.size());
    for (Copy& c : copies) {
      if (!merged.empty()) {
        Copy& last = merged.back();
        if (last.param == c.param && last.source == c.source && try_merge({&last.dst, &last.src}, {&c.dst, &c.src})) {
          continue;
        }
      }
      merged.push_back(std::move(c));
    }
    const bool changed = merged.size() != copies.size();
    copies = std::move(merged);
    if (!changed) break;
  }
  copies_ = std::move(copies);

  std::vector<Zero> zeros;
  for (Zero& z : zeros_) {
    if (z.dst.numel() == 0) continue;
    z.param = premap[z.param];
    zeros.push_back(std::move(z));
  }
  while (true) {
    for (Zero& z : zeros) normalise(z.dst, nullptr);
    std::sort(zeros.begin(), zeros.end(), [](const Zero& a, const Zero& b) {
      if (a.param != b.param) return a.param < b.param;
      if (a.dst.offset != b.dst.offset) return a.dst.offset < b.dst.offset;
      if (a.dst.shape != b.dst.shape) return a.dst.shape < b.dst.shape;
      return a.dst.strides < b.dst.strides;
    });
    std::vector<Zero> merged;
    for (Zero& z : zeros) {
      if (!merged.empty() && merged.back().param == z.param && try_merge({&merged.back().dst}, {&z.dst})) continue;
      merged.push_back(std::move(z));
    }
    const bool changed = merged.size() != zeros.size();
    zeros = std::move(merged);
    if (!changed) break;
  }
  zeros_ = std::move(zeros);
  for (BlockQuantize& q : quantized_) q.param = premap[q.param];
  std::sort(quantized_.begin(), quantized_.end(),
            [](const BlockQuantize& a, const BlockQuantize& b) { return a.param < b.param; });
}

Status Plan::set_quantized(std::vector<BlockQuantize> quantized) {
  std::vector<bool> seen(params_.size(), false);
  std::unordered_map<std::string, uint32_t> scales;
  for (const BlockQuantize& q : quantized) {
    if (q.param >= params_.size()) return out_of_range("quantised param index {} of {}", q.param, params_.size());
    const TensorDecl& d = params_[q.param];
    if (seen[q.param]) return invalid_argument("param '{}' is listed as quantised twice", d.name);
    seen[q.param] = true;
    if (d.shape.size() < 2 || !is_floating(d.dtype)) {
      return invalid_argument("param '{}' ({} {}) can't be block-quantised: not a float matrix", d.name,
                              dtype_name(d.dtype), shape_str(d.shape));
    }
    if (q.format > 2) return invalid_argument("param '{}': scale format {} is not one of 0, 1, 2", d.name, q.format);
    if (q.block == 0 || q.block > (1u << 16)) {
      return invalid_argument("param '{}': quantisation block {} is not in [1, 65536]", d.name, q.block);
    }
    if (q.scale_name.empty() || q.scale_name.size() > kMaxNameLength) {
      return invalid_argument("param '{}': its scales need a name of 1 to {} bytes", d.name, kMaxNameLength);
    }
    if (param_index_.count(q.scale_name)) {
      return invalid_argument("param '{}': its scales' name '{}' is a param of the plan", d.name, q.scale_name);
    }
    if (!scales.emplace(q.scale_name, q.param).second) {
      return invalid_argument("params '{}' and '{}' name their scales alike: '{}'", params_[scales[q.scale_name]].name,
                              d.name, q.scale_name);
    }
  }
  std::sort(quantized.begin(), quantized.end(),
            [](const BlockQuantize& a, const BlockQuantize& b) { return a.param < b.param; });
  quantized_ = std::move(quantized);
  return Status::Ok();
}

std::string Plan::encode() const {
  Writer w;
  w.raw(kMagic, 4);
  w.u32(quantized_.empty() ? 1 : 2);
  w.uvar(sources_.size());
  for (const auto& d : sources_) write_decl(w, d);
  w.uvar(params_.size());
  for (const auto& d : params_) write_decl(w, d);
  w.uvar(copies_.size());
  for (const Copy& c : copies_) {
    w.uvar(c.source);
    w.uvar(c.param);
    w.layout(c.src);
    w.layout(c.dst);
  }
  w.uvar(zeros_.size());
  for (const Zero& z : zeros_) {
    w.uvar(z.param);
    w.layout(z.dst);
  }
  if (!quantized_.empty()) {
    w.uvar(quantized_.size());
    for (const BlockQuantize& q : quantized_) {
      w.uvar(q.param);
      w.uvar(q.format);
      w.uvar(q.block);
      w.str(q.scale_name);
    }
  }
  return w.take();
}

Result<Plan> Plan::decode(std::string_view bytes) {
  return decode(std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
}

namespace {
// Anything wrong in decoded bytes is corruption, whatever check caught it.
Status as_corrupt(const Status& s, const std::string& context) {
  if (s.ok()) return s;
  return Status(StatusCode::kCorrupt, context + ": " + s.message());
}
}  // namespace

Result<Plan> Plan::decode(std::span<const std::byte> bytes) {
  Reader r(bytes);
  char magic[4];
  FERRY_RETURN_IF_ERROR(r.raw(magic, 4).with_context("plan header"));
  if (std::memcmp(magic, kMagic, 4) != 0) return corrupt("plan: bad magic (not a ferry plan)");
  FERRY_ASSIGN_OR_RETURN(uint32_t version, r.u32());
  if (version < 1 || version > kEncodingVersion) {
    return corrupt("plan: encoding version {} is not supported (this build reads 1 to {})", version, kEncodingVersion);
  }
  Plan plan;
  // Every entry takes at least 2 bytes, so a count beyond the remaining bytes is a lie.
  auto count = [&](std::string_view what, uint64_t max) -> Result<uint64_t> {
    FERRY_ASSIGN_OR_RETURN(uint64_t n, r.bounded(max, what));
    if (n > r.left()) return corrupt("plan: {} count {} exceeds the {} bytes left", what, n, r.left());
    return n;
  };
  FERRY_ASSIGN_OR_RETURN(uint64_t ns, count("source", kMaxTensors));
  for (uint64_t i = 0; i < ns; ++i) {
    FERRY_ASSIGN_OR_RETURN(TensorDecl d, read_decl(r));
    if (plan.source_index_.count(d.name)) return corrupt("plan: source '{}' declared twice", d.name);
    FERRY_RETURN_IF_ERROR(as_corrupt(plan.declare_source(d).status(), "plan"));
  }
  FERRY_ASSIGN_OR_RETURN(uint64_t np, count("param", kMaxTensors));
  for (uint64_t i = 0; i < np; ++i) {
    FERRY_ASSIGN_OR_RETURN(TensorDecl d, read_decl(r));
    if (plan.param_index_.count(d.name)) return corrupt("plan: param '{}' declared twice", d.name);
    FERRY_RETURN_IF_ERROR(as_corrupt(plan.declare_param(d).status(), "plan"));
  }
  FERRY_ASSIGN_OR_RETURN(uint64_t nc, count("copy", kMaxEntries));
  plan.copies_.reserve(nc);
  for (uint64_t i = 0; i < nc; ++i) {
    Copy c;
    FERRY_ASSIGN_OR_RETURN(uint64_t s, r.uvar());
    FERRY_ASSIGN_OR_RETURN(uint64_t p, r.uvar());
    if (s >= plan.sources_.size() || p >= plan.params_.size()) return corrupt("plan: copy {} names a tensor out of range", i);
    c.source = static_cast<uint32_t>(s);
    c.param = static_cast<uint32_t>(p);
    FERRY_ASSIGN_OR_RETURN(c.src, r.layout());
    FERRY_ASSIGN_OR_RETURN(c.dst, r.layout());
    FERRY_RETURN_IF_ERROR(as_corrupt(plan.add_copy(std::move(c)), fmt::format("plan: copy {}", i)));
  }
  FERRY_ASSIGN_OR_RETURN(uint64_t nz, count("zero", kMaxEntries));
  for (uint64_t i = 0; i < nz; ++i) {
    Zero z;
    FERRY_ASSIGN_OR_RETURN(uint64_t p, r.uvar());
    if (p >= plan.params_.size()) return corrupt("plan: zero {} names a param out of range", i);
    z.param = static_cast<uint32_t>(p);
    FERRY_ASSIGN_OR_RETURN(z.dst, r.layout());
    FERRY_RETURN_IF_ERROR(as_corrupt(plan.add_zero(std::move(z)), fmt::format("plan: zero {}", i)));
  }
  if (version >= 2) {
    FERRY_ASSIGN_OR_RETURN(uint64_t nq, count("quantised param", kMaxTensors));
    if (nq == 0) return corrupt("plan: version 2 with no quantised params (written as version 1)");
    std::vector<BlockQuantize> quantized(nq);
    for (BlockQuantize& q : quantized) {
      FERRY_ASSIGN_OR_RETURN(uint64_t p, r.bounded(kMaxTensors, "quantised param"));
      FERRY_ASSIGN_OR_RETURN(uint64_t f, r.bounded(255, "scale format"));
      FERRY_ASSIGN_OR_RETURN(uint64_t b, r.bounded(0xffffffffu, "quantisation block"));
      q.param = static_cast<uint32_t>(p);
      q.format = static_cast<uint8_t>(f);
      q.block = static_cast<uint32_t>(b);
      FERRY_ASSIGN_OR_RETURN(q.scale_name, r.str());
    }
    for (size_t i = 1; i < quantized.size(); ++i) {
      if (quantized[i].param <= quantized[i - 1].param) return corrupt("plan: quantised params out of order");
    }
    FERRY_RETURN_IF_ERROR(as_corrupt(plan.set_quantized(std::move(quantized)), "plan"));
  }
  if (r.left() != 0) return corrupt("plan: {} trailing bytes", r.left());
  return plan;
}

uint64_t Plan::hash() const {
  const std::string e = encode();
  return XXH3_64bits(e.data(), e.size());
}

PlanStats Plan::stats() const {
  PlanStats s;
  s.copies = copies_.size();
  s.zeros = zeros_.size();
  for (const Copy& c : copies_) {
    const uint64_t n = static_cast<uint64_t>(c.src.numel());
    s.elements += n;
    s.bytes += n * dtype_size(sources_[c.source].dtype);
  }
  for (const Zero& z : zeros_) s.zero_elements += static_cast<uint64_t>(z.dst.numel());
  return s;
}

namespace {
// Appends the [begin, end) element runs of `l` (innermost dim as runs when its stride is 1).
void append_runs(const Layout& layout, std::vector<std::pair<int64_t, int64_t>>& runs) {
  Layout l = layout;
  coalesce_layout(l);
  if (l.numel() == 0) return;
  if (l.ndim() == 0) {
    runs.emplace_back(l.offset, l.offset + 1);
    return;
  }
  const int64_t inner = l.shape.back();
  const int64_t istride = l.strides.back();
  Shape outer_shape(l.shape.begin(), l.shape.end() - 1);
  const int64_t rows = shape_numel(outer_shape);
  Shape idx(outer_shape.size(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t base = l.offset;
    int64_t rem = r;
    for (size_t k = outer_shape.size(); k-- > 0;) {
      base += (rem % outer_shape[k]) * l.strides[k];
      rem /= outer_shape[k];
    }
    if (istride == 1) {
      runs.emplace_back(base, base + inner);
    } else {
      for (int64_t i = 0; i < inner; ++i) runs.emplace_back(base + i * istride, base + i * istride + 1);
    }
  }
}
}  // namespace

Status Plan::check_coverage(bool allow_unwritten) const {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs(params_.size());
  for (const Copy& c : copies_) append_runs(c.dst, runs[c.param]);
  for (const Zero& z : zeros_) append_runs(z.dst, runs[z.param]);
  for (size_t p = 0; p < params_.size(); ++p) {
    auto& r = runs[p];
    std::sort(r.begin(), r.end());
    const int64_t n = shape_numel(params_[p].shape);
    int64_t covered = 0;
    for (const auto& [b, e] : r) {
      if (b < covered) {
        return invalid_argument("param '{}' {}: element {} is written twice", params_[p].name, shape_str(params_[p].shape), b);
      }
      if (b > covered && !allow_unwritten) {
        return invalid_argument("param '{}' {}: element {} is written by no copy", params_[p].name,
                                shape_str(params_[p].shape), covered);
      }
      covered = e;
    }
    if (covered < n && !allow_unwritten) {
      return invalid_argument("param '{}' {}: element {} is written by no copy", params_[p].name, shape_str(params_[p].shape),
                              covered);
    }
  }
  return Status::Ok();
}

std::string Plan::to_string() const {
  std::string out;
  const auto st = stats();
  out += fmt::format("plan: {} sources, {} params, {} copies, {} zeros, {} bytes\n", sources_.size(), params_.size(),
                     st.copies, st.zeros, st.bytes);
  for (const Copy& c : copies_) {
    out += fmt::format("  {} {} <- {} {}\n", params_[c.param].name, c.dst.to_string(), sources_[c.source].name,
                       c.src.to_string());
  }
  for (const Zero& z : zeros_) out += fmt::format("  {} {} <- 0\n", params_[z.param].name, z.dst.to_string());
  for (const BlockQuantize& q : quantized_) {
    out += fmt::format("  {} quantised: fp8 tiles of {}, scale format {} -> {}\n", params_[q.param].name, q.block,
                       q.format, q.scale_name);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Recorder

Recorder::Recorder() : previous_(active_record_sink()) { set_active_record_sink(this); }
Recorder::~Recorder() { set_active_record_sink(previous_); }

Status Recorder::record_copy(const Tensor& dst, const Tensor& src) {
  if (!status_.ok()) return status_;
  auto fail = [&](Status s) {
    status_ = s;
    return s;
  };
  if (src.storage_kind() != StorageKind::kSource) {
    return fail(invalid_argument("copy_: {} is not a checkpoint source; only sources can be copied into params", src.describe()));
  }
  if (dst.storage_kind() == StorageKind::kSource) {
    return fail(invalid_argument("copy_: destination {} is a checkpoint source; copy into a param", dst.describe()));
  }
  if (dst.is_real() && dst.name().empty()) {
    return fail(invalid_argument("copy_: destination {} of a recorded copy from {} needs a name (Tensor::empty(.., name))",
                                 dst.describe(), src.describe()));
  }
  if (dst.is_recorded_copy()) {
    return fail(invalid_argument("copy_: destination {} is a copy made by reshape/contiguous, not a view of the param; "
                                 "the write would be lost",
                                 dst.describe()));
  }
  if (!dtypes_compatible(src.dtype(), dst.dtype())) {
    return fail(invalid_argument("copy_: dtype {} of {} cannot convert to {} of {}", dtype_name(src.dtype()), src.describe(),
                                 dtype_name(dst.dtype()), dst.describe()));
  }
  Tensor s = src.shape() == dst.shape() ? src : src.reshape(dst.shape());
  if (!s.ok()) return fail(s.status());
  auto pieces = s.element_map();
  if (!pieces.ok()) return fail(pieces.status());
  auto si = plan_.declare_source({src.name(), src.dtype(), src.root_shape()});
  if (!si.ok()) return fail(si.status());
  auto pi = plan_.declare_param({dst.name(), dst.dtype(), dst.root_shape()});
  if (!pi.ok()) return fail(pi.status());
  const Layout& dl = dst.layout();
  for (const MapPiece& piece : *pieces) {
    Copy c;
    c.source = *si;
    c.param = *pi;
    c.src = piece.root;
    c.dst.shape = piece.root.shape;
    c.dst.strides = dl.strides;
    c.dst.offset = dl.offset_of(piece.start);
    if (auto st = plan_.add_copy(std::move(c)); !st.ok()) return fail(st.with_context("copy_"));
  }
  return Status::Ok();
}

Status Recorder::record_zero(const Tensor& dst) {
  if (!status_.ok()) return status_;
  if (dst.is_recorded_copy()) {
    status_ = invalid_argument("zero_: {} is a copy made by reshape/contiguous, not a view of the param", dst.describe());
    return status_;
  }
  auto pi = plan_.declare_param({dst.name(), dst.dtype(), dst.root_shape()});
  if (!pi.ok()) {
    status_ = pi.status();
    return status_;
  }
  Status st = plan_.add_zero(Zero{*pi, dst.layout()});
  if (!st.ok()) status_ = st;
  return st;
}

Result<Plan> Recorder::finish() {
  if (!status_.ok()) return status_;
  Plan p = plan_;
  p.canonicalize();
  return p;
}

}  // namespace ferry
