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
//   {job}/world/{role}/{r}/{P}/{C}  the world sizes rank r was given (in the key name)
//   {job}/committed/{c}     the version consumer c committed last, and whether a failed
//                           sync left it mixed or torn (committed_states)
//   {job}/instance/{role}/{r}  the instance holding rank r: its claim, written first
//   {job}/failed/{role}/{r}    why rank r failed to join (ttl rendezvous_timeout)
// A rank is held by one instance: create() first claims it (set only if absent, renewed
// every lease_ttl/3), waiting up to 1.5 lease_ttl for a dead holder's claim to lapse; a
// rank another live instance holds is refused with kAlreadyExists naming the rank and
// the holder, having written nothing (the holder keeps syncing). An instance whose rank
// a restart claimed while it was paused past lease_ttl fails every later sync with
// kFailedPrecondition naming the new holder.
// A rank whose create() fails its own checks publishes why; every other rank still
// joining fails within about 2 s with kPeerFailed naming it and the reason.
// Every participant waits (bounded by rendezvous_timeout; world sizes that differ
// between ranks fail within a second, kInvalidArgument naming both) until every expected
// producer and consumer has published, then builds the same Routes with build_routes (a pure
// function of metadata, holdings and plans), so no routes cross the wire. Each rank makes
// only the ops it uses (memory.h, producer_/consumer_router_options: a producer its packs,
// a consumer its plan class's unpacks and the packs it derives in-place reads from);
// Routes::fingerprint() is what the ranks compare. Routes do not
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
// Zero copy (docs/engine.md): pieces that unpack as plain byte copies land straight in
//   the consumer's (registered) params, and producers whose weights live in transport
//   regions (ProducerOptions::source_regions) serve contiguous pieces from there,
//   unpacked and unstaged. Pull: consumers read them; in-place bytes that land in params
//   are read ahead, for every group, once the producer announced anything of v. Push:
//   the producer writes them (the consumer's lease says where its params lie).
// Push mode: the consumer sends READY(v, g, recv slot) instead of waiting for ANNOUNCE;
//   the producer writes its segments into that receive slot and the consumer's params,
//   flushes, and sends PUSHED. A consumer that gives up a push sync returns only once no
//   write of a producer into it is in flight (ABORT, answered by FLUSHED; up to timeout).
// Membership per sync: a producer serves the consumers whose lease exists when its sync
//   starts (re-reading addresses, so restarted consumers are connected afresh), waiting
//   up to one lease_ttl for the lease of a consumer it is still connected to (a resumed
//   pause heals it; after a store restart, for every consumer); one still without a lease
//   is told DROPPED. One that it serves and that did not commit the version is named in
//   SyncReport::missed.
// Store restarts: at the start of every sync each rank re-publishes the keys it wrote
//   once at create (meta, holdings, plan) if the store lost them; a store that cannot be
//   reached fails sync() with the store's error, which names its URL.
// Creation: Producer::create returns once every consumer's lease is published (each
//   consumer's last step), so a sync() right away reaches all of them.
// Versions: every rank syncs the same version; a consumer whose producers serve another
//   fails at once (kFailedPrecondition, or kCancelled when a push producer dropped it),
//   naming both. An earlier version synced by every rank (a rollback) is a normal sync.
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
//     rejoins at the next sync. A producer a consumer waits for that is silent with its
//     lease gone at two checks a lease_ttl apart (its host cut off, or paused) is
//     failed over the same way when a replica holds its boxes; being alive, it clears
//     its own mark at the end of that sync and rejoins at the next one.
//   * A producer no replica covers that is gone as a consumer's sync begins (it died
//     between syncs) is waited for: the consumer polls the store with backoff for a
//     restarted instance's lease until `timeout` from the sync's start, meanwhile
//     JOINing the other producers (so they drop it neither as a straggler nor as
//     stalled), then syncs from the new instance; not back in time, the sync fails
//     naming it, nothing read.
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
#include <optional>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include "ferry/models.h"
#include "ferry/plan.h"
#include "ferry/route.h"
#include "ferry/source.h"
#include "ferry/status.h"
#include "ferry/store.h"
#include "ferry/trace.h"
#include "ferry/transport.h"

namespace ferry {

namespace engine {
struct TestHooks;   // src/engine/testing.h (internal)
struct TestAccess;  // ditto
}  // namespace engine

enum class SyncMode : uint8_t { kPull, kPush };
Result<SyncMode> parse_sync_mode(std::string_view text);  // "pull" | "push"
std::string_view sync_mode_name(SyncMode mode);

// The order layer groups move in within a sync (EngineOptions::group_order;
// docs/group-order.md). kLayer: every consumer reads the groups in layer order (under
// pipeline parallelism about one stage's trainer NICs send at a time). kRotated: the
// producers are split into lanes (a PP stage each), consumers into cohorts that start at
// different lanes and go round, and each producer serves its reads step by step, so
// every stage sends for the whole sync; with one lane (no PP) it is the layer order.
enum class GroupOrderKind : uint8_t { kLayer, kRotated };
Result<GroupOrderKind> parse_group_order_kind(std::string_view text);  // "layer" | "rotated"
std::string_view group_order_kind_name(GroupOrderKind kind);

struct SyncReport;

// The smallest EngineOptions::delta_block_bytes (other than 0): 64 bytes, where the block
// hashes are an eighth of the bytes staged.
inline constexpr uint64_t kMinDeltaBlockBytes = 64;

// Who a sink hears from: a side ("producer" or "consumer"), its rank, the sync's version.
struct SyncSource {
  const char* side = "";
  int rank = -1;
  uint64_t version = 0;
};

// Where each rank's syncs are told as they happen (EngineOptions::sink): each sync's
// start, its control decisions (ferry/trace.h ControlEvent: drops, failovers, repairs...)
// as each is made, and its report, ok or failed, as sync() returns (every on_begin is
// followed by one on_report), and a commit() after a sync that only received. A metrics
// exporter implements it (ferry/metrics.h). Calls come on the engine's threads (the sync thread; a transport handler thread for
// a drop), sometimes while the engine holds a lock: keep each short, never call back into
// the engine, and be thread-safe when several ranks share one sink.
class SyncSink {
 public:
  virtual ~SyncSink() = default;
  virtual void on_begin(const SyncSource& from) { static_cast<void>(from); }
  virtual void on_control(const SyncSource& from, const ControlEvent& event) {
    static_cast<void>(from);
    static_cast<void>(event);
  }
  virtual void on_report(const SyncSource& from, const SyncReport& report) {
    static_cast<void>(from);
    static_cast<void>(report);
  }
  // Consumer::commit() made a received version live (shadow, sync(v, false) first):
  // from.version is that version, `seconds` the commit's pause.
  virtual void on_commit(const SyncSource& from, double seconds) {
    static_cast<void>(from);
    static_cast<void>(seconds);
  }
};

struct EngineOptions {
  std::string job = "ferry";   // store key prefix
  int num_producers = 1;       // trainer world size
  int num_consumers = 1;       // inference world size
  SyncMode mode = SyncMode::kPull;
  std::chrono::milliseconds rendezvous_timeout{60000};
  // Bound on one wait inside a sync (an announce, a read, a free slot).
  std::chrono::milliseconds timeout{30000};
  // Producer: drop a consumer that has not released (pull) / asked (push) a group for
  // this long after the later of its announcement and the consumer's own last progress
  // in the sync (a release, a request, a JOIN: a consumer waiting for another producer's
  // restarted instance sends JOINs). A consumer takes groups in order, so a slow
  // producer of an earlier group delays it: keep this above the slowest materialise,
  // and above lease_ttl.
  std::chrono::milliseconds stall_timeout{30000};
  // Producer: a straggler — a consumer that entered the sync and has not released (pull)
  // / asked for (push) a slot the other consumers of that slot are done with, for longer
  // than max(straggler_floor, straggler_factor x the time the others took) since the
  // later of the last of them and its own last progress in this sync — is dropped from
  // this sync early (so it holds the others back by at most that bound, not by
  // stall_timeout) and catches up at the next sync. The same for the sync's end: one
  // that has not committed (DONE) that long after the others did. The bound is relative
  // so that a big group that takes everyone long is not a straggler, with a floor of
  // seconds so that ordinary jitter (scheduling, a short GC) is not either; it holds as
  // set, with any number of producers. A consumer that keeps moving (e.g.
  // post-processing each group for a second: it JOINs while its unpacking drains) is
  // never one, nor is one held up by another producer (it JOINs the others every
  // quarter of the floor while it waits for an announcement, reads or a failover), nor
  // are clocks run while the producer itself was stopped. A lone consumer
  // of a slot is never a straggler: only stall_timeout applies; nor is one still moving
  // to the routes of a failed-over sync, until it declares them (its lag counts from
  // then). 0: off (join_window too; only stall_timeout applies).
  std::chrono::milliseconds straggler_floor{2000};
  double straggler_factor = 8;
  // Producer: how long a consumer that has not entered the sync yet (inference ranks
  // enter seconds apart after their rollouts) may lag the others before it is dropped
  // from this sync as absent; it catches up at the next one. Never shorter than the
  // straggler bound; stall_timeout (from each group's announcement) still applies.
  std::chrono::milliseconds join_window{20000};
  std::chrono::milliseconds lease_ttl{3000};
  bool checksums = false;
  // Producer failover: when a producer dies mid-sync, consumers mark it in
  // {job}/dead/{p}, every participant rebuilds routes without it (the same routes:
  // build_routes over the remaining holdings) and the sync restarts; only when no other
  // producer holds what it held does the sync fail. Producers size staging slots for
  // the worst case when they share boxes with a replica (within staging_budget, if given).
  bool failover = true;
  // The order layer groups move in (GroupOrderKind): rotated by default, so every
  // pipeline stage's trainer NICs send for the whole sync (without PP it is the layer
  // order); kLayer stays an option. Every rank of a job must run the same (checked at
  // rendezvous, with convert_on: a rank with another order fails at once, naming it).
  GroupOrderKind group_order = GroupOrderKind::kRotated;
  // Where a float conversion that shrinks the bytes runs (fp32 masters into bf16 params:
  // ConvertOn in ferry/route.h): on the producer as it packs (the wire carries what the
  // consumer keeps), or on the consumer as it unpacks. Every rank of a job must run the
  // same; this and group_order are checked at rendezvous (a rank that differs fails at
  // once, naming the other).
  ConvertOn convert_on = ConvertOn::kProducer;
  // Where the FP8 block quantisation a consumer's plan asks for runs (QuantizeOn in
  // ferry/route.h; LoaderOptions::quantize): on a producer wherever one holds every
  // element of each of a param's tiles, so the wire carries e4m3 values and scales and
  // they land in the params as they are (the default), else on the consumer after the
  // dense values land. The params' bits are the same either way. A producer-quantised
  // param is e4m3 in ferry's buffers from the start: a caller's buffer of the loaded
  // dtype for it is not used (params() names ferry's, as after post-processing). Every
  // rank of a job must run the same (checked at rendezvous).
  QuantizeOn quantize_on = QuantizeOn::kProducer;
  // Delta syncs (docs/delta.md). Producer: keeps a copy of every group as it packed it
  // last (host memory after its staging ring, MemoryUse::kept_copy: the bytes it stages
  // in one sync) and, per plan class, puts in the slot a patch of the elements that
  // changed since that version (src/delta/patch.h) when it is smaller than the dense
  // bytes; it serves nothing in place (source_regions are not used). Consumer: where its
  // live params hold the patch's base version intact it reads the patch and applies it
  // (gathering the base from its params; the result checked against the new content's
  // hash, and on a mismatch repaired by reading the dense bytes: SyncReport::
  // patches_repaired), else it reads the dense bytes from the producer's kept copy; it
  // reads nothing straight into params. Host params only take patches (GPU params and
  // the CUDA IPC lane read dense). Every rank of a job must run the same (checked at
  // rendezvous).
  // Over shared memory the bytes move faster than they are encoded and applied (measured,
  // docs/RESULTS.md: 0.14 s against 0.04 s for the bench's 314 MB at 1% changed), so
  // unless delta_same_host: a job whose every rank met on one host (the hosts they
  // published at rendezvous) runs without delta, keeping both zero-copy paths; and in a
  // job over several hosts a producer sends dense bytes to the plan classes whose every
  // consumer in the sync is on its own host (their leases name it), encodes nothing for
  // them, and where no class of a group is patched does not write its kept copy either
  // (its next patch waits for a sync that wrote it).
  bool delta = false;
  // Delta: patches over shared memory too (the tests, which run every rank on one host;
  // hosts whose shared memory is slower than their encoder). The same on every rank.
  bool delta_same_host = false;
  // Delta, producer: every Nth of its syncs sends dense bytes only (0: never).
  uint32_t delta_full_every = 0;
  // Delta, producer: 0 (the default) keeps a copy of what it packed last (patches of the
  // elements that changed). > 0 keeps no copy: only an XXH3-64 per block of this many
  // bytes of every segment it packed last, and a patch carries the blocks whose hash
  // changed, whole (delta::encode_changed_blocks); it costs a patch area as large as the
  // staging ring instead of a copy of every byte staged, and wins where whole tensors or
  // experts did not change. The dense bytes stay in the slot (consumers that lack the
  // base read them there); push consumers get the dense bytes in this mode. At least
  // kMinDeltaBlockBytes: a hash (8 bytes) per smaller block costs more memory than the
  // copy it replaces saves (MemoryUse::kept_copy counts the hashes).
  uint64_t delta_block_bytes = 0;
  // The weight checker (docs/engine.md, "Checking the weights"). Producer: an XXH3-64 of
  // every box it materialises (host memory), published after each sync ({job}/digest/{p}),
  // so that boxes several trainer replicas hold can be compared. Consumer: an XXH3-64 of
  // every host param as each version goes live; Consumer::check_weights compares the live
  // params with them and the replicas' boxes with each other. Costs a hash pass (~10 GB/s
  // a core) over what each side holds, per sync.
  bool weight_digests = false;
  // Fault injection for ferry's own tests (src/engine/testing.h); null in production.
  std::shared_ptr<const engine::TestHooks> test_hooks;
  // Told of every control decision and report of this rank's syncs (SyncSink); none when
  // null. Shared: one sink may serve every rank of a process.
  std::shared_ptr<SyncSink> sink;
};

struct ProducerOptions : EngineOptions {
  // Zero-copy serving: regions of this producer's Transport (allocate_memory or
  // register_memory) that hold the source's weights *in place*: every box
  // materialize() returns inside one of them is at the same address every sync and
  // unchanged from the start of sync() until it returns (the trainer's own parameter
  // storage, updated only between syncs). Consumers read (pull), or this producer writes
  // (push), the pieces of such boxes that are contiguous runs of at least
  // direct_min_bytes straight from there; they are neither packed nor staged. create() materialises every group once to learn where
  // each box lies; a sync fails (naming the tensor) if a box has moved. Empty (the
  // default): every byte is packed into staging. Over UCX 1.13 shared memory, peers read
  // allocate_memory regions by plain copy, memory registered in place only by message
  // over tcp (docs/transport.md). Host memory only: GPU boxes are packed on the GPU.
  std::vector<MemoryRegion> source_regions;
  uint64_t direct_min_bytes = 64 * 1024;
  // Bytes of registered staging memory; 0: two slots of the largest group (with failover
  // and boxes shared with another producer: of the largest a failover may need). A budget
  // smaller than the largest group under the routes now is refused (kInvalidArgument
  // naming the bytes needed); one smaller than the failover worst case gets slots as
  // large as two fit in it, and a failover needing more fails that sync naming the bytes.
  uint64_t staging_budget = 0;
  // Staging in GPU memory (CUDA IPC between processes of one host): the producer packs
  // its boxes, all of which must then be in this device's memory, with a kernel into a
  // staging ring there, exported with CUDA IPC in its lease. Consumers on this host
  // whose params are on a GPU copy from it device to device (ConsumerOptions::cuda_ipc);
  // for the others (another host, host params) each packed slot is also copied to the
  // host staging ring the transport serves. Host (the default): host staging only. A
  // device that cannot be used fails create() naming it.
  Device staging_device = Device::host();
};

// How a consumer's live params change version (ConsumerOptions::commit; docs/engine.md,
// "Atomic versions").
enum class CommitPolicy : uint8_t {
  // Every byte lands in the live params as it arrives: no memory beyond the params. While
  // a sync runs, a reader of the params sees a mix of versions, and a failed sync leaves
  // them torn (ConsumerState::torn) until a later sync completes.
  kInPlace = 0,
  // A sync lands in a shadow set of buffers beside the live params (its direct reads,
  // unpack and post-processing all work on the shadow); the live params stay exactly the
  // committed version until commit() makes the whole received version live in one step:
  // a flip of the two sets where the consumer owns both (no caller params: host memory,
  // pull or push), else a copy per param (memcpy; device to device for GPU params). A
  // failed, aborted or discarded sync leaves the live params bit for bit the committed
  // version (never torn). Costs one more copy of the params (MemoryUse::shadow).
  kShadow = 1,
  // A bounded shadow: a sync lands layer group by layer group in a shadow of a few
  // groups' params (each param from the first group that writes it until its layer
  // group, the unit of commit, is complete and post-processed: about the largest layer
  // group), and each layer group is made live as soon as it is complete, received,
  // verified and post-processed: a copy of its params between before_commit and
  // after_commit (on the consumer's background thread). Guarantees: each layer group
  // changes version in one step (a reader under the hooks' lock sees every group whole,
  // never a param half written); groups change in the consumer's order; a failed sync
  // leaves a known set of groups at the new version, each whole, and the rest at the
  // committed one (ConsumerState::mixed, SyncReport::groups_live name them; never torn).
  // Not atomic across groups: during a sync, and after a failed one, a reader may see
  // layer 3 at the new version and layer 4 at the old. Nothing is read straight into
  // params (every byte goes through the receive ring). MemoryUse::shadow says how much.
  kGroups = 2,
};
const char* commit_policy_name(CommitPolicy p);
// "in_place", "shadow" or "groups"; kInvalidArgument naming the value otherwise.
Result<CommitPolicy> parse_commit_policy(std::string_view name);

struct ConsumerOptions : EngineOptions {
  // See CommitPolicy. Under kShadow, sync(v) commits at its end unless called with
  // commit = false; the commit runs between before_commit and after_commit.
  CommitPolicy commit = CommitPolicy::kInPlace;
  // Read by CUDA IPC, device to device, from producers that stage in GPU memory
  // (ProducerOptions::staging_device) into a receive ring on the params' device, with no
  // host hop. Taken per sync when every param is in GPU memory on one device, the mode
  // is pull, checksums are off, and every producer this consumer reads from is on this
  // host, stages on a GPU and serves it nothing in place; otherwise the transport path
  // (SyncReport::received_via_cuda_ipc says which bytes came which way, and a failure
  // to map a producer's staging is named in the report).
  bool cuda_ipc = true;
  // Zero copy: a piece of at least this many bytes that unpacks as a plain byte copy into
  // a contiguous run of a param is read (pull) or written by its producer (push)
  // straight into the param (registered with the transport at create) instead of through
  // the receive ring. 0: every such piece; UINT64_MAX: none (everything through the ring).
  uint64_t direct_min_bytes = 64 * 1024;
  // Params the consumer allocates itself (none passed to create): true, the transport's
  // memory (allocate_memory, as in push), which replicas joining on this host read at
  // memory speed (Consumer::catch_up; UCX reads memory registered in place on one host
  // only by message, about 3x slower, docs/elastic.md); they live as long as the
  // consumer. false: heap memory, registered in place, whose views may outlive the
  // consumer (the Python binding's choice: its views stay valid after close()). A
  // transport that cannot allocate that much (a small /dev/shm) leaves them to the heap.
  bool own_params_in_transport_memory = true;
  // Relay within a host (docs/relay.md): consumers of one plan class (replicas of one
  // rank) on one host (same hostname) that read the layer groups in the same order form
  // a relay group. Its lowest live rank (the relay) reads each group across the network;
  // the others copy it from the relay's receive ring over shared memory, so each byte
  // crosses the host's link once, and tell the producers they read nothing from them.
  // A member whose relay fails, pauses past its lease, is cut off or cannot offer a
  // group reads that group (and, for a relay lost, the rest of the sync) from the
  // producers, which keep it staged until then. Only where the relay's ring is reached
  // natively (shared memory, not by messages); never over CUDA IPC. Under relay nothing
  // is read straight into params (direct_min_bytes is ignored): every byte passes the
  // receive ring, which is what a member copies. SyncReport::received_via_relay and
  // relayed_to_peers count it.
  bool relay = false;
  // With EngineOptions::weight_digests: every sync begins with the weight check of the
  // version held (Consumer::check_weights: its params against their digests, the trainer
  // replicas' boxes of it, every producer's digests of it published by then); each finding
  // is a ControlEvent of kind kWeights in that sync's report (and the sink's metrics). The
  // sync itself goes on (it rewrites what it moves).
  bool check_weights_each_sync = false;
  std::function<void(uint64_t version)> before_sync;             // e.g. pause generation
  std::function<void(uint64_t version, int group)> after_group;  // background thread
  std::function<void(uint64_t version)> after_sync;              // resume with version
  // kShadow: around every commit (the only moment the live params change): where a
  // serving engine takes and releases the lock its forward passes hold, so that no pass
  // reads a mix of versions. Sync thread (the caller of sync() or commit()). kGroups:
  // around each layer group's commit, on the consumer's background thread.
  std::function<void(uint64_t version)> before_commit, after_commit;
};

// What an inference rank syncs into when its plan comes from anywhere (the inference
// engine's own load_weights recorded on recording tensors, ferry.record_load, a plan
// written by hand) rather than from a built-in ModelLoader.
struct ConsumerModel {
  // The rank's plan. Its sources must match the trainer's metadata (name, dtype, shape;
  // kInvalidArgument naming the tensor otherwise), but for f32/bf16/f16, which convert (a
  // trainer's fp32 masters of a bf16 checkpoint: Plan::set_source_dtype, the copies
  // convert as the built-in loaders' plans do). Ranks with equal plans (Plan::hash)
  // are replicas: the router sends them the same pieces from the same producers. Params
  // the plan keeps block-quantised (mark_quantized) end as e4m3 with their scales, in
  // buffers ferry makes (Consumer::params names them), whichever side quantised them.
  Plan plan;
  // Real, contiguous buffers for the plan's params (the engine's own parameters),
  // written in place by every sync; the caller keeps them alive and at the same address
  // for the Consumer's lifetime. A param not given is allocated by the engine (zeroed).
  TensorMap params;
  // Post-processing groups are the layer groups of the param names (group_of: "pre",
  // "layer N", "post"). Optional; runs on the consumer's background thread once every
  // param of `group` landed in a sync, and may rewrite those params in place. An error
  // fails the sync (the rank is then torn).
  struct PostGroup {
    int id = 0;
    std::string name;                 // "pre", "layer 3", "post"
    std::vector<std::string> params;  // the plan params it covers
  };
  std::function<Status(const PostGroup& group, TensorMap& params)> post_process;
};

// The memory one rank holds for the engine beyond what it was handed (the weights a
// producer's source holds, the params a consumer syncs into), by kind. Every figure is
// what the engine allocated or built, not a guess from the process (docs/engine.md,
// "Memory": what each kind costs, with the formula). Bounds, whatever the model size:
//   producer: extra() <= staging ring (<= max(staging_budget, one slot); default two
//             slots of its largest group) + metadata + kFixedAllowance
//   consumer: extra() <= receive ring (two slots of its largest group) + metadata +
//             kFixedAllowance
// where metadata grows linearly in tensors and copies (routes, plans, holdings).
struct MemoryUse {
  // The allowance for what the engine cannot count from inside: the transport's own
  // buffers (UCX endpoints, its shared-memory FIFOs and bounce buffers), the engine's
  // threads and message buffers. Checked against measured RSS by
  // tests/engine/memory_mp_test.cpp.
  static constexpr uint64_t kFixedAllowance = 64ull << 20;
  uint64_t staging_ring = 0;   // producer: registered staging slots (slots x slot bytes)
  uint64_t receive_ring = 0;   // consumer: registered receive slots (2 x slot bytes)
  // Memory of the caller's (or the rank's params) registered in place with the
  // transport: source regions, params read into directly. No copy: not extra.
  uint64_t registered_in_place = 0;
  // Consumer: params the engine allocated because the caller passed none (one arena).
  // They are the rank's params, not extra; reported so a caller can tell who owns them.
  uint64_t own_params = 0;
  // Consumer under CommitPolicy::kShadow: the shadow buffers a sync lands in (one more
  // copy of every param the sync writes); under kGroups the bounded shadow (the params
  // of the layer groups in flight at once: about the largest). Extra.
  uint64_t shadow = 0;
  // Producer under EngineOptions::delta: its kept copy of every group as packed last
  // (the bytes it stages in one sync, in the staging ring's registered region). Extra.
  uint64_t kept_copy = 0;
  // Routes, every rank's plan and holdings, the schedules and in-place tables: estimated
  // from their element counts (heap blocks included), linear in tensors and copies.
  uint64_t metadata = 0;
  uint64_t transport_allowance = kFixedAllowance;  // see kFixedAllowance
  uint64_t extra() const { return staging_ring + receive_ring + shadow + kept_copy + metadata + transport_allowance; }
  std::string to_string() const;
};

// What every rank will hold (MemoryUse), before any starts (`ferry plan`): from the
// routes, the inputs every rank keeps after rendezvous (metadata, every producer's
// holdings, every consumer's plan) and the producers' options (staging_budget,
// failover). A staging budget smaller than a producer's largest group is
// kInvalidArgument naming the producer and the bytes needed, as Producer::create says.
struct MemoryPrediction {
  std::vector<MemoryUse> producers;  // per trainer rank
  std::vector<MemoryUse> consumers;  // per inference rank
};
// `commit`: the consumers' ConsumerOptions::commit (kShadow: MemoryUse::shadow, one more
// copy of each consumer's params, host memory as ParamSet lays it out; kGroups: the
// bounded shadow, about the largest layer group's params).
Result<MemoryPrediction> predict_memory(const Routes& routes, const std::vector<TensorDecl>& metadata,
                                        const std::vector<Holdings>& holdings, const std::vector<const Plan*>& plans,
                                        const ProducerOptions& options,
                                        CommitPolicy commit = CommitPolicy::kInPlace);

// Where a sync's wall time went, stage by stage (ferry/trace.h SyncStage): seconds the
// sync thread spent in each, never overlapping, and `unattributed`, the time no stage
// claimed (before the first, and any gap): together they sum to SyncReport::seconds.
struct SyncStages {
  double seconds[kSyncStageCount] = {};
  double unattributed = 0;
  double of(SyncStage s) const { return seconds[static_cast<int>(s)]; }
  double sum() const;  // every stage and unattributed
  // (name, seconds) of every stage in the order a sync passes them, then "unattributed":
  // how reports, metrics and `ferry demo` name them.
  std::vector<std::pair<std::string_view, double>> named() const;
};

// Why a sync failed, as a value (SyncReport::failure): the peer whose failure ended it
// (a producer for a consumer; -1: none, this rank's own failure or a wait that ran
// out), the layer group it was at (-1: outside the groups: rendezvous, routing, the
// commit), the reason (the status code) and the status message, which names this rank.
struct SyncFailure {
  int32_t peer = -1;
  int32_t group = -1;
  StatusCode reason = StatusCode::kOk;
  std::string message;
};

struct SyncReport {
  uint64_t version = 0;
  // This rank's extra memory during the sync (the same every sync unless routes change).
  MemoryUse memory;
  Status status;                // OK when this side finished the sync
  std::optional<SyncFailure> failure;  // set exactly when status is not OK
  // Producer: bytes sent (each consumer's share counted), and of those served in place
  // (read straight from the source's own memory, no staging copy). Zero on a consumer.
  uint64_t bytes_sent = 0, sent_in_place = 0;
  // Producer: the FP8 values and scales it quantised and staged (EngineOptions::
  // quantize_on; each region each time it staged it, whoever reads it). Those are packed,
  // never served in place. Zero on a consumer.
  uint64_t quantized_bytes = 0;
  // Consumer: bytes received, of those read straight into params, and of those copied
  // device to device from producers' GPU staging (ConsumerOptions::cuda_ipc). Zero on a
  // producer.
  uint64_t bytes_received = 0, received_into_params = 0, received_via_cuda_ipc = 0;
  // Consumer under ConsumerOptions::relay: of bytes_received, those copied from the relay
  // of its host (not across the network); as the relay, the bytes its peers copied from
  // its receive ring and confirmed. Zero on a producer.
  uint64_t received_via_relay = 0, relayed_to_peers = 0;
  // Consumer::catch_up: of bytes_received, those read from the live params of replicas of
  // its plan class (not from any producer: bytes_per_peer has none of them).
  uint64_t received_from_replicas = 0;
  int catch_up_source = -1;  // Consumer::catch_up: the replica (consumer rank) that served it; -1 otherwise
  // Delta syncs (EngineOptions::delta), from the trace: of bytes_sent / bytes_received,
  // those that moved as patches. Producer: the dense bytes its patches stood for (each
  // consumer's share counted, as bytes_sent), and over what it packed this sync the
  // elements it compared with its kept copy and of those the elements that changed.
  // Consumer: patches whose end-to-end check failed and that it repaired by reading the
  // dense bytes (each also in `failures`).
  uint64_t patch_bytes = 0, patched_dense_bytes = 0;
  uint64_t delta_elements = 0, delta_changed = 0;
  uint64_t patches_repaired = 0;
  // Whether the weights this rank moved equal those of its previous successful sync (the
  // same bytes under a new version number: an adapter the trainer never updated, a frozen
  // draft), from the producers' checksums (EngineOptions::checksums), compared layer
  // group by layer group over the same routes. nullopt when it cannot tell: checksums
  // off, the first sync, routes changed (failover, a new member), bytes that came without
  // checksums (relay, catch-up), or a failed sync. A version reported unchanged was still
  // synced and committed.
  std::optional<bool> unchanged;
  double seconds = 0;           // wall time of sync()
  SyncStages stages;            // where `seconds` went, stage by stage (summing to it)
  // Phases (seconds, summed over groups and attempts). Producer: materialize, pack, wait
  // (slots). Consumer: wait (announces), read, unpack, post (process_weights_after_loading).
  double materialize_seconds = 0, pack_seconds = 0, wait_seconds = 0, read_seconds = 0, unpack_seconds = 0,
         post_seconds = 0;
  std::map<int, uint64_t> bytes_per_peer;  // peer rank -> bytes
  // Every phase and transfer of the sync (ferry/trace.h), in the order recorded. The byte
  // counts and phase seconds above are sums over it (the transfers counted, the phases'
  // durations), also for a failed sync (Producer/Consumer::last_report).
  std::vector<TraceEvent> trace;
  int64_t start_unix_ns = 0;  // when sync() began (system clock): the trace's time origin
  std::vector<int> dropped;                // producer: consumers dropped this sync
  // Producer: the consumers it serves (that read anything from it) that did not commit
  // this version: dropped, failed, absent (no live lease: not a member of this sync) or
  // silent (no DONE within stall_timeout). Each has a line in `failures` saying why.
  std::vector<int> missed;
  // Producer: the consumers it serves that left the job on purpose (Consumer::leave)
  // instead of committing this version (not missed); the consumers whose instance joined
  // (a new or restarted one registered) since its previous sync; and the epoch of its
  // consumers' membership, which moves whenever who is live changes.
  std::vector<int> left;
  std::vector<int> joined;
  uint64_t epoch = 0;
  std::vector<std::string> failures;       // one line per failure: each event's message
  // The control decisions of this sync (ferry/trace.h), in the order made; `failures`
  // holds their messages.
  std::vector<ControlEvent> events;
  // Consumer: the version its live params hold when sync() returned (the committed one;
  // unchanged by a failed sync under CommitPolicy::kShadow), absent when none; whether
  // this sync's version was committed (false: received and waiting for commit(), or
  // failed); and how long the commit took (the pause a serving engine sees).
  std::optional<uint64_t> live_version;
  bool committed = false;
  double commit_seconds = 0;  // kGroups: summed over the layer groups' commits
  // Consumer under CommitPolicy::kGroups: the layer groups (post-processing groups:
  // "pre", "layer 3", "post") this sync made live at its version, in the order they were
  // (every group after a successful sync; after a failed one, those whose params now hold
  // the new version, each whole, while the others hold live_version).
  std::vector<std::string> groups_live;
  // Producer: the version each consumer of the job held live (committed) as this sync
  // began, as its lease says (the consumer keeps it current: ConsumerState::version);
  // a consumer that has committed none, or has no live lease, is absent.
  std::map<int, uint64_t> consumers_live;
  // True only if this side finished and (producer) every consumer it serves committed
  // the version: a report never says ok while a member missed it.
  bool ok() const { return status.ok() && missed.empty(); }
  std::string to_string() const;
  // The report as one JSON object (every CLI output and the Python report dicts use the
  // same keys, docs/trace.md "Reports"): the fields above by their names, "ok", "bytes"
  // (this side's: sent or received), "error"/"code" when status is not OK. Without the trace.
  std::string to_json() const;
};

// What a consumer holds after its syncs.
struct ConsumerState {
  uint64_t version = 0;   // last committed version: what the live params hold (valid if `has_version`)
  bool has_version = false;
  bool torn = false;      // a failed sync left some groups newer than `version` (kInPlace only)
  // kGroups: a failed sync made some layer groups live at a newer version than
  // `version`, each group whole (that sync's SyncReport::groups_live names them); the
  // rest hold `version`. Until a later sync completes.
  bool mixed = false;
  // kShadow: a version fully received, verified and post-processed into the shadow,
  // waiting for commit() or discard().
  std::optional<uint64_t> received;
};

// What a consumer's live params hold, as it recorded in the store ({job}/committed/{c}:
// after every successful sync, and after a failed one that left them not whole).
struct CommittedState {
  std::optional<uint64_t> version;  // committed last; nullopt: none
  // A failed sync of `newer` left the params not one version until a later sync completes:
  // `mixed` (CommitPolicy::kGroups: some layer groups live at `newer`, each whole, the
  // rest at `version`) or `torn` (kInPlace: some groups partly new).
  bool mixed = false, torn = false;
  std::optional<uint64_t> newer;
  bool whole() const { return !mixed && !torn; }
  std::string to_string() const;  // "3", "3 (mixed with 4)", "none (torn by 1)"
};
Result<std::vector<CommittedState>> committed_states(Store& store, std::string_view job, int num_consumers);

// The version each consumer 0..num_consumers-1 of job `job` committed last (committed_states'
// versions), nullopt for one that has committed none. What a framework asks before it
// serves with new weights; the job-wide version is the minimum. A consumer whose params a
// failed sync left mixed or torn still says the version it committed: committed_states
// says which are not whole. Errors are the store's.
Result<std::vector<std::optional<uint64_t>>> committed_versions(Store& store, std::string_view job,
                                                                int num_consumers);

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
  // The report of the last sync(), whether it succeeded or not (status says why; the
  // seconds, bytes and trace are those of the attempt as far as it went). Between syncs.
  const SyncReport& last_report() const;

  const Routes& routes() const;
  int rank() const;
  struct Impl;

 private:
  explicit Producer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What Consumer::check_weights found.
struct WeightCheck {
  std::optional<uint64_t> version;  // the live version checked (none: nothing committed yet)
  // Params whose live bytes differ from their digest as the version went live.
  std::vector<std::string> changed;
  // Boxes two producers hold for `version` whose digests differ: "producers 0 and 2
  // disagree on 'NAME' [0:4, 0:8]" (one line per box and pair).
  std::vector<std::string> drifted;
  // Of the params' bytes, those compared (host params; a param in GPU memory is not).
  uint64_t bytes_checked = 0, bytes = 0;
  // Boxes held by several producers, and of those compared (both digests of `version`).
  uint64_t replicated_boxes = 0, replicated_checked = 0;
  bool ok() const { return changed.empty() && drifted.empty(); }
  double coverage() const { return bytes ? static_cast<double>(bytes_checked) / static_cast<double>(bytes) : 0.0; }
  std::string to_string() const;
};

class Consumer {
 public:
  // Records the plan of inference rank `rank` over the trainer metadata, publishes it,
  // builds routes, allocates the receive ring. `params`: the rank's param buffers as
  // loaded (RankLoader::params(), real, contiguous); empty: allocated here (zeroed).
  static Result<std::unique_ptr<Consumer>> create(const ModelLoader& loader, int rank, Transport& transport,
                                                  Store& store, const ConsumerOptions& options,
                                                  TensorMap params = {});
  // The same from any recorded plan (ConsumerModel): publishes model.plan, syncs into
  // model.params.
  static Result<std::unique_ptr<Consumer>> create(ConsumerModel model, int rank, Transport& transport, Store& store,
                                                  const ConsumerOptions& options);
  ~Consumer();
  Consumer(const Consumer&) = delete;
  Consumer& operator=(const Consumer&) = delete;

  // Receives version `version`. On error the report (in the Status message) names the
  // failing producer or group, and state().torn tells whether params changed (never under
  // CommitPolicy::kShadow: the live params are then the committed version, bit for bit).
  // Under kShadow with `commit` false it returns once the version is received, verified
  // and post-processed in the shadow; commit() or discard() then decides (a later sync
  // discards it). With kInPlace `commit` must be true (kInvalidArgument).
  Result<SyncReport> sync(uint64_t version);
  Result<SyncReport> sync(uint64_t version, bool commit);
  // kShadow: makes the received version live in one step (a flip or a copy per param,
  // between before_commit and after_commit; never half way) and records it as committed;
  // the commit's seconds. kFailedPrecondition when no version is received (or kInPlace).
  Result<double> commit();
  // kShadow: drops the received version; the live params stay as they are.
  // kFailedPrecondition when none is received.
  Status discard();
  // Leaves the job on purpose, between syncs (not while sync() runs): marks this rank as
  // left by this instance ({job}/left/consumer/{rank}), then gives up its lease and its
  // claim on the rank. Producers
  // then neither wait for it nor report it missed (SyncReport::left says it left); its
  // params stay as they are. It can sync no more (kFailedPrecondition): destroy it. A new
  // instance started in this rank joins the job again (it clears the mark as it
  // registers). The store's error when the mark cannot be written (nothing given up).
  Status leave();
  // Joins the live version at once, between syncs, from the replicas that hold it rather
  // than at the next sync from the trainer (docs/elastic.md): the newest version any
  // inference rank committed is read straight from the live params of a replica of this
  // rank's plan class (the same layout), post-processed here as a sync would, and made
  // live (committed, recorded, in the lease). Several joiners fan out as a tree: a joiner
  // that holds the version serves the next ones. The replica read from keeps its live
  // params unchanged until the reads end (its own next sync or commit waits for that
  // up to the straggler floor, then gives the hold up and this joiner reads elsewhere);
  // its readers see one version throughout. A replica that refuses, fails or gives the
  // hold up is a kCatchUp event, and the next one is tried. The report: the version, the
  // bytes (SyncReport::received_from_replicas; none from producers), the replica that
  // served it (catch_up_source), its stages. Errors: kNotFound when no replica of this
  // plan class holds the live version (nothing changed: the producers serve it at the
  // next sync); kUnimplemented for params on a GPU; the last replica's error when none
  // could serve it (the params are then torn if reads had begun: state().torn).
  // kFailedPrecondition during a sync or after leave(). The caller's thread, between syncs.
  Result<SyncReport> catch_up();
  // The weight checker (EngineOptions::weight_digests on every rank; else
  // kFailedPrecondition): compares each live host param with its digest taken as its
  // version went live (a param changed since is named), and the digests of the boxes
  // several producers hold for that version with each other (a drifted trainer replica is
  // named with the box). Not during a sync (the caller's thread, between syncs).
  Result<WeightCheck> check_weights();
  // The report of the last sync(), whether it succeeded or not (as Producer::last_report).
  const SyncReport& last_report() const;

  ConsumerState state() const;
  // Whether the caller still holds the params it passed to create where this consumer
  // writes them. `current`: the caller's params now (e.g. its framework's parameters,
  // re-read); every param passed to create that the plan writes must be in it, on the
  // same device at the same address, or kFailedPrecondition naming the first that is
  // missing or has moved (re-allocated, re-bound: the consumer would go on writing the
  // old memory, which nobody reads). Names beyond those are not checked. Call it before
  // sync when the caller's params can move (ferry.Consumer.sync does); thread-safe.
  Status check_params(const TensorMap& current) const;
  // Final params (after post-processing) of the last sync; valid between syncs. Params
  // the consumer allocated (none passed to create) live as long as it: in push they are
  // its transport's memory (allocate_memory, so that producers on the host write them by
  // plain copy), freed with the consumer; copy them to keep them beyond it.
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
