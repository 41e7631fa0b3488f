// `ferry simulate`: predicts a sync's seconds on a described cluster, for ferry's design
// (from the real routes) or for the designs it replaces, on SimGrid (docs/simulation.md).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/plot.h"
#include "engine/group_order.h"
#include "simulate/cluster.h"
#include "simulate/simulate.h"
#include "simulate/workload.h"
#include "tools/config_path.h"
#include "tools/subprocess.h"

namespace ferry::cli {
namespace {

using namespace ferry::simulate;

struct SimulateArgs {
  JobSpec job;
  std::string cluster;
  std::string design = "ferry";
  std::string mode = "pull";
  std::string order = "rotated";
  const CLI::Option* order_given = nullptr;  // --order given (other designs have none: an error)
  double changed_fraction = 0;
  const CLI::Option* changed_given = nullptr;  // --changed-fraction given: a delta sync
  std::string quantize = "none";
  std::string quantize_on;  // "": as the engine (producer where there is something to quantise)
  std::string changes = "scattered";
  bool json = false;
  bool relay = false;  // every inference rank under ConsumerOptions::relay within its node
  std::string plot;
  int catch_up = 0;  // > 0: the last N replicas join and catch up (Consumer::catch_up)
};



// The --plot picture: NIC receive utilisation over time, drawn by Debian's matplotlib
// (python3-matplotlib) from the JSON result; ferry itself carries no plotting code.
constexpr const char* kPlotScript = R"PY(
r = json.load(open(sys.argv[1]))
fig, ax = plt.subplots(figsize=(9, 4.5))
dt = r["timeline"]["bin_seconds"]
for row in r["timeline"]["rx_utilisation"]:
    v = row["utilisation"]
    ax.step([i * dt for i in range(len(v))], v, where="post", label=row["nic"], linewidth=1)
ax.set_xlabel("seconds")
ax.set_ylabel("receive utilisation (of NIC rate)")
ax.set_ylim(0, 1.05)
ax.set_title("%s %s: %s -> %s, %.3f s (floor %.3f s)" % (r["design"], r["mode"], r["trainer"], r["inference"],
             r["seconds"], r["floor_seconds"]), fontsize=9)
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=120)
)PY";

Status run_python(const std::vector<std::string>& args) { return run_plot_script(kPlotScript, args, "--plot"); }

std::string gb(double b) { return fmt::format("{:.2f} GB", b / 1e9); }

// --catch-up N (docs/elastic.md): the last N replicas of the layout join and read the live
// version from the replicas that hold it, as the engine's tree does (one SimGrid run of
// its rounds, here), against the same joiners served by the trainer: a sync of a job whose
// inference side is the N joining replicas alone (a child `ferry simulate`, SimGrid runs
// once per process; on a non-blocking fabric which nodes they sit on does not matter).
int run_catch_up(const SimulateArgs& a, const JobSpec& job, const ClusterSpec& cluster) {
  auto layout = InferenceLayout::parse(a.job.inference);
  if (!layout.ok()) return fail_with("simulate", layout.status().with_context("--inference"));
  const auto t0 = std::chrono::steady_clock::now();
  auto work = build_workload(job, Design::kFerry);
  if (!work.ok()) return fail_with("simulate", work.status());
  auto rounds = catch_up_rounds(*work, a.catch_up);
  if (!rounds.ok()) return fail_with("simulate", rounds.status());
  auto ends = run_rounds(cluster, work->producers, work->consumers, *rounds);
  if (!ends.ok()) return fail_with("simulate", ends.status());
  uint64_t max_joiner = 0;
  for (const auto& round : *rounds)
    for (const Flow& f : round) max_joiner = std::max(max_joiner, f.bytes);
  // From the trainer: the joiners alone as the job's inference side.
  InferenceLayout joiners = *layout;
  joiners.replicas = a.catch_up;
  tools::ProcessSpec ps;
  ps.argv = {tools::exe_path(), "simulate", "--json", "--model", a.job.model, "--trainer", a.job.trainer, "--inference",
             joiners.to_string(), "--cluster", a.cluster, "--mode", a.mode, "--order", a.order, "--quantize", a.quantize};
  if (!a.job.config_overrides.empty()) ps.argv.insert(ps.argv.end(), {"--config-overrides", a.job.config_overrides});
  if (!a.quantize_on.empty()) ps.argv.insert(ps.argv.end(), {"--quantize-on", a.quantize_on});
  if (a.job.staging_budget) ps.argv.insert(ps.argv.end(), {"--staging-budget", std::to_string(a.job.staging_budget)});
  if (a.job.shrink) ps.argv.push_back("--shrink");
  ps.log = fmt::format("/tmp/ferry-simulate-catch-up-{}.log", getpid());
  ps.name = "ferry simulate (the joiners from the trainer)";
  auto child = tools::spawn(ps);
  if (!child.ok()) return fail_with("simulate", child.status());
  auto st = tools::wait_exit(*child, std::chrono::steady_clock::now() + std::chrono::hours(2));
  const std::string log = tools::read_log(*child);
  std::filesystem::remove(ps.log);
  if (!st) tools::kill_now(*child);
  nlohmann::json trainer;
  const size_t brace = log.find('{');
  if (brace != std::string::npos) trainer = nlohmann::json::parse(log.substr(brace), nullptr, false);
  if (!st || !WIFEXITED(*st) || WEXITSTATUS(*st) != 0 || !trainer.is_object() || !trainer.contains("seconds"))
    return fail_with("simulate", internal_error("--catch-up: the joiners' sync from the trainer failed:\n{}", log));
  const double from_replicas = ends->empty() ? 0.0 : ends->back();
  const double from_trainer = trainer["seconds"].get<double>();
  nlohmann::json j;
  j["model"] = a.job.model;
  j["trainer"] = a.job.trainer;
  j["inference"] = a.job.inference;
  j["cluster"] = cluster.name.empty() ? a.cluster : cluster.name;
  j["joining_replicas"] = a.catch_up;
  j["holding_replicas"] = layout->replicas - a.catch_up;
  j["rounds_end_seconds"] = *ends;
  j["from_replicas_seconds"] = from_replicas;
  j["from_trainer_seconds"] = from_trainer;
  j["from_trainer_floor_seconds"] = trainer.value("floor_seconds", 0.0);
  j["max_joiner_bytes"] = max_joiner;
  j["route_seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  j["from_trainer"] = trainer;
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("ferry simulate: %d of %d replicas join (%s -> %s on %s)\n", a.catch_up, layout->replicas,
              a.job.trainer.c_str(), a.job.inference.c_str(), j["cluster"].get<std::string>().c_str());
  std::printf("  from the replicas         %.3f s   (%zu round(s) of the catch-up tree; busiest joiner reads %s)\n",
              from_replicas, ends->size(), gb(static_cast<double>(max_joiner)).c_str());
  std::printf("  from the trainer          %.3f s   (a sync of the %d joining replicas alone, floor %.3f s)\n",
              from_trainer, a.catch_up, trainer.value("floor_seconds", 0.0));
  return 0;
}

int run_simulate(const SimulateArgs& a) {
  auto design = parse_design(a.design);
  if (!design.ok()) return fail_with("simulate", design.status());
  auto mode = parse_mode(a.mode);
  if (!mode.ok()) return fail_with("simulate", mode.status());
  if (*design != Design::kFerry && *mode == Mode::kPush) {
    return fail_with("simulate", invalid_argument("--mode push: only ferry's design has a push mode (got --design {})", a.design));
  }
  auto order = engine::parse_group_order(*design == Design::kFerry || a.order_given->count() > 0 ? a.order : "layer");
  if (!order.ok()) return fail_with("simulate", order.status());
  if (*design != Design::kFerry && order->kind != engine::GroupOrderKind::kLayer) {
    return fail_with("simulate", invalid_argument("--order {}: only ferry's design has a group order (got --design {})",
                                                  a.order, a.design));
  }
  const bool rotated = order->kind != engine::GroupOrderKind::kLayer;
  JobSpec job = a.job;
  job.order = *order;
  auto quant = parse_quantize(a.quantize);
  if (!quant.ok()) return fail_with("simulate", quant.status().with_context("--quantize"));
  job.quantize = *quant;
  if (!a.quantize_on.empty() && a.quantize_on != "consumer" && a.quantize_on != "producer") {
    return fail_with("simulate", invalid_argument("--quantize-on: '{}' is not consumer or producer", a.quantize_on));
  }
  // Unset: as the engine does (EngineOptions::quantize_on), on the producers wherever
  // ferry's design has something to quantise.
  job.quantize_on_producer = a.quantize_on.empty() ? job.quantize != Quantize::kNone && a.design == "ferry"
                                                   : a.quantize_on == "producer";
  // A relative cluster file is found as a model config is (working directory, the
  // installed share/ferry/, the source tree), so configs/clusters/*.json work anywhere.
  auto cluster_path = tools::find_model_config(a.cluster);
  if (!cluster_path.ok()) return fail_with("simulate", cluster_path.status().with_context("--cluster"));
  auto cluster = ClusterSpec::load(*cluster_path);
  if (!cluster.ok()) return fail_with("simulate", cluster.status().with_context("--cluster"));
  if (!a.plot.empty()) {
    // Before minutes of simulation: is matplotlib there at all?
    auto st = run_python({});
    if (!st.ok()) return fail_with("simulate", st);
  }
  if (a.relay) job.relay_node_gpus = cluster->inference.gpus_per_node;
  if (a.catch_up > 0) {
    const bool delta_given = a.changed_given && a.changed_given->count() > 0;
    if (*design != Design::kFerry || delta_given || a.relay || !a.plot.empty())
      return fail_with("simulate", invalid_argument("--catch-up: ferry's design only, without --changed-fraction, --relay "
                                                    "or --plot"));
    return run_catch_up(a, job, *cluster);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto work = build_workload(job, *design);
  if (!work.ok()) return fail_with("simulate", work.status());
  // Given at all: a delta sync, and apply_delta refuses what is not in [0, 1] (nan and
  // -0.5 ran dense when a negative value meant none).
  const bool delta = a.changed_given && a.changed_given->count() > 0;
  if (delta) {
    auto layout = delta::parse_change_layout(a.changes);
    if (!layout.ok()) return fail_with("simulate", layout.status().with_context("--changes"));
    if (Status st = apply_delta(*work, *design, a.changed_fraction, *layout); !st.ok()) return fail_with("simulate", st);
  }
  const auto t1 = std::chrono::steady_clock::now();
  SimOptions opts;
  opts.design = *design;
  opts.mode = *mode;
  auto r = run_simulation(*cluster, work->work, opts);
  if (!r.ok()) return fail_with("simulate", r.status());
  const auto t2 = std::chrono::steady_clock::now();
  auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };

  nlohmann::json j;
  j["design"] = a.design;
  j["mode"] = a.mode;
  j["model"] = a.job.model;
  j["trainer"] = a.job.trainer;
  j["inference"] = a.job.inference;
  j["cluster"] = cluster->name.empty() ? a.cluster : cluster->name;
  j["producers"] = work->producers;
  j["consumers"] = work->consumers;
  j["seconds"] = r->seconds;
  j["floor_seconds"] = r->floor_seconds;
  j["rx_floor_seconds"] = r->rx_floor_seconds;
  j["lockstep_seconds"] = r->lockstep_seconds;
  if (rotated) {
    j["order"] = a.order;
    j["order_lockstep_seconds"] = r->order_lockstep_seconds;
    j["lanes"] = work->lanes;
    j["cohort_sizes"] = work->cohort_sizes;
    j["lane_groups"] = work->lane_groups;
    j["round_lanes"] = work->round_lanes;
  }
  nlohmann::json cp = nlohmann::json::array();
  for (const auto& [k, v] : r->critical_path) cp.push_back({{"phase", k}, {"seconds", v}});
  j["critical_path"] = cp;
  auto nic = [&](size_t i) {
    const NicUse& u = r->nics[i];
    return nlohmann::json{{"nic", u.name},
                          {"bytes_in", u.bytes_in},
                          {"bytes_out", u.bytes_out},
                          {"rate_bytes_per_s", u.rate},
                          {"rx_utilisation", r->seconds > 0 ? u.bytes_in / u.rate / r->seconds : 0.0},
                          {"tx_utilisation", r->seconds > 0 ? u.bytes_out / u.rate / r->seconds : 0.0}};
  };
  nlohmann::json nics = nlohmann::json::array();
  for (size_t i = 0; i < r->nics.size(); ++i)
    if (r->nics[i].bytes_in || r->nics[i].bytes_out) nics.push_back(nic(i));
  if (!r->nics.empty()) {
    j["busiest_rx_nic"] = nic(r->busiest_rx);
    j["busiest_tx_nic"] = nic(r->busiest_tx);
  }
  j["nics"] = nics;
  if (delta) {
    j["changed_fraction"] = a.changed_fraction;
    j["changes"] = a.changes;
    j["element_bytes"] = work->element_bytes;
    j["patch_ratio"] = work->patch_ratio;
  }
  if (job.quantize != Quantize::kNone) {
    j["quantize"] = a.quantize;
    j["quantize_on"] = job.quantize_on_producer ? "producer" : "consumer";
    if (job.quantize_on_producer) {
      j["quantized_params"] = work->quantized_params;
      j["quantized_on_producer"] = work->quantized_on_producer;
    }
  }
  j["model_bytes"] = work->model_bytes;
  j["max_consumer_bytes"] = work->max_consumer_bytes;
  j["bytes_moved"] = *design == Design::kBroadcast ? 0 : work->bytes_moved;
  j["flows"] = r->flows;
  j["route_seconds"] = secs(t1 - t0);
  j["simulate_seconds"] = secs(t2 - t1);
  j["cpu_seconds"] = self_cpu_seconds();
  j["peak_rss_bytes"] = self_peak_rss_bytes();
  nlohmann::json tl = nlohmann::json::array();
  for (const auto& [name, v] : r->rx_timeline) tl.push_back({{"nic", name}, {"utilisation", v}});
  j["timeline"] = {{"bin_seconds", r->bin_seconds}, {"rx_utilisation", tl}};

  if (!a.plot.empty()) {
    const std::string tmp = fmt::format("{}.{}.json", a.plot, getpid());
    {
      std::ofstream f(tmp);
      f << j.dump();
      if (!f) return fail_with("simulate", io_error("--plot: cannot write '{}'", tmp));
    }
    auto st = run_python({tmp, a.plot});
    std::filesystem::remove(tmp);
    if (!st.ok()) return fail_with("simulate", st);
  }
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  const std::string order_note = rotated ? ", " + a.order + " order" : "";
  std::printf("ferry simulate: %s (%s%s), %s -> %s on %s\n", a.design.c_str(), a.mode.c_str(), order_note.c_str(),
              a.job.trainer.c_str(), a.job.inference.c_str(), j["cluster"].get<std::string>().c_str());
  std::printf("  predicted sync            %.3f s   (floor %.3f s: busiest NIC bytes / rate; receive side %.3f s)\n",
              r->seconds, r->floor_seconds, r->rx_floor_seconds);
  if (delta) {
    std::printf("  delta sync: %g%% of elements changed (%s), %.2f bytes per element: patches %.3f%% of the dense bytes\n",
                100 * a.changed_fraction, a.changes.c_str(), work->element_bytes, 100 * work->patch_ratio);
  }
  if (job.quantize_on_producer) {
    std::printf("  fp8 on the producer       %llu of %llu quantised params (every tile from one producer: the "
                "engine's routes, RouterOptions::quantize_on); %s moved\n",
                static_cast<unsigned long long>(work->quantized_on_producer),
                static_cast<unsigned long long>(work->quantized_params),
                gb(static_cast<double>(work->bytes_moved)).c_str());
  }
  if (r->lockstep_seconds > 0) {
    std::printf("  groups in lockstep        %.3f s   (sum over groups of the group's busiest NIC bytes / rate)\n",
                r->lockstep_seconds);
  }
  if (rotated) {
    std::printf("  steps in lockstep         %.3f s   (sum over steps of the busiest NIC bytes / rate, %s order)\n",
                r->order_lockstep_seconds, a.order.c_str());
    std::printf("  %s\n", work->order_summary.c_str());
  }
  std::printf("  critical path:\n");
  for (const auto& [k, v] : r->critical_path) {
    if (k.rfind("(", 0) == 0) {
      std::printf("    %s\n", k.c_str());
    } else {
      std::printf("    %-46s %.3f s\n", k.c_str(), v);
    }
  }
  if (!r->nics.empty()) {
    for (auto [what, i] : {std::pair<const char*, size_t>{"busiest receiving NIC", r->busiest_rx},
                           std::pair<const char*, size_t>{"busiest sending NIC", r->busiest_tx}}) {
      const NicUse& u = r->nics[i];
      const uint64_t b = what[8] == 'r' ? u.bytes_in : u.bytes_out;
      std::printf("  %-25s %s: %s at %.1f GB/s, %.0f%% utilised\n", what, u.name.c_str(), gb(static_cast<double>(b)).c_str(),
                  u.rate / 1e9, r->seconds > 0 ? 100.0 * b / u.rate / r->seconds : 0.0);
    }
  }
  std::printf("  bytes: model %s, busiest inference rank receives %s; %llu flows\n",
              gb(static_cast<double>(work->model_bytes)).c_str(), gb(static_cast<double>(work->max_consumer_bytes)).c_str(),
              static_cast<unsigned long long>(r->flows));
  std::printf("  took %.2f s routing + %.2f s simulating (%.2f s cpu), peak RSS %.0f MiB (--json lists bytes per NIC)\n",
              secs(t1 - t0), secs(t2 - t1), self_cpu_seconds(), static_cast<double>(self_peak_rss_bytes()) / (1 << 20));
  return 0;
}

FERRY_COMMAND(simulate_command, "simulate",
              "Predict a sync's seconds on a described cluster (ferry, broadcast or sharded-gather design) on SimGrid",
              [](CLI::App& app) -> std::function<int()> {
                auto a = std::make_shared<SimulateArgs>();
                app.add_option("--model,-m", a->job.model, "HF config.json of the model")->required();
                app.add_option("--config-overrides", a->job.config_overrides,
                               "JSON merged into the config (e.g. '{\"quantization_config\": null}': bf16)");
                app.add_option("--trainer,-t", a->job.trainer, "Trainer layout: \"tp=..,pp=..,ep=..,etp=..[,dp=..]\"")
                    ->required();
                app.add_option("--inference,-i", a->job.inference, "Inference layout: \"tp=..,dp=..,ep=..,replicas=..\"")
                    ->required();
                app.add_option("--cluster,-c", a->cluster, "Cluster description (JSON; docs/simulation.md)")->required();
                app.add_option("--design", a->design, "ferry | broadcast | sharded-gather")->default_val("ferry");
                app.add_option("--mode", a->mode, "ferry's mode: pull | push")->default_val("pull");
                a->order_given = app.add_option("--order", a->order,
                               "ferry's group order: rotated (the engine's default) | layer | rotated-unpaced "
                               "(docs/group-order.md)")
                    ->default_val("rotated");
                a->changed_given = app.add_option("--changed-fraction", a->changed_fraction,
                               "Predict a delta sync (docs/delta.md): this fraction (0..1) of the elements changed "
                               "since the version every consumer holds");
                app.add_option("--changes", a->changes,
                               "How the changed elements lie, with --changed-fraction: scattered (one by one) | "
                               "clustered (whole tensors or experts)")
                    ->default_val("scattered");
                app.add_option("--quantize", a->quantize,
                               "What the inference ranks keep: none | fp8 (e4m3, 128x128 blocks, fp32 scales) | fp8-ue8m0 | mxfp8")
                    ->default_val("none");
                app.add_option("--quantize-on", a->quantize_on,
                               "With --quantize fp8: producer (the engine's default: params whose every tile one "
                               "trainer rank holds cross as FP8 + scales, the engine's own routes) | consumer (the "
                               "trainer's bf16 crosses; the inference ranks quantise)");
                app.add_option("--staging-budget", a->job.staging_budget,
                               "Each producer's staging budget (bytes, suffixes KiB, MiB, GiB; 0: two slots)")
                    ->check(size_not_negative())
                    ->transform(CLI::AsSizeValue(false));
                app.add_option("--groups-in-flight", a->job.groups_in_flight,
                               "Groups each consumer reads at once (its receive budget; 1: the engine's, each group's "
                               "reads posted once the one before landed), each one more receive slot")
                    ->check(CLI::Range(1, 64));
                app.add_flag("--relay", a->relay,
                             "Every inference rank relays within its node (ConsumerOptions::relay, docs/relay.md): "
                             "one replica of each rank reads from the trainer, the others copy from it inside the node");
                app.add_flag("--shrink", a->job.shrink,
                             "Route a structurally equal small variant of the model (what ferry demo syncs)");
                app.add_option("--catch-up", a->catch_up,
                               "Predict N joining replicas (the last N of --inference) catching up to the live version "
                               "from the others (Consumer::catch_up's tree, docs/elastic.md) against the same joiners "
                               "served by the trainer (a sync of the N replicas alone)")
                    ->check(CLI::Range(1, 1 << 20));
                app.add_flag("--json", a->json, "Print one JSON object");
                app.add_option("--plot", a->plot,
                               "Write a PNG of NIC receive utilisation over time (needs python3-matplotlib)");
                return [a] { return run_simulate(*a); };
              });

}  // namespace
}  // namespace ferry::cli
