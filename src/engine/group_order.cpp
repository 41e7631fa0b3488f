#include "engine/group_order.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace ferry::engine {

Result<GroupOrderOptions> parse_group_order(std::string_view text) {
  if (text == "layer") return GroupOrderOptions{GroupOrderKind::kLayer, true};
  if (text == "rotated") return GroupOrderOptions{GroupOrderKind::kRotated, true};
  if (text == "rotated-unpaced") return GroupOrderOptions{GroupOrderKind::kRotated, false};
  return invalid_argument("--order: unknown group order '{}' (layer, rotated, rotated-unpaced)", text);
}

std::string group_order_name(const GroupOrderOptions& options) {
  if (options.kind == GroupOrderKind::kLayer) return "layer";
  return options.paced ? "rotated" : "rotated-unpaced";
}

std::vector<std::vector<ServedRead>> serve_waves(const Routes& routes, const GroupOrder& order, int p) {
  std::vector<std::vector<ServedRead>> out;
  std::vector<std::pair<int, ServedRead>> by;  // (step or pack position, read)
  const auto& packs = order.producer[static_cast<size_t>(p)];
  for (size_t i = 0; i < packs.size(); ++i) {
    const int g = packs[i];
    for (size_t c = 0; c < routes.consumer_plan.size(); ++c) {
      const auto& reads = routes.consumer(c).groups[static_cast<size_t>(g)].reads;
      if (std::none_of(reads.begin(), reads.end(), [p](const Read& r) { return r.producer == static_cast<uint32_t>(p); }))
        continue;
      const int key = order.paced ? order.step[c][static_cast<size_t>(g)] : static_cast<int>(i);
      by.emplace_back(key, ServedRead{static_cast<int>(c), g});
    }
  }
  std::stable_sort(by.begin(), by.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < by.size(); ++i) {
    if (i == 0 || by[i].first != by[i - 1].first) out.emplace_back();
    out.back().push_back(by[i].second);
  }
  return out;
}

namespace {

// Producer p serves group g: it stages bytes some consumer reads.
bool serves(const Routes& routes, size_t p, size_t g) {
  const ProducerGroup& pg = routes.producers[p].groups[g];
  return pg.staging_bytes > 0 || !pg.segments.empty();
}

struct UnionFind {
  std::vector<int> parent;
  explicit UnionFind(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  int find(int x) {
    while (parent[static_cast<size_t>(x)] != x) {
      parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
      x = parent[static_cast<size_t>(x)];
    }
    return x;
  }
  void unite(int a, int b) {
    a = find(a);
    b = find(b);
    if (a != b) parent[static_cast<size_t>(std::max(a, b))] = std::min(a, b);
  }
};

// The rounds: round r holds the r-th group of every lane that has one. Where lanes are
// uneven, the last rounds have fewer lanes. (Measured on Kimi-K2, docs/group-order.md:
// this beats spreading a short lane's gaps over the rounds, where every round then had
// two cohorts on one lane: 2.17 s against 2.2-3.5 s.)
std::vector<std::vector<int>> make_rounds(const std::vector<std::vector<int>>& lanes) {
  size_t R = 0;
  for (const auto& lane : lanes) R = std::max(R, lane.size());
  std::vector<std::vector<int>> rounds(R);
  for (const auto& lane : lanes)
    for (size_t r = 0; r < lane.size(); ++r) rounds[r].push_back(lane[r]);
  return rounds;
}

// Consumer c's order: round by round, the round's groups (one per lane it has) starting
// at the cohort's place among them and going round, the place moving on by one each
// round (where a round has fewer lanes than there are cohorts, the cohorts sharing a
// lane change from round to round); each group no producer serves after the group before
// it in layer order.
std::vector<int> consumer_order(const GroupOrder& o, int G, int cohort) {
  std::vector<int> served;
  const size_t K = o.lanes.size();
  for (size_t r = 0; r < o.rounds.size(); ++r) {
    const auto& round = o.rounds[r];
    const size_t m = round.size();
    // Where every lane is in the round, cohort j starts at lane j in every round.
    const size_t first = m == K ? static_cast<size_t>(cohort) : (static_cast<size_t>(cohort) + r) % m;
    for (size_t k = 0; k < m; ++k) served.push_back(round[(first + k) % m]);
  }
  std::vector<int> out;
  out.reserve(static_cast<size_t>(G));
  auto unserved_after = [&](int g) {
    for (int h = g + 1; h < G && o.lane_of_group[static_cast<size_t>(h)] < 0; ++h) out.push_back(h);
  };
  unserved_after(-1);
  for (int g : served) {
    out.push_back(g);
    unserved_after(g);
  }
  return out;
}

}  // namespace

std::vector<int> GroupOrder::lane_sizes() const {
  std::vector<int> out;
  for (const auto& lane : lanes) out.push_back(static_cast<int>(lane.size()));
  return out;
}

std::vector<int> GroupOrder::round_sizes() const {
  std::vector<int> out;
  for (const auto& round : rounds) out.push_back(static_cast<int>(round.size()));
  return out;
}

std::vector<int> GroupOrder::cohort_sizes() const {
  std::vector<int> out(static_cast<size_t>(std::max(1, num_lanes())), 0);
  for (int k : cohort) ++out[static_cast<size_t>(k)];
  return out;
}

std::string GroupOrder::summary() const {
  return fmt::format("{} lanes of {} groups, {} rounds of {} lanes, cohorts of {} consumers", num_lanes(),
                     fmt::join(lane_sizes(), "/"), rounds.size(), fmt::join(round_sizes(), "/"),
                     fmt::join(cohort_sizes(), "/"));
}

GroupOrder make_group_order(const Routes& routes, const GroupOrderOptions& options) {
  GroupOrder o;
  o.kind = options.kind;
  o.paced = options.kind == GroupOrderKind::kRotated && options.paced;
  const size_t P = routes.producers.size(), C = routes.consumer_plan.size();
  const int G = routes.num_groups();
  const size_t Gs = static_cast<size_t>(G);

  // Lanes: producers joined by serving one group; a group belongs to its producers' lane.
  UnionFind uf(P);
  std::vector<int> first(Gs, -1);  // per group: a producer serving it
  for (size_t g = 0; g < Gs; ++g) {
    for (size_t p = 0; p < P; ++p) {
      if (!serves(routes, p, g)) continue;
      if (first[g] < 0) {
        first[g] = static_cast<int>(p);
      } else {
        uf.unite(first[g], static_cast<int>(p));
      }
    }
  }
  // Under kLayer every served group is one lane: the layer order.
  std::unordered_map<int, int> lane_of_root;
  o.lane_of_group.assign(Gs, -1);
  for (size_t g = 0; g < Gs; ++g) {
    if (first[g] < 0) continue;
    const int root = options.kind == GroupOrderKind::kLayer ? 0 : uf.find(first[g]);
    auto [it, fresh] = lane_of_root.emplace(root, static_cast<int>(o.lanes.size()));
    if (fresh) o.lanes.emplace_back();
    o.lane_of_group[g] = it->second;
    o.lanes[static_cast<size_t>(it->second)].push_back(static_cast<int>(g));
  }
  o.lane_of_producer.assign(P, -1);
  o.producer.assign(P, {});
  for (size_t p = 0; p < P; ++p) {
    for (size_t g = 0; g < Gs; ++g) {
      if (!serves(routes, p, g)) continue;
      o.lane_of_producer[p] = o.lane_of_group[g];
      o.producer[p].push_back(static_cast<int>(g));  // layer order, as the staging ring packs today
    }
  }

  // Cohorts. Per consumer, the bytes it reads from each producer over the sync (the same
  // for every consumer of a plan class); at every step a lane serves one cohort, so a
  // producer's load while it serves cohort j is about what j's consumers read from it.
  // Greedy, largest consumers first: each to the cohort whose busiest producer stays
  // least loaded, then the one with fewest consumers, then the fewest bytes, then the
  // lowest. Replicas of one rank (which read one holder) and EP ranks whose experts one
  // trainer rank holds land in different cohorts while there are cohorts to go round.
  const int K = o.num_lanes();
  o.cohort.assign(C, 0);
  if (K > 1) {
    std::vector<std::vector<std::pair<int, uint64_t>>> by_plan(routes.plans.size());
    std::vector<uint64_t> plan_bytes(routes.plans.size(), 0);
    for (size_t k = 0; k < routes.plans.size(); ++k) {
      std::unordered_map<int, uint64_t> from;
      for (const PlanGroup& pg : routes.plans[k].groups)
        for (const Read& r : pg.reads) from[static_cast<int>(r.producer)] += r.length;
      for (const auto& [p, b] : from) {
        by_plan[k].emplace_back(p, b);
        plan_bytes[k] += b;
      }
      std::sort(by_plan[k].begin(), by_plan[k].end());
    }
    std::vector<size_t> todo(C);
    std::iota(todo.begin(), todo.end(), size_t{0});
    std::stable_sort(todo.begin(), todo.end(), [&](size_t a, size_t b) {
      return plan_bytes[routes.consumer_plan[a]] > plan_bytes[routes.consumer_plan[b]];
    });
    std::vector<std::unordered_map<int, uint64_t>> load(static_cast<size_t>(K));
    std::vector<uint64_t> peak(static_cast<size_t>(K), 0), bytes(static_cast<size_t>(K), 0);
    std::vector<size_t> members(static_cast<size_t>(K), 0);
    std::map<int, int> cohort_of_relay;  // relay group -> its cohort, once its first consumer has one
    auto relay_group = [&](size_t c) {
      return c < options.relay_group.size() ? options.relay_group[c] : -1;
    };
    for (size_t c : todo) {
      if (auto it = cohort_of_relay.find(relay_group(c)); it != cohort_of_relay.end()) {
        o.cohort[c] = it->second;  // (reads nothing from the producers while its relay lives)
        continue;
      }
      const auto& mine = by_plan[routes.consumer_plan[c]];
      size_t best = 0;
      uint64_t best_peak = 0;
      for (size_t j = 0; j < static_cast<size_t>(K); ++j) {
        uint64_t after = peak[j];
        for (const auto& [p, b] : mine) {
          auto it = load[j].find(p);
          after = std::max(after, (it == load[j].end() ? 0 : it->second) + b);
        }
        const auto key = std::make_tuple(after, members[j], bytes[j]);
        if (j == 0 || key < std::make_tuple(best_peak, members[best], bytes[best])) {
          best = j;
          best_peak = after;
        }
      }
      for (const auto& [p, b] : mine) load[best][p] += b;
      peak[best] = best_peak;
      bytes[best] += plan_bytes[routes.consumer_plan[c]];
      ++members[best];
      o.cohort[c] = static_cast<int>(best);
      if (relay_group(c) >= 0) cohort_of_relay[relay_group(c)] = static_cast<int>(best);
    }
  }
  o.rounds = make_rounds(o.lanes);
  o.consumer.resize(C);
  o.step.assign(C, std::vector<int>(Gs, -1));
  for (size_t c = 0; c < C; ++c) {
    o.consumer[c] = consumer_order(o, G, o.cohort[c]);
    // Steps count served groups only, so that every consumer's round r covers the same
    // steps; a group nobody serves shares the step of the one it follows (step 0 before
    // the first served one: a model whose first group only post-processes).
    int k = -1;
    for (int g : o.consumer[c]) {
      if (o.lane_of_group[static_cast<size_t>(g)] >= 0) ++k;
      o.step[c][static_cast<size_t>(g)] = std::max(k, 0);
    }
  }
  return o;
}

Status check_group_order(const Routes& routes, const GroupOrder& order) {
  const size_t P = routes.producers.size(), C = routes.consumer_plan.size();
  const int G = routes.num_groups();
  if (order.consumer.size() != C || order.producer.size() != P || order.lane_of_group.size() != static_cast<size_t>(G))
    return internal_error("group order: {} consumers, {} producers, {} groups against routes of {}, {}, {}",
                          order.consumer.size(), order.producer.size(), order.lane_of_group.size(), C, P, G);
  // Round of each served group; each lane's groups in rounds in layer order, one a round.
  std::vector<int> round(static_cast<size_t>(G), -1);
  for (size_t r = 0; r < order.rounds.size(); ++r) {
    std::vector<char> lane_seen(order.lanes.size(), 0);
    for (int g : order.rounds[r]) {
      const int s = g >= 0 && g < G ? order.lane_of_group[static_cast<size_t>(g)] : -1;
      if (s < 0 || round[static_cast<size_t>(g)] >= 0 || lane_seen[static_cast<size_t>(s)])
        return internal_error("group order: round {} holds group {} (not served, twice, or its lane's second)", r,
                              g);
      lane_seen[static_cast<size_t>(s)] = 1;
      round[static_cast<size_t>(g)] = static_cast<int>(r);
    }
  }
  for (size_t s = 0; s < order.lanes.size(); ++s) {
    for (size_t i = 0; i < order.lanes[s].size(); ++i) {
      const int r = round[static_cast<size_t>(order.lanes[s][i])];
      if (r < 0 || (i > 0 && r <= round[static_cast<size_t>(order.lanes[s][i - 1])]))
        return internal_error("group order: lane {}'s group {} is in no round, or not after the lane's group before", s,
                              order.lanes[s][i]);
    }
  }
  // Each producer packs the groups it serves, each once, in layer order.
  for (size_t p = 0; p < P; ++p) {
    std::vector<int> expect;
    for (int g = 0; g < G; ++g)
      if (serves(routes, p, static_cast<size_t>(g))) expect.push_back(g);
    if (order.producer[p] != expect)
      return internal_error("group order: producer {} packs {} groups, not the {} it serves in layer order", p,
                            order.producer[p].size(), expect.size());
  }
  for (size_t c = 0; c < C; ++c) {
    const auto& o = order.consumer[c];
    std::vector<char> seen(static_cast<size_t>(G), 0);
    for (int g : o) {
      if (g < 0 || g >= G || seen[static_cast<size_t>(g)])
        return internal_error("group order: consumer {} reads group {} twice or out of {} groups", c, g, G);
      seen[static_cast<size_t>(g)] = 1;
    }
    if (o.size() != static_cast<size_t>(G))
      return internal_error("group order: consumer {} reads {} of {} groups", c, o.size(), G);
    if (order.step.size() != C || order.step[c].size() != static_cast<size_t>(G))
      return internal_error("group order: no step table for consumer {}", c);
    // Steps: served groups numbered in order, the same rounds at the same steps for all.
    int k = 0;
    for (int g : o) {
      if (round[static_cast<size_t>(g)] < 0) continue;
      if (order.step[c][static_cast<size_t>(g)] != k)
        return internal_error("group order: consumer {} reads group {} at step {}, its step table says {}", c, g, k,
                              order.step[c][static_cast<size_t>(g)]);
      ++k;
    }
    // Rounds never go back; per producer, its groups in its pack order.
    int last_round = 0;
    std::vector<int> last_of(P, -1);
    for (int g : o) {
      const int r = round[static_cast<size_t>(g)];
      if (r < 0) continue;
      if (r < last_round)
        return internal_error("group order: consumer {} reads group {} (round {}) after a group of round {}", c, g, r,
                              last_round);
      last_round = r;
      for (const Read& rd : routes.consumer(c).groups[static_cast<size_t>(g)].reads) {
        int& last = last_of[rd.producer];
        if (last > g)
          return internal_error("group order: consumer {} reads group {} of producer {} after its group {}", c, g,
                                rd.producer, last);
        last = g;
      }
    }
  }
  return Status::Ok();
}

std::vector<OrderStep> order_steps(const Routes& routes, const GroupOrder& order) {
  const size_t C = order.consumer.size();
  size_t steps = 0;
  for (const auto& o : order.consumer) steps = std::max(steps, o.size());
  std::vector<OrderStep> out(steps);
  std::vector<uint64_t> prod(routes.producers.size(), 0);
  for (size_t k = 0; k < steps; ++k) {
    std::fill(prod.begin(), prod.end(), 0);
    for (size_t c = 0; c < C; ++c) {
      if (k >= order.consumer[c].size()) continue;
      const PlanGroup& pg = routes.consumer(c).groups[static_cast<size_t>(order.consumer[c][k])];
      uint64_t mine = 0;
      for (const Read& r : pg.reads) {
        prod[r.producer] += r.length;
        mine += r.length;
      }
      out[k].max_consumer_bytes = std::max(out[k].max_consumer_bytes, mine);
    }
    for (uint64_t b : prod) out[k].max_producer_bytes = std::max(out[k].max_producer_bytes, b);
  }
  return out;
}

}  // namespace ferry::engine
