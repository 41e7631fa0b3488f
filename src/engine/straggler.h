// engine/straggler.h — the producer's straggler policy (EngineOptions::straggler_floor,
// straggler_factor, join_window) apart from its slots, lock and clock: when a consumer
// still pending on a slot that others have released counts as a straggler (or, one that
// has not entered the sync yet, as absent), and the reason it is dropped with.
//
// RL timing is not a fault: inference ranks enter a sync seconds apart after their
// rollouts, and one may post-process each group for a second. So a consumer lags only
// from the later of the others' last release of the slot, its own entry into the sync
// (JOIN) and its own last progress (a release or request of any slot of this sync): one
// that keeps moving, however slowly, is never a straggler; one that has not entered is
// bounded by the join window; one that stopped moving by the straggler bound. Pure functions of what the producer knows; the producer's wait_slot
// waits and drops.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/clock.h"

namespace ferry::engine {

struct StragglerPolicy {
  std::chrono::milliseconds floor{0};  // EngineOptions::straggler_floor; 0: no stragglers
  double factor = 0;                   // EngineOptions::straggler_factor
  bool pull = true;                    // consumers release slots (pull) or request them (push)
  // EngineOptions::join_window: how long a consumer that has not entered the sync may lag
  // the others before it is dropped as absent (never sooner than the straggler bound).
  // No bound is raised for what other producers may do: a consumer one of them holds up
  // (paused, lost, slow) says so with JOINs to the rest (issue 49, finding 2: a bound of
  // at least 2 x lease_ttl with several producers made join_window=2 s a silent 6 s).
  std::chrono::milliseconds join_window{0};
};

// One staging slot as the policy sees it.
struct SlotPace {
  int group = -1;  // -1: the sync's end (Producer wait_committed), the others' pace their DONEs
  uint64_t routes = 0;                            // the routes it was packed with
  Clock::time_point since;                        // when it was announced
  std::optional<Clock::time_point> last_release;  // when a consumer last released it (the others' pace)
};

// What the producer knows of the consumers' routes in this sync.
struct RoutesKnown {
  uint64_t current = 0;                                    // the producer's routes now
  const std::map<int, uint64_t>* declared = nullptr;       // consumer -> routes it moved to (FAILOVER)
  const std::map<int, Clock::time_point>* joined = nullptr;  // ... and when that FAILOVER came
  std::optional<uint64_t> undeclared;  // the routes of a consumer that declared none, if known
  // consumer -> when it last moved in this sync: entered (JOIN), released or requested a
  // slot. A consumer absent here has not entered the sync. Null: every consumer counts as
  // entered, with no progress known.
  const std::map<int, Clock::time_point>* progress = nullptr;
  // The rotated order's paced service (EngineOptions::group_order, docs/group-order.md):
  // consumer -> when its turn at the slot came (its wave opened with the group packed).
  // A consumer absent here is not late: its turn has not come. Null: every consumer's
  // turn came when the slot was announced (layer order).
  const std::map<int, Clock::time_point>* opened = nullptr;
  // When this producer last resumed from a stop of its own (PauseWatch): no consumer
  // lags from before it, entered or not — what they sent meanwhile may still be queued.
  std::optional<Clock::time_point> resumed;
};

// Where consumer c's lag on a slot starts, and whether it has entered the sync.
struct Lag {
  Clock::time_point from;
  bool entered = true;
  friend bool operator==(const Lag&, const Lag&) = default;
};

// The bound a pending consumer that entered the sync may lag the others by: max(floor,
// factor x the time the others took). Needs `slot.last_release`.
Clock::duration straggler_bound(const StragglerPolicy& policy, const SlotPace& slot);

// When consumer c's lag began: nullopt while it is not known to read the slot's routes
// (a slot of routes the producer abandoned, or routes c has not declared), else the
// latest of the last release, when c moved to these routes (FAILOVER), c's own last
// progress and the producer's own last resume; with whether c entered the sync. Needs `slot.last_release`.
std::optional<Lag> lag_start(const SlotPace& slot, const RoutesKnown& known, int c);

// The bound for one consumer's lag: `bound` (straggler_bound) once it entered the sync,
// else max(bound, join_window).
Clock::duration lag_bound(const StragglerPolicy& policy, Clock::duration bound, const Lag& lag);

// The earliest time before `deadline` at which a consumer of `pending` lags by more than
// its lag_bound; nullopt with the policy off, before any release, or when there is none.
std::optional<Clock::time_point> next_straggler(const StragglerPolicy& policy, Clock::duration bound,
                                                const SlotPace& slot, const RoutesKnown& known,
                                                const std::set<int>& pending, Clock::time_point deadline);

// The consumers of `pending` lagging by their lag_bound or more at `now`, each with the
// reason it is dropped for (the group, its lag, the others' time and the bound; "absent"
// for one that never entered). Needs `slot.last_release`.
std::vector<std::pair<int, std::string>> stragglers(const StragglerPolicy& policy, Clock::duration bound,
                                                    const SlotPace& slot, const RoutesKnown& known,
                                                    const std::set<int>& pending, Clock::time_point now);

// Notices that this process did not run for a while (SIGSTOP, a host or VM stall): a
// thread wakes every `tick` and records when a wake came more than `gap` after the one
// before. A producer judges no consumer by time that passed while it was itself stopped:
// its clocks on every consumer restart when it resumes (issue 30: a paused trainer rank
// dropped healthy consumers as stragglers for its own pause, the releases they sent
// meanwhile still queued). A machine so loaded that a short sleep overshoots by `gap`
// looks the same, and only delays a drop by a straggler bound. Thread-safe.
class PauseWatch {
 public:
  PauseWatch(Clock::duration tick, Clock::duration gap);
  ~PauseWatch();
  PauseWatch(const PauseWatch&) = delete;
  PauseWatch& operator=(const PauseWatch&) = delete;
  // When the last such gap ended; nullopt if none was seen. A gap still open — the
  // watcher has not woken since more than `gap` ago, as right after a SIGCONT when the
  // caller's thread runs before the watcher's — counts as ending now: a caller that
  // wakes from a stop is never told it was not stopped (issue 49, finding 1).
  std::optional<Clock::time_point> last_resume() const;

 private:
  const Clock::duration tick_, gap_;
  std::atomic<int64_t> resumed_{0};  // Clock ticks since epoch; 0: none
  std::atomic<int64_t> woke_{0};     // the watcher's last wake, Clock ticks since epoch
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, started_ = false;
  std::thread thread_;
};

}  // namespace ferry::engine
