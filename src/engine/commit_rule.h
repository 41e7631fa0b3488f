// engine/commit_rule.h — a consumer's commit policy as a part (internal): what each of
// CommitPolicy's three rules does at the points a sync passes, with the state it needs
// kept here and nowhere else. The consumer's sync loop calls every point whatever the
// policy (a rule with nothing to do there does nothing), so it names no policy.
//
// A rule works on a CommitTarget: the side of the param set (engine/param_set.h) that a
// commit changes. Tests give it a fake one.
//
// Threading: begin_sync, install, finish, commit and report on the consumer's sync
// thread between attempts or after its last one; before_unpack and group_done on the
// thread running the attempt's unpack and post-processing (the unpack worker). The rule
// guards what both touch with its own lock. Errors: Status naming the consumer rank.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/clock.h"
#include "engine/schedule.h"
#include "engine/sync_trace.h"
#include "ferry/engine.h"

namespace ferry::engine {

// What a commit changes in the params (ParamSet implements it).
class CommitTarget {
 public:
  virtual ~CommitTarget() = default;
  // The version received and not yet live (shadow), if any.
  virtual std::optional<uint64_t> received_version() const = 0;
  // The received version made live in one step; the version. kFailedPrecondition when
  // nothing is received.
  virtual Result<uint64_t> commit() = 0;
  // Groups: the bounded shadow's layout for the routes installed (between attempts);
  // the layer group at a position of the order opens (before its unpack) and is made
  // live (after its post-processing).
  virtual Status set_group_shadow(GroupShadow layout, const std::vector<TensorDecl>& params) = 0;
  virtual const GroupShadow& group_shadow() const = 0;
  virtual Status open_at(int position) = 0;
  virtual Status commit_at(int position) = 0;
};

// What install() needs of the routes now installed: the consumer's plan route and its
// order of layer groups, its post-processing groups, and which params are on a GPU.
// The pointers stay valid until the next install().
struct CommitLayout {
  const PlanRoute* route = nullptr;
  const std::vector<int>* order = nullptr;
  const std::map<std::string, int>* post_group_of = nullptr;
  const std::vector<std::string>* post_group_names = nullptr;
  std::vector<bool> on_device;  // per route->params
};

class CommitRule {
 public:
  // The caller's hooks around every change of the live params (ConsumerOptions).
  struct Hooks {
    std::function<void(uint64_t)> before, after;
  };
  static std::unique_ptr<CommitRule> make(CommitPolicy policy, int rank, Hooks hooks);
  virtual ~CommitRule() = default;

  virtual CommitPolicy policy() const = 0;
  // Whether bytes may be read straight into params (groups: every byte passes the
  // bounded shadow by unpack).
  virtual bool lands_direct() const { return true; }
  // The param set's options this rule needs (ParamSetOptions::shadow, ::groups).
  virtual bool needs_shadow() const { return false; }
  virtual bool needs_group_shadow() const { return false; }

  // sync(v, commit_it): kInvalidArgument unless the rule can leave a version received
  // and not live (commit_it false needs the shadow).
  virtual Status check_sync(bool commit_it) const;
  // A sync begins (nothing of it made live yet).
  virtual void begin_sync() {}
  // Routes installed (between attempts).
  virtual Status install(CommitTarget& target, const CommitLayout& layout);
  // Worker thread: before layer group g is unpacked / after its post-processing.
  virtual Status before_unpack(CommitTarget& target, int g);
  virtual Status group_done(CommitTarget& target, uint64_t version, int g, SyncTrace& trace);

  // Sync v was received whole (ParamSet::finish ran). What the rule makes of it: live
  // now (`live`, with the seconds its commit took), or held received (shadow, commit_it
  // false). A commit's error.
  struct Finished {
    bool live = false;
    double commit_seconds = 0;
  };
  virtual Result<Finished> finish(CommitTarget& target, uint64_t version, bool commit_it);
  // Consumer::commit(): the received version made live between the hooks; the seconds it
  // took. The target's error when nothing is received.
  Result<double> commit(CommitTarget& target);
  // What this sync made live so far, for its report (groups: the units and the seconds
  // their commits took).
  virtual void report(SyncReport& rep) const { static_cast<void>(rep); }

  CommitRule(int rank, Hooks hooks) : rank_(rank), hooks_(std::move(hooks)) {}

 protected:
  int rank_;
  Hooks hooks_;
};

}  // namespace ferry::engine
