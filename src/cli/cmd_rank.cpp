// `ferry serve` and `ferry fetch`: one trainer / inference rank as a process, for any
// launcher (tools/rank_entry.h; docs/multihost.md).
#include <memory>

#include "cli/command.h"
#include "tools/rank_entry.h"

namespace ferry::cli {
namespace {

void add_common(CLI::App& app, tools::RankSpec& s) {
  app.add_option("--store", s.store, "Store URL every rank of the job uses, e.g. tcp://10.0.0.1:29500 (token: "
                                     "$FERRY_TOKEN or $FERRY_TOKEN_FILE)")
      ->required();
  app.add_option("--trainer", s.trainer, "Trainer layout, e.g. tp=2,pp=2 (the same on every rank)")->required();
  app.add_option("--inference", s.inference, "Inference layout, e.g. tp=2,replicas=2 (the same on every rank)")
      ->required();
  app.add_option("--rank", s.rank,
                 "This rank of its role (default: the launcher's: FERRY_RANK, RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, "
                 "SLURM_PROCID; when the launcher's world is trainer + inference ranks, the trainer's come first)")
      ->check(number_in(0, 1 << 20));
  app.add_option("--job", s.job, "Job name: the store key prefix (the same on every rank)")->default_val("ferry");
  app.add_option("--mode", s.mode, "pull (consumers read) or push (trainers write); the same on every rank")
      ->default_val("pull");
  app.add_option("--group-order", s.group_order,
                 "rotated (every pipeline stage sends for the whole sync) or layer: the order layer groups move in "
                 "(docs/group-order.md; the same on every rank)")
      ->default_val("rotated")
      ->check(CLI::IsMember({"rotated", "layer"}));
  app.add_flag("--checksums", s.checksums, "End-to-end xxHash per segment (the same on every rank)");
  CLI::Option* delta = app.add_flag("--delta", s.delta,
               "Delta syncs: serve sends patches of what changed since the version each fetch holds, fetch applies "
               "them (checked end to end; docs/delta.md)");
  app.add_option("--delta-block-bytes", s.delta_block_bytes,
                 "serve, with --delta: keep no copy, only a hash per block of this many bytes, and send changed "
                 "blocks whole (0: keep a copy)")
      ->check(delta_block_bytes_in())
      ->needs(delta);
  app.add_flag("--delta-same-host", s.delta_same_host,
               "with --delta: patches over shared memory too (by default a job whose every rank is on one host runs "
               "without delta, and a serve rank sends dense bytes to fetch ranks on its host: shared memory moves "
               "them faster than they are encoded and applied); the same on every rank")
      ->needs(delta);
  app.add_option("--version", s.first_version, "First version to sync")->default_val(1)->check(number_in(0, 1 << 30));
  app.add_option("--syncs", s.syncs, "Syncs to run: versions --version, --version + 1, ... (0: none, with fetch "
                                     "--catch-up only)")
      ->default_val(1)
      ->check(number_in(0, 1 << 30));
  app.add_option("--timeout", s.timeout_ms, "Bound on each wait of a sync, in ms")
      ->default_val(30000)
      ->check(number_in(1, 1 << 30));
  app.add_option("--rendezvous-timeout", s.rendezvous_ms, "Bound on waiting for every rank to start, in ms")
      ->default_val(120000)
      ->check(number_in(1, 1 << 30));
  app.add_option("--lease-ttl", s.lease_ttl_ms,
                 "A rank is lost once its store lease is this old, in ms (the same on every rank)")
      ->default_val(3000)
      ->check(number_in(10, 1 << 30));
  app.add_option("--straggler-floor", s.straggler_floor_ms,
                 "serve: drop a fetch rank that entered the sync and made no progress for max(this, "
                 "--straggler-factor x the others' time) ms after the others were done with a group or "
                 "committed the sync; it catches up at the next sync (0: only --timeout)")
      ->default_val(2000)
      ->check(number_in(0, 1 << 30));
  app.add_option("--straggler-factor", s.straggler_factor, "serve: the relative part of that bound")
      ->default_val(8)
      ->check(number_in(0, 1e6));
  app.add_option("--join-window", s.join_window_ms,
                 "serve: how long a fetch rank that has not entered the sync yet may lag the others before it "
                 "is dropped from it as absent, in ms (rollouts end seconds apart); below --timeout (default: "
                 "20000, or half --timeout if that is less)")
      ->check(number_in(0, 1 << 30));
  CLI::Option* metrics = app.add_option("--metrics-port", s.metrics,
                 "Serve this rank's Prometheus metrics at http://HOST:PORT/metrics while it runs: PORT (every "
                 "interface) or HOST:PORT; 0 picks a free port (printed on stderr). docs/metrics.md lists them");
  app.add_option("--metrics-linger", s.metrics_linger_s,
                 "With --metrics-port: after the last sync, keep serving until one more scrape has the final values, "
                 "or this many seconds pass (Prometheus pulls: without it a short job's last sync is never scraped)")
      ->default_val(0)
      ->check(number_in(0, 86400))
      ->needs(metrics);
  app.add_option("--trace", s.trace,
                 "Write this rank's trace of every sync to FILE (Chrome trace-event JSON for Perfetto; \"{rank}\" "
                 "is replaced by the rank; `ferry trace` merges, summarises and plots; docs/trace.md)");
}

std::function<int()> setup_serve(CLI::App& app) {
  auto s = std::make_shared<tools::RankSpec>();
  add_common(app, *s);
  app.add_option("--checkpoint", s->checkpoint,
                 "Safetensors checkpoint directory this rank serves its holdings of (memory-mapped and served in "
                 "place; it must not change while served)")
      ->required();
  app.add_flag("--read-checkpoint", s->read_checkpoint,
               "Read the checkpoint into memory this rank owns instead of mapping it (costs its size in memory; "
               "immune to the files changing while served)");
  app.add_option("--model", s->model, "HF config.json (default: CHECKPOINT/config.json)");
  app.add_option("--device", s->device,
                 "Where this rank's weights live: cpu, or cuda:N (its boxes copied onto that GPU once at start, packed "
                 "there by a kernel each sync)")
      ->default_val("cpu");
  app.add_flag("--gpu-staging", s->gpu_staging,
               "With --device cuda:N: stage in GPU memory, shared by CUDA IPC with fetch ranks of this host whose "
               "params are on a GPU (device to device, no host hop); the others read a host copy");
  return [s] { return tools::run_serve(*s); };
}

std::function<int()> setup_fetch(CLI::App& app) {
  auto s = std::make_shared<tools::RankSpec>();
  add_common(app, *s);
  app.add_option("--model", s->model, "HF config.json of the model")->required();
  app.add_option("--verify", s->checkpoint,
                 "Checkpoint directory to compare the received params with, bit for bit (a direct load)");
  app.add_option("--output", s->output,
                 "Write the received params to DIR/rank-R.safetensors after the last sync (DIR is made if missing and "
                 "checked writable before any sync)");
  app.add_option("--device", s->device, "Where this rank's params live: cpu, or cuda:N (unpacked there by a kernel)")
      ->default_val("cpu");
  app.add_flag("!--no-cuda-ipc", s->cuda_ipc,
               "With --device cuda:N: read through the transport even from serve ranks of this host that stage in "
               "GPU memory (default: copy device to device by CUDA IPC; received_via_cuda_ipc says how much)");
  app.add_option("--commit", s->commit,
                 "in_place: bytes land in the params as they arrive; shadow: each sync lands beside the live params "
                 "and commits in one step at its end (a failed sync leaves the live params the last committed "
                 "version); groups: a bounded shadow, each layer group made live whole as it completes (a failed "
                 "sync leaves the groups_live it names new, the rest old); each line says live_version, committed, "
                 "commit_seconds, received_version")
      ->check(CLI::IsMember({"in_place", "shadow", "groups"}))
      ->default_val("in_place");
  app.add_flag("--leave", s->leave,
               "After the last sync, leave the job on purpose (scaling in): the serve ranks neither wait for this "
               "rank nor report it missed (their lines name it in \"left\"); a fetch started later in this rank "
               "joins again");
  app.add_flag("--catch-up", s->catch_up,
               "Before the syncs, join the live version from the inference replicas that hold it (a new or "
               "restarted rank joining a running job; docs/elastic.md): read from a replica of this layout's live "
               "params, not from the serve ranks; its line has catch_up_source and received_from_replicas. Then "
               "sync from --version (the job's next; --syncs 0: none). Where no replica of this layout holds it, "
               "stderr says so and the first sync brings it");
  return [s] { return tools::run_fetch(*s); };
}

}  // namespace

FERRY_COMMAND(serve_command, "serve",
              "Be one trainer rank: serve this rank's shards of a safetensors checkpoint to inference ranks "
              "(start one per rank with any launcher)",
              setup_serve);
FERRY_COMMAND(fetch_command, "fetch",
              "Be one inference rank: receive this rank's shard of a version, verified, optionally written as "
              "safetensors (start one per rank with any launcher)",
              setup_fetch);

}  // namespace ferry::cli
