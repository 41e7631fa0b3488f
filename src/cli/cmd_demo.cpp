// `ferry demo`: trainer and inference ranks as separate processes on this machine, with
// the embedded store and no set-up; several syncs of a shrunk real model, every consumer
// verified bit for bit, one inference rank SIGKILLed mid-sync and restarted.
// `ferry worker` (hidden): one rank process of the demo and the multi-process tests, or
// with --bench of `ferry bench` (tools/bench.h).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "ferry/models.h"
#include "ferry/source.h"
#include "tools/bench.h"
#include "tools/demo.h"
#include "tools/percentile.h"
#include "tools/emulated_hosts.h"
#include "tools/job_model.h"
#include "tools/subprocess.h"
#include "tools/worker.h"

namespace ferry::cli {
namespace {

constexpr const char* kMoeModel = "configs/qwen3-30b-a3b.json";
constexpr const char* kDenseModel = "configs/llama-3.1-8b.json";
// Shrunk-model sizes for the demo: ~288 MB (MoE: 16 experts of 1024x512, 4 layers;
// ~190 MB dense) that 2 cores sync and verify (a direct load of every version on every
// rank) in well under a minute; --config-overrides scales up or down.
constexpr const char* kMoeOverrides =
    R"({"num_hidden_layers": 4, "hidden_size": 1024, "moe_intermediate_size": 512, "num_experts": 16,)"
    R"( "num_experts_per_tok": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,)"
    R"( "vocab_size": 16000})";
constexpr const char* kDenseOverrides =
    R"({"num_hidden_layers": 4, "hidden_size": 1024, "intermediate_size": 4096, "vocab_size": 16000,)"
    R"( "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128})";

// `--hosts H`: where each rank runs. Trainer ranks on the first max(1, H/2) hosts,
// inference ranks on the others (every host when H is 1), each side in contiguous
// blocks, so a host's bytes in or out all cross its link.
struct Placement {
  int hosts = 0, trainer_hosts = 0;
  int producers = 0, consumers = 0;
  int host_of(bool producer, int rank) const {
    if (hosts <= 1) return 0;
    const int inference_hosts = hosts - trainer_hosts;
    return producer ? rank * trainer_hosts / producers : trainer_hosts + rank * inference_hosts / consumers;
  }
};

// Parses "rate=1gbit,loss=0.01" (scripts/hosts.sh's syntax).
bool parse_link(const std::string& text, tools::LinkShape& link, double& rate_bytes) {
  link = {};
  rate_bytes = 0;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string kv = text.substr(at, comma - at);
    at = comma + 1;
    if (kv.rfind("rate=", 0) == 0) {
      link.rate = kv.substr(5);
      char* end = nullptr;
      const double n = std::strtod(link.rate.c_str(), &end);
      const std::string unit = end;
      const double scale = unit == "gbit" ? 1e9 : unit == "mbit" ? 1e6 : unit == "kbit" ? 1e3 : unit == "bit" ? 1 : 0;
      if (!(n > 0) || scale == 0) return false;
      rate_bytes = n * scale / 8;
    } else if (kv.rfind("loss=", 0) == 0) {
      link.loss = std::strtod(kv.c_str() + 5, nullptr);
      if (!(link.loss >= 0 && link.loss < 1)) return false;
    } else if (!kv.empty()) {
      return false;
    }
  }
  return true;
}

// Per sync: each host's bytes in and out (what its ranks received or served from other
// hosts: the placement puts the two sides on different hosts; a copy from a relay on the
// same host, ConsumerOptions::relay, stays inside it) and the speed of light of the
// setup, max over hosts of max(in, out) / link rate. Then what the kernel counted on each
// host's link over the whole run (every sync, the setup and the control messages, with
// their headers).
void print_host_table(const tools::DemoResult& r, const Placement& pl, double rate_bytes) {
  std::printf("\n%8s %6s %12s %12s %10s %10s %8s\n", "version", "host", "bytes in", "bytes out", "seconds", "light s",
              "of light");
  for (const auto& row : r.rows) {
    std::vector<uint64_t> in(static_cast<size_t>(pl.hosts)), out(static_cast<size_t>(pl.hosts));
    for (const auto& [who, text] : row.results) {
      // "producer{r}" or "consumer{r}", exactly.
      const bool producer = who.rfind("producer", 0) == 0;
      if (!producer && who.rfind("consumer", 0) != 0) continue;
      int rank = -1;
      const std::string_view digits = std::string_view(who).substr(8);
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
      if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() || rank < 0) continue;
      auto j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_discarded() || !j.value("ok", false)) continue;
      const auto h = static_cast<size_t>(pl.host_of(producer, rank));
      (producer ? out : in)[h] += j.value("bytes", uint64_t{0}) - j.value("received_via_relay", uint64_t{0});
    }
    uint64_t worst = 0;
    for (int h = 0; h < pl.hosts; ++h) worst = std::max({worst, in[static_cast<size_t>(h)], out[static_cast<size_t>(h)]});
    const double light = rate_bytes > 0 ? static_cast<double>(worst) / rate_bytes : 0;
    for (int h = 0; h < pl.hosts; ++h) {
      const bool last = h == pl.hosts - 1;
      std::printf("%8d %6d %12llu %12llu %10s %10s %8s\n", row.version, h,
                  static_cast<unsigned long long>(in[static_cast<size_t>(h)]),
                  static_cast<unsigned long long>(out[static_cast<size_t>(h)]),
                  last ? fmt::format("{:.3f}", row.seconds).c_str() : "",
                  last && light > 0 ? fmt::format("{:.3f}", light).c_str() : "",
                  last && light > 0 && row.seconds > 0 ? fmt::format("{:.2f}", light / row.seconds).c_str() : "");
    }
  }
}

// The --pause-* options: one pause per --pause-ms value, at syncs V, V+2, V+4, ... (the
// sync after each shows the catch-up).
struct PauseArgs {
  std::string role;
  int rank = 0;
  int sync = 2;
  int point = -1;
  std::vector<int> ms;
};

// One --cut HOST:SYNC[:POINT[:MS]] as written; the rank it stops at is resolved once the
// placement is known (cuts_for).
struct CutArg {
  std::string text;
  int host = 0, sync = 0;
  int point = -1;  // -1: "start" (every rank stops at the start of the sync)
  int ms = 3000;
};

// What a serving engine feels, over the syncs: the stall (each sync's longest commit among
// the inference ranks) and the slowest inference rank's sync, p50 and p95; and the stage
// record of the last sync's slowest inference rank, which sums to its seconds.
void print_stall_and_stages(const tools::DemoResult& r, const std::string& commit) {
  std::vector<double> stalls, slowest;
  for (const auto& row : r.rows) {
    if (row.slowest.empty()) continue;
    stalls.push_back(row.stall);
    slowest.push_back(row.slowest_seconds);
  }
  if (slowest.empty()) return;
  std::printf("stall (commit %s: the longest commit of each sync, the pause a serving engine feels): p50 %.6f s, "
              "p95 %.6f s; slowest inference rank's sync: p50 %.3f s, p95 %.3f s (%zu syncs)\n",
              commit.c_str(), tools::percentile(stalls, 50), tools::percentile(stalls, 95),
              tools::percentile(slowest, 50), tools::percentile(slowest, 95), slowest.size());
  const auto& last = r.rows.back();
  if (last.slowest.empty() || !last.slowest_stages.is_object() || last.slowest_stages.empty()) return;
  std::string stages;
  double sum = 0;
  for (const auto& stage : SyncStages{}.named()) {  // (in the order a sync passes them)
    const std::string name(stage.first);
    const double secs = last.slowest_stages.value(name, 0.0);
    stages += fmt::format("{}{} {:.4f}", stages.empty() ? "" : ", ", name, secs);
    sum += secs;
  }
  std::printf("stage record of sync %d, %s (%.4f s): %s; sum %.4f s\n", last.version, last.slowest.c_str(),
              last.slowest_seconds, stages.c_str(), sum);
}

bool parse_int(const std::string& s, int& out) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return false;
  out = std::stoi(s);
  return true;
}

Result<CutArg> parse_cut(const std::string& text) {
  CutArg c;
  c.text = text;
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t colon = text.find(':', at);
    parts.push_back(text.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  const bool ok = parts.size() >= 2 && parts.size() <= 4 && parse_int(parts[0], c.host) && parse_int(parts[1], c.sync) &&
                  (parts.size() < 3 || parts[2] == "start" || parse_int(parts[2], c.point)) &&
                  (parts.size() < 4 || parse_int(parts[3], c.ms));
  if (!ok) {
    return invalid_argument("--cut '{}': expected HOST:SYNC[:POINT[:MS]] (POINT: start, or a point of the host's first "
                            "rank: consumer group*4+phase, producer group; MS: how long the link stays down, in ms)",
                            text);
  }
  return c;
}

// The cuts as DemoLinkCuts: a point belongs to the first rank placed on the host.
Result<std::vector<tools::DemoLinkCut>> cuts_for(const std::vector<CutArg>& args, const Placement& pl, int syncs) {
  std::vector<tools::DemoLinkCut> out;
  for (const CutArg& c : args) {
    if (c.host >= pl.hosts) {
      return out_of_range("--cut {}: host {} is outside 0..{} (--hosts {})", c.text, c.host, pl.hosts - 1, pl.hosts);
    }
    if (c.sync < 1 || c.sync > syncs) {
      return out_of_range("--cut {}: sync {} is outside 1..{} (--syncs {})", c.text, c.sync, syncs, syncs);
    }
    tools::DemoLinkCut lc{.host = c.host, .version = c.sync, .role = "start", .rank = 0, .point = 0, .ms = c.ms};
    if (c.point >= 0) {
      lc.point = c.point;
      lc.role.clear();
      for (int r = 0; r < pl.producers && lc.role.empty(); ++r) {
        if (pl.host_of(true, r) == c.host) lc.role = "producer", lc.rank = r;
      }
      for (int r = 0; r < pl.consumers && lc.role.empty(); ++r) {
        if (pl.host_of(false, r) == c.host) lc.role = "consumer", lc.rank = r;
      }
      if (lc.role.empty()) {
        return invalid_argument("--cut {}: host {} runs no rank to stop at point {}; cut it at the start instead ({}:{}:start)",
                                c.text, c.host, c.point, c.host, c.sync);
      }
    }
    out.push_back(lc);
  }
  return out;
}

int run_demo_cmd(tools::DemoSpec d, int kill_sync, bool kill_sync_given, int kill_point, bool model_given,
                 bool overrides_given, int hosts, const std::string& link_text, const PauseArgs& pause,
                 const std::vector<std::string>& cut_texts) {
  // One kind of fault at a time (the check that every report is true assumes it): a kill
  // asked for beside another fault is refused, not silently dropped. Without --kill-sync,
  // the default kill (sync 2) gives way to the other fault.
  const char* other_fault = !d.store_restarts.empty() ? "--store-restart-sync"
                            : !pause.role.empty()     ? "--pause-role"
                            : !cut_texts.empty()      ? "--cut"
                                                      : nullptr;
  if (d.relay) {  // (a layout that does not parse is refused below, naming it)
    auto inference = InferenceLayout::parse(d.inference);
    if (inference.ok() && inference->replicas < 2)
      return fail_with("demo", invalid_argument("--relay: --inference {} has one replica of each rank, so none "
                                                "relays for another (replicas=N with N >= 2)", d.inference));
  }
  if (other_fault != nullptr && kill_sync_given && kill_sync > 0) {
    std::fprintf(stderr,
                 "ferry demo: --kill-sync %d and %s are two faults; the demo injects one kind of fault per run "
                 "(its check that every report is true assumes it): drop one\n",
                 kill_sync, other_fault);
    return 2;
  }
  if (other_fault != nullptr) kill_sync = 0;
  // The killed rank catches up at the sync after its kill: a kill at the last sync (or
  // past it) leaves it none, and the demo ended "FAILED" for that alone. Asked for, that
  // is refused; the default kill gives way (ferry demo --syncs 2 runs without one).
  if (kill_sync > 0 && kill_sync >= d.syncs) {
    if (kill_sync_given) {
      std::fprintf(stderr,
                   "ferry demo: --kill-sync %d leaves no sync after it for the killed rank to catch up in (--syncs "
                   "%d): give --syncs %d or more, or --kill-sync 0 for none\n",
                   kill_sync, d.syncs, kill_sync + 1);
      return 2;
    }
    kill_sync = 0;
  }
  std::vector<CutArg> cut_args;
  for (const std::string& t : cut_texts) {
    auto c = parse_cut(t);
    if (!c.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", c.status().message().c_str());
      return 2;
    }
    cut_args.push_back(*c);
  }
  if (!cut_args.empty()) {
    if (hosts == 0) {
      std::fprintf(stderr, "ferry demo: --cut takes an emulated host's link down: give --hosts too\n");
      return 2;
    }
  }
  if (!pause.role.empty()) {
    if (pause.ms.empty()) {
      std::fprintf(stderr, "ferry demo: --pause-role needs --pause-ms\n");
      return 2;
    }
    for (size_t i = 0; i < pause.ms.size(); ++i) {
      d.pauses.push_back(tools::DemoPause{pause.role, pause.rank, pause.sync + 2 * static_cast<int>(i), pause.point,
                                          pause.ms[i]});
    }
    const int last = d.pauses.back().version + 1;
    if (d.syncs < last) d.syncs = last;
    if (pause.role == "store" && d.store.empty()) d.store_process = true;
  }
  d.worker_binary = tools::exe_path();
  if (!model_given) {
    auto archs = supported_architectures();
    if (std::find(archs.begin(), archs.end(), "Qwen3MoeForCausalLM") != archs.end()) {
      d.model = kMoeModel;
    } else {
      std::printf("demo: this build has no Qwen3-MoE loader; using a dense model\n");
      d.model = kDenseModel;
      d.trainer = "tp=2,pp=2";
      d.inference = "tp=2,replicas=2";
    }
  }
  if (!overrides_given) d.overrides = d.model.find("llama") != std::string::npos ? kDenseOverrides : kMoeOverrides;
  if (kill_sync > 0 && kill_point >= 0) {
    // A point the sync never reaches would leave the victim running and the driver
    // waiting out its timeout (67 s) before failing: refused here, before any process.
    auto m = tools::make_job_model_quantized(d.model, d.trainer, d.inference, d.shrink, d.overrides, d.quantize);
    if (!m.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", m.status().to_string().c_str());
      return 2;
    }
    const int groups = Groups(m->metadata).size();
    if (kill_point >= groups * 4) {
      std::fprintf(stderr,
                   "ferry demo: --kill-point %d is past the last point of a sync: the model has %d layer groups, so "
                   "an inference rank's points are 0..%d (group*4 + phase, phase 0..3)\n",
                   kill_point, groups, groups * 4 - 1);
      return 2;
    }
  }
  if (kill_sync > 0) d.kills = {{kill_sync, kill_point}};
  const auto t0 = std::chrono::steady_clock::now();
  tools::LinkShape link;
  double rate_bytes = 0;
  if (!parse_link(link_text, link, rate_bytes)) {
    std::fprintf(stderr, "ferry demo: --link '%s': expected rate=R[,loss=P] (R: a number with bit, kbit, mbit or gbit; "
                         "P: a fraction in [0, 1))\n", link_text.c_str());
    return 2;
  }
  if (!link_text.empty() && hosts == 0) {
    std::fprintf(stderr, "ferry demo: --link shapes the links of emulated hosts: give --hosts too\n");
    return 2;
  }
  std::unique_ptr<tools::EmulatedHosts> emulated;
  std::optional<tools::EmulatedHosts::Inside> inside;
  Placement pl;
  if (hosts > 0) {
    if (!d.store.empty()) {
      std::fprintf(stderr, "ferry demo: --hosts runs its own store on host 0; drop --store\n");
      return 2;
    }
    auto m = tools::make_job_model_quantized(d.model, d.trainer, d.inference, d.shrink, d.overrides, d.quantize);
    if (!m.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", m.status().to_string().c_str());
      return 2;
    }
    pl.hosts = hosts;
    pl.trainer_hosts = std::max(1, hosts / 2);
    pl.producers = m->trainer.world_size();
    pl.consumers = m->inference.world_size();
    auto cuts = cuts_for(cut_args, pl, d.syncs);
    if (!cuts.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", cuts.status().message().c_str());
      return 2;
    }
    d.link_cuts = std::move(*cuts);
    auto h = tools::EmulatedHosts::create(hosts, link);
    if (!h.ok()) {
      std::fprintf(stderr, "ferry demo: --hosts %d: %s\n", hosts, h.status().to_string().c_str());
      return 2;
    }
    emulated = std::move(*h);
    // The driver and its embedded store live on host 0 (threads started from here on
    // are born in its network namespace).
    auto in = emulated->enter(0);
    if (!in.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", in.status().to_string().c_str());
      return 2;
    }
    inside.emplace(std::move(*in));
    d.store_host = emulated->address(0);
    const tools::EmulatedHosts* eh = emulated.get();
    d.launch_prefix = [eh, pl](const std::string& role, int rank) {
      return eh->exec_prefix(pl.host_of(role == "producer", rank));
    };
    tools::EmulatedHosts* links = emulated.get();
    d.set_link = [links](int host, bool up) { return links->set_link(host, up); };
    std::printf("demo: %d emulated hosts (network namespaces %s-h*), links %s; trainer ranks on hosts 0..%d, "
                "inference on %d..%d; no delay emulated (no netem)\n",
                hosts, emulated->prefix().c_str(), link_text.empty() ? "unshaped" : link_text.c_str(),
                pl.trainer_hosts - 1, hosts > 1 ? pl.trainer_hosts : 0, hosts - 1);
  }
  tools::DemoResult r = tools::run_demo(d);
  inside.reset();
  if (emulated && !r.rows.empty()) {
    print_host_table(r, pl, rate_bytes);
    std::printf("links over the whole run (the kernel's eth0 counters, headers and control included):");
    for (int h = 0; h < hosts; ++h) {
      auto c = emulated->counters(h);
      if (c.ok())
        std::printf(" host %d in %llu out %llu;", h, static_cast<unsigned long long>(c->rx_bytes),
                    static_cast<unsigned long long>(c->tx_bytes));
    }
    std::printf("\n");
  }
  emulated.reset();
  if (!r.rows.empty()) {
    std::printf("\n%8s %12s %9s %9s %16s %9s %5s  %s\n", "version", "bytes", "seconds", "GB/s", "broadcast bytes",
                "verified", "torn", "");
    for (const auto& row : r.rows) {
      // The row names what was done to its sync: a kill, a pause, a store restart, a link cut.
      std::string note = row.note;
      std::string fault = row.paused;
      while (!fault.empty() && (fault.back() == ' ' || fault.back() == ';')) fault.pop_back();
      if (!fault.empty()) note += (note.empty() ? "" : "; ") + fault;
      // torn: inference ranks whose failed sync left params of two versions (in place).
      std::printf("%8d %12llu %9.3f %9.2f %16llu %6d/%-2d %5d  %s\n", row.version,
                  static_cast<unsigned long long>(row.bytes), row.seconds,
                  row.seconds > 0 ? static_cast<double>(row.bytes) / row.seconds / 1e9 : 0.0,
                  static_cast<unsigned long long>(row.broadcast_bytes), row.verified, row.expected, row.torn,
                  note.c_str());
    }
    print_stall_and_stages(r, d.commit);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int untrue = 0;
  for (const auto& row : r.rows) untrue += static_cast<int>(row.untrue.size());
  if (!d.pauses.empty() || !d.store_restarts.empty() || !d.link_cuts.empty()) {
    std::printf("pauses injected %d, store restarts %d, link cuts %d; reports untrue: %d\n", r.pauses_injected,
                r.store_restarts, r.link_cuts_done, untrue);
    for (const auto& n : r.pauses_not_reached) std::printf("  %s\n", n.c_str());
    // A sync with a member paused may miss it (named in the reports); the job must
    // recover: the last sync verified everywhere, and every report true.
    const bool recovered = !r.rows.empty() && r.rows.back().verified == r.rows.back().expected &&
                           r.rows.back().failed == 0 && untrue == 0 && r.error.empty();
    if (!r.error.empty()) std::fprintf(stderr, "ferry demo: %s\n", r.error.c_str());
    std::printf("%s in %.1f s\n", recovered ? "demo: recovered from every fault; every report true"
                                             : "demo: FAILED", secs);
    return recovered ? 0 : 1;
  }
  if (!r.error.empty()) std::fprintf(stderr, "ferry demo: %s\n", r.error.c_str());
  if (!d.trace.empty()) std::printf("demo: trace of every rank's syncs in %s (ferry trace %s --plot OUT.png)\n",
                                    d.trace.c_str(), d.trace.c_str());
  std::printf("%s in %.1f s\n", r.all_verified ? "demo: every consumer verified bit for bit at every sync it took part in"
                                               : "demo: FAILED",
              secs);
  return r.all_verified ? 0 : 1;
}

std::function<int()> setup_demo(CLI::App& app) {
                auto d = std::make_shared<tools::DemoSpec>();
                auto kill_sync = std::make_shared<int>(2);
                auto kill_point = std::make_shared<int>(-1);
                auto model_opt = app.add_option("--model", d->model,
                                                "HF config.json (shrunk unless --no-shrink); default: Qwen3-30B-A3B");
                app.add_flag("!--no-shrink", d->shrink, "use the config as is");
                auto ov_opt = app.add_option("--config-overrides", d->overrides, "JSON merged into the shrunk config");
                app.add_option("--trainer", d->trainer, "trainer layout (tp=,pp=,ep=,etp=,dp= | fsdp=)");
                app.add_option("--inference", d->inference, "inference layout (tp=,dp=,ep=,replicas=)");
                app.add_option("--mode", d->mode, "pull | push");
                app.add_option("--group-order", d->group_order,
                               "rotated (the default) | layer: the order layer groups move in (EngineOptions::group_order; "
                               "docs/group-order.md)")
                    ->check(CLI::IsMember({"layer", "rotated"}));
                app.add_option("--convert-on", d->convert_on,
                               "producer | consumer: where a float conversion that shrinks the bytes runs (a trainer "
                               "--trainer ...,dtype=fp32 into bf16 params; EngineOptions::convert_on)")
                    ->check(CLI::IsMember({"producer", "consumer"}));
                CLI::Option* quantize = app.add_option("--quantize", d->quantize,
                               "none | fp8 | fp8-ue8m0 | mxfp8: the inference ranks' loader block-quantises the linear weights "
                 "after loading (LoaderOptions::quantize, docs/models.md); where it runs: --quantize-on")
                    ->check(CLI::IsMember({"none", "fp8", "fp8-ue8m0", "mxfp8"}));
                app.add_option("--quantize-on", d->quantize_on,
                 "producer | consumer: where the --quantize block quantisation runs: on a trainer rank that holds "
                 "every element of a param's tiles (FP8 values and scales cross the wire), or after loading on the "
                 "inference rank (EngineOptions::quantize_on; the params' bits are the same)")
                    ->check(CLI::IsMember({"producer", "consumer"}))
                    ->needs(quantize);
                app.add_option("--commit", d->commit,
                               "inference ranks' commit policy: in_place, groups (a bounded shadow: each layer group "
                               "commits whole as it completes; the reader checks every group is whole), or shadow "
                               "(each sync lands beside the live "
                               "params and commits in one step; a reader thread in every inference rank checks that "
                               "each read of its live params during the syncs is exactly one version)")
                    ->check(CLI::IsMember({"in_place", "shadow", "groups"}));
                app.add_flag("--caller-params", d->caller_params,
                             "inference ranks pass param buffers of their own (as an inference engine's parameters "
                             "are) instead of letting ferry allocate them: under --commit shadow every commit is "
                             "then a copy into them, not a flip");
                app.add_option("--store", d->store, "store URL (tcp://... or redis://...); default: embedded");
                app.add_option("--backend", d->backend, "transport backend (ucx)");
                app.add_flag("--checksums", d->checksums, "xxHash64 per segment, checked on arrival");
                app.add_flag("--relay", d->relay,
                             "relay within a host: replicas of one inference rank on one host copy each layer group "
                             "from the lowest live one over shared memory instead of each pulling it across the "
                             "network (ConsumerOptions::relay, docs/relay.md)");
                add_delta_options(app, d->delta, d->changed_fraction, d->changes, d->delta_block_bytes, d->delta_same_host);
                app.add_flag("--prepare-weights", d->prepare_weights,
                             "trainer ranks generate each version's weights before the sync starts (held in memory, "
                             "as a trainer's are): the sync's seconds are the engine's alone");
                app.add_option("--syncs", d->syncs, "number of syncs")->check(number_in(1, 1 << 20));
                app.add_option("--seed", d->seed, "seed of the synthetic weights")->check(number_in(0, 1.8e19));
                auto kill_sync_opt =
                    app.add_option("--kill-sync", *kill_sync,
                                   "SIGKILL an inference rank during this sync (0: never; default 2 unless another "
                                   "fault is asked for: one kind of fault per run, so --kill-sync with "
                                   "--store-restart-sync, --pause-role or --cut is refused)")
                        ->check(number_in(0, 1 << 20));
                app.add_option("--kill-rank", d->kill_rank, "the inference rank to kill")->check(number_in(0, 1 << 20));
                app.add_option("--kill-point", *kill_point,
                               "point of the sync (group*4+phase; -1: random); past the model's last point is "
                               "refused, naming its number of layer groups")
                    ->check(number_in(-1, 1 << 30));
                auto pause = std::make_shared<PauseArgs>();
                app.add_option("--pause-role", pause->role,
                               "SIGSTOP a process instead of killing one: consumer | producer | store (the "
                               "store then runs as its own `ferry store` process)")
                    ->check(CLI::IsMember({"consumer", "producer", "store"}));
                app.add_option("--pause-rank", pause->rank, "the rank to pause")->check(number_in(0, 1 << 20));
                app.add_option("--pause-sync", pause->sync, "the sync of the first pause (then every other one)")
                    ->check(number_in(1, 1 << 20));
                app.add_option("--pause-point", pause->point,
                               "-1: between syncs (before the sync's go); else mid-sync at this point (consumer: "
                               "group*4+phase, producer: group; the store: at the go)")
                    ->check(number_in(-1, 1 << 30));
                app.add_option("--pause-ms", pause->ms, "how long each pause lasts, one pause per value (e.g. 600,1500,6000)")
                    ->delimiter(',')
                    ->check(number_in(0, 3600000));
                app.add_flag("--store-process", d->store_process, "run the embedded store as its own process");
                app.add_option("--store-restart-sync", d->store_restarts,
                               "restart the store (no data kept) before these syncs")
                    ->delimiter(',')
                    ->check(number_in(1, 1 << 20));
                app.add_option("--lease-ttl-ms", d->lease_ttl_ms, "the ranks' lease ttl")->check(number_in(10, 1 << 30));
                app.add_option("--rank-timeout-ms", d->rank_timeout_ms,
                               "bound on each wait of a rank's sync (EngineOptions::timeout; default 20000)")
                    ->check(number_in(100, 1 << 30));
                app.add_option("--stall-ms", d->stall_ms,
                               "how long a producer waits for a silent reader before dropping it (default 20000)")
                    ->check(number_in(100, 1 << 30));
                app.add_option("--straggler-ms", d->straggler_ms,
                               "the trainer ranks' straggler floor (EngineOptions::straggler_floor; default 2000; 0: "
                               "off)")
                    ->check(number_in(0, 1 << 30));
                app.add_option("--join-window-ms", d->join_window_ms,
                               "how long trainer ranks wait for an inference rank to enter a sync before dropping "
                               "it from that sync (EngineOptions::join_window; default 20000)")
                    ->check(number_in(0, 1 << 30));
                app.add_flag("-v,--verbose", d->verbose, "per-rank phase times");
                app.add_option("--trace", d->trace,
                               "write every rank's trace of every sync to FILE (Chrome trace-event JSON: open in "
                               "Perfetto; `ferry trace FILE --plot OUT.png`; docs/trace.md)");
                auto hosts = std::make_shared<int>(0);
                auto link = std::make_shared<std::string>();
                app.add_option("--hosts", *hosts,
                               "run the ranks on this many emulated hosts (network namespaces on this machine; "
                               "needs root): trainer ranks on the first half, inference on the rest")
                    ->check(number_in(0, 64));
                app.add_option("--link", *link,
                               "shape every emulated host's link: rate=R (tc rate: 1gbit, 200mbit), loss=P "
                               "(fraction of packets dropped each way); e.g. rate=1gbit,loss=0.01");
                auto cuts = std::make_shared<std::vector<std::string>>();
                app.add_option("--cut", *cuts,
                               "take emulated host HOST's link down during sync SYNC for MS ms (default 3000), "
                               "HOST:SYNC[:POINT[:MS]]: at the start of every rank's sync (POINT start, the "
                               "default) or when the host's first rank reaches POINT (consumer: group*4+phase, "
                               "producer: group); repeatable; needs --hosts")
                    ->take_all();
                return [d, kill_sync, kill_sync_opt, kill_point, model_opt, ov_opt, hosts, link, pause, cuts] {
                  return run_demo_cmd(*d, *kill_sync, kill_sync_opt->count() > 0, *kill_point,
                                      model_opt->count() > 0, ov_opt->count() > 0, *hosts, *link, *pause, *cuts);
                };
}

// The options of `ferry worker --bench` (the rest are the demo's).
constexpr const char* kBenchWorkerOptions[] = {"--role",  "--rank", "--model", "--trainer", "--inference", "--store",
                                               "--job",   "--mode", "--group-order", "--convert-on", "--quantize", "--quantize-on", "--seed",  "--timeout-ms", "--tls",     "--in-place",
                                               "--trace", "--bench", "--commit", "--caller-params", "--delta",
                                               "--changed-fraction", "--changes", "--delta-block-bytes", "--delta-same-host", "--help"};

std::function<int()> setup_worker(CLI::App& app) {
  app.group("");  // hidden
  auto w = std::make_shared<tools::WorkerSpec>();
  app.add_option("--role", w->role)->required();
  app.add_option("--rank", w->rank)->required()->check(number_in(0, 1 << 20));
  app.add_option("--model", w->model)->required();
  app.add_option("--trainer", w->trainer)->required();
  app.add_option("--inference", w->inference)->required();
  app.add_option("--store", w->store)->required();
  auto job = app.add_option("--job", w->job);
  app.add_option("--backend", w->backend);
  app.add_option("--mode", w->mode);
  app.add_option("--group-order", w->group_order)->check(CLI::IsMember({"layer", "rotated"}));
  app.add_option("--convert-on", w->convert_on)->check(CLI::IsMember({"producer", "consumer"}));
  app.add_option("--quantize", w->quantize)->check(CLI::IsMember({"none", "fp8", "fp8-ue8m0", "mxfp8"}));
  app.add_option("--quantize-on", w->quantize_on)->check(CLI::IsMember({"producer", "consumer"}));
  app.add_flag("--checksums", w->checksums);
  app.add_flag("--relay", w->relay);
  app.add_option("--seed", w->seed)->check(number_in(0, 1.8e19));
  app.add_option("--first-version", w->first_version)->check(number_in(0, 1 << 30));
  app.add_option("--last-version", w->last_version)->check(number_in(0, 1 << 30));
  app.add_option("--crash-version", w->crash_version)->check(number_in(-1, 1 << 30));
  app.add_option("--crash-point", w->crash_point)->check(number_in(-1, 1 << 30));
  app.add_option("--staging-budget", w->staging_budget)->check(number_in(0, 1.8e19));
  app.add_option("--stall-ms", w->stall_ms)->check(number_in(0, 1 << 30));
  app.add_option("--straggler-ms", w->straggler_ms)->check(number_in(0, 1 << 30));
  app.add_option("--join-window-ms", w->join_window_ms)->check(number_in(0, 1 << 30));
  app.add_option("--commit", w->commit)->check(CLI::IsMember({"in_place", "shadow", "groups"}));
  app.add_flag("--caller-params", w->caller_params);
  app.add_option("--corrupt-version", w->corrupt_version)->check(number_in(-1, 1 << 30));
  app.add_option("--corrupt-group", w->corrupt_group)->check(number_in(0, 1 << 20));
  app.add_option("--discard-version", w->discard_version)->check(number_in(-1, 1 << 30));
  auto timeout = app.add_option("--timeout-ms", w->timeout_ms)->check(number_in(1, 1 << 30));
  app.add_option("--lease-ttl-ms", w->lease_ttl_ms)->check(number_in(10, 1 << 30));
  app.add_option("--go-timeout-ms", w->go_timeout_ms)->check(number_in(1, 1 << 30));
  app.add_option("--trace", w->trace);  // this process's trace file (DemoSpec::trace)
  auto pauses = std::make_shared<std::string>();
  app.add_option("--pause-at", *pauses);  // VERSION:POINT,...: SIGSTOP itself there
  // --bench: a rank of `ferry bench` (run_bench_worker) instead, which takes of the
  // options above only those it shares (kBenchWorkerOptions), and needs --job.
  auto bench = std::make_shared<tools::BenchWorkerSpec>();
  auto as_bench = app.add_flag("--bench");
  app.add_option("--tls", bench->tls)->needs(as_bench);
  app.add_option("--in-place", bench->in_place)->needs(as_bench);
  app.add_flag("--delta", w->delta);
  app.add_flag("--prepare-weights", w->prepare_weights);
  app.add_option("--delta-block-bytes", w->delta_block_bytes)->check(delta_block_bytes_in());
  app.add_flag("--delta-same-host", w->delta_same_host);
  app.add_option("--changed-fraction", w->changed_fraction)->check(number_in(0, 1));
  app.add_option("--changes", w->changes)->check(CLI::IsMember({"scattered", "clustered"}));
  return [&app, w, pauses, bench, as_bench, job, timeout] {
    if (as_bench->count() > 0) {
      for (const CLI::Option* o : app.get_options()) {
        const std::string name = o->get_name();
        if (o->count() > 0 && std::find(std::begin(kBenchWorkerOptions), std::end(kBenchWorkerOptions), name) ==
                                  std::end(kBenchWorkerOptions)) {
          std::fprintf(stderr, "ferry worker --bench: %s is not a bench rank's option\n", name.c_str());
          return 2;
        }
      }
      if (job->count() == 0) {
        std::fprintf(stderr, "ferry worker --bench: --job is required\n");
        return 2;
      }
      bench->role = w->role;
      bench->rank = w->rank;
      bench->model = w->model;
      bench->trainer = w->trainer;
      bench->inference = w->inference;
      bench->store = w->store;
      bench->job = w->job;
      bench->mode = w->mode;
      bench->group_order = w->group_order;
      bench->convert_on = w->convert_on;
      bench->quantize = w->quantize;
      bench->quantize_on = w->quantize_on;
      bench->delta = w->delta;
      bench->changed_fraction = w->changed_fraction;
      bench->changes = w->changes;
      bench->delta_block_bytes = w->delta_block_bytes;
      bench->delta_same_host = w->delta_same_host;
      bench->seed = w->seed;
      bench->trace = w->trace;
      bench->caller_params = w->caller_params;
      bench->commit = w->commit;
      if (timeout->count() > 0) bench->timeout_ms = w->timeout_ms;
      return tools::run_bench_worker(*bench);
    }
    auto p = tools::parse_pause_points(*pauses);
    if (!p.ok()) {
      std::fprintf(stderr, "ferry worker: --pause-at: %s\n", p.status().to_string().c_str());
      return 2;
    }
    w->pauses = *p;
    return tools::run_worker(*w);
  };
}

}  // namespace

FERRY_COMMAND(demo_command, "demo",
              "Run trainer and inference ranks as local processes and sync a shrunk real model several times, verified",
              setup_demo);
FERRY_COMMAND(worker_command, "worker", "", setup_worker);

}  // namespace ferry::cli
