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

namespace ferry::route_detail {

class TileGrid {
 public:
  static constexpr int32_t kNone = -1;  // no element seen yet

  // `shape`: the param's (at least 2 dims); tiles of trows x block.
  TileGrid(const Shape& shape, int64_t trows, int64_t block);

  int64_t batch() const { return batch_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t trows() const { return trows_; }
  int64_t block() const { return block_; }
  int64_t tile_rows() const { return brows_; }  // tiles along rows
  int64_t tile_cols() const { return bcols_; }
  uint64_t tiles() const { return id_.size(); }
  int32_t id(int64_t b, int64_t br, int64_t bc) const { return id_[index(b, br, bc)]; }
  const std::vector<int32_t>& ids() const { return id_; }

  // Every tile elements [flat, flat + n) (contiguous) lie in: `mark(tile_id&, b, br, bc)`.
  // Whole rows at once: each tile once per run, not once per row (Kimi-K2's experts are
  // 12 x 4096 rows of 56 tiles per class: marking row by row took minutes to route).
  template <typename Mark>
  void mark_run(int64_t flat, int64_t n, Mark&& mark) {
    while (n > 0) {
      const int64_t b = flat / (rows_ * cols_), rc = flat % (rows_ * cols_);
      const int64_t r = rc / cols_, c = rc % cols_;
      if (c == 0 && n >= cols_) {
        const int64_t k = std::min(n / cols_, rows_ - r);
        for (int64_t br = r / trows_; br <= (r + k - 1) / trows_; ++br)
          for (int64_t bc = 0; bc < bcols_; ++bc) mark(id_[index(b, br, bc)], b, br, bc);
        flat += k * cols_;
        n -= k * cols_;
        continue;
      }
      const int64_t len = std::min(n, cols_ - c);
      for (int64_t bc = c / block_; bc <= (c + len - 1) / block_; ++bc) {
        mark(id_[index(b, r / trows_, bc)], b, r / trows_, bc);
      }
      flat += len;
      n -= len;
    }
  }

 private:
  size_t index(int64_t b, int64_t br, int64_t bc) const { return static_cast<size_t>((b * brows_ + br) * bcols_ + bc); }
  int64_t trows_, block_, rows_ = 0, cols_ = 0, batch_ = 0, brows_ = 0, bcols_ = 0;
  std::vector<int32_t> id_;
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
