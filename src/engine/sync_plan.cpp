#include "engine/sync_plan.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

namespace ferry::engine {

uint64_t ConsumerAttemptPlan::transfers() const {
  uint64_t n = 0;
  for (const ConsumerGroupPlan& g : groups) {
    for (const auto* by : {&g.staged, &g.to_slot, &g.to_params})
      for (const auto& [p, ts] : *by) n += ts.size();
  }
  return n;
}

ConsumerAttemptPlan make_consumer_attempt_plan(int rank, const ConsumerSchedule& schedule, const Lane* ipc,
                                               const PlanRoute* route, const Lane* relay) {
  ConsumerAttemptPlan plan;
  // CUDA IPC this attempt: only when every producer read from is mapped and serves this
  // consumer nothing in place or into params (all of a group lands in one receive ring,
  // the device one).
  bool all = ipc != nullptr, any = false;
  std::set<int> unmapped;
  for (const ConsumerGroupSchedule& gs : schedule.groups) {
    for (const SubRead& sr : gs.reads) {
      any = true;
      const int p = static_cast<int>(sr.producer);
      if (!ipc || !ipc->viable(p) || sr.region >= 0 || sr.param) all = false;
      if (ipc && !ipc->why_not(p).empty()) unmapped.insert(p);
    }
  }
  plan.cuda_ipc = all && any;
  for (int p : unmapped) {
    plan.notes.push_back(fmt::format("consumer {}: producer {}'s GPU staging is not mapped here ({}); read through "
                                     "the transport", rank, p, ipc->why_not(p)));
  }
  const LaneKind staged_lane = plan.cuda_ipc ? LaneKind::kCudaIpc : LaneKind::kTransport;
  plan.groups.resize(schedule.groups.size());
  for (size_t g = 0; g < schedule.groups.size(); ++g) {
    const ConsumerGroupSchedule& gs = schedule.groups[g];
    ConsumerGroupPlan& gp = plan.groups[g];
    for (const auto& [p, bytes] : gs.received_from) gp.from.push_back(p);
    for (const SubRead& sr : gs.reads) {
      const int p = static_cast<int>(sr.producer);
      if (sr.region < 0) {
        gp.staged[p].push_back(Transfer{staged_lane, static_cast<int>(g), p, &sr});
      } else {
        auto& to = sr.param ? gp.to_params : gp.to_slot;
        to[p].push_back(Transfer{LaneKind::kTransport, static_cast<int>(g), p, &sr});
      }
    }
    if (!route || gp.from.empty()) continue;
    const PlanGroup& pg = route->groups[g];
    if (relay && !plan.cuda_ipc) {
      gp.relayed = std::make_unique<PlannedRead>();
      gp.relayed->read = SubRead{0, 0, pg.recv_bytes, nullptr, 0, -1, 0, 0};
      gp.relayed->transfer = Transfer{LaneKind::kRelay, static_cast<int>(g), -1, &gp.relayed->read};
    }
    for (int p : gp.from) {
      const Read* r = single_read_from(pg, static_cast<uint32_t>(p));
      if (!r) continue;
      auto pr = std::make_unique<PlannedRead>();
      pr->read = SubRead{static_cast<uint32_t>(r - pg.reads.data()), r->recv_offset, r->length, nullptr, 0, -1,
                         r->offset, static_cast<uint32_t>(p)};
      pr->transfer = Transfer{LaneKind::kTransport, static_cast<int>(g), p, &pr->read};
      gp.patch[p] = std::move(pr);
    }
  }
  return plan;
}

std::vector<const Transfer*> read_ahead(const ConsumerAttemptPlan& plan, int p, int group) {
  std::vector<const Transfer*> out;
  for (size_t g = static_cast<size_t>(std::max(group, 0)); g < plan.groups.size(); ++g) {
    auto it = plan.groups[g].to_params.find(p);
    if (it == plan.groups[g].to_params.end()) continue;
    for (const Transfer& t : it->second) out.push_back(&t);
  }
  return out;
}

const std::vector<PushWrite>& ProducerAttemptPlan::writes_of(int c, int g) const {
  static const std::vector<PushWrite> kNone;
  auto it = writes.find(c);
  if (it == writes.end() || !it->second.by_group || g < 0 || static_cast<size_t>(g) >= it->second.by_group->size())
    return kNone;
  return (*it->second.by_group)[static_cast<size_t>(g)];
}

uint64_t ProducerAttemptPlan::heap_bytes() const {
  uint64_t n = groups.capacity() * sizeof(ProducerGroupPlan);
  for (const ProducerGroupPlan& g : groups) n += g.targets.capacity() * sizeof(int);
  for (const auto& [c, w] : writes) {
    if (!w.by_group) continue;
    n += w.by_group->capacity() * sizeof((*w.by_group)[0]);
    for (const auto& g : *w.by_group) n += g.capacity() * sizeof(PushWrite);
  }
  return n;
}

ProducerAttemptPlan make_producer_attempt_plan(const ProducerPlanInputs& in) {
  ProducerAttemptPlan plan;
  plan.routes_hash = in.routes_hash;
  const Routes& routes = *in.routes;
  plan.groups.resize(in.schedule->groups.size());
  for (size_t g = 0; g < in.schedule->groups.size(); ++g) {
    const ProducerGroupSchedule& gs = in.schedule->groups[g];
    for (size_t c = 0; c < in.members.size(); ++c) {
      if (in.members[c] && gs.served.count(routes.consumer_plan[c])) plan.groups[g].targets.push_back(static_cast<int>(c));
    }
  }
  if (!in.push) return plan;
  static const InPlaceTable kStaged;
  for (size_t c = 0; c < in.members.size(); ++c) {
    if (!in.members[c] || c >= in.tables.size() || !in.tables[c]) continue;
    const int ci = static_cast<int>(c);
    const std::string& instance = c < in.instances.size() ? in.instances[c] : std::string();
    if (in.previous && in.previous->routes_hash == in.routes_hash) {
      auto it = in.previous->writes.find(ci);
      if (it != in.previous->writes.end() && it->second.instance == instance && it->second.by_group) {
        plan.writes[ci] = it->second;
        continue;
      }
    }
    plan.writes[ci] = ProducerAttemptPlan::Writes{
        instance, std::make_shared<const std::vector<std::vector<PushWrite>>>(push_writes(
                      routes, in.rank, ci, *in.tables[c], *in.holdings, in.in_place ? *in.in_place : kStaged))};
  }
  return plan;
}

}  // namespace ferry::engine
