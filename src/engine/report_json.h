// engine/report_json.h — the one serialiser of a SyncReport to JSON, and of its trace to
// Chrome trace events (internal; SyncReport::to_json is the public face).
//
// sync_report_json's keys are the report's field names (docs/trace.md, "Reports"): every
// CLI line (`ferry serve/fetch`, the demo's and the bench's workers) and every Python
// report dict is this object, with only its own extra keys added (rank, role, ...).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/engine.h"

namespace ferry::engine {

nlohmann::json memory_use_json(const MemoryUse& m);
// version, ok, error, code (null when OK), bytes (this side's), bytes_sent, sent_in_place,
// bytes_received, received_into_params, received_via_cuda_ipc, seconds, the six
// *_seconds, bytes_per_peer ({"rank": bytes}), dropped, missed, failures, memory.
nlohmann::json sync_report_json(const SyncReport& r);

// Chrome trace events (the JSON array format's objects) of one rank's syncs, ready to be
// merged with other ranks' into {"traceEvents": [...]}: process `pid` named `name`, a
// track per lane and thread ("sync", "unpack", "transport", "in_place", "cuda_ipc"; a
// track for each peer of a lane, split where slices overlap), "X" slices in microseconds
// since the epoch, a "bytes in flight" counter from the transfers.
struct ChromeProcess {
  int pid = 0;
  std::string name;       // "trainer 0", "inference 1"
  bool producer = false;  // names the peers of its tracks ("to consumer 2" / "from producer 1")
};
// The process/thread name metadata of `p` (once per file per process).
nlohmann::json chrome_process_metadata(const ChromeProcess& p, int sort_index);
// Appends r's events to `events` (and the thread names of tracks first used).
void append_chrome_events(nlohmann::json& events, const ChromeProcess& p, const SyncReport& r);
// The pid of a rank in a trace file: trainers 1, 3, 5, ...; inference ranks 2, 4, 6, ...
ChromeProcess chrome_process(bool producer, int rank);

// A Chrome trace file (`--trace FILE`, docs/trace.md) of one process's ranks' syncs:
// {"traceEvents": [...], "displayTimeUnit": "ms", "ferryReports": [...]}, the events of
// append_chrome_events (one process per rank) and each sync's report (sync_report_json
// plus "role" and "rank"), which `ferry trace` and the tests check the events against.
// Written whole after each sync (a rank that dies later leaves the syncs it finished);
// the processes of a job write one file each, merged by a driver or `ferry trace --merge`
// (tools/trace_file.h).
class TraceFile {
 public:
  explicit TraceFile(std::string path) : path_(std::move(path)) {}
  const std::string& path() const { return path_; }
  void add(bool producer, int rank, const SyncReport& r);  // one sync of trainer/inference rank `rank`
  Status write() const;  // to a temporary beside it, then renamed; errors name the path

 private:
  std::string path_;
  nlohmann::json events_ = nlohmann::json::array();
  nlohmann::json reports_ = nlohmann::json::array();
  std::vector<int> named_;  // pids whose process metadata is in events_
};
Status write_trace_file(const std::string& path, const nlohmann::json& events, const nlohmann::json& reports);

}  // namespace ferry::engine
