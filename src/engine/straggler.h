// engine/straggler.h — the producer's straggler policy (EngineOptions::straggler_floor,
// straggler_factor) apart from its slots, lock and clock: when a consumer still pending
// on a slot that others have released counts as a straggler, and the reason it is
// dropped with. Pure functions of what the producer knows; the producer's wait_slot
// waits and drops.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/clock.h"

namespace ferry::engine {

struct StragglerPolicy {
  std::chrono::milliseconds floor{0};  // EngineOptions::straggler_floor; 0: no stragglers
  double factor = 0;                   // EngineOptions::straggler_factor
  bool pull = true;                    // consumers release slots (pull) or request them (push)
};

// One staging slot as the policy sees it.
struct SlotPace {
  int group = -1;
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
};

// The bound a pending consumer may lag the others by: max(floor, factor x the time the
// others took). Needs `slot.last_release`.
Clock::duration straggler_bound(const StragglerPolicy& policy, const SlotPace& slot);

// When consumer c's lag began: nullopt while it is not known to read the slot's routes
// (a slot of routes the producer abandoned, or routes c has not declared), else the last
// release, or when c moved to these routes if that was later. Needs `slot.last_release`.
std::optional<Clock::time_point> lag_start(const SlotPace& slot, const RoutesKnown& known, int c);

// The earliest time before `deadline` at which a consumer of `pending` lags by more than
// `bound`; nullopt with the policy off, before any release, or when there is none.
std::optional<Clock::time_point> next_straggler(const StragglerPolicy& policy, Clock::duration bound,
                                                const SlotPace& slot, const RoutesKnown& known,
                                                const std::set<int>& pending, Clock::time_point deadline);

// The consumers of `pending` lagging by `bound` or more at `now`, each with the reason
// it is dropped for (the group, its lag, the others' time and the bound). Needs
// `slot.last_release`.
std::vector<std::pair<int, std::string>> stragglers(const StragglerPolicy& policy, Clock::duration bound,
                                                    const SlotPace& slot, const RoutesKnown& known,
                                                    const std::set<int>& pending, Clock::time_point now);

}  // namespace ferry::engine
