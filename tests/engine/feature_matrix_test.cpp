// The covering sets of feature_matrix.h against an independent oracle: the pairs a set
// must hold are computed here from the product of the features by brute force (not from
// the generator's own bookkeeping), and each set is checked to hold every one. Also the
// sizes against the full products, which is what the covering sets save.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "engine/engine_test_util.h"
#include "engine/feature_matrix.h"

namespace ferry::engine_tests {
namespace {

using Restrict = std::map<std::string, std::vector<std::string>>;

// Every pair (feature a = x, feature b = y), a < b by name order in the matrix, that some
// allowed full combination holds: the product enumerated by nested counting.
std::set<std::tuple<std::string, std::string, std::string, std::string>> possible_pairs(const Matrix& m) {
  std::set<std::tuple<std::string, std::string, std::string, std::string>> out;
  size_t total = 1;
  for (const Feature& f : m.features) total *= f.values.size();
  for (size_t n = 0; n < total; ++n) {
    Combination c;
    size_t rest = n;
    for (const Feature& f : m.features) {
      c.push_back(static_cast<int>(rest % f.values.size()));
      rest /= f.values.size();
    }
    if (m.excluded(c)) continue;
    for (size_t a = 0; a < c.size(); ++a) {
      for (size_t b = a + 1; b < c.size(); ++b) {
        out.emplace(m.features[a].name, m.features[a].values[static_cast<size_t>(c[a])], m.features[b].name,
                    m.features[b].values[static_cast<size_t>(c[b])]);
      }
    }
  }
  return out;
}

// The pairs the EngineCases of a suite hold, read back from the cases (by name, through
// case_name), so that the mapping to EngineCase is checked too.
std::set<std::tuple<std::string, std::string, std::string, std::string>> held_pairs(const std::vector<EngineCase>& cases) {
  std::set<std::tuple<std::string, std::string, std::string, std::string>> out;
  for (const EngineCase& e : cases) {
    const std::vector<std::pair<std::string, std::string>> v = {
        {"backend", backend_name(e.backend)},
        {"mode", is_push(e.mode) ? "push" : "pull"},
        {"serving", is_in_place(e.mode) ? "in_place" : "staged"},
        {"commit", e.shadow ? "shadow" : e.groups ? "groups" : "in_place"},
        {"order", e.rotated ? "rotated" : "layer"},
        {"relay", e.relay ? "on" : "off"},
        {"delta", e.delta ? "on" : "off"},
        {"checksums", e.checksums ? "on" : "off"},
        {"fp8", e.fp8 == Fp8Side::kProducer ? "producer" : e.fp8 == Fp8Side::kConsumer ? "consumer" : "none"},
        {"staging", e.gpu_staging ? "gpu" : "host"},
    };
    for (size_t a = 0; a < v.size(); ++a) {
      for (size_t b = a + 1; b < v.size(); ++b) out.emplace(v[a].first, v[a].second, v[b].first, v[b].second);
    }
  }
  return out;
}

size_t product_size(const Matrix& m) {
  size_t n = 1;
  for (const Feature& f : m.features) n *= f.values.size();
  return n;
}

// Each suite's restriction, as its INSTANTIATE_TEST_SUITE_P writes it.
const std::vector<std::pair<std::string, Restrict>>& suites() {
  static const std::vector<std::pair<std::string, Restrict>> s = {
      {"EngineMatrixTest", {}},
      {"EngineTest", plain()},
      {"EngineInprocTest", plain({{"backend", {"inproc"}}})},
      {"EngineDeltaTest", plain({{"delta", {"on"}}, {"relay", {"off"}}})},
      {"EngineRelayTest", plain({{"relay", {"on"}}, {"commit", {"in_place"}}})},
  };
  return s;
}

TEST(FeatureMatrix, EverySuitesCasesHoldEveryPairOfItsFeatures) {
  for (const auto& [suite, restrict] : suites()) {
    const Matrix m = engine_matrix(restrict);
    const auto want = possible_pairs(m);
    const auto cases = covering_cases(restrict);
    const auto got = held_pairs(cases);
    size_t held = 0;
    for (const auto& p : want) {
      if (got.count(p)) {
        ++held;
      } else {
        ADD_FAILURE() << suite << ": no case holds " << std::get<0>(p) << "=" << std::get<1>(p) << " with "
                      << std::get<2>(p) << "=" << std::get<3>(p);
      }
    }
    EXPECT_EQ(held, want.size()) << suite;
    EXPECT_LT(cases.size(), product_size(m) + 1) << suite;
    // (what docs/RESULTS.md's "CI time" quotes)
    std::printf("%s: %zu cases of a product of %zu; %zu of %zu pairs held\n", suite.c_str(), cases.size(),
                product_size(m), held, want.size());
  }
}

// Every allowed pair of every value of the whole matrix: 10 features, 2304 combinations;
// the covering set is small (a product of the two largest features, 3 x 3, is its floor).
// The one constraint removes exactly one pair (in-place serving with GPU staging), and
// no case holds it.
TEST(FeatureMatrix, TheWholeMatrixIsCoveredByFewCases) {
  const auto cases = covering_cases({});
  EXPECT_GE(cases.size(), 9u);
  EXPECT_LE(cases.size(), 16u);
  const auto held = held_pairs(cases);
  const auto possible = possible_pairs(engine_matrix());
  EXPECT_EQ(held.size(), possible.size());
  Matrix unconstrained = engine_matrix();
  unconstrained.excluded = [](const Combination&) { return false; };
  const auto all = possible_pairs(unconstrained);
  std::vector<std::tuple<std::string, std::string, std::string, std::string>> impossible;
  for (const auto& p : all) {
    if (!possible.count(p)) impossible.push_back(p);
  }
  ASSERT_EQ(impossible.size(), 1u);
  EXPECT_EQ(impossible[0], std::make_tuple(std::string("serving"), std::string("in_place"), std::string("staging"),
                                           std::string("gpu")));
  EXPECT_EQ(held.count(impossible[0]), 0u);
  for (const EngineCase& e : cases) EXPECT_FALSE(is_in_place(e.mode) && e.gpu_staging) << case_name(e);
}

// Constraints and required combinations, on a small matrix: an excluded combination never
// appears, a pair only excluded combinations hold is not asked for, and a required
// combination is taken whole.
TEST(FeatureMatrix, ExclusionsAndRequiredCombinations) {
  Matrix m;
  m.features = {{"a", {"0", "1", "2"}}, {"b", {"0", "1"}}, {"c", {"0", "1"}}, {"d", {"0", "1", "2"}}};
  // a=2 never with b=1 (a reason would stand here); a=1 with c=1 only when d=2.
  m.excluded = [](const Combination& c) { return (c[0] == 2 && c[1] == 1) || (c[0] == 1 && c[2] == 1 && c[3] != 2); };
  m.required = {{{0, 1, 1, 1}, "b and c interact when both on"}};
  const auto set = covering_set(m);
  ASSERT_FALSE(set.empty());
  EXPECT_EQ(set.front(), (Combination{0, 1, 1, 1}));
  std::set<ValuePair> held;
  for (const Combination& c : set) {
    EXPECT_FALSE(m.excluded(c));
    for (const ValuePair& p : pairs_of(c)) held.insert(p);
  }
  EXPECT_EQ(held.count({0, 2, 1, 1}), 0u) << "a pair only excluded combinations hold";
  EXPECT_EQ(held.count({0, 1, 2, 1}), 1u) << "a=1, c=1 is allowed with d=2";
  size_t possible = 0;
  for (const auto& p : possible_pairs(m)) {
    (void)p;
    ++possible;
  }
  EXPECT_EQ(held.size(), possible);
  EXPECT_LT(set.size(), product_size(m));
  // Deterministic: the same set every time (ctest names the cases by it).
  EXPECT_EQ(covering_set(m), set);
}

TEST(FeatureMatrix, AnUnknownFeatureOrValueIsRefused) {
  EXPECT_THROW(engine_matrix({{"colour", {"red"}}}), std::invalid_argument);
  EXPECT_THROW(engine_matrix({{"mode", {"sideways"}}}), std::invalid_argument);
}

}  // namespace
}  // namespace ferry::engine_tests
