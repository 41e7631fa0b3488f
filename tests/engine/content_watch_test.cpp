// ContentWatch (engine/weight_digests.h): SyncReport::unchanged from the checksums of
// each layer group, against the last successful sync's over the same routes.
#include <gtest/gtest.h>

#include "engine/weight_digests.h"

namespace ferry::engine {
namespace {

using Sums = std::map<int64_t, uint64_t>;

TEST(ContentWatch, SaysUnchangedOnlyWhenEveryGroupMatchesOverTheSameRoutes) {
  ContentWatch w;
  auto run = [&](uint64_t routes, std::vector<Sums> groups, bool ok = true, uint64_t end_routes = 0) {
    w.begin(routes);
    for (size_t g = 0; g < groups.size(); ++g) w.add(static_cast<int>(g), groups[g]);
    return w.finish(end_routes ? end_routes : routes, ok);
  };
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 3}}}), std::nullopt);  // the first: nothing to compare with
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 3}}}), true);
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 4}}}), false);        // one segment's checksum differs
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 4}}}, false), std::nullopt);  // failed: no answer, no reference
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 4}}}), std::nullopt);  // (what the failed one left live is unknown)
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 4}}}), true);
  w.forget();  // a catch-up, a dropped received version
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 4}}}), std::nullopt);
  EXPECT_EQ(run(7, {{{0, 1}}, {{0, 2}, {1, 4}}}), true);
  EXPECT_EQ(run(8, {{{0, 1}}, {{0, 2}, {1, 4}}}), std::nullopt);  // other routes
  EXPECT_EQ(run(8, {{{0, 1}}, {{0, 2}, {1, 4}}}), true);
  EXPECT_EQ(run(8, {{{0, 1}}}), std::nullopt);                    // other groups packed: cannot tell
  EXPECT_EQ(run(8, {{{0, 1}}, {}}), std::nullopt);               // a group without checksums
  EXPECT_EQ(run(8, {{{0, 1}}, {{0, 2}, {1, 4}}}), std::nullopt);  // (nothing to compare with since)
  EXPECT_EQ(run(8, {{{0, 1}}, {{0, 2}, {1, 4}}}, true, 9), std::nullopt);  // routes changed during the sync
  // A group moved twice in one sync (a second attempt) counts as moved last.
  w.begin(9);
  w.add(0, {{0, 5}});
  w.add(0, {{0, 1}});
  EXPECT_EQ(w.finish(9, true), std::nullopt);
  w.begin(9);
  w.add(0, {{0, 1}});
  EXPECT_EQ(w.finish(9, true), true);
}

}  // namespace
}  // namespace ferry::engine
