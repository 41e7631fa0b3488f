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
#include <functional>
#include <utility>
#include <vector>

#include "ferry/tensor.h"

namespace ferry {
namespace {

void unravel_into(int64_t p, const Shape& radix, Shape& q) {
  for (size_t j = radix.size(); j-- > 0;) {
    q[j] = p % radix[j];
    p /= radix[j];
  }
}

// Allocation-free per box (issue 30: a copy over fsdp=N holders is cut N times, and
// allocating a dozen small vectors per visit dominated routing): the box being visited,
// its digits and steps live in scratch members reused for every box, and boxes waiting
// to be visited are rows of 2*nd integers (start, size) on one flat stack. Every cut,
// every visit and the order of the output are as they were.
class Composer {
 public:
  Composer(const Layout& layout, const Shape& radix, const std::vector<MapPiece>& parent,
           const std::vector<uint32_t>* subset, const std::function<void(const MapPiece&)>& each)
      : layout_(layout), radix_(radix), parent_(parent), subset_(subset), each_(each) {}

  // Boxes wait on an explicit stack, not on the call stack: a copy that crosses N pieces
  // (a row-parallel weight over fsdp=N holders) is cut N times, and recursing once per
  // cut overflowed the stack at N = 10^6. Pushing the second half first and popping the
  // first visits boxes in the same depth-first order the recursion did, so the output
  // is unchanged; the stack stays shallow (a peeled cut leaves one box behind).
  void run() {
    nd_ = layout_.shape.size();
    nq_ = radix_.size();
    if (shape_numel(layout_.shape) == 0) return;
    index_pieces();
    start_.assign(nd_, 0);
    size_ = layout_.shape;
    q0_.assign(nq_, 0);
    q1_.assign(nq_, 0);
    dq_.assign(nd_ * nq_, 0);
    lo_.assign(nq_, 0);
    hi_.assign(nq_, 0);
    zeros_.assign(nq_, 0);
    push(start_, size_);
    while (pending_boxes_ > 0) {
      --pending_boxes_;
      const size_t at = pending_.size() - 2 * nd_;
      std::copy(pending_.begin() + static_cast<std::ptrdiff_t>(at),
                pending_.begin() + static_cast<std::ptrdiff_t>(at + nd_), start_.begin());
      std::copy(pending_.begin() + static_cast<std::ptrdiff_t>(at + nd_), pending_.end(), size_.begin());
      pending_.resize(at);
      visit();
    }
  }

 private:
  size_t count() const { return subset_ ? subset_->size() : parent_.size(); }
  const MapPiece& piece(uint32_t i) const { return subset_ ? parent_[(*subset_)[i]] : parent_[i]; }
  int64_t dq(size_t k, size_t j) const { return dq_[k * nq_ + j]; }

  void push(const Shape& start, const Shape& size) {
    pending_.insert(pending_.end(), start.begin(), start.end());
    pending_.insert(pending_.end(), size.begin(), size.end());
    ++pending_boxes_;  // (a 0-d box has no integers: counted, not sized)
  }

  // Digit j's range over the box.
  std::pair<int64_t, int64_t> range(size_t j) const {
    int64_t lo = q0_[j], hi = q0_[j];
    for (size_t k = 0; k < nd_; ++k) {
      const int64_t span = (size_[k] - 1) * dq(k, j);
      (span < 0 ? lo : hi) += span;
    }
    return {lo, hi};
  }

  void visit() {
    const int64_t p0 = layout_.offset_of(start_);
    unravel_into(p0, radix_, q0_);
    std::fill(dq_.begin(), dq_.end(), 0);
    for (size_t k = 0; k < nd_; ++k) {
      if (size_[k] <= 1) continue;
      unravel_into(p0 + layout_.strides[k], radix_, q1_);
      for (size_t j = 0; j < nq_; ++j) dq_[k * nq_ + j] = q1_[j] - q0_[j];
    }
    // Affine check: digit ranges over the box.
    bool affine = true;
    for (size_t j = 0; j < nq_ && affine; ++j) {
      auto [lo, hi] = range(j);
      affine = lo >= 0 && hi < radix_[j];
    }
    if (!affine) {
      split_at_limits(zeros_, radix_);
      return;
    }
    // Which parent pieces does the box touch? Only those whose start on the key digit
    // lies within [lo - widest + 1, hi] can; they are taken by that start, so the first
    // partial one (which decides the cut) is the nearest, and a box peeled piece by
    // piece finds its next piece at once instead of after every piece already cut off.
    auto [key_lo, key_hi] = range(key_digit_);
    const size_t j0 = key_digit_;
    auto first = std::lower_bound(by_start_.begin(), by_start_.end(), key_lo - key_widest_ + 1,
                                  [&](uint32_t i, int64_t v) { return piece(i).start[j0] < v; });
    for (auto it = first; it != by_start_.end() && piece(*it).start[j0] <= key_hi; ++it) {
      const uint32_t pi = *it;
      const MapPiece& pc = piece(pi);
      bool inside = true, disjoint = false;
      for (size_t j = 0; j < nq_; ++j) {
        auto [lo, hi] = range(j);
        const int64_t plo = pc.start[j];
        const int64_t phi = pc.start[j] + pc.root.shape[j] - 1;
        if (hi < plo || lo > phi) disjoint = true;
        if (lo < plo || hi > phi) inside = false;
      }
      if (disjoint) continue;
      if (inside) {
        emit(pc, pi);
        continue;
      }
      // Partial: cut the box where it crosses this piece and visit both parts.
      for (size_t j = 0; j < nq_; ++j) {
        lo_[j] = pc.start[j];
        hi_[j] = pc.start[j] + pc.root.shape[j];
      }
      split_at_limits(lo_, hi_);
      return;
    }
  }

  // Splits the box along the outermost dim where moving alone from the corner changes
  // whether digits lie in [lo, hi); falls back to halving the largest dim.
  void split_at_limits(const Shape& lo, const Shape& hi) {
    auto in = [&](const Shape& q) {
      for (size_t j = 0; j < q.size(); ++j) {
        if (q[j] < lo[j] || q[j] >= hi[j]) return false;
      }
      return true;
    };
    const bool corner_in = in(q0_);
    for (size_t k = 0; k < nd_; ++k) {
      const int64_t n = size_[k];
      if (n <= 1) continue;
      // Interval of steps t in [0, n) with q0 + t*dq in [lo, hi).
      int64_t tmin = 0, tmax = n - 1;
      for (size_t j = 0; j < nq_; ++j) {
        const int64_t d = dq(k, j);
        if (d == 0) {
          if (q0_[j] < lo[j] || q0_[j] >= hi[j]) { tmin = 1; tmax = 0; }
          continue;
        }
        // lo <= q0 + t d <= hi - 1
        int64_t a, b;
        if (d > 0) {
          a = ceil_div(lo[j] - q0_[j], d);
          b = floor_div(hi[j] - 1 - q0_[j], d);
        } else {
          a = ceil_div(hi[j] - 1 - q0_[j], d);
          b = floor_div(lo[j] - q0_[j], d);
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
        split(k, cut);
        return;
      }
    }
    // Halve the largest dim.
    size_t best = 0;
    for (size_t k = 1; k < nd_; ++k) {
      if (size_[k] > size_[best]) best = k;
    }
    split(best, size_[best] / 2);
  }

  static int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
  }
  static int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

  // Queues the two halves of the box cut at `cut` along dim k, the first on top.
  void split(size_t k, int64_t cut) {
    const int64_t s = start_[k], n = size_[k];
    start_[k] = s + cut;  // the second half
    size_[k] = n - cut;
    push(start_, size_);
    start_[k] = s;  // the first
    size_[k] = cut;
    push(start_, size_);
  }

  // Every visit used to test every piece, and a copy over N pieces takes O(N) visits:
  // O(N^2) per copy, what made fsdp routing quadratic in the ranks. Pieces are disjoint
  // boxes, so they are indexed by their start on one digit (the one on which pieces are
  // narrowest relative to the radix: dim 0 for FSDP chunks, dim 1 for row-parallel
  // slices), ties in index order.
  void index_pieces() {
    const size_t n = count();
    double best = 2;
    for (size_t j = 0; j < nq_; ++j) {
      int64_t widest = 1;
      for (uint32_t i = 0; i < n; ++i) widest = std::max(widest, piece(i).root.shape[j]);
      const double narrowness = static_cast<double>(widest) / static_cast<double>(std::max<int64_t>(radix_[j], 1));
      if (narrowness < best) {
        best = narrowness;
        key_digit_ = j;
        key_widest_ = widest;
      }
    }
    by_start_.resize(n);
    for (uint32_t i = 0; i < by_start_.size(); ++i) by_start_[i] = i;
    std::stable_sort(by_start_.begin(), by_start_.end(), [&](uint32_t a, uint32_t b) {
      return piece(a).start[key_digit_] < piece(b).start[key_digit_];
    });
  }

  void emit(const MapPiece& pc, uint32_t part) {
    MapPiece& out = emitted_;
    out.part = part;
    out.start = start_;
    out.root.shape = size_;
    out.root.offset = pc.root.offset;
    for (size_t j = 0; j < nq_; ++j) out.root.offset += pc.root.strides[j] * (q0_[j] - pc.start[j]);
    out.root.strides.assign(nd_, 0);
    for (size_t k = 0; k < nd_; ++k) {
      int64_t s = 0;
      for (size_t j = 0; j < nq_; ++j) s += pc.root.strides[j] * dq(k, j);
      out.root.strides[k] = size_[k] > 1 ? s : 0;
    }
    // Size-1 dims of the box get stride 0 (never stepped).
    each_(out);
  }

  const Layout& layout_;
  const Shape& radix_;
  const std::vector<MapPiece>& parent_;
  const std::vector<uint32_t>* subset_;
  const std::function<void(const MapPiece&)>& each_;
  size_t nd_ = 0, nq_ = 0;
  Shape start_, size_;                // the box being visited
  Shape q0_, q1_, lo_, hi_, zeros_;   // its corner's digits, a step's, a piece's limits
  std::vector<int64_t> dq_;           // nd x nq: digit steps per dim
  std::vector<int64_t> pending_;      // boxes still to visit (start, size), the next on top
  size_t pending_boxes_ = 0;
  MapPiece emitted_;
  size_t key_digit_ = 0;              // the digit pieces are indexed by
  int64_t key_widest_ = 1;            // the widest piece's extent on that digit
  std::vector<uint32_t> by_start_;    // piece indices (into the subset) by start on the key digit
};

}  // namespace

void compose_layout_each(const Layout& layout, const Shape& radix_in, const std::vector<MapPiece>& pieces_in,
                         const std::vector<uint32_t>* subset, const std::function<void(const MapPiece&)>& each) {
  if (!radix_in.empty()) {
    Composer(layout, radix_in, pieces_in, subset, each).run();
    return;
  }
  // A 0-d inner space: one element, every index maps to it.
  const Shape radix = {1};
  std::vector<MapPiece> pieces;
  const size_t n = subset ? subset->size() : pieces_in.size();
  for (size_t i = 0; i < n; ++i) {
    MapPiece p = pieces_in[subset ? (*subset)[i] : i];
    p.start = {0};
    p.root.shape = {1};
    p.root.strides = {0};
    pieces.push_back(std::move(p));
  }
  Composer(layout, radix, pieces, nullptr, each).run();
}

std::vector<MapPiece> compose_layout(const Layout& layout, const Shape& radix, const std::vector<MapPiece>& pieces) {
  std::vector<MapPiece> out;
  compose_layout_each(layout, radix, pieces, nullptr, [&](const MapPiece& m) { out.push_back(m); });
  return out;
}

}  // namespace ferry
