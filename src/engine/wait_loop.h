// engine/wait_loop.h — the one wait of the engine's control plane (wait_loop) and the one
// rule by which a peer's lease counts as lost (LapseWatch). Internal.
//
// A rank waiting for its peers (a consumer for an announcement, its relay's answer, or a
// restarted producer) does the same things while it waits: it wakes when a message comes
// (its condition variable), says it is still in the sync to the producers it is not
// waiting for (keepalive: JOINs, so that no healthy producer drops it as a straggler for
// what another holds up), looks at the leases of those it waits for (check: one cut off
// or paused cannot be told from dead by the transport), probes its own transport, and
// gives up at its deadline. What differs is what it waits for (step) and what each of
// those says; the loop is here once.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>

#include "engine/clock.h"

namespace ferry::engine {

// The lapse rule: a peer whose lease is gone (or names another instance) at two checks in
// a row, a lease_ttl apart, is lost: paused past its ttl, cut off or dead. Not one whose
// lease a store restart dropped and that heals within a ttl (gone at one check only). A
// check that could not read the store tells nothing (`gone` false) and starts over.
class LapseWatch {
 public:
  // One check of `who`'s lease; true once it was gone at this check and the one before.
  bool lapsed(int who, bool gone) {
    if (!gone) {
      seen_.erase(who);
      return false;
    }
    return !seen_.insert(who).second;
  }

 private:
  std::set<int> seen_;
};

struct WaitTicks {
  Clock::time_point deadline;
  Clock::duration probe_every{};      // the longest sleep: step probes the transport's health
  Clock::duration keepalive_every{};  // 0: no keepalive
  // Lease checks: the first after check_first (0: check_every), each later one twice as
  // long after the last, up to check_every. check_every 0: no checks.
  Clock::duration check_every{};
  Clock::duration check_first{};
};

// Waits under `lk` (which guards `cv`) until `step()` has an answer (a std::optional<T>
// with a value), then returns it. Between steps it sleeps on `cv` until a notify, the
// next tick or the deadline; after a wake it runs `keepalive()` and then `check()` when
// their time came, both with `lk` released (they talk to peers and the store); an answer
// from `check()` ends the wait too. Once the deadline passed and `step()` still has none,
// the answer is `late()` (with `lk` held).
template <typename T, typename Step, typename Keepalive, typename Check, typename Late>
T wait_loop(std::unique_lock<std::mutex>& lk, std::condition_variable& cv, const WaitTicks& t, Step&& step,
            Keepalive&& keepalive, Check&& check, Late&& late) {
  constexpr Clock::time_point kNever = Clock::time_point::max();
  auto next_keepalive = t.keepalive_every.count() > 0 ? Clock::now() + t.keepalive_every : kNever;
  Clock::duration check_in = t.check_first.count() > 0 ? t.check_first : t.check_every;
  auto next_check = t.check_every.count() > 0 ? Clock::now() + check_in : kNever;
  for (;;) {
    if (std::optional<T> answer = step()) return std::move(*answer);
    const auto now = Clock::now();
    if (now >= t.deadline) return late();
    cv.wait_until(lk, std::min({t.deadline, now + t.probe_every, next_keepalive, next_check}));
    if (Clock::now() >= next_keepalive) {
      lk.unlock();
      keepalive();
      lk.lock();
      next_keepalive = Clock::now() + t.keepalive_every;
    }
    if (Clock::now() >= next_check && Clock::now() < t.deadline) {
      lk.unlock();
      std::optional<T> answer = check();
      lk.lock();
      check_in = std::min<Clock::duration>(2 * check_in, t.check_every);
      next_check = Clock::now() + check_in;
      if (answer) return std::move(*answer);
    }
  }
}

}  // namespace ferry::engine
