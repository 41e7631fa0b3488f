// ferry/engine.h — the sync engine (shared/DESIGN.md §8): a Producer per trainer rank,
// a Consumer per inference rank, moving one version of the weights per sync, layer group
// by layer group, point to point.
//
// Rendezvous (Producer::create / Consumer::create), under the store prefix `job`:
//   {job}/meta               trainer metadata (JSON; written by producer 0)
//   {job}/holdings/{p}       producer p's holdings (JSON)
//   {job}/plan/{c}           consumer c's canonical plan (Plan::encode)
//   {job}/producer/{p}       lease: producer p's transport address + staging-ring key
//   {job}/consumer/{c}       lease: consumer c's transport address + receive-ring key
// Every participant waits (bounded by rendezvous_timeout) until every expected producer
// and consumer has published, then builds the same Routes with build_routes (a pure
// function of metadata, holdings and plans), so no routes cross the wire. Routes do not
// depend on which consumers are alive: a dead consumer is skipped, a restarted one (same
// rank, same plan) rejoins at the next sync without any rebuild.
//
// One sync (version v), pull mode (the default):
//   producer: for each group g in order: wait for a free staging slot (ring of slots
//     bounded by staging_budget; default two groups), materialise g, pack it, send
//     ANNOUNCE(v, g, slot) to every live consumer that reads from it in g, move on to
//     g+1 (so materialise/pack of g+1 overlaps the reads of g). A slot is free again
//     once every consumer it was announced to sent RELEASE or was dropped.
//   consumer: for each group g: as each producer it reads from in g announces, read
//     that producer's segments into a slot of its registered receive ring (two slots)
//     and send it RELEASE; then hand the slot to a background thread that unpacks into the params
//     and runs RankLoader::process_weights_after_loading for every post-processing group whose
//     params are now complete; meanwhile the caller thread reads g+1. v is committed
//     only when every group landed.
// Zero copy (pull; docs/engine.md): consumers read pieces that unpack as plain byte
//   copies straight into their (registered) params, and producers whose weights live in
//   transport regions (ProducerOptions::source_regions) let consumers read contiguous
//   pieces from there, unpacked and unstaged; such in-place bytes that land in params are
//   read ahead, for every group, once the producer announced anything of v.
// Push mode: the consumer sends READY(v, g, recv slot) instead of waiting for ANNOUNCE;
//   the producer writes its segments into that receive slot, flushes, and sends PUSHED.
// Membership per sync: a producer serves the consumers whose lease exists when its sync
//   starts (re-reading addresses, so restarted consumers are connected afresh).
//
// Failure semantics
//   * A consumer that dies (transport peer failure) or stalls (no RELEASE/READY within
//     stall_timeout) is dropped from the producer's current sync, recorded in
//     SyncReport::failures, and the producer finishes for the others. A dropped live
//     consumer is told (DROPPED) and fails its sync.
//   * A producer failing during a consumer's sync: with a DP replica holding its boxes,
//     consumers fail over (EngineOptions::failover) and the sync completes; otherwise the
//     sync fails with kPeerFailed naming the producer; groups already unpacked are new
//     and the rest old: state() reports torn until a later sync completes. A restarted
//     producer (Producer::create again, between syncs: it clears its {job}/dead/ mark)
//     rejoins at the next sync.
//   * Every wait is bounded (timeout, stall_timeout, rendezvous_timeout); every
//     message is length-checked, every read is checked against the staging region
//     (Routes::validate plus the transport's key bounds).
//   * checksums=true: the producer sends an xxHash64 per segment with each announce;
//     the consumer checks it on arrival (kCorrupt naming producer and group).
//
// Ownership and threading
//   * The caller owns the WeightSource / ModelLoader, the Transport and the Store and
//     keeps them alive longer than the Producer/Consumer. The engine installs its own
//     message and peer-failure handlers on the Transport (one engine per Transport).
//   * sync() is called from one thread at a time; the rest of the API is thread-safe.
//     Hooks run on the caller's thread (before/after sync) or the consumer's
//     background thread (after_group); they must not call back into the engine.
//   * Destruction releases leases, handlers and registered memory; it waits at most
//     for the background thread to finish its current group.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/models.h"
#include "ferry/plan.h"
#include "ferry/route.h"
#include "ferry/source.h"
#include "ferry/status.h"
#include "ferry/store.h"
#include "ferry/transport.h"

namespace ferry {

namespace engine {
struct TestHooks;   // src/engine/testing.h (internal)
struct TestAccess;  // ditto
}  // namespace engine

enum class SyncMode : uint8_t { kPull, kPush };
Result<SyncMode> parse_sync_mode(std::string_view text);  // "pull" | "push"
std::string_view sync_mode_name(SyncMode mode);

struct EngineOptions {
  std::string job = "ferry";   // store key prefix
  int num_producers = 1;       // trainer world size
  int num_consumers = 1;       // inference world size
  SyncMode mode = SyncMode::kPull;
  std::chrono::milliseconds rendezvous_timeout{60000};
  // Bound on one wait inside a sync (an announce, a read, a free slot).
  std::chrono::milliseconds timeout{30000};
  // Producer: drop a consumer that has not released (pull) / asked (push) a group for
  // this long after it was announced. A consumer takes groups in order, so a slow
  // producer of an earlier group delays it: keep this above the slowest materialise.
  std::chrono::milliseconds stall_timeout{30000};
  std::chrono::milliseconds lease_ttl{3000};
  bool checksums = false;
  // Producer failover: when a producer dies mid-sync, consumers mark it in
  // {job}/dead/{p}, every participant rebuilds routes without it (the same routes:
  // build_routes over the remaining holdings) and the sync restarts; only when no other
  // producer holds what it held does the sync fail. Producers size staging slots for
  // the worst case when they share boxes with a replica.
  bool failover = true;
  // Fault injection for ferry's own tests (src/engine/testing.h); null in production.
  std::shared_ptr<const engine::TestHooks> test_hooks;
};

struct ProducerOptions : EngineOptions {
  // Zero-copy serving: regions of this producer's Transport (allocate_memory or
  // register_memory) that hold the source's weights *in place*: every box
  // materialize() returns inside one of them is at the same address every sync and
  // unchanged from the start of sync() until it returns (the trainer's own parameter
  // storage, updated only between syncs). Consumers read the pieces of such boxes that
  // are contiguous runs of at least direct_min_bytes straight from there; they are
  // neither packed nor staged. create() materialises every group once to learn where
  // each box lies; a sync fails (naming the tensor) if a box has moved. Empty (the
  // default): every byte is packed into staging. Over UCX 1.13 shared memory, peers read
  // allocate_memory regions by plain copy, memory registered in place only by message
  // over tcp (docs/transport.md).
  std::vector<MemoryRegion> source_regions;
  uint64_t direct_min_bytes = 64 * 1024;
  // Bytes of registered staging memory; 0: two groups (two slots of the largest group).
  uint64_t staging_budget = 0;
};

struct ConsumerOptions : EngineOptions {
  // Zero-copy (pull): a piece of at least this many bytes that unpacks as a plain byte
  // copy into a contiguous run of a param is read straight into the param (registered
  // with the transport at create) instead of through the receive ring. 0: every such
  // piece; UINT64_MAX: none (everything through the ring, as push mode does).
  uint64_t direct_min_bytes = 64 * 1024;
  std::function<void(uint64_t version)> before_sync;             // e.g. pause generation
  std::function<void(uint64_t version, int group)> after_group;  // background thread
  std::function<void(uint64_t version)> after_sync;              // resume with version
};

struct SyncReport {
  uint64_t version = 0;
  Status status;                // OK when this side finished the sync
  // Producer: bytes sent (each consumer's share counted), and of those served in place
  // (read straight from the source's own memory, no staging copy). Zero on a consumer.
  uint64_t bytes_sent = 0, sent_in_place = 0;
  // Consumer: bytes received, and of those read straight into params. Zero on a producer.
  uint64_t bytes_received = 0, received_into_params = 0;
  double seconds = 0;           // wall time of sync()
  // Phases (seconds, summed over groups). Producer: materialize, pack, wait (slots).
  // Consumer: wait (announces), read, unpack, post (process_weights_after_loading).
  double materialize_seconds = 0, pack_seconds = 0, wait_seconds = 0, read_seconds = 0, unpack_seconds = 0,
         post_seconds = 0;
  std::map<int, uint64_t> bytes_per_peer;  // peer rank -> bytes
  std::vector<int> dropped;                // producer: consumers dropped this sync
  std::vector<std::string> failures;       // one line per failure
  std::string to_string() const;
};

// What a consumer holds after its syncs.
struct ConsumerState {
  uint64_t version = 0;   // last committed version (valid if `has_version`)
  bool has_version = false;
  bool torn = false;      // a failed sync left some groups newer than `version`
};

class Producer {
 public:
  // Publishes metadata (rank 0), holdings and address; builds routes once every
  // expected participant has published; allocates and registers the staging ring.
  static Result<std::unique_ptr<Producer>> create(WeightSource& source, Transport& transport, Store& store,
                                                  const ProducerOptions& options);
  ~Producer();
  Producer(const Producer&) = delete;
  Producer& operator=(const Producer&) = delete;

  // Moves version `version` (what source.materialize returns now) to every live
  // consumer. OK unless this producer itself failed (its source, its transport, a
  // timeout with no consumer left to blame); dropped consumers are in the report.
  Result<SyncReport> sync(uint64_t version);

  const Routes& routes() const;
  int rank() const;
  struct Impl;

 private:
  explicit Producer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Consumer {
 public:
  // Records the plan of inference rank `rank` over the trainer metadata, publishes it,
  // builds routes, allocates the receive ring. `params`: the rank's param buffers as
  // loaded (RankLoader::params(), real, contiguous); empty: allocated here (zeroed).
  static Result<std::unique_ptr<Consumer>> create(const ModelLoader& loader, int rank, Transport& transport,
                                                  Store& store, const ConsumerOptions& options,
                                                  TensorMap params = {});
  ~Consumer();
  Consumer(const Consumer&) = delete;
  Consumer& operator=(const Consumer&) = delete;

  // Receives version `version`. On error the report (in the Status message) names the
  // failing producer or group, and state().torn tells whether params changed.
  Result<SyncReport> sync(uint64_t version);

  ConsumerState state() const;
  // Final params (after post-processing) of the last sync; valid between syncs.
  const TensorMap& params() const;
  const Routes& routes() const;
  int rank() const;
  struct Impl;

 private:
  friend struct engine::TestAccess;
  explicit Consumer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
