#include "engine/schedule.h"

#include <algorithm>
#include <set>
#include <unordered_map>

#include <xxhash.h>

#include "engine/registered_buffer.h"

namespace ferry::engine {

uint64_t slot_bytes_for(uint64_t largest) { return align_up(std::max<uint64_t>(largest, 64), 64); }

uint64_t consumer_slot_bytes(const PlanRoute& plan_route) {
  uint64_t largest = 0;
  for (const auto& g : plan_route.groups) largest = std::max(largest, g.recv_bytes);
  return slot_bytes_for(largest);
}

std::vector<std::vector<uint64_t>> shared_held_bytes(const std::vector<TensorDecl>& metadata,
                                                     const std::vector<Holdings>& holdings) {
  const Groups groups(metadata);
  // One index of every producer's boxes by tensor name, so each box is checked against
  // the other holders of its tensor only (Kimi-K2: 256 producers, ~350k boxes).
  struct Held {
    size_t producer;
    const HeldBox* box;
    const TensorDecl* decl;
  };
  std::unordered_map<std::string_view, std::vector<Held>> by_name;
  for (size_t q = 0; q < holdings.size(); ++q)
    for (const HeldBox& b : holdings[q].boxes) {
      const TensorDecl& d = holdings[q].tensors[b.tensor];
      by_name[d.name].push_back(Held{q, &b, &d});
    }
  std::vector<std::vector<uint64_t>> out(holdings.size(), std::vector<uint64_t>(static_cast<size_t>(groups.size()), 0));
  for (auto& [name, held] : by_name) {
    // Within one tensor, boxes are sorted by their start on one dim (the one on which
    // they are narrowest relative to the tensor: dim 0 for FSDP slabs, dim 1 for
    // row-parallel slices) and each box is checked only against those whose start on
    // that dim lies within the widest box's extent before it: what made this quadratic
    // in the ranks (fsdp=N: N boxes of every tensor, each checked against every other).
    const size_t nd = held.front().box->box.start.size();
    size_t key = 0;
    int64_t widest = 0;
    bool keyed = false;
    double best = 2;
    const bool uniform = std::all_of(held.begin(), held.end(), [&](const Held& h) {
      return h.box->box.start.size() == nd && h.box->box.size.size() == nd && h.decl->shape.size() == nd;
    });
    for (size_t k = 0; uniform && k < nd; ++k) {
      int64_t w = 0, extent = 1;
      for (const Held& h : held) {
        w = std::max(w, h.box->box.size[k]);
        extent = std::max(extent, h.decl->shape[k]);
      }
      const double narrowness = static_cast<double>(w) / static_cast<double>(extent);
      if (narrowness < best) {
        best = narrowness;
        key = k;
        widest = w;
        keyed = true;
      }
    }
    auto start_of = [&](const Held& h) { return h.box->box.start[key]; };
    if (keyed) {
      std::stable_sort(held.begin(), held.end(),
                       [&](const Held& a, const Held& b) { return start_of(a) < start_of(b); });
    }
    for (const Held& h : held) {
      auto first = held.begin(), last = held.end();
      if (keyed) {
        const int64_t lo = start_of(h) - widest + 1, hi = start_of(h) + h.box->box.size[key];
        first = std::lower_bound(held.begin(), held.end(), lo,
                                 [&](const Held& x, int64_t v) { return start_of(x) < v; });
        last = std::lower_bound(first, held.end(), hi, [&](const Held& x, int64_t v) { return start_of(x) < v; });
      }
      for (auto it = first; it != last; ++it) {
        if (it->producer != h.producer && it->box->box.intersects(h.box->box)) {
          out[h.producer][static_cast<size_t>(groups.of_name(h.decl->name))] +=
              static_cast<uint64_t>(h.box->box.numel()) * dtype_size(h.decl->dtype);
          break;
        }
      }
    }
  }
  return out;
}

uint64_t producer_slot_bytes(const Routes& routes, int rank, const std::vector<uint64_t>& shared, bool failover) {
  const auto me = static_cast<size_t>(rank);
  uint64_t largest = 0;
  for (const auto& grp : routes.producers[me].groups) largest = std::max(largest, grp.staging_bytes);
  if (!failover) return slot_bytes_for(largest);
  // After a failover only boxes another producer also holds can move to this one: what
  // it alone holds is in its staging already, under any routes. So a group's worst case
  // is its staging now plus every plan class reading all of its shared boxes of the
  // group (one more aligned segment each). Sizing every held byte that way (as before)
  // made a tp=2 trainer whose ranks share only their replicated norms stage 4 classes x
  // its whole largest group: 3.9 GiB instead of 1 GiB for Llama-3.1-8B -> tp=4.
  const uint64_t classes = routes.plans.size();
  const auto& mine = routes.producers[me].groups;
  for (size_t g = 0; g < shared.size() && g < mine.size(); ++g) {
    if (shared[g]) largest = std::max(largest, mine[g].staging_bytes + classes * (shared[g] + 64));
  }
  return slot_bytes_for(largest);
}

uint64_t producer_slot_bytes(const Routes& routes, int rank, const std::vector<TensorDecl>& metadata,
                             const std::vector<Holdings>& holdings, bool failover) {
  if (!failover) return producer_slot_bytes(routes, rank, std::vector<uint64_t>{}, false);
  return producer_slot_bytes(routes, rank, shared_held_bytes(metadata, holdings)[static_cast<size_t>(rank)], true);
}

// ---------------------------------------------------------------------------------------

SegmentHash::SegmentHash() : state_(XXH64_createState()) { XXH64_reset(static_cast<XXH64_state_t*>(state_), 0); }
SegmentHash::~SegmentHash() { XXH64_freeState(static_cast<XXH64_state_t*>(state_)); }
void SegmentHash::update(const std::byte* data, uint64_t bytes) {
  if (bytes) XXH64_update(static_cast<XXH64_state_t*>(state_), data, bytes);
}
uint64_t SegmentHash::digest() const { return XXH64_digest(static_cast<const XXH64_state_t*>(state_)); }

// ---------------------------------------------------------------------------------------

Result<ProducerSchedule> make_producer_schedule(const Routes& routes, int rank, const Holdings& holdings,
                                                const InPlaceTable& in_place, uint64_t slot_bytes) {
  const ProducerRoute& pr = routes.producers[static_cast<size_t>(rank)];
  ProducerSchedule out;
  out.groups.resize(static_cast<size_t>(routes.num_groups()));
  for (int g = 0; g < routes.num_groups(); ++g) {
    const ProducerGroup& grp = pr.groups[static_cast<size_t>(g)];
    ProducerGroupSchedule& s = out.groups[static_cast<size_t>(g)];
    if (slot_bytes && grp.staging_bytes > slot_bytes)
      return failed_precondition("producer {}: group {} needs {} staging bytes after failover, the ring has {}", rank, g,
                                 grp.staging_bytes, slot_bytes);
    s.pack = grp;
    for (const Segment& x : grp.segments) {
      if (x.bytes) s.served[x.plan] += x.bytes;
    }
    s.in_place = in_place_pieces(grp, holdings, in_place);
    if (!s.in_place.empty()) {
      std::set<uint64_t> at;
      for (const InPlacePiece& x : s.in_place) {
        at.insert(x.offset);
        for (const Segment& sg : grp.segments) {
          if (x.offset >= sg.offset && x.offset + x.bytes <= sg.offset + sg.bytes) s.served_in_place[sg.plan] += x.bytes;
        }
      }
      std::erase_if(s.pack.packs, [&](const PackOp& op) { return at.count(op.offset) && op.src.numel() > 0; });
    }
    // Checksum spans: each segment in staging order, its in-place runs from the source.
    for (const Segment& sg : grp.segments) {
      auto& spans = s.checksum_spans[sg.plan];
      uint64_t at = sg.offset;
      const uint64_t end = sg.offset + sg.bytes;
      auto it = std::lower_bound(s.in_place.begin(), s.in_place.end(), at,
                                 [](const InPlacePiece& x, uint64_t v) { return x.offset < v; });
      for (; it != s.in_place.end() && it->offset + it->bytes <= end; ++it) {
        if (it->offset > at) spans.push_back(SegmentSpan{-1, at, it->offset - at});
        spans.push_back(SegmentSpan{it->region, it->region_offset, it->bytes});
        at = it->offset + it->bytes;
      }
      if (end > at) spans.push_back(SegmentSpan{-1, at, end - at});
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------

namespace {

// A byte copy into a registered param, alone on its receive bytes: read straight there.
struct DirectRun {
  uint64_t offset, bytes;  // receive bytes
  const ParamTable::Param* param;
  uint64_t param_offset;
};
struct DirectUnpacks {
  std::vector<DirectRun> runs;  // sorted by offset
  std::vector<bool> is_direct;  // per PlanGroup::unpacks
};

// The unpacks of `pg` that are plain byte copies (same dtype, contiguous destination in
// a registered param, at least direct_min_bytes, not sharing bytes with another unpack,
// inside one read): those land in the param directly (read there in pull, written there
// in push).
DirectUnpacks find_direct_unpacks(const PlanGroup& pg, const PlanRoute& plan_route, const ConsumerScheduleInputs& in) {
  DirectUnpacks out;
  out.is_direct.assign(pg.unpacks.size(), false);
  if (!in.params) return out;
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // every unpack's recv bytes
  for (const UnpackOp& u : pg.unpacks)
    spans.emplace_back(u.offset, u.offset + static_cast<uint64_t>(u.dst.numel()) * dtype_size(u.src_dtype));
  // shared[k]: another unpack reads some of op k's bytes (one sweep in offset order:
  // an op overlaps an earlier one iff it starts below the earlier ends' maximum).
  std::vector<bool> shared(spans.size(), false);
  {
    std::vector<size_t> order;
    for (size_t k = 0; k < spans.size(); ++k)
      if (spans[k].second > spans[k].first) order.push_back(k);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a] < spans[b]; });
    uint64_t max_hi = 0;
    size_t max_at = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      const size_t k = order[i];
      if (i > 0 && spans[k].first < max_hi) shared[k] = shared[max_at] = true;
      if (spans[k].second > max_hi) {
        max_hi = spans[k].second;
        max_at = k;
      }
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> reads;  // recv bytes of each read
  for (const Read& r : pg.reads)
    if (r.length) reads.emplace_back(r.recv_offset, r.recv_offset + r.length);
  std::sort(reads.begin(), reads.end());
  auto in_one_read = [&](uint64_t lo, uint64_t hi) {
    auto it = std::upper_bound(reads.begin(), reads.end(), std::make_pair(lo, UINT64_MAX));
    return it != reads.begin() && std::prev(it)->first <= lo && hi <= std::prev(it)->second;
  };
  for (size_t k = 0; k < pg.unpacks.size(); ++k) {
    const UnpackOp& u = pg.unpacks[k];
    const TensorDecl& d = plan_route.params[u.param];
    const auto [lo, hi] = spans[k];
    if (u.src_dtype != d.dtype || !u.dst.is_contiguous() || hi - lo < in.direct_min_bytes || hi == lo) continue;
    auto it = in.params->find(d.name);
    if (it == in.params->end()) continue;
    const uint64_t at = static_cast<uint64_t>(u.dst.offset) * dtype_size(d.dtype);
    if (u.dst.offset < 0 || at + (hi - lo) > it->second.bytes || shared[k] || !in_one_read(lo, hi)) continue;
    out.runs.push_back(DirectRun{lo, hi - lo, &it->second, at});
    out.is_direct[k] = true;
  }
  std::sort(out.runs.begin(), out.runs.end(), [](const DirectRun& a, const DirectRun& b) { return a.offset < b.offset; });
  return out;
}

// In-place runs of each producer of group `g` (staging coordinates, sorted): only of
// producers whose table is usable.
std::map<uint32_t, std::vector<InPlacePiece>> in_place_runs(const PlanGroup& pg, size_t g,
                                                            const ConsumerScheduleInputs& in) {
  std::map<uint32_t, std::vector<InPlacePiece>> remote;
  for (const Read& r : pg.reads) {
    if (!r.length || remote.count(r.producer) || r.producer >= in.in_place.size()) continue;
    const InPlaceTable* table = in.in_place[r.producer];
    if (!table || table->empty()) continue;
    remote[r.producer] = in_place_pieces(in.routes->producers[r.producer].groups[g], (*in.holdings)[r.producer], *table);
  }
  return remote;
}

// Cuts each read of `pg` where the local side (param / ring) or the remote side (source
// region / staging) changes, merging pieces that continue each other on every side.
void cut_reads(const PlanGroup& pg, const std::vector<DirectRun>& direct,
               const std::map<uint32_t, std::vector<InPlacePiece>>& remote, std::vector<SubRead>& out) {
  auto emit = [&](const SubRead& x) {
    if (!x.length) return;
    if (!out.empty()) {  // merge with the previous piece when every side continues it
      SubRead& b = out.back();
      if (b.read == x.read && b.recv_offset + b.length == x.recv_offset && b.param == x.param &&
          (!x.param || b.param_offset + b.length == x.param_offset) && b.region == x.region &&
          b.remote + b.length == x.remote) {
        b.length += x.length;
        return;
      }
    }
    out.push_back(x);
  };
  for (size_t i = 0; i < pg.reads.size(); ++i) {
    const Read& r = pg.reads[i];
    if (!r.length) continue;
    const uint64_t lo = r.recv_offset, hi = r.recv_offset + r.length;
    // Cut the read where the local side (param / ring) or the remote side (source
    // region / staging) changes; in recv coordinates.
    std::vector<uint64_t> cuts{lo, hi};
    auto first_local = std::lower_bound(direct.begin(), direct.end(), lo,
                                        [](const DirectRun& d, uint64_t v) { return d.offset < v; });
    for (auto it = first_local; it != direct.end() && it->offset + it->bytes <= hi; ++it) {
      cuts.push_back(it->offset);
      cuts.push_back(it->offset + it->bytes);
    }
    std::vector<InPlacePiece> runs;  // this read's in-place runs, in recv coordinates
    if (auto rit = remote.find(r.producer); rit != remote.end()) {
      for (const InPlacePiece& x : rit->second) {
        if (x.offset < r.offset || x.offset + x.bytes > r.offset + r.length) continue;
        InPlacePiece y = x;
        y.offset = lo + (x.offset - r.offset);
        runs.push_back(y);
        cuts.push_back(y.offset);
        cuts.push_back(y.offset + y.bytes);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    auto local = first_local;
    auto run = runs.begin();
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const uint64_t a = cuts[k], b = cuts[k + 1];
      while (local != direct.end() && local->offset + local->bytes <= a) ++local;
      while (run != runs.end() && run->offset + run->bytes <= a) ++run;
      SubRead x{static_cast<uint32_t>(i), a, b - a, nullptr, 0, -1, r.offset + (a - lo), r.producer};
      if (local != direct.end() && local->offset <= a && a < local->offset + local->bytes) {
        x.param = local->param;
        x.param_offset = local->param_offset + (a - local->offset);
      }
      if (run != runs.end() && run->offset <= a && a < run->offset + run->bytes) {
        x.region = run->region;
        x.remote = run->region_offset + (a - run->offset);
      }
      emit(x);
    }
  }
}

// What the group moves, and per producer the order its checksum covers.
void summarize(const PlanGroup& pg, ConsumerGroupSchedule& cg) {
  for (const Read& r : pg.reads) {
    if (!r.length) continue;
    cg.received += r.length;
    cg.received_from[static_cast<int>(r.producer)] += r.length;
  }
  std::map<int, std::vector<std::pair<uint64_t, uint32_t>>> by_staging;  // producer -> (staging offset, sub-read)
  for (size_t k = 0; k < cg.reads.size(); ++k) {
    const SubRead& sr = cg.reads[k];
    if (sr.param) cg.direct += sr.length;
    const Read& r = pg.reads[sr.read];
    by_staging[static_cast<int>(r.producer)].emplace_back(r.offset + (sr.recv_offset - r.recv_offset),
                                                          static_cast<uint32_t>(k));
  }
  for (auto& [p, v] : by_staging) {
    std::sort(v.begin(), v.end());
    auto& order = cg.checksum_order[p];
    for (const auto& e : v) order.push_back(e.second);
  }
}

// Post-processing: a group runs after the last layer group that writes one of its params.
void place_post_groups(const PlanRoute& plan_route, const ConsumerScheduleInputs& in, ConsumerSchedule& out) {
  if (!in.num_post_groups) return;
  // Positions in the consumer's order (layer order without one).
  const size_t G = plan_route.groups.size();
  std::vector<int> at(G), group_at(G);
  for (size_t g = 0; g < G; ++g) at[g] = group_at[g] = static_cast<int>(g);
  if (in.order && in.order->size() == G) {
    for (size_t i = 0; i < G; ++i) {
      const int g = (*in.order)[i];
      if (g >= 0 && static_cast<size_t>(g) < G) {
        at[static_cast<size_t>(g)] = static_cast<int>(i);
        group_at[i] = g;
      }
    }
  }
  std::map<std::string, int> last_group;  // param -> the last position writing it
  for (size_t g = 0; g < G; ++g) {
    for (const UnpackOp& u : plan_route.groups[g].unpacks) {
      int& last = last_group.try_emplace(plan_route.params[u.param].name, 0).first->second;
      last = std::max(last, at[g]);
    }
  }
  std::vector<int> ready_at(in.num_post_groups, 0);
  for (const auto& [name, k] : in.post_group_of) {
    auto it = last_group.find(name);
    if (it != last_group.end() && k >= 0 && static_cast<size_t>(k) < ready_at.size())
      ready_at[static_cast<size_t>(k)] = std::max(ready_at[static_cast<size_t>(k)], it->second);
  }
  for (size_t k = 0; k < ready_at.size(); ++k) {
    const auto i = static_cast<size_t>(ready_at[k]);
    if (i < G) out.groups[static_cast<size_t>(group_at[i])].post_groups.push_back(static_cast<int>(k));
  }
}

}  // namespace

ConsumerSchedule make_consumer_schedule(const ConsumerScheduleInputs& in) {
  const PlanRoute& plan_route = in.routes->consumer(static_cast<size_t>(in.rank));
  ConsumerSchedule out;
  out.unpack = plan_route;
  out.groups.resize(plan_route.groups.size());
  if (in.order && in.order->size() == plan_route.groups.size()) {
    out.order = *in.order;
  } else {
    out.order.resize(plan_route.groups.size());
    for (size_t g = 0; g < out.order.size(); ++g) out.order[g] = static_cast<int>(g);
  }
  for (size_t g = 0; g < plan_route.groups.size(); ++g) {
    const PlanGroup& pg = plan_route.groups[g];
    const DirectUnpacks direct = find_direct_unpacks(pg, plan_route, in);
    std::vector<UnpackOp> rest;  // what still goes through the receive slot
    for (size_t k = 0; k < pg.unpacks.size(); ++k)
      if (!direct.is_direct[k]) rest.push_back(pg.unpacks[k]);
    out.unpack.groups[g].unpacks = std::move(rest);
    cut_reads(pg, direct.runs, in_place_runs(pg, g, in), out.groups[g].reads);
    summarize(pg, out.groups[g]);
  }
  place_post_groups(plan_route, in, out);
  return out;
}

GroupShadow group_shadow_layout(const PlanRoute& plan_route, const std::vector<int>* order,
                                const std::map<std::string, int>& post_group_of, const std::vector<bool>& on_device) {
  const size_t G = plan_route.groups.size(), N = plan_route.params.size();
  std::vector<int> at(G);  // layer group -> position in the order
  for (size_t g = 0; g < G; ++g) at[g] = static_cast<int>(g);
  if (order && order->size() == G) {
    for (size_t i = 0; i < G; ++i) {
      const int g = (*order)[i];
      if (g >= 0 && static_cast<size_t>(g) < G) at[static_cast<size_t>(g)] = static_cast<int>(i);
    }
  }
  GroupShadow out;
  out.offset.assign(N, GroupShadow::kNone);
  out.on_device.assign(N, false);
  for (size_t i = 0; i < N && i < on_device.size(); ++i) out.on_device[i] = on_device[i];
  out.opens.resize(G);
  out.commits.resize(G);
  out.units.resize(G);
  std::vector<int> first(N, -1), last(N, -1);
  for (size_t g = 0; g < G; ++g) {
    for (const UnpackOp& u : plan_route.groups[g].unpacks) {
      if (u.param >= N) continue;
      const int i = at[g];
      first[u.param] = first[u.param] < 0 ? i : std::min(first[u.param], i);
      last[u.param] = std::max(last[u.param], i);
    }
  }
  // Units: a param's post-processing group, or the param alone (-1 - its index).
  std::vector<int> unit(N);
  std::map<int, int> unit_done;  // unit -> the last position writing any of its params
  for (size_t p = 0; p < N; ++p) {
    auto it = post_group_of.find(plan_route.params[p].name);
    unit[p] = it != post_group_of.end() && it->second >= 0 ? it->second : -1 - static_cast<int>(p);
    if (first[p] >= 0) {
      int& d = unit_done.try_emplace(unit[p], last[p]).first->second;
      d = std::max(d, last[p]);
    }
  }
  std::vector<int> close(N, -1);
  for (size_t p = 0; p < N; ++p) {
    if (first[p] < 0) continue;
    close[p] = unit_done.at(unit[p]);
    out.opens[static_cast<size_t>(first[p])].push_back(static_cast<uint32_t>(p));
    out.commits[static_cast<size_t>(close[p])].push_back(static_cast<uint32_t>(p));
  }
  for (const auto& [u, d] : unit_done) out.units[static_cast<size_t>(d)].push_back(u);
  // First fit per shadow: a param's room is free again for params opened after the
  // position its unit is made live at (the commit runs after that group's unpack and
  // post-processing, before the next group's unpack).
  struct Held {
    uint64_t offset, bytes;
    int close;
  };
  std::vector<Held> held[2];
  for (size_t i = 0; i < G; ++i) {
    for (uint32_t p : out.opens[i]) {
      const int place = out.on_device[p] ? 1 : 0;
      std::vector<Held>& h = held[place];
      std::erase_if(h, [&](const Held& x) { return x.close < static_cast<int>(i); });
      std::sort(h.begin(), h.end(), [](const Held& a, const Held& b) { return a.offset < b.offset; });
      const TensorDecl& d = plan_route.params[p];
      const uint64_t bytes = align_up(std::max<uint64_t>(shape_numel(d.shape) * dtype_size(d.dtype), 1), 64);
      uint64_t offset = 0;
      for (const Held& x : h) {
        if (x.offset >= offset + bytes) break;
        offset = std::max(offset, x.offset + x.bytes);
      }
      h.push_back({offset, bytes, close[p]});
      out.offset[p] = offset;
      uint64_t& size = place ? out.device_bytes : out.host_bytes;
      size = std::max(size, offset + bytes);
    }
  }
  return out;
}

const Read* single_read_from(const PlanGroup& group, uint32_t producer) {
  const Read* found = nullptr;
  for (const Read& r : group.reads) {
    if (r.producer != producer) continue;
    if (found) return nullptr;
    found = &r;
  }
  return found;
}

std::vector<uint64_t> kept_layout(const ProducerRoute& route) {
  std::vector<uint64_t> at;
  at.reserve(route.groups.size() + 1);
  uint64_t next = 0;
  for (const ProducerGroup& g : route.groups) {
    at.push_back(next);
    next += (g.staging_bytes + 63) / 64 * 64;
  }
  at.push_back(next);
  return at;
}

}  // namespace ferry::engine
