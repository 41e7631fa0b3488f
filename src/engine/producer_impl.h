// engine/producer_impl.h — Producer::Impl, the producer's control plane (internal; only
// the producer's three files include it). producer.cpp: the sync loop (a sync's
// attempts: plan, pack, announce or push, wait, report); producer_peers.cpp: its
// consumers (leases and connections, messages and failures, drops, routes);
// producer_slots.cpp: the staging slots' readers (announcements, pushes, releases, the
// rotated order's turns) and the wait for a slot that drops stragglers. Bytes move by
// the data plane: the staging ring (staging_ring.h), the delta encoder (delta_encoder.h),
// the push writes (push_writes.h); the pace is the Pacer's (pacer.h).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "engine/clock.h"
#include "engine/delta_encoder.h"
#include "engine/pacer.h"
#include "engine/peer_table.h"
#include "engine/sync_trace.h"
#include "engine/weight_digests.h"
#include "engine/group_order.h"
#include "engine/in_place.h"
#include "engine/protocol.h"
#include "engine/push_writes.h"
#include "engine/sync_plan.h"
#include "engine/rendezvous.h"
#include "engine/memory.h"
#include "engine/membership.h"
#include "engine/schedule.h"
#include "engine/staging_ring.h"
#include "engine/straggler.h"
#include "engine/sync_members.h"
#include "engine/testing.h"
#include "ferry/engine.h"

namespace ferry {

using namespace engine;  // (internal header: the producer's files only)

struct Producer::Impl {
  WeightSource& source;
  Transport& transport;
  Store& store;
  ProducerOptions opts;
  JobKeys keys;
  int rank = 0;
  RouteState route_state;               // rendezvous inputs; producers excluded from `routes`
  Routes routes;
  uint64_t routes_hash = 0;
  ProducerSchedule schedule;            // per group of `routes`: what to pack, serve in place, checksum
  // Failover within a sync; mu.
  struct Restart {
    bool asked = false;  // a consumer asked to restart the sync (FAILOVER) ...
    uint64_t routes = 0;  // ... with these routes
    // Routes this producer left during the current sync (it failed over from them).
    // Dead sets only grow within a sync, so a consumer that declares one of these is
    // behind, not ahead: it will come to our routes (following, or finding the same loss
    // at its own pace) and read every group of them, so it stays a reader of our slots
    // and does not restart us.
    std::set<uint64_t> abandoned;
    // Whether a restart onto routes other than `current` was asked.
    bool to_other_than(uint64_t current) const { return asked && routes != current; }
  } restart;
  // Its consumers' progress within and across syncs (engine/sync_members.h); mu.
  SyncMembers members;
  // When this process last resumed from a stop (SIGSTOP, a stalled host): clocks on the
  // consumers count from then at the earliest (wait_slot).
  PauseWatch pause_watch{std::chrono::milliseconds(100), std::chrono::milliseconds(1000)};
  // Where groups are packed and read from: the host ring, the GPU ring, the in-place
  // table (engine/staging_ring.h); its memory registered with `transport`.
  TransportRingMemory ring_memory{transport};
  std::unique_ptr<StagingRing> staging;
  // Its claim, lease and what it published (metadata at rank 0, holdings) in the store.
  Registration reg;

  // A consumer (engine/peer_table.h) and what push imports from its lease.
  struct Peer : PeerLink {
    RemoteRegion recv;       // push: the consumer's receive ring
    uint64_t recv_slot_bytes = 0;
    // Push: where its registered params lie (its lease's ParamTable) and their imported
    // keys (this producer's writes to it are the attempt plan's); a consumer that commits
    // by a flip has a second set, laid out alike, and names per READY which one to write.
    ParamTable params;
    std::vector<RemoteRegion> param_regions, other_param_regions;
    std::optional<uint64_t> committed;  // the version it serves, as its lease said last (mu)
    std::string host;                   // its host, as its lease says (delta: same host, dense bytes; mu)
  };
  std::mutex mu;
  std::condition_variable cv;
  PeerTable<Peer> peers;  // per consumer rank
  // The consumers as their leases say (engine/membership.h; sync thread): read once a
  // sync (refresh_membership).
  Membership roll;
  // Sync state (mu).
  struct Slot {
    int group = -1;
    uint64_t hash = 0;  // routes of the attempt that packed it
    bool packed = false;
    std::set<int> pending;
    std::set<int> pushing;  // push: writes posted
    Clock::time_point since;
    // When a consumer last released (pull) / was served (push) this slot: the others'
    // pace, against which a straggler is measured (wait_slot).
    std::optional<Clock::time_point> last_release;
    std::map<uint32_t, uint64_t> checksum;  // per plan class
    // Consumer -> when its turn at this slot came (the group packed and, in the rotated
    // order, its wave open: Pacer): announced (pull) or servable on its READY (push) from
    // then. A pending consumer absent here waits for its wave.
    std::map<int, Clock::time_point> opened;
    // Targets left out when it was packed because they had declared other routes (a
    // FAILOVER); one that declares this slot's routes later reads it then (on_message).
    std::set<int> skipped;
    DeltaPack patches;  // delta syncs
  };
  std::vector<Slot> slots;
  // Delta syncs' kept copy and patches (engine/delta_encoder.h; dense without delta).
  std::unique_ptr<DeltaEncoder> delta;
  BoxDigests digests;  // EngineOptions::weight_digests: this sync's boxes, published after it
  ContentWatch content;  // SyncReport::unchanged: this sync's checksums against the last one's
  // The pace reads are served at (engine/pacer.h: the rotated order's waves, or the
  // layer order's none). Set with the routes (apply_routes); mu.
  Pacer pacer;
  // The current attempt's plan (engine/sync_plan.h): per group the consumers packed for,
  // and push's writes to each; built at the start of each attempt; mu.
  ProducerAttemptPlan plan;
  // push: (version, group, consumer) -> READY (sender instance, receive slot, routes); kept
  // even from instances not connected yet (a consumer may ask before this producer's sync
  // began). Only a READY of the routes a slot was packed with is served from it: a READY of
  // abandoned routes names a receive slot the consumer now uses for another group.
  struct ReadyFrom {
    PeerId from = 0;
    uint32_t slot = 0;
    uint64_t hash = 0;
    uint8_t landing = 0;  // the consumer's param set to write (Ready::landing)
    std::optional<uint64_t> base;  // delta: the version it takes a patch against (Ready::base)
  };
  struct Pushes {
    std::map<std::tuple<uint64_t, int, int>, ReadyFrom> ready;
    // Writes to a consumer posted and not yet finished (flushed or failed), and the
    // FLUSHED reply owed to its FAILOVER once they are: consumer -> (version, routes).
    std::map<int, int> inflight;
    std::map<int, std::pair<uint64_t, uint64_t>> flushed_owed;
  } pushes;  // mu
  SyncReport report;
  SyncTrace trace;  // this sync's events; report's sums are derived from it at the end
  Status local_failure;  // see note_local_failure; mu

  Impl(WeightSource& s, Transport& t, Store& st, const ProducerOptions& opt)
      : source(s), transport(t), store(st), opts(opt), keys(opt.job),
        route_state(st, JobKeys(opt.job), opt.failover, producer_router_options(opt, s.rank())),
        roll(st, [k = JobKeys(opt.job)](int c) { return k.consumer(c); }, consumer_instance, opt.num_consumers,
             opt.lease_ttl, [k = JobKeys(opt.job)](int c) { return k.left(c); }) {}

  // Sends m to `to`; an error from our own transport fails the sync (note_local_failure).
  Status send(PeerId to, const Message& m);

  ~Impl() {
    transport.set_message_handler({});
    transport.set_peer_failure_handler({});
    if (reg.lease) reg.lease->release().ignore();
  }

  uint32_t cls(int c) const { return routes.consumer_plan[static_cast<size_t>(c)]; }
  // What this rank holds, as it published it (the rendezvous inputs, once create() has
  // them; the staging ring keeps a reference).
  const Holdings& own_holdings() const { return route_state.inputs().holdings[static_cast<size_t>(rank)]; }

  // mu held.
  void drop_locked(int c, const std::string& why, std::vector<int>* notify);

  // The consumers it serves that did not commit v because they left the job on purpose
  // (Consumer::leave): absent at the roll call with their left mark set, or marked since.
  // Store reads without mu.
  std::set<int> leavers(uint64_t v);
  // SyncReport::missed: every consumer this producer serves that did not commit v and
  // did not leave (`left`: those are SyncReport::left), with why (a dropped one already
  // has its line in failures). mu held.
  void note_missed_locked(uint64_t v, const std::set<int>& left);
  // Consumer c is a member of the current sync no more (dropped, or it left): nothing
  // waits for it. mu held.
  void forget_member_locked(int c);

  void send_dropped(const std::vector<int>& cs, uint64_t v);

  // After a failover, tells every live consumer of sync v that has not moved to this
  // producer's routes yet which routes it now serves. Without it a restarted attempt can
  // deadlock: it waits for a slot of the abandoned attempt that a consumer still on the
  // old routes has not released, while that consumer waits for an announcement of the
  // old routes that no restarted producer will make, and no announcement of the new ones
  // reaches it. On the notice the consumer switches (FAILOVER), which frees the slot.
  void send_routes_notice(uint64_t v);

  // Whether this side's own transport is dead (Transport::health), recorded as the
  // sync's local failure: a wait for consumers asks every health_probe_every, because a
  // dead transport delivers no RELEASE/READY and, with nothing to send, no op fails
  // (without it a crashed producer waited out stall_timeout, issue 30). lk holds mu.
  bool own_transport_dead(std::unique_lock<std::mutex>& lk);

  // An op refused by this side's own transport (shut down, or crashed by failure
  // injection), not because of the peer: this producer can serve nobody, so its sync
  // fails at once instead of waiting out stall_timeout for releases that cannot come.
  void note_local_failure(const Status& st);

  // The slot holding (current version, g), or -1. mu held.
  int slot_of_locked(int g, uint64_t hash);

  static uint64_t served(const std::map<uint32_t, uint64_t>& by_class, uint32_t cls);

  // `took` (Release::took): kRelayed c read nothing (relayed on its host); kPatch c read its class's patch (delta), not the dense
  // bytes; 2 the patch and then the dense bytes (a repair).
  void release_locked(int s, int c, uint8_t took = Release::kDense);

  // Push: one write sequence to consumer c ended; owes it FLUSHED once none is left.
  void push_done(int c);

  void send_flushed(PeerId to, uint64_t v, uint64_t hash);

  // A read this attempt no longer waits for (Pacer::open). mu held.
  bool read_finished_locked(const ServedRead& r) const;

  // What to serve a consumer whose turn came (announce, or push on its READY).
  struct Serve {
    int slot = 0, consumer = 0, group = 0;
    uint64_t version = 0, hash = 0;
    PeerId id = 0;
    Announce announce;  // pull
    bool push = false;
    uint32_t recv_slot = 0;
    uint8_t landing = 0;
  };

  // The ANNOUNCE of slot s (holding sl) to consumer c: its checksum, and under delta its
  // class's patch. mu held.
  Announce announce_locked(const Slot& sl, int c, size_t s);

  // Paced: consumer c's turn at slot s came (once); what to send it now, if anything.
  // mu held.
  std::optional<Serve> turn_came_locked(int s, int c);

  // Opens every wave whose reads before it all finished (Pacer::open), and returns what
  // to serve for their groups already packed (the others are served as they are packed).
  // mu held; serve() the result once mu is released.
  std::vector<Serve> open_waves_locked();

  // Sends what open_waves_locked returned. Called without mu.
  void serve(const std::vector<Serve>& todo);

  // Push: posts the writes of slot s for consumer c into its receive slot `rslot` and
  // params (post_push_writes, engine/push_writes.h), then PUSHED. Called without mu.
  void start_push(int s, int c, uint32_t rslot, uint8_t landing, int g, uint64_t v);

  // Consumer c's sync of v is over (DONE or ABORT): its READYs of v are history, not
  // requests, so that a later sync of an older version (a rollback) does not read them
  // as a consumer asking for another version. mu held.
  void forget_ready_locked(int c, uint64_t v);

  void on_message(PeerId from, std::span<const std::byte> payload);

  void on_peer_failure(PeerId peer, const Status& why);

  // Installs routes and their schedule (caller thread; handlers read both under mu).
  Status apply_routes(Routes r);

  // This producer's extra memory (MemoryUse) for the routes now installed; cached per
  // routes and consumer instances (the walk over every plan's copies is linear in them),
  // plus the attempt plan's. Caller thread, mu held.
  MemoryUse memory_use();
  MemoryUse routes_memory_use();
  struct {
    MemoryUse use;
    uint64_t routes = 0;            // the routes `use` is of
    uint64_t epoch = ~uint64_t{0};  // ... and the consumers' membership epoch (roll)
  } memory_cache;

  // Rebuilds routes when the set of dead producers in the store changed.
  Status refresh_routes();

  // Consumer c with the lease `raw` (its roll call's): connects a new instance; true if
  // c is a member now.
  bool admit(int c, const std::string& raw);

  // Re-reads consumer leases, connects new instances; marks who takes part in this sync.
  // `store_lost_keys`: the store had lost this producer's rendezvous keys (it restarted
  // without its data), so every lease lapsed with them: wait for the leases of
  // consumers not yet connected too (a new instance that registered just before).
  void refresh_membership(uint64_t v, bool store_lost_keys);

  // Waits until slot s is free; drops consumers that stall past stall_timeout.
  Status wait_slot(size_t s, bool stop_on_restart);
  // The straggler policy these options set (EngineOptions::straggler_floor,
  // straggler_factor, join_window), for wait_slot and wait_committed.
  StragglerPolicy straggler_policy() const {
    StragglerPolicy policy{opts.straggler_floor, opts.straggler_factor, opts.mode == SyncMode::kPull};
    policy.join_window = opts.join_window;
    return policy;
  }
  // The sync's end (mu held by lk): waits until every member committed v (DONE), the
  // routes change or this producer fails, at most stall_timeout from `since` (when its
  // last slot was done); drops a member that lags the others' commits past the
  // straggler bound (engine/straggler.h, group -1). Returns the dropped, to be told
  // (send_dropped) once mu is released.
  std::vector<int> wait_committed(std::unique_lock<std::mutex>& lk, uint64_t v, Clock::time_point since);

  // The plan of an attempt at sync v (engine/sync_plan.h): its members are the live
  // consumers that have not committed v; push writes of consumer instances already
  // planned under these routes are reused. Caller thread (peers' tables change only on
  // it); installed under mu for the handlers (start_push).
  void plan_attempt(uint64_t v);

  // One attempt at sync v with the current routes. Sets *restarted when a consumer asked
  // for a failover restart.
  Status attempt(uint64_t v, bool* restarted);

  Result<SyncReport> sync(uint64_t v);
};

}  // namespace ferry
