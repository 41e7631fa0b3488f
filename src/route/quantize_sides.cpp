// Which side can block-quantise each param (issue 29): decided from the routes alone.
#include <algorithm>

#include <fmt/format.h>

#include "ferry/route.h"

namespace ferry {

namespace {

constexpr int32_t kNone = -1;   // no element of the tile seen yet
constexpr int32_t kSplit = -2;  // elements from two producers

// The producer each read of `pg` comes from, by receive offset (reads are disjoint).
struct ReadIndex {
  std::vector<std::pair<uint64_t, const Read*>> by_offset;
  explicit ReadIndex(const PlanGroup& pg) {
    for (const Read& r : pg.reads)
      if (r.length) by_offset.emplace_back(r.recv_offset, &r);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  // The read holding receive byte `at`, or null.
  const Read* at(uint64_t at) const {
    auto it = std::upper_bound(by_offset.begin(), by_offset.end(), at,
                               [](uint64_t v, const auto& x) { return v < x.first; });
    if (it == by_offset.begin()) return nullptr;
    const Read* r = std::prev(it)->second;
    return at < r->recv_offset + r->length ? r : nullptr;
  }
};

// Tiles of one param: [batch][rows / block][cols / block], each the producer all its
// elements came from so far (kNone, kSplit).
class TileOwners {
 public:
  TileOwners(const Shape& shape, int64_t trows, int64_t block) : trows_(trows), block_(block) {
    const size_t nd = shape.size();
    rows_ = shape[nd - 2];
    cols_ = shape[nd - 1];
    batch_ = rows_ * cols_ == 0 ? 0 : shape_numel(shape) / (rows_ * cols_);
    brows_ = (rows_ + trows - 1) / trows;
    bcols_ = (cols_ + block - 1) / block;
    owner_.assign(static_cast<size_t>(batch_ * brows_ * bcols_), kNone);
  }
  uint64_t tiles() const { return owner_.size(); }

  // Elements [flat, flat + n) of the param, contiguous, from producer p.
  void mark_run(int64_t flat, int64_t n, int32_t p) {
    while (n > 0) {
      const int64_t b = flat / (rows_ * cols_), rc = flat % (rows_ * cols_);
      const int64_t r = rc / cols_, c = rc % cols_;
      const int64_t len = std::min(n, cols_ - c);
      for (int64_t bc = c / block_; bc <= (c + len - 1) / block_; ++bc) mark(b, r / trows_, bc, p);
      flat += len;
      n -= len;
    }
  }
  void mark_element(int64_t flat, int32_t p) { mark_run(flat, 1, p); }

  // Tiles whose elements came from more than one producer, and tiles no element reached.
  uint64_t split() const { return static_cast<uint64_t>(std::count(owner_.begin(), owner_.end(), kSplit)); }
  uint64_t unreached() const { return static_cast<uint64_t>(std::count(owner_.begin(), owner_.end(), kNone)); }

 private:
  void mark(int64_t b, int64_t br, int64_t bc, int32_t p) {
    int32_t& o = owner_[static_cast<size_t>((b * brows_ + br) * bcols_ + bc)];
    if (o == kNone) {
      o = p;
    } else if (o != p) {
      o = kSplit;
    }
  }
  int64_t trows_, block_, rows_ = 0, cols_ = 0, batch_ = 0, brows_ = 0, bcols_ = 0;
  std::vector<int32_t> owner_;
};

// Every element of `dst` (a layout over the param's flat index space) marked as coming
// from producer p: runs along the innermost dim at once, other strides element by element.
template <class Tiles>
void mark_layout(Tiles& tiles, const Layout& dst, int32_t p) {
  const size_t nd = dst.shape.size();
  if (dst.numel() == 0) return;
  if (nd == 0) {
    tiles.mark_element(dst.offset, p);
    return;
  }
  const int64_t inner = dst.shape[nd - 1], stride = dst.strides[nd - 1];
  std::vector<int64_t> idx(nd - 1, 0);
  for (;;) {
    int64_t f = dst.offset;
    for (size_t k = 0; k + 1 < nd; ++k) f += idx[k] * dst.strides[k];
    if (stride == 1) {
      tiles.mark_run(f, inner, p);
    } else {
      for (int64_t i = 0; i < inner; ++i) tiles.mark_element(f + i * stride, p);
    }
    size_t k = idx.size();
    while (k > 0 && ++idx[k - 1] == dst.shape[k - 1]) idx[--k] = 0;
    if (k == 0) return;
  }
}

// Tiles of one row (MXFP8's 1 x block runs): in flat order a tile is a contiguous range,
// so tiles follow the elements' order and a tile is split exactly when a boundary between
// two producers' runs falls inside it. Runs instead of one mark per tile: a trillion
// parameters have tens of billions of such tiles.
class RowTileRuns {
 public:
  RowTileRuns(const Shape& shape, int64_t block) : block_(block) {
    cols_ = shape.back();
    bcols_ = (cols_ + block - 1) / block;
    const int64_t rows = shape_numel(shape) / std::max<int64_t>(cols_, 1);
    tiles_ = static_cast<uint64_t>(rows * bcols_);
  }
  uint64_t tiles() const { return tiles_; }
  void mark_run(int64_t flat, int64_t n, int32_t p) { runs_.push_back({flat, flat + n, p}); }
  void mark_element(int64_t flat, int32_t p) { mark_run(flat, 1, p); }
  // Splits and tiles reached, from the runs sorted.
  void finish(uint64_t& split, uint64_t& reached) {
    std::sort(runs_.begin(), runs_.end(), [](const Run& a, const Run& b) { return a.lo < b.lo; });
    split = reached = 0;
    int64_t last_tile = -1, last_split = -1;
    int32_t last_producer = -1;
    for (const Run& r : runs_) {
      const int64_t t0 = tile_of(r.lo), t1 = tile_of(r.hi - 1);
      reached += static_cast<uint64_t>(t1 - t0 + 1) - (t0 == last_tile ? 1 : 0);
      if (t0 == last_tile && r.producer != last_producer && last_split != t0) {
        ++split;
        last_split = t0;
      }
      last_tile = t1;
      last_producer = r.producer;
    }
  }

 private:
  struct Run {
    int64_t lo, hi;
    int32_t producer;
  };
  int64_t tile_of(int64_t flat) const { return (flat / cols_) * bcols_ + (flat % cols_) / block_; }
  int64_t block_, cols_ = 0, bcols_ = 0;
  uint64_t tiles_ = 0;
  std::vector<Run> runs_;
};

}  // namespace

Result<std::vector<QuantizeSide>> quantize_sides(const Routes& routes,
                                                 const std::vector<std::vector<uint32_t>>& quantized,
                                                 const BlockQuantizeFormat& format) {
  if (quantized.size() != routes.plans.size()) {
    return invalid_argument("quantize_sides: {} lists of quantised params for {} plan classes", quantized.size(),
                            routes.plans.size());
  }
  if (format.block <= 0 || format.block_rows <= 0) {
    return invalid_argument("quantize_sides: tiles of {} x {} must be positive", format.block_rows, format.block);
  }
  std::vector<uint64_t> consumers(routes.plans.size(), 0);
  for (uint32_t k : routes.consumer_plan) ++consumers[k];
  std::vector<QuantizeSide> out;
  for (uint32_t k = 0; k < routes.plans.size(); ++k) {
    const PlanRoute& pr = routes.plans[k];
    std::vector<ReadIndex> reads;
    reads.reserve(pr.groups.size());
    for (const PlanGroup& pg : pr.groups) reads.emplace_back(pg);
    for (uint32_t param : quantized[k]) {
      if (param >= pr.params.size()) {
        return out_of_range("quantize_sides: plan {} has {} params, not {}", k, pr.params.size(), param);
      }
      const TensorDecl& d = pr.params[param];
      if (d.shape.size() < 2 || !is_floating(d.dtype)) {
        return invalid_argument("quantize_sides: param '{}' ({} {}) is not a float matrix", d.name,
                                dtype_name(d.dtype), shape_str(d.shape));
      }
      QuantizeSide side;
      uint64_t reached = 0;  // elements the routes carry (not the plan's zero padding)
      side.plan = k;
      side.param = param;
      side.name = d.name;
      side.consumers = consumers[k];
      auto each_unpack = [&](auto&& mark) -> Status {
        for (size_t g = 0; g < pr.groups.size(); ++g) {
          for (const UnpackOp& u : pr.groups[g].unpacks) {
            if (u.param != param) continue;
            const Read* r = reads[g].at(u.offset);
            if (!r) return internal_error("quantize_sides: plan {} group {}: unpack of '{}' outside every read", k, g, d.name);
            side.bytes_dense += static_cast<uint64_t>(u.dst.numel()) * dtype_size(u.src_dtype);
            reached += static_cast<uint64_t>(u.dst.numel());
            mark(u.dst, static_cast<int32_t>(r->producer));
          }
        }
        return Status::Ok();
      };
      uint64_t tiles_reached = 0;
      if (format.block_rows == 1) {
        RowTileRuns tiles(d.shape, format.block);
        FERRY_RETURN_IF_ERROR(each_unpack([&](const Layout& l, int32_t p) { mark_layout(tiles, l, p); }));
        side.tiles = tiles.tiles();
        tiles.finish(side.tiles_split, tiles_reached);
      } else {
        TileOwners tiles(d.shape, format.block_rows, format.block);
        FERRY_RETURN_IF_ERROR(each_unpack([&](const Layout& l, int32_t p) { mark_layout(tiles, l, p); }));
        side.tiles = tiles.tiles();
        side.tiles_split = tiles.split();
        tiles_reached = side.tiles - tiles.unreached();
      }
      // A tile no element reaches (all zero padding) has nothing to send: its scale is
      // the all-zero tile's, which the consumer knows.
      side.on_producer = side.tiles_split == 0;
      side.bytes_quantized = reached * format.value_bytes + tiles_reached * format.scale_bytes;
      out.push_back(std::move(side));
    }
  }
  return out;
}

}  // namespace ferry
