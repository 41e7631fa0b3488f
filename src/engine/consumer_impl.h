// engine/consumer_impl.h — Consumer::Impl, the consumer's control plane (internal; only
// the consumer's files include it). consumer.cpp: the sync loop (a sync's attempts, each
// group received and verified, failover, commit); consumer_receive.cpp: one group from
// the producers, pulled or pushed, and delta's patches applied or repaired;
// consumer_waits.cpp: the waits for producers and what ends them; consumer_relay.cpp:
// relay within a host; consumer_peers.cpp: joining the job and keeping track of the
// producers (create/start, their leases and connections, messages and failures, routes
// and schedule). Bytes move by the data plane: the attempt's plan (sync_plan.h), its
// reads through the lanes (attempt_reads.h, lane.h, cuda_ipc.h) into the receive ring
// (receive_ring.h), param_set.h and the unpack worker; the commit policy, delta and
// membership are parts (commit_rule.h, delta_applier.h, membership.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include <unistd.h>

#include "engine/attempt_reads.h"
#include "engine/clock.h"
#include "engine/sync_trace.h"
#include "engine/weight_digests.h"
#include "engine/cuda_ipc.h"
#include "engine/delta_applier.h"
#include "engine/group_order.h"
#include "ferry/device.h"
#include "engine/in_place.h"
#include "engine/protocol.h"
#include "engine/rank_model.h"
#include "engine/receive_ring.h"
#include "engine/replica_server.h"
#include "engine/registered_buffer.h"
#include "engine/rendezvous.h"
#include "engine/schedule.h"
#include "engine/sync_plan.h"
#include "engine/testing.h"
#include "engine/memory.h"
#include "engine/membership.h"
#include "engine/param_set.h"
#include "engine/peer_table.h"
#include "engine/unpack_worker.h"
#include "engine/wait_loop.h"

#include "ferry/engine.h"

namespace ferry {

using namespace engine;  // (internal header: the consumer's two files only)

struct Consumer::Impl {
  int rank = 0;
  Transport& transport;
  Store& store;
  ConsumerOptions opts;
  JobKeys keys;
  // What this rank loads into and how it post-processes (engine/rank_model.h; set by the
  // two create()s, then fixed; RankModel::routed_params at the first routes).
  RankModel model;
  RouteState route_state;  // rendezvous inputs; producers excluded from `routes`
  Routes routes;
  uint64_t routes_hash = 0;
  // Where bytes land (engine/param_set.h): the param buffers, their registrations and
  // placements, the committed view and what the params hold. Set by start().
  std::unique_ptr<ParamSet> param_set;
  static constexpr int kSlots = ReceiveRing::kSlots;
  ReceiveRing recv;  // (engine/receive_ring.h) where each group's bytes land, host or GPU
  // The lanes (engine/lane.h): the transport's (reads into the receive ring and params),
  // and CUDA IPC (ConsumerOptions::cuda_ipc) to producers' GPU staging on this host
  // (engine/cuda_ipc.h; null: params not all on one GPU, push, or checksums). Each
  // attempt's plan (engine/sync_plan.h) says which one moves each transfer, and so which
  // ring the attempt lands in (plan_attempt).
  struct Lanes {
    std::unique_ptr<TransportLane> transport;
    std::unique_ptr<CudaIpcLane> cuda_ipc;
    std::unique_ptr<RelayLane> relay;  // relay on: connected to this attempt's relay (refresh_relay)
    ConsumerAttemptPlan plan;  // this attempt's
  } lanes;
  // The attempt's plan from the schedule (rebuilt if stale), the ring it lands in, and
  // what the parts that depend on it are told. Sync thread, between attempts.
  void plan_attempt();
  // Per layer group of `routes`: what to read from whom into where (the slot, or a
  // param directly: zero copy, engine/schedule.h), what to unpack, which
  // post-processing groups complete, and the order it reads them in (engine/
  // group_order.h, EngineOptions::group_order: layer order, or its order in the rotated
  // one, set with the routes). Rebuilt when routes change or a producer's in-place table
  // does (Peer::in_schedule).
  ConsumerSchedule schedule;
  // Its claim, lease and what it published (its plan) in the store.
  Registration reg;
  // Puts the versions the params hold (ParamSet::state) into the lease if they changed
  // (ConsumerLease::committed/received). The store's error, if any.
  Status publish_versions();

  // A producer as its lease describes it (its staging and source regions are imported
  // into `lane`, its GPU staging into `ipc_lane`).
  struct Peer : PeerLink {  // (engine/peer_table.h)
    // Set when the producer was found gone as an attempt began (no lease, or its lease's
    // address refused us): the lease it had ("" for none). A restarted instance registers
    // another (await_restart).
    std::optional<std::string> gone;
    InPlaceTable in_place;     // boxes it serves from the trainer's memory
    size_t regions = 0;        // of its source regions (in_place.keys), how many are imported
    std::optional<Status> failure;  // why its connection failed (cleared when connected again)
    bool in_schedule = false;       // the schedule was built with its current in-place table
  };

  std::mutex mu;
  std::condition_variable cv;
  PeerTable<Peer> peers;
  // The producers as their leases say (engine/membership.h; sync thread).
  Membership roll;
  // An Announce (pull), Pushed (push) or RoutesNotice (group -1) as the sync loop takes it.
  struct Arrival {
    PeerId from = 0;          // sender instance
    uint64_t routes = 0;      // the routes the sender runs (laid the bytes out by)
    uint64_t slot_offset = 0; // Announce: the group's offset in the producer's staging ring
    std::optional<uint64_t> checksum;
    // Delta syncs: our segment is a patch of patch_bytes against version patch_base
    // (Announce: in the slot, the dense bytes at dense_offset; Pushed: written into our
    // receive slot).
    std::optional<uint64_t> patch_base;
    uint64_t patch_bytes = 0, dense_offset = 0, patch_offset = 0;
  };
  // (version, group, producer) -> arrival. Kept even from instances not connected yet (a
  // restarted producer may announce before we re-read its lease); checked against the
  // connected instance when taken.
  std::map<std::tuple<uint64_t, int, int>, Arrival> inbox;
  // The current sync's attempts: what ended the last one and which routes it leaves.
  struct Attempts {
    int failed_p = -1;              // the producer whose failure ended the last attempt
    int group = -1;                 // the layer group the attempt is at (-1: none)
    std::set<uint64_t> old_hashes;  // routes abandoned during the current sync
    bool switch_routes = false;     // a producer announced other routes for this sync (mu)
    bool declare = false;           // tell producers our routes once connected (sync began on failed-over routes)
  } attempts;
  // What this instance knows of the syncs it ran and runs, against which producers'
  // messages are judged (late, stale, behind, a mismatch). mu.
  struct Syncs {
    std::optional<uint64_t> syncing;  // the version of the sync in progress
    bool left = false;                // leave() was called: no more syncs
    std::set<uint64_t> attempted;     // versions this instance began syncs of (the last 64)
    std::set<uint64_t> mismatched;    // versions producers served when ours differed (the last 64)
    // Producers that announced, during this sync, an older version this instance never
    // synced (so not a late message): producer -> that version.
    std::map<int, uint64_t> behind;
    // (version, producer) -> why that producer dropped us from that sync. A drop counts
    // only while its producer is in our routes: one failed over (by us or by the others,
    // whose routes we followed) may still drop us from the attempt it was left out of.
    std::map<std::pair<uint64_t, int>, std::string> dropped;
  } syncs;
  // Push: producers sent READY this sync (they may have writes into our receive ring in
  // flight), and the FLUSHED answers to our FAILOVERs: producer -> (version, routes), mu;
  // per producer, READYs of this sync not answered by PUSHED yet: its writes of those
  // groups may be in flight (sync thread only).
  struct PushBook {
    std::set<int> readied;
    std::map<int, std::pair<uint64_t, uint64_t>> flushed_from;
    std::map<int, int> unanswered;
  } push;
  std::atomic<bool> crashed{false};  // simulate_crash (test hook)
  ParamDigests weights;   // EngineOptions::weight_digests: the live params as they went live
  ContentWatch content;   // SyncReport::unchanged: this sync's checksums against the last one's
  SyncTrace trace;        // this sync's events (the unpack worker records too); rep's sums come from it
  SyncReport last;        // last_report(): the last sync's report, failed or not
  // The unpack + post-processing thread (unpack_worker.h). Last: destroyed first.
  std::unique_ptr<UnpackWorker> worker;

  // Relay within a host (ConsumerOptions::relay, docs/relay.md; consumer_relay.cpp): its
  // state in both roles, guarded by mu. With relay off it stays empty: nothing asks, no
  // link is found, and every relay_* step below answers for itself that it has nothing
  // to do, so the sync loop calls them whatever the options.
  struct RelayLink {  // as a member: the relay this attempt reads from (rank -1: none)
    int rank = -1;
    ConsumerLease lease;  // the relay's instance (its lease without versions) we connected and imported with
    PeerId id = 0;        // (its receive ring: Lanes::relay)
    bool lost = false;    // failed, gone or given up: the rest of this attempt reads from producers
    std::string why;      // ... and why, for the report
  };
  struct RelaySlot {  // as the relay: a receive slot's group, verified, and who reads it
    bool valid = false;
    uint64_t version = 0, routes = 0;
    int group = -1;
    std::map<int, PeerId> readers;  // member rank -> its instance
    std::set<int> released;         // members whose copy of it is done (kept)
  };
  struct RelayState {
    // As a member: this attempt's link (refresh_relay, sync thread between attempts;
    // `lost` also set by the handlers), and the relay's answers to our asks and
    // releases by (version, group): the latest.
    RelayLink link;
    std::map<std::pair<uint64_t, int>, Relay> inbox;
    // Every consumer's order (rotated order; empty: layer order, all alike): a relay and
    // its members must read in one order. Set with the routes.
    std::vector<std::vector<int>> orders;
    // As the relay (every consumer with relay on serves asks; only members on its host
    // ask): the members it expects to copy every group it lands this attempt (those of
    // its class on its host it reached: rank -> instance; one that leaves a slot unasked
    // past relay_hold() is expected no more this attempt); per receive slot the group it
    // holds; asks of groups not landed yet; groups whose slot was reused (asked again:
    // gone). A release from a member no longer among a slot's readers (cut by
    // relay_reuse) is answered cut.
    std::map<int, PeerId> members;
    RelaySlot slots[kReceiveSlots];
    std::map<std::tuple<uint64_t, int, uint64_t>, std::map<int, PeerId>> asks;
    std::set<std::tuple<uint64_t, int, uint64_t>> passed;
  } relay;
  // Finds this attempt's relay (or that this consumer reads for itself) from the leases
  // of its plan class on its host; a relay or member not reached is a relay-unreached
  // control event. Sync thread, between attempts.
  void refresh_relay();
  // refresh_relay's search: this attempt's relay (its import kept from `before` when the
  // same instance), or none; sets relay.members.
  RelayLink find_relay(const RelayLink& before);
  // A Relay message (either role). The transport's handler thread; takes mu.
  void on_relay(PeerId from, const Relay& m);
  // The relay: group g of sync v is verified in receive slot s (members may read it).
  // Nothing without relay, or over the CUDA IPC lane.
  void relay_landed(uint64_t v, int g, int s);
  // The relay: before slot s is written again, waits (bounded) for its readers, then
  // takes the slot back; readers still there are cut.
  void relay_reuse(int s);
  // The relay: an attempt at sync `version` ended; asks of that sync (and earlier) it did
  // not offer are answered gone.
  void relay_attempt_over(uint64_t version);
  // A member: copies group g of sync v into its receive slot at `base` from the relay's
  // ring. true: copied and kept intact; false: read it from the producers (`lost` set
  // when the relay is gone for this attempt). An error: a producer of `from` failed or
  // dropped us while we waited (as await_any).
  Result<bool> copy_from_relay(AttemptReads& reads, uint64_t v, int g, uint64_t base, const std::set<int>& from);
  // How long a relay waits for a member still reading a slot it needs again.
  Clock::duration relay_hold() const {
    return std::clamp<Clock::duration>(opts.straggler_floor / 2, std::chrono::milliseconds(50),
                                       std::chrono::milliseconds(5000));
  }

  // Catch-up (Consumer::catch_up; consumer_catch_up.cpp, docs/elastic.md): as a joiner,
  // the live version read from the live params of replicas of its plan class; as a
  // replica, its live params served to joiners (engine/replica_server.h: the asks, holds
  // and answers, both roles). Made by start().
  std::unique_ptr<ReplicaServer> replicas;
  struct CatchUpSources {
    uint64_t version = 0;       // the live version: the newest any other rank committed
    std::vector<int> holders;   // of this plan class, holding it
    std::vector<int> order;     // the holders in the order to try them
    std::optional<int> parent;  // a joiner of an earlier round of the tree, to read from first
  };
  // From the consumers' leases and the joiners' marks. kNotFound when no replica of this
  // plan class holds the live version (the producers serve it at the next sync).
  Result<CatchUpSources> catch_up_sources();
  // Reads every live param of version v from consumer c's live params into ours (asked,
  // offered, read, confirmed intact); recorded in the trace.
  Status read_replica(int c, uint64_t v, const ParamSet::ServingLayout& mine);
  Result<SyncReport> catch_up();
  // After a version went whole and live (a sync, commit(), a catch-up): serving table
  // published once, and open to joiners for that version. The store's error.
  Status serve_live();
  // Before the live params change (a sync, commit(), a catch-up; leave()): closed to
  // joiners, holds ended or, after catch_up_hold(), given up (a kCatchUp event each).
  void close_serving();
  // close_serving() for a step that changes the live params; the guard reopens them to
  // joiners as it goes, for whatever version is then live and whole (serve_live; a store
  // error is a kStore event).
  struct ServingPause {
    Impl* m;
    explicit ServingPause(Impl* impl) : m(impl) {}
    ServingPause(const ServingPause&) = delete;
    ServingPause& operator=(const ServingPause&) = delete;
    ~ServingPause();
  };
  [[nodiscard]] ServingPause pause_serving() {
    close_serving();
    return ServingPause{this};
  }
  Clock::duration catch_up_hold() const;

  // `opts` as given; start() turns direct_min_bytes off where a part needs every byte in
  // the receive ring (delta where it runs, the groups commit rule, relay) and the
  // DeltaApplier off where delta does not run (rendezvous.h, delta_runs).
  Impl(int r, Transport& t, Store& s, const ConsumerOptions& opt)
      : rank(r), transport(t), store(s), opts(opt), keys(opt.job),
        route_state(s, JobKeys(opt.job), opt.failover, consumer_router_options(opt, r)),
        roll(s, [k = JobKeys(opt.job)](int p) { return k.producer(p); }, [](std::string_view v) { return std::string(v); },
             opt.num_producers, opt.lease_ttl),
        commit_rule(CommitRule::make(opt.commit, r, {opt.before_commit, opt.after_commit})),
        delta(r, opt.delta) {}

  ~Impl() {
    worker.reset();  // stops after its current job
    transport.set_message_handler({});
    transport.set_peer_failure_handler({});
    replicas.reset();  // (its thread stops: nothing is answered from here on)
    if (reg.lease) reg.lease->release().ignore();
  }

  void point(int g, int phase) {
    if (opts.test_hooks && opts.test_hooks->consumer_point) opts.test_hooks->consumer_point(g, phase);
  }

  void on_message(PeerId from, std::span<const std::byte> payload);

  void on_peer_failure(PeerId peer, const Status& why);

  // The worker's job steps (on its thread); the commit rule's group_done follows them.
  Status unpack_job(const UnpackWorker::Job& job);
  Status post_job(const UnpackWorker::Job& job);
  // The commit policy (engine/commit_rule.h): what a sync's end, each layer group's
  // unpack and commit, and commit() do to the live params.
  std::unique_ptr<CommitRule> commit_rule;
  void wake() {
    std::lock_guard<std::mutex> lk(mu);
    cv.notify_all();
  }
  std::string who() const { return fmt::format("consumer {}", rank); }

  Status refresh_producers();

  // A producer we wait for serves another version than this sync's: the trainer and this
  // inference rank disagree (a caller bug or a rollback on one side only). Fails at once
  // rather than at the timeout. Older versions are those this instance never synced
  // (an announcement of a version it did sync may just be late). mu held.
  Status version_mismatch_locked(uint64_t v, const std::set<int>& from);
  // Not ok when a producer in `from` has moved on from v (it dropped this consumer from
  // v, or serves a later version): then nothing of v may be read from it or asked of it.
  // mu held.
  Status moved_on_locked(uint64_t v, const std::set<int>& from);
  // Not ok when a live producer dropped this consumer from v (DROPPED): that producer
  // counts it as missing v, so it must not commit v, however its groups came. mu held.
  Status dropped_locked(uint64_t v);

  // Sends m to producer p; the completion, when the send was posted (it completes once
  // the message has left: delivered to the peer, for inproc).
  std::optional<Completion> send_to(int p, const Message& m);
  uint32_t me() const { return static_cast<uint32_t>(rank); }

  // Waits for the message (v, g, p) from any producer p in `from`; fails when one of
  // them failed, when we were dropped, or after `timeout`.
  // `none` (polling): return at once with *none = true when nothing is there yet.
  Result<std::pair<int, Arrival>> await_any(uint64_t v, int g, const std::set<int>& from, const char* what,
                                            bool* none = nullptr);

  // A producer of `from` that went silent and lost its lease (its heartbeat renews it
  // every ttl/3) at two checks a lease_ttl apart — so not a lease that a store restart
  // dropped and that is healing — and whose boxes the others hold: cut off or paused,
  // it cannot be told from dead by the transport, and waiting for it would get this
  // consumer dropped as a stalled reader by every other producer. It is failed over
  // (it rejoins at the next sync: Producer::sync clears its mark once alive). -1: none.
  // A store that cannot be reached tells nothing: no lease is judged then.
  int lost_producer(const std::set<int>& from, LapseWatch& lapses);

  // wait_all for reads from producer p, bounded by timeout; kPeerFailed as soon as p is
  // lost (lost_producer): a host cut off mid-read stalls tcp, it does not fail it. JOINs
  // the other producers each keepalive_every meanwhile, as await_any does.
  Status wait_reads(std::span<const Completion> ops, int p, uint64_t v, int g);

  // The receive slot of the group at position `at` of this consumer's order.
  Result<int> acquire_slot(int at);

  // await_any for an announcement, working through the backlog while none is there.
  Result<std::pair<int, Arrival>> await_working(uint64_t v, int g, const std::set<int>& from, AttemptReads& reads);

  // A post's status; a failed one names its producer as the attempt's failure (failed_p).
  Status posted(const AttemptReads& reads, Status st);
  // Waits for producer p's reads; a failure is p's, in the consumer's words.
  Status waited(std::span<const Completion> ops, int p, uint64_t v, int g);

  Status sync_groups(uint64_t v, SyncReport& rep);

  // One layer group of an attempt as sync_groups receives it into receive slot `slot` (at
  // `base` in the ring) from the producers `from`: by this host's relay (relay_group,
  // consumer_relay.cpp), else from the producers (pull_group or push_group,
  // consumer_receive.cpp). What came: each producer's arrival, and under delta which
  // segments came as patches and which of those were repaired.
  struct GroupRx {
    uint64_t v = 0;
    int g = 0, slot = 0;
    uint64_t base = 0;
    std::set<int> from;
    std::map<int, Arrival> got;
    std::map<int, uint64_t> patched;   // delta: producers whose segment came as a patch, its bytes
    std::set<int> repaired;            // ... and of those, whose dense bytes were read after it
    std::map<int, Arrival> announced;  // pull: announcements taken while the relay was tried
  };
  // The group into its receive slot: copied from this host's relay where it has it
  // (relay_group), else from the producers (pull_group or push_group); its transfers
  // recorded in the trace.
  Status receive_group(GroupRx& rx, const ConsumerGroupSchedule& gs, AttemptReads& reads, SyncReport& rep);
  // A member copies the group from its relay's receive ring by the relay lane (true), or
  // finds no relay for it (false: read from the producers).
  Result<bool> relay_group(GroupRx& rx, AttemptReads& reads);
  // Pull: each producer's staged bytes (or its patch) read once it announced the group,
  // then released; in-place bytes (into the slot, and into params ahead) at the pace
  // `reads` keeps.
  Status pull_group(GroupRx& rx, AttemptReads& reads, SyncReport& rep);
  // Push: READY to each producer, then its PUSHED once its writes landed.
  Status push_group(GroupRx& rx, const ConsumerGroupSchedule& gs, AttemptReads& reads, SyncReport& rep);
  // Delta: producer p's patch failed its check (`why`): its dense bytes of the group read
  // from its kept copy instead (both modes: its staging ring is imported).
  Status repair_patch(GroupRx& rx, AttemptReads& reads, int p, const Status& why, SyncReport& rep);

  // Delta syncs (engine/delta_applier.h): which patches this consumer takes, and
  // applying one. Sync thread.
  DeltaApplier delta;
  // Applies the patch at the start of producer p's segment (`read`) of group g in the
  // receive slot at `base`; kCorrupt when it fails its check (the caller repairs).
  Status apply_patch(int g, int p, const Read& read, uint64_t patch_bytes, uint64_t base);

  // Installs routes (only between attempts: the background thread is idle).
  Status apply_routes(Routes r);

  // This consumer's extra memory (MemoryUse) for the routes and schedule now installed.
  // Caller thread, between attempts (mu taken for the schedule and the peers' tables).
  MemoryUse memory_use();

  // The schedule of the current routes with the producers' current in-place tables
  // (only those whose source regions are imported). mu held.
  void rebuild_schedule();

  Status refresh_routes();
  // This rank's plan class in `routes` (mu, or the sync thread).
  const PlanRoute* plan_route() const { return &routes.consumer(static_cast<size_t>(rank)); }

  // Waits for the background thread to go idle, then resets it for a new attempt; its
  // timeout (a job still running) when it did not: no new attempt then.
  Status reset_background();

  // After producer failed_p failed: mark it dead and rebuild routes without it, if the
  // remaining producers hold everything. Then ask live producers to restart.
  Status failover(uint64_t v, const Status& why);

  // Producer p, which no DP replica covers, was gone as this attempt began (Peer::gone),
  // so nothing of sync v was read yet: waits until a restarted instance of it registers
  // (a lease other than the one it was gone with), polling the store with backoff, until
  // `deadline`. Meanwhile JOINs to the other producers say this consumer is still in the
  // sync (they drop it neither as a straggler nor as stalled, Producer wait_slot).
  Status await_restart(uint64_t v, int p, Clock::time_point deadline);
  // Not ok, naming this consumer, once its own transport is dead (Transport::health):
  // a wait for producers asks every health_probe_every, as a dead transport delivers
  // nothing and, with nothing to send, no op fails.
  Status own_transport_health() const {
    Status h = transport.health();
    return h.ok() ? h : h.with_context(fmt::format("consumer {}: its transport failed", rank));
  }
  // How often a consumer held up by one producer JOINs the others (await_any,
  // wait_reads, await_restart): a quarter of the straggler floor, within [20 ms, 500 ms].
  Clock::duration keepalive_every() const {
    return std::clamp<Clock::duration>(opts.straggler_floor / 4, std::chrono::milliseconds(20),
                                       std::chrono::milliseconds(500));
  }

  // Tells every live producer which routes this consumer reads sync v with (FAILOVER): a
  // producer on other routes restarts the sync with these, and no producer keeps a slot
  // of routes this consumer does not read waiting for it. Needed also when this sync
  // began on failed-over routes (the dead set was already in the store): otherwise
  // producers still on the old routes wait for releases that never come while this
  // consumer waits for announcements of the new ones.
  void declare_routes(uint64_t v);

  // Push: waits until each producer of `from` answered with FLUSHED for (v, our routes)
  // (sent once none of its writes to us is in flight), has failed, or is dead; bounded
  // by `timeout`, after which `late(p)` says why. A crash (test hook) ends the wait:
  // with kCancelled when `cancel_on_crash`.
  template <typename Late>
  Status await_flushed(uint64_t v, const std::vector<int>& from, bool cancel_on_crash, Late late);

  // Push, after moving to new routes mid-sync: a producer that we asked to write (READY)
  // under the old routes may still have those writes in flight into our receive ring,
  // where they would land on top of the new attempt's groups. Waits until each of them
  // answered our FAILOVER with FLUSHED.
  Status wait_flushed(uint64_t v);

  // Push, after giving up sync v (ABORT sent): a producer whose READY we have not seen
  // answered may still be writing into our receive ring and params, which the caller
  // owns again once sync() returns. Waits until each such producer answered the ABORT
  // with FLUSHED. Returns why when one did not.
  Status wait_aborted_writes(uint64_t v);

  // Producers connected and not failed: those told of the end of a sync (ABORT, DONE).
  std::vector<int> reachable_producers();
  // JOIN (this consumer is in sync v and moving) to every reachable producer not in
  // `except`: on entering the sync, and each keepalive_every while a wait on the
  // producers in `except` (or on its own unpacking) holds it, so that no other producer
  // drops it as a straggler for what holds it up. Call without mu held.
  void join_producers(uint64_t v, const std::set<int>& except = {});

  // create()'s steps after the rank check and its claim (claim_rank), which join() runs
  // first; create()'s failure is published for the other ranks (publish_failure).
  Status join(const std::function<Status()>& steps);
  Result<std::vector<TensorDecl>> await_metadata();
  Status start(const std::vector<TensorDecl>& metadata, TensorMap params);

  // Consumer::commit(): the received version made live (CommitRule::commit), recorded
  // for committed_versions() and in the lease; the seconds it took.
  Result<double> commit();
  // Version v is live: recorded for committed_versions() (what a framework asks before it
  // serves with these weights).
  Status record_committed(uint64_t v);
  // After failed sync v: when it left the live params mixed or torn, the committed key says
  // so ("V mixed v", "V torn v"; committed_states) until a later sync records a version.
  Status record_not_whole(uint64_t v);
  Result<WeightCheck> check_weights();
  // ConsumerOptions::check_weights_each_sync: the check of the version held, each finding
  // a kWeights event of the sync beginning.
  void check_weights_held();

  Result<SyncReport> sync(uint64_t v, bool commit_it);
};

}  // namespace ferry
