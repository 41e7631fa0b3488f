// build_routes: pieces, assignment, segments (see ferry/route.h and docs/routing.md).
#include <algorithm>
#include <array>
#include <climits>
#include <iterator>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>
#include <unordered_map>

#include "ferry/route.h"
#include "common/parallel.h"
#include "route/op_digest.h"
#include "route/tiles.h"

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
  int32_t region = -1;   // a region a producer quantises (ClassCuts::regions), not a piece
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

// A region of a param a producer quantises (RouterOptions::quantize_on): its box, the
// producers that hold every element of it, and the param's cuts that land in it (their
// layouts stay in the class's pool; ClassCuts::quant_cuts).
struct QuantRegion {
  route_detail::TileRegion box;
  uint32_t param = 0, scale = 0;         // in the class's route (PlanRoute::params)
  int64_t batch = 0, rows = 0, cols = 0;  // the param as [batch, rows, cols]
  DType dtype = DType::kBF16;  // the param's dtype in the plan
  uint8_t format = 0;
  uint32_t block = 128;
  std::vector<uint32_t> producers;
  std::vector<uint32_t> cuts;  // into ClassCuts::quant_cuts
};

// One plan class's cuts, their layouts and the bytes they carry (built on one thread).
struct ClassCuts {
  Blocks<Cut> cuts;
  LayoutPool pool;
  uint64_t bytes = 0;
  Status status;
  std::vector<QuantRegion> regions;
  std::vector<Cut> quant_cuts;  // cuts of producer-quantised params, replaced by their regions
  uint64_t quantized = 0, on_producer = 0;
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

// The producers holding a tensor piece, sorted.
std::vector<uint32_t> producers_of(const TensorInfo& ti, const TensorPiece& piece) {
  std::vector<uint32_t> out;
  out.reserve(piece.holders.size());
  for (uint32_t h : piece.holders) out.push_back(ti.holders[h].producer);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Producer-side quantisation of one plan class (RouterOptions::quantize_on): for each
// param the plan keeps block-quantised whose every tile some producer holds whole, its
// cuts are replaced by regions (tile-aligned boxes each one producer set holds) and the
// class's route gets the param as e4m3 plus its scales. The rest stay dense, for the
// consumer to quantise.
void quantize_class(const Plan& plan, uint64_t weight, const std::vector<TensorInfo>& tensors,
                    ClassCuts& out, PlanRoute& route) {
  std::vector<std::vector<size_t>> cuts_of(plan.params().size());
  for (size_t j = 0; j < out.cuts.size(); ++j) cuts_of[out.cuts[j].param].push_back(j);
  std::vector<bool> padded(plan.params().size(), false);
  for (const Zero& z : plan.zeros()) padded[z.param] = true;
  std::vector<bool> dropped(out.cuts.size(), false);
  std::vector<Cut> region_cuts;
  for (const BlockQuantize& bq : plan.quantized()) {
    ++out.quantized;
    const TensorDecl& d = plan.params()[bq.param];
    const std::vector<size_t>& mine = cuts_of[bq.param];
    if (mine.empty() || padded[bq.param]) continue;
    bool ok = true;
    for (size_t j : mine) ok &= out.cuts[j].group == out.cuts[mine[0]].group;
    if (!ok) continue;
    // Each tile: the producers that hold every element of it (interned sets).
    const int64_t trows = batch::fp8_tile_rows(bq.format, bq.block);
    route_detail::TileGrid grid(d.shape, trows, bq.block);
    std::vector<std::vector<uint32_t>> sets;
    std::map<std::vector<uint32_t>, int32_t> set_id;
    std::map<std::pair<int32_t, int32_t>, int32_t> meets;
    auto intern = [&](std::vector<uint32_t> s) {
      auto [it, fresh] = set_id.emplace(s, static_cast<int32_t>(sets.size()));
      if (fresh) sets.push_back(std::move(s));
      return it->second;
    };
    auto meet = [&](int32_t a, int32_t b) {
      const auto key = std::minmax(a, b);
      auto it = meets.find(key);
      if (it != meets.end()) return it->second;
      std::vector<uint32_t> both;
      std::set_intersection(sets[a].begin(), sets[a].end(), sets[b].begin(), sets[b].end(), std::back_inserter(both));
      const int32_t id = intern(std::move(both));
      meets.emplace(key, id);
      return id;
    };
    struct TileBox {
      int64_t b0 = INT64_MAX, b1 = -1, r0 = INT64_MAX, r1 = -1, c0 = INT64_MAX, c1 = -1;
    };
    std::vector<TileBox> bounds(mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      const Cut& c = out.cuts[mine[i]];
      const TensorInfo& ti = tensors[c.tensor];
      const int32_t id = intern(producers_of(ti, ti.pieces[c.piece]));
      TileBox& tb = bounds[i];
      route_detail::mark_layout(grid, out.pool.dst(c.layouts),
                                [&](int32_t& t, int64_t b, int64_t br, int64_t bc0, int64_t bc1) {
                                  t = t == route_detail::TileGrid::kNone ? id : (t == id ? id : meet(t, id));
                                  tb.b0 = std::min(tb.b0, b), tb.b1 = std::max(tb.b1, b);
                                  tb.r0 = std::min(tb.r0, br), tb.r1 = std::max(tb.r1, br);
                                  tb.c0 = std::min(tb.c0, bc0), tb.c1 = std::max(tb.c1, bc1 - 1);
                                });
    }
    for (int64_t b = 0; b < grid.batch() && ok; ++b)
      for (int64_t br = 0; br < grid.tile_rows() && ok; ++br)
        for (const route_detail::TileGrid::Run& run : grid.runs(b, br))
          ok &= run.id >= 0 && !sets[static_cast<size_t>(run.id)].empty();
    if (!ok) continue;
    ++out.on_producer;
    // The param becomes e4m3 in this class's route; its scales are appended.
    const uint32_t scale = static_cast<uint32_t>(route.params.size());
    route.params[bq.param].dtype = DType::kF8E4M3;
    route.params.push_back(TensorDecl{bq.scale_name, route_detail::scale_dtype(bq.format),
                                      route_detail::scale_shape(d.shape, bq.format, bq.block)});
    route.quantized.push_back(QuantizedParam{bq.param, scale, bq.format, bq.block, d.dtype});
    const Cut& first = out.cuts[mine[0]];
    for (size_t j : mine) {
      dropped[j] = true;
      out.bytes -= out.cuts[j].bytes;
    }
    const uint32_t qbase = static_cast<uint32_t>(out.quant_cuts.size());
    for (size_t j : mine) out.quant_cuts.push_back(out.cuts[j]);
    for (const route_detail::TileRegion& box : route_detail::tile_regions(grid, kMaxQuantRegionElements)) {
      QuantRegion qr;
      qr.box = box;
      qr.param = bq.param;
      qr.scale = scale;
      qr.batch = grid.batch();
      qr.rows = grid.rows();
      qr.cols = grid.cols();
      qr.dtype = d.dtype;
      qr.format = bq.format;
      qr.block = bq.block;
      qr.producers = sets[static_cast<size_t>(box.id)];
      const int64_t tb0 = box.b0, tb1 = box.b0 + box.nb - 1, tr0 = box.r0 / trows, tr1 = (box.r0 + box.nr - 1) / trows;
      const int64_t tc0 = box.c0 / bq.block, tc1 = (box.c0 + box.nc - 1) / bq.block;
      for (size_t i = 0; i < mine.size(); ++i) {
        const TileBox& tb = bounds[i];
        if (tb.b1 >= tb0 && tb.b0 <= tb1 && tb.r1 >= tr0 && tb.r0 <= tr1 && tb.c1 >= tc0 && tb.c0 <= tc1) {
          qr.cuts.push_back(qbase + static_cast<uint32_t>(i));
        }
      }
      QuantOp probe;  // its byte count
      probe.format = bq.format;
      probe.block = bq.block;
      probe.region = {box.nb, box.nr, box.nc};
      Cut rc = first;
      rc.region = static_cast<int32_t>(out.regions.size());
      rc.wire = DType::kF8E4M3;
      rc.bytes = probe.bytes();
      rc.cost = rc.bytes * weight;
      rc.dst_offset = (box.b0 * grid.rows() + box.r0) * grid.cols() + box.c0;
      rc.layouts = 0;
      out.bytes += rc.bytes;
      region_cuts.push_back(rc);
      out.regions.push_back(std::move(qr));
    }
  }
  if (region_cuts.empty()) return;
  Blocks<Cut> kept;
  for (size_t j = 0; j < out.cuts.size(); ++j)
    if (!dropped[j]) kept.push_back(out.cuts[j]);
  for (const Cut& c : region_cuts) kept.push_back(c);
  out.cuts = std::move(kept);
}

// The quant op of region `r` of class `cc` as producer `p` packs it at staging `offset`:
// each of the param's cuts in the region, from p's box of its piece, into the region.
Result<QuantOp> quant_op(const ClassCuts& cc, const QuantRegion& r, uint32_t p, uint64_t offset,
                         const std::vector<TensorInfo>& tensors) {
  QuantOp op;
  op.offset = offset;
  op.dtype = r.dtype;
  op.format = r.format;
  op.block = r.block;
  op.region = {r.box.nb, r.box.nr, r.box.nc};
  const std::vector<MapPiece> region{
      MapPiece{Shape{r.box.b0, r.box.r0, r.box.c0}, Layout::contiguous(op.region), 0}};
  // A region of whole rows (and whole matrices where it spans several) is a flat range.
  const bool whole_rows = r.box.c0 == 0 && r.box.nc == r.cols && (r.box.nb == 1 || (r.box.r0 == 0 && r.box.nr == r.rows));
  const int64_t region_lo = (r.box.b0 * r.rows + r.box.r0) * r.cols;
  const int64_t region_hi = region_lo + static_cast<int64_t>(r.box.numel());
  for (uint32_t j : r.cuts) {
    const Cut& qc = cc.quant_cuts[j];
    // dst indexes the param's flat space: the param as [batch, rows, cols]. (A cut is a
    // candidate by its tiles' bounding box: it may touch no element of the region.)
    Layout dst = cc.pool.dst(qc.layouts);
    Layout src = cc.pool.src(qc.layouts);
    std::vector<MapPiece> in_region;
    const int64_t lo = dst.min_offset(), hi = dst.max_offset();
    if (dst.numel() > 0 && whole_rows && lo >= region_lo && hi < region_hi) {
      // The cut lies in a region of whole rows: the region's own flat space is the param's,
      // shifted (most cuts: a region is a param's or an expert's whole matrix).
      in_region.push_back(MapPiece{Shape(dst.shape.size(), 0), Layout{dst.shape, dst.strides, dst.offset - region_lo}, 0});
    } else {
      // Runs over whole rows re-expressed along the param's dims first, so that composing
      // cuts them by the region's rows and columns, not row by row.
      unflatten(dst, src, Shape{r.batch, r.rows, r.cols});
      compose_layout_each(dst, Shape{r.batch, r.rows, r.cols}, region, nullptr,
                          [&](const MapPiece& m) { in_region.push_back(m); });
    }
    if (in_region.empty()) continue;
    const TensorInfo& ti = tensors[qc.tensor];
    const TensorPiece& piece = ti.pieces[qc.piece];
    const Holder* holder = nullptr;
    for (uint32_t h : piece.holders) {
      if (ti.holders[h].producer == p) {
        holder = &ti.holders[h];
        break;
      }
    }
    if (!holder) return internal_error("quantising a region: producer {} holds no box of a piece it was given", p);
    if (piece.refined && holder->box != piece.box) src = rebase(src, piece.box, holder->box);
    for (const MapPiece& m : in_region) {
      op.fills.push_back(FillOp{holder->box_index, Layout{m.root.shape, src.strides, src.offset_of(m.start)}, m.root});
    }
  }
  return op;
}

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

std::string_view quantize_on_name(QuantizeOn q) { return q == QuantizeOn::kProducer ? "producer" : "consumer"; }

std::optional<QuantizeOn> parse_quantize_on(std::string_view name) {
  if (name == "producer") return QuantizeOn::kProducer;
  if (name == "consumer") return QuantizeOn::kConsumer;
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
        if (options.quantize_on == QuantizeOn::kProducer && !plan.quantized().empty()) {
          quantize_class(plan, weight[k], tensors, out, routes.plans[k]);
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
  // A region's producer: the least loaded of those holding it whole (the first where
  // there is no choice; `load` null).
  auto assign_region = [&](Cut& c, const std::vector<uint64_t>* load) {
    const std::vector<uint32_t>& ps = per[c.plan].regions[static_cast<size_t>(c.region)].producers;
    uint32_t best = ps[0];
    if (load) {
      for (uint32_t q : ps) {
        if ((*load)[q] < (*load)[best]) best = q;
      }
    }
    c.producer = best;
    c.box = 0;
    c.sole = ps.size() == 1;
  };
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
        if (c.region >= 0) {
          assign_region(c, nullptr);
          continue;
        }
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
      if (c.region >= 0) {
        assign_region(c, &load);
        load[c.producer] += c.cost;
        continue;
      }
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
  std::vector<Status> quant_status(num_producers);
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
          if (c.region >= 0) {
            auto op = quant_op(per[c.plan], per[c.plan].regions[static_cast<size_t>(c.region)],
                               static_cast<uint32_t>(p), cur, tensors);
            if (!op.ok()) {
              quant_status[p] = op.status();
            } else {
              pg.quants.push_back(std::move(*op));  // (dropped below where this producer's ops are elided)
            }
            if (c.sole) sole[p] += c.cost;
            cur += c.bytes;
            continue;
          }
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
      if (!keep && !pg.quants.empty()) {
        // Elided like the packs: counted and digested after them (group_digest's order).
        for (const QuantOp& q : pg.quants) pg.elided_digest = route_detail::digest_op(pg.elided_digest, q);
        pg.elided_packs += pg.quants.size();
        pg.quants.clear();
        pg.quants.shrink_to_fit();
      }
    }
    for (ProducerGroup& pg : pr.groups) pg.packs.shrink_to_fit();  // merged ops left room unused
  });
  for (const Status& st : quant_status) FERRY_RETURN_IF_ERROR(st);
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
          if (c.region >= 0) {
            // The e4m3 values into the param's box, then the scales into its tiles.
            const QuantRegion& qr = per[k].regions[static_cast<size_t>(c.region)];
            const route_detail::TileRegion& b = qr.box;
            Layout values{{b.nb, b.nr, b.nc}, {qr.rows * qr.cols, qr.cols, 1}, (b.b0 * qr.rows + b.r0) * qr.cols + b.c0};
            coalesce_layout(values);
            sink.push(UnpackOp{qr.param, DType::kF8E4M3, cur, values}, 1);
            const int64_t trows = batch::fp8_tile_rows(qr.format, qr.block), bl = qr.block;
            const int64_t TR = (qr.rows + trows - 1) / trows, TC = (qr.cols + bl - 1) / bl;
            Layout scales{{b.nb, (b.nr + trows - 1) / trows, (b.nc + bl - 1) / bl},
                          {TR * TC, TC, 1},
                          (b.b0 * TR + b.r0 / trows) * TC + b.c0 / bl};
            coalesce_layout(scales);
            const DType sdt = route_detail::scale_dtype(qr.format);
            sink.push(UnpackOp{qr.scale, sdt, cur + static_cast<uint64_t>(values.numel()), scales}, dtype_size(sdt));
            cur += c.bytes;
            continue;
          }
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
  for (const ClassCuts& c : per) {
    st.quantized_params += c.quantized;
    st.quantized_on_producer += c.on_producer;
    st.quant_regions += c.regions.size();
  }
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
