// The producer's straggler policy (engine/straggler.h) on its own, on made-up time points:
// who lags, from when, by which bound, and the reason a straggler is dropped with.
#include <gtest/gtest.h>

#include "engine/straggler.h"

namespace ferry::engine {
namespace {

using std::chrono::milliseconds;

struct Known {
  std::map<int, uint64_t> declared;
  std::map<int, Clock::time_point> joined;
  RoutesKnown at(uint64_t current, std::optional<uint64_t> undeclared) const {
    return RoutesKnown{current, &declared, &joined, undeclared};
  }
};

const Clock::time_point t0{};  // the slot's announcement
const SlotPace kSlot{3, 0xAB, t0, t0 + milliseconds(100)};

TEST(Straggler, BoundIsTheFloorOrTheOthersTimesTheFactor) {
  EXPECT_EQ(straggler_bound({milliseconds(50), 2, true}, kSlot), milliseconds(200));
  EXPECT_EQ(straggler_bound({milliseconds(500), 2, true}, kSlot), milliseconds(500));
}

TEST(Straggler, OnlyAConsumerKnownToReadTheSlotsRoutesLags) {
  Known k;
  k.declared = {{1, 0xAB}, {2, 0xCD}};
  k.joined = {{1, t0 + milliseconds(300)}, {2, t0}};
  // Undeclared consumers read the sync's first routes when those are known.
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, 0xAB), 0), t0 + milliseconds(100));
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, std::nullopt), 0), std::nullopt);
  // One that moved to these routes lags from when it moved, if after the last release.
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, std::nullopt), 1), t0 + milliseconds(300));
  // One that declared other routes, or any in a slot of routes the producer abandoned: never.
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, 0xAB), 2), std::nullopt);
  EXPECT_EQ(lag_start(kSlot, k.at(0xEF, 0xAB), 0), std::nullopt);
}

TEST(Straggler, NextIsTheEarliestBeforeTheDeadline) {
  Known k;
  k.declared = {{1, 0xAB}};
  k.joined = {{1, t0 + milliseconds(300)}};
  const StragglerPolicy on{milliseconds(50), 2, true};
  const auto bound = straggler_bound(on, kSlot);
  const auto deadline = t0 + milliseconds(10000);
  EXPECT_EQ(next_straggler(on, bound, kSlot, k.at(0xAB, 0xAB), {0, 1}, deadline), t0 + milliseconds(300));
  EXPECT_EQ(next_straggler(on, bound, kSlot, k.at(0xAB, 0xAB), {1}, deadline), t0 + milliseconds(500));
  // Not past the stall deadline (stall_timeout applies), not with the policy off, not
  // before anyone released.
  EXPECT_EQ(next_straggler(on, bound, kSlot, k.at(0xAB, 0xAB), {0}, t0 + milliseconds(300)), std::nullopt);
  EXPECT_EQ(next_straggler({milliseconds(0), 2, true}, bound, kSlot, k.at(0xAB, 0xAB), {0}, deadline), std::nullopt);
  SlotPace unreleased = kSlot;
  unreleased.last_release.reset();
  EXPECT_EQ(next_straggler(on, bound, unreleased, k.at(0xAB, 0xAB), {0}, deadline), std::nullopt);
}

TEST(Straggler, ReasonNamesTheGroupTheLagAndTheBound) {
  Known k;
  k.declared = {{1, 0xAB}};
  k.joined = {{1, t0 + milliseconds(300)}};
  const StragglerPolicy pull{milliseconds(50), 2, true};
  const auto bound = straggler_bound(pull, kSlot);
  // At 350 ms consumer 0 (lagging since 100 ms) is one; consumer 1 (since 300 ms) not yet.
  auto out = stragglers(pull, bound, kSlot, k.at(0xAB, 0xAB), {0, 1}, t0 + milliseconds(350));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].first, 0);
  EXPECT_EQ(out[0].second,
            "straggler: group 3 not released 250 ms after the other consumers (100 ms after it was announced; "
            "bound: max(straggler_floor 50 ms, 2 x 100 ms))");
  const StragglerPolicy push{milliseconds(50), 2, false};
  out = stragglers(push, bound, kSlot, k.at(0xAB, 0xAB), {1}, t0 + milliseconds(500));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].second,
            "straggler: group 3 not requested 400 ms after the other consumers, 200 ms after it moved to these "
            "routes (100 ms after it was announced; bound: max(straggler_floor 50 ms, 2 x 100 ms))");
}

}  // namespace
}  // namespace ferry::engine
