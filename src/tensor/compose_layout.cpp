// compose_layout (ferry/tensor.h): the element map of a recorded copy, composed from
// its layout over a virtual buffer and the map of what that buffer copies.
//
// A tensor over a virtual buffer (a recorded contiguous() of a parent view) maps index
// i to flat position p(i) = offset + sum(s_k i_k) in the buffer, whose row-major digits
// q = unravel(p) index the parent. We cut the index space into boxes on which q(i) is
// affine in i and lies inside one piece of the parent's map; there the composed map is
// a strided layout. A candidate affine map (from the box corner and one step along each
// dim) is exact when every digit stays within its range over the box: both sides then
// ravel to the same p, and mixed-radix digits are unique.
#include <algorithm>
#include <utility>
#include <vector>

#include "ferry/tensor.h"

namespace ferry {
namespace {

struct Box {
  Shape start;
  Shape size;
};

Shape unravel(int64_t p, const Shape& radix) {
  Shape q(radix.size());
  for (size_t j = radix.size(); j-- > 0;) {
    q[j] = p % radix[j];
    p /= radix[j];
  }
  return q;
}

class Composer {
 public:
  Composer(const Layout& layout, const Shape& radix, const std::vector<MapPiece>& parent)
      : layout_(layout), radix_(radix), parent_(parent) {}

  // Boxes wait on an explicit stack, not on the call stack: a copy that crosses N pieces
  // (a row-parallel weight over fsdp=N holders) is cut N times, and recursing once per
  // cut overflowed the stack at N = 10^6. Pushing the second half first and popping the
  // first visits boxes in the same depth-first order the recursion did, so the output
  // is unchanged; the stack stays shallow (a peeled cut leaves one box behind).
  std::vector<MapPiece> run() {
    Box all{Shape(layout_.shape.size(), 0), layout_.shape};
    if (shape_numel(all.size) == 0) return std::move(out_);
    index_pieces();
    pending_.push_back(std::move(all));
    while (!pending_.empty()) {
      Box box = std::move(pending_.back());
      pending_.pop_back();
      visit(box);
    }
    return std::move(out_);
  }

 private:
  // Position (flat in the virtual buffer) of an index.
  int64_t pos(const Shape& i) const { return layout_.offset_of(i); }

  void visit(const Box& box) {
    const size_t nd = box.size.size();
    const size_t nq = radix_.size();
    const Shape q0 = unravel(pos(box.start), radix_);
    std::vector<Shape> dq(nd, Shape(nq, 0));
    for (size_t k = 0; k < nd; ++k) {
      if (box.size[k] <= 1) continue;
      const Shape q1 = unravel(pos(box.start) + layout_.strides[k], radix_);
      for (size_t j = 0; j < nq; ++j) dq[k][j] = q1[j] - q0[j];
    }
    // Affine check: digit ranges over the box.
    auto range = [&](size_t j) {
      int64_t lo = q0[j], hi = q0[j];
      for (size_t k = 0; k < nd; ++k) {
        const int64_t span = (box.size[k] - 1) * dq[k][j];
        (span < 0 ? lo : hi) += span;
      }
      return std::pair<int64_t, int64_t>(lo, hi);
    };
    bool affine = true;
    for (size_t j = 0; j < nq && affine; ++j) {
      auto [lo, hi] = range(j);
      affine = lo >= 0 && hi < radix_[j];
    }
    if (!affine) {
      split_at_limits(box, q0, dq, Shape(nq, 0), radix_);
      return;
    }
    // Which parent pieces does the box touch? Only those whose start on the key digit
    // lies within [lo - widest + 1, hi] can; they are taken by that start, so the first
    // partial one (which decides the cut) is the nearest, and a box peeled piece by
    // piece finds its next piece at once instead of after every piece already cut off.
    auto [key_lo, key_hi] = range(key_digit_);
    const size_t j0 = key_digit_;
    auto first = std::lower_bound(by_start_.begin(), by_start_.end(), key_lo - key_widest_ + 1,
                                  [&](uint32_t i, int64_t v) { return parent_[i].start[j0] < v; });
    for (auto it = first; it != by_start_.end() && parent_[*it].start[j0] <= key_hi; ++it) {
      const uint32_t pi = *it;
      const MapPiece& piece = parent_[pi];
      bool inside = true, disjoint = false;
      for (size_t j = 0; j < nq; ++j) {
        auto [lo, hi] = range(j);
        const int64_t plo = piece.start[j];
        const int64_t phi = piece.start[j] + piece.root.shape[j] - 1;
        if (hi < plo || lo > phi) disjoint = true;
        if (lo < plo || hi > phi) inside = false;
      }
      if (disjoint) continue;
      if (inside) {
        emit(box, q0, dq, piece, pi);
        continue;
      }
      // Partial: cut the box where it crosses this piece and visit both parts.
      Shape lo(nq), hi(nq);
      for (size_t j = 0; j < nq; ++j) {
        lo[j] = piece.start[j];
        hi[j] = piece.start[j] + piece.root.shape[j];
      }
      split_at_limits(box, q0, dq, lo, hi);
      return;
    }
  }

  // Splits `box` along the outermost dim where moving alone from the corner changes
  // whether digits lie in [lo, hi); falls back to halving the largest dim.
  void split_at_limits(const Box& box, const Shape& q0, const std::vector<Shape>& dq, const Shape& lo,
                       const Shape& hi) {
    const size_t nd = box.size.size();
    auto in = [&](const Shape& q) {
      for (size_t j = 0; j < q.size(); ++j) {
        if (q[j] < lo[j] || q[j] >= hi[j]) return false;
      }
      return true;
    };
    const bool corner_in = in(q0);
    for (size_t k = 0; k < nd; ++k) {
      const int64_t n = box.size[k];
      if (n <= 1) continue;
      // Interval of steps t in [0, n) with q0 + t*dq in [lo, hi).
      int64_t tmin = 0, tmax = n - 1;
      for (size_t j = 0; j < q0.size(); ++j) {
        const int64_t d = dq[k][j];
        if (d == 0) {
          if (q0[j] < lo[j] || q0[j] >= hi[j]) { tmin = 1; tmax = 0; }
          continue;
        }
        // lo <= q0 + t d <= hi - 1
        int64_t a, b;
        if (d > 0) {
          a = ceil_div(lo[j] - q0[j], d);
          b = floor_div(hi[j] - 1 - q0[j], d);
        } else {
          a = ceil_div(hi[j] - 1 - q0[j], d);
          b = floor_div(lo[j] - q0[j], d);
        }
        tmin = std::max(tmin, a);
        tmax = std::min(tmax, b);
      }
      int64_t cut = -1;
      if (corner_in) {
        if (tmax + 1 < n) cut = tmax + 1;
      } else if (tmin <= tmax && tmin > 0) {
        cut = tmin;
      }
      if (cut > 0 && cut < n) {
        split(box, k, cut);
        return;
      }
    }
    // Halve the largest dim.
    size_t best = 0;
    for (size_t k = 1; k < nd; ++k) {
      if (box.size[k] > box.size[best]) best = k;
    }
    split(box, best, box.size[best] / 2);
  }

  static int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
  }
  static int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

  // Queues the two halves of `box` cut at `cut` along dim k, the first on top.
  void split(const Box& box, size_t k, int64_t cut) {
    Box a = box, b = box;
    a.size[k] = cut;
    b.start[k] += cut;
    b.size[k] -= cut;
    pending_.push_back(std::move(b));
    pending_.push_back(std::move(a));
  }

  // Every visit used to test every piece, and a copy over N pieces takes O(N) visits:
  // O(N^2) per copy, what made fsdp routing quadratic in the ranks. Pieces are disjoint
  // boxes, so they are indexed by their start on one digit (the one on which pieces are
  // narrowest relative to the radix: dim 0 for FSDP chunks, dim 1 for row-parallel
  // slices), ties in index order.
  void index_pieces() {
    const size_t nq = radix_.size();
    double best = 2;
    for (size_t j = 0; j < nq; ++j) {
      int64_t widest = 1;
      for (const MapPiece& p : parent_) widest = std::max(widest, p.root.shape[j]);
      const double narrowness = static_cast<double>(widest) / static_cast<double>(std::max<int64_t>(radix_[j], 1));
      if (narrowness < best) {
        best = narrowness;
        key_digit_ = j;
        key_widest_ = widest;
      }
    }
    by_start_.resize(parent_.size());
    for (uint32_t i = 0; i < by_start_.size(); ++i) by_start_[i] = i;
    std::stable_sort(by_start_.begin(), by_start_.end(), [&](uint32_t a, uint32_t b) {
      return parent_[a].start[key_digit_] < parent_[b].start[key_digit_];
    });
  }


  void emit(const Box& box, const Shape& q0, const std::vector<Shape>& dq, const MapPiece& piece, uint32_t part) {
    MapPiece out;
    out.part = part;
    out.start = box.start;
    out.root.shape = box.size;
    out.root.offset = piece.root.offset;
    for (size_t j = 0; j < q0.size(); ++j) out.root.offset += piece.root.strides[j] * (q0[j] - piece.start[j]);
    out.root.strides.assign(box.size.size(), 0);
    for (size_t k = 0; k < box.size.size(); ++k) {
      int64_t s = 0;
      for (size_t j = 0; j < q0.size(); ++j) s += piece.root.strides[j] * dq[k][j];
      out.root.strides[k] = box.size[k] > 1 ? s : 0;
    }
    // Size-1 dims of the box get stride 0 (never stepped).
    out_.push_back(std::move(out));
  }

  const Layout& layout_;
  const Shape& radix_;
  const std::vector<MapPiece>& parent_;
  std::vector<MapPiece> out_;
  std::vector<Box> pending_;          // boxes still to visit, the next on top
  size_t key_digit_ = 0;              // the digit pieces are indexed by
  int64_t key_widest_ = 1;            // the widest piece's extent on that digit
  std::vector<uint32_t> by_start_;    // piece indices by start on the key digit
};

}  // namespace

std::vector<MapPiece> compose_layout(const Layout& layout, const Shape& radix_in, const std::vector<MapPiece>& pieces_in) {
  if (!radix_in.empty()) return Composer(layout, radix_in, pieces_in).run();
  // A 0-d inner space: one element, every index maps to it.
  const Shape radix = {1};
  std::vector<MapPiece> pieces = pieces_in;
  for (auto& p : pieces) {
    p.start = {0};
    p.root.shape = {1};
    p.root.strides = {0};
  }
  return Composer(layout, radix, pieces).run();
}

}  // namespace ferry
