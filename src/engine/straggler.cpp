#include "engine/straggler.h"

#include <algorithm>

#include <fmt/format.h>

namespace ferry::engine {

Clock::duration straggler_bound(const StragglerPolicy& policy, const SlotPace& slot) {
  const auto others = *slot.last_release - slot.since;
  return std::max<Clock::duration>(policy.floor, std::chrono::duration_cast<Clock::duration>(others * policy.factor));
}

std::optional<Clock::time_point> lag_start(const SlotPace& slot, const RoutesKnown& known, int c) {
  // A slot of routes this producer has abandoned (it restarted the sync): whoever is
  // still pending there has not moved yet, by definition still finding the lost producer
  // (it may be blocked reading from it): never a straggler there.
  if (slot.routes != known.current) return std::nullopt;
  auto h = known.declared->find(c);
  if (h == known.declared->end() ? known.undeclared != slot.routes : h->second != slot.routes) return std::nullopt;
  Clock::time_point from = *slot.last_release;
  if (auto j = known.joined->find(c); h != known.declared->end() && j != known.joined->end())
    from = std::max(from, j->second);
  return from;
}

std::optional<Clock::time_point> next_straggler(const StragglerPolicy& policy, Clock::duration bound,
                                                const SlotPace& slot, const RoutesKnown& known,
                                                const std::set<int>& pending, Clock::time_point deadline) {
  std::optional<Clock::time_point> at;
  if (!slot.last_release || policy.floor.count() <= 0) return at;
  for (int c : pending) {
    const auto from = lag_start(slot, known, c);
    if (from && *from + bound < deadline && (!at || *from + bound < *at)) at = *from + bound;
  }
  return at;
}

std::vector<std::pair<int, std::string>> stragglers(const StragglerPolicy& policy, Clock::duration bound,
                                                    const SlotPace& slot, const RoutesKnown& known,
                                                    const std::set<int>& pending, Clock::time_point now) {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  std::vector<std::pair<int, std::string>> out;
  const auto took = duration_cast<milliseconds>(*slot.last_release - slot.since);
  for (int c : pending) {
    const auto from = lag_start(slot, known, c);
    if (!from || now < *from + bound) continue;
    const auto lag = duration_cast<milliseconds>(now - *slot.last_release);
    const std::string moved =
        *from == *slot.last_release
            ? std::string()
            : fmt::format(", {} ms after it moved to these routes", duration_cast<milliseconds>(now - *from).count());
    out.emplace_back(c, fmt::format("straggler: group {} not {} {} ms after the other consumers{} ({} ms after it "
                                    "was announced; bound: max(straggler_floor {} ms, {} x {} ms))",
                                    slot.group, policy.pull ? "released" : "requested", lag.count(), moved,
                                    took.count(), policy.floor.count(), policy.factor, took.count()));
  }
  return out;
}

}  // namespace ferry::engine
