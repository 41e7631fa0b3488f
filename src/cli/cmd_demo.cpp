// `ferry demo`: trainer and inference ranks as separate processes on this machine, with
// the embedded store and no set-up; several syncs of a shrunk real model, every consumer
// verified bit for bit, one inference rank SIGKILLed mid-sync and restarted.
// `ferry worker` (hidden): one rank process of the demo and the multi-process tests.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "ferry/models.h"
#include "tools/demo.h"
#include "tools/worker.h"

namespace ferry::cli {
namespace {

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "ferry";
  buf[n] = 0;
  return buf;
}

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

int run_demo_cmd(tools::DemoSpec d, int kill_sync, int kill_point, bool model_given, bool overrides_given) {
  d.worker_binary = self_exe();
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
  if (kill_sync > 0) d.kills = {{kill_sync, kill_point}};
  const auto t0 = std::chrono::steady_clock::now();
  tools::DemoResult r = tools::run_demo(d);
  if (!r.rows.empty()) {
    std::printf("\n%8s %12s %9s %9s %16s %9s  %s\n", "version", "bytes", "seconds", "GB/s", "broadcast bytes", "verified",
                "");
    for (const auto& row : r.rows) {
      std::printf("%8d %12llu %9.3f %9.2f %16llu %6d/%-2d  %s\n", row.version, static_cast<unsigned long long>(row.bytes),
                  row.seconds, row.seconds > 0 ? static_cast<double>(row.bytes) / row.seconds / 1e9 : 0.0,
                  static_cast<unsigned long long>(row.broadcast_bytes), row.verified, row.expected, row.note.c_str());
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r.error.empty()) std::fprintf(stderr, "ferry demo: %s\n", r.error.c_str());
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
                app.add_option("--store", d->store, "store URL (tcp://... or redis://...); default: embedded");
                app.add_option("--backend", d->backend, "transport backend (ucx)");
                app.add_flag("--checksums", d->checksums, "xxHash64 per segment, checked on arrival");
                app.add_option("--syncs", d->syncs, "number of syncs");
                app.add_option("--seed", d->seed, "seed of the synthetic weights");
                app.add_option("--kill-sync", *kill_sync, "SIGKILL an inference rank during this sync (0: never)");
                app.add_option("--kill-rank", d->kill_rank, "the inference rank to kill");
                app.add_option("--kill-point", *kill_point, "point of the sync (group*4+phase; -1: random)");
                app.add_flag("-v,--verbose", d->verbose, "per-rank phase times");
                return [d, kill_sync, kill_point, model_opt, ov_opt] {
                  return run_demo_cmd(*d, *kill_sync, *kill_point, model_opt->count() > 0, ov_opt->count() > 0);
                };
}

std::function<int()> setup_worker(CLI::App& app) {
  app.group("");  // hidden
  auto w = std::make_shared<tools::WorkerSpec>();
  app.add_option("--role", w->role)->required();
  app.add_option("--rank", w->rank)->required();
  app.add_option("--model", w->model)->required();
  app.add_option("--trainer", w->trainer)->required();
  app.add_option("--inference", w->inference)->required();
  app.add_option("--store", w->store)->required();
  app.add_option("--job", w->job);
  app.add_option("--backend", w->backend);
  app.add_option("--mode", w->mode);
  app.add_flag("--checksums", w->checksums);
  app.add_option("--seed", w->seed);
  app.add_option("--first-version", w->first_version);
  app.add_option("--last-version", w->last_version);
  app.add_option("--crash-version", w->crash_version);
  app.add_option("--crash-point", w->crash_point);
  app.add_option("--stall-ms", w->stall_ms);
  app.add_option("--timeout-ms", w->timeout_ms);
  return [w] { return tools::run_worker(*w); };
}

}  // namespace

FERRY_COMMAND(demo_command, "demo",
              "Run trainer and inference ranks as local processes and sync a shrunk real model several times, verified",
              setup_demo);
FERRY_COMMAND(worker_command, "worker", "", setup_worker);

}  // namespace ferry::cli
