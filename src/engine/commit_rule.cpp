// The three commit rules (engine/commit_rule.h): in place (a received sync is live, no
// state), shadow (a received sync waits in the shadow for commit(), no state) and groups
// (each layer group made live by the worker as it completes; the rule keeps each group's
// position in the order and what this sync made live).
#include "engine/commit_rule.h"

#include <algorithm>

#include <fmt/format.h>

namespace ferry::engine {

Status CommitRule::check_sync(bool commit_it) const {
  if (commit_it) return Status::Ok();
  return invalid_argument("consumer {}: sync(commit=false) needs the shadow commit policy", rank_);
}

Status CommitRule::install(CommitTarget& target, const CommitLayout& layout) {
  static_cast<void>(target);
  static_cast<void>(layout);
  return Status::Ok();
}

Status CommitRule::before_unpack(CommitTarget& target, int g) {
  static_cast<void>(target);
  static_cast<void>(g);
  return Status::Ok();
}

Status CommitRule::group_done(CommitTarget& target, uint64_t version, int g, SyncTrace& trace) {
  static_cast<void>(target);
  static_cast<void>(version);
  static_cast<void>(g);
  static_cast<void>(trace);
  return Status::Ok();
}

Result<CommitRule::Finished> CommitRule::finish(CommitTarget& target, uint64_t version, bool commit_it) {
  static_cast<void>(target);
  static_cast<void>(version);
  static_cast<void>(commit_it);
  return Finished{true, 0};  // (finishing the sync made it live)
}

Result<double> CommitRule::commit(CommitTarget& target) {
  const std::optional<uint64_t> v = target.received_version();
  if (!v) return target.commit().status();  // (its error: nothing received)
  if (hooks_.before) hooks_.before(*v);
  const auto t = Clock::now();
  Result<uint64_t> done = target.commit();
  const double seconds = seconds_since(t);
  if (hooks_.after) hooks_.after(*v);
  FERRY_RETURN_IF_ERROR(done.status());
  return seconds;
}

namespace {

// Every byte lands in the live params as it arrives.
class InPlaceCommit final : public CommitRule {
 public:
  using CommitRule::CommitRule;
  CommitPolicy policy() const override { return CommitPolicy::kInPlace; }
};

// A sync lands in the shadow; commit() makes it live in one step.
class ShadowCommit final : public CommitRule {
 public:
  using CommitRule::CommitRule;
  CommitPolicy policy() const override { return CommitPolicy::kShadow; }
  bool needs_shadow() const override { return true; }
  Status check_sync(bool) const override { return Status::Ok(); }
  Result<Finished> finish(CommitTarget& target, uint64_t, bool commit_it) override {
    if (!commit_it) return Finished{false, 0};  // (held received: commit() or discard() decides)
    FERRY_ASSIGN_OR_RETURN(const double seconds, commit(target));
    return Finished{true, seconds};
  }
};

// Each layer group made live as soon as it is complete (on the worker thread).
class GroupsCommit final : public CommitRule {
 public:
  using CommitRule::CommitRule;
  CommitPolicy policy() const override { return CommitPolicy::kGroups; }
  bool lands_direct() const override { return false; }
  bool needs_group_shadow() const override { return true; }

  void begin_sync() override {
    std::lock_guard<std::mutex> lk(mu_);
    live_.clear();
    seconds_ = 0;
  }

  Status install(CommitTarget& target, const CommitLayout& layout) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      layout_ = layout;
      position_.assign(layout.route->groups.size(), -1);
      const std::vector<int>& order = *layout.order;
      for (size_t i = 0; i < order.size(); ++i)
        if (order[i] >= 0 && static_cast<size_t>(order[i]) < position_.size())
          position_[static_cast<size_t>(order[i])] = static_cast<int>(i);
    }
    return target
        .set_group_shadow(group_shadow_layout(*layout.route, layout.order, *layout.post_group_of, layout.on_device),
                          layout.route->params)
        .with_context(fmt::format("consumer {}", rank_));
  }

  // Its params' room in the bounded shadow, filled from the live params first.
  Status before_unpack(CommitTarget& target, int g) override { return target.open_at(position(g)); }

  Status group_done(CommitTarget& target, uint64_t version, int g, SyncTrace& trace) override {
    const int at = position(g);
    const GroupShadow& shadow = target.group_shadow();
    if (at < 0 || static_cast<size_t>(at) >= shadow.commits.size() || shadow.commits[static_cast<size_t>(at)].empty())
      return Status::Ok();
    // The only moment these params change: between the caller's hooks (its lock).
    if (hooks_.before) hooks_.before(version);
    const auto t = Clock::now();
    Status s = target.commit_at(at);
    const auto t1 = Clock::now();
    if (hooks_.after) hooks_.after(version);
    trace.record(TracePhase::kCommit, g, -1, t, t1);
    FERRY_RETURN_IF_ERROR(s.with_context(fmt::format("consumer {} committing group {}", rank_, g)));
    std::lock_guard<std::mutex> lk(mu_);
    seconds_ += std::chrono::duration<double>(t1 - t).count();
    for (int u : shadow.units[static_cast<size_t>(at)]) {
      std::string name = unit_name(u);  // (once, also when a later attempt commits it again)
      if (std::find(live_.begin(), live_.end(), name) == live_.end()) live_.push_back(std::move(name));
    }
    return Status::Ok();
  }

  void report(SyncReport& rep) const override {
    std::lock_guard<std::mutex> lk(mu_);
    rep.groups_live = live_;
    rep.commit_seconds = seconds_;
  }

 private:
  int position(int g) const {
    std::lock_guard<std::mutex> lk(mu_);
    return g >= 0 && static_cast<size_t>(g) < position_.size() ? position_[static_cast<size_t>(g)] : -1;
  }
  // A unit of commit: a post-processing group, or a param of none (-1 - its index).
  std::string unit_name(int unit) const {
    const std::vector<std::string>& groups = *layout_.post_group_names;
    if (unit >= 0 && static_cast<size_t>(unit) < groups.size()) return groups[static_cast<size_t>(unit)];
    const auto param = static_cast<size_t>(-1 - static_cast<int64_t>(unit));
    if (unit < 0 && param < layout_.route->params.size()) return layout_.route->params[param].name;
    return fmt::format("group {}", unit);
  }

  mutable std::mutex mu_;
  CommitLayout layout_;
  std::vector<int> position_;     // per layer group: its position in the order (-1: not read)
  std::vector<std::string> live_;  // the units this sync made live, in order
  double seconds_ = 0;             // their commits' seconds
};

}  // namespace

std::unique_ptr<CommitRule> CommitRule::make(CommitPolicy policy, int rank, Hooks hooks) {
  switch (policy) {
    case CommitPolicy::kShadow: return std::unique_ptr<CommitRule>(new ShadowCommit(rank, std::move(hooks)));
    case CommitPolicy::kGroups: return std::unique_ptr<CommitRule>(new GroupsCommit(rank, std::move(hooks)));
    case CommitPolicy::kInPlace: break;
  }
  return std::unique_ptr<CommitRule>(new InPlaceCommit(rank, std::move(hooks)));
}

}  // namespace ferry::engine
