#include "engine/sync_trace.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "engine/schedule.h"

namespace ferry {

std::string_view trace_phase_name(TracePhase phase) {
  switch (phase) {
    case TracePhase::kWait: return "wait";
    case TracePhase::kMaterialize: return "materialize";
    case TracePhase::kPack: return "pack";
    case TracePhase::kAnnounce: return "announce";
    case TracePhase::kPushWrite: return "push-write";
    case TracePhase::kSend: return "send";
    case TracePhase::kCommit: return "commit";
    case TracePhase::kRead: return "read";
    case TracePhase::kReceive: return "receive";
    case TracePhase::kUnpack: return "unpack";
    case TracePhase::kPost: return "post";
  }
  return "?";
}

std::string_view control_kind_name(ControlKind kind) {
  switch (kind) {
    case ControlKind::kDrop: return "drop";
    case ControlKind::kMissed: return "missed";
    case ControlKind::kFailover: return "failover";
    case ControlKind::kFollow: return "follow";
    case ControlKind::kRejoin: return "rejoin";
    case ControlKind::kRestart: return "restart";
    case ControlKind::kRelayLost: return "relay-lost";
    case ControlKind::kRelayUnreached: return "relay-unreached";
    case ControlKind::kRepair: return "repair";
    case ControlKind::kRepublish: return "republish";
    case ControlKind::kStore: return "store";
    case ControlKind::kNote: return "note";
    case ControlKind::kWeights: return "weights";
    case ControlKind::kCatchUp: return "catch-up";
  }
  return "?";
}

std::string_view sync_stage_name(SyncStage stage) {
  switch (stage) {
    case SyncStage::kRendezvous: return "rendezvous";
    case SyncStage::kRouting: return "routing";
    case SyncStage::kRegistration: return "registration";
    case SyncStage::kWire: return "wire";
    case SyncStage::kReceive: return "receive";
    case SyncStage::kTransform: return "transform";
    case SyncStage::kCommit: return "commit";
  }
  return "?";
}

std::string_view trace_lane_name(TraceLane lane) {
  switch (lane) {
    case TraceLane::kNone: return "";
    case TraceLane::kTransport: return "transport";
    case TraceLane::kInPlace: return "in_place";
    case TraceLane::kCudaIpc: return "cuda_ipc";
    case TraceLane::kPatch: return "patch";
    case TraceLane::kRelay: return "relay";
    case TraceLane::kReplica: return "replica";
  }
  return "?";
}

}  // namespace ferry

namespace ferry::engine {

void SyncTrace::begin(Clock::time_point start, uint64_t version) {
  SyncSink* sink;
  SyncSource from;
  {
    std::lock_guard<std::mutex> lk(mu_);
    begin_locked(start, version);
    sink = sink_;
    from = source_;
  }
  if (sink) sink->on_begin(from);
}

void SyncTrace::begin_locked(Clock::time_point start, uint64_t version) {
  stage_ = -1;
  std::fill(std::begin(stage_ns_), std::end(stage_ns_), 0);
  events_.clear();
  control_.clear();
  source_.version = version;
  events_.reserve(256);
  start_ = start;
  // The system clock at `start`: what places ranks of several processes (and hosts) on
  // one timeline.
  const auto now_sys = std::chrono::system_clock::now();
  const auto since = Clock::now() - start;
  start_unix_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(now_sys.time_since_epoch() - since).count();
  attempt_ = 0;
  failed_peer_ = failed_group_ = -1;
}

void SyncTrace::failed_at(int peer, int group) {
  std::lock_guard<std::mutex> lk(mu_);
  failed_peer_ = peer;
  failed_group_ = group;
}

void SyncTrace::record(TracePhase phase, int group, int peer, Clock::time_point t0, Clock::time_point t1,
                       TraceLane lane, uint64_t bytes, bool into_params) {
  TraceEvent e;
  e.phase = phase;
  e.lane = lane;
  e.group = group;
  e.peer = peer;
  e.bytes = bytes;
  e.into_params = into_params;
  std::lock_guard<std::mutex> lk(mu_);
  e.attempt = attempt_;
  e.t0_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t0 - start_).count();
  e.t1_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - start_).count();
  events_.push_back(e);
}

void SyncTrace::new_attempt(bool count_earlier_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!count_earlier_bytes) {
    for (TraceEvent& e : events_) {
      if (e.is_transfer()) e.counted = false;
    }
  }
  ++attempt_;
}

std::vector<TraceEvent> SyncTrace::take() {
  std::lock_guard<std::mutex> lk(mu_);
  return std::move(events_);
}

void SyncTrace::control(ControlKind kind, int peer, int group, std::string message) {
  ControlEvent e;
  e.kind = kind;
  e.peer = peer;
  e.group = group;
  e.message = std::move(message);
  SyncSink* sink;
  SyncSource from;
  {
    std::lock_guard<std::mutex> lk(mu_);
    e.attempt = attempt_;
    e.t_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start_).count();
    control_.push_back(e);
    sink = sink_;
    from = source_;
  }
  if (sink) sink->on_control(from, e);  // (outside the trace's lock: it may take its own)
}

void SyncTrace::stage(SyncStage s) {
  const auto now = Clock::now();
  if (stage_ >= 0) stage_ns_[stage_] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - stage_since_).count();
  stage_ = static_cast<int>(s);
  stage_since_ = now;
}

void SyncTrace::committed(uint64_t v, double seconds) {
  SyncSink* sink;
  SyncSource from;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sink = sink_;
    from = source_;
  }
  from.version = v;
  if (sink) sink->on_commit(from, seconds);
}

void SyncTrace::set_sink(SyncSink* sink, const char* side, int rank) {
  std::lock_guard<std::mutex> lk(mu_);
  sink_ = sink;
  source_.side = side;
  source_.rank = rank;
}

void SyncTrace::finish_report(SyncReport& r) {
  SyncSink* sink;
  SyncSource from;
  {
    std::lock_guard<std::mutex> lk(mu_);
    r.trace = std::move(events_);
    r.events = std::move(control_);
    events_.clear();
    control_.clear();
    sink = sink_;
    from = source_;
    r.failure.reset();
    if (!r.status.ok()) r.failure = SyncFailure{failed_peer_, failed_group_, r.status.code(), r.status.message()};
  }
  for (const ControlEvent& e : r.events) r.failures.push_back(e.message);
  r.start_unix_ns = start_unix_ns_;
  // The open stage ends where the sync's seconds end (they were measured just before).
  if (stage_ >= 0) {
    const auto end = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(r.seconds));
    if (end > stage_since_)
      stage_ns_[stage_] += std::chrono::duration_cast<std::chrono::nanoseconds>(end - stage_since_).count();
    stage_ = -1;
  }
  double staged = 0;
  for (int i = 0; i < kSyncStageCount; ++i) {
    r.stages.seconds[i] = static_cast<double>(stage_ns_[i]) * 1e-9;
    staged += r.stages.seconds[i];
  }
  r.stages.unattributed = std::max(0.0, r.seconds - staged);
  derive_report_sums(r);
  if (sink) sink->on_report(from, r);
}

void record_receives(SyncTrace& trace, int g, const ConsumerGroupSchedule& gs, bool ipc, Clock::time_point t0,
                     Clock::time_point t1, const std::map<int, uint64_t>& patched, const std::set<int>& repaired) {
  // (producer, lane, into params) -> bytes, in that order.
  std::map<std::tuple<int, TraceLane, bool>, uint64_t> parts;
  for (const auto& [p, bytes] : patched) parts[{p, TraceLane::kPatch, false}] = bytes;
  for (const SubRead& sr : gs.reads) {
    if (patched.count(static_cast<int>(sr.producer)) && !repaired.count(static_cast<int>(sr.producer))) continue;
    const TraceLane lane = ipc ? TraceLane::kCudaIpc : sr.region >= 0 ? TraceLane::kInPlace : TraceLane::kTransport;
    parts[{static_cast<int>(sr.producer), lane, sr.param != nullptr}] += sr.length;
  }
  for (const auto& [key, bytes] : parts) {
    const auto& [p, lane, into_params] = key;
    trace.record(TracePhase::kReceive, g, p, t0, t1, lane, bytes, into_params);
  }
}

void derive_report_sums(SyncReport& r) {
  r.bytes_sent = r.sent_in_place = r.bytes_received = r.received_into_params = r.received_via_cuda_ipc = 0;
  r.patch_bytes = 0;
  r.received_via_relay = r.relayed_to_peers = r.received_from_replicas = 0;
  r.bytes_per_peer.clear();
  r.materialize_seconds = r.pack_seconds = r.wait_seconds = r.read_seconds = r.unpack_seconds = r.post_seconds = 0;
  int64_t ns[static_cast<size_t>(TracePhase::kPost) + 1] = {};
  for (const TraceEvent& e : r.trace) {
    ns[static_cast<size_t>(e.phase)] += e.t1_ns - e.t0_ns;
    if (!e.is_transfer() || !e.counted) continue;
    if (e.lane == TraceLane::kRelay) {  // between consumers: the peer is a consumer, not a producer
      if (e.phase == TracePhase::kSend) {
        r.relayed_to_peers += e.bytes;
      } else {
        r.bytes_received += e.bytes;
        r.received_via_relay += e.bytes;
      }
      continue;
    }
    if (e.lane == TraceLane::kReplica) {  // a joiner's catch-up: the peer is a consumer
      r.bytes_received += e.bytes;
      r.received_from_replicas += e.bytes;
      if (e.into_params) r.received_into_params += e.bytes;
      continue;
    }
    r.bytes_per_peer[e.peer] += e.bytes;
    if (e.lane == TraceLane::kPatch) r.patch_bytes += e.bytes;
    if (e.phase == TracePhase::kSend) {
      r.bytes_sent += e.bytes;
      if (e.lane == TraceLane::kInPlace) r.sent_in_place += e.bytes;
    } else {
      r.bytes_received += e.bytes;
      if (e.into_params) r.received_into_params += e.bytes;
      if (e.lane == TraceLane::kCudaIpc) r.received_via_cuda_ipc += e.bytes;
    }
  }
  auto secs = [&](TracePhase p) { return static_cast<double>(ns[static_cast<size_t>(p)]) * 1e-9; };
  r.materialize_seconds = secs(TracePhase::kMaterialize);
  r.pack_seconds = secs(TracePhase::kPack);
  r.wait_seconds = secs(TracePhase::kWait);
  r.read_seconds = secs(TracePhase::kRead);
  r.unpack_seconds = secs(TracePhase::kUnpack);
  r.post_seconds = secs(TracePhase::kPost);
}

}  // namespace ferry::engine
