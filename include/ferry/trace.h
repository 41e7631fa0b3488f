// ferry/trace.h — what one sync did, step by step (SyncReport::trace).
//
// Every phase and every transfer of a sync is one TraceEvent, recorded by the engine as it
// runs, always (docs/trace.md says what it costs: a few hundred events per sync of a large
// model, tens of nanoseconds each). SyncReport's byte counts and phase seconds are sums
// over these events, made by one function, so a report and a picture of the trace never
// disagree. `ferry demo/bench/serve/fetch --trace FILE` write them as Chrome trace-event
// JSON (Perfetto, chrome://tracing); `ferry trace FILE` summarises or plots such a file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ferry {

enum class TracePhase : uint8_t {
  // Producer
  kWait,         // for a free staging slot (producer) / for an announce or push (consumer)
  kMaterialize,  // WeightSource::materialize of a group
  kPack,         // packing the group into its staging slot (and checksums)
  kAnnounce,     // pull: the group's ANNOUNCEs sent
  kPushWrite,    // push: one consumer's writes of a group posted, until flushed
  kSend,         // transfer: bytes of a group a consumer took (read, or written by push)
  kCommit,       // producer: waiting for every consumer's DONE; consumer: DONEs and commit
  // Consumer
  kRead,         // reads posted and waited for (the sync thread's share of a group)
  kReceive,      // transfer: bytes of a group from one producer, landed
  kUnpack,       // background thread: receive slot -> params
  kPost,         // background thread: process_weights_after_loading
};
std::string_view trace_phase_name(TracePhase phase);  // "wait", "push-write", "send", ...

// How a transfer's bytes moved. kNone for phases that are not transfers.
enum class TraceLane : uint8_t {
  kNone,
  kTransport,  // through the transport from staging (read or write)
  kInPlace,    // through the transport straight from the trainer's own memory (no staging)
  kCudaIpc,    // device to device from a producer's GPU staging on this host
  kPatch,      // through the transport from staging, as a delta patch (EngineOptions::delta)
  kRelay,      // between consumers of one host: copied from (receive) or by (send) a relay's
               // receive ring (ConsumerOptions::relay); peer is the other consumer's rank
  kReplica,    // a joiner's catch-up (Consumer::catch_up): read from the live params of a replica
               // of its plan class; peer is that consumer's rank
};
// "", "transport", "in_place", "cuda_ipc", "patch", "relay", "replica"
std::string_view trace_lane_name(TraceLane lane);

// Where a sync's thread spends its wall time, one stage at a time (SyncReport::stages):
// the stages never overlap, so they and the time no stage claimed sum to the sync's
// seconds. (The phases of TraceEvent overlap: the unpack worker runs beside the reads.)
enum class SyncStage : uint8_t {
  kRendezvous,    // the store and the peers: claims, leases, connections, republishing
  kRouting,       // routes rebuilt or checked, the attempt planned
  kRegistration,  // memory registered with the transport for new routes (params, landings)
  kWire,          // waiting for the other side: announcements or pushes (consumer), free slots (producer)
  kReceive,       // consumer: reads posted and landed, verified; producer: announcing and serving
  kTransform,     // producer: materialise and pack; consumer: waiting for unpack and post-processing
  kCommit,        // the DONEs, and making the version live
};
inline constexpr int kSyncStageCount = 7;
std::string_view sync_stage_name(SyncStage stage);  // "rendezvous", "routing", ...

struct TraceEvent {
  TracePhase phase = TracePhase::kWait;
  TraceLane lane = TraceLane::kNone;
  int32_t group = -1;  // layer group; -1: the sync as a whole
  int32_t peer = -1;   // the other side's rank (a consumer for a producer and vice versa); -1: none
  uint64_t bytes = 0;  // transfers (kSend, kReceive) only
  bool into_params = false;  // kReceive: the bytes landed straight in params
  // False: bytes of an attempt the consumer abandoned (it failed over and read the
  // group again); shown, but not in the report's byte counts.
  bool counted = true;
  uint16_t attempt = 0;      // 0, then one more at each failover restart
  int64_t t0_ns = 0, t1_ns = 0;  // since the sync began (SyncReport::start_unix_ns)
  bool is_transfer() const { return phase == TracePhase::kSend || phase == TracePhase::kReceive; }
};

// A decision of a sync's control plane (SyncReport::events, in the order made): who
// moves which version changed, or a step could not be taken and the sync went on another
// way. Each is one line of SyncReport::failures (its `message`): the report's lines are
// made from these, and a sink (EngineOptions::sink) gets each as it is made.
enum class ControlKind : uint8_t {
  kDrop,        // producer: consumer `peer` dropped from the sync (straggler, stalled, its ABORT)
  kMissed,      // producer: consumer `peer` served by it did not commit (absent, or silent)
  kFailover,    // routes rebuilt without dead producers (consumer: after producer `peer` failed)
  kFollow,      // consumer: followed producers to routes without a failed producer
  kRejoin,      // producer: failed over by consumers while alive; serves again next sync
  kRestart,     // consumer: producer `peer` was gone as the sync began; its restarted instance served it
  kRelayLost,   // consumer: its relay, consumer `peer`, lost at `group`; the rest read from producers
  kRelayUnreached,  // consumer: relay or member `peer` not reached; read from the producers
  kRepair,      // consumer: the patch of `group` from producer `peer` failed its check; dense bytes read
  kRepublish,   // the store had lost its rendezvous keys (restarted): re-published
  kStore,       // a store write failed (a committed version, a lease); the sync went on
  kNote,        // a lane or path this attempt could not use (the attempt plan's notes)
  kWeights,     // consumer: the weight check of the version held found a changed param or a drifted replica
  kCatchUp,     // consumer: a catch-up from replica `peer` refused, failed or revoked (the next
                // source is tried); as the source, a joiner's hold given up for its next sync
};
std::string_view control_kind_name(ControlKind kind);  // "drop", "missed", "failover", ...

struct ControlEvent {
  ControlKind kind = ControlKind::kNote;
  int32_t peer = -1;   // the rank it is about (a consumer for a producer and vice versa); -1: none
  int32_t group = -1;  // layer group; -1: the sync as a whole
  uint16_t attempt = 0;
  int64_t t_ns = 0;     // since the sync began (SyncReport::start_unix_ns)
  std::string message;  // its line in SyncReport::failures, naming this rank
};

}  // namespace ferry
