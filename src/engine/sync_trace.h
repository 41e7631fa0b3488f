// engine/sync_trace.h — the recorder of a sync's TraceEvents (ferry/trace.h), and the one
// function that derives SyncReport's sums from them (internal).
//
// Cost (always on): record() takes one uncontended mutex and appends 48 bytes to a
// vector reserved at begin(); docs/trace.md gives the measured ns per event and events
// per sync. Threading: record() and new_attempt() may be called from any thread (the
// sync thread, the consumer's unpack worker, transport completion callbacks); begin()
// and take() from the sync thread while no other thread records. Lock order: the
// caller's locks -> the trace's (it calls nothing while holding it).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "engine/clock.h"
#include "ferry/engine.h"
#include "ferry/trace.h"

namespace ferry::engine {

struct ConsumerGroupSchedule;

class SyncTrace {
 public:
  // A new sync (of `version`) starting at `start` (the events' time origin): forgets the
  // previous one, and tells the sink (SyncSink::on_begin). Each begin() must be followed
  // by one finish_report(), whatever the sync's outcome.
  void begin(Clock::time_point start, uint64_t version = 0);
  // One event from t0 to t1 (steady clock); bytes, lane and into_params for transfers.
  void record(TracePhase phase, int group, int peer, Clock::time_point t0, Clock::time_point t1,
              TraceLane lane = TraceLane::kNone, uint64_t bytes = 0, bool into_params = false);
  // Later events belong to the next attempt. count_earlier_bytes false: the transfers
  // recorded so far are not counted in the report (the consumer reads them again).
  void new_attempt(bool count_earlier_bytes);
  // The events recorded since begin(), and the system-clock time of that origin.
  std::vector<TraceEvent> take();
  int64_t start_unix_ns() const { return start_unix_ns_; }

  // The sync thread's stage from now on (SyncReport::stages): it closes the one before.
  // The sync thread only (between begin() and finish_report()).
  void stage(SyncStage s);
  // A control decision (ferry/trace.h ControlEvent), recorded now and passed to the sink
  // (set_sink) at once, on the caller's thread.
  void control(ControlKind kind, int peer, int group, std::string message);
  // Where a failing sync stands: the peer whose failure ended it and the layer group it
  // was at (-1: none), for SyncReport::failure. The last call before finish_report wins.
  void failed_at(int peer, int group);
  // Consumer::commit() made version v live in `seconds`: tells the sink (on_commit).
  void committed(uint64_t v, double seconds);
  // Who records (for the sink: side "producer" or "consumer", rank), and the sink, if any
  // (EngineOptions::sink; kept alive by the options that hold it). Before the first sync.
  void set_sink(SyncSink* sink, const char* side, int rank);
  // The report of the sync since begin(v): `r`'s trace, events, failures (one per event,
  // in order, after any already there), its typed failure when r.status is not OK
  // (failed_at's peer and group), time origin, sums (derive_report_sums) and stages
  // (the last closed at r.seconds; unattributed what is left of it); then the sink's
  // on_report. The sync thread, once per sync, as it returns, after r.seconds is set.
  void finish_report(SyncReport& r);

 private:
  void begin_locked(Clock::time_point start, uint64_t version);

  std::mutex mu_;
  std::vector<TraceEvent> events_;
  std::vector<ControlEvent> control_;
  SyncSink* sink_ = nullptr;
  SyncSource source_;
  Clock::time_point start_{};
  int64_t start_unix_ns_ = 0;
  uint16_t attempt_ = 0;
  int failed_peer_ = -1, failed_group_ = -1;
  // Stages (the sync thread's alone: no lock).
  int stage_ = -1;
  Clock::time_point stage_since_{};
  int64_t stage_ns_[kSyncStageCount] = {};
};

// Consumer: the transfers of group g (one kReceive per producer, lane and destination:
// the ring or params), split from its schedule's reads; all of it via CUDA IPC when `ipc`.
// `patched`: producers whose segment came as a patch (delta), with its bytes: one
// kPatch receive each instead, and its dense bytes too for those in `repaired` (read
// after a patch failed its check).
void record_receives(SyncTrace& trace, int g, const ConsumerGroupSchedule& gs, bool ipc, Clock::time_point t0,
                     Clock::time_point t1, const std::map<int, uint64_t>& patched = {},
                     const std::set<int>& repaired = {});

// Sets r's byte counts (bytes_sent, sent_in_place, bytes_received, received_into_params,
// received_via_cuda_ipc, bytes_per_peer) from its counted transfers and its phase seconds
// (materialize, pack, wait, read, unpack, post) from the durations of those phases.
void derive_report_sums(SyncReport& r);

}  // namespace ferry::engine
