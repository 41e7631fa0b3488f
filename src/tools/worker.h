// The rank worker of `ferry demo` and of the multi-process tests (internal): one trainer
// or inference rank as its own process (`ferry worker ...`), started by run_demo.
//
// Protocol, through the store: the worker writes {job}/ready/{role}{rank} (its pid) once
// its Producer or Consumer is created; the driver writes {job}/go/{v}; the worker syncs v
// and writes {job}/result/{v}/{role}{rank} (JSON: the engine's report, engine/report_json.h's
// sync_report_json of last_report(), failed or not: bytes, seconds, the phases' *_seconds,
// dropped, missed, failures, ...; with "ok" saying whether sync() succeeded and report_ok
// SyncReport::ok; and verified,
// elapsed (the wall seconds of sync(), whatever its outcome), mismatch, torn, holds (consumer: the version it holds, absent before any); a producer also
// `serves`: the consumers that read from it under the full routes; memory: the engine's
// MemoryUse by kind; held_bytes: the rank's weights shard / params;
// source_resident_bytes (producer): the most the synthetic source holds at once, one
// group; from /proc: rss_base_bytes and anon_base_bytes before the engine was created,
// rss_created_bytes once it was, and after the sync (before verifying) rss_bytes,
// peak_rss_bytes, anon_bytes, shmem_bytes; `transport`: reads, writes, bytes and those by message).
// It exits 0 after its last version, 2 on an error of its own (the message on stderr).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry::tools {

struct WorkerSpec {
  std::string role;  // "producer" | "consumer"
  int rank = 0;
  std::string model;       // config path (already shrunk)
  std::string trainer;
  std::string inference;
  std::string store;       // URL (token from FERRY_TOKEN)
  std::string job = "ferry";
  std::string backend = "ucx";  // one-host settings; ucx: UCX_TLS from FERRY_UCX_TLS, else sm,tcp,self
  std::string mode = "pull";
  std::string group_order = "rotated";  // EngineOptions::group_order
  std::string convert_on = "producer";  // EngineOptions::convert_on
  std::string quantize_on = "producer";  // EngineOptions::quantize_on
  std::string quantize = "none";        // the inference ranks' LoaderOptions::quantize
  bool checksums = false;
  bool relay = false;  // ConsumerOptions::relay (consumers only)
  bool delta = false;                 // EngineOptions::delta
  uint64_t delta_block_bytes = 0;     // EngineOptions::delta_block_bytes
  bool delta_same_host = false;       // EngineOptions::delta_same_host
  // Producer: generate each version's weights before calling sync() (all groups held in
  // memory, as a trainer's parameters are), so the sync's time is the engine's alone.
  bool prepare_weights = false;
  double changed_fraction = 1.0;      // the synthetic weights' SyntheticChanges per version
  std::string changes = "scattered";  // ... scattered | clustered
  uint64_t seed = 1;
  int first_version = 1;
  int last_version = 1;
  int crash_version = -1;  // SIGKILL itself at `crash_point` of this sync
  int crash_point = 0;     // consumer: group * 4 + phase (see engine::TestHooks::consumer_point);
                           // producer: the group it is about to materialise
  // SIGSTOP itself at these (version, point)s (the same points as crash_point); the
  // driver SIGCONTs it (DemoSpec::pauses).
  std::vector<std::pair<int, int>> pauses;
  uint64_t staging_budget = 0;  // ProducerOptions::staging_budget (0: two slots)
  int stall_ms = 20000;
  int straggler_ms = 2000;  // EngineOptions::straggler_floor
  int join_window_ms = 20000;  // EngineOptions::join_window
  int timeout_ms = 20000;
  int lease_ttl_ms = 2000;
  // Bound on the wait for the driver's go key (and the retries of its own store
  // writes: a paused or restarting store is waited out, up to this long).
  int go_timeout_ms = 120000;
  // Write this process's trace of its syncs here (tools/trace_file.h), after each sync.
  std::string trace;
  // Consumer: ConsumerOptions::commit. Under "shadow" a reader thread reads the live
  // params in a loop during every sync (under the lock the commit hooks take) and checks
  // each read is exactly the committed version, bit for bit: the result's "reads" and
  // "mixed_reads" (reads that were not one version).
  std::string commit = "in_place";
  // Consumer: pass param buffers of this process to Consumer::create (host memory, as an
  // inference engine's parameters), instead of letting the engine allocate them: under
  // shadow the commit is a copy into them, not a flip.
  bool caller_params = false;
  // Producer: flip one byte of group `corrupt_group`'s staging in sync `corrupt_version`,
  // after checksumming (engine::TestHooks::corrupt_group/corrupt_version; -1: never).
  int corrupt_version = -1;
  int corrupt_group = 0;
  // Consumer (commit "shadow"): sync this version with commit=false, then discard() it;
  // the result says "received" (state().received before the discard), "discarded"
  // (received was this version, discard() succeeded and state().received is empty after
  // it) and "live_verified" (the live params are still, bit for bit, the version held
  // before). -1: never.
  int discard_version = -1;
};
// The pause point at the start of a sync: the go received, before Producer/Consumer::sync
// (so before any store call of that sync).
inline constexpr int kWorkerSyncStartPoint = -2;
// "2:5,4:-1" -> {(2,5),(4,-1)}; InvalidArgument naming the bad item.
Result<std::vector<std::pair<int, int>>> parse_pause_points(std::string_view text);
// The pause points of one worker process, each taken once: a consumer that falls back
// from its relay reaches the same point of the same sync again, and stopping itself a
// second time left it stopped for good (the driver resumes each pause once: the demo hung
// for its timeout, issue 49 finding 9). Thread-safe (the sync thread and the unpack worker
// both reach points).
class PausePoints {
 public:
  explicit PausePoints(std::vector<std::pair<int, int>> points) : points_(std::move(points)) {}
  // True the first time (v, point) is reached, if it is one of the points: pause there.
  bool take(int v, int point);

 private:
  std::mutex mu_;
  std::vector<std::pair<int, int>> points_;  // (those taken are removed)
};
int run_worker(const WorkerSpec& spec);

// The protocol's store keys.
std::string worker_ready_key(const std::string& job, const std::string& role, int rank);
std::string worker_go_key(const std::string& job, int version);
std::string worker_result_key(const std::string& job, int version, const std::string& role, int rank);

}  // namespace ferry::tools
