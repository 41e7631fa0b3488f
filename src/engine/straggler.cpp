#include "engine/straggler.h"

#include <algorithm>

#include <fmt/format.h>

namespace ferry::engine {

Clock::duration straggler_bound(const StragglerPolicy& policy, const SlotPace& slot) {
  const auto others = *slot.last_release - slot.since;
  return std::max<Clock::duration>(policy.floor, std::chrono::duration_cast<Clock::duration>(others * policy.factor));
}

std::optional<Lag> lag_start(const SlotPace& slot, const RoutesKnown& known, int c) {
  // A slot of routes this producer has abandoned (it restarted the sync): whoever is
  // still pending there has not moved yet, by definition still finding the lost producer
  // (it may be blocked reading from it): never a straggler there.
  if (slot.routes != known.current) return std::nullopt;
  auto h = known.declared->find(c);
  if (h == known.declared->end() ? known.undeclared != slot.routes : h->second != slot.routes) return std::nullopt;
  Lag lag{*slot.last_release, true};
  if (known.opened) {
    auto o = known.opened->find(c);
    if (o == known.opened->end()) return std::nullopt;
    lag.from = std::max(lag.from, o->second);
  }
  if (auto j = known.joined->find(c); h != known.declared->end() && j != known.joined->end())
    lag.from = std::max(lag.from, j->second);
  if (known.progress) {
    auto p = known.progress->find(c);
    lag.entered = p != known.progress->end();
    if (lag.entered) lag.from = std::max(lag.from, p->second);
  }
  if (known.resumed) lag.from = std::max(lag.from, *known.resumed);
  return lag;
}

Clock::duration lag_bound(const StragglerPolicy& policy, Clock::duration bound, const Lag& lag) {
  return lag.entered ? bound : std::max<Clock::duration>(bound, policy.join_window);
}

std::optional<Clock::time_point> next_straggler(const StragglerPolicy& policy, Clock::duration bound,
                                                const SlotPace& slot, const RoutesKnown& known,
                                                const std::set<int>& pending, Clock::time_point deadline) {
  std::optional<Clock::time_point> at;
  if (!slot.last_release || policy.floor.count() <= 0) return at;
  for (int c : pending) {
    const auto lag = lag_start(slot, known, c);
    if (!lag) continue;
    const auto when = lag->from + lag_bound(policy, bound, *lag);
    if (when < deadline && (!at || when < *at)) at = when;
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
  const auto ms = [](Clock::duration d) { return duration_cast<milliseconds>(d).count(); };
  const bool commit = slot.group < 0;  // the sync's end: lagging the others' commits
  const std::string what = commit ? std::string("committed the sync")
                                  : fmt::format("{} group {}", policy.pull ? "released" : "requested", slot.group);
  for (int c : pending) {
    const auto lag = lag_start(slot, known, c);
    if (!lag || now < lag->from + lag_bound(policy, bound, *lag)) continue;
    const auto behind = ms(now - *slot.last_release);
    if (!lag->entered) {
      out.emplace_back(c, fmt::format("absent: did not enter the sync {} ms after the other consumers {} "
                                      "(join_window {} ms)",
                                      behind, what, ms(lag_bound(policy, bound, *lag))));
      continue;
    }
    std::string since;
    if (lag->from != *slot.last_release) {
      auto j = known.joined->find(c);
      const bool moved = j != known.joined->end() && j->second == lag->from;
      const bool turn = known.opened && known.opened->count(c) && known.opened->at(c) == lag->from;
      const bool resumed = known.resumed == lag->from;
      since = fmt::format(", {} ms after {}", ms(now - lag->from),
                          moved    ? "it moved to these routes"
                          : turn   ? "its turn came (its wave opened)"
                          : resumed ? "this producer resumed from a stop of its own"
                                    : "its last progress in this sync");
    }
    if (commit) {
      out.emplace_back(c, fmt::format("straggler: did not commit the sync {} ms after the other consumers did{} "
                                      "(they took {} ms after this producer's last group was done; bound: "
                                      "max(straggler_floor {} ms, {} x {} ms))",
                                      behind, since, took.count(), policy.floor.count(), policy.factor, took.count()));
      continue;
    }
    out.emplace_back(c, fmt::format("straggler: group {} not {} {} ms after the other consumers{} ({} ms after it "
                                    "was announced; bound: max(straggler_floor {} ms, {} x {} ms))",
                                    slot.group, policy.pull ? "released" : "requested", behind, since, took.count(),
                                    policy.floor.count(), policy.factor, took.count()));
  }
  return out;
}

PauseWatch::PauseWatch(Clock::duration tick, Clock::duration gap) : tick_(tick), gap_(gap) {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lk(mu_);
    auto last = Clock::now();
    woke_.store(last.time_since_epoch().count());
    started_ = true;
    cv_.notify_all();
    while (!stop_) {
      cv_.wait_for(lk, tick_);
      const auto now = Clock::now();
      if (now - last > gap_) resumed_.store(now.time_since_epoch().count());
      woke_.store(now.time_since_epoch().count());
      last = now;
    }
  });
  // Watching from here on: a stop right after construction counts too.
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [this] { return started_; });
}

PauseWatch::~PauseWatch() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::optional<Clock::time_point> PauseWatch::last_resume() const {
  // woke_ before resumed_: the watcher stores them in the other order, so a gap it
  // closed is seen either as still open (woke_ old) or as closed (resumed_), never as none.
  const auto now = Clock::now();
  const auto woke = Clock::time_point(Clock::duration(woke_.load()));
  const int64_t t = resumed_.load();
  if (now - woke > gap_) return now;
  if (t == 0) return std::nullopt;
  return Clock::time_point(Clock::duration(t));
}

}  // namespace ferry::engine
