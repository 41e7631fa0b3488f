// ferry::Shape against std::vector<int64_t> as the oracle: random sequences of every
// operation, across the inline/heap boundary, with self-aliasing ranges.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "ferry/shape.h"

namespace ferry {
namespace {

void expect_same(const Shape& s, const std::vector<int64_t>& v, int step) {
  ASSERT_EQ(s.size(), v.size()) << "step " << step;
  ASSERT_EQ(s.empty(), v.empty());
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(s[i], v[i]) << "step " << step << " index " << i;
  ASSERT_TRUE(s == v);
  ASSERT_EQ(s.vec(), v);
  ASSERT_GE(s.capacity(), s.size());
}

TEST(Shape, BehavesAsAVectorOverRandomOperations) {
  std::mt19937_64 rng(20261206);
  for (int run = 0; run < 200; ++run) {
    Shape s;
    std::vector<int64_t> v;
    for (int step = 0; step < 200; ++step) {
      const auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
      const int64_t x = static_cast<int64_t>(rng() % 1000) - 500;
      switch (pick(14)) {
        case 0: s.push_back(x); v.push_back(x); break;
        case 1: if (!v.empty()) { s.pop_back(); v.pop_back(); } break;
        case 2: { const size_t n = pick(10); s.resize(n, x); v.resize(n, x); break; }
        case 3: { const size_t n = pick(10); s.assign(n, x); v.assign(n, x); break; }
        case 4: { const size_t at = pick(v.size() + 1); s.insert(s.begin() + at, x); v.insert(v.begin() + static_cast<std::ptrdiff_t>(at), x); break; }
        case 5: if (!v.empty()) { const size_t at = pick(v.size()); s.erase(s.begin() + at); v.erase(v.begin() + static_cast<std::ptrdiff_t>(at)); } break;
        case 6: {  // insert a range of itself (aliasing)
          const size_t at = pick(v.size() + 1), a = pick(v.size() + 1), b = a + pick(v.size() + 1 - a);
          s.insert(s.begin() + at, s.begin() + a, s.begin() + b);
          const std::vector<int64_t> r(v.begin() + static_cast<std::ptrdiff_t>(a), v.begin() + static_cast<std::ptrdiff_t>(b));
          v.insert(v.begin() + static_cast<std::ptrdiff_t>(at), r.begin(), r.end());
          break;
        }
        case 7: {  // assign a range of itself (aliasing)
          const size_t a = pick(v.size() + 1), b = a + pick(v.size() + 1 - a);
          s.assign(s.begin() + a, s.begin() + b);
          v = std::vector<int64_t>(v.begin() + static_cast<std::ptrdiff_t>(a), v.begin() + static_cast<std::ptrdiff_t>(b));
          break;
        }
        case 8: { Shape c(s); s = c; Shape m(std::move(c)); EXPECT_TRUE(c.empty()); s = std::move(m); break; }
        case 9: {
          Shape t{1, 2, 3, 4, 5, 6};
          s.swap(t);
          expect_same(t, v, step);
          v = {1, 2, 3, 4, 5, 6};
          break;
        }
        case 10: s.clear(); v.clear(); break;
        case 11: if (!v.empty()) { const size_t a = pick(v.size()), b = a + pick(v.size() - a + 1); s.erase(s.begin() + a, s.begin() + b); v.erase(v.begin() + static_cast<std::ptrdiff_t>(a), v.begin() + static_cast<std::ptrdiff_t>(b)); } break;
        case 12: { const std::vector<int64_t> w(pick(8), x); s = w; v = w; break; }
        case 13: { const size_t n = pick(12); s.reserve(n); v.reserve(n); break; }
      }
      expect_same(s, v, step);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(Shape, ComparesAndConstructsAsAVector) {
  EXPECT_EQ(Shape(3), Shape({0, 0, 0}));
  EXPECT_EQ(Shape(2, 7), Shape({7, 7}));
  EXPECT_LT(Shape({1, 2}), Shape({1, 3}));
  EXPECT_LT(Shape({1, 2}), Shape({1, 2, 0}));
  EXPECT_LT(Shape({1, 2, 3, 4, 5}), Shape({1, 2, 3, 4, 6}));  // (on the heap)
  EXPECT_EQ(Shape({1, 2, 3, 4, 5, 6, 7}).vec(), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
  const std::vector<int64_t> v{4, 5};
  const Shape s = v;
  EXPECT_TRUE(s == v);
  EXPECT_TRUE(v == s);
  EXPECT_EQ(s.front(), 4);
  EXPECT_EQ(s.back(), 5);
  EXPECT_EQ(*s.rbegin(), 5);
  EXPECT_THROW(static_cast<void>(s.at(2)), std::out_of_range);
  EXPECT_EQ(sizeof(Shape), 40u);  // inline storage: no heap block for up to four dims
}

}  // namespace
}  // namespace ferry
