// `ferry serve` and `ferry fetch`, and `ferry.serve` / `ferry.fetch` in Python: one trainer
// or one inference rank in a process that any launcher can start (a shell loop, mpirun,
// srun, torchrun), given a store URL, the job's layouts and its rank (a flag, or the
// launcher's environment). No driver: the ranks meet in the store (Producer/Consumer::create
// wait for every rank's holdings and plans) and sync versions first_version ..
// first_version + syncs - 1 together.
//
// serve: a trainer rank serving its holdings (TrainerLayout boxes) of a safetensors
// checkpoint directory it holds, memory-mapped and served in place from the mapping
// (each file a source region: no copy of the checkpoint in memory, contiguous boxes not
// even staged); the checkpoint must not change while served (checked before each sync;
// a file truncated during a sync ends the process with exit 1 and a message naming it,
// io/mapping_guard.h, instead of SIGBUS; read_checkpoint: owned memory instead, immune
// to that). fetch: an inference rank receiving its shard, optionally
// checked bit for bit against a direct load of a checkpoint directory and written as
// safetensors. serve_rank / fetch_rank return one RankReport per sync; the commands
// print each as a JSON line (rank_report_json) and exit 0 when every sync passed, 1 when
// one did not, 2 on a setup error (the message on stderr names the op and the thing).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/transport.h"

namespace ferry::tools {

// The launcher's rank and world size, when the environment names them. Precedence (first
// set wins, as python/ferry/_launcher.py): FERRY_RANK / FERRY_WORLD_SIZE, RANK /
// WORLD_SIZE (torchrun), OMPI_COMM_WORLD_RANK / _SIZE (Open MPI), PMI_RANK / PMI_SIZE
// (MPICH), SLURM_PROCID / SLURM_NTASKS (srun). kInvalidArgument naming the variable when
// its value is not a non-negative integer.
struct LauncherRank {
  std::optional<int> rank, world_size;
  std::string rank_var, world_size_var;  // which variables said so
};
Result<LauncherRank> launcher_rank_from_env();

// This process's rank of its role: `flag` when >= 0, else the launcher's. One launch may
// start both roles (`mpirun -n P ferry serve ... : -n C ferry fetch ...`): when the
// launcher's world size is producers + consumers, ranks 0..P-1 are the trainer's and
// P..P+C-1 the inference side's (consumer rank = launcher rank - P). Otherwise the
// launcher's world must be the role's own (P or C). Errors name the rank, the sizes and
// the variables.
Result<int> resolve_role_rank(bool producer, int flag, int producers, int consumers, const LauncherRank& env);

struct RankSpec {
  std::string store;       // URL
  std::string token;       // empty: the URL's, else FERRY_TOKEN / FERRY_TOKEN_FILE (store and transport)
  std::string job = "ferry";
  std::string model;       // HF config.json; serve: default {checkpoint}/config.json
  std::string trainer;     // TrainerLayout, e.g. "tp=2,pp=2"
  std::string inference;   // InferenceLayout, e.g. "tp=2,replicas=2"
  std::string checkpoint;  // serve: the directory served; fetch: verify against it (optional)
  std::string output;      // fetch: write the params as {output}/rank-{R}.safetensors
  // Write every sync's trace here (Chrome trace-event JSON, tools/trace_file.h), rewritten
  // after each sync; "{rank}" is replaced by the rank. Empty: none.
  std::string trace;
  int rank = -1;           // -1: the launcher's (resolve_role_rank)
  // Serve this rank's metrics (ferry/metrics.h SyncMetrics) for Prometheus at this address
  // while it runs: "PORT" (every interface) or "HOST:PORT"; port 0 picks a free one (the
  // URL is printed on stderr). Empty: none.
  std::string metrics;
  // With `metrics`: after the last sync, keep serving until one more scrape has collected
  // the final values (Prometheus pulls: a rank that exits at once loses its last sync's)
  // or this many seconds pass. 0: exit at once.
  double metrics_linger_s = 0;
  // Return every sync's report (the library's callers, the tests). The CLI prints each as
  // it comes (the sink) and keeps none: a serve or fetch of 12,000 syncs grew 24-28 MB
  // holding them (issue 49).
  bool keep_reports = true;
  std::string mode = "pull";
  std::string group_order = "rotated";  // EngineOptions::group_order: rotated | layer
  bool checksums = false;
  // EngineOptions::delta: serve sends patches of what changed since the version each
  // fetch holds; fetch takes them (docs/delta.md).
  bool delta = false;
  uint64_t delta_block_bytes = 0;  // serve: EngineOptions::delta_block_bytes (0: keep a copy)
  bool delta_same_host = false;    // serve: EngineOptions::delta_same_host
  bool read_checkpoint = false;  // serve: read the files into owned memory instead of mapping them
  // Where the weights (serve: this rank's boxes, copied there once at start) or the
  // params (fetch) live: "cpu" or "cuda:N" (ferry/device.h's parse_device).
  std::string device = "cpu";
  bool gpu_staging = false;  // serve on a GPU: stage there, exported by CUDA IPC (ProducerOptions::staging_device)
  bool cuda_ipc = true;      // fetch on a GPU: copy device to device from such staging (ConsumerOptions::cuda_ipc)
  std::string commit = "in_place";  // fetch: ConsumerOptions::commit ("in_place" or "shadow")
  // fetch: after the last sync, leave the job on purpose (Consumer::leave: scaling in;
  // producers then name the rank in `left`, not `missed`) instead of only exiting.
  bool leave = false;
  // fetch: before its syncs, join the live version from the replicas that hold it
  // (Consumer::catch_up: a new instance joining a running job): one line for it (its
  // version; verified against the checkpoint), then the syncs. No replica of this layout
  // holding it is no failure: the line says so and the first sync brings it.
  bool catch_up = false;
  int first_version = 1;
  int syncs = 1;
  int timeout_ms = 30000;      // bound on each wait of a sync (EngineOptions::timeout, stall)
  int rendezvous_ms = 120000;  // bound on waiting for every rank at start
  // The producer's straggler policy and join window (EngineOptions; serve only).
  int straggler_floor_ms = 2000;
  double straggler_factor = 8;
  int join_window_ms = -1;     // -1: min(20000, timeout_ms / 2) (local_setup)
  int lease_ttl_ms = 3000;  // EngineOptions::lease_ttl
  // Tests only: serve runs this before materialising each group (engine::TestHooks).
  std::function<void(uint64_t version, int group)> before_materialize;
};

// One sync of one rank: what `ferry serve/fetch` print as a JSON line and ferry.serve /
// ferry.fetch return as a dict (both through rank_report_json, so the keys are the same).
struct RankReport {
  bool producer = true;       // "role": "trainer" (serve) | "inference" (fetch)
  int rank = 0;
  int version = 0;
  // The sync succeeded and the report is true: serve: every consumer this rank serves
  // committed the version (SyncReport::ok); fetch: the version is committed here.
  bool ok = false;
  Status error;               // !ok: why ("error", and its code name as "code")
  // The engine's report of the sync, also of a failed one (Producer/Consumer::last_report:
  // its seconds, bytes and trace as far as it went); empty when no sync was run.
  SyncReport sync;
  bool torn = false;          // fetch: a failed sync left some groups new
  std::optional<uint64_t> received;  // fetch (shadow): a version received and not committed
  // fetch with a checkpoint to verify against, after an ok sync: whether the params
  // equal a direct load bit for bit, and where they first differ.
  std::optional<bool> verified;
  std::string mismatch;
  TransportStats transport;   // this rank's transport counters after the sync (cumulative)
};
// ok, and verified where it was checked: what the exit status and check=True go by.
bool rank_report_passed(const RankReport& r);
// engine/report_json.h's sync_report_json of `sync` (the same keys as every report), with
// "ok", "error" and "code" of the rank's verdict, and "role", "rank", "torn" (fetch),
// "verified" and "mismatch" (when checked) and "transport" added.
nlohmann::json rank_report_json(const RankReport& r);

// Called with each sync's report as soon as it is made (the commands print it there).
using RankReportSink = std::function<void(const RankReport&)>;

// Runs the rank in the calling thread: setup (every local check first: the spec, the
// layouts, the rank, the checkpoint, the model config; then the store, the transport and
// the rendezvous), then each sync. A setup error is returned and nothing was synced: it
// names the op and the thing (the checkpoint directory, the layout, the variable). A failed
// sync is not an error: its report says ok false and why, and the next sync is still run
// (the job's other ranks are in it too). fetch with `output`: the params are written
// after the last sync when every sync passed; a failure to write is returned as the error
// (the reports went to `on_report`).
Result<std::vector<RankReport>> serve_rank(const RankSpec& spec, const RankReportSink& on_report = {});
Result<std::vector<RankReport>> fetch_rank(const RankSpec& spec, const RankReportSink& on_report = {});

// The commands: print each report as a JSON line on stdout, a setup error on stderr;
// return the exit status (0 every sync passed, 1 one did not, 2 setup error).
int run_serve(const RankSpec& spec);
int run_fetch(const RankSpec& spec);

}  // namespace ferry::tools
