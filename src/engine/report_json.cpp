#include "engine/report_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <tuple>
#include <vector>

namespace ferry {

std::string SyncReport::to_json() const { return engine::sync_report_json(*this).dump(); }

}  // namespace ferry

namespace ferry::engine {

nlohmann::json memory_use_json(const MemoryUse& m) {
  return {{"staging_ring", m.staging_ring},
          {"receive_ring", m.receive_ring},
          {"metadata", m.metadata},
          {"transport_allowance", m.transport_allowance},
          {"extra", m.extra()},
          {"registered_in_place", m.registered_in_place},
          {"own_params", m.own_params},
          {"shadow", m.shadow},
          {"kept_copy", m.kept_copy}};
}

nlohmann::json sync_report_json(const SyncReport& r) {
  nlohmann::json peers = nlohmann::json::object();
  for (const auto& [peer, bytes] : r.bytes_per_peer) peers[std::to_string(peer)] = bytes;
  nlohmann::json j = {{"version", r.version},
                      {"ok", r.ok()},
                      {"error", nullptr},
                      {"code", nullptr},
                      {"failure", nullptr},
                      {"bytes", r.bytes_sent + r.bytes_received},
                      {"bytes_sent", r.bytes_sent},
                      {"sent_in_place", r.sent_in_place},
                      {"quantized_bytes", r.quantized_bytes},
                      {"bytes_received", r.bytes_received},
                      {"received_into_params", r.received_into_params},
                      {"received_via_cuda_ipc", r.received_via_cuda_ipc},
                      {"received_via_relay", r.received_via_relay},
                      {"received_from_replicas", r.received_from_replicas},
                      {"catch_up_source", r.catch_up_source},
                      {"relayed_to_peers", r.relayed_to_peers},
                      {"patch_bytes", r.patch_bytes},
                      {"patched_dense_bytes", r.patched_dense_bytes},
                      {"delta_elements", r.delta_elements},
                      {"delta_changed", r.delta_changed},
                      {"patches_repaired", r.patches_repaired},
                      {"seconds", r.seconds},
                      {"materialize_seconds", r.materialize_seconds},
                      {"pack_seconds", r.pack_seconds},
                      {"wait_seconds", r.wait_seconds},
                      {"read_seconds", r.read_seconds},
                      {"unpack_seconds", r.unpack_seconds},
                      {"post_seconds", r.post_seconds},
                      {"bytes_per_peer", peers},
                      {"dropped", r.dropped},
                      {"missed", r.missed},
                      {"left", r.left},
                      {"joined", r.joined},
                      {"epoch", r.epoch},
                      {"failures", r.failures},
                      {"live_version", nullptr},
                      {"unchanged", nullptr},
                      {"committed", r.committed},
                      {"commit_seconds", r.commit_seconds},
                      {"groups_live", r.groups_live},
                      {"memory", memory_use_json(r.memory)}};
  if (r.live_version) j["live_version"] = *r.live_version;
  if (r.unchanged) j["unchanged"] = *r.unchanged;
  nlohmann::json events = nlohmann::json::array();
  for (const ControlEvent& e : r.events)
    events.push_back({{"kind", std::string(control_kind_name(e.kind))}, {"peer", e.peer}, {"group", e.group},
                      {"attempt", e.attempt}, {"t_ns", e.t_ns}, {"message", e.message}});
  j["events"] = events;
  // The stage record: where `seconds` went, stage by stage, summing to it.
  nlohmann::json stages = nlohmann::json::object();
  for (const auto& [name, secs] : r.stages.named()) stages[std::string(name)] = secs;
  j["stages"] = stages;
  nlohmann::json live = nlohmann::json::object();
  for (const auto& [c, v] : r.consumers_live) live[std::to_string(c)] = v;
  j["consumers_live"] = live;
  if (!r.status.ok()) {
    j["error"] = r.status.to_string();
    j["code"] = std::string(status_code_name(r.status.code()));
  }
  if (r.failure) {
    j["failure"] = {{"peer", r.failure->peer}, {"group", r.failure->group},
                    {"reason", std::string(status_code_name(r.failure->reason))}, {"message", r.failure->message}};
  }
  return j;
}

ChromeProcess chrome_process(bool producer, int rank) {
  return {producer ? 2 * rank + 1 : 2 * rank + 2, fmt::format("{} {}", producer ? "trainer" : "inference", rank),
          producer};
}

nlohmann::json chrome_process_metadata(const ChromeProcess& p, int sort_index) {
  return nlohmann::json::array(
      {{{"ph", "M"}, {"pid", p.pid}, {"tid", 0}, {"name", "process_name"}, {"args", {{"name", p.name}}}},
       {{"ph", "M"}, {"pid", p.pid}, {"tid", 0}, {"name", "process_sort_index"}, {"args", {{"sort_index", sort_index}}}}});
}

namespace {

// Tracks: what runs on the sync thread, on the consumer's unpack thread, a producer's
// push writes per consumer, and each lane's transfers per peer.
enum Track { kSyncThread = 1, kUnpackThread = 2, kPushWrites = 3, kLane = 4 };

Track track_of(const TraceEvent& e) {
  if (e.is_transfer()) return kLane;
  // (A layer group's commit under CommitPolicy::kGroups runs on the unpack thread too.)
  if (e.phase == TracePhase::kUnpack || e.phase == TracePhase::kPost || (e.phase == TracePhase::kCommit && e.group >= 0))
    return kUnpackThread;
  if (e.phase == TracePhase::kPushWrite) return kPushWrites;
  return kSyncThread;
}

std::string track_name(Track t, const TraceEvent& e, bool producer_side, int sub) {
  std::string n;
  const char* other = producer_side ? "consumer" : "producer";
  switch (t) {
    case kSyncThread: n = "sync"; break;
    case kUnpackThread: n = "unpack"; break;
    case kPushWrites: n = fmt::format("push-write to {} {}", other, e.peer); break;
    case kLane:
      n = fmt::format("{} {} {} {}", trace_lane_name(e.lane), producer_side ? "to" : "from",
                      e.lane == TraceLane::kRelay || e.lane == TraceLane::kReplica ? "consumer" : other, e.peer);
      break;
  }
  if (sub > 0) n += fmt::format(" ({})", sub + 1);
  return n;
}

}  // namespace

void append_chrome_events(nlohmann::json& events, const ChromeProcess& p, const SyncReport& r) {
  const bool producer_side = p.producer;
  const double origin_us = static_cast<double>(r.start_unix_ns) / 1e3;
  // Slices of one track must not overlap (viewers nest or drop them): each (track, lane,
  // peer) is split into sub-tracks, an event going to the first whose last slice ended.
  std::vector<size_t> order(r.trace.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return r.trace[a].t0_ns < r.trace[b].t0_ns; });
  std::map<std::tuple<int, int, int>, std::vector<int64_t>> ends;  // (track, lane, peer) -> last end per sub-track
  std::map<int, bool> named;
  std::vector<std::pair<int64_t, int64_t>> flight;  // (time, +/- bytes)
  for (size_t i : order) {
    const TraceEvent& e = r.trace[i];
    const Track t = track_of(e);
    const int peer = t == kSyncThread || t == kUnpackThread ? -1 : e.peer;
    auto& subs = ends[{t, static_cast<int>(e.lane), peer}];
    size_t sub = 0;
    while (sub < subs.size() && subs[sub] > e.t0_ns) ++sub;
    if (sub == subs.size()) subs.push_back(0);
    subs[sub] = std::max(e.t1_ns, e.t0_ns);
    const int tid = t * 1'000'000 + static_cast<int>(e.lane) * 100'000 + (peer + 1) * 100 + static_cast<int>(std::min<size_t>(sub, 99));
    if (!named[tid]) {
      named[tid] = true;
      events.push_back({{"ph", "M"}, {"pid", p.pid}, {"tid", tid}, {"name", "thread_name"},
                        {"args", {{"name", track_name(t, e, producer_side, static_cast<int>(sub))}}}});
      events.push_back({{"ph", "M"}, {"pid", p.pid}, {"tid", tid}, {"name", "thread_sort_index"},
                        {"args", {{"sort_index", tid}}}});
    }
    std::string name(trace_phase_name(e.phase));
    if (e.group >= 0) name += fmt::format(" g{}", e.group);
    nlohmann::json args = {{"version", r.version}, {"group", e.group}, {"attempt", e.attempt}};
    if (e.peer >= 0) args["peer"] = e.peer;
    if (e.is_transfer()) {
      args["bytes"] = e.bytes;
      args["lane"] = std::string(trace_lane_name(e.lane));
      args["into_params"] = e.into_params;
      args["counted"] = e.counted;
      flight.emplace_back(e.t0_ns, static_cast<int64_t>(e.bytes));
      flight.emplace_back(e.t1_ns, -static_cast<int64_t>(e.bytes));
    }
    events.push_back({{"ph", "X"}, {"pid", p.pid}, {"tid", tid}, {"name", name},
                      {"cat", e.is_transfer() ? "transfer" : "phase"},
                      {"ts", origin_us + static_cast<double>(e.t0_ns) / 1e3},
                      {"dur", static_cast<double>(std::max<int64_t>(0, e.t1_ns - e.t0_ns)) / 1e3}, {"args", args}});
  }
  // Control decisions: instants on the process's timeline, named by kind.
  for (const ControlEvent& e : r.events) {
    nlohmann::json args = {{"version", r.version}, {"attempt", e.attempt}, {"message", e.message}};
    if (e.peer >= 0) args["peer"] = e.peer;
    if (e.group >= 0) args["group"] = e.group;
    events.push_back({{"ph", "i"}, {"s", "p"}, {"pid", p.pid}, {"tid", 0}, {"name", std::string(control_kind_name(e.kind))},
                      {"cat", "control"}, {"ts", origin_us + static_cast<double>(e.t_ns) / 1e3}, {"args", args}});
  }
  // Bytes in flight: transfers begun and not yet landed (ends before starts at a tie).
  std::sort(flight.begin(), flight.end());
  int64_t in_flight = 0;
  for (size_t i = 0; i < flight.size(); ++i) {
    in_flight += flight[i].second;
    if (i + 1 < flight.size() && flight[i + 1].first == flight[i].first) continue;
    events.push_back({{"ph", "C"}, {"pid", p.pid}, {"tid", 0}, {"name", "bytes in flight"},
                      {"ts", origin_us + static_cast<double>(flight[i].first) / 1e3}, {"args", {{"bytes", in_flight}}}});
  }
}

void TraceFile::add(bool producer, int rank, const SyncReport& r) {
  const ChromeProcess p = chrome_process(producer, rank);
  if (std::find(named_.begin(), named_.end(), p.pid) == named_.end()) {
    named_.push_back(p.pid);
    for (auto& m : chrome_process_metadata(p, p.pid)) events_.push_back(std::move(m));
  }
  append_chrome_events(events_, p, r);
  nlohmann::json j = sync_report_json(r);
  j["role"] = producer ? "trainer" : "inference";
  j["rank"] = rank;
  reports_.push_back(std::move(j));
}

Status TraceFile::write() const { return write_trace_file(path_, events_, reports_); }

Status write_trace_file(const std::string& path, const nlohmann::json& events, const nlohmann::json& reports) {
  const nlohmann::json j = {{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"ferryReports", reports}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return unavailable("trace file {}: cannot write {}", path, tmp);
    f << j.dump();
    f.close();
    if (!f) return unavailable("trace file {}: writing {} failed", path, tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return unavailable("trace file {}: cannot rename {} to it", path, tmp);
  return Status::Ok();
}

}  // namespace ferry::engine
