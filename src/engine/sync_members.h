// engine/sync_members.h — what a producer knows of its consumers' part in its syncs:
// who is a member of the current sync (a live lease when it began), who committed which
// version and when, who moved to which routes in it (a FAILOVER) and when each last
// moved (the straggler clocks, engine/straggler.h), what came early for a later sync,
// and why one was dropped. Internal.
//
// Threading: not thread-safe; the producer's mutex guards it (its handlers write it as
// messages come, its sync thread reads it).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/clock.h"

namespace ferry::engine {

// A producer's line for a consumer that aborted the sync: with the consumer's own reason
// (its ABORT's), which names the producer whose failure ended it, when it gave one.
inline std::string aborted_because(const std::string& reason) {
  return reason.empty() ? "it aborted the sync" : "it aborted the sync (" + reason + ")";
}

struct SyncMembers {
  // The sync this producer runs (in_sync) or ran last: its version.
  bool in_sync = false;
  uint64_t version = 0;
  // Per consumer rank: a member of the current sync (its lease live when it began).
  std::vector<bool> live;
  // consumer -> the version it committed last (DONE), and when that came.
  std::map<int, uint64_t> done;
  std::map<int, Clock::time_point> done_at;
  // This producer's previous sync() (its version, when it returned): a DONE of that
  // version from before then belongs to it, not to a sync of the same version again (a
  // rollback to it: "a sync like any other", docs/engine.md).
  std::optional<std::pair<uint64_t, Clock::time_point>> previous_sync;
  // consumer -> the routes it moved to in this sync (FAILOVER), and when that came.
  std::map<int, uint64_t> consumer_hash;
  std::map<int, Clock::time_point> consumer_joined;
  // consumer -> when it last moved in this sync: entered it (JOIN), released or asked
  // for a slot. A consumer absent here has not entered (engine/straggler.h).
  std::map<int, Clock::time_point> consumer_progress;
  // The routes a consumer that declared none this sync reads with: those the sync began
  // with, when they had no dead producer (otherwise every consumer declares its routes,
  // Consumer::declare_routes, and one that has not is still moving).
  std::optional<uint64_t> undeclared_hash;
  // What came before this producer's sync of that version began, applied when it starts:
  // consumer -> a later version it entered (JOIN), aborted (ABORT), or moved to other
  // routes in (FAILOVER: version, routes).
  std::map<int, uint64_t> early_join;
  std::map<int, std::pair<uint64_t, std::string>> early_abort;  // (version, its reason)
  std::map<int, std::pair<uint64_t, uint64_t>> early_failover;
  // consumer -> the instance (its lease's, as connected) that said it left the job
  // (LEAVE): not a member again until another instance of that rank is live.
  std::map<int, std::string> left_instance;
  // consumer -> why it was dropped from the current sync (told with DROPPED).
  std::map<int, std::string> drop_reason;

  bool member(int c) const { return c >= 0 && static_cast<size_t>(c) < live.size() && live[static_cast<size_t>(c)]; }
  // Whether consumer c committed version v (its last DONE).
  bool committed(int c, uint64_t v) const {
    auto d = done.find(c);
    return d != done.end() && d->second == v;
  }
};

}  // namespace ferry::engine
