// The rank of `ferry serve` / `ferry fetch` from a flag or the launcher's environment.
#include <gtest/gtest.h>

#include "tools/rank_entry.h"

namespace ferry::tools {
namespace {

LauncherRank env(int rank, int world, const char* rv = "OMPI_COMM_WORLD_RANK", const char* wv = "OMPI_COMM_WORLD_SIZE") {
  LauncherRank l;
  l.rank = rank;
  l.world_size = world;
  l.rank_var = rv;
  l.world_size_var = wv;
  return l;
}

TEST(RankEntry, RankFromFlagOrLauncher) {
  // The flag wins and is checked against the layout.
  EXPECT_EQ(*resolve_role_rank(true, 1, 2, 4, env(5, 6)), 1);
  EXPECT_FALSE(resolve_role_rank(false, 4, 2, 4, {}).ok());
  // A launcher world of the role alone.
  EXPECT_EQ(*resolve_role_rank(false, -1, 2, 4, env(3, 4)), 3);
  EXPECT_EQ(*resolve_role_rank(true, -1, 2, 4, env(1, 2)), 1);
  // One world of trainer + inference ranks: the trainer's first.
  EXPECT_EQ(*resolve_role_rank(true, -1, 2, 4, env(1, 6)), 1);
  EXPECT_EQ(*resolve_role_rank(false, -1, 2, 4, env(2, 6)), 0);
  EXPECT_EQ(*resolve_role_rank(false, -1, 2, 4, env(5, 6)), 3);
  auto wrong = resolve_role_rank(true, -1, 2, 4, env(3, 6));
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("OMPI_COMM_WORLD_RANK=3"), std::string::npos) << wrong.status().to_string();
  // A world that is neither, or no rank at all: errors naming what is missing.
  auto odd = resolve_role_rank(false, -1, 2, 4, env(0, 5));
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("OMPI_COMM_WORLD_SIZE=5"), std::string::npos) << odd.status().to_string();
  auto none = resolve_role_rank(false, -1, 2, 4, {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("--rank"), std::string::npos);
  // No world size: the role's own.
  LauncherRank only_rank;
  only_rank.rank = 2;
  only_rank.rank_var = "FERRY_RANK";
  EXPECT_EQ(*resolve_role_rank(false, -1, 2, 4, only_rank), 2);
}

TEST(RankEntry, LauncherVariablesInPrecedence) {
  ::setenv("SLURM_PROCID", "7", 1);
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  auto l = launcher_rank_from_env();
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(*l->rank, 3);
  EXPECT_EQ(l->rank_var, "RANK");
  EXPECT_EQ(*l->world_size, 4);
  ::setenv("FERRY_RANK", "x1", 1);
  auto bad = launcher_rank_from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("FERRY_RANK='x1'"), std::string::npos) << bad.status().to_string();
  for (const char* n : {"SLURM_PROCID", "RANK", "WORLD_SIZE", "FERRY_RANK"}) ::unsetenv(n);
}

}  // namespace
}  // namespace ferry::tools
