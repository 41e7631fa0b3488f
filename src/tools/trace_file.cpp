#include "tools/trace_file.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>

namespace ferry::tools {

std::string trace_path_for_rank(const std::string& path, int rank) {
  std::string out = path;
  for (size_t at = out.find("{rank}"); at != std::string::npos; at = out.find("{rank}", at))
    out.replace(at, 6, std::to_string(rank));
  return out;
}

Result<nlohmann::json> read_trace_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return not_found("trace file {}: cannot open it", path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return corrupt("trace file {}: not JSON", path);
  if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array())
    return corrupt("trace file {}: no \"traceEvents\" array (Chrome trace-event JSON object format)", path);
  size_t i = 0;
  for (const auto& e : j["traceEvents"]) {
    auto bad = [&](const char* why) { return corrupt("trace file {}: event {}: {}: {}", path, i, why, e.dump()); };
    if (!e.is_object()) return bad("not an object");
    if (!e.contains("ph") || !e["ph"].is_string()) return bad("no string \"ph\"");
    if (!e.contains("name") || !e["name"].is_string()) return bad("no string \"name\"");
    if (!e.contains("pid") || !e["pid"].is_number()) return bad("no numeric \"pid\"");
    const std::string ph = e["ph"];
    if (ph != "M" && (!e.contains("ts") || !e["ts"].is_number())) return bad("no numeric \"ts\"");
    if (ph == "X" && (!e.contains("dur") || !e["dur"].is_number() || e["dur"].get<double>() < 0))
      return bad("an \"X\" slice without a \"dur\" >= 0");
    if (ph == "C" && (!e.contains("args") || !e["args"].is_object())) return bad("a \"C\" counter without \"args\"");
    ++i;
  }
  if (j.contains("ferryReports") && !j["ferryReports"].is_array())
    return corrupt("trace file {}: \"ferryReports\" is not an array", path);
  return j;
}

Status merge_trace_files(const std::vector<std::string>& parts, const std::string& out) {
  nlohmann::json events = nlohmann::json::array(), reports = nlohmann::json::array();
  for (const std::string& p : parts) {
    FERRY_ASSIGN_OR_RETURN(nlohmann::json j, read_trace_file(p));
    for (auto& e : j["traceEvents"]) events.push_back(std::move(e));
    if (j.contains("ferryReports")) {
      for (auto& r : j["ferryReports"]) reports.push_back(std::move(r));
    }
  }
  return engine::write_trace_file(out, events, reports);
}

}  // namespace ferry::tools
