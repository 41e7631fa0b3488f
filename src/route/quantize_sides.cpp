// Which side can block-quantise each param (issue 29): decided from the routes alone.
#include <algorithm>

#include <fmt/format.h>

#include "ferry/route.h"
#include "route/tiles.h"

namespace ferry {

namespace {

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
        FERRY_RETURN_IF_ERROR(each_unpack([&](const Layout& l, int32_t p) { route_detail::mark_layout(tiles, l, p); }));
        side.tiles = tiles.tiles();
        tiles.finish(side.tiles_split, tiles_reached);
      } else {
        // Each tile: the producer all its elements came from so far (kNone, kSplit).
        route_detail::TileGrid tiles(d.shape, format.block_rows, format.block);
        FERRY_RETURN_IF_ERROR(each_unpack([&](const Layout& l, int32_t p) {
          route_detail::mark_layout(tiles, l, [p](int32_t& t, int64_t, int64_t, int64_t, int64_t) {
            t = t == route_detail::TileGrid::kNone || t == p ? p : kSplit;
          });
        }));
        side.tiles = tiles.tiles();
        side.tiles_split = tiles.count(kSplit);
        tiles_reached = side.tiles - tiles.count(route_detail::TileGrid::kNone);
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
