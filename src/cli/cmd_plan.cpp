// `ferry plan`: routes a model from a trainer layout to an inference layout and prints
// what moves: the bytes every inference rank keeps (the minimum), the bytes ferry moves,
// what a broadcast design moves, the busiest producer and consumer, reads, plan time
// and peak memory.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "common/parallel.h"
#include "engine/group_order.h"
#include "engine/memory.h"
#include "ferry/engine.h"
#include "ferry/models.h"
#include "ferry/route.h"
#include "ferry/source.h"
#include "tools/broadcast.h"
#include "tools/config_path.h"
#include "tools/job_model.h"
#include "tools/proc_memory.h"

namespace ferry::cli {
namespace {

struct PlanArgs {
  std::string model;
  std::string trainer;
  std::string inference = "tp=1";
  std::string quantize = "none";
  std::string quantize_on = "producer";  // EngineOptions::quantize_on
  bool shrink = false;
  std::string config_overrides;  // JSON merged into the (shrunk) config, as demo/bench/simulate take
  bool json = false;
  bool every_rank = false;
  bool loader_record = false;
  uint64_t staging_budget = 0;  // ProducerOptions::staging_budget (0: two slots)
  bool no_failover = false;
  bool delta = false;  // EngineOptions::delta: producers keep a copy of what they staged (kept_copy)
  uint64_t delta_block_bytes = 0;  // EngineOptions::delta_block_bytes (no copy: a patch area)
  std::string commit = "in_place";  // the consumers' ConsumerOptions::commit
  std::string group_order = "rotated";  // EngineOptions::group_order (docs/group-order.md)
};

std::string human(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.2f} {}", b, units[u]);
}



int run_plan(const PlanArgs& a) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto found = tools::find_model_config(a.model);
  if (!found.ok()) return fail_with("plan", found.status());
  auto cfg = ModelConfig::load(*found);
  if (!cfg.ok()) return fail_with("plan", cfg.status());
  auto inference = InferenceLayout::parse(a.inference);
  if (!inference.ok()) return fail_with("plan", inference.status().with_context("--inference"));
  auto trainer = TrainerLayout::parse(a.trainer);
  if (!trainer.ok()) return fail_with("plan", trainer.status().with_context("--trainer"));
  auto quant = parse_quantize(a.quantize);
  if (!quant.ok()) return fail_with("plan", quant.status());
  LoaderOptions lopts;
  lopts.quantize = *quant;
  ModelConfig config = *cfg;
  if (a.shrink) {
    auto s = shrink_config(config, *inference, lopts);
    if (!s.ok()) return fail_with("plan", s.status());
    config = s->config;
  }
  if (!a.config_overrides.empty()) {
    nlohmann::json j = config.json();
    try {
      j.merge_patch(nlohmann::json::parse(a.config_overrides));
    } catch (const std::exception& e) {
      return fail_with("plan", invalid_argument("--config-overrides: {}", e.what()));
    }
    auto merged = ModelConfig::from_json(j, config.path());
    if (!merged.ok()) return fail_with("plan", merged.status().with_context("--config-overrides"));
    config = *merged;
  }
  auto loader = make_model_loader(config, *inference, lopts);
  if (!loader.ok()) return fail_with("plan", loader.status());
  // What the trainer publishes: the checkpoint's tensors in the dtype it holds them in.
  const std::vector<TensorDecl> meta = trainer_metadata((*loader)->checkpoint(), *trainer);

  // What routing this layout costs, before any holding is made: one that would not fit
  // (fsdp=1000000: 35 million route groups every rank would hold) is refused here, in
  // microseconds, saying what it would need, rather than after minutes and gigabytes.
  {
    auto boxes = count_held_boxes(meta, *trainer, model_info_from_config(config.json()));
    if (!boxes.ok()) return fail_with("plan", boxes.status().with_context("--trainer " + trainer->to_string()));
    RoutingCost cost;
    cost.producers = static_cast<uint64_t>(trainer->world_size());
    cost.plan_classes = static_cast<uint64_t>(a.every_rank ? inference->world_size() : inference->engine_size());
    cost.groups = static_cast<uint64_t>(Groups(meta).size());
    cost.held_boxes = *boxes;
    cost.every_op = false;  // the routes below make no op (RouterOptions::packs_of)
    auto avail = tools::mem_available_bytes();
    if (Status s = check_routing_cost(cost, avail.ok() ? *avail : 0); !s.ok())
      return fail_with("plan", 
          s.with_context(fmt::format("--trainer {} --inference {}", trainer->to_string(), inference->to_string())));
  }

  // Trainer holdings.
  const auto t_hold = clock::now();
  auto th = make_holdings(meta, *trainer, model_info_from_config(config.json()));
  if (!th.ok()) return fail_with("plan", th.status().with_context("--trainer " + trainer->to_string()));

  // Consumer plans: one per engine rank (the same rank of every replica loads the same
  // way); --every-rank records each rank and lets the router dedupe by hash.
  const auto t_rec = clock::now();
  const int world = inference->world_size();
  const int engine = inference->engine_size();
  const int recorded = a.every_rank ? world : engine;
  // On several threads (recording is per thread; the loader's rank cache is locked): the
  // 32 engine ranks of Kimi-K2 took 2 s on one.
  std::vector<Result<Plan>> recorded_plans(static_cast<size_t>(recorded), Result<Plan>(internal_error("not recorded")));
  if (a.every_rank && recorded > engine) {
    // Every replica's ranks recorded again: what they hold, from rank 0's plan, against
    // the memory there is, before any is recorded (replicas=400000 ran 21-46 s, then out
    // of memory).
    recorded_plans[0] = a.loader_record ? record_plan(**loader, 0, meta) : tools::record_rank_plan(**loader, 0, &meta);
    if (!recorded_plans[0].ok()) return fail_with("plan", recorded_plans[0].status());
    const uint64_t each = ferry::engine::plan_heap_bytes(*recorded_plans[0]);
    const double need = static_cast<double>(each) * recorded;
    if (auto room = tools::memory_room(); room && need > static_cast<double>(room->bytes)) {
      return fail_with("plan", invalid_argument(
          "--every-rank records a plan per inference rank: {} plans of ~{:.1f} KiB (rank 0's) need ~{:.1f} GiB, "
          "and {} leaves {:.1f} GiB; without --every-rank one plan per engine rank ({}) is recorded and the "
          "replicas share it", recorded, static_cast<double>(each) / 1024, need / (1ull << 30), room->bound,
          static_cast<double>(room->bytes) / (1ull << 30), engine));
    }
  }
  parallel_for(static_cast<size_t>(recorded), default_threads(16), [&](size_t i) {
    if (recorded_plans[i].ok()) return;  // (rank 0, recorded above)
    const int r = static_cast<int>(i);
    recorded_plans[i] = a.loader_record ? record_plan(**loader, r, meta) : tools::record_rank_plan(**loader, r, &meta);
  });
  std::vector<Plan> plans;
  plans.reserve(static_cast<size_t>(recorded));
  for (auto& plan : recorded_plans) {
    if (!plan.ok()) return fail_with("plan", plan.status());
    plans.push_back(std::move(*plan));
  }
  RouterInput in;
  in.metadata = meta;
  in.producers = std::move(th->ranks);
  for (int r = 0; r < world; ++r) in.consumers.push_back(&plans[static_cast<size_t>(a.every_rank ? r : r % engine)]);

  const auto t_route = clock::now();
  // Every rank's segments and reads, and op counts in the stats; no rank's packs, and
  // unpacks only where --quantize looks at them: a rank's own ops are what it builds and
  // holds (the engine's RouterOptions), the job's are a GiB at fsdp=4096.
  RouterOptions ropts;
  ropts.packs_of = RouterOptions::kNoRank;
  const bool on_producer = a.quantize_on == "producer" && lopts.quantize != Quantize::kNone;
  ropts.unpacks_of = lopts.quantize != Quantize::kNone && !on_producer ? RouterOptions::kEveryRank : RouterOptions::kNoRank;
  ropts.quantize_on = on_producer ? QuantizeOn::kProducer : QuantizeOn::kConsumer;
  auto routes = build_routes(in, ropts);
  if (!routes.ok()) return fail_with("plan", routes.status());
  const auto t_end = clock::now();
  const tools::BroadcastStats bc = tools::broadcast_baseline(meta, th->tensor_stage, world);

  auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
  const RouteStats& st = routes->stats;
  uint64_t params = 0, model_bytes = 0;
  for (const auto& d : meta) {
    params += static_cast<uint64_t>(shape_numel(d.shape));
    model_bytes += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  }
  // What every rank will hold beyond its weights / params (the engine's MemoryUse), as
  // Producer/Consumer will allocate it; a budget too small is refused here, up front.
  ProducerOptions po;
  po.staging_budget = a.staging_budget;
  po.failover = !a.no_failover;
  po.delta = a.delta;
  po.delta_block_bytes = a.delta_block_bytes;
  auto order = engine::parse_group_order(a.group_order);
  if (!order.ok()) {
    return fail_with("plan", invalid_argument("--group-order: unknown group order '{}' (layer, rotated, rotated-unpaced)",
                                              a.group_order));
  }
  po.group_order = order->kind;
  // The engine's own order from these routes (what each rank follows; ferry simulate
  // takes the same): lanes of groups, rounds of lanes, cohorts of consumers.
  const engine::GroupOrder go = engine::make_group_order(*routes, *order);
  if (Status c = engine::check_group_order(*routes, go); !c.ok()) return fail_with("plan", c);
  auto policy = parse_commit_policy(a.commit);
  if (!policy.ok()) return fail_with("plan", policy.status().with_context("--commit"));
  auto mem = predict_memory(*routes, meta, in.producers, in.consumers, po, *policy);
  if (!mem.ok()) return fail_with("plan", mem.status().with_context("--staging-budget"));
  auto largest = [](const std::vector<MemoryUse>& v) {
    size_t at = 0;
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i].extra() > v[at].extra()) at = i;
    return at;
  };
  const size_t max_p = largest(mem->producers), max_c = largest(mem->consumers);

  // With --quantize fp8: which side can quantise each param, from these routes (route.h,
  // quantize_sides): a prediction of trainer-side quantisation; the engine still
  // quantises on the consumer.
  struct QuantizeTotals {
    uint64_t params = 0, on_producer = 0, tiles_split = 0;
    uint64_t bytes_dense = 0, bytes_quantized_params = 0;  // summed over consumers, quantised params only
    uint64_t bytes_moved = 0;                              // every byte, with the producer quantising where it can
    std::vector<std::string> fell_back;                    // names (first few)
  };
  std::optional<QuantizeTotals> qt;
  BlockQuantizeFormat tiles;
  // With the producers quantising, the routes say what moves; the params that fell back
  // are those still dense in their class's route.
  std::vector<std::string> fell_back;
  if (on_producer) {
    for (size_t k = 0; k < routes->plans.size(); ++k) {
      const Plan* plan = nullptr;
      for (size_t c = 0; c < routes->consumer_plan.size() && !plan; ++c)
        if (routes->consumer_plan[c] == k) plan = in.consumers[c];
      for (const BlockQuantize& q : plan->quantized()) {
        if (routes->plans[k].params[q.param].dtype != DType::kF8E4M3 && fell_back.size() < 3)
          fell_back.push_back(plan->params()[q.param].name);
      }
    }
  }
  if (lopts.quantize != Quantize::kNone && !on_producer) {
    auto quantized = tools::quantized_params(**loader, *routes);
    if (!quantized.ok()) return fail_with("plan", quantized.status());
    tiles = quantized->format;
    auto sides = quantize_sides(*routes, quantized->per_plan, tiles);
    if (!sides.ok()) return fail_with("plan", sides.status());
    QuantizeTotals t;
    t.bytes_moved = st.bytes_moved;
    for (const QuantizeSide& q : *sides) {
      ++t.params;
      t.tiles_split += q.tiles_split * q.consumers;
      t.bytes_dense += q.bytes_dense * q.consumers;
      if (q.on_producer) {
        ++t.on_producer;
        t.bytes_quantized_params += q.bytes_quantized * q.consumers;
        t.bytes_moved -= (q.bytes_dense - q.bytes_quantized) * q.consumers;
      } else {
        t.bytes_quantized_params += q.bytes_dense * q.consumers;
        if (t.fell_back.size() < 3) t.fell_back.push_back(q.name);
      }
    }
    qt = t;
  }
  const double plan_seconds = secs(t_end - t0);
  const double plan_cpu_seconds = self_cpu_seconds();
  const uint64_t rss = self_peak_rss_bytes();

  if (a.json) {
    nlohmann::json j;
    j["model"] = config.path();
    j["architecture"] = config.architecture();
    j["trainer"] = trainer->to_string();
    j["inference"] = inference->to_string();
    j["producers"] = trainer->world_size();
    j["consumers"] = world;
    j["plan_classes"] = st.num_plan_classes;
    j["tensors"] = meta.size();
    j["params"] = params;
    j["model_bytes"] = model_bytes;
    j["bytes_min"] = st.bytes_min;
    j["bytes_moved"] = st.bytes_moved;
    j["bytes_broadcast"] = bc.bytes;
    j["max_producer_bytes"] = st.max_producer_bytes;
    j["max_consumer_bytes"] = st.max_consumer_bytes;
    j["mean_producer_bytes"] = st.mean_producer_bytes;
    j["balance_bound_bytes"] = st.balance_bound;
    j["balance"] = st.balance;
    j["broadcast_max_producer_bytes"] = bc.max_producer_bytes;
    j["broadcast_max_consumer_bytes"] = bc.max_consumer_bytes;
    j["num_reads"] = st.num_reads;
    j["num_pack_ops"] = st.num_pack_ops;
    j["num_unpack_ops"] = st.num_unpack_ops;
    j["max_staging_bytes"] = st.max_staging_bytes;
    j["plan_seconds"] = plan_seconds;
    j["plan_cpu_seconds"] = plan_cpu_seconds;
    j["component_bound_bytes"] = st.component_bound;
    j["record_seconds"] = secs(t_route - t_rec);
    j["route_seconds"] = secs(t_end - t_route);
    j["peak_rss_bytes"] = rss;
    auto mem_json = [](const MemoryUse& m) {
      return nlohmann::json{{"staging_ring", m.staging_ring}, {"receive_ring", m.receive_ring},
                            {"metadata", m.metadata},         {"transport_allowance", m.transport_allowance},
                            {"shadow", m.shadow},             {"kept_copy", m.kept_copy},
                            {"extra", m.extra()}};
    };
    nlohmann::json pm = nlohmann::json::array(), cm = nlohmann::json::array();
    for (const auto& m : mem->producers) pm.push_back(mem_json(m));
    for (const auto& m : mem->consumers) cm.push_back(mem_json(m));
    j["group_order"] = engine::group_order_name(*order);
    if (order->kind != GroupOrderKind::kLayer) {
      j["lanes"] = go.num_lanes();
      j["lane_groups"] = go.lane_sizes();
      j["round_lanes"] = go.round_sizes();
      j["cohort_sizes"] = go.cohort_sizes();
    }
    if (on_producer) {
      j["quantize"] = {{"format", quantize_name(lopts.quantize)},
                       {"on", "producer"},
                       {"params", st.quantized_params},
                       {"params_on_producer", st.quantized_on_producer},
                       {"regions", st.quant_regions},
                       {"fell_back_examples", fell_back}};
    }
    if (qt) {
      j["quantize_on_producer"] = {{"params", qt->params},
                                   {"params_on_producer", qt->on_producer},
                                   {"tiles_split", qt->tiles_split},
                                   {"bytes_quantized_params_consumer_side", qt->bytes_dense},
                                   {"bytes_quantized_params_producer_side", qt->bytes_quantized_params},
                                   {"bytes_moved_producer_side", qt->bytes_moved},
                                   {"fell_back_examples", qt->fell_back}};
    }
    j["staging_budget"] = a.staging_budget;
    j["memory"] = {{"producers", pm}, {"consumers", cm}, {"max_producer_extra", mem->producers[max_p].extra()},
                   {"max_consumer_extra", mem->consumers[max_c].extra()}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  auto row = [](const char* k, const std::string& v) { std::printf("  %-34s %s\n", k, v.c_str()); };
  std::printf("ferry plan: %s (%s)\n", config.architecture().c_str(), config.path().c_str());
  std::printf("  trainer %s (%d ranks) -> inference %s (%d ranks, %llu distinct plans)\n", trainer->to_string().c_str(),
              trainer->world_size(), inference->to_string().c_str(), world,
              static_cast<unsigned long long>(st.num_plan_classes));
  row("model parameters", fmt::format("{} ({} tensors)", params, meta.size()));
  row("model bytes", human(static_cast<double>(model_bytes)));
  row("bytes inference ranks keep (min)", human(static_cast<double>(st.bytes_min)));
  row("bytes ferry moves", fmt::format("{} ({:.3f}x min)", human(static_cast<double>(st.bytes_moved)),
                                       st.bytes_min ? static_cast<double>(st.bytes_moved) / st.bytes_min : 1.0));
  row("bytes broadcast moves", fmt::format("{} ({:.2f}x ferry)", human(static_cast<double>(bc.bytes)),
                                           st.bytes_moved ? static_cast<double>(bc.bytes) / st.bytes_moved : 0.0));
  row("max bytes one producer sends",
      fmt::format("{} (mean {}, bound {}: {:.3f}x; stage bound {}: {:.3f}x; broadcast {})",
                  human(static_cast<double>(st.max_producer_bytes)), human(st.mean_producer_bytes),
                  human(st.balance_bound), st.balance, human(st.component_bound),
                  st.component_bound > 0 ? static_cast<double>(st.max_producer_bytes) / st.component_bound : 1.0,
                  human(static_cast<double>(bc.max_producer_bytes))));
  row("max bytes one consumer receives", fmt::format("{} (broadcast {})", human(static_cast<double>(st.max_consumer_bytes)),
                                                     human(static_cast<double>(bc.max_consumer_bytes))));
  row("reads", fmt::format("{} ({} pack ops, {} unpack ops)", st.num_reads, st.num_pack_ops, st.num_unpack_ops));
  row("largest staging (producer, group)", human(static_cast<double>(st.max_staging_bytes)));
  row("plan time", fmt::format("{:.3f} s wall, {:.3f} s cpu (holdings {:.3f}, record {} plans {:.3f}, route {:.3f})",
                               plan_seconds, plan_cpu_seconds, secs(t_rec - t_hold), recorded, secs(t_route - t_rec),
                               secs(t_end - t_route)));
  row("peak memory (ru_maxrss)", human(static_cast<double>(rss)));
  if (on_producer) {
    // Counted over plan classes (a class's params once).
    row(fmt::format("{} on the producers", quantize_name(lopts.quantize)).c_str(),
        fmt::format("{} of {} quantised params quantised by a trainer rank ({} regions){}", st.quantized_on_producer,
                    st.quantized_params, st.quant_regions,
                    fell_back.empty() ? std::string()
                                      : fmt::format("; the rest on the consumer (e.g. {})", fmt::join(fell_back, ", "))));
  }
  if (qt) {
    // Counted over plan classes (a class's params once), bytes over every consumer.
    row(fmt::format("{} on the producer (prediction)", quantize_name(lopts.quantize)).c_str(),
        fmt::format("{} of {} quantised params have every {}x{} tile from one producer{}", qt->on_producer,
                    qt->params, tiles.block_rows, tiles.block,
                    qt->fell_back.empty() ? std::string()
                                          : fmt::format("; the rest stay on the consumer (e.g. {})",
                                                        fmt::join(qt->fell_back, ", "))));
    row("  their bytes (consumer/producer)",
        fmt::format("{} / {} ({:.3f}x)", human(static_cast<double>(qt->bytes_dense)),
                    human(static_cast<double>(qt->bytes_quantized_params)),
                    qt->bytes_dense ? static_cast<double>(qt->bytes_quantized_params) / qt->bytes_dense : 1.0));
    row("  bytes ferry would move",
        fmt::format("{} ({:.3f}x the {} moved with --quantize-on consumer)",
                    human(static_cast<double>(qt->bytes_moved)),
                    st.bytes_moved ? static_cast<double>(qt->bytes_moved) / st.bytes_moved : 1.0,
                    human(static_cast<double>(st.bytes_moved))));
  }
  if (order->kind == GroupOrderKind::kLayer) {
    row("group order", "layer (every consumer takes the groups in layer order; --group-order rotated: every stage at once)");
  } else {
    row("group order", fmt::format("{}: {}", engine::group_order_name(*order), go.summary()));
  }
  // Predicted extra memory per rank (docs/engine.md, "Memory"): ranks with the same
  // figures are listed together.
  std::printf("  predicted extra memory per rank (beyond weights / params; staging budget %s):\n",
              a.staging_budget ? human(static_cast<double>(a.staging_budget)).c_str() : "default, two slots");
  // Ranks with the same ring to the MiB (metadata differs by bytes) share one line: the ranks
  // (ranges), then the largest figures among them.
  auto rows = [&](const char* role, const std::vector<MemoryUse>& v, bool producer) {
    std::map<uint64_t, std::vector<size_t>> by_ring;
    for (size_t i = 0; i < v.size(); ++i) by_ring[(producer ? v[i].staging_ring : v[i].receive_ring) >> 20].push_back(i);
    for (auto it = by_ring.rbegin(); it != by_ring.rend(); ++it) {
      const std::vector<size_t>& r = it->second;
      std::string who;
      for (size_t a = 0; a < r.size();) {
        size_t b = a;
        while (b + 1 < r.size() && r[b + 1] == r[b] + 1) ++b;
        who += (who.empty() ? "" : ",") + (a == b ? std::to_string(r[a]) : fmt::format("{}-{}", r[a], r[b]));
        a = b + 1;
      }
      if (who.size() > 40) who = who.substr(0, 37) + "...";
      MemoryUse m = v[r[0]];
      for (size_t q : r)
        if (v[q].extra() > m.extra()) m = v[q];
      std::printf("    %zu %s%s %s: %s = %s %s%s%s + metadata %s + transport allowance %s\n", r.size(), role,
                  r.size() == 1 ? "" : "s", who.c_str(), human(static_cast<double>(m.extra())).c_str(),
                  producer ? "staging ring" : "receive ring",
                  human(static_cast<double>(producer ? m.staging_ring : m.receive_ring)).c_str(),
                  m.shadow ? (" + shadow params " + human(static_cast<double>(m.shadow))).c_str() : "",
                  m.kept_copy ? (" + delta kept copy " + human(static_cast<double>(m.kept_copy))).c_str() : "",
                  human(static_cast<double>(m.metadata)).c_str(), human(static_cast<double>(m.transport_allowance)).c_str());
    }
  };
  rows("producer", mem->producers, true);
  rows("consumer", mem->consumers, false);
  return 0;
}

FERRY_COMMAND(plan_command, "plan",
              "Route a model from a trainer layout to an inference layout and print what moves (vs broadcast)",
              [](CLI::App& app) -> std::function<int()> {
                auto a = std::make_shared<PlanArgs>();
                app.add_option("--model,-m", a->model, "HF config.json of the model")->required();
                app.add_option("--trainer,-t", a->trainer,
                               "Trainer layout: \"tp=..,pp=..,ep=..,etp=..[,dp=..][,world=..]\" or \"fsdp=N\"")
                    ->required();
                app.add_option("--inference,-i", a->inference, "Inference layout: \"tp=..,dp=..,ep=..,replicas=..\"")
                    ->default_val("tp=1");
                app.add_option("--quantize", a->quantize, "Inference post-processing: none | fp8 | fp8-ue8m0 | mxfp8")->default_val("none");
                app.add_option("--quantize-on", a->quantize_on,
                               "Where --quantize runs (EngineOptions::quantize_on): producer (the routes carry FP8 "
                               "values and scales wherever one trainer rank holds a param's every tile; the rest "
                               "fall back to the consumer) | consumer (the routes carry what the trainer holds; "
                               "the report then predicts the producer side)")
                    ->check(CLI::IsMember({"producer", "consumer"}))
                    ->default_val("producer");
                app.add_flag("--shrink", a->shrink, "Route a structurally equal small variant of the model");
                app.add_option("--config-overrides", a->config_overrides,
                               "JSON merged into the config (after --shrink), as demo, bench and simulate take it "
                               "(e.g. '{\"quantization_config\": null}': the model as a BF16 trainer holds it)");
                app.add_flag("--every-rank", a->every_rank,
                             "Record every inference rank's plan (default: one per engine rank, shared by replicas)");
                app.add_flag("--loader-record", a->loader_record,
                             "Record with record_plan() over every checkpoint tensor (default: skip the tensors a rank "
                             "loads nothing from)");
                app.add_option("--staging-budget", a->staging_budget,
                               "Each producer's staging budget (bytes; suffixes KiB, MiB, GiB; 0: two slots of its "
                               "largest group); refused when smaller than the largest group, with the bytes needed")
                    ->check(size_not_negative())
                    ->transform(CLI::AsSizeValue(false));
                app.add_flag("--no-failover", a->no_failover,
                             "Size staging as a producer without failover (no worst case for a replica's boxes)");
                CLI::Option* delta = app.add_flag("--delta", a->delta,
                             "Producers run delta syncs: each keeps a copy of every byte it stages (reported as "
                             "delta kept copy; docs/delta.md)");
                app.add_option("--delta-block-bytes", a->delta_block_bytes,
                               "With --delta: producers keep no copy, only block hashes; a patch area the size of "
                               "the staging ring and its block hashes are reported instead")
                    ->check(delta_block_bytes_in())
                    ->needs(delta);
                app.add_option("--commit", a->commit,
                               "The consumers' commit policy: in_place, shadow (each consumer holds one more copy "
                               "of its params, reported as shadow params) or groups (a bounded shadow: the layer "
                               "groups in flight, about the largest)")
                    ->check(CLI::IsMember({"in_place", "shadow", "groups"}))
                    ->default_val("in_place");
                app.add_option("--group-order", a->group_order,
                               "The order groups move in (EngineOptions::group_order): rotated (the default) | layer | "
                               "rotated-unpaced (docs/group-order.md); prints its lanes, rounds and cohorts")
                    ->default_val("rotated");
                app.add_flag("--json", a->json, "Print one JSON object");
                return [a] { return run_plan(*a); };
              });

}  // namespace
}  // namespace ferry::cli
