// tools/percentile.h — the nearest-rank percentile of a sample, for the figures `ferry
// demo` and `ferry bench` print over their syncs (the stall's and the slowest receiver's
// p50 and p95).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace ferry::tools {

// The smallest value with at least p% of the sample at or below it (p in [0, 100]); 0 for
// an empty sample. p50 of {1, 2, 3, 4} is 2, p95 of 20 values the 19th smallest.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = rank < 1 ? 0 : std::min(v.size(), static_cast<size_t>(rank)) - 1;
  return v[i];
}

}  // namespace ferry::tools
