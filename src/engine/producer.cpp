// Producer: one per trainer rank. See ferry/engine.h for the protocol.
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
#include "engine/group_order.h"
#include "engine/in_place.h"
#include "engine/protocol.h"
#include "engine/push_writes.h"
#include "engine/sync_plan.h"
#include "engine/rendezvous.h"
#include "engine/memory.h"
#include "engine/schedule.h"
#include "engine/staging_ring.h"
#include "engine/straggler.h"
#include "engine/testing.h"

namespace ferry {

using namespace engine;

struct Producer::Impl {
  WeightSource& source;
  Transport& transport;
  Store& store;
  ProducerOptions opts;
  JobKeys keys;
  int rank = 0;
  Holdings holdings;
  RouteState route_state;               // rendezvous inputs; producers excluded from `routes`
  Routes routes;
  uint64_t routes_hash = 0;
  ProducerSchedule schedule;            // per group of `routes`: what to pack, serve in place, checksum
  bool restart = false;                 // a consumer asked to restart the sync (failover); mu
  uint64_t restart_hash = 0;            // ... with these routes; mu
  // Routes this producer left during the current sync (it failed over from them). Dead
  // sets only grow within a sync, so a consumer that declares one of these is behind,
  // not ahead: it will come to our routes (following, or finding the same loss at its own
  // pace) and read every group of them, so it stays a reader of our slots and does not
  // restart us. mu.
  std::set<uint64_t> abandoned_hashes;
  std::map<int, uint64_t> consumer_hash;  // consumer -> routes it moved to this sync (FAILOVER); mu
  std::map<int, Clock::time_point> consumer_joined;  // ... and when that FAILOVER came; mu
  // consumer -> when it last moved in this sync: entered it (JOIN), released or asked for
  // a slot. A consumer absent here has not entered (engine/straggler.h); mu.
  std::map<int, Clock::time_point> consumer_progress;
  // When this process last resumed from a stop (SIGSTOP, a stalled host): clocks on the
  // consumers count from then at the earliest (wait_slot).
  PauseWatch pause_watch{std::chrono::milliseconds(100), std::chrono::milliseconds(1000)};
  std::map<int, uint64_t> early_join;  // consumer -> a later version it entered before this producer; mu
  // The routes a consumer that declared none this sync reads with: those the sync began
  // with, when they had no dead producer (otherwise every consumer declares its routes,
  // Consumer::declare_routes, and one that has not is still moving); mu.
  std::optional<uint64_t> undeclared_hash;
  // FAILOVERs that arrived before this producer's sync of that version began:
  // consumer -> (version, routes); applied when the sync starts.
  std::map<int, std::pair<uint64_t, uint64_t>> early_failover;
  std::map<int, uint64_t> early_abort;  // consumer -> version it aborted before this producer's sync began; mu
  std::map<int, uint64_t> done;         // consumer -> the version it committed last; mu
  std::map<int, Clock::time_point> done_at;  // consumer -> when that DONE came; mu
  // This producer's previous sync() (its version, when it returned): a DONE of that
  // version from before then belongs to it, not to a sync of the same version again
  // (a rollback to it: "a sync like any other", docs/engine.md). mu.
  std::optional<std::pair<uint64_t, Clock::time_point>> previous_sync;
  // Where groups are packed and read from: the host ring, the GPU ring, the in-place
  // table (engine/staging_ring.h); its memory registered with `transport`.
  TransportRingMemory ring_memory{transport};
  std::unique_ptr<StagingRing> staging;
  std::unique_ptr<Lease> lease;
  Published published;  // metadata (rank 0) and holdings, put back if the store lost them
  // This instance's claim on the rank (rendezvous.h, claim_rank) and its name there.
  const std::string instance = instance_name();
  std::unique_ptr<Lease> claim;

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
  };
  std::mutex mu;
  std::condition_variable cv;
  PeerTable<Peer> peers;  // per consumer rank
  // Sync state (mu).
  bool in_sync = false;
  uint64_t version = 0;
  std::vector<bool> live;
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
  std::map<std::tuple<uint64_t, int, int>, ReadyFrom> ready;
  // push: writes to a consumer posted and not yet finished (flushed or failed), and the
  // FLUSHED reply owed to its FAILOVER once they are: consumer -> (version, routes). mu.
  std::map<int, int> pushes_inflight;
  std::map<int, std::pair<uint64_t, uint64_t>> flushed_owed;
  SyncReport report;
  SyncTrace trace;  // this sync's events; report's sums are derived from it at the end
  std::map<int, std::string> drop_reason;  // consumer -> why it was dropped (told with DROPPED); mu
  Status local_failure;  // see note_local_failure; mu

  Impl(WeightSource& s, Transport& t, Store& st, const ProducerOptions& opt)
      : source(s), transport(t), store(st), opts(opt), keys(opt.job), route_state(st, JobKeys(opt.job), opt.failover, producer_router_options(opt, s.rank())) {}

  // Sends m to `to`; an error from our own transport fails the sync (note_local_failure).
  Status send(PeerId to, const Message& m) {
    auto sent = transport.send(to, kEngineTag, encode_message(m));
    if (!sent.ok()) note_local_failure(sent.status());
    return sent.status();
  }

  ~Impl() {
    transport.set_message_handler({});
    transport.set_peer_failure_handler({});
    if (lease) lease->release().ignore();
  }

  uint32_t cls(int c) const { return routes.consumer_plan[static_cast<size_t>(c)]; }

  // mu held.
  void drop_locked(int c, const std::string& why, std::vector<int>* notify) {
    if (c < 0 || c >= static_cast<int>(live.size()) || !live[static_cast<size_t>(c)]) return;
    live[static_cast<size_t>(c)] = false;
    report.dropped.push_back(c);
    report.failures.push_back(fmt::format("producer {} dropped consumer {}: {}", rank, c, why));
    drop_reason[c] = why;
    for (auto& s : slots) {
      s.pending.erase(c);
      s.pushing.erase(c);
    }
    if (notify) notify->push_back(c);
    cv.notify_all();
  }

  // SyncReport::missed: every consumer this producer serves that did not commit v, with
  // why (a dropped one already has its line in failures). mu held.
  void note_missed_locked(uint64_t v) {
    std::vector<bool> served(static_cast<size_t>(opts.num_consumers), false);
    for (const ProducerGroupSchedule& gs : schedule.groups) {
      for (int c = 0; c < opts.num_consumers; ++c) {
        if (gs.served.count(cls(c))) served[static_cast<size_t>(c)] = true;
      }
    }
    const std::set<int> dropped(report.dropped.begin(), report.dropped.end());
    for (int c = 0; c < opts.num_consumers; ++c) {
      if (!served[static_cast<size_t>(c)] || (done.count(c) && done[c] == v)) continue;
      report.missed.push_back(c);
      if (dropped.count(c)) continue;
      if (!live[static_cast<size_t>(c)]) {
        report.failures.push_back(fmt::format("producer {}: consumer {} is not a member of sync {} (no live lease {})",
                                              rank, c, v, keys.consumer(c)));
      } else {
        report.failures.push_back(fmt::format("producer {}: consumer {} did not confirm it committed sync {} within "
                                              "stall_timeout {} ms", rank, c, v, opts.stall_timeout.count()));
      }
    }
  }

  void send_dropped(const std::vector<int>& cs, uint64_t v) {
    for (int c : cs) {
      PeerId id;
      std::string why;
      {
        std::lock_guard<std::mutex> lk(mu);
        if (!peers[c].connected) continue;
        id = peers[c].id;
        why = drop_reason[c];
      }
      send(id, Dropped{static_cast<uint32_t>(rank), v, routes_hash, why}).ignore();
    }
  }

  // After a failover, tells every live consumer of sync v that has not moved to this
  // producer's routes yet which routes it now serves. Without it a restarted attempt can
  // deadlock: it waits for a slot of the abandoned attempt that a consumer still on the
  // old routes has not released, while that consumer waits for an announcement of the
  // old routes that no restarted producer will make, and no announcement of the new ones
  // reaches it. On the notice the consumer switches (FAILOVER), which frees the slot.
  void send_routes_notice(uint64_t v) {
    std::vector<PeerId> to;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (int c = 0; c < opts.num_consumers; ++c) {
        const auto i = static_cast<size_t>(c);
        if (!live[i] || !peers[c].connected || (done.count(c) && done[c] == v)) continue;
        if (auto it = consumer_hash.find(c); it != consumer_hash.end() && it->second == routes_hash) continue;
        to.push_back(peers[c].id);
      }
    }
    const RoutesNotice m{static_cast<uint32_t>(rank), v, routes_hash};
    for (PeerId id : to) transport.send(id, kEngineTag, encode_message(m)).status().ignore();
  }

  // Whether this side's own transport is dead (Transport::health), recorded as the
  // sync's local failure: a wait for consumers asks every health_probe_every, because a
  // dead transport delivers no RELEASE/READY and, with nothing to send, no op fails
  // (without it a crashed producer waited out stall_timeout, issue 30). lk holds mu.
  bool own_transport_dead(std::unique_lock<std::mutex>& lk) {
    Status h = transport.health();
    if (h.ok()) return false;
    lk.unlock();
    note_local_failure(h);
    lk.lock();
    return !local_failure.ok();
  }

  // An op refused by this side's own transport (shut down, or crashed by failure
  // injection), not because of the peer: this producer can serve nobody, so its sync
  // fails at once instead of waiting out stall_timeout for releases that cannot come.
  void note_local_failure(const Status& st) {
    if (st.code() != StatusCode::kCancelled && st.code() != StatusCode::kFailedPrecondition) return;
    std::lock_guard<std::mutex> lk(mu);
    if (local_failure.ok()) local_failure = st.with_context(fmt::format("producer {}: its transport failed", rank));
    cv.notify_all();
  }

  // The slot holding (current version, g), or -1. mu held.
  int slot_of_locked(int g, uint64_t hash) {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].group == g && slots[i].packed && slots[i].hash == hash) return static_cast<int>(i);
    }
    return -1;
  }

  static uint64_t served(const std::map<uint32_t, uint64_t>& by_class, uint32_t cls) {
    auto it = by_class.find(cls);
    return it == by_class.end() ? 0 : it->second;
  }

  // `took_patch` (Release::took_patch): 3 c read nothing (relayed on its host); 1 c read its class's patch (delta), not the dense
  // bytes; 2 the patch and then the dense bytes (a repair).
  void release_locked(int s, int c, int took_patch = 0) {
    Slot& sl = slots[static_cast<size_t>(s)];
    if (sl.pending.erase(c)) {
      sl.last_release = Clock::now();
      const ProducerGroupSchedule& gs = schedule.groups[static_cast<size_t>(sl.group)];
      const uint64_t b = served(gs.served, cls(c)), ip = served(gs.served_in_place, cls(c));
      Clock::time_point from = sl.since;  // from its turn
      pacer.note_released(c, sl.group);
      if (auto o = sl.opened.find(c); o != sl.opened.end()) from = o->second;
      if (took_patch == 3) {  // c copied the group from a relay on its host: nothing went to it from here
        cv.notify_all();
        return;
      }
      const uint64_t patch = took_patch > 0 ? sl.patches.bytes_for(cls(c)).value_or(0) : 0;
      if (patch > 0) {
        trace.record(TracePhase::kSend, sl.group, c, from, *sl.last_release, TraceLane::kPatch, patch);
        if (took_patch == 1) report.patched_dense_bytes += b - ip;
      }
      if ((patch == 0 || took_patch == 2) && (b > ip || ip == 0)) {
        trace.record(TracePhase::kSend, sl.group, c, from, *sl.last_release, TraceLane::kTransport, b - ip);
      }
      if (ip > 0) trace.record(TracePhase::kSend, sl.group, c, from, *sl.last_release, TraceLane::kInPlace, ip);
      cv.notify_all();
    }
  }

  // Push: one write sequence to consumer c ended; owes it FLUSHED once none is left.
  void push_done(int c) {
    PeerId to = 0;
    uint64_t v = 0, hash = 0;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (--pushes_inflight[c] > 0) return;
      auto it = flushed_owed.find(c);
      if (it == flushed_owed.end() || !peers[c].connected) return;
      v = it->second.first;
      hash = it->second.second;
      flushed_owed.erase(it);
      to = peers[c].id;
    }
    send_flushed(to, v, hash);
  }

  void send_flushed(PeerId to, uint64_t v, uint64_t hash) {
    transport.send(to, kEngineTag, encode_message(Flushed{static_cast<uint32_t>(rank), v, hash})).status().ignore();
  }

  // A read this attempt no longer waits for (Pacer::open). mu held.
  bool read_finished_locked(const ServedRead& r) const {
    const auto c = static_cast<size_t>(r.consumer);
    if (c >= live.size() || !live[c]) return true;
    if (auto d = done.find(r.consumer); d != done.end() && d->second == version) return true;
    if (auto h = consumer_hash.find(r.consumer); h != consumer_hash.end() && h->second != routes_hash) return true;
    if (static_cast<size_t>(r.group) >= plan.groups.size()) return true;
    const std::vector<int>& t = plan.groups[static_cast<size_t>(r.group)].targets;
    return !std::binary_search(t.begin(), t.end(), r.consumer);
  }

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
  Announce announce_locked(const Slot& sl, int c, size_t s) {
    Announce m{static_cast<uint32_t>(rank), version, sl.group, sl.hash, staging->slot_offset(s), std::nullopt};
    if (opts.checksums) m.checksum = served(sl.checksum, cls(c));
    if (auto pb = sl.patches.bytes_for(cls(c))) {
      m.patch_base = sl.patches.base;
      m.patch_bytes = *pb;
      m.patch_offset = sl.patches.patch_offset;
      m.dense_offset = sl.patches.dense_offset;
    }
    return m;
  }

  // Paced: consumer c's turn at slot s came (once); what to send it now, if anything.
  // mu held.
  std::optional<Serve> turn_came_locked(int s, int c) {
    Slot& sl = slots[static_cast<size_t>(s)];
    if (!sl.pending.count(c) || sl.opened.count(c)) return std::nullopt;
    sl.opened[c] = Clock::now();
    Serve out{s, c, sl.group, version, sl.hash, peers[c].id};
    if (opts.mode == SyncMode::kPull) {
      out.announce = announce_locked(sl, c, static_cast<size_t>(s));
      return out;
    }
    auto it = ready.find({version, sl.group, c});
    if (it == ready.end() || it->second.from != out.id || it->second.hash != sl.hash) return std::nullopt;
    out.push = true;
    out.recv_slot = it->second.slot;
    out.landing = it->second.landing;
    return out;
  }

  // Opens every wave whose reads before it all finished (Pacer::open), and returns what
  // to serve for their groups already packed (the others are served as they are packed).
  // mu held; serve() the result once mu is released.
  std::vector<Serve> open_waves_locked() {
    std::vector<Serve> out;
    if (!in_sync || plan.routes_hash != routes_hash) return out;
    for (const ServedRead& r : pacer.open([this](const ServedRead& x) { return read_finished_locked(x); })) {
      const int s = slot_of_locked(r.group, routes_hash);
      if (s < 0) continue;
      if (auto sv = turn_came_locked(s, r.consumer)) out.push_back(*sv);
    }
    return out;
  }

  // Sends what open_waves_locked returned. Called without mu.
  void serve(const std::vector<Serve>& todo) {
    for (const Serve& t : todo) {
      if (t.push) {
        start_push(t.slot, t.consumer, t.recv_slot, t.landing, t.group, t.version);
        continue;
      }
      const auto ta = Clock::now();
      if (Status sent = send(t.id, t.announce); !sent.ok()) {
        std::lock_guard<std::mutex> lk(mu);
        drop_locked(t.consumer, "announce failed: " + sent.to_string(), nullptr);
      }
      trace.record(TracePhase::kAnnounce, t.group, t.consumer, ta, Clock::now());
    }
  }

  // Push: posts the writes of slot s for consumer c into its receive slot `rslot` and
  // params (post_push_writes, engine/push_writes.h), then PUSHED. Called without mu.
  void start_push(int s, int c, uint32_t rslot, uint8_t landing, int g, uint64_t v) {
    const auto t_push = Clock::now();
    std::vector<PushWrite> mine;
    PushTarget to;
    std::optional<uint64_t> checksum;
    uint64_t hash;
    uint64_t from_offset = staging->slot_offset(static_cast<size_t>(s));  // where the writes' staging bytes lie
    std::optional<uint64_t> patch_base;  // delta: a patch is written
    uint64_t patch_bytes = 0, dense_offset = 0;
    {
      std::lock_guard<std::mutex> lk(mu);
      Slot& sl = slots[static_cast<size_t>(s)];
      if (!in_sync || version != v || sl.group != g || sl.hash != routes_hash || !sl.pending.count(c) ||
          sl.pushing.count(c))
        return;
      sl.pushing.insert(c);
      hash = sl.hash;
      ++pushes_inflight[c];
      const Peer& p = peers[c];
      to = PushTarget{p.id, p.recv, static_cast<uint64_t>(rslot) * p.recv_slot_bytes,
                      landing == 0 ? p.param_regions : p.other_param_regions};
      if (opts.checksums) {
        auto it = sl.checksum.find(cls(c));
        checksum = it != sl.checksum.end() ? it->second : 0;
      }
      mine = plan.writes_of(c, g);
      // Delta: c's class has a patch in the slot. Write it (one write, into c's segment of
      // the receive slot) where c holds its base, else the dense bytes from the kept copy.
      // (Without a kept copy, delta_block_bytes, the slot holds the dense bytes and the
      // patches lie in its patch area: push writes the dense bytes, as it would read
      // them back for a repair from a slot that may be packed again by then.)
      if (auto pb = sl.patches.bytes_for(cls(c)); pb && !opts.delta_block_bytes) {
        auto rf = ready.find({v, g, c});
        const Read* read = single_read_from(routes.consumer(static_cast<size_t>(c)).groups[static_cast<size_t>(g)],
                                            static_cast<uint32_t>(rank));
        if (rf != ready.end() && rf->second.base == sl.patches.base && read && *pb <= read->length) {
          mine = {PushWrite{-1, read->offset, -1, read->recv_offset, *pb}};
          patch_base = sl.patches.base;
          patch_bytes = *pb;
          dense_offset = sl.patches.dense_offset;
        } else {
          from_offset = sl.patches.dense_offset;
        }
      }
    }
    // Exactly one end (push_done) per push. The first error takes c out of the sync (and
    // fails it, if our own transport failed), before the writes already posted complete.
    auto failed = [this, c, v](const Status& st) {
      note_local_failure(st);
      std::lock_guard<std::mutex> lk(mu);
      if (version == v) drop_locked(c, "push failed: " + st.to_string(), nullptr);
    };
    const PeerId id = to.peer;
    auto end = [this, s, c, g, v, id, rslot, checksum, hash, failed, t_push, patch_base, patch_bytes,
                dense_offset](const Status& st) {
      if (st.ok()) {
        trace.record(TracePhase::kPushWrite, g, c, t_push, Clock::now());
        // routes: the ones the bytes were laid out by, whatever this producer runs now.
        const Pushed m{static_cast<uint32_t>(rank), v, g, hash, rslot, checksum, patch_base, patch_bytes, dense_offset};
        auto sent = transport.send(id, kEngineTag, encode_message(m));
        if (!sent.ok()) {
          failed(sent.status());
        } else {
          std::vector<Serve> todo;
          {
            std::lock_guard<std::mutex> lk(mu);
            const Slot& sl = slots[static_cast<size_t>(s)];
            if (version == v && sl.group == g && sl.hash == hash) release_locked(s, c, patch_base ? 1 : 0);
            todo = open_waves_locked();
          }
          serve(todo);
        }
      }
      push_done(c);
    };
    if (opts.test_hooks && opts.test_hooks->before_push) opts.test_hooks->before_push(v, g, c);
    post_push_writes(transport, *staging, from_offset, mine, to, failed, end);
  }

  // Consumer c's sync of v is over (DONE or ABORT): its READYs of v are history, not
  // requests, so that a later sync of an older version (a rollback) does not read them
  // as a consumer asking for another version. mu held.
  void forget_ready_locked(int c, uint64_t v) {
    for (auto it = ready.lower_bound({v, std::numeric_limits<int>::min(), std::numeric_limits<int>::min()});
         it != ready.end() && std::get<0>(it->first) == v;) {
      it = std::get<2>(it->first) == c ? ready.erase(it) : std::next(it);
    }
  }

  void on_message(PeerId from, std::span<const std::byte> payload) {
    auto decoded = decode_message(payload);
    if (!decoded.ok()) return;
    const Message& msg = *decoded;
    const int c = static_cast<int>(sender_of(msg));
    const uint64_t mv = version_of(msg);
    int push_slot = -1;
    std::optional<Ready> push;
    std::optional<Dropped> mismatch_drop;  // sent once mu is released
    std::optional<std::pair<uint64_t, uint64_t>> flushed;  // (version, routes) answered at once
    std::vector<Serve> todo;                                // paced: turns that came
    {
      std::lock_guard<std::mutex> lk(mu);
      if (c < 0 || c >= peers.size()) return;
      const bool known = peers.made_for(from, c);
      if (!known) {
        // An instance not admitted yet that gave up: serve none of its READYs later.
        if (const auto* m = std::get_if<Abort>(&msg)) forget_ready_locked(c, m->version);
      }
      if (!known && !std::holds_alternative<Ready>(msg)) return;  // stale instance or unknown peer
      const bool current = in_sync && mv == version;
      if (current && known && (std::holds_alternative<Release>(msg) || std::holds_alternative<Ready>(msg) ||
                      std::holds_alternative<Join>(msg))) {
        consumer_progress[c] = Clock::now();  // its straggler clock restarts (wait_slot)
        cv.notify_all();
      }
      if (std::holds_alternative<Join>(msg)) {
        if (!current && mv > version) early_join[c] = mv;
        return;
      }
      if (const auto* m = std::get_if<Release>(&msg)) {
        if (!current) return;
        const int s = slot_of_locked(m->group, m->routes);
        if (s >= 0) release_locked(s, c, m->took_patch);
      } else if (const auto* m = std::get_if<Failover>(&msg)) {
        if (opts.mode == SyncMode::kPush) {
          // Reply FLUSHED once no write of ours to c is in flight: c reuses its receive
          // slots for the new routes only then. (Below, c leaves every slot of other
          // routes, so no new write of those starts.)
          if (pushes_inflight[c] == 0) {
            flushed = std::make_pair(m->version, m->routes);
          } else {
            flushed_owed[c] = {m->version, m->routes};
          }
        }
        if (!current) {
          // A later version's (this producer is not in it yet, or still in the one
          // before): applied when that sync starts.
          if (m->version > version) early_failover[c] = {m->version, m->routes};
        } else {
          // c abandoned its attempt: it reads none of the slots it had pending.
          consumer_hash[c] = m->routes;
          consumer_joined[c] = Clock::now();
          cv.notify_all();  // its straggler clock (wait_slot) starts now
          const bool behind = abandoned_hashes.count(m->routes) > 0;
          for (auto& sl : slots) {
            if (sl.hash != m->routes && !(behind && sl.hash == routes_hash) && sl.pending.erase(c)) cv.notify_all();
          }
          // Groups packed on these routes while c was still on others (it followed a
          // first failover, then found a second producer lost at its own pace) left it
          // out: it reads them now. Before, nothing announced them to it, and it waited
          // for them until this producer dropped it as stalled (CI:
          // MultiHostFaults.TrainerHostLinkDownFailsOverToTheDpReplica, 1 run in 3).
          if (m->routes == routes_hash) {
            for (size_t s = 0; s < slots.size(); ++s) {
              Slot& sl = slots[s];
              if (!sl.packed || sl.hash != m->routes || !sl.skipped.erase(c)) continue;
              sl.pending.insert(c);
              cv.notify_all();
              if (!pacer.turn(c, sl.group)) continue;  // served when its wave opens
              if (auto sv = turn_came_locked(static_cast<int>(s), c)) todo.push_back(*sv);
            }
          }
          if (m->routes != routes_hash && !behind) {
            restart = true;
            restart_hash = m->routes;
            cv.notify_all();
          }
        }
      } else if (const auto* m = std::get_if<Done>(&msg)) {
        done[c] = m->version;  // (not max: a rollback commits an older version)
        done_at[c] = Clock::now();
        forget_ready_locked(c, m->version);
        if (current) {
          for (auto& sl : slots) sl.pending.erase(c);
          cv.notify_all();
        }
      } else if (const auto* m = std::get_if<Abort>(&msg)) {
        forget_ready_locked(c, m->version);
        if (opts.mode == SyncMode::kPush) {
          // c owns its params again once none of our writes is in flight: say when (below,
          // c leaves the sync, so no new write to it starts).
          if (pushes_inflight[c] == 0) {
            flushed = std::make_pair(m->version, m->routes);
          } else {
            flushed_owed[c] = {m->version, m->routes};
          }
        }
        if (current) {
          drop_locked(c, "it aborted the sync", nullptr);
        } else if (!in_sync && m->version > version) {
          early_abort[c] = m->version;
        } else if (in_sync && m->version > version) {
          // It gave up a later version than ours: it is not in this sync (a version
          // mismatch), so waiting for it would only hold the slots to the stall timeout.
          drop_locked(c, fmt::format("it synced version {}, not this sync's {}", m->version, version), nullptr);
        }
      } else if (const auto* m = std::get_if<Ready>(&msg)) {
        // A consumer may ask before this producer's sync of that version started.
        if (in_sync && m->version < version) return;
        // ... but only once it committed ours: one that asks for a later version while a
        // member of this sync syncs another version than ours (a caller's mismatch).
        // Drop it, and tell it under its own version so that it fails now, naming both.
        if (known && in_sync && m->version > version && !(done.count(c) && done[c] == version) &&
            static_cast<size_t>(c) < live.size() && live[static_cast<size_t>(c)]) {
          const std::string why = fmt::format("it syncs version {} but this producer serves version {}", m->version, version);
          drop_locked(c, why, nullptr);
          mismatch_drop = Dropped{static_cast<uint32_t>(rank), m->version, routes_hash, why};
        }
        if (m->recv_slot >= kReceiveSlots) return;  // not a slot of the consumer's ring
        if (ready.size() > 100000) return;
        const Peer& p = peers[c];
        if (known &&
            (m->landing > 1 || (m->landing == 1 && p.other_param_regions.size() != p.param_regions.size()))) {
          // A set its lease does not publish: the writes meant for its params would miss them.
          const std::string why = fmt::format("its READY names param set {}, which its lease does not publish",
                                              int(m->landing));
          if (current) drop_locked(c, why, nullptr);
          mismatch_drop = Dropped{static_cast<uint32_t>(rank), m->version, routes_hash, why};
        } else {
          ready[{m->version, m->group, c}] = ReadyFrom{from, m->recv_slot, m->routes, m->landing, m->base};
          if (current && known) {
            push_slot = slot_of_locked(m->group, m->routes);
            // Paced: served when its wave opens (open_waves_locked), not before.
            if (push_slot >= 0 && !pacer.turn(c, m->group)) push_slot = -1;
            push = *m;
          }
        }
      }
      todo = open_waves_locked();
    }
    serve(todo);
    if (mismatch_drop) send(from, *mismatch_drop).ignore();
    if (push_slot >= 0) start_push(push_slot, c, push->recv_slot, push->landing, push->group, push->version);
    if (flushed) send_flushed(from, flushed->first, flushed->second);
  }

  void on_peer_failure(PeerId peer, const Status& why) {
    std::lock_guard<std::mutex> lk(mu);
    const std::optional<int> failed = peers.fail(peer);  // (one not mapped yet: refresh_membership refuses it)
    if (!failed) return;
    const int c = *failed;
    // One that committed this sync (DONE) and then closed is not dropped: nothing is
    // missed and the report names no one (issue 30: it said ok while naming a consumer
    // that closed right after syncing). Nor is one that died between refresh and the
    // sync: neither is waited for.
    if (in_sync && !(done.count(c) && done[c] == version)) {
      drop_locked(c, "transport: " + why.to_string(), nullptr);
    } else if (static_cast<size_t>(c) < live.size()) {
      live[static_cast<size_t>(c)] = false;
    }
  }

  // Installs routes and their schedule (caller thread; handlers read both under mu).
  Status apply_routes(Routes r) {
    FERRY_RETURN_IF_ERROR(check_routes_hold(r, route_state.router()).with_context(fmt::format("producer {}", rank)));
    FERRY_ASSIGN_OR_RETURN(auto sched, make_producer_schedule(r, rank, holdings, staging->in_place(), staging->slot_bytes()));
    FERRY_ASSIGN_OR_RETURN(Pacer pace, Pacer::make(r, rank, opts.group_order));
    std::lock_guard<std::mutex> lk(mu);
    pacer = std::move(pace);
    routes = std::move(r);
    routes_hash = routes.fingerprint();
    schedule = std::move(sched);
    delta->install(routes.producers[static_cast<size_t>(rank)]);
    return Status::Ok();
  }

  // This producer's extra memory (MemoryUse) for the routes now installed; cached per
  // routes and consumer instances (the walk over every plan's copies is linear in them),
  // plus the attempt plan's. Caller thread, mu held.
  MemoryUse memory_use() {
    MemoryUse m = routes_memory_use();
    m.metadata += plan.heap_bytes();
    m.metadata += pacer.heap_bytes();  // the rotated order's waves (docs/group-order.md, "Memory")
    return m;
  }
  MemoryUse routes_memory_use() {
    if (memory_hash != routes_hash || !memory_known) {
      MemoryUse m;
      m.kept_copy = staging->kept_bytes();
      m.staging_ring = staging->host_bytes() - m.kept_copy;
      if (!opts.delta)  // (delta serves nothing in place)
        for (const MemoryRegion& r : opts.source_regions) m.registered_in_place += r.length;
      const RouteInputs& in = route_state.inputs();
      m.metadata = metadata_heap_bytes(routes, in.metadata, in.holdings, in.plans) + schedule_heap_bytes(schedule) +
                   staging->in_place().boxes.capacity() * sizeof(InPlaceTable::At);
      memory = m;
      memory_hash = routes_hash;
      memory_known = true;
    }
    return memory;
  }
  MemoryUse memory;
  uint64_t memory_hash = 0;
  bool memory_known = false;

  // Rebuilds routes when the set of dead producers in the store changed.
  Status refresh_routes() {
    return route_state.refresh([this](Routes r) { return apply_routes(std::move(r)); });
  }

  // Reads consumer c's lease and connects a new instance; true if c is a member now.
  bool admit(int c) {
    auto raw = store.get(keys.consumer(c));
    if (!raw.ok()) return false;
    auto lease = decode_consumer_lease(*raw);
    if (!lease.ok()) return false;
    // The instance and its memory; the versions it holds change at every commit and are
    // no reason to reconnect.
    const std::string blob = encode_lease(lease->instance());
    Peer& p = peers[c];
    bool fresh;
    {
      std::lock_guard<std::mutex> lk(mu);
      fresh = !peers.current(c, blob);
      p.committed = lease->committed;
    }
    if (!fresh) return true;
    auto id = transport.connect(string_bytes(lease->address));
    if (!id.ok()) return false;
    RemoteRegion recv;
    uint64_t rbytes = 0;
    ParamTable params;
    std::vector<RemoteRegion> param_regions, other_param_regions;
    if (opts.mode == SyncMode::kPush) {
      auto k = transport.import_key(string_bytes(lease->recv_key));
      if (!k.ok()) return false;
      recv = *k;
      rbytes = lease->recv_slot_bytes;
      auto table = ParamTable::decode(lease->params);
      if (!table.ok()) return false;
      for (const std::string& key : table->keys) {
        auto r = transport.import_key(string_bytes(key));
        if (!r.ok()) return false;
        param_regions.push_back(*r);
      }
      for (const std::string& key : table->other_keys) {
        auto r = transport.import_key(string_bytes(key));
        if (!r.ok()) return false;
        other_param_regions.push_back(*r);
      }
      params = std::move(*table);
    }
    std::lock_guard<std::mutex> lk(mu);
    if (!peers.adopt(c, blob, *id)) return false;  // died while we connected
    p.recv = recv;
    p.recv_slot_bytes = rbytes;
    p.params = std::move(params);
    p.param_regions = std::move(param_regions);
    p.other_param_regions = std::move(other_param_regions);
    memory_known = false;
    return true;
  }

  // Re-reads consumer leases, connects new instances; marks who takes part in this sync.
  // `store_lost_keys`: the store had lost this producer's rendezvous keys (it restarted
  // without its data), so every lease lapsed with them: wait for the leases of
  // consumers not yet connected too (a new instance that registered just before).
  void refresh_membership(uint64_t v, bool store_lost_keys) {
    std::vector<bool> now(static_cast<size_t>(opts.num_consumers), false);
    for (int c = 0; c < opts.num_consumers; ++c) now[static_cast<size_t>(c)] = admit(c);
    // Consumers it serves that are still connected from an earlier sync but have no
    // lease: paused past the ttl, or every lease lapsed because the store paused or
    // restarted. A live one heals its lease within ttl/3 of resuming (Lease), so wait up
    // to one lease_ttl for it before leaving it out of v; one still paused is told at
    // once that it is not a member of v, so that it fails v as soon as it resumes
    // instead of waiting out `timeout` for announcements that never come, and rejoins
    // at the next sync. (A dead one is not connected: the transport reported it.)
    auto absent = [&] {
      std::vector<int> out;
      std::lock_guard<std::mutex> lk(mu);
      for (int c = 0; c < opts.num_consumers; ++c) {
        if (now[static_cast<size_t>(c)] || !(peers[c].connected || store_lost_keys)) continue;
        bool serves = false;
        for (const ProducerGroupSchedule& gs : schedule.groups) serves |= gs.served.count(cls(c)) > 0;
        if (serves) out.push_back(c);
      }
      return out;
    };
    std::vector<int> missing;
    heal_leases(
        opts.lease_ttl, [&] { return !(missing = absent()).empty(); },
        [&] {
          for (int c : missing) now[static_cast<size_t>(c)] = admit(c);
        });
    std::vector<int> left_out = absent();
    if (store_lost_keys) {  // told only if connected: one never reached may be dead
      std::lock_guard<std::mutex> lk(mu);
      std::erase_if(left_out, [&](int c) { return !peers[c].connected; });
    }
    std::unique_lock<std::mutex> lk(mu);
    for (int c = 0; c < opts.num_consumers; ++c) {
      if (!peers[c].connected) now[static_cast<size_t>(c)] = false;  // failed since connecting
    }
    live = now;
    for (int c : left_out) {
      drop_reason[c] = fmt::format("not a member of sync {}: no live lease {} within lease_ttl {} ms of its start "
                                   "(paused?); rejoin at the next sync", v, keys.consumer(c), opts.lease_ttl.count());
    }
    lk.unlock();
    send_dropped(left_out, v);
  }

  // Waits until slot s is free; drops consumers that stall past stall_timeout.
  Status wait_slot(size_t s, bool stop_on_restart) {
    std::vector<int> n;
    std::unique_lock<std::mutex> lk(mu);
    if (!local_failure.ok()) return local_failure;
    while (!slots[s].pending.empty() && !(stop_on_restart && restart && restart_hash != routes_hash) &&
           local_failure.ok()) {
      // Turns that came (drops end reads too) are served from here as well.
      if (std::vector<Serve> todo = open_waves_locked(); !todo.empty()) {
        lk.unlock();
        serve(todo);
        lk.lock();
        continue;
      }
      if (own_transport_dead(lk)) continue;  // (ends the wait)
      const auto probe_at = Clock::now() + health_probe_every(opts.lease_ttl);
      // On the current routes a consumer's stall and lag count from its turn (Slot::opened:
      // when its group was packed, or when its wave opened); one whose turn has not come
      // waits for those before it.
      const bool pace_slot = slots[s].hash == routes_hash;
      bool any_open = false;
      if (pace_slot) {
        for (int c : slots[s].pending) any_open = any_open || slots[s].opened.count(c) > 0;
      }
      // A consumer stalls stall_timeout after the later of the slot's announcement (its
      // turn, paced) and its own last progress in this sync (a release, a request, a
      // JOIN): one held up by another producer that is gone and restarting says so with
      // JOINs (Consumer await_restart), and is not dropped for it.
      // Time this producer spent stopped is held against no consumer: what they sent
      // meanwhile may still be queued for us (engine/straggler.h, PauseWatch).
      const std::optional<Clock::time_point> resumed = pause_watch.last_resume();
      if (resumed) {
        for (int c : slots[s].pending) {
          if (auto pr = consumer_progress.find(c); pr != consumer_progress.end()) pr->second = std::max(pr->second, *resumed);
        }
      }
      auto stall_from = [&](int c) -> std::optional<Clock::time_point> {
        Clock::time_point from = slots[s].since;
        if (any_open) {
          auto o = slots[s].opened.find(c);
          if (o == slots[s].opened.end()) return std::nullopt;  // its turn has not come
          from = o->second;
        }
        if (resumed) from = std::max(from, *resumed);
        if (auto pr = consumer_progress.find(c); pr != consumer_progress.end()) from = std::max(from, pr->second);
        return from;
      };
      auto deadline = slots[s].since + opts.stall_timeout;
      {
        bool first = true;
        for (int c : slots[s].pending) {
          if (auto from = stall_from(c)) {
            deadline = first ? *from + opts.stall_timeout : std::min(deadline, *from + opts.stall_timeout);
            first = false;
          }
        }
      }
      // A straggler: others released this slot and it lags them by more than the bound
      // (EngineOptions::straggler_floor / straggler_factor), so it no longer holds them
      // back for the whole stall timeout. It catches up at the next sync. Only a consumer
      // known to read this slot's routes, the producer's current ones, can lag: one still
      // moving to them after a failover (it finds a producer lost by its lease at its own
      // pace, seconds apart from the others on a loaded host) is bounded by stall_timeout
      // alone until it declares them (FAILOVER), and its lag counts from then; so is one
      // pending in a slot of routes the producer abandoned (engine/straggler.h). What it
      // knows is read again after the wait, which may have let a FAILOVER in.
      StragglerPolicy policy{opts.straggler_floor, opts.straggler_factor, opts.mode == SyncMode::kPull};
      policy.join_window = opts.join_window;
      if (opts.num_producers > 1) policy.loss_detection = 2 * opts.lease_ttl;
      RoutesKnown known{routes_hash, &consumer_hash, &consumer_joined, undeclared_hash};
      known.progress = &consumer_progress;
      if (pace_slot) known.opened = &slots[s].opened;
      auto pace = [&] { return SlotPace{slots[s].group, slots[s].hash, slots[s].since, slots[s].last_release}; };
      const Clock::duration bound = slots[s].last_release ? straggler_bound(policy, pace()) : Clock::duration{};
      if (auto at = next_straggler(policy, bound, pace(), known, slots[s].pending, deadline)) {
        if (cv.wait_until(lk, std::min(*at, probe_at)) == std::cv_status::timeout && Clock::now() >= *at &&
            slots[s].last_release &&
            !slots[s].pending.empty()) {
          for (const auto& [c, why] : stragglers(policy, bound, pace(), known, slots[s].pending, Clock::now()))
            drop_locked(c, why, &n);
        }
        continue;
      }
      if (cv.wait_until(lk, std::min(deadline, probe_at)) == std::cv_status::timeout && Clock::now() >= deadline) {
        std::set<int> late = slots[s].pending;
        const auto now = Clock::now();
        std::erase_if(late, [&](int c) {
          const auto from = stall_from(c);
          return !from || *from + opts.stall_timeout > now;
        });
        for (int c : late) {
          drop_locked(c,
                      fmt::format("stalled: group {} not {} within {} ms (stall_timeout) of its announcement "
                                  "or the consumer's last progress", slots[s].group,
                                  opts.mode == SyncMode::kPull ? "released" : "requested", opts.stall_timeout.count()),
                      &n);
        }
      }
    }
    const uint64_t v = version;
    lk.unlock();
    send_dropped(n, v);
    std::lock_guard<std::mutex> relock(mu);
    return local_failure;
  }

  // The plan of an attempt at sync v (engine/sync_plan.h): its members are the live
  // consumers that have not committed v; push writes of consumer instances already
  // planned under these routes are reused. Caller thread (peers' tables change only on
  // it); installed under mu for the handlers (start_push).
  void plan_attempt(uint64_t v) {
    ProducerPlanInputs in;
    in.routes = &routes;
    in.routes_hash = routes_hash;
    in.rank = rank;
    in.schedule = &schedule;
    in.push = opts.mode == SyncMode::kPush;
    in.holdings = &route_state.inputs().holdings;
    in.in_place = &staging->in_place();
    ProducerAttemptPlan previous;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (int c = 0; c < opts.num_consumers; ++c) {
        const Peer& p = peers[c];
        const bool member = live[static_cast<size_t>(c)] && !(done.count(c) && done[c] == v);
        in.members.push_back(member);
        in.tables.push_back(member ? &p.params : nullptr);
        in.instances.push_back(member ? p.instance : std::string());
      }
      previous = plan;  // (copies shared writes; the handlers keep reading `plan` meanwhile)
    }
    in.previous = &previous;
    ProducerAttemptPlan next = make_producer_attempt_plan(in);
    std::lock_guard<std::mutex> lk(mu);
    plan = std::move(next);
    pacer.begin_attempt();  // this attempt's waves (with the plan, under one lock)
  }

  // One attempt at sync v with the current routes. Sets *restarted when a consumer asked
  // for a failover restart.
  Status attempt(uint64_t v, bool* restarted) {
    const ProducerRoute& route = routes.producers[static_cast<size_t>(rank)];
    const uint64_t hash = routes_hash;
    auto check_restart = [&] {
      std::lock_guard<std::mutex> lk(mu);
      return restart && restart_hash != hash;
    };
    plan_attempt(v);
    for (int g = 0; g < routes.num_groups(); ++g) {
      const ProducerGroup& grp = route.groups[static_cast<size_t>(g)];
      std::vector<int> targets;  // the plan's, less those dropped or done since
      {
        std::lock_guard<std::mutex> lk(mu);
        for (int c : plan.groups[static_cast<size_t>(g)].targets) {
          if (live[static_cast<size_t>(c)] && !(done.count(c) && done[c] == v)) targets.push_back(c);
        }
      }
      if (targets.empty()) continue;
      // By place in this producer's pack order (rotated: its groups need not be consecutive).
      const int at = pacer.pack_position(g);
      const size_t s = static_cast<size_t>(at % staging->slots());
      auto tw = Clock::now();
      FERRY_RETURN_IF_ERROR(wait_slot(s, true));
      trace.record(TracePhase::kWait, g, -1, tw, Clock::now());
      if (check_restart()) {
        *restarted = true;
        return Status::Ok();
      }
      if (opts.test_hooks && opts.test_hooks->before_materialize) opts.test_hooks->before_materialize(v, g);
      auto tm = Clock::now();
      auto boxes = source.materialize(g);
      trace.record(TracePhase::kMaterialize, g, -1, tm, Clock::now());
      if (!boxes.ok()) return boxes.status().with_context(fmt::format("producer {} materialize group {}", rank, g));
      auto tp = Clock::now();
      auto packed = staging->pack(schedule, g, s, *boxes);
      if (!packed.ok()) return packed.status();
      for (const QuantOp& q : grp.quants) report.quantized_bytes += q.bytes();
      std::map<uint32_t, uint64_t> sums = std::move(*packed);
      DeltaPack dp = delta->pack(g, s, v, grp);
      {
        std::lock_guard<std::mutex> lk(mu);
        report.delta_elements += dp.compared;
        report.delta_changed += dp.changed;
      }
      if (opts.test_hooks && opts.test_hooks->corrupt_group == g && opts.test_hooks->corrupt_version == v &&
          !grp.segments.empty() && grp.segments[0].bytes) {
        // Delta: a patched segment's last byte (a value: the patch's structure stays valid
        // and only its content hash can tell); otherwise its first byte.
        const std::optional<uint64_t> pb = dp.bytes_for(grp.segments[0].plan);
        std::byte* host = staging->slot(0).data();  // the host ring's start (slots, then the kept area)
        host[(pb ? dp.patch_offset + *pb - 1 : staging->slot_offset(s)) + grp.segments[0].offset] ^= std::byte{0x40};
      }
      trace.record(TracePhase::kPack, g, -1, tp, Clock::now());
      struct PushTo {
        int consumer;
        uint32_t recv_slot;
        uint8_t landing;
      };
      std::vector<PushTo> to_push;
      struct AnnounceTo {
        int consumer;
        PeerId id;
        Announce m;
      };
      std::vector<AnnounceTo> to_announce;
      std::vector<Serve> todo;  // paced: turns at earlier slots that came meanwhile
      {
        std::lock_guard<std::mutex> lk(mu);
        Slot& sl = slots[s];
        sl = Slot{};
        sl.group = g;
        sl.hash = hash;
        sl.packed = true;
        sl.since = Clock::now();
        sl.checksum = sums;
        sl.patches = std::move(dp);
        for (int c : targets) {
          if (!live[static_cast<size_t>(c)] || (done.count(c) && done[c] == v)) continue;
          if (auto it = consumer_hash.find(c);
              it != consumer_hash.end() && it->second != hash && !abandoned_hashes.count(it->second)) {
            sl.skipped.insert(c);
            continue;
          }
          sl.pending.insert(c);
          if (!pacer.turn(c, g)) continue;  // served when its wave opens
          sl.opened[c] = sl.since;
          if (opts.mode == SyncMode::kPull) {
            to_announce.push_back(AnnounceTo{c, peers[c].id, announce_locked(sl, c, s)});
          } else if (auto it = ready.find({v, g, c}); it != ready.end() &&
                                                      it->second.from == peers[c].id &&
                                                      it->second.hash == hash) {
            to_push.push_back(PushTo{c, it->second.slot, it->second.landing});
          }
        }
        todo = open_waves_locked();
      }
      const auto ta = Clock::now();
      for (const AnnounceTo& a : to_announce) {
        if (Status sent = send(a.id, a.m); !sent.ok()) {
          std::lock_guard<std::mutex> lk(mu);
          drop_locked(a.consumer, "announce failed: " + sent.to_string(), nullptr);
        }
      }
      if (!to_announce.empty()) trace.record(TracePhase::kAnnounce, g, -1, ta, Clock::now());
      serve(todo);
      {
        std::lock_guard<std::mutex> lk(mu);
        if (!local_failure.ok()) return local_failure;
      }
      for (const PushTo& t : to_push) start_push(static_cast<int>(s), t.consumer, t.recv_slot, t.landing, g, v);
    }
    auto tw = Clock::now();
    std::vector<size_t> by_group(slots.size());  // oldest group first (rotated: its reads open the later ones)
    for (size_t s = 0; s < slots.size(); ++s) by_group[s] = s;
    {
      std::lock_guard<std::mutex> lk(mu);
      std::stable_sort(by_group.begin(), by_group.end(), [&](size_t a, size_t b) { return slots[a].group < slots[b].group; });
    }
    for (size_t s : by_group) FERRY_RETURN_IF_ERROR(wait_slot(s, true));
    trace.record(TracePhase::kWait, -1, -1, tw, Clock::now());
    if (check_restart()) *restarted = true;
    return Status::Ok();
  }

  Result<SyncReport> sync(uint64_t v) {
    const auto t0 = Clock::now();
    struct Returned {  // previous_sync, whatever the outcome
      Impl& self;
      uint64_t v;
      ~Returned() {
        std::lock_guard<std::mutex> lk(self.mu);
        self.previous_sync = std::make_pair(v, Clock::now());
      }
    } returned{*this, v};
    {
      std::lock_guard<std::mutex> lk(mu);
      // The same version again: the consumers' DONEs of the previous sync are not this
      // one's (before, every consumer counted as done at once: the sync reported ok
      // with 0 bytes sent, and the consumers timed out waiting for announcements).
      if (previous_sync && previous_sync->first == v) {
        for (auto it = done.begin(); it != done.end();) {
          const auto at = done_at.find(it->first);
          const bool old = it->second == v && (at == done_at.end() || at->second <= previous_sync->second);
          it = old ? done.erase(it) : std::next(it);
        }
      }
      report = SyncReport{};
      report.version = v;
      delta->begin_sync();
      trace.begin(t0);
      restart = false;
      local_failure = Status::Ok();
      consumer_hash.clear();
      consumer_joined.clear();
      abandoned_hashes.clear();
      consumer_progress.clear();
      for (auto it = ready.begin(); it != ready.end();) it = std::get<0>(it->first) < v ? ready.erase(it) : std::next(it);
      for (auto& s : slots) s = Slot{};
    }
    FERRY_RETURN_IF_ERROR(check_claim(*claim, store, Participant{"producer", rank}, instance));
    bool store_lost_keys = false;
    {
      auto again = republish(store, published);
      if (!again.ok()) return again.status().with_context(fmt::format("producer {} sync {}", rank, v));
      store_lost_keys = *again > 0;
      if (*again > 0)
        report.failures.push_back(fmt::format("producer {}: the store {} had lost its rendezvous keys (restarted?); "
                                              "re-published {}", rank, store.url(), *again));
    }
    FERRY_RETURN_IF_ERROR(refresh_routes().with_context(fmt::format("producer {} sync {}", rank, v)));
    refresh_membership(v, store_lost_keys);
    {
      std::lock_guard<std::mutex> lk(mu);
      for (int c = 0; c < opts.num_consumers; ++c) {
        const Peer& p = peers[c];
        if (static_cast<size_t>(c) < live.size() && live[static_cast<size_t>(c)] && p.committed)
          report.consumers_live[c] = *p.committed;
      }
    }
    std::vector<std::pair<PeerId, Dropped>> early_mismatch;  // sent once mu is released
    {
      // FAILOVERs / ABORTs of v that came before this point were kept aside (not yet in
      // the sync); apply them in the same step that makes later ones current, so that
      // none falls in between and is lost (a consumer would then wait on routes this
      // producer never serves, and it on releases that never come).
      std::lock_guard<std::mutex> lk(mu);
      version = v;
      in_sync = true;
      undeclared_hash.reset();
      if (route_state.dead().empty()) undeclared_hash = routes_hash;
      for (const auto& [c, vh] : early_failover) {
        if (vh.first != v) continue;
        consumer_hash[c] = vh.second;
        consumer_joined[c] = Clock::now();
        if (vh.second != routes_hash) {
          restart = true;
          restart_hash = vh.second;
        }
      }
      early_failover.clear();
      // Consumers that entered v (JOIN, or asked for a group of it) before this producer
      // did: their clocks start with this producer's sync.
      for (const auto& [c, ev] : early_join) {
        if (ev == v) consumer_progress[c] = Clock::now();
      }
      early_join.clear();
      for (const auto& [key, r] : ready) {
        if (std::get<0>(key) == v) consumer_progress[std::get<2>(key)] = Clock::now();
      }
      for (const auto& [c, ev] : early_abort) {
        if (ev == v) {
          drop_locked(c, "it aborted the sync", nullptr);
        } else if (ev > v && !(done.count(c) && done[c] == v)) {
          // It gave up a later version before this sync began: it is not in this sync (a
          // version mismatch), as on_message judges an ABORT that comes during it. Kept as
          // a member, it never enters, and the others waited for it the whole join window.
          drop_locked(c, fmt::format("it synced version {}, not this sync's {}", ev, v), nullptr);
        }
      }
      early_abort.clear();
      // A READY for a later version that came before this sync began is the same caller's
      // mismatch as one that comes during it (on_message): that consumer syncs another
      // version than ours and would otherwise wait for pushes of its version to its own
      // timeout, while this producer waits for it to the stall timeout.
      for (const auto& [key, rf] : ready) {
        const auto& [rv, g, c] = key;
        if (rv <= v || c < 0 || static_cast<size_t>(c) >= live.size() || !live[static_cast<size_t>(c)]) continue;
        if (!peers.made_for(rf.from, c) || (done.count(c) && done[c] == v)) continue;
        const std::string why = fmt::format("it syncs version {} but this producer serves version {}", rv, v);
        drop_locked(c, why, nullptr);
        early_mismatch.emplace_back(rf.from, Dropped{static_cast<uint32_t>(rank), rv, routes_hash, why});
      }
    }
    for (const auto& [to, d] : early_mismatch) send(to, d).ignore();
    Status failure;
    for (int tries = 0;; ++tries) {
      bool restarted = false;
      if (!route_state.dead().empty()) send_routes_notice(v);
      failure = attempt(v, &restarted);
      if (failure.ok() && !restarted) {
        // Stay in the sync until every live consumer committed it (DONE), so that a
        // consumer that fails over late still finds this producer; bounded by the stall
        // timeout (a slow consumer is not dropped for it).
        std::unique_lock<std::mutex> lk(mu);
        const auto tc = Clock::now();
        const auto deadline = Clock::now() + opts.stall_timeout;
        auto all_done = [&] {
          for (int c = 0; c < opts.num_consumers; ++c) {
            if (live[static_cast<size_t>(c)] && !(done.count(c) && done[c] == v)) return false;
          }
          return true;
        };
        while (!all_done() && !(restart && restart_hash != routes_hash) && local_failure.ok()) {
          if (own_transport_dead(lk)) continue;  // (ends the wait)
          if (cv.wait_until(lk, std::min(deadline, Clock::now() + health_probe_every(opts.lease_ttl))) ==
                  std::cv_status::timeout &&
              Clock::now() >= deadline)
            break;
        }
        if (!local_failure.ok()) failure = local_failure;
        restarted = restart && restart_hash != routes_hash;
        trace.record(TracePhase::kCommit, -1, -1, tc, Clock::now());
      }
      if (!failure.ok() || !restarted) break;
      trace.new_attempt(true);
      if (tries > opts.num_producers) {
        failure = internal_error("producer {}: sync {} restarted {} times", rank, v, tries);
        break;
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        abandoned_hashes.insert(routes_hash);
      }
      failure = refresh_routes().with_context(fmt::format("producer {} failover in sync {}", rank, v));
      if (!failure.ok()) break;
      {
        std::lock_guard<std::mutex> lk(mu);
        abandoned_hashes.erase(routes_hash);  // (the store still had the same routes)
        if (restart_hash == routes_hash) restart = false;
      }
      std::lock_guard<std::mutex> lk(mu);
      report.failures.push_back(fmt::format("producer {}: failover, routes rebuilt without producer(s) {}", rank,
                                            rank_list(route_state.dead())));
    }
    // Leave no slot pending (a failed attempt may have left some).
    for (size_t s = 0; s < slots.size(); ++s) wait_slot(s, false).ignore();
    // Consumers failed this producer over while it was alive (cut off, or paused, with
    // its lease gone) and it still finished the sync (on the routes without it): take
    // the mark off, so that it serves again from the next sync on, as a restarted
    // producer does. Not after a failed sync: a producer that lost its transport
    // (crashed, or cut off for good) would otherwise take its mark off while the others
    // are still failing it over, and their next route rebuild would bring it back
    // mid-sync (seen in CI: "sync 2 restarted 5 times"); it rejoins after a sync it
    // finishes, or when it restarts (create clears the mark).
    if (auto marked = opts.failover && failure.ok() ? route_state.read_dead() : Result<std::set<int>>(std::set<int>{});
        marked.ok() && marked->count(rank)) {
      Status cleared = store.remove(keys.dead(rank)).status();
      std::lock_guard<std::mutex> lk(mu);
      report.failures.push_back(
          cleared.ok() ? fmt::format("producer {}: failed over by consumers in sync {} while alive; rejoins at the "
                                     "next sync", rank, v)
                       : fmt::format("producer {}: failed over in sync {} while alive; clearing its mark {}: {}", rank,
                                     v, keys.dead(rank), cleared.to_string()));
    }
    std::lock_guard<std::mutex> lk(mu);
    in_sync = false;
    if (failure.ok()) note_missed_locked(v);
    report.seconds = seconds_since(t0);
    report.status = failure;
    report.memory = memory_use();
    report.trace = trace.take();
    report.start_unix_ns = trace.start_unix_ns();
    derive_report_sums(report);
    if (!failure.ok()) return failure;
    return report;
  }
};

Producer::Producer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Producer::~Producer() = default;
const Routes& Producer::routes() const { return impl_->routes; }
int Producer::rank() const { return impl_->rank; }
Result<SyncReport> Producer::sync(uint64_t version) { return impl_->sync(version); }
const SyncReport& Producer::last_report() const { return impl_->report; }

Result<std::unique_ptr<Producer>> Producer::create(WeightSource& source, Transport& transport, Store& store,
                                                   const ProducerOptions& options) {
  auto impl = std::make_unique<Impl>(source, transport, store, options);
  Impl& m = *impl;
  m.rank = source.rank();
  const Participant me{"producer", m.rank};
  bool was_dead = false;  // it took its own dead mark off
  Status joined = [&]() -> Status {
    if (m.rank < 0 || m.rank >= options.num_producers)
      return invalid_argument("producer rank {} outside num_producers {}", m.rank, options.num_producers);
    FERRY_ASSIGN_OR_RETURN(m.claim, claim_rank(store, m.keys, options, me, m.instance));
    FERRY_RETURN_IF_ERROR(StagingRing::check_device(m.rank, options.staging_device));  // before any rendezvous
    FERRY_RETURN_IF_ERROR(publish_world(store, m.keys, options, me));
    FERRY_ASSIGN_OR_RETURN(m.holdings, source.holdings(m.rank));
    const std::string meta = encode_decls(source.metadata());
    if (m.rank == 0) m.published.emplace_back(m.keys.meta(), meta);
    m.published.emplace_back(m.keys.holdings(m.rank), encode_holdings(m.holdings));
    for (const auto& [key, value] : m.published) FERRY_RETURN_IF_ERROR(store.set(key, value));
    // A restarted producer is alive again: take it out of the dead set (put back below
    // if this create fails: the store must never say alive a producer with no lease).
    if (options.failover) {
      was_dead = store.get(m.keys.dead(m.rank)).ok();
      store.remove(m.keys.dead(m.rank)).status().ignore();
    }
    FERRY_ASSIGN_OR_RETURN(auto inputs, rendezvous_inputs(store, m.keys, options, me, source.metadata()));
    FERRY_ASSIGN_OR_RETURN(auto routes, m.route_state.start(std::move(inputs)));
    {
      // Within staging_budget: worst-case slots when it holds them, else as large as it
      // allows (memory.h, staging_ring).
      const uint64_t worst = producer_slot_bytes(routes, m.rank, m.route_state.inputs().metadata,
                                                 m.route_state.inputs().holdings, options.failover);
      const uint64_t needed = producer_slot_bytes(routes, m.rank, {}, false);
      FERRY_ASSIGN_OR_RETURN(StagingSlots sr, staging_ring(m.rank, needed, worst, options.staging_budget));
      // Delta: nothing served in place (every byte is packed, so that it can be patched),
      // and the kept copy after the slots.
      StagingRingOptions so{m.rank,
                            sr.slot_bytes,
                            sr.slots,
                            options.staging_device,
                            options.delta ? std::vector<MemoryRegion>{} : options.source_regions,
                            options.direct_min_bytes,
                            options.checksums,
                            delta_kept_bytes(options, routes.producers[static_cast<size_t>(m.rank)], sr)};
      FERRY_ASSIGN_OR_RETURN(m.staging, StagingRing::create(m.ring_memory, source, m.holdings, so));
    }
    m.delta = std::make_unique<DeltaEncoder>(*m.staging, options);
    FERRY_RETURN_IF_ERROR(m.apply_routes(std::move(routes)));
    m.slots.resize(static_cast<size_t>(m.staging->slots()));
    m.peers.resize(options.num_consumers);
    m.live.assign(static_cast<size_t>(options.num_consumers), false);
    Impl* self = impl.get();
    transport.set_message_handler([self](PeerId from, uint32_t tag, std::span<const std::byte> payload) {
      if (tag == kEngineTag) self->on_message(from, payload);
    });
    transport.set_peer_failure_handler([self](PeerId peer, const Status& why) { self->on_peer_failure(peer, why); });
    const std::string blob =
        encode_lease(ProducerLease{bytes_to_string(transport.address()), m.staging->host_key(), m.staging->slot_bytes(),
                                   m.staging->in_place().encode(), m.staging->cuda_ipc()});
    FERRY_ASSIGN_OR_RETURN(m.lease, store.hold_lease(m.keys.producer(m.rank), blob, options.lease_ttl));
    // Return only once every consumer can receive (its lease is published last, after its
    // ring and handlers are up): a sync() called right away then reaches all of them
    // instead of finding none and reporting nothing moved.
    std::vector<std::string> consumer_keys;
    for (int c = 0; c < options.num_consumers; ++c) consumer_keys.push_back(m.keys.consumer(c));
    FERRY_RETURN_IF_ERROR(await_keys(store, m.keys, options, me, consumer_keys, "every consumer's lease"));
    return Status::Ok();
  }();
  // Failed after taking its dead mark off (a staging ring out of GPU memory, a budget too
  // small): it is not alive, so the mark goes back, and consumers keep routing around it
  // instead of waiting for a lease that never comes.
  if (!joined.ok() && was_dead) store.set(m.keys.dead(m.rank), "1").ignore();
  // Failed: why, for the other ranks (not when it is not this rank's own).
  publish_failure(store, m.keys, options, me, m.instance, joined);
  FERRY_RETURN_IF_ERROR(joined);
  return std::unique_ptr<Producer>(new Producer(std::move(impl)));
}

}  // namespace ferry
