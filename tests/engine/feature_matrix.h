// The engine's feature matrix as a covering set (issue 43): instead of instantiating a
// suite once per product of feature values (backend x mode x commit x order x relay x
// delta ...: every new feature doubled the cases), a suite is instantiated over a set of
// cases in which every pair of values of any two features appears at least once, plus
// the combinations known to interact, each named with its reason. Most defects that
// depend on configuration depend on one feature or on two together; a pair no case holds
// is what a product would have checked and a covering set might miss, and the tests of
// this header (feature_matrix_test.cpp) check that no allowed pair is missing.
//
// Generated, never hand-listed: every full combination the constraints allow is
// enumerated, the required combinations are taken first, then greedily the combination
// that covers the most pairs not yet covered (ties: the first in enumeration order), until
// every pair that some allowed combination holds is covered. Deterministic, so a case's
// name (and so its ctest name) is the same at every run.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ferry::engine_tests {

struct Feature {
  std::string name;
  std::vector<std::string> values;  // values[0] is the default (what a user gets with no option)
};

// One case: an index into each feature's values, in the order of the features.
using Combination = std::vector<int>;

// A pair of values of two features: (feature a, value of a, feature b, value of b), a < b.
using ValuePair = std::tuple<int, int, int, int>;

struct Matrix {
  std::vector<Feature> features;
  // A combination the engine cannot run, with why; false: allowed.
  std::function<bool(const Combination&)> excluded = [](const Combination&) { return false; };
  // Combinations known to interact, always instantiated whole (beyond their pairs).
  struct Required {
    Combination values;
    std::string reason;
  };
  std::vector<Required> required;

  // Requires the combination of these values (every other feature at its default); a
  // feature or value not in the matrix is skipped whole (a suite restricted away from it).
  void require(const std::vector<std::pair<std::string, std::string>>& values, std::string reason) {
    Combination c(features.size(), 0);
    for (const auto& [feature, value] : values) {
      const int f = index_of(feature);
      if (f < 0) return;
      const auto& vs = features[static_cast<size_t>(f)].values;
      const auto it = std::find(vs.begin(), vs.end(), value);
      if (it == vs.end()) return;
      c[static_cast<size_t>(f)] = static_cast<int>(it - vs.begin());
    }
    if (!excluded(c)) required.push_back({c, std::move(reason)});
  }
  int index_of(const std::string& feature) const {
    for (size_t i = 0; i < features.size(); ++i) {
      if (features[i].name == feature) return static_cast<int>(i);
    }
    return -1;
  }
  // Every combination the constraints allow, in lexicographic order (the last feature
  // varying fastest).
  std::vector<Combination> allowed() const {
    std::vector<Combination> out;
    Combination c(features.size(), 0);
    while (true) {
      if (!excluded(c)) out.push_back(c);
      size_t i = features.size();
      while (i > 0) {
        --i;
        if (++c[i] < static_cast<int>(features[i].values.size())) break;
        c[i] = 0;
        if (i == 0) return out;
      }
      if (features.empty()) return out;
    }
  }
};

inline std::vector<ValuePair> pairs_of(const Combination& c) {
  std::vector<ValuePair> out;
  for (size_t a = 0; a < c.size(); ++a) {
    for (size_t b = a + 1; b < c.size(); ++b) out.emplace_back(static_cast<int>(a), c[a], static_cast<int>(b), c[b]);
  }
  return out;
}

// The covering set: the required combinations, then greedily the allowed combination
// covering the most uncovered pairs, until each pair some allowed combination holds is
// covered. Pairs are numbered densely (a flag each), so that this runs in milliseconds at
// static initialisation even under the sanitizers: every test process of a suite
// instantiated over it pays for it.
inline std::vector<Combination> covering_set(const Matrix& m) {
  const size_t n = m.features.size();
  // base[a][b]: the number of the first pair of features a < b; pair (a=x, b=y) is
  // base[a][b] + x * |values of b| + y.
  std::vector<std::vector<size_t>> base(n, std::vector<size_t>(n, 0));
  size_t pairs = 0;
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      base[a][b] = pairs;
      pairs += m.features[a].values.size() * m.features[b].values.size();
    }
  }
  auto numbers = [&](const Combination& c) {
    std::vector<size_t> out;
    out.reserve(n * (n - 1) / 2);
    for (size_t a = 0; a < n; ++a) {
      for (size_t b = a + 1; b < n; ++b) {
        out.push_back(base[a][b] + static_cast<size_t>(c[a]) * m.features[b].values.size() + static_cast<size_t>(c[b]));
      }
    }
    return out;
  };
  const std::vector<Combination> pool = m.allowed();
  std::vector<std::vector<size_t>> pool_pairs;
  pool_pairs.reserve(pool.size());
  std::vector<char> uncovered(pairs, 0);
  size_t left = 0;
  for (const Combination& c : pool) {
    pool_pairs.push_back(numbers(c));
    for (size_t p : pool_pairs.back()) {
      left += uncovered[p] == 0;
      uncovered[p] = 1;
    }
  }
  std::vector<Combination> out;
  auto take = [&](const Combination& c, const std::vector<size_t>& ps) {
    for (size_t p : ps) {
      left -= uncovered[p] == 1;
      uncovered[p] = 0;
    }
    out.push_back(c);
  };
  for (const Matrix::Required& r : m.required) take(r.values, numbers(r.values));
  while (left > 0) {
    size_t best = 0, best_gain = 0;
    for (size_t i = 0; i < pool.size(); ++i) {
      size_t gain = 0;
      for (size_t p : pool_pairs[i]) gain += static_cast<size_t>(uncovered[p]);
      if (gain > best_gain) {
        best = i;
        best_gain = gain;
      }
    }
    take(pool[best], pool_pairs[best]);  // (some pool member holds every uncovered pair: best_gain > 0)
  }
  return out;
}

}  // namespace ferry::engine_tests
