// A Chrome trace-event file of ranks' syncs (`--trace FILE`; docs/trace.md) (internal).
//
// {"traceEvents": [...], "displayTimeUnit": "ms", "ferryReports": [...]}: the events of
// engine/report_json.h's append_chrome_events (one process per rank), and each sync's
// report (sync_report_json plus "role" and "rank"), which `ferry trace` and the tests
// check the events against. A file is written whole after each sync (a rank that dies
// later leaves the syncs it finished); processes of one job write one file each and a
// driver (or `ferry trace A B ... --merge OUT`) merges them.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/report_json.h"
#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry::tools {

using engine::TraceFile;  // engine/report_json.h

// "{rank}" in a --trace path replaced by the rank (one file per rank of a launcher).
std::string trace_path_for_rank(const std::string& path, int rank);

// Reads and checks a trace file: an object with a "traceEvents" array whose events each
// have a string "ph" and "name", numeric "pid" and "ts" (not for "M"), "dur" >= 0 for
// "X". kCorrupt naming the file and the event otherwise.
Result<nlohmann::json> read_trace_file(const std::string& path);
// One file of every event and report of `parts` (in order); errors name the part.
Status merge_trace_files(const std::vector<std::string>& parts, const std::string& out);

}  // namespace ferry::tools
