// `ferry bench`: the engine's sync time on this machine beside its baselines, measured in
// one run: raw UCX reads of the same sizes (the transport's speed of light), memcpy of the
// same bytes, and the broadcast design on OpenMPI's MPI_Bcast (what ferry replaces).
// Its rank processes are `ferry worker --bench` (cmd_demo.cpp).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "cli/command.h"
#include "tools/bench.h"
#include "tools/subprocess.h"
#include "tools/transport_options.h"

namespace ferry::cli {
namespace {

// A dense Llama-3.1-8B shrunk to ~300 MB of bf16: big enough that per-message costs do
// not dominate, small enough for 6 processes on 2 cores in well under a minute.
constexpr const char* kModel = "configs/llama-3.1-8b.json";
constexpr const char* kOverrides =
    R"({"num_hidden_layers": 6, "hidden_size": 1024, "intermediate_size": 4096, "vocab_size": 32000,)"
    R"( "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64})";

int run_bench_cmd(tools::BenchSpec b, bool json, bool model_given, bool overrides_given) {
  const std::string self = tools::exe_path();
  b.worker_binary = self;
  b.mpi_binary = self.substr(0, self.rfind('/') + 1) + "ferry-mpi-bcast";
  if (!model_given && !overrides_given) b.overrides = kOverrides;
  tools::BenchResult r = tools::run_bench(b);
  if (!r.error.empty()) {
    std::fprintf(stderr, "ferry bench: %s\n", r.error.c_str());
    return 1;
  }
  const auto& j = r.json;
  if (b.estimate_only) {
    std::printf("%s\n", j.dump(json ? -1 : 2).c_str());
    return j["fits"].get<bool>() ? 0 : 1;
  }
  if (json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  const double bytes = j["bytes_moved"].get<double>();
  const double sync = j["sync_seconds"].get<double>();
  const bool push = j["mode"] == "push";
  std::printf("\n%s, %.1f MB; trainer %s (%d ranks) -> inference %s (%d ranks); UCX_TLS=%s; median of %d\n",
              j["architecture"].get<std::string>().c_str(), j["checkpoint_bytes"].get<double>() / 1e6,
              j["trainer"].get<std::string>().c_str(), j["producers"].get<int>(),
              j["inference"].get<std::string>().c_str(), j["consumers"].get<int>(), j["tls"].get<std::string>().c_str(),
              j["syncs"].get<int>());
  std::printf("%-34s %10s %12s %9s %8s\n", "", "seconds", "bytes", "GB/s", "CPU s");
  std::printf("%-34s %10.4f %12.0f %9.2f %8.2f\n", push ? "ferry sync (push, verified)" : "ferry sync (pull, verified)", sync,
              bytes, j["gbps"].get<double>(), j["sync_cpu_seconds"].get<double>());
  const double dense = j.value("raw_bytes", bytes);  // under --delta: the dense bytes
  std::printf("%-34s %10.4f %12.0f %9.2f %8.2f\n", push ? "raw UCX writes, dense sizes" : "raw UCX reads, dense sizes",
              j["raw_transport_seconds"].get<double>(), dense, j["raw_transport_gbps"].get<double>(),
              j["raw_cpu_seconds"].get<double>());
  std::printf("%-34s %10.4f %12.0f %9.2f\n", "memcpy, dense bytes", j["memcpy_seconds"].get<double>(), dense,
              j["memcpy_gbps"].get<double>());
  std::printf("  zero-copy: %.0f%% of the bytes served in place from trainer memory%s, %.0f%% read straight into params\n",
              100 * j["in_place_fraction"].get<double>(), j["in_place"].get<bool>() ? "" : " (--no-in-place)",
              100 * j["into_params_fraction"].get<double>());
  if (j.value("commit", std::string("in_place")) != "in_place")
    std::printf("  commit (%s): %.6f s, %.1f%% of the sync: the pause a serving engine sees%s\n",
                j["commit"].get<std::string>().c_str(), j["commit_seconds"].get<double>(),
                100 * j["commit_fraction_of_sync"].get<double>(),
                j["commit"] == "groups" ? " (summed over the layer groups' commits)" : "");
  std::printf("  stall (the longest commit of each sync, the pause a serving engine feels): p50 %.6f s, p95 %.6f s; "
              "slowest inference rank: p50 %.4f s, p95 %.4f s\n",
              j.value("stall_seconds_p50", 0.0), j.value("stall_seconds_p95", 0.0),
              j.value("slowest_receiver_seconds_p50", 0.0), j.value("slowest_receiver_seconds_p95", 0.0));
  std::printf("%-34s %10.4f %12.0f %9.2f\n", "staged pack+read+unpack (no 0-copy)", j["staged_seconds"].get<double>(),
              bytes, bytes / j["staged_seconds"].get<double>() / 1e9);
  std::printf("%-34s %10.4f %12.0f %9.2f %8.2f\n", "broadcast (OpenMPI MPI_Bcast)",
              j["broadcast_seconds"].get<double>(), j["broadcast_bytes"].get<double>(), j["broadcast_gbps"].get<double>(),
              j["broadcast_cpu_seconds"].get<double>());
  if (j.contains("delta")) {
    const auto& d = j["delta"];
    std::printf("  delta (%s %.4g%% changed, %.4g%% seen): %.0f bytes on the wire against %.0f dense = %.4f of dense "
                "(%.0f as patches); sync / dense raw %s time %.3f; %d patches repaired\n",
                d["changes"].get<std::string>().c_str(), 100 * d["changed_fraction"].get<double>(),
                100 * d["changed_fraction_seen"].get<double>(), d["bytes_moved"].get<double>(),
                d["dense_bytes"].get<double>(), d["wire_ratio"].get<double>(), d["patch_bytes"].get<double>(),
                push ? "write" : "read", d["sync_vs_dense_raw"].get<double>(), d["patches_repaired"].get<int>());
  }
  std::printf("\nefficiency_vs_raw     %.2f  (raw UCX seconds / ferry seconds)\n", j["efficiency_vs_raw"].get<double>());
  std::printf("speedup_vs_broadcast  %.2f  (broadcast seconds / ferry seconds)\n",
              j["speedup_vs_broadcast"].get<double>());
  return 0;
}

std::function<int()> setup_bench(CLI::App& app) {
  auto b = std::make_shared<tools::BenchSpec>();
  auto json = std::make_shared<bool>(false);
  b->model = kModel;
  auto model = app.add_option("--model", b->model, "HF config.json (shrunk unless --no-shrink); default: Llama-3.1-8B ~300 MB");
  app.add_flag("!--no-shrink", b->shrink, "use the config as is");
  auto ov = app.add_option("--config-overrides", b->overrides, "JSON merged into the shrunk config");
  app.add_option("--trainer", b->trainer, "trainer layout (tp=,pp=,ep=,etp=,dp= | fsdp=)");
  app.add_option("--inference", b->inference, "inference layout (tp=,dp=,ep=,replicas=)");
  app.add_option("--tls", b->tls, "UCX_TLS of every rank (default $FERRY_UCX_TLS or sm,tcp,self: bytes over shared memory, messages over tcp); MPI's baseline uses shared memory when the list has it, else tcp");
  app.add_option("--mode", b->mode, "pull | push (push: the raw baseline is UCX writes)");
  app.add_option("--group-order", b->group_order, "rotated (the default) | layer: the order layer groups move in (docs/group-order.md)")
      ->check(CLI::IsMember({"layer", "rotated"}));
  app.add_option("--convert-on", b->convert_on,
                 "producer | consumer: where a float conversion that shrinks the bytes runs (a trainer "
                 "--trainer ...,dtype=fp32 into bf16 params; EngineOptions::convert_on)")
      ->check(CLI::IsMember({"producer", "consumer"}));
  app.add_option("--quantize", b->quantize,
                 "none | fp8 | fp8-ue8m0 | mxfp8: the inference ranks' loader block-quantises the linear weights "
                 "after loading (LoaderOptions::quantize, docs/models.md); where it runs: --quantize-on")
      ->check(CLI::IsMember({"none", "fp8", "fp8-ue8m0", "mxfp8"}));
  app.add_option("--quantize-on", b->quantize_on,
                 "producer | consumer: where the --quantize block quantisation runs: on a trainer rank that holds "
                 "every element of a param's tiles (FP8 values and scales cross the wire), or after loading on the "
                 "inference rank (EngineOptions::quantize_on; the params' bits are the same)")
      ->check(CLI::IsMember({"producer", "consumer"}));
  app.add_option("--syncs", b->syncs, "timed trials of each measurement, after one warm-up (medians)")
      ->check(number_in(1, 1 << 20));
  app.add_option("--seed", b->seed, "seed of the synthetic weights")->check(number_in(0, 1.8e19));
  app.add_option("--mpirun", b->mpirun, "mpirun executable");
  app.add_option("--mpi-mca", b->mpi_mca, "MCA options replacing the default (\"--mca pml ob1 --mca btl self,vader\")");
  app.add_option("--timeout-ms", b->timeout_ms, "bound on each wait")->check(number_in(1, 1 << 30));
  app.add_option("--trace", b->trace,
                 "write every rank's trace of every sync step to FILE (Chrome trace-event JSON; docs/trace.md)");
  app.add_flag("!--no-in-place", b->in_place,
               "trainer weights in ordinary memory, every byte packed into staging (default: in a transport region, "
               "served in place)");
  app.add_option("--commit", b->commit,
                 "consumers' commit policy: in_place, shadow (each sync lands beside the live params and commits "
                 "at its end; phases_max.commit_seconds_max is the pause a serving engine sees), or groups (a "
                 "bounded shadow: each layer group commits whole as it completes; the pause is summed over them)")
      ->check(CLI::IsMember({"in_place", "shadow", "groups"}));
  app.add_flag("--caller-params", b->caller_params,
               "consumers pass param buffers of their own (as an inference engine's parameters are) instead of "
               "letting the engine allocate them; under --commit shadow the commit is then a copy into them, "
               "not a flip");
  add_delta_options(app, b->delta, b->changed_fraction, b->changes, b->delta_block_bytes, b->delta_same_host);  // (the raw steps still move the dense bytes)
  app.add_flag("--memory-estimate", b->estimate_only,
               "print what every process would hold and MemAvailable, start nothing (exit 1 if it does not fit)");
  app.add_flag("--json", *json, "print one JSON object");
  return [b, json, model, ov] { return run_bench_cmd(*b, *json, model->count() > 0, ov->count() > 0); };
}

}  // namespace

FERRY_COMMAND(bench_command, "bench",
              "Time a sync of a shrunk model beside raw UCX reads, memcpy and an MPI_Bcast broadcast design",
              setup_bench);

}  // namespace ferry::cli
