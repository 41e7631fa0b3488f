#include "engine/memory.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>

#include <fmt/format.h>

#include "delta/patch.h"
#include "engine/protocol.h"
#include "engine/registered_buffer.h"
#include "ferry/source.h"

namespace ferry {

namespace engine {
namespace {

uint64_t heap(uint64_t n) { return heap_block_bytes(n); }

// Every overload declared before the templates use them (the types are ferry's, so
// argument-dependent lookup would not find later ones in this namespace).
uint64_t bytes_of(const ProducerGroup& g);
uint64_t bytes_of(const ProducerRoute& r);
uint64_t bytes_of(const PlanGroup& g);
uint64_t bytes_of(const PlanRoute& r);
uint64_t bytes_of(const Holdings& h);
uint64_t bytes_of(const ProducerGroupSchedule& g);
uint64_t bytes_of(const ConsumerGroupSchedule& g);
template <typename T>
uint64_t bytes_of(const std::vector<T>& v);

// Element counts (size), not capacities: what a rank built and what `ferry plan` predicts
// from the same content then agree exactly, however each vector grew.
uint64_t bytes_of(const std::string& s) { return s.size() > 15 ? heap(s.size() + 1) : 0; }
uint64_t bytes_of(const Shape& v) { return heap(v.size() * sizeof(int64_t)); }
uint64_t bytes_of(const Layout& l) { return bytes_of(l.shape) + bytes_of(l.strides); }
uint64_t bytes_of(const TensorDecl& d) { return bytes_of(d.name) + bytes_of(d.shape); }
uint64_t bytes_of(const Box& b) { return bytes_of(b.start) + bytes_of(b.size); }
uint64_t bytes_of(const HeldBox& b) { return bytes_of(b.box); }
uint64_t bytes_of(const PackOp& p) { return bytes_of(p.src); }
uint64_t bytes_of(const UnpackOp& u) { return bytes_of(u.dst); }
uint64_t bytes_of(const Copy& c) { return bytes_of(c.src) + bytes_of(c.dst); }
uint64_t bytes_of(const Zero& z) { return bytes_of(z.dst); }
template <typename T>
uint64_t bytes_of(const T&) requires std::is_trivially_copyable_v<T> { return 0; }

// A vector's block plus what its elements own.
template <typename T>
uint64_t bytes_of(const std::vector<T>& v) {
  uint64_t n = heap(v.size() * sizeof(T));
  for (const T& x : v) n += bytes_of(x);
  return n;
}
// A std::map / unordered_map node: key, value and three pointers (or a hash link).
template <typename M>
uint64_t map_bytes(const M& m) {
  uint64_t n = 0;
  for (const auto& [k, v] : m) n += heap(sizeof(k) + sizeof(v) + 32) + bytes_of(k) + bytes_of(v);
  return n;
}

uint64_t bytes_of(const ProducerGroup& g) { return bytes_of(g.segments) + bytes_of(g.packs); }
uint64_t bytes_of(const ProducerRoute& r) { return bytes_of(r.groups); }
uint64_t bytes_of(const PlanGroup& g) { return bytes_of(g.reads) + bytes_of(g.unpacks); }
uint64_t bytes_of(const PlanRoute& r) { return bytes_of(r.params) + bytes_of(r.groups); }
uint64_t bytes_of(const Holdings& h) { return bytes_of(h.tensors) + bytes_of(h.boxes); }
uint64_t bytes_of(const ProducerGroupSchedule& g) {
  uint64_t n = bytes_of(g.pack) + bytes_of(g.in_place) + map_bytes(g.served) + map_bytes(g.served_in_place);
  for (const auto& [cls, spans] : g.checksum_spans) n += heap(64) + bytes_of(spans);
  return n;
}
uint64_t bytes_of(const ConsumerGroupSchedule& g) {
  uint64_t n = bytes_of(g.reads) + map_bytes(g.received_from) + bytes_of(g.post_groups);
  for (const auto& [p, order] : g.checksum_order) n += heap(64) + bytes_of(order);
  return n;
}

uint64_t bytes_of(const Plan& p) {
  // Two name indexes (hash nodes holding a copy of the name) beside the vectors.
  uint64_t n = bytes_of(p.sources()) + bytes_of(p.params()) + bytes_of(p.copies()) + bytes_of(p.zeros());
  for (const auto* decls : {&p.sources(), &p.params()})
    for (const TensorDecl& d : *decls) n += heap(sizeof(std::string) + 16) + bytes_of(d.name) + 8;
  return n;
}

}  // namespace

uint64_t plan_heap_bytes(const Plan& plan) { return bytes_of(plan); }

// A group's ops as a rank holds them: made (their vector), or where elided in `routes`,
// what making them takes (the router reserves them exactly).
uint64_t ops_bytes(const ProducerGroup& g) {
  return g.elided_packs ? heap(g.elided_packs * sizeof(PackOp)) : bytes_of(g.packs);
}
uint64_t ops_bytes(const PlanGroup& g) {
  return g.elided_unpacks ? heap(g.elided_unpacks * sizeof(UnpackOp)) : bytes_of(g.unpacks);
}
uint64_t ops_bytes(const ProducerRoute& r) {
  uint64_t n = 0;
  for (const ProducerGroup& g : r.groups) n += ops_bytes(g);
  return n;
}
uint64_t ops_bytes(const PlanRoute& r) {
  uint64_t n = 0;
  for (const PlanGroup& g : r.groups) n += ops_bytes(g);
  return n;
}
// The made ops of `routes` (what metadata_heap_bytes counted of them).
uint64_t made_ops_bytes(const Routes& routes) {
  uint64_t n = 0;
  for (const ProducerRoute& r : routes.producers)
    for (const ProducerGroup& g : r.groups) n += bytes_of(g.packs);
  for (const PlanRoute& r : routes.plans)
    for (const PlanGroup& g : r.groups) n += bytes_of(g.unpacks);
  return n;
}

uint64_t registered_bytes(uint64_t n) { return align_up(std::max<uint64_t>(n, 64), 4096); }

uint64_t delta_kept_bytes(const EngineOptions& options, const ProducerRoute& route, const StagingSlots& slots) {
  if (!options.delta) return 0;
  if (options.delta_block_bytes) return slots.slot_bytes * static_cast<uint64_t>(slots.slots);
  return kept_copy_bytes(route);
}

uint64_t delta_block_state_bytes(const EngineOptions& options, const ProducerRoute& route) {
  if (!options.delta || !options.delta_block_bytes) return 0;
  const uint64_t bb = options.delta_block_bytes;
  uint64_t n = heap(route.groups.size() * sizeof(std::vector<std::vector<uint64_t>>)), largest = 0;
  for (const ProducerGroup& g : route.groups) {
    n += heap(g.segments.size() * sizeof(std::vector<uint64_t>));
    for (const Segment& seg : g.segments) {
      n += heap((seg.bytes + bb - 1) / bb * sizeof(uint64_t));
      largest = std::max<uint64_t>(largest, seg.bytes);
    }
  }
  return n + heap(delta::max_block_patch_bytes(largest, bb));
}

Result<StagingSlots> staging_ring(int rank, uint64_t needed, uint64_t worst, uint64_t staging_budget) {
  worst = std::max(worst, needed);
  if (staging_budget == 0) return StagingSlots{worst, 2};
  if (staging_budget < needed)
    return invalid_argument(
        "producer {}: staging budget {} bytes is smaller than its largest group ({} bytes): give at least {} bytes "
        "(two slots, {} bytes, let packing overlap reads; {} bytes cover any failover)",
        rank, staging_budget, needed, needed, 2 * needed, 2 * worst);
  if (staging_budget >= worst)
    return StagingSlots{worst, static_cast<int>(std::min<uint64_t>(staging_budget / worst, 64))};
  const uint64_t slot = std::max(needed, staging_budget / 2 / 64 * 64);
  return StagingSlots{slot, static_cast<int>(std::min<uint64_t>(staging_budget / slot, 64))};
}

uint64_t metadata_heap_bytes(const Routes& routes, const std::vector<TensorDecl>& metadata,
                             const std::vector<Holdings>& holdings, const std::vector<const Plan*>& plans) {
  uint64_t n = bytes_of(routes.group_names) + bytes_of(routes.producers) + bytes_of(routes.plans) +
               bytes_of(routes.consumer_plan) + bytes_of(metadata) + bytes_of(holdings);
  for (const Plan* p : plans)
    if (p) n += bytes_of(*p);
  return n;
}

uint64_t schedule_heap_bytes(const ProducerSchedule& s) { return bytes_of(s.groups); }
uint64_t schedule_heap_bytes(const ConsumerSchedule& s) {
  return bytes_of(s.groups) + bytes_of(s.unpack) + s.order.capacity() * sizeof(int);
}
uint64_t predicted_schedule_bytes(const ProducerRoute& route) {
  uint64_t n = bytes_of(route);
  for (const ProducerGroup& g : route.groups)
    if (g.elided_packs) n += ops_bytes(g);
  return n;
}
uint64_t predicted_schedule_bytes(const PlanRoute& route) {
  uint64_t reads = 0, elided = 0;
  for (const PlanGroup& g : route.groups) {
    reads += g.reads.size();
    if (g.elided_unpacks) elided += ops_bytes(g);
  }
  return bytes_of(route) + elided + heap(reads * sizeof(SubRead));
}

RouterOptions producer_router_options(const EngineOptions& options, int rank) {
  RouterOptions r;
  r.convert_on = options.convert_on;
  r.quantize_on = options.quantize_on;
  r.packs_of = rank;
  r.unpacks_of = options.mode == SyncMode::kPush ? RouterOptions::kEveryRank : RouterOptions::kNoRank;
  return r;
}
Status check_routes_hold(const Routes& routes, const RouterOptions& options) {
  for (size_t p = 0; p < routes.producers.size(); ++p) {
    const bool asked = options.packs_of == RouterOptions::kEveryRank || options.packs_of == static_cast<int>(p);
    if (asked && !routes.has_packs(p)) return internal_error("routes lack producer {}'s packs", p);
  }
  const int own = options.unpacks_of >= 0 && static_cast<size_t>(options.unpacks_of) < routes.consumer_plan.size()
                      ? static_cast<int>(routes.consumer_plan[static_cast<size_t>(options.unpacks_of)])
                      : -1;
  for (size_t k = 0; k < routes.plans.size(); ++k) {
    const bool asked = options.unpacks_of == RouterOptions::kEveryRank || own == static_cast<int>(k);
    if (asked && !routes.has_unpacks(k)) return internal_error("routes lack plan class {}'s unpacks", k);
  }
  return Status::Ok();
}

RouterOptions consumer_router_options(const EngineOptions& options, int rank) {
  RouterOptions r;
  r.convert_on = options.convert_on;
  r.quantize_on = options.quantize_on;
  r.packs_of = RouterOptions::kEveryRank;
  r.unpacks_of = rank;
  return r;
}

uint64_t metadata_heap_bytes(const Routes& routes, const std::vector<TensorDecl>& metadata,
                             const std::vector<Holdings>& holdings, const std::vector<Plan>& plans) {
  std::vector<const Plan*> ptrs;
  for (const Plan& p : plans) ptrs.push_back(&p);
  return metadata_heap_bytes(routes, metadata, holdings, ptrs);
}

}  // namespace engine

std::string MemoryUse::to_string() const {
  auto mib = [](uint64_t b) { return static_cast<double>(b) / (1 << 20); };
  return fmt::format(
      "extra {:.1f} MiB (staging ring {:.1f}, receive ring {:.1f}, shadow {:.1f}, kept copy {:.1f}, metadata {:.2f}, "
      "transport allowance {:.0f}); registered in place {:.1f} MiB, own params {:.1f} MiB",
      mib(extra()), mib(staging_ring), mib(receive_ring), mib(shadow), mib(kept_copy), mib(metadata),
      mib(transport_allowance), mib(registered_in_place), mib(own_params));
}

namespace {

// CommitPolicy::kGroups: the bounded shadow of a consumer with `plan`, as the consumer lays
// it out (group_shadow_layout), its units the layer groups of the param names (a
// loader's post-processing groups: "pre", "layer N", "post"), in layer order, on the
// host. Which of the `num_groups` layer groups writes which param comes from the plan (a
// copy from a source of that group, `source_groups` the routes' groups), not from the
// routes' unpacks, which `ferry plan` does not make.
uint64_t group_shadow_bytes(const Plan& plan, const Groups& source_groups, size_t num_groups) {
  using namespace engine;
  const std::vector<TensorDecl>& params = plan.params();
  const Groups by_name(params);
  std::map<std::string, int> unit_of;
  for (size_t i = 0; i < params.size(); ++i) unit_of[params[i].name] = by_name.of_tensor(i);
  PlanRoute writes;
  writes.params = params;
  writes.groups.resize(num_groups);
  std::set<std::pair<int, uint32_t>> seen;
  for (const Copy& k : plan.copies()) {
    const int g = source_groups.of_name(plan.sources()[k.source].name);
    if (g < 0 || static_cast<size_t>(g) >= num_groups || !seen.insert({g, k.param}).second) continue;
    writes.groups[static_cast<size_t>(g)].unpacks.emplace_back().param = k.param;
  }
  const GroupShadow layout = group_shadow_layout(writes, nullptr, unit_of, {});
  return layout.host_bytes ? align_up(layout.host_bytes, 4096) : 0;
}

}  // namespace

Result<MemoryPrediction> predict_memory(const Routes& routes, const std::vector<TensorDecl>& metadata,
                                        const std::vector<Holdings>& holdings, const std::vector<const Plan*>& plans,
                                        const ProducerOptions& options, CommitPolicy commit) {
  using namespace engine;
  if (holdings.size() != routes.producers.size() || plans.size() != routes.consumer_plan.size())
    return invalid_argument("predict_memory: {} holdings and {} plans for routes of {} producers and {} consumers",
                            holdings.size(), plans.size(), routes.producers.size(), routes.consumer_plan.size());
  // What every rank keeps alike, counted once: the routes without any op (made or
  // elided in `routes`), then each rank's own ops as its router options keep them.
  const uint64_t common = metadata_heap_bytes(routes, metadata, holdings, plans) - made_ops_bytes(routes);
  uint64_t all_packs = 0, all_unpacks = 0;
  for (const ProducerRoute& r : routes.producers) all_packs += ops_bytes(r);
  for (const PlanRoute& r : routes.plans) all_unpacks += ops_bytes(r);
  const bool push = options.mode == SyncMode::kPush;
  MemoryPrediction out;
  const auto shared = options.failover ? shared_held_bytes(metadata, holdings) : std::vector<std::vector<uint64_t>>{};
  for (size_t p = 0; p < routes.producers.size(); ++p) {
    const int rank = static_cast<int>(p);
    const uint64_t needed = producer_slot_bytes(routes, rank, std::vector<uint64_t>{}, false);
    const uint64_t worst =
        options.failover ? producer_slot_bytes(routes, rank, shared[p], true) : needed;
    FERRY_ASSIGN_OR_RETURN(StagingSlots ring, staging_ring(rank, needed, worst, options.staging_budget));
    MemoryUse m;
    // The kept copy (or patch area) after the slots, in the same registration.
    m.kept_copy = delta_kept_bytes(options, routes.producers[p], ring);
    m.staging_ring = registered_bytes(ring.slot_bytes * static_cast<uint64_t>(ring.slots) + m.kept_copy) - m.kept_copy;
    m.kept_copy += delta_block_state_bytes(options, routes.producers[p]);
    m.metadata = common + ops_bytes(routes.producers[p]) + (push ? all_unpacks : 0) +
                 predicted_schedule_bytes(routes.producers[p]);
    out.producers.push_back(m);
  }
  // kGroups: the routes' layer groups, and each plan class's bounded shadow once.
  const std::optional<Groups> source_groups =
      commit == CommitPolicy::kGroups ? std::optional<Groups>(Groups(metadata)) : std::nullopt;
  std::vector<std::optional<uint64_t>> groups_shadow(routes.plans.size());
  std::vector<uint64_t> per_class;  // plan classes share a route: one walk each
  for (const PlanRoute& pr : routes.plans) per_class.push_back(predicted_schedule_bytes(pr));
  for (size_t c = 0; c < routes.consumer_plan.size(); ++c) {
    const PlanRoute& pr = routes.consumer(c);
    MemoryUse m;
    m.receive_ring = registered_bytes(consumer_slot_bytes(pr) * kReceiveSlots);
    m.metadata = common + all_packs + ops_bytes(pr) + per_class[routes.consumer_plan[c]];
    if (commit == CommitPolicy::kShadow && plans[c]) {
      // ParamSet's shadow arena: every param as the routes deliver it (producer-quantised
      // ones e4m3, plus their scales), 64-byte aligned, rounded to a page.
      uint64_t shadow = 0;
      for (const auto& d : pr.params) shadow += align_up(shape_numel(d.shape) * dtype_size(d.dtype), 64);
      m.shadow = align_up(shadow, 4096);
    } else if (commit == CommitPolicy::kGroups && plans[c]) {
      const uint32_t k = routes.consumer_plan[c];  // (its consumers' plans are equal)
      if (!groups_shadow[k]) groups_shadow[k] = group_shadow_bytes(*plans[c], *source_groups, pr.groups.size());
      m.shadow = *groups_shadow[k];
    }
    out.consumers.push_back(m);
  }
  return out;
}

}  // namespace ferry
