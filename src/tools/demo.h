// `ferry demo` and the multi-process tests (internal): their ranks are `ferry worker`
// processes (tools/worker.h), started and reaped through tools/subprocess.h.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/status.h"

namespace ferry::tools {

// A SIGSTOP of one process of the job for `ms`, then SIGCONT (DemoSpec::pauses).
struct DemoPause {
  std::string role = "consumer";  // "consumer" | "producer" | "store"
  int rank = 0;                   // ignored for the store
  int version = 2;                // the sync it falls in (point >= 0) or before (point -1)
  // -1: between syncs (after sync version-1 reported, before version's go). Otherwise
  // mid-sync: a rank stops itself at this point of sync `version` (consumer: group * 4 +
  // phase; producer: the group it is about to materialise, as for kills); the store is
  // stopped as soon as the driver has written version's go (every rank is then at the
  // start of that sync, reading membership from it).
  int point = -1;
  int ms = 1000;
};

// A host's network link taken down during one sync, then brought back up `ms` later
// (DemoSpec::link_cuts; the hosts are the caller's, reached through DemoSpec::set_link).
struct DemoLinkCut {
  int host = 0;      // passed to DemoSpec::set_link
  int version = 2;   // the sync it falls in
  // Where: rank `rank` of `role` stops itself at `point` of sync `version` (the points
  // of DemoPause), the driver takes the link down, then lets the rank go on: the cut
  // lands at that point of the sync. role "start": every rank stops itself at the start
  // of sync `version` (its go received, before any store call of the sync), and all go
  // on once the link is down.
  std::string role = "consumer";  // "consumer" | "producer" | "start"
  int rank = 0;
  int point = 0;
  int ms = 3000;     // how long the link stays down
};

// The driver of `ferry demo` and the multi-process tests: starts every trainer and
// inference rank as a process (`worker_binary worker ...`), runs `syncs` syncs through
// the store, SIGKILLs rank `kill_rank` of `kill_role` at the given (version, point)s
// (restarting it for the next sync), and collects per-sync figures.
struct DemoSpec {
  std::string worker_binary;  // the ferry executable
  std::string model = "configs/qwen3-30b-a3b.json";
  std::string overrides;      // JSON merged into the shrunk config
  bool shrink = true;
  std::string trainer = "tp=2,pp=2,ep=2";
  std::string inference = "tp=2,ep=2,replicas=2";
  std::string mode = "pull";
  std::string group_order = "rotated";  // EngineOptions::group_order of every rank
  std::string convert_on = "producer";  // EngineOptions::convert_on of every rank
  std::string quantize_on = "producer";  // EngineOptions::quantize_on of every rank
  // The inference ranks' loader quantisation (LoaderOptions::quantize: "none", "fp8",
  // "fp8-ue8m0", "mxfp8"): the consumers block-quantise after loading (post-processing).
  std::string quantize = "none";
  std::string store;          // empty: an embedded TCP store in this process
  std::string store_host = "127.0.0.1";  // the address the embedded store listens on
  // With `store` empty: run the embedded store as its own process (`ferry store`), which
  // a pause of the store needs (the in-process one would stop the driver with it).
  bool store_process = false;
  // A store run by the caller (e.g. a private redis-server): its pid, for pauses of the
  // store, and how to restart it, for store_restarts.
  pid_t store_pid = -1;
  std::function<Status()> restart_store;
  // Before each of these syncs (between syncs), the store is restarted: the embedded one
  // (in this process or its own) stopped or SIGKILLed and started again on the same
  // port with no data, the caller's through restart_store.
  std::vector<int> store_restarts;
  std::vector<DemoPause> pauses;
  // Link cuts (DemoLinkCut): set_link(host, up) takes a host's link down or up (e.g.
  // EmulatedHosts::set_link); every link cut is brought back up before run_demo
  // returns, whatever happened. Results: DemoSyncRow::paused names each cut.
  std::vector<DemoLinkCut> link_cuts;
  std::function<Status(int host, bool up)> set_link;
  int lease_ttl_ms = 2000;    // the workers' EngineOptions::lease_ttl
  int stall_ms = 20000;       // the workers' stall_timeout
  int straggler_ms = 2000;    // the workers' straggler_floor (EngineOptions; 0: off)
  int join_window_ms = 20000;  // the workers' join_window (EngineOptions)
  // The consumers' commit policy (WorkerSpec::commit): "shadow" also runs a reader in
  // each inference rank that checks every read of its live params during syncs is one
  // version (a read of a mix fails the demo); "groups" one that checks every layer group
  // of each read is whole, the version held or the one syncing (a group half written
  // fails the demo).
  std::string commit = "in_place";
  // Inference ranks pass param buffers of their own (WorkerSpec::caller_params): under
  // shadow the commit copies into them instead of flipping.
  bool caller_params = false;
  int rank_timeout_ms = 20000;  // the workers' EngineOptions::timeout
  std::string backend = "ucx";
  // UCX_TLS of the workers (passed as FERRY_UCX_TLS). Empty: default_worker_tls()
  // (tools/transport_options.h): $FERRY_UCX_TLS when set, else sm,tcp,self: reads and writes over
  // shared memory, every message over loopback tcp. Runs that SIGKILL ranks need tcp (or
  // another transport with peer-failure support) in the list: UCX 1.13's shared-memory
  // receive FIFO is shared by every sender, and a sender killed mid-send can leave the
  // receiver deaf to every peer for good, so the transport keeps messages off it
  // (docs/transport.md).
  std::string ucx_tls;
  bool checksums = false;
  // ConsumerOptions::relay of every inference rank: replicas on one host copy from one
  // (docs/relay.md).
  bool relay = false;
  // Delta syncs (EngineOptions::delta) on every rank, and what the trainer's synthetic
  // weights change per version (SyntheticChanges: "scattered" elements or "clustered"
  // whole tensors).
  bool delta = false;
  double changed_fraction = 1.0;
  std::string changes = "scattered";
  uint64_t delta_block_bytes = 0;  // EngineOptions::delta_block_bytes (0: keep a copy)
  bool delta_same_host = false;    // EngineOptions::delta_same_host (patches over shared memory too)
  // Trainer ranks generate each version's synthetic weights before their sync starts
  // (held in memory, as a trainer's parameters are): the sync's seconds are then the
  // engine's alone. Default: generated group by group inside the sync.
  bool prepare_weights = false;
  uint64_t staging_budget = 0;  // every producer's ProducerOptions::staging_budget (0: two slots)
  int syncs = 4;
  uint64_t seed = 1;
  std::string kill_role = "consumer";  // "consumer" (inference rank) | "producer" (trainer rank)
  int kill_rank = 1;
  // (version, point); point -1: random. Consumer: group * 4 + phase; producer: group.
  std::vector<std::pair<int, int>> kills;
  // A checksum mismatch injected (needs `checksums` to be caught): trainer rank
  // `corrupt_rank` flips one byte of group `corrupt_group`'s staging in sync
  // `corrupt_sync`, after checksumming (engine::TestHooks::corrupt_group; 0: never). The
  // consumers that read that segment fail the sync (kCorrupt naming the producer).
  int corrupt_sync = 0;
  int corrupt_group = 0;
  int corrupt_rank = 0;
  // Commit "shadow" only: every inference rank syncs this version with commit=false, then
  // discards it (Consumer::discard), its reader still running (0: never). The row counts
  // them in `discarded` and `live_verified` (the live params still the version before).
  int discard_sync = 0;
  // The argv prefix each rank's `ferry worker` runs under (e.g. scripts/hosts.sh exec P H:
  // on emulated host H); it must exec the worker, so that the pid is the worker's. Empty
  // (or no function): the worker runs directly.
  std::function<std::vector<std::string>(const std::string& role, int rank)> launch_prefix;
  int timeout_ms = 60000;     // bound on each wait of the driver
  bool quiet = false;
  bool verbose = false;       // per-rank phase times under each sync
  // Write every rank's trace of every sync to this file (Chrome trace-event JSON,
  // tools/trace_file.h): each worker process writes its own part in the run's directory,
  // merged here when the run ends (also a failed one). Empty: none.
  std::string trace;
};
struct DemoSyncRow {
  int version = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t broadcast_bytes = 0;
  int verified = 0;
  int expected = 0;   // consumers that reported (the killed one excluded)
  int failed = 0;     // consumers whose sync failed
  int torn = 0;       // consumers reporting torn state after the sync
  // Commit shadow: failed (or discarded) consumers whose live params were still, bit for
  // bit, the version they held before (the worker's "live_verified"), and reads of the
  // live params during the sync that saw a mix of versions (should be 0).
  int live_verified = 0;
  uint64_t mixed_reads = 0;
  // DemoSpec::discard_sync: consumers that received the version (state().received was
  // it), discarded it and then held none received (the worker's "discarded"). Each one
  // counts in `expected` and in `live_verified` when its live params were still the version
  // before, not in `verified` (its live params are not this version).
  int discarded = 0;
  std::vector<std::string> errors;  // "consumerN: error" of each failed consumer
  std::vector<std::string> failures;  // failure lines of every rank (failovers, drops)
  std::vector<uint64_t> producer_bytes;  // bytes each trainer rank served (0: none or no result)
  // Each rank's result as it reported it ("producer0" -> worker JSON, tools/worker.h).
  std::map<std::string, std::string> results;
  // Reports: producers whose report said ok; consumers named in some producer's
  // `missed`; and every way a report was untrue ("producer 0 says ok but consumer 2,
  // which it serves, did not verify 3"; "consumer 2 did not verify 3 and producer 1,
  // which serves it, does not name it in missed"). Empty when every report was true.
  int producers_ok = 0;
  int missed = 0;
  std::vector<std::string> untrue;
  std::string paused;       // what was paused during or before this sync
  std::string note;
  // The stall: the longest commit among the inference ranks that committed this sync (the
  // pause a serving engine feels); the slowest receiver: the longest inference rank's
  // sync, and its name and stage record (the report's "stages", summing to its seconds).
  double stall = 0;
  double slowest_seconds = 0;
  std::string slowest;
  nlohmann::json slowest_stages;
};
struct DemoResult {
  std::vector<DemoSyncRow> rows;
  // Soak figures: growth of each worker's RSS (KiB) and open descriptors between the
  // end of sync `min(10, syncs/4)` and the one before the last (workers that were never restarted).
  int64_t max_rss_growth_kib = 0;
  int64_t max_fd_growth = 0;
  bool all_verified = false;
  std::string ucx_tls;  // the workers' UCX_TLS
  std::string store_url;  // without its token
  int pauses_injected = 0;  // SIGSTOP/SIGCONT pairs done
  std::vector<std::string> pauses_not_reached;  // mid-sync pauses whose rank never stopped
  int store_restarts = 0;
  int link_cuts_done = 0;   // links taken down and brought back up
  std::string error;
};
DemoResult run_demo(const DemoSpec& spec);

}  // namespace ferry::tools
