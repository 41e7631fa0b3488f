// `ferry demo` and the multi-process tests (internal): their ranks are `ferry worker`
// processes (tools/worker.h), started and reaped through tools/subprocess.h.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ferry::tools {

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
  std::string store;          // empty: an embedded TCP store in this process
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
  int syncs = 4;
  uint64_t seed = 1;
  std::string kill_role = "consumer";  // "consumer" (inference rank) | "producer" (trainer rank)
  int kill_rank = 1;
  // (version, point); point -1: random. Consumer: group * 4 + phase; producer: group.
  std::vector<std::pair<int, int>> kills;
  int timeout_ms = 60000;     // bound on each wait of the driver
  bool quiet = false;
  bool verbose = false;       // per-rank phase times under each sync
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
  std::vector<std::string> errors;  // "consumerN: error" of each failed consumer
  std::vector<std::string> failures;  // failure lines of every rank (failovers, drops)
  std::vector<uint64_t> producer_bytes;  // bytes each trainer rank served (0: none or no result)
  std::string note;
};
struct DemoResult {
  std::vector<DemoSyncRow> rows;
  // Soak figures: growth of each worker's RSS (KiB) and open descriptors between the
  // end of sync `min(10, syncs/4)` and the one before the last (workers that were never restarted).
  int64_t max_rss_growth_kib = 0;
  int64_t max_fd_growth = 0;
  bool all_verified = false;
  std::string ucx_tls;  // the workers' UCX_TLS
  std::string error;
};
DemoResult run_demo(const DemoSpec& spec);

}  // namespace ferry::tools
