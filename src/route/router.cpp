// build_routes as named passes over one RouteBuild (see ferry/route.h and
// docs/routing.md): the metadata indexed, the holdings read and checked, the consumers'
// plans grouped into classes, every copy cut by the pieces it touches, a holder chosen
// per cut, each producer's cuts made into segments and packs, each class's reads and
// unpacks, and the stats. What the passes share is route/router_parts.h; pieces,
// layouts and quantisation regions are pieces.cpp.
#include <algorithm>
#include <array>
#include <climits>
#include <iterator>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>
#include <unordered_map>

#include "ferry/route.h"
#include "common/parallel.h"
#include "route/router_parts.h"

namespace ferry {

namespace {

using namespace route_detail;

// One build_routes call: its inputs, what each pass leaves for the next, the routes.
class RouteBuild {
 public:
  RouteBuild(const RouterInput& in, const RouterOptions& options)
      : in(in), options(options), meta(in.metadata), num_producers(static_cast<uint32_t>(in.producers.size())),
        threads(router_threads(options)), align(std::max<uint64_t>(1, options.segment_alignment)) {}

  Status index_metadata();
  Status read_holdings();
  Status find_plan_classes();
  Status check_options_and_cost();
  Status cut_copies();
  void choose_holders();
  void bucket_by_producer();
  Status make_packs();
  void make_unpacks();
  void compute_stats();

  Routes routes;

 private:
  // A segment: one group's bytes of one plan class in a producer's staging.
  struct Run {
    uint32_t group = 0, plan = 0;
    uint64_t offset = 0, bytes = 0;  // the segment in the producer's staging
    size_t a = 0, b = 0;             // its cuts: by_producer[a, b)
  };
  Cut& cut_of(CutRef r) { return per[r >> kCutBits].cuts[r & kCutMask]; }

  const RouterInput& in;
  const RouterOptions& options;
  const std::vector<TensorDecl>& meta;
  const uint32_t num_producers;
  const int threads;
  const uint64_t align;
  // index_metadata: tensor name -> index in meta; the layer groups.
  std::unordered_map<std::string, uint32_t> index;
  Groups groups;
  int G = 0;
  size_t ng = 0;
  // read_holdings: per tensor its holders (then its pieces, cut_copies).
  std::vector<TensorInfo> tensors;
  // find_plan_classes: the distinct plans and how many consumers run each.
  std::vector<const Plan*> classes;
  std::vector<uint64_t> weight;
  // cut_copies: per class its cuts (holders chosen by choose_holders).
  std::vector<ClassCuts> per;
  uint64_t num_cuts = 0;
  // bucket_by_producer: every cut, producer-major; producer p's are [start[p], start[p + 1]).
  std::vector<CutRef> by_producer;
  std::vector<size_t> start;
  // make_packs: per producer its segments; bytes only it holds (x consumers).
  std::vector<std::vector<Run>> runs;
  std::vector<uint64_t> sole;
};

Status RouteBuild::index_metadata() {
  index.reserve(meta.size() * 2);
  for (uint32_t t = 0; t < meta.size(); ++t) {
    if (!index.emplace(meta[t].name, t).second) {
      return invalid_argument("metadata lists tensor '{}' twice", meta[t].name);
    }
  }
  groups = Groups(meta);
  G = groups.size();
  ng = static_cast<size_t>(G);
  return Status::Ok();
}

// Every producer's tensors checked against the metadata and each other, its boxes
// within their tensors and not overlapping one another.
Status RouteBuild::read_holdings() {
  tensors.resize(meta.size());
  for (uint32_t p = 0; p < num_producers; ++p) {
    const Holdings& h = in.producers[p];
    std::vector<uint32_t> local(h.tensors.size());
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const TensorDecl& d = h.tensors[i];
      auto it = index.find(d.name);
      if (it == index.end()) {
        return not_found("producer {} holds tensor '{}', which the metadata lacks", p, d.name);
      }
      TensorInfo& ti = tensors[it->second];
      // Against the first holder's view (it matched the metadata): one comparison, not
      // a search of that holder's tensor list (which made fsdp=N quadratic in N).
      if (ti.first_decl && ti.first_holder != static_cast<int>(p) && !same_decl(*ti.first_decl, d)) {
        return invalid_argument("holders disagree on tensor '{}': producer {} has {}, producer {} has {}", d.name,
                                ti.first_holder, decl_str(*ti.first_decl), p, decl_str(d));
      }
      if (!same_decl(d, meta[it->second])) {
        return invalid_argument("holders disagree on tensor '{}': the metadata says {}, producer {} has {}", d.name,
                                decl_str(meta[it->second]), p, decl_str(d));
      }
      if (ti.first_holder < 0) {
        ti.first_holder = static_cast<int>(p);
        ti.first_decl = &d;
      }
      local[i] = it->second;
    }
    // Boxes; overlap within this producer.
    std::unordered_map<uint32_t, std::vector<uint32_t>> mine;
    for (uint32_t b = 0; b < h.boxes.size(); ++b) {
      const HeldBox& hb = h.boxes[b];
      if (hb.tensor >= h.tensors.size()) {
        return out_of_range("producer {}: box {} names tensor #{} of {} declared", p, b, hb.tensor, h.tensors.size());
      }
      const uint32_t t = local[hb.tensor];
      const TensorDecl& d = meta[t];
      const Box& box = hb.box;
      if (box.start.size() != d.shape.size() || box.size.size() != d.shape.size()) {
        return invalid_argument("producer {}: box {} of tensor '{}' has the wrong number of dims for {}", p,
                                box.to_string(), d.name, shape_str(d.shape));
      }
      for (size_t k = 0; k < d.shape.size(); ++k) {
        if (box.start[k] < 0 || box.size[k] < 0 || box.start[k] > d.shape[k] - box.size[k]) {
          return out_of_range("producer {}: box {} is outside tensor '{}' {}", p, box.to_string(), d.name,
                              shape_str(d.shape));
        }
      }
      if (box.empty()) continue;
      mine[t].push_back(b);
      tensors[t].holders.push_back(Holder{box, p, b});
    }
    for (auto& [t, list] : mine) {
      if (list.size() < 2) continue;
      std::sort(list.begin(), list.end(), [&](uint32_t a, uint32_t b) { return h.boxes[a].box < h.boxes[b].box; });
      for (size_t i = 0; i < list.size(); ++i) {
        const Box& a = h.boxes[list[i]].box;
        for (size_t j = i + 1; j < list.size(); ++j) {
          const Box& b = h.boxes[list[j]].box;
          if (!a.start.empty() && b.start[0] >= a.start[0] + a.size[0]) break;
          if (a.intersects(b)) {
            return invalid_argument("producer {} holds overlapping boxes {} and {} of tensor '{}'", p, a.to_string(),
                                    b.to_string(), meta[t].name);
          }
        }
      }
    }
  }
  return Status::Ok();
}

// Consumers with equal plans share one class (and its route); every plan's sources
// checked against the metadata.
Status RouteBuild::find_plan_classes() {
  for (int g = 0; g < G; ++g) routes.group_names.push_back(groups.name(g));
  std::unordered_map<uint64_t, std::vector<uint32_t>> by_hash;
  routes.consumer_plan.reserve(in.consumers.size());
  for (size_t c = 0; c < in.consumers.size(); ++c) {
    const Plan* plan = in.consumers[c];
    if (!plan) return invalid_argument("consumer {} has no plan", c);
    const uint64_t h = plan->hash();
    auto& list = by_hash[h];
    int found = -1;
    for (uint32_t k : list) {
      if (classes[k] == plan || *classes[k] == *plan) {
        found = static_cast<int>(k);
        break;
      }
    }
    if (found < 0) {
      for (const TensorDecl& s : plan->sources()) {
        auto it = index.find(s.name);
        if (it == index.end()) {
          return not_found("the plan of consumer {} reads tensor '{}', which the metadata lacks", c, s.name);
        }
        if (!same_decl(s, meta[it->second])) {
          return invalid_argument("the plan of consumer {} reads tensor '{}' as {}, the metadata says {}", c, s.name,
                                  decl_str(s), decl_str(meta[it->second]));
        }
      }
      found = static_cast<int>(classes.size());
      classes.push_back(plan);
      weight.push_back(0);
      list.push_back(static_cast<uint32_t>(found));
      routes.plans.push_back(PlanRoute{h, plan->params(), std::vector<PlanGroup>(static_cast<size_t>(G))});
    }
    weight[static_cast<size_t>(found)]++;
    routes.consumer_plan.push_back(static_cast<uint32_t>(found));
  }
  return Status::Ok();
}

Status RouteBuild::check_options_and_cost() {
  if (options.packs_of < RouterOptions::kNoRank || options.packs_of >= static_cast<int64_t>(num_producers)) {
    return invalid_argument("router options: packs of producer {}, of {} producers", options.packs_of, num_producers);
  }
  if (options.unpacks_of < RouterOptions::kNoRank || options.unpacks_of >= static_cast<int64_t>(in.consumers.size())) {
    return invalid_argument("router options: unpacks of consumer {}, of {} consumers", options.unpacks_of,
                            in.consumers.size());
  }
  {  // What the rest would cost, before any piece: refused at once when out of bounds.
    RoutingCost cost;
    cost.producers = num_producers;
    cost.plan_classes = classes.size();
    cost.groups = static_cast<uint64_t>(G);
    for (const Holdings& h : in.producers) cost.held_boxes += h.boxes.size();
    FERRY_RETURN_IF_ERROR(check_routing_cost(cost));
  }
  return Status::Ok();
}

Status RouteBuild::cut_copies() {
  // Each plan class on its own (a thread each, up to options.threads): its cuts, layouts
  // and bytes are its own, and the pieces every class reads are built first. A cut is
  // named by a CutRef: its class in the high bits, its index in the class's cuts below.
  per.resize(classes.size());
  {
    std::vector<uint32_t> read;  // tensors some plan reads, once each
    std::vector<bool> seen(tensors.size(), false);
    std::vector<std::vector<uint32_t>> src_tensor(classes.size());
    for (uint32_t k = 0; k < classes.size(); ++k) {
      const Plan& plan = *classes[k];
      src_tensor[k].resize(plan.sources().size());
      for (size_t s = 0; s < plan.sources().size(); ++s) src_tensor[k][s] = index.at(plan.sources()[s].name);
      for (const Copy& copy : plan.copies()) {
        const uint32_t t = src_tensor[k][copy.source];
        if (copy.src.numel() != 0 && !seen[t]) {
          seen[t] = true;
          read.push_back(t);
        }
      }
    }
    std::vector<Status> built(tensors.size());
    parallel_for(read.size(), threads, [&](size_t i) { built[read[i]] = build_pieces(meta[read[i]], tensors[read[i]]); });

    parallel_for(classes.size(), threads, [&](size_t kk) {
      const auto k = static_cast<uint32_t>(kk);
      const Plan& plan = *classes[k];
      ClassCuts& out = per[k];
      std::vector<uint32_t> filtered_idx;
      out.status = [&]() -> Status {
        for (const Copy& copy : plan.copies()) {
          const int64_t n = copy.src.numel();
          if (n == 0) continue;
          const uint32_t t = src_tensor[k][copy.source];
          const TensorDecl& d = meta[t];
          const TensorInfo& ti = tensors[t];
          FERRY_RETURN_IF_ERROR(built[t]);
          if (ti.pieces.empty()) {
            return not_found("tensor '{}' is read by a consumer plan but no producer holds it", d.name);
          }
          Layout src = copy.src, dst = copy.dst;
          unflatten(src, dst, d.shape);
          // Only the pieces the copy's flat range can touch.
          const std::vector<uint32_t>* idx = nullptr;
          if (ti.map.size() > 4) {
            const int64_t lo = src.min_offset(), hi = src.max_offset();
            filtered_idx.clear();
            // By binary search in the pieces sorted by flat start, not a scan of every
            // piece per copy; taken in index order, as the scan did, so the cut is the same.
            auto first = std::lower_bound(ti.by_flat.begin(), ti.by_flat.end(), lo - ti.widest_flat,
                                          [&](uint32_t i, int64_t v) { return ti.pieces[i].flat_lo < v; });
            for (auto it = first; it != ti.by_flat.end() && ti.pieces[*it].flat_lo <= hi; ++it) {
              if (ti.pieces[*it].flat_hi >= lo) filtered_idx.push_back(*it);
            }
            std::sort(filtered_idx.begin(), filtered_idx.end());
            idx = &filtered_idx;
          }
          int64_t covered = 0;
          const DType wire = wire_dtype(d.dtype, plan.params()[copy.param].dtype, options);
          const uint64_t es = dtype_size(wire);
          const int32_t group = groups.of_tensor(t);
          compose_layout_each(src, d.shape, ti.map, idx, [&](const MapPiece& m) {
            Cut cut;
            cut.plan = k;
            cut.param = copy.param;
            cut.tensor = t;
            cut.piece = idx ? (*idx)[m.part] : m.part;
            cut.group = group;
            cut.wire = wire;
            cut.dst_offset = dst.offset_of(m.start);
            cut.layouts = out.pool.add(m.root.shape, m.root.strides, m.root.offset, dst.strides, cut.dst_offset);
            const int64_t numel = out.pool.numel(cut.layouts);
            covered += numel;
            cut.bytes = static_cast<uint64_t>(numel) * es;
            cut.cost = cut.bytes * weight[k];  // (final: every consumer was counted above)
            out.bytes += cut.bytes;
            out.cuts.push_back(cut);
          });
          if (covered != n) {
            return not_found(
                "tensor '{}': {} of the {} elements a consumer plan reads ({} -> param '{}') are held by no producer",
                d.name, n - covered, n, copy.src.to_string(), plan.params()[copy.param].name);
          }
        }
        if (options.quantize_on == QuantizeOn::kProducer && !plan.quantized().empty()) {
          quantize_class(plan, weight[k], tensors, out, routes.plans[k]);
        }
        return Status::Ok();
      }();
    });
    // The error a class-by-class pass would have met first.
    for (const ClassCuts& c : per) FERRY_RETURN_IF_ERROR(c.status);
  }
  if (static_cast<uint64_t>(classes.size()) >= (uint64_t{1} << (64 - kCutBits))) {
    return invalid_argument("{} plan classes: too many to route", classes.size());
  }
  num_cuts = 0;
  for (const ClassCuts& c : per) num_cuts += c.cuts.size();
  return Status::Ok();
}

void RouteBuild::choose_holders() {
  // Where every piece has one holder (no DP replica: FSDP, TP/PP/EP alone) there is
  // nothing to choose: each class takes its holders on its own thread. Otherwise greedy,
  // largest cost first, to the least-loaded holder, over every class in one order.
  bool choice = false;
  for (const TensorInfo& ti : tensors) {
    for (const TensorPiece& p : ti.pieces) choice |= p.holders.size() > 1;
  }
  // A region's producer: the least loaded of those holding it whole (the first where
  // there is no choice; `load` null).
  auto assign_region = [&](Cut& c, const std::vector<uint64_t>* load) {
    const std::vector<uint32_t>& ps = per[c.plan].regions[static_cast<size_t>(c.region)].producers;
    uint32_t best = ps[0];
    if (load) {
      for (uint32_t q : ps) {
        if ((*load)[q] < (*load)[best]) best = q;
      }
    }
    c.producer = best;
    c.box = 0;
    c.sole = ps.size() == 1;
  };
  auto assign = [&](Cut& c, uint32_t hidx, const TensorInfo& ti, LayoutPool& pool) {
    const TensorPiece& piece = ti.pieces[c.piece];
    const Holder& h = ti.holders[hidx];
    c.producer = h.producer;
    c.box = h.box_index;
    c.sole = piece.holders.size() == 1;
    if (piece.refined && h.box != piece.box) pool.set_src(c.layouts, rebase(pool.src(c.layouts), piece.box, h.box));
  };
  if (!choice) {
    parallel_for(per.size(), threads, [&](size_t k) {
      ClassCuts& cc = per[k];
      for (size_t j = 0; j < cc.cuts.size(); ++j) {
        Cut& c = cc.cuts[j];
        if (c.region >= 0) {
          assign_region(c, nullptr);
          continue;
        }
        const TensorInfo& ti = tensors[c.tensor];
        assign(c, ti.pieces[c.piece].holders[0], ti, cc.pool);
      }
    });
  } else {
    std::vector<CutRef> order;
    order.reserve(num_cuts);
    for (uint64_t k = 0; k < per.size(); ++k)
      for (uint64_t j = 0; j < per[k].cuts.size(); ++j) order.push_back(k << kCutBits | j);
    std::sort(order.begin(), order.end(), [&](CutRef a, CutRef b) {
      const Cut& x = cut_of(a);
      const Cut& y = cut_of(b);
      if (x.cost != y.cost) return x.cost > y.cost;
      if (x.plan != y.plan) return x.plan < y.plan;
      if (x.param != y.param) return x.param < y.param;
      return x.dst_offset < y.dst_offset;
    });
    std::vector<uint64_t> load(num_producers, 0);
    for (CutRef r : order) {
      Cut& c = cut_of(r);
      if (c.region >= 0) {
        assign_region(c, &load);
        load[c.producer] += c.cost;
        continue;
      }
      const TensorInfo& ti = tensors[c.tensor];
      const TensorPiece& piece = ti.pieces[c.piece];
      uint32_t best = piece.holders[0];
      for (uint32_t hidx : piece.holders) {
        if (load[ti.holders[hidx].producer] < load[ti.holders[best].producer]) best = hidx;
      }
      assign(c, best, ti, per[c.plan].pool);
      load[c.producer] += c.cost;
    }
  }
}

// Each producer's cuts by group, plan, param and destination offset: bucketed by
// producer (a counting sort, each class filling its own slots); make_packs sorts each
// producer's bucket on its own thread.
void RouteBuild::bucket_by_producer() {
  // Each producer's cuts by group, plan, param and destination offset: bucketed by
  // producer (a counting sort, each class filling its own slots), then each producer's
  // bucket sorted on its own thread.
  by_producer.assign(num_cuts, 0);
  start.assign(num_producers + 1, 0);
  {
    const size_t K = per.size();
    std::vector<std::vector<size_t>> count(K, std::vector<size_t>(num_producers, 0));
    parallel_for(K, threads, [&](size_t k) {
      for (size_t j = 0; j < per[k].cuts.size(); ++j) ++count[k][per[k].cuts[j].producer];
    });
    // Slots: producer-major, class-minor (the order a pass over every cut gives).
    size_t at = 0;
    for (uint32_t p = 0; p < num_producers; ++p) {
      start[p] = at;
      for (size_t k = 0; k < K; ++k) {
        const size_t n = count[k][p];
        count[k][p] = at;
        at += n;
      }
    }
    start[num_producers] = at;
    parallel_for(K, threads, [&](size_t k) {
      std::vector<size_t>& slot = count[k];
      for (uint64_t j = 0; j < per[k].cuts.size(); ++j) by_producer[slot[per[k].cuts[j].producer]++] = uint64_t{k} << kCutBits | j;
    });
  }
}

// Per producer: sort its cuts, cut them into segments (one per group and plan class)
// and make its packs. Each segment's cuts are a run of by_producer.
Status RouteBuild::make_packs() {
  routes.producers.assign(num_producers, ProducerRoute{std::vector<ProducerGroup>(ng)});
  runs.assign(num_producers, {});
  sole.assign(num_producers, 0);
  std::vector<Status> quant_status(num_producers);
  parallel_for(num_producers, threads, [&](size_t p) {
    const auto b0 = static_cast<std::ptrdiff_t>(start[p]), b1 = static_cast<std::ptrdiff_t>(start[p + 1]);
    std::sort(by_producer.begin() + b0, by_producer.begin() + b1, [&](CutRef a, CutRef b) {
      const Cut& x = cut_of(a);
      const Cut& y = cut_of(b);
      if (x.group != y.group) return x.group < y.group;
      if (x.plan != y.plan) return x.plan < y.plan;
      if (x.param != y.param) return x.param < y.param;
      return x.dst_offset < y.dst_offset;
    });
    ProducerRoute& pr = routes.producers[p];
    const bool keep = options.packs_of == RouterOptions::kEveryRank || options.packs_of == static_cast<int>(p);
    if (keep) {  // Room for every op up front (merges only make fewer).
      std::vector<size_t> packs(ng, 0);
      for (size_t i = start[p]; i < start[p + 1]; ++i) ++packs[static_cast<size_t>(cut_of(by_producer[i]).group)];
      for (size_t g = 0; g < ng; ++g) pr.groups[g].packs.reserve(packs[g]);
    }
    for (size_t a = start[p]; a < start[p + 1];) {
      const Cut& first = cut_of(by_producer[a]);
      const auto g = static_cast<size_t>(first.group);
      ProducerGroup& pg = pr.groups[g];
      // A producer's cuts are by group: this group's segments come one after another.
      OpSink<PackOp> sink(keep ? &pg.packs : nullptr);
      for (; a < start[p + 1] && static_cast<size_t>(cut_of(by_producer[a]).group) == g;) {
        const Cut& head = cut_of(by_producer[a]);
        const LayoutPool& pool = per[head.plan].pool;
        Run run{static_cast<uint32_t>(g), head.plan, align_up(pg.staging_bytes, align), 0, a, a};
        uint64_t cur = run.offset;
        sink.begin_segment();
        size_t b = a;
        for (; b < start[p + 1]; ++b) {
          const Cut& c = cut_of(by_producer[b]);
          if (static_cast<size_t>(c.group) != g || c.plan != head.plan) break;
          if (c.region >= 0) {
            auto op = quant_op(per[c.plan], per[c.plan].regions[static_cast<size_t>(c.region)],
                               static_cast<uint32_t>(p), cur, tensors);
            if (!op.ok()) {
              quant_status[p] = op.status();
            } else {
              pg.quants.push_back(std::move(*op));  // (dropped below where this producer's ops are elided)
            }
            if (c.sole) sole[p] += c.cost;
            cur += c.bytes;
            continue;
          }
          sink.push(PackOp{c.box, c.wire, cur, pool.src(c.layouts)}, dtype_size(c.wire));
          if (c.sole) sole[p] += c.cost;
          cur += c.bytes;
        }
        run.bytes = cur - run.offset;
        run.b = b;
        pg.staging_bytes = cur;
        pg.segments.push_back(Segment{run.plan, run.offset, run.bytes});
        runs[p].push_back(run);
        a = b;
      }
      std::tie(pg.elided_packs, pg.elided_digest) = sink.finish();
      if (!keep && !pg.quants.empty()) {
        // Elided like the packs: counted and digested after them (group_digest's order).
        for (const QuantOp& q : pg.quants) pg.elided_digest = route_detail::digest_op(pg.elided_digest, q);
        pg.elided_packs += pg.quants.size();
        pg.quants.clear();
        pg.quants.shrink_to_fit();
      }
    }
    for (ProducerGroup& pg : pr.groups) pg.packs.shrink_to_fit();  // merged ops left room unused
  });
  for (const Status& st : quant_status) FERRY_RETURN_IF_ERROR(st);
  return Status::Ok();
}

// Per plan class: its reads (producer by producer, as the consumer receives them) and
// its unpacks.
void RouteBuild::make_unpacks() {
  const int keep_plan = options.unpacks_of >= 0 ? static_cast<int>(routes.consumer_plan[static_cast<size_t>(options.unpacks_of)]) : -1;
  parallel_for(routes.plans.size(), threads, [&](size_t k) {
    PlanRoute& route = routes.plans[k];
    const LayoutPool& pool = per[k].pool;
    const bool keep = options.unpacks_of == RouterOptions::kEveryRank || keep_plan == static_cast<int>(k);
    if (keep) {
      std::vector<size_t> unpacks(ng, 0);
      for (uint32_t p = 0; p < num_producers; ++p)
        for (const Run& r : runs[p])
          if (r.plan == k) unpacks[r.group] += r.b - r.a;
      for (size_t g = 0; g < ng; ++g) route.groups[g].unpacks.reserve(unpacks[g]);
    }
    std::vector<OpSink<UnpackOp>> sinks;
    sinks.reserve(ng);
    for (size_t g = 0; g < ng; ++g) sinks.emplace_back(keep ? &route.groups[g].unpacks : nullptr);
    for (uint32_t p = 0; p < num_producers; ++p) {
      for (const Run& r : runs[p]) {
        if (r.plan != k) continue;
        PlanGroup& cg = route.groups[r.group];
        OpSink<UnpackOp>& sink = sinks[r.group];
        const Read rd{p, r.offset, r.bytes, align_up(cg.recv_bytes, align)};
        sink.begin_segment();
        uint64_t cur = rd.recv_offset;
        for (size_t i = r.a; i < r.b; ++i) {
          const Cut& c = cut_of(by_producer[i]);
          if (c.region >= 0) {
            // The e4m3 values into the param's box, then the scales into its tiles.
            const QuantRegion& qr = per[k].regions[static_cast<size_t>(c.region)];
            const route_detail::TileRegion& b = qr.box;
            Layout values{{b.nb, b.nr, b.nc}, {qr.rows * qr.cols, qr.cols, 1}, (b.b0 * qr.rows + b.r0) * qr.cols + b.c0};
            coalesce_layout(values);
            sink.push(UnpackOp{qr.param, DType::kF8E4M3, cur, values}, 1);
            const int64_t trows = batch::fp8_tile_rows(qr.format, qr.block), bl = qr.block;
            const int64_t TR = (qr.rows + trows - 1) / trows, TC = (qr.cols + bl - 1) / bl;
            Layout scales{{b.nb, (b.nr + trows - 1) / trows, (b.nc + bl - 1) / bl},
                          {TR * TC, TC, 1},
                          (b.b0 * TR + b.r0 / trows) * TC + b.c0 / bl};
            coalesce_layout(scales);
            const DType sdt = route_detail::scale_dtype(qr.format);
            sink.push(UnpackOp{qr.scale, sdt, cur + static_cast<uint64_t>(values.numel()), scales}, dtype_size(sdt));
            cur += c.bytes;
            continue;
          }
          sink.push(UnpackOp{c.param, c.wire, cur, pool.dst(c.layouts)}, dtype_size(c.wire));
          cur += c.bytes;
        }
        cg.recv_bytes = rd.recv_offset + rd.length;
        cg.reads.push_back(rd);
      }
    }
    for (size_t g = 0; g < ng; ++g) {
      PlanGroup& cg = route.groups[g];
      std::tie(cg.elided_unpacks, cg.elided_digest) = sinks[g].finish();
      cg.unpacks.shrink_to_fit();
    }
  });
}

void RouteBuild::compute_stats() {
  RouteStats& st = routes.stats;
  st.num_pieces = num_cuts;
  st.num_plan_classes = classes.size();
  for (const ClassCuts& c : per) {
    st.quantized_params += c.quantized;
    st.quantized_on_producer += c.on_producer;
    st.quant_regions += c.regions.size();
  }
  st.producer_bytes.assign(num_producers, 0);
  for (uint32_t p = 0; p < num_producers; ++p) {
    for (const ProducerGroup& pg : routes.producers[p].groups) {
      st.num_pack_ops += pg.packs.size() + pg.elided_packs;
      st.max_staging_bytes = std::max(st.max_staging_bytes, pg.staging_bytes);
      for (const Segment& s : pg.segments) st.producer_bytes[p] += s.bytes * weight[s.plan];
    }
  }
  for (const PlanRoute& pr : routes.plans) {
    for (const PlanGroup& g : pr.groups) st.num_unpack_ops += g.unpacks.size() + g.elided_unpacks;
  }
  st.consumer_bytes.assign(in.consumers.size(), 0);
  for (size_t c = 0; c < in.consumers.size(); ++c) {
    for (const PlanGroup& g : routes.consumer(c).groups) {
      st.num_reads += g.reads.size();
      for (const Read& r : g.reads) st.consumer_bytes[c] += r.length;
    }
    st.bytes_moved += st.consumer_bytes[c];
    st.bytes_min += per[routes.consumer_plan[c]].bytes;
    st.max_consumer_bytes = std::max(st.max_consumer_bytes, st.consumer_bytes[c]);
  }
  uint64_t total = 0;
  for (uint32_t p = 0; p < num_producers; ++p) {
    total += st.producer_bytes[p];
    st.max_producer_bytes = std::max(st.max_producer_bytes, st.producer_bytes[p]);
    st.max_sole_holder_bytes = std::max(st.max_sole_holder_bytes, sole[p]);
    if (!in.producers[p].boxes.empty()) st.holders++;
  }
  st.mean_producer_bytes = st.holders ? static_cast<double>(total) / static_cast<double>(st.holders) : 0.0;
  st.balance_bound = std::max(st.mean_producer_bytes, static_cast<double>(st.max_sole_holder_bytes));
  // Holder components: producers linked by holding a common piece. Every byte of a
  // component's pieces is sent by its producers, so cost / size bounds its busiest one.
  {
    std::vector<uint32_t> parent(num_producers);
    std::iota(parent.begin(), parent.end(), 0);
    auto find = [&](uint32_t x) {
      while (parent[x] != x) x = parent[x] = parent[parent[x]];
      return x;
    };
    for (const TensorInfo& ti : tensors) {
      for (const TensorPiece& p : ti.pieces) {
        const uint32_t a = find(ti.holders[p.holders[0]].producer);
        for (uint32_t h : p.holders) parent[find(ti.holders[h].producer)] = a;
      }
    }
    std::vector<double> cost(num_producers, 0.0), size(num_producers, 0.0);
    for (uint32_t p = 0; p < num_producers; ++p) {
      cost[find(p)] += static_cast<double>(st.producer_bytes[p]);
      size[find(p)] += 1.0;
    }
    for (uint32_t p = 0; p < num_producers; ++p) {
      if (find(p) == p && size[p] > 0) st.component_bound = std::max(st.component_bound, cost[p] / size[p]);
    }
    st.component_bound = std::max(st.component_bound, static_cast<double>(st.max_sole_holder_bytes));
  }
  st.balance = st.balance_bound > 0 ? static_cast<double>(st.max_producer_bytes) / st.balance_bound : 1.0;
}

}  // namespace

uint64_t RoutingCost::route_groups() const { return (producers + plan_classes) * groups; }
uint64_t RoutingCost::pieces() const { return held_boxes * plan_classes; }
uint64_t RoutingCost::bytes() const {
  // Per held box: its HeldBox and a share of its rank's TensorDecl copies, and the
  // router's Holder and piece; per route group, an empty group's vectors; per piece,
  // the router's cut and layouts, and where every op is made a pack op and an unpack op
  // (measured: fsdp=4096 -> tp=8 over Llama-3.1-8B peaks at 2.15 GB with every op, this
  // says 3.5; 1.28 GB with none, this says 1.5).
  constexpr uint64_t kPerBox = 240, kPerGroup = 64, kPerCut = 150, kPerOps = 260;
  return held_boxes * kPerBox + route_groups() * kPerGroup + pieces() * (kPerCut + (every_op ? kPerOps : 0));
}
std::string RoutingCost::to_string() const {
  return fmt::format("{} held boxes, {} route groups, ~{} pieces: ~{:.1f} GiB to route", held_boxes, route_groups(),
                     pieces(), static_cast<double>(bytes()) / static_cast<double>(uint64_t{1} << 30));
}

Status check_routing_cost(const RoutingCost& c, uint64_t memory_budget) {
  auto gib = [](uint64_t b) { return static_cast<double>(b) / static_cast<double>(uint64_t{1} << 30); };
  if (c.route_groups() > kMaxRouteGroups) {
    return invalid_argument(
        "routing {} producers and {} plan classes over {} layer groups needs {} route groups, which every rank of the "
        "job would hold (~{:.1f} GiB of them before any piece); the limit is {} route groups. In all: {}",
        c.producers, c.plan_classes, c.groups, c.route_groups(), gib(c.route_groups() * 64), kMaxRouteGroups,
        c.to_string());
  }
  if (c.pieces() > kMaxRoutePieces) {
    return invalid_argument(
        "routing {} held boxes to {} plan classes cuts up to ~{} pieces; the limit is {} pieces. In all: {}",
        c.held_boxes, c.plan_classes, c.pieces(), kMaxRoutePieces, c.to_string());
  }
  if (memory_budget && c.bytes() > memory_budget) {
    return invalid_argument("routing needs ~{:.1f} GiB of memory and {:.1f} GiB is available. In all: {}",
                            gib(c.bytes()), gib(memory_budget), c.to_string());
  }
  return Status::Ok();
}

std::string_view convert_on_name(ConvertOn c) { return c == ConvertOn::kProducer ? "producer" : "consumer"; }

std::optional<ConvertOn> parse_convert_on(std::string_view name) {
  if (name == "producer") return ConvertOn::kProducer;
  if (name == "consumer") return ConvertOn::kConsumer;
  return std::nullopt;
}

std::string_view quantize_on_name(QuantizeOn q) { return q == QuantizeOn::kProducer ? "producer" : "consumer"; }

std::optional<QuantizeOn> parse_quantize_on(std::string_view name) {
  if (name == "producer") return QuantizeOn::kProducer;
  if (name == "consumer") return QuantizeOn::kConsumer;
  return std::nullopt;
}

Result<Routes> build_routes(const RouterInput& in, const RouterOptions& options) {
  RouteBuild b(in, options);
  FERRY_RETURN_IF_ERROR(b.index_metadata());
  FERRY_RETURN_IF_ERROR(b.read_holdings());
  FERRY_RETURN_IF_ERROR(b.find_plan_classes());
  FERRY_RETURN_IF_ERROR(b.check_options_and_cost());
  FERRY_RETURN_IF_ERROR(b.cut_copies());
  b.choose_holders();
  b.bucket_by_producer();
  FERRY_RETURN_IF_ERROR(b.make_packs());
  b.make_unpacks();
  b.compute_stats();
  return std::move(b.routes);
}

}  // namespace ferry
