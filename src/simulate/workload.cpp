#include "simulate/workload.h"

#include "engine/replica_server.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "engine/rendezvous.h"
#include "ferry/models.h"
#include "ferry/route.h"
#include "ferry/source.h"
#include "tools/job_model.h"

namespace ferry::simulate {
namespace {

uint64_t box_bytes(const Box& b, DType d) { return static_cast<uint64_t>(b.numel()) * dtype_size(d); }

// Per rank, per group: the bytes of its holdings.
std::vector<std::vector<uint64_t>> held_bytes(const std::vector<Holdings>& ranks, const Groups& groups,
                                              const std::unordered_map<std::string, size_t>& index) {
  std::vector<std::vector<uint64_t>> out(ranks.size(), std::vector<uint64_t>(static_cast<size_t>(groups.size()), 0));
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const HeldBox& hb : ranks[r].boxes) {
      const TensorDecl& d = ranks[r].tensors[hb.tensor];
      out[r][static_cast<size_t>(groups.of_tensor(index.at(d.name)))] += box_bytes(hb.box, d.dtype);
    }
  }
  return out;
}

Result<Routes> route(const tools::JobModel& m, const std::vector<Holdings>& holdings, std::vector<Plan>& plans,
                     QuantizeOn quantize_on = QuantizeOn::kConsumer) {
  const int world = m.inference.world_size(), engine = m.inference.engine_size();
  if (plans.empty()) {
    for (int r = 0; r < engine; ++r) {
      FERRY_ASSIGN_OR_RETURN(auto plan, tools::record_rank_plan(*m.loader, r, &m.metadata));
      plans.push_back(std::move(plan));
    }
  }
  RouterInput in;
  in.metadata = m.metadata;
  in.producers = holdings;
  for (int r = 0; r < world; ++r) in.consumers.push_back(&plans[static_cast<size_t>(r % engine)]);
  RouterOptions ro;
  ro.quantize_on = quantize_on;
  return build_routes(in, ro);
}

// Routes -> per group: pack bytes, transfers merged per (producer, consumer), unpack bytes.
void fill_from_routes(const Routes& routes, std::vector<GroupWork>& groups, JobWorkload& out) {
  const size_t P = routes.producers.size(), C = routes.consumer_plan.size();
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupWork& gw = groups[g];
    gw.pack_bytes.assign(P, 0);
    gw.unpack_bytes.assign(C, 0);
    for (size_t p = 0; p < P; ++p) gw.pack_bytes[p] = routes.producers[p].groups[g].staging_bytes;
    for (size_t c = 0; c < C; ++c) {
      const PlanGroup& pg = routes.consumer(c).groups[g];
      gw.unpack_bytes[c] = pg.recv_bytes;
      std::map<uint32_t, Flow> by;
      for (const Read& r : pg.reads) {
        Flow& f = by[r.producer];
        f.from = r.producer;
        f.to = static_cast<uint32_t>(c);
        f.bytes += r.length;
        f.ops = f.bytes == r.length ? 1 : f.ops + 1;
      }
      for (auto& [p, f] : by) {
        gw.transfers.push_back(f);
        out.bytes_moved += f.bytes;
      }
    }
  }
  out.max_consumer_bytes = routes.stats.max_consumer_bytes;
  out.consumer_plan = routes.consumer_plan;
  std::vector<uint64_t> class_bytes;
  for (const PlanRoute& pr : routes.plans) {
    uint64_t b = 0;
    for (const TensorDecl& d : pr.params) b += shape_numel(d.shape) * dtype_size(d.dtype);
    class_bytes.push_back(b);
  }
  out.consumer_param_bytes.clear();
  for (uint32_t k : routes.consumer_plan) out.consumer_param_bytes.push_back(class_bytes[k]);
}

}  // namespace

Result<JobWorkload> build_workload(const JobSpec& job, Design design) {
  if (design != Design::kFerry && job.order.kind != engine::GroupOrderKind::kLayer) {
    return invalid_argument("--order {}: only ferry's design has a group order (got --design {})",
                            engine::group_order_name(job.order), design_name(design));
  }
  if (design != Design::kFerry && job.relay_node_gpus > 0)
    return invalid_argument("--relay: only ferry's design relays (got --design {})", design_name(design));
  const auto t0 = std::chrono::steady_clock::now();
  if (job.quantize_on_producer && design != Design::kFerry) {
    return invalid_argument("--quantize-on producer: only ferry's design quantises on the producer (got --design {})",
                            design_name(design));
  }
  if (job.quantize_on_producer && job.quantize == Quantize::kNone) {
    return invalid_argument("--quantize-on producer needs --quantize fp8");
  }
  LoaderOptions lopts;
  lopts.quantize = job.quantize;
  FERRY_ASSIGN_OR_RETURN(auto m, tools::make_job_model(job.model, job.trainer, job.inference, job.shrink,
                                                       job.config_overrides, lopts));
  if (design != Design::kFerry && m.trainer.kind != TrainerLayout::Kind::kMegatron) {
    return invalid_argument("--design {}: needs a Megatron trainer layout (tp=..,pp=..), got {}", design_name(design),
                            m.trainer.to_string());
  }
  JobWorkload out;
  out.producers = m.trainer.world_size();
  out.consumers = m.inference.world_size();
  out.engine_size = m.inference.engine_size();
  out.model_bytes = m.checkpoint_bytes;
  {
    double elements = 0, bytes = 0;
    for (const TensorDecl& d : m.metadata) {
      elements += static_cast<double>(shape_numel(d.shape));
      bytes += static_cast<double>(shape_numel(d.shape)) * static_cast<double>(dtype_size(d.dtype));
    }
    if (elements > 0) out.element_bytes = bytes / elements;
  }
  Workload& w = out.work;
  w.producers = out.producers;
  w.consumers = out.consumers;
  const Groups groups(m.metadata);
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < m.metadata.size(); ++i) index.emplace(m.metadata[i].name, i);
  w.groups.resize(static_cast<size_t>(groups.size()));
  for (size_t t = 0; t < m.metadata.size(); ++t) {
    GroupWork& gw = w.groups[static_cast<size_t>(groups.of_tensor(t))];
    gw.stage = std::max(gw.stage, m.tensor_stage[t]);
  }

  std::vector<Plan> plans;
  if (design == Design::kShardedGather) {
    // After the TP all-gather every TP rank holds the whole dense tensors of its stage:
    // the same ranks as a trainer with tp=1 and the TP ranks as data-parallel replicas
    // (global rank stage*T*D + d*T + t is the same rank; experts are not gathered).
    TrainerLayout gathered = m.trainer;
    gathered.dp *= gathered.tp;
    gathered.tp = 1;
    auto th = make_holdings(m.metadata, gathered, model_info_from_config(m.config.json()));
    if (!th.ok()) return th.status().with_context("sharded-gather's gathered trainer " + gathered.to_string());
    FERRY_ASSIGN_OR_RETURN(auto routes, route(m, th->ranks, plans));
    fill_from_routes(routes, w.groups, out);
    // The all-gather: each rank receives what it lacks of its stage's dense tensors,
    // evenly from its TP peers (ranks base..base+T-1, the same stage and DP index).
    const auto before = held_bytes(*m.holdings, groups, index);
    const auto after = held_bytes(th->ranks, groups, index);
    const int T = m.trainer.tp;
    for (size_t g = 0; g < w.groups.size() && T > 1; ++g) {
      for (int p = 0; p < out.producers; ++p) {
        const uint64_t need = after[p][g] - std::min(after[p][g], before[p][g]);
        if (need == 0) continue;
        const int base = p - p % T;
        for (int q = base; q < base + T; ++q) {
          if (q != p) w.groups[g].gather.push_back({static_cast<uint32_t>(q), static_cast<uint32_t>(p), need / (T - 1), 1});
        }
      }
    }
    w.serial_stages = true;
  } else {
    // Trainer-side quantisation: the engine's own routes (RouterOptions::quantize_on), whose
    // reads carry FP8 values and scales where a producer quantises.
    FERRY_ASSIGN_OR_RETURN(auto routes, route(m, *m.holdings, plans,
                                              job.quantize_on_producer ? QuantizeOn::kProducer : QuantizeOn::kConsumer));
    fill_from_routes(routes, w.groups, out);
    engine::GroupOrderOptions order_options = job.order;
    if (job.relay_node_gpus > 0) {
      // The engine's relay groups (consumers of one plan class on one node), from the
      // hosts as its ranks would publish them.
      engine::RouteInputs hosts;
      for (size_t c = 0; c < routes.consumer_plan.size(); ++c)
        hosts.relay_hosts.push_back(fmt::format("node {}", c / static_cast<size_t>(job.relay_node_gpus)));
      order_options.relay_group = engine::relay_groups(hosts, routes.consumer_plan);
      w.relay_of.assign(routes.consumer_plan.size(), -1);
      for (size_t c = 0; c < w.relay_of.size(); ++c) {
        const int r = order_options.relay_group[c];
        if (r >= 0 && static_cast<size_t>(r) != c) w.relay_of[c] = r;
      }
      for (GroupWork& gw : w.groups) {  // a member reads nothing from the producers; it copies inside its node
        std::vector<Flow> kept;
        for (const Flow& f : gw.transfers) {
          if (w.relay_of[f.to] < 0) {
            kept.push_back(f);
          } else {
            out.bytes_moved -= f.bytes;
          }
        }
        gw.transfers = std::move(kept);
        for (size_t c = 0; c < w.relay_of.size(); ++c)
          if (w.relay_of[c] >= 0) out.bytes_moved += gw.unpack_bytes[c];
      }
    }
    if (job.quantize_on_producer) {
      out.quantized_params = routes.stats.quantized_params;
      out.quantized_on_producer = routes.stats.quantized_on_producer;
    }
    // The engine's own order computation, so the prediction follows the engine.
    const engine::GroupOrder order = engine::make_group_order(routes, order_options);
    FERRY_RETURN_IF_ERROR(engine::check_group_order(routes, order));
    out.lanes = order.num_lanes();
    out.cohort_sizes = order.cohort_sizes();
    out.lane_groups = order.lane_sizes();
    out.round_lanes = order.round_sizes();
    out.order_summary = order.summary();
    if (order_options.kind != engine::GroupOrderKind::kLayer) {
      w.consumer_order = order.consumer;
      w.producer_order = order.producer;
      if (order.paced) {
        w.waves.resize(routes.producers.size());
        for (size_t p = 0; p < routes.producers.size(); ++p) {
          for (const auto& wave : engine::serve_waves(routes, order, static_cast<int>(p))) {
            auto& to = w.waves[p].emplace_back();
            for (const engine::ServedRead& r : wave) to.emplace_back(r.consumer, r.group);
          }
        }
      }
    }
  }
  w.groups_in_flight = std::max(1, job.groups_in_flight);
  if (job.staging_budget > 0) {
    uint64_t largest = 0;
    for (const GroupWork& gw : w.groups)
      for (uint64_t b : gw.pack_bytes) largest = std::max(largest, b);
    w.staging_slots = largest == 0 ? 2 : static_cast<int>(std::max<uint64_t>(1, job.staging_budget / largest));
  }
  if (design == Design::kBroadcast) {
    // Each stage's first rank gathers the stage's full tensors (one holder per distinct
    // box, itself where it holds one) and broadcasts them; consumers keep what their
    // routes say they receive (the ferry routes' unpack bytes).
    const int S = m.trainer.stage_size();
    std::vector<std::map<uint32_t, uint64_t>> from(w.groups.size());  // per group: source -> bytes
    for (size_t t = 0; t < m.metadata.size(); ++t) {
      GroupWork& gw = w.groups[static_cast<size_t>(groups.of_tensor(t))];
      gw.broadcast_bytes += static_cast<uint64_t>(shape_numel(m.metadata[t].shape)) * dtype_size(m.metadata[t].dtype);
      gw.tensors += 1;
    }
    for (size_t g = 0; g < w.groups.size(); ++g) {
      w.groups[g].root = w.groups[g].stage * S;
      w.groups[g].transfers.clear();
      w.groups[g].pack_bytes.clear();
    }
    // Distinct boxes per tensor: the root's own, else the lowest rank's.
    std::map<std::pair<size_t, Shape>, int> holder;  // (tensor, box start) -> rank
    std::map<std::pair<size_t, Shape>, uint64_t> bytes;
    for (size_t r = 0; r < m.holdings->size(); ++r) {
      const Holdings& h = (*m.holdings)[r];
      for (const HeldBox& hb : h.boxes) {
        const TensorDecl& d = h.tensors[hb.tensor];
        const size_t t = index.at(d.name);
        const int root = m.tensor_stage[t] * S;
        auto key = std::make_pair(t, hb.box.start);
        auto it = holder.find(key);
        if (it == holder.end() || static_cast<int>(r) == root) holder[key] = static_cast<int>(r);
        bytes[key] = box_bytes(hb.box, d.dtype);
      }
    }
    for (const auto& [key, r] : holder) {
      const size_t g = static_cast<size_t>(groups.of_tensor(key.first));
      if (r != w.groups[g].root) from[g][static_cast<uint32_t>(r)] += bytes[key];
    }
    for (size_t g = 0; g < w.groups.size(); ++g) {
      for (const auto& [r, b] : from[g]) w.groups[g].gather.push_back({r, static_cast<uint32_t>(w.groups[g].root), b, 1});
    }
    // PP stages in series and groups in stage order: the broadcast actor walks the groups
    // in order, which is stage order already (pre, layers, post).
  }
  out.route_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

Status apply_delta(JobWorkload& job, Design design, double fraction, delta::ChangeLayout layout) {
  if (!(fraction >= 0 && fraction <= 1))
    return invalid_argument("--changed-fraction {}: must be between 0 and 1", fraction);
  if (design != Design::kFerry)
    return invalid_argument("--changed-fraction: only ferry's design sends deltas (got --design {})", design_name(design));
  const double r = delta::predicted_patch_ratio(fraction, job.element_bytes, layout);
  job.patch_ratio = r;
  auto scale = [](uint64_t b, double k) { return static_cast<uint64_t>(std::ceil(static_cast<double>(b) * k)); };
  job.bytes_moved = 0;
  for (GroupWork& gw : job.work.groups) {
    for (Flow& f : gw.transfers) {
      if (f.bytes == 0) continue;
      f.bytes = std::max<uint64_t>(delta::kPatchHeaderBytes, std::min(f.bytes + delta::kPatchHeaderBytes, scale(f.bytes, r)));
      job.bytes_moved += f.bytes;
    }
    for (uint64_t& b : gw.pack_bytes) b = scale(b, (3 + r) / 2);
    for (uint64_t& b : gw.unpack_bytes) b = scale(b, (1 + 2 * r) / 2);
  }
  job.max_consumer_bytes = scale(job.max_consumer_bytes, r);
  return Status::Ok();
}

Result<std::vector<std::vector<Flow>>> catch_up_rounds(const JobWorkload& job, int joiners) {
  if (job.engine_size <= 0 || job.consumer_param_bytes.size() != static_cast<size_t>(job.consumers))
    return invalid_argument("--catch-up: needs ferry's design (the routes' params per inference rank)");
  const int replicas = job.consumers / job.engine_size;
  if (joiners < 1 || joiners >= replicas)
    return invalid_argument("--catch-up {}: between 1 and {} (the job has {} replicas; at least one must hold the version)",
                            joiners, replicas - 1, replicas);
  const int holders = replicas - joiners;
  std::vector<std::vector<Flow>> rounds;
  // Per rank of a replica (a plan class is the same rank of every replica: same plan), the
  // places (holders, then joiners) in replica order, as each joiner's tree sees them.
  for (int r = 0; r < job.engine_size; ++r) {
    auto rank_of = [&](int place) { return place * job.engine_size + r; };  // replica `place`'s rank r
    for (int i = 0; i < joiners; ++i) {
      const size_t p = static_cast<size_t>(holders + i);
      const size_t parent = engine::catch_up_parent(static_cast<size_t>(holders), static_cast<size_t>(i));
      size_t round = 0;
      for (size_t n = static_cast<size_t>(holders); p >= n; n *= 2) ++round;
      if (rounds.size() < round) rounds.resize(round);
      const int to = rank_of(static_cast<int>(p)), from = rank_of(static_cast<int>(parent));
      rounds[round - 1].push_back(Flow{static_cast<uint32_t>(job.producers + from), static_cast<uint32_t>(job.producers + to),
                                       job.consumer_param_bytes[static_cast<size_t>(to)], 1});
    }
  }
  return rounds;
}

}  // namespace ferry::simulate
