// build_routes: pieces, assignment, segments (see ferry/route.h and docs/routing.md).
#include <algorithm>
#include <array>
#include <numeric>
#include <tuple>
#include <utility>
#include <unordered_map>

#include "ferry/route.h"
#include "common/parallel.h"
#include "route/op_digest.h"

namespace ferry {

namespace {

// One producer's box of a tensor.
struct Holder {
  Box box;
  uint32_t producer = 0;
  uint32_t box_index = 0;  // into the producer's Holdings::boxes
};

// A disjoint piece of a tensor and the holders whose box contains it.
struct TensorPiece {
  Box box;
  std::vector<uint32_t> holders;  // indices into the tensor's Holder list, by producer
  bool refined = false;           // some holder's box is larger than the piece
  int64_t flat_lo = 0, flat_hi = 0;  // row-major flat range the piece spans (inclusive)
};

struct TensorInfo {
  std::vector<Holder> holders;
  std::vector<TensorPiece> pieces;
  std::vector<MapPiece> map;  // compose_layout pieces (local contiguous roots)
  bool pieces_built = false;
  int first_holder = -1;       // producer whose view of the tensor was seen first
  const TensorDecl* first_decl = nullptr;  // and that view
  // Pieces by flat_lo (ties by index) and the widest flat extent of one: the pieces a
  // copy's flat range [lo, hi] can touch start within [lo - widest, hi].
  std::vector<uint32_t> by_flat;
  int64_t widest_flat = 0;
};

// A cut piece of one copy of one plan class. Its layouts are a row of the LayoutPool:
// millions of cuts at fsdp=N holding two Layouts (four heap vectors) each were what
// routing spent its time and memory on.
struct Cut {
  uint32_t plan = 0;
  uint32_t param = 0;
  uint32_t tensor = 0;
  uint32_t piece = 0;
  int32_t group = 0;
  uint32_t producer = 0;
  uint32_t box = 0;  // producer's box index
  DType wire = DType::kBF16;  // what staging holds: the source's dtype, or the param's
  bool sole = false;          // its piece has one holder
  uint64_t bytes = 0;
  uint64_t cost = 0;  // bytes x consumers of the plan class
  int64_t dst_offset = 0;
  uint64_t layouts = 0;  // its row in the LayoutPool
};

// A vector kept in fixed blocks: growing it never moves, nor touches again, what it
// holds (a doubling vector of millions of cuts copied and page-faulted all of them at
// every doubling).
template <typename T>
class Blocks {
 public:
  static constexpr size_t kBits = 14;
  void push_back(const T& x) {
    if (blocks_.empty() || blocks_.back().size() == (size_t{1} << kBits)) {
      blocks_.emplace_back();
      blocks_.back().reserve(size_t{1} << kBits);
    }
    blocks_.back().push_back(x);
    ++size_;
  }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return blocks_[i >> kBits][i & ((size_t{1} << kBits) - 1)]; }
  const T& operator[](size_t i) const { return blocks_[i >> kBits][i & ((size_t{1} << kBits) - 1)]; }

 private:
  std::vector<std::vector<T>> blocks_;
  size_t size_ = 0;
};

// The src (piece-local, then holder-local) and dst layouts of every cut, one row each in
// one flat vector: [ndim, src offset, dst offset, shape x ndim, src strides x ndim, dst
// strides x ndim], in blocks that never move. add() coalesces the pair as
// coalesce_layouts() does, without allocating (scratch reused).
class LayoutPool {
 public:
  uint64_t add(const Shape& shape, const Shape& src_strides, int64_t src_offset, const Shape& dst_strides,
               int64_t dst_offset) {
    sh_.clear();
    a_.clear();
    b_.clear();
    bool empty = false;
    for (int64_t n : shape) empty |= n == 0;
    if (empty) {
      sh_.push_back(0);
      a_.push_back(1);
      b_.push_back(1);
    } else {
      for (size_t d = 0; d < shape.size(); ++d) {
        const int64_t n = shape[d];
        if (n == 1) continue;
        if (!sh_.empty() && a_.back() == src_strides[d] * n && b_.back() == dst_strides[d] * n) {
          sh_.back() *= n;
          a_.back() = src_strides[d];
          b_.back() = dst_strides[d];
        } else {
          sh_.push_back(n);
          a_.push_back(src_strides[d]);
          b_.push_back(dst_strides[d]);
        }
      }
    }
    const size_t row = 3 + 3 * sh_.size();
    if (blocks_.empty() || blocks_.back().size() + row > std::max(kBlock, row)) {
      blocks_.emplace_back();
      blocks_.back().reserve(std::max(kBlock, row));
    }
    std::vector<int64_t>& v = blocks_.back();
    const uint64_t at = (blocks_.size() - 1) << 32 | v.size();
    v.push_back(static_cast<int64_t>(sh_.size()));
    v.push_back(src_offset);
    v.push_back(dst_offset);
    v.insert(v.end(), sh_.begin(), sh_.end());
    v.insert(v.end(), a_.begin(), a_.end());
    v.insert(v.end(), b_.begin(), b_.end());
    return at;
  }
  int64_t numel(uint64_t at) const {
    const int64_t* r = row(at);
    int64_t n = 1;
    for (int64_t k = 0; k < r[0]; ++k) n *= r[3 + k];
    return n;
  }
  Layout src(uint64_t at) const { return layout(at, 1, 1); }
  Layout dst(uint64_t at) const { return layout(at, 2, 2); }
  // A rebased src of the same shape.
  void set_src(uint64_t at, const Layout& l) {
    int64_t* r = row(at);
    r[1] = l.offset;
    std::copy(l.strides.begin(), l.strides.end(), r + 3 + r[0]);
  }

 private:
  static constexpr size_t kBlock = size_t{1} << 16;  // int64s per block
  const int64_t* row(uint64_t at) const { return blocks_[at >> 32].data() + (at & 0xffffffffu); }
  int64_t* row(uint64_t at) { return blocks_[at >> 32].data() + (at & 0xffffffffu); }
  Layout layout(uint64_t at, size_t offset_field, size_t strides_block) const {
    const int64_t* r = row(at);
    const auto nd = static_cast<size_t>(r[0]);
    const int64_t* base = r + 3;
    Layout l;
    l.shape.assign(base, base + nd);
    l.strides.assign(base + strides_block * nd, base + (strides_block + 1) * nd);
    l.offset = r[offset_field];
    return l;
  }
  std::vector<std::vector<int64_t>> blocks_;
  Shape sh_, a_, b_;
};

// One plan class's cuts, their layouts and the bytes they carry (built on one thread).
struct ClassCuts {
  Blocks<Cut> cuts;
  LayoutPool pool;
  uint64_t bytes = 0;
  Status status;
};
// A cut: its plan class above kCutBits, its index in the class's cuts below.
using CutRef = uint64_t;
constexpr unsigned kCutBits = 40;
constexpr uint64_t kCutMask = (uint64_t{1} << kCutBits) - 1;

int router_threads(const RouterOptions& options) {
  if (options.threads > 0) return options.threads;
  return default_threads(16);
}

int64_t flat_of(const Shape& idx, const Shape& strides) {
  int64_t f = 0;
  for (size_t k = 0; k < idx.size(); ++k) f += idx[k] * strides[k];
  return f;
}

Shape unravel(int64_t p, const Shape& radix) {
  Shape q(radix.size());
  for (size_t j = radix.size(); j-- > 0;) {
    q[j] = p % radix[j];
    p /= radix[j];
  }
  return q;
}

// Re-expresses dims of a copy's src layout along the source's own dims where a dim runs
// over whole rows of the source (stride = a dim's row-major stride, size a multiple of
// that dim), so that compose_layout cuts by rows instead of row by row. Exact for any
// choice (a dim of size n = a*b and stride s is the pair [a, b] with strides [s*b, s]);
// src and dst are split alike.
void unflatten(Layout& src, Layout& dst, const Shape& radix) {
  if (radix.size() < 2) return;
  const Shape P = contiguous_strides(radix);
  Layout s2{{}, {}, src.offset}, d2{{}, {}, dst.offset};
  for (size_t k = 0; k < src.shape.size(); ++k) {
    int64_t n = src.shape[k], ss = src.strides[k], ds = dst.strides[k];
    std::vector<std::array<int64_t, 3>> inner;  // innermost first
    while (true) {
      int j = -1;
      for (size_t q = radix.size(); q-- > 1;) {
        if (P[q] == ss && radix[q] > 1) {
          j = static_cast<int>(q);
          break;
        }
      }
      if (j < 1) break;
      const int64_t r = radix[static_cast<size_t>(j)];
      if (n <= r || n % r != 0 || (src.offset / P[static_cast<size_t>(j)]) % r != 0) break;
      inner.push_back({r, ss, ds});
      n /= r;
      ss *= r;
      ds *= r;
    }
    s2.shape.push_back(n);
    s2.strides.push_back(ss);
    d2.shape.push_back(n);
    d2.strides.push_back(ds);
    for (size_t i = inner.size(); i-- > 0;) {
      s2.shape.push_back(inner[i][0]);
      s2.strides.push_back(inner[i][1]);
      d2.shape.push_back(inner[i][0]);
      d2.strides.push_back(inner[i][2]);
    }
  }
  src = std::move(s2);
  dst = std::move(d2);
}

// A layout over a piece's local row-major space, re-expressed over a holder box that
// contains the piece (every element it touches lies in the piece).
Layout rebase(const Layout& l, const Box& piece, const Box& holder) {
  const Shape& ps = piece.size;
  const Shape hs = contiguous_strides(holder.size);
  auto to_holder = [&](const Shape& q) {
    int64_t f = 0;
    for (size_t j = 0; j < q.size(); ++j) f += (q[j] + piece.start[j] - holder.start[j]) * hs[j];
    return f;
  };
  Layout out;
  out.shape = l.shape;
  out.strides.assign(l.shape.size(), 0);
  if (ps.empty()) {  // 0-d
    out.offset = 0;
    return out;
  }
  const Shape q0 = unravel(l.offset, ps);
  out.offset = to_holder(q0);
  for (size_t k = 0; k < l.shape.size(); ++k) {
    if (l.shape[k] <= 1) continue;
    const Shape q1 = unravel(l.offset + l.strides[k], ps);
    out.strides[k] = to_holder(q1) - out.offset;
  }
  return out;
}

uint64_t align_up(uint64_t x, uint64_t a) { return a <= 1 ? x : (x + a - 1) / a * a; }

bool is_run(const Layout& l) { return l.ndim() == 1 && (l.strides[0] == 1 || l.shape[0] == 1); }
bool is_scalar_like(const Layout& l) { return l.numel() == 1; }

// Merges `op` into `p` where both are contiguous runs that continue each other on both
// sides (the staging or receive bytes and the box or param); true if it did.
bool merge_op(PackOp& p, const PackOp& op, uint64_t es) {
  if (p.box == op.box && p.dtype == op.dtype && (is_run(p.src) || is_scalar_like(p.src)) &&
      (is_run(op.src) || is_scalar_like(op.src)) && p.src.numel() > 0) {
    const int64_t pn = p.src.numel();
    if (p.src.offset + pn == op.src.offset && p.offset + static_cast<uint64_t>(pn) * es == op.offset) {
      p.src = Layout{{pn + op.src.numel()}, {1}, p.src.offset};
      return true;
    }
  }
  return false;
}

bool merge_op(UnpackOp& p, const UnpackOp& op, uint64_t es) {
  if (p.param == op.param && p.src_dtype == op.src_dtype && (is_run(p.dst) || is_scalar_like(p.dst)) &&
      (is_run(op.dst) || is_scalar_like(op.dst)) && p.dst.numel() > 0) {
    const int64_t pn = p.dst.numel();
    if (p.dst.offset + pn == op.dst.offset && p.offset + static_cast<uint64_t>(pn) * es == op.offset) {
      p.dst = Layout{{pn + op.dst.numel()}, {1}, p.dst.offset};
      return true;
    }
  }
  return false;
}

// One group's ops as a segment's cuts arrive: appended to `ops` (merged with the
// previous op of the same segment where they continue each other), or, where the group's
// ops are elided (ops == nullptr), merged alike and only counted and digested.
template <typename Op>
class OpSink {
 public:
  explicit OpSink(std::vector<Op>* ops = nullptr) : ops_(ops) {}
  void begin_segment() { first_ = ops_ ? ops_->size() : count_; }
  void push(Op op, uint64_t es) {
    if (ops_) {
      if (ops_->size() > first_ && merge_op(ops_->back(), op, es)) return;
      ops_->push_back(std::move(op));
      return;
    }
    if (count_ > first_ && merge_op(last_, op, es)) return;
    if (count_) digest_ = route_detail::digest_op(digest_, last_);
    last_ = std::move(op);
    ++count_;
  }
  // An elided group's count and digest (both 0 where the ops were made).
  std::pair<uint64_t, uint64_t> finish() {
    if (ops_ || !count_) return {0, 0};
    return {count_, route_detail::digest_op(digest_, last_)};
  }

 private:
  std::vector<Op>* ops_;
  Op last_{};
  uint64_t count_ = 0, digest_ = 0;
  size_t first_ = 0;
};

// The dtype a piece crosses the wire in: the param's where the producer converts (both
// floating, the param's elements narrower: fp32 masters kept as bf16 send half the
// bytes), else the source's. Either side converts with the same strided_copy, so the
// bits are the same wherever it runs.
DType wire_dtype(DType source, DType param, const RouterOptions& options) {
  if (options.convert_on == ConvertOn::kProducer && source != param && is_floating(source) && is_floating(param) &&
      dtype_size(param) < dtype_size(source))
    return param;
  return source;
}

bool same_decl(const TensorDecl& a, const TensorDecl& b) { return a.dtype == b.dtype && a.shape == b.shape; }

std::string decl_str(const TensorDecl& d) { return fmt::format("{} {}", dtype_name(d.dtype), shape_str(d.shape)); }

// Builds the disjoint pieces of a tensor from its holders.
Status build_pieces(const TensorDecl& decl, TensorInfo& ti) {
  ti.pieces_built = true;
  auto& hs = ti.holders;
  // Distinct boxes, each with its holders.
  std::vector<uint32_t> order(hs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    if (hs[a].box != hs[b].box) return hs[a].box < hs[b].box;
    return hs[a].producer < hs[b].producer;
  });
  std::vector<TensorPiece> distinct;
  for (uint32_t i : order) {
    if (distinct.empty() || distinct.back().box != hs[i].box) distinct.push_back(TensorPiece{hs[i].box, {}, false});
    distinct.back().holders.push_back(i);
  }
  // Partial overlaps between distinct boxes? (sorted by start, so a sweep on dim 0).
  bool partial = false;
  for (size_t i = 0; i < distinct.size() && !partial; ++i) {
    for (size_t j = i + 1; j < distinct.size(); ++j) {
      const Box& a = distinct[i].box;
      const Box& b = distinct[j].box;
      if (!a.start.empty() && b.start[0] >= a.start[0] + a.size[0]) break;
      if (a.intersects(b)) {
        partial = true;
        break;
      }
    }
  }
  if (!partial) {
    ti.pieces = std::move(distinct);
  } else {
    // Refine into the grid of every box edge; keep cells some box holds.
    const size_t nd = decl.shape.size();
    std::vector<std::vector<int64_t>> cuts(nd);
    for (const auto& d : distinct) {
      for (size_t k = 0; k < nd; ++k) {
        cuts[k].push_back(d.box.start[k]);
        cuts[k].push_back(d.box.start[k] + d.box.size[k]);
      }
    }
    uint64_t cells = 1;
    for (auto& c : cuts) {
      std::sort(c.begin(), c.end());
      c.erase(std::unique(c.begin(), c.end()), c.end());
      cells *= c.size() - 1;
    }
    if (cells > (1u << 20)) {
      return invalid_argument("tensor '{}': its {} holder boxes overlap in too complex a pattern ({} cells)",
                              decl.name, distinct.size(), cells);
    }
    Shape idx(nd, 0);
    for (uint64_t c = 0; c < cells; ++c) {
      Box cell{Shape(nd), Shape(nd)};
      for (size_t k = 0; k < nd; ++k) {
        cell.start[k] = cuts[k][static_cast<size_t>(idx[k])];
        cell.size[k] = cuts[k][static_cast<size_t>(idx[k]) + 1] - cell.start[k];
      }
      TensorPiece p{cell, {}, false};
      for (const auto& d : distinct) {
        if (d.box.contains(cell)) {
          p.holders.insert(p.holders.end(), d.holders.begin(), d.holders.end());
          if (d.box != cell) p.refined = true;
        }
      }
      if (!p.holders.empty()) {
        std::sort(p.holders.begin(), p.holders.end(),
                  [&](uint32_t a, uint32_t b) { return hs[a].producer < hs[b].producer; });
        ti.pieces.push_back(std::move(p));
      }
      for (size_t k = nd; k-- > 0;) {
        if (++idx[k] < static_cast<int64_t>(cuts[k].size()) - 1) break;
        idx[k] = 0;
      }
    }
  }
  const Shape strides = contiguous_strides(decl.shape);
  ti.map.reserve(ti.pieces.size());
  for (auto& p : ti.pieces) {
    Shape last(p.box.start.size());
    for (size_t k = 0; k < last.size(); ++k) last[k] = p.box.start[k] + p.box.size[k] - 1;
    p.flat_lo = flat_of(p.box.start, strides);
    p.flat_hi = flat_of(last, strides);
    ti.map.push_back(MapPiece{p.box.start, Layout::contiguous(p.box.size), 0});
    ti.widest_flat = std::max(ti.widest_flat, p.flat_hi - p.flat_lo);
  }
  ti.by_flat.resize(ti.pieces.size());
  std::iota(ti.by_flat.begin(), ti.by_flat.end(), 0);
  std::stable_sort(ti.by_flat.begin(), ti.by_flat.end(),
                   [&](uint32_t a, uint32_t b) { return ti.pieces[a].flat_lo < ti.pieces[b].flat_lo; });
  return Status::Ok();
}

}  // namespace

uint64_t RoutingCost::route_groups() const { return (producers + plan_classes) * groups; }
uint64_t RoutingCost::pieces() const { return held_boxes * plan_classes; }
uint64_t RoutingCost::bytes() const {
  // Per held box: its HeldBox and a share of its rank's TensorDecl copies, and the
  // router's Holder and piece; per route group, an empty group's vectors; per piece,
  // the router's cut and layouts, and where every op is made a pack op and an unpack op
  // (measured: fsdp=4096 -> tp=8 over Llama-3.1-8B peaks at 2.15 GB with every op, this
  // says 3.5; 1.28 GB with none, this says 1.5).
  constexpr uint64_t kPerBox = 240, kPerGroup = 64, kPerCut = 150, kPerOps = 260;
  return held_boxes * kPerBox + route_groups() * kPerGroup + pieces() * (kPerCut + (every_op ? kPerOps : 0));
}
std::string RoutingCost::to_string() const {
  return fmt::format("{} held boxes, {} route groups, ~{} pieces: ~{:.1f} GiB to route", held_boxes, route_groups(),
                     pieces(), static_cast<double>(bytes()) / static_cast<double>(uint64_t{1} << 30));
}

Status check_routing_cost(const RoutingCost& c, uint64_t memory_budget) {
  auto gib = [](uint64_t b) { return static_cast<double>(b) / static_cast<double>(uint64_t{1} << 30); };
  if (c.route_groups() > kMaxRouteGroups) {
    return invalid_argument(
        "routing {} producers and {} plan classes over {} layer groups needs {} route groups, which every rank of the "
        "job would hold (~{:.1f} GiB of them before any piece); the limit is {} route groups. In all: {}",
        c.producers, c.plan_classes, c.groups, c.route_groups(), gib(c.route_groups() * 64), kMaxRouteGroups,
        c.to_string());
  }
  if (c.pieces() > kMaxRoutePieces) {
    return invalid_argument(
        "routing {} held boxes to {} plan classes cuts up to ~{} pieces; the limit is {} pieces. In all: {}",
        c.held_boxes, c.plan_classes, c.pieces(), kMaxRoutePieces, c.to_string());
  }
  if (memory_budget && c.bytes() > memory_budget) {
    return invalid_argument("routing needs ~{:.1f} GiB of memory and {:.1f} GiB is available. In all: {}",
                            gib(c.bytes()), gib(memory_budget), c.to_string());
  }
  return Status::Ok();
}

std::string_view convert_on_name(ConvertOn c) { return c == ConvertOn::kProducer ? "producer" : "consumer"; }

std::optional<ConvertOn> parse_convert_on(std::string_view name) {
  if (name == "producer") return ConvertOn::kProducer;
  if (name == "consumer") return ConvertOn::kConsumer;
  return std::nullopt;
}

Result<Routes> build_routes(const RouterInput& in, const RouterOptions& options) {
  const auto& meta = in.metadata;
  const uint32_t num_producers = static_cast<uint32_t>(in.producers.size());
  // --- metadata -------------------------------------------------------------------------
  std::unordered_map<std::string, uint32_t> index;
  index.reserve(meta.size() * 2);
  for (uint32_t t = 0; t < meta.size(); ++t) {
    if (!index.emplace(meta[t].name, t).second) {
      return invalid_argument("metadata lists tensor '{}' twice", meta[t].name);
    }
  }
  const Groups groups(meta);
  const int G = groups.size();

  // --- holdings ---------------------------------------------------------------------------
  std::vector<TensorInfo> tensors(meta.size());
  for (uint32_t p = 0; p < num_producers; ++p) {
    const Holdings& h = in.producers[p];
    std::vector<uint32_t> local(h.tensors.size());
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const TensorDecl& d = h.tensors[i];
      auto it = index.find(d.name);
      if (it == index.end()) {
        return not_found("producer {} holds tensor '{}', which the metadata lacks", p, d.name);
      }
      TensorInfo& ti = tensors[it->second];
      // Against the first holder's view (it matched the metadata): one comparison, not
      // a search of that holder's tensor list (which made fsdp=N quadratic in N).
      if (ti.first_decl && ti.first_holder != static_cast<int>(p) && !same_decl(*ti.first_decl, d)) {
        return invalid_argument("holders disagree on tensor '{}': producer {} has {}, producer {} has {}", d.name,
                                ti.first_holder, decl_str(*ti.first_decl), p, decl_str(d));
      }
      if (!same_decl(d, meta[it->second])) {
        return invalid_argument("holders disagree on tensor '{}': the metadata says {}, producer {} has {}", d.name,
                                decl_str(meta[it->second]), p, decl_str(d));
      }
      if (ti.first_holder < 0) {
        ti.first_holder = static_cast<int>(p);
        ti.first_decl = &d;
      }
      local[i] = it->second;
    }
    // Boxes; overlap within this producer.
    std::unordered_map<uint32_t, std::vector<uint32_t>> mine;
    for (uint32_t b = 0; b < h.boxes.size(); ++b) {
      const HeldBox& hb = h.boxes[b];
      if (hb.tensor >= h.tensors.size()) {
        return out_of_range("producer {}: box {} names tensor #{} of {} declared", p, b, hb.tensor, h.tensors.size());
      }
      const uint32_t t = local[hb.tensor];
      const TensorDecl& d = meta[t];
      const Box& box = hb.box;
      if (box.start.size() != d.shape.size() || box.size.size() != d.shape.size()) {
        return invalid_argument("producer {}: box {} of tensor '{}' has the wrong number of dims for {}", p,
                                box.to_string(), d.name, shape_str(d.shape));
      }
      for (size_t k = 0; k < d.shape.size(); ++k) {
        if (box.start[k] < 0 || box.size[k] < 0 || box.start[k] > d.shape[k] - box.size[k]) {
          return out_of_range("producer {}: box {} is outside tensor '{}' {}", p, box.to_string(), d.name,
                              shape_str(d.shape));
        }
      }
      if (box.empty()) continue;
      mine[t].push_back(b);
      tensors[t].holders.push_back(Holder{box, p, b});
    }
    for (auto& [t, list] : mine) {
      if (list.size() < 2) continue;
      std::sort(list.begin(), list.end(), [&](uint32_t a, uint32_t b) { return h.boxes[a].box < h.boxes[b].box; });
      for (size_t i = 0; i < list.size(); ++i) {
        const Box& a = h.boxes[list[i]].box;
        for (size_t j = i + 1; j < list.size(); ++j) {
          const Box& b = h.boxes[list[j]].box;
          if (!a.start.empty() && b.start[0] >= a.start[0] + a.size[0]) break;
          if (a.intersects(b)) {
            return invalid_argument("producer {} holds overlapping boxes {} and {} of tensor '{}'", p, a.to_string(),
                                    b.to_string(), meta[t].name);
          }
        }
      }
    }
  }

  // --- plan classes -------------------------------------------------------------------
  Routes routes;
  for (int g = 0; g < G; ++g) routes.group_names.push_back(groups.name(g));
  std::vector<const Plan*> classes;
  std::vector<uint64_t> weight;
  std::unordered_map<uint64_t, std::vector<uint32_t>> by_hash;
  routes.consumer_plan.reserve(in.consumers.size());
  for (size_t c = 0; c < in.consumers.size(); ++c) {
    const Plan* plan = in.consumers[c];
    if (!plan) return invalid_argument("consumer {} has no plan", c);
    const uint64_t h = plan->hash();
    auto& list = by_hash[h];
    int found = -1;
    for (uint32_t k : list) {
      if (classes[k] == plan || *classes[k] == *plan) {
        found = static_cast<int>(k);
        break;
      }
    }
    if (found < 0) {
      for (const TensorDecl& s : plan->sources()) {
        auto it = index.find(s.name);
        if (it == index.end()) {
          return not_found("the plan of consumer {} reads tensor '{}', which the metadata lacks", c, s.name);
        }
        if (!same_decl(s, meta[it->second])) {
          return invalid_argument("the plan of consumer {} reads tensor '{}' as {}, the metadata says {}", c, s.name,
                                  decl_str(s), decl_str(meta[it->second]));
        }
      }
      found = static_cast<int>(classes.size());
      classes.push_back(plan);
      weight.push_back(0);
      list.push_back(static_cast<uint32_t>(found));
      routes.plans.push_back(PlanRoute{h, plan->params(), std::vector<PlanGroup>(static_cast<size_t>(G))});
    }
    weight[static_cast<size_t>(found)]++;
    routes.consumer_plan.push_back(static_cast<uint32_t>(found));
  }

  if (options.packs_of < RouterOptions::kNoRank || options.packs_of >= static_cast<int64_t>(num_producers)) {
    return invalid_argument("router options: packs of producer {}, of {} producers", options.packs_of, num_producers);
  }
  if (options.unpacks_of < RouterOptions::kNoRank || options.unpacks_of >= static_cast<int64_t>(in.consumers.size())) {
    return invalid_argument("router options: unpacks of consumer {}, of {} consumers", options.unpacks_of,
                            in.consumers.size());
  }
  {  // What the rest would cost, before any piece: refused at once when out of bounds.
    RoutingCost cost;
    cost.producers = num_producers;
    cost.plan_classes = classes.size();
    cost.groups = static_cast<uint64_t>(G);
    for (const Holdings& h : in.producers) cost.held_boxes += h.boxes.size();
    FERRY_RETURN_IF_ERROR(check_routing_cost(cost));
  }

  // --- cut every copy by the pieces it touches ------------------------------------------
  // Each plan class on its own (a thread each, up to options.threads): its cuts, layouts
  // and bytes are its own, and the pieces every class reads are built first. A cut is
  // named by a CutRef: its class in the high bits, its index in the class's cuts below.
  const int threads = router_threads(options);
  std::vector<ClassCuts> per(classes.size());
  {
    std::vector<uint32_t> read;  // tensors some plan reads, once each
    std::vector<bool> seen(tensors.size(), false);
    std::vector<std::vector<uint32_t>> src_tensor(classes.size());
    for (uint32_t k = 0; k < classes.size(); ++k) {
      const Plan& plan = *classes[k];
      src_tensor[k].resize(plan.sources().size());
      for (size_t s = 0; s < plan.sources().size(); ++s) src_tensor[k][s] = index.at(plan.sources()[s].name);
      for (const Copy& copy : plan.copies()) {
        const uint32_t t = src_tensor[k][copy.source];
        if (copy.src.numel() != 0 && !seen[t]) {
          seen[t] = true;
          read.push_back(t);
        }
      }
    }
    std::vector<Status> built(tensors.size());
    parallel_for(read.size(), threads, [&](size_t i) { built[read[i]] = build_pieces(meta[read[i]], tensors[read[i]]); });

    parallel_for(classes.size(), threads, [&](size_t kk) {
      const auto k = static_cast<uint32_t>(kk);
      const Plan& plan = *classes[k];
      ClassCuts& out = per[k];
      std::vector<uint32_t> filtered_idx;
      out.status = [&]() -> Status {
        for (const Copy& copy : plan.copies()) {
          const int64_t n = copy.src.numel();
          if (n == 0) continue;
          const uint32_t t = src_tensor[k][copy.source];
          const TensorDecl& d = meta[t];
          const TensorInfo& ti = tensors[t];
          FERRY_RETURN_IF_ERROR(built[t]);
          if (ti.pieces.empty()) {
            return not_found("tensor '{}' is read by a consumer plan but no producer holds it", d.name);
          }
          Layout src = copy.src, dst = copy.dst;
          unflatten(src, dst, d.shape);
          // Only the pieces the copy's flat range can touch.
          const std::vector<uint32_t>* idx = nullptr;
          if (ti.map.size() > 4) {
            const int64_t lo = src.min_offset(), hi = src.max_offset();
            filtered_idx.clear();
            // By binary search in the pieces sorted by flat start, not a scan of every
            // piece per copy; taken in index order, as the scan did, so the cut is the same.
            auto first = std::lower_bound(ti.by_flat.begin(), ti.by_flat.end(), lo - ti.widest_flat,
                                          [&](uint32_t i, int64_t v) { return ti.pieces[i].flat_lo < v; });
            for (auto it = first; it != ti.by_flat.end() && ti.pieces[*it].flat_lo <= hi; ++it) {
              if (ti.pieces[*it].flat_hi >= lo) filtered_idx.push_back(*it);
            }
            std::sort(filtered_idx.begin(), filtered_idx.end());
            idx = &filtered_idx;
          }
          int64_t covered = 0;
          const DType wire = wire_dtype(d.dtype, plan.params()[copy.param].dtype, options);
          const uint64_t es = dtype_size(wire);
          const int32_t group = groups.of_tensor(t);
          compose_layout_each(src, d.shape, ti.map, idx, [&](const MapPiece& m) {
            Cut cut;
            cut.plan = k;
            cut.param = copy.param;
            cut.tensor = t;
            cut.piece = idx ? (*idx)[m.part] : m.part;
            cut.group = group;
            cut.wire = wire;
            cut.dst_offset = dst.offset_of(m.start);
            cut.layouts = out.pool.add(m.root.shape, m.root.strides, m.root.offset, dst.strides, cut.dst_offset);
            const int64_t numel = out.pool.numel(cut.layouts);
            covered += numel;
            cut.bytes = static_cast<uint64_t>(numel) * es;
            cut.cost = cut.bytes * weight[k];  // (final: every consumer was counted above)
            out.bytes += cut.bytes;
            out.cuts.push_back(cut);
          });
          if (covered != n) {
            return not_found(
                "tensor '{}': {} of the {} elements a consumer plan reads ({} -> param '{}') are held by no producer",
                d.name, n - covered, n, copy.src.to_string(), plan.params()[copy.param].name);
          }
        }
        return Status::Ok();
      }();
    });
    // The error a class-by-class pass would have met first.
    for (const ClassCuts& c : per) FERRY_RETURN_IF_ERROR(c.status);
  }
  if (static_cast<uint64_t>(classes.size()) >= (uint64_t{1} << (64 - kCutBits))) {
    return invalid_argument("{} plan classes: too many to route", classes.size());
  }
  auto cut_of = [&](CutRef r) -> Cut& { return per[r >> kCutBits].cuts[r & kCutMask]; };
  uint64_t num_cuts = 0;
  for (const ClassCuts& c : per) num_cuts += c.cuts.size();

  // --- choose holders -------------------------------------------------------------------
  // Where every piece has one holder (no DP replica: FSDP, TP/PP/EP alone) there is
  // nothing to choose: each class takes its holders on its own thread. Otherwise greedy,
  // largest cost first, to the least-loaded holder, over every class in one order.
  bool choice = false;
  for (const TensorInfo& ti : tensors) {
    for (const TensorPiece& p : ti.pieces) choice |= p.holders.size() > 1;
  }
  auto assign = [&](Cut& c, uint32_t hidx, const TensorInfo& ti, LayoutPool& pool) {
    const TensorPiece& piece = ti.pieces[c.piece];
    const Holder& h = ti.holders[hidx];
    c.producer = h.producer;
    c.box = h.box_index;
    c.sole = piece.holders.size() == 1;
    if (piece.refined && h.box != piece.box) pool.set_src(c.layouts, rebase(pool.src(c.layouts), piece.box, h.box));
  };
  if (!choice) {
    parallel_for(per.size(), threads, [&](size_t k) {
      ClassCuts& cc = per[k];
      for (size_t j = 0; j < cc.cuts.size(); ++j) {
        Cut& c = cc.cuts[j];
        const TensorInfo& ti = tensors[c.tensor];
        assign(c, ti.pieces[c.piece].holders[0], ti, cc.pool);
      }
    });
  } else {
    std::vector<CutRef> order;
    order.reserve(num_cuts);
    for (uint64_t k = 0; k < per.size(); ++k)
      for (uint64_t j = 0; j < per[k].cuts.size(); ++j) order.push_back(k << kCutBits | j);
    std::sort(order.begin(), order.end(), [&](CutRef a, CutRef b) {
      const Cut& x = cut_of(a);
      const Cut& y = cut_of(b);
      if (x.cost != y.cost) return x.cost > y.cost;
      if (x.plan != y.plan) return x.plan < y.plan;
      if (x.param != y.param) return x.param < y.param;
      return x.dst_offset < y.dst_offset;
    });
    std::vector<uint64_t> load(num_producers, 0);
    for (CutRef r : order) {
      Cut& c = cut_of(r);
      const TensorInfo& ti = tensors[c.tensor];
      const TensorPiece& piece = ti.pieces[c.piece];
      uint32_t best = piece.holders[0];
      for (uint32_t hidx : piece.holders) {
        if (load[ti.holders[hidx].producer] < load[ti.holders[best].producer]) best = hidx;
      }
      assign(c, best, ti, per[c.plan].pool);
      load[c.producer] += c.cost;
    }
  }

  // --- segments -------------------------------------------------------------------------
  // Each producer's cuts by group, plan, param and destination offset: bucketed by
  // producer (a counting sort, each class filling its own slots), then each producer's
  // bucket sorted on its own thread.
  std::vector<CutRef> order(num_cuts);
  std::vector<size_t> start(num_producers + 1, 0);
  {
    const size_t K = per.size();
    std::vector<std::vector<size_t>> count(K, std::vector<size_t>(num_producers, 0));
    parallel_for(K, threads, [&](size_t k) {
      for (size_t j = 0; j < per[k].cuts.size(); ++j) ++count[k][per[k].cuts[j].producer];
    });
    // Slots: producer-major, class-minor (the order a pass over every cut gives).
    size_t at = 0;
    for (uint32_t p = 0; p < num_producers; ++p) {
      start[p] = at;
      for (size_t k = 0; k < K; ++k) {
        const size_t n = count[k][p];
        count[k][p] = at;
        at += n;
      }
    }
    start[num_producers] = at;
    parallel_for(K, threads, [&](size_t k) {
      std::vector<size_t>& slot = count[k];
      for (uint64_t j = 0; j < per[k].cuts.size(); ++j) order[slot[per[k].cuts[j].producer]++] = uint64_t{k} << kCutBits | j;
    });
  }
  const uint64_t align = std::max<uint64_t>(1, options.segment_alignment);
  const auto ng = static_cast<size_t>(G);
  routes.producers.assign(num_producers, ProducerRoute{std::vector<ProducerGroup>(ng)});
  // Pass A, per producer: sort its cuts, cut them into segments (one per group and plan
  // class) and make its packs. Each segment's cuts are a run of `order`.
  struct Run {
    uint32_t group = 0, plan = 0;
    uint64_t offset = 0, bytes = 0;  // the segment in the producer's staging
    size_t a = 0, b = 0;             // its cuts: order[a, b)
  };
  std::vector<std::vector<Run>> runs(num_producers);
  std::vector<uint64_t> sole(num_producers, 0);
  parallel_for(num_producers, threads, [&](size_t p) {
    const auto b0 = static_cast<std::ptrdiff_t>(start[p]), b1 = static_cast<std::ptrdiff_t>(start[p + 1]);
    std::sort(order.begin() + b0, order.begin() + b1, [&](CutRef a, CutRef b) {
      const Cut& x = cut_of(a);
      const Cut& y = cut_of(b);
      if (x.group != y.group) return x.group < y.group;
      if (x.plan != y.plan) return x.plan < y.plan;
      if (x.param != y.param) return x.param < y.param;
      return x.dst_offset < y.dst_offset;
    });
    ProducerRoute& pr = routes.producers[p];
    const bool keep = options.packs_of == RouterOptions::kEveryRank || options.packs_of == static_cast<int>(p);
    if (keep) {  // Room for every op up front (merges only make fewer).
      std::vector<size_t> packs(ng, 0);
      for (size_t i = start[p]; i < start[p + 1]; ++i) ++packs[static_cast<size_t>(cut_of(order[i]).group)];
      for (size_t g = 0; g < ng; ++g) pr.groups[g].packs.reserve(packs[g]);
    }
    for (size_t a = start[p]; a < start[p + 1];) {
      const Cut& first = cut_of(order[a]);
      const auto g = static_cast<size_t>(first.group);
      ProducerGroup& pg = pr.groups[g];
      // A producer's cuts are by group: this group's segments come one after another.
      OpSink<PackOp> sink(keep ? &pg.packs : nullptr);
      for (; a < start[p + 1] && static_cast<size_t>(cut_of(order[a]).group) == g;) {
        const Cut& head = cut_of(order[a]);
        const LayoutPool& pool = per[head.plan].pool;
        Run run{static_cast<uint32_t>(g), head.plan, align_up(pg.staging_bytes, align), 0, a, a};
        uint64_t cur = run.offset;
        sink.begin_segment();
        size_t b = a;
        for (; b < start[p + 1]; ++b) {
          const Cut& c = cut_of(order[b]);
          if (static_cast<size_t>(c.group) != g || c.plan != head.plan) break;
          sink.push(PackOp{c.box, c.wire, cur, pool.src(c.layouts)}, dtype_size(c.wire));
          if (c.sole) sole[p] += c.cost;
          cur += c.bytes;
        }
        run.bytes = cur - run.offset;
        run.b = b;
        pg.staging_bytes = cur;
        pg.segments.push_back(Segment{run.plan, run.offset, run.bytes});
        runs[p].push_back(run);
        a = b;
      }
      std::tie(pg.elided_packs, pg.elided_digest) = sink.finish();
    }
    for (ProducerGroup& pg : pr.groups) pg.packs.shrink_to_fit();  // merged ops left room unused
  });
  // Pass B, per plan class: its reads (producer by producer, as the consumer receives
  // them) and its unpacks.
  const int keep_plan = options.unpacks_of >= 0 ? static_cast<int>(routes.consumer_plan[static_cast<size_t>(options.unpacks_of)]) : -1;
  parallel_for(routes.plans.size(), threads, [&](size_t k) {
    PlanRoute& route = routes.plans[k];
    const LayoutPool& pool = per[k].pool;
    const bool keep = options.unpacks_of == RouterOptions::kEveryRank || keep_plan == static_cast<int>(k);
    if (keep) {
      std::vector<size_t> unpacks(ng, 0);
      for (uint32_t p = 0; p < num_producers; ++p)
        for (const Run& r : runs[p])
          if (r.plan == k) unpacks[r.group] += r.b - r.a;
      for (size_t g = 0; g < ng; ++g) route.groups[g].unpacks.reserve(unpacks[g]);
    }
    std::vector<OpSink<UnpackOp>> sinks;
    sinks.reserve(ng);
    for (size_t g = 0; g < ng; ++g) sinks.emplace_back(keep ? &route.groups[g].unpacks : nullptr);
    for (uint32_t p = 0; p < num_producers; ++p) {
      for (const Run& r : runs[p]) {
        if (r.plan != k) continue;
        PlanGroup& cg = route.groups[r.group];
        OpSink<UnpackOp>& sink = sinks[r.group];
        const Read rd{p, r.offset, r.bytes, align_up(cg.recv_bytes, align)};
        sink.begin_segment();
        uint64_t cur = rd.recv_offset;
        for (size_t i = r.a; i < r.b; ++i) {
          const Cut& c = cut_of(order[i]);
          sink.push(UnpackOp{c.param, c.wire, cur, pool.dst(c.layouts)}, dtype_size(c.wire));
          cur += c.bytes;
        }
        cg.recv_bytes = rd.recv_offset + rd.length;
        cg.reads.push_back(rd);
      }
    }
    for (size_t g = 0; g < ng; ++g) {
      PlanGroup& cg = route.groups[g];
      std::tie(cg.elided_unpacks, cg.elided_digest) = sinks[g].finish();
      cg.unpacks.shrink_to_fit();
    }
  });
  std::vector<uint64_t> plan_min(per.size(), 0);
  for (size_t k = 0; k < per.size(); ++k) plan_min[k] = per[k].bytes;
  // --- stats ----------------------------------------------------------------------------
  RouteStats& st = routes.stats;
  st.num_pieces = num_cuts;
  st.num_plan_classes = classes.size();
  st.producer_bytes.assign(num_producers, 0);
  for (uint32_t p = 0; p < num_producers; ++p) {
    for (const ProducerGroup& pg : routes.producers[p].groups) {
      st.num_pack_ops += pg.packs.size() + pg.elided_packs;
      st.max_staging_bytes = std::max(st.max_staging_bytes, pg.staging_bytes);
      for (const Segment& s : pg.segments) st.producer_bytes[p] += s.bytes * weight[s.plan];
    }
  }
  for (const PlanRoute& pr : routes.plans) {
    for (const PlanGroup& g : pr.groups) st.num_unpack_ops += g.unpacks.size() + g.elided_unpacks;
  }
  st.consumer_bytes.assign(in.consumers.size(), 0);
  for (size_t c = 0; c < in.consumers.size(); ++c) {
    for (const PlanGroup& g : routes.consumer(c).groups) {
      st.num_reads += g.reads.size();
      for (const Read& r : g.reads) st.consumer_bytes[c] += r.length;
    }
    st.bytes_moved += st.consumer_bytes[c];
    st.bytes_min += plan_min[routes.consumer_plan[c]];
    st.max_consumer_bytes = std::max(st.max_consumer_bytes, st.consumer_bytes[c]);
  }
  uint64_t total = 0;
  for (uint32_t p = 0; p < num_producers; ++p) {
    total += st.producer_bytes[p];
    st.max_producer_bytes = std::max(st.max_producer_bytes, st.producer_bytes[p]);
    st.max_sole_holder_bytes = std::max(st.max_sole_holder_bytes, sole[p]);
    if (!in.producers[p].boxes.empty()) st.holders++;
  }
  st.mean_producer_bytes = st.holders ? static_cast<double>(total) / static_cast<double>(st.holders) : 0.0;
  st.balance_bound = std::max(st.mean_producer_bytes, static_cast<double>(st.max_sole_holder_bytes));
  // Holder components: producers linked by holding a common piece. Every byte of a
  // component's pieces is sent by its producers, so cost / size bounds its busiest one.
  {
    std::vector<uint32_t> parent(num_producers);
    std::iota(parent.begin(), parent.end(), 0);
    auto find = [&](uint32_t x) {
      while (parent[x] != x) x = parent[x] = parent[parent[x]];
      return x;
    };
    for (const TensorInfo& ti : tensors) {
      for (const TensorPiece& p : ti.pieces) {
        const uint32_t a = find(ti.holders[p.holders[0]].producer);
        for (uint32_t h : p.holders) parent[find(ti.holders[h].producer)] = a;
      }
    }
    std::vector<double> cost(num_producers, 0.0), size(num_producers, 0.0);
    for (uint32_t p = 0; p < num_producers; ++p) {
      cost[find(p)] += static_cast<double>(st.producer_bytes[p]);
      size[find(p)] += 1.0;
    }
    for (uint32_t p = 0; p < num_producers; ++p) {
      if (find(p) == p && size[p] > 0) st.component_bound = std::max(st.component_bound, cost[p] / size[p]);
    }
    st.component_bound = std::max(st.component_bound, static_cast<double>(st.max_sole_holder_bytes));
  }
  st.balance = st.balance_bound > 0 ? static_cast<double>(st.max_producer_bytes) / st.balance_bound : 1.0;
  return routes;
}

}  // namespace ferry
