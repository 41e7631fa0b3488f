// The commit rules (engine/commit_rule.h) against a fake param set that logs what is
// done to it: which rule may hold a version received, when a commit runs and between
// which hooks, and the groups rule's positions, opens, commits and report.
#include "engine/commit_rule.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ferry::engine {
namespace {

// A CommitTarget that logs each call ("commit", "open 1", "commit_at 1", ...).
class FakeTarget final : public CommitTarget {
 public:
  std::vector<std::string>* log = nullptr;
  std::optional<uint64_t> received;
  GroupShadow shadow;
  int shadows_set = 0;

  std::optional<uint64_t> received_version() const override { return received; }
  Result<uint64_t> commit() override {
    log->push_back("commit");
    if (!received) return failed_precondition("nothing received");
    const uint64_t v = *received;
    received.reset();
    return v;
  }
  Status set_group_shadow(GroupShadow layout, const std::vector<TensorDecl>&) override {
    ++shadows_set;
    // The test's layout stands for the one computed from the routes: keep it.
    if (shadow.commits.empty()) shadow = std::move(layout);
    return Status::Ok();
  }
  const GroupShadow& group_shadow() const override { return shadow; }
  Status open_at(int position) override {
    log->push_back("open " + std::to_string(position));
    return Status::Ok();
  }
  Status commit_at(int position) override {
    log->push_back("commit_at " + std::to_string(position));
    return Status::Ok();
  }
};

CommitRule::Hooks logging_hooks(std::vector<std::string>& log) {
  return {[&log](uint64_t v) { log.push_back("before " + std::to_string(v)); },
          [&log](uint64_t v) { log.push_back("after " + std::to_string(v)); }};
}

TEST(CommitRule, InPlaceIsLiveAtFinishAndHoldsNothingReceived) {
  std::vector<std::string> log;
  auto rule = CommitRule::make(CommitPolicy::kInPlace, 3, logging_hooks(log));
  FakeTarget t;
  t.log = &log;
  EXPECT_TRUE(rule->lands_direct());
  EXPECT_FALSE(rule->needs_shadow());
  EXPECT_FALSE(rule->needs_group_shadow());
  const Status refused = rule->check_sync(false);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("consumer 3"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("shadow"), std::string::npos) << refused.message();
  EXPECT_TRUE(rule->check_sync(true).ok());
  auto f = rule->finish(t, 5, true);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->live);
  EXPECT_TRUE(log.empty());  // nothing to commit: the bytes landed live, no hook ran
  SyncReport rep;
  rule->report(rep);
  EXPECT_TRUE(rep.groups_live.empty());
  // commit() with nothing received: the target's error, no hook.
  EXPECT_EQ(rule->commit(t).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(log, std::vector<std::string>{"commit"});
}

TEST(CommitRule, ShadowHoldsAReceivedVersionAndCommitsBetweenTheHooks) {
  std::vector<std::string> log;
  auto rule = CommitRule::make(CommitPolicy::kShadow, 0, logging_hooks(log));
  FakeTarget t;
  t.log = &log;
  EXPECT_TRUE(rule->needs_shadow());
  EXPECT_TRUE(rule->lands_direct());
  EXPECT_TRUE(rule->check_sync(false).ok());
  t.received = 7;
  auto held = rule->finish(t, 7, false);  // commit=false: held for commit() or discard()
  ASSERT_TRUE(held.ok());
  EXPECT_FALSE(held->live);
  EXPECT_TRUE(log.empty());
  EXPECT_EQ(t.received, std::optional<uint64_t>(7));
  auto c = rule->commit(t);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_GE(*c, 0.0);
  EXPECT_EQ(log, (std::vector<std::string>{"before 7", "commit", "after 7"}));
  log.clear();
  t.received = 8;
  auto live = rule->finish(t, 8, true);  // the sync's own commit
  ASSERT_TRUE(live.ok());
  EXPECT_TRUE(live->live);
  EXPECT_EQ(log, (std::vector<std::string>{"before 8", "commit", "after 8"}));
  EXPECT_FALSE(t.received);
}

// Three layer groups read in the order 2, 0, 1; units commit after positions 0 and 2.
TEST(CommitRule, GroupsOpensAndCommitsEachGroupAtItsPositionAndReportsItsUnits) {
  std::vector<std::string> log;
  auto rule = CommitRule::make(CommitPolicy::kGroups, 1, logging_hooks(log));
  FakeTarget t;
  t.log = &log;
  EXPECT_FALSE(rule->lands_direct());
  EXPECT_TRUE(rule->needs_group_shadow());
  EXPECT_FALSE(rule->check_sync(false).ok());
  PlanRoute route;
  route.params = {TensorDecl{"w0", DType::kF32, {4}}, TensorDecl{"w1", DType::kF32, {4}}};
  route.groups.resize(3);
  route.groups[2].unpacks.emplace_back().param = 0;
  route.groups[1].unpacks.emplace_back().param = 1;
  const std::vector<int> order{2, 0, 1};
  const std::map<std::string, int> post_group_of{{"w0", 0}};
  const std::vector<std::string> post_group_names{"layer.0"};
  t.shadow.commits = {{0}, {}, {1}};
  t.shadow.units = {{0}, {}, {-2}};  // position 2 makes w1 live: a param of no post group
  ASSERT_TRUE(rule->install(t, CommitLayout{&route, &order, &post_group_of, &post_group_names, {false, false}}).ok());
  EXPECT_EQ(t.shadows_set, 1);

  rule->begin_sync();
  SyncTrace trace;
  trace.begin(Clock::now());
  for (int g : order) {
    ASSERT_TRUE(rule->before_unpack(t, g).ok());
    ASSERT_TRUE(rule->group_done(t, 4, g, trace).ok());
  }
  EXPECT_EQ(log, (std::vector<std::string>{"open 0", "before 4", "commit_at 0", "after 4", "open 1", "open 2",
                                            "before 4", "commit_at 2", "after 4"}));
  auto f = rule->finish(t, 4, true);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->live);
  SyncReport rep;
  rule->report(rep);
  EXPECT_EQ(rep.groups_live, (std::vector<std::string>{"layer.0", "w1"}));
  int commits = 0;
  for (const TraceEvent& e : trace.take()) commits += e.phase == TracePhase::kCommit;
  EXPECT_EQ(commits, 2);
  // A second attempt commits group 2 again: its unit is named once. A new sync forgets.
  ASSERT_TRUE(rule->group_done(t, 4, 2, trace).ok());
  rule->report(rep);
  EXPECT_EQ(rep.groups_live.size(), 2u);
  rule->begin_sync();
  rule->report(rep);
  EXPECT_TRUE(rep.groups_live.empty());
  EXPECT_EQ(rep.commit_seconds, 0.0);
}

}  // namespace
}  // namespace ferry::engine
