// route/bounds.h — overflow-checked bounds of layouts and byte ranges, shared by the
// routes' validation (codec.cpp) and the executors' checks before they touch memory
// (execute.cpp). Internal.
#pragma once

#include <cstdint>

#include "ferry/route.h"

namespace ferry::route_bounds {

// numel and flat range of a layout, false on overflow or a negative size.
inline bool layout_range(const Layout& l, int64_t& numel, int64_t& lo, int64_t& hi) {
  if (l.shape.size() != l.strides.size() || l.shape.size() > Routes::kMaxRank) return false;
  numel = 1;
  for (int64_t s : l.shape) {
    if (s < 0 || (s != 0 && __builtin_mul_overflow(numel, s, &numel))) return false;
  }
  lo = hi = l.offset;
  if (numel == 0) return true;
  for (size_t k = 0; k < l.shape.size(); ++k) {
    int64_t span = 0;
    if (__builtin_mul_overflow(l.shape[k] - 1, l.strides[k], &span)) return false;
    if (span < 0) {
      if (__builtin_add_overflow(lo, span, &lo)) return false;
    } else if (__builtin_add_overflow(hi, span, &hi)) {
      return false;
    }
  }
  return true;
}

// [offset, offset + numel * es) within [0, limit).
inline bool bytes_within(uint64_t offset, int64_t numel, uint64_t es, uint64_t limit) {
  uint64_t n = 0, end = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), es, &n)) return false;
  if (__builtin_add_overflow(offset, n, &end)) return false;
  return end <= limit;
}


}  // namespace ferry::route_bounds
