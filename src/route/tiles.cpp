// Tile grids and regions of one quantised param (see tiles.h).
#include "route/tiles.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace ferry::route_detail {

TileGrid::TileGrid(const Shape& shape, int64_t trows, int64_t block) : trows_(trows), block_(block) {
  const size_t nd = shape.size();
  rows_ = shape[nd - 2];
  cols_ = shape[nd - 1];
  batch_ = rows_ * cols_ == 0 ? 0 : shape_numel(shape) / (rows_ * cols_);
  brows_ = (rows_ + trows - 1) / trows;
  bcols_ = (cols_ + block - 1) / block;
  runs_.assign(static_cast<size_t>(batch_ * brows_), std::vector<Run>{Run{0, bcols_, kNone}});
}

int32_t TileGrid::id(int64_t b, int64_t br, int64_t bc) const {
  for (const Run& r : runs(b, br))
    if (bc >= r.bc0 && bc < r.bc1) return r.id;
  return kNone;
}

uint64_t TileGrid::count(int32_t id) const {
  uint64_t n = 0;
  for (const auto& row : runs_)
    for (const Run& r : row) n += r.id == id ? static_cast<uint64_t>(r.bc1 - r.bc0) : 0;
  return n;
}

namespace {

// Splits `r` into pieces of at most `max_elements` (tile multiples), appending them.
void split_region(const TileGrid& g, const TileRegion& r, uint64_t max_elements, std::vector<TileRegion>& out) {
  if (r.numel() <= max_elements) {
    out.push_back(r);
    return;
  }
  const auto max = static_cast<int64_t>(std::max<uint64_t>(max_elements, 1));
  const int64_t matrix = r.nr * r.nc;
  if (r.nb > 1) {  // whole matrices first
    const int64_t per = std::max<int64_t>(1, max / std::max<int64_t>(matrix, 1));
    if (per < r.nb || matrix > max) {
      for (int64_t b = 0; b < r.nb; b += per) {
        TileRegion s = r;
        s.b0 = r.b0 + b;
        s.nb = std::min(per, r.nb - b);
        split_region(g, s, max_elements, out);
      }
      return;
    }
  }
  if (r.nr > g.trows()) {  // then tile rows
    const int64_t per_rows = std::max<int64_t>(1, max / (g.trows() * std::max<int64_t>(r.nc, 1))) * g.trows();
    if (per_rows < r.nr) {
      for (int64_t row = 0; row < r.nr; row += per_rows) {
        TileRegion s = r;
        s.r0 = r.r0 + row;
        s.nr = std::min(per_rows, r.nr - row);
        split_region(g, s, max_elements, out);
      }
      return;
    }
  }
  if (r.nc > g.block()) {  // then tile columns
    const int64_t per_cols = std::max<int64_t>(1, max / (std::max<int64_t>(r.nr, 1) * g.block())) * g.block();
    if (per_cols < r.nc) {
      for (int64_t col = 0; col < r.nc; col += per_cols) {
        TileRegion s = r;
        s.c0 = r.c0 + col;
        s.nc = std::min(per_cols, r.nc - col);
        out.push_back(s);
      }
      return;
    }
  }
  out.push_back(r);  // one tile, larger than the bound
}

}  // namespace

std::vector<TileRegion> tile_regions(const TileGrid& g, uint64_t max_elements) {
  std::vector<TileRegion> merged;
  const int64_t R = g.rows(), C = g.cols(), tr = g.trows(), bl = g.block();
  for (int64_t b = 0; b < g.batch(); ++b) {
    const size_t first = merged.size();
    // Regions of this matrix still open for the next tile row, by (c0, nc, id).
    std::map<std::tuple<int64_t, int64_t, int32_t>, size_t> open, next;
    for (int64_t br = 0; br < g.tile_rows(); ++br) {
      next.clear();
      const int64_t r0 = br * tr, nr = std::min(tr, R - r0);
      for (const TileGrid::Run& run : g.runs(b, br)) {
        const int32_t id = run.id;
        const int64_t c0 = run.bc0 * bl, nc = std::min(run.bc1 * bl, C) - c0;
        const auto key = std::make_tuple(c0, nc, id);
        auto it = open.find(key);
        if (it != open.end()) {
          merged[it->second].nr += nr;
          next.emplace(key, it->second);
        } else {
          next.emplace(key, merged.size());
          merged.push_back(TileRegion{b, 1, r0, nr, c0, nc, id});
        }
      }
      std::swap(open, next);
    }
    // A whole matrix of one id continues the previous matrix's whole region of that id.
    if (merged.size() == first + 1 && first > 0) {
      const TileRegion& m = merged.back();
      TileRegion& prev = merged[first - 1];
      if (m.r0 == 0 && m.nr == R && m.c0 == 0 && m.nc == C && prev.r0 == 0 && prev.nr == R && prev.c0 == 0 &&
          prev.nc == C && prev.id == m.id && prev.b0 + prev.nb == b) {
        prev.nb++;
        merged.pop_back();
      }
    }
  }
  std::vector<TileRegion> out;
  out.reserve(merged.size());
  for (const TileRegion& r : merged) split_region(g, r, max_elements, out);
  std::sort(out.begin(), out.end(), [](const TileRegion& a, const TileRegion& b) {
    return std::tie(a.b0, a.r0, a.c0) < std::tie(b.b0, b.r0, b.c0);
  });
  return out;
}

}  // namespace ferry::route_detail
