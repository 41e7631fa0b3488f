// The quantisation tiles of one param and the regions they are cut into (issue 29):
// the grid over [batch, rows, cols] (leading dims flattened into batch) of trows x block
// tiles, each carrying an id (who can quantise it: the router's interned producer sets),
// and a partition of the grid into tile-aligned boxes of one id each. Pure and internal
// to the router (src/route).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ferry/tensor.h"
#include "tensor/fp8_blocks.h"

namespace ferry::route_detail {

// A quantised param's scales (BlockQuantize::format, the tile's columns): their dtype,
// and their shape, the weight's with its last two dims counted in tiles
// (batch::fp8_tile_rows rows of `block` columns each).
inline DType scale_dtype(uint8_t format) { return format == batch::kScaleF32 ? DType::kF32 : DType::kU8; }
inline Shape scale_shape(const Shape& weight, uint8_t format, int64_t block) {
  Shape s = weight;
  if (s.size() < 2) return s;
  const int64_t trows = batch::fp8_tile_rows(format, block);
  s[s.size() - 2] = (s[s.size() - 2] + trows - 1) / trows;
  s.back() = (s.back() + block - 1) / block;
  return s;
}

// The tiles are kept as runs of one id along each tile row (tile rows are few runs: a
// cut covers whole tile columns ranges), so marking a run of whole rows costs a run per
// tile row, not a write per tile: MXFP8's 1 x 32 tiles are 11 million for one class's
// Kimi-K2 experts, and a per-tile grid took minutes to route.
class TileGrid {
 public:
  static constexpr int32_t kNone = -1;  // no element seen yet
  struct Run {
    int64_t bc0 = 0, bc1 = 0;  // tiles [bc0, bc1) of one tile row
    int32_t id = kNone;
  };

  // `shape`: the param's (at least 2 dims); tiles of trows x block.
  TileGrid(const Shape& shape, int64_t trows, int64_t block);

  int64_t batch() const { return batch_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t trows() const { return trows_; }
  int64_t block() const { return block_; }
  int64_t tile_rows() const { return brows_; }  // tiles along rows
  int64_t tile_cols() const { return bcols_; }
  uint64_t tiles() const { return static_cast<uint64_t>(batch_ * brows_ * bcols_); }
  // Tile row (b, br): runs in column order, covering [0, tile_cols()), neighbours of
  // different ids.
  const std::vector<Run>& runs(int64_t b, int64_t br) const { return runs_[static_cast<size_t>(b * brows_ + br)]; }
  int32_t id(int64_t b, int64_t br, int64_t bc) const;
  uint64_t count(int32_t id) const;  // tiles with that id

  // Every tile elements [flat, flat + n) (contiguous) lie in, a run at a time:
  // `mark(id&, b, br, bc0, bc1)` for tiles [bc0, bc1) of tile row (b, br), whose ids were
  // all `id` (runs split at the bounds first, merged again after).
  template <typename Mark>
  void mark_run(int64_t flat, int64_t n, Mark&& mark) {
    while (n > 0) {
      const int64_t b = flat / (rows_ * cols_), rc = flat % (rows_ * cols_);
      const int64_t r = rc / cols_, c = rc % cols_;
      if (c == 0 && n >= cols_) {  // whole rows
        const int64_t k = std::min(n / cols_, rows_ - r);
        for (int64_t br = r / trows_; br <= (r + k - 1) / trows_; ++br) mark_tiles(b, br, 0, bcols_, mark);
        flat += k * cols_;
        n -= k * cols_;
        continue;
      }
      const int64_t len = std::min(n, cols_ - c);
      mark_tiles(b, r / trows_, c / block_, (c + len - 1) / block_ + 1, mark);
      flat += len;
      n -= len;
    }
  }

 private:
  // Runs of `row` split so that `at` starts one (0 < at < tile_cols()).
  static void split_at(std::vector<Run>& row, int64_t at) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (row[i].bc0 < at && at < row[i].bc1) {
        Run right = row[i];
        right.bc0 = at;
        row[i].bc1 = at;
        row.insert(row.begin() + static_cast<std::ptrdiff_t>(i) + 1, right);
        return;
      }
    }
  }
  template <typename Mark>
  void mark_tiles(int64_t b, int64_t br, int64_t bc0, int64_t bc1, Mark& mark) {
    std::vector<Run>& row = runs_[static_cast<size_t>(b * brows_ + br)];
    split_at(row, bc0);
    split_at(row, bc1);
    for (Run& x : row)
      if (x.bc0 >= bc0 && x.bc1 <= bc1) mark(x.id, b, br, x.bc0, x.bc1);
    size_t out = 0;
    for (size_t i = 1; i < row.size(); ++i) {
      if (row[i].id == row[out].id) {
        row[out].bc1 = row[i].bc1;
      } else {
        row[++out] = row[i];
      }
    }
    row.resize(out + 1);
  }
  int64_t trows_, block_, rows_ = 0, cols_ = 0, batch_ = 0, brows_ = 0, bcols_ = 0;
  std::vector<std::vector<Run>> runs_;  // per tile row
};

// Every element of `l` (a layout over a param's flat row-major space) to
// `tiles.mark_run(flat, n, args...)`: runs along the innermost dim at once, other strides
// element by element. (TileGrid, and quantize_sides' runs of MXFP8 tiles.)
template <typename Tiles, typename... Args>
void mark_layout(Tiles& tiles, const Layout& l, Args&&... args) {
  const size_t nd = l.shape.size();
  if (l.numel() == 0) return;
  if (nd == 0) return tiles.mark_run(l.offset, 1, args...);
  const int64_t inner = l.shape[nd - 1], stride = l.strides[nd - 1];
  std::vector<int64_t> idx(nd - 1, 0);
  for (;;) {
    int64_t f = l.offset;
    for (size_t k = 0; k + 1 < nd; ++k) f += idx[k] * l.strides[k];
    if (stride == 1) {
      tiles.mark_run(f, inner, args...);
    } else {
      for (int64_t i = 0; i < inner; ++i) tiles.mark_run(f + i * stride, 1, args...);
    }
    size_t k = idx.size();
    while (k > 0 && ++idx[k - 1] == l.shape[k - 1]) idx[--k] = 0;
    if (k == 0) return;
  }
}

// A box of the param in elements ([b0, b0 + nb) x [r0, r0 + nr) x [c0, c0 + nc) of
// [batch, rows, cols]), its origin on the tile grid, its ends on it or at the param's
// edge; every tile in it has id `id`.
struct TileRegion {
  int64_t b0 = 0, nb = 0, r0 = 0, nr = 0, c0 = 0, nc = 0;
  int32_t id = 0;
  uint64_t numel() const { return static_cast<uint64_t>(nb * nr * nc); }
  friend bool operator==(const TileRegion&, const TileRegion&) = default;
};

// Cuts the grid into regions: each tile row's runs of one id, merged with the run of the
// tile row above where both span the same columns with the same id, whole matrices of
// one id merged across the batch; then each region split (along the batch, then tile
// rows, then tile columns) to at most `max_elements`, or one tile where a tile is larger.
// Deterministic; regions come by (b0, r0, c0). Every id must be >= 0.
std::vector<TileRegion> tile_regions(const TileGrid& grid, uint64_t max_elements);

}  // namespace ferry::route_detail
