// Consumer: one per inference rank; the control plane of its syncs (membership, announcements,
// failover, versions). Bytes move by the data plane: the attempt's plan (sync_plan.h), its reads
// through the lanes (attempt_reads.h, lane.h, cuda_ipc.h), param_set.h, the unpack worker.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include <unistd.h>

#include "engine/attempt_reads.h"
#include "engine/clock.h"
#include "engine/sync_trace.h"
#include "engine/cuda_ipc.h"
#include "ferry/device.h"
#include "engine/in_place.h"
#include "engine/protocol.h"
#include "engine/rank_model.h"
#include "engine/registered_buffer.h"
#include "engine/rendezvous.h"
#include "engine/schedule.h"
#include "engine/sync_plan.h"
#include "engine/testing.h"
#include "engine/memory.h"
#include "engine/param_set.h"
#include "engine/unpack_worker.h"

namespace ferry {

using namespace engine;

struct Consumer::Impl {
  int rank = 0;
  Transport& transport;
  Store& store;
  ConsumerOptions opts;
  JobKeys keys;
  // What this rank loads into and how it post-processes (engine/rank_model.h; set by the
  // two create()s, then fixed).
  RankModel model;
  RouteState route_state;  // rendezvous inputs; producers excluded from `routes`
  Routes routes;
  uint64_t routes_hash = 0;
  const PlanRoute* plan_route = nullptr;  // this rank's plan class in `routes`
  int failed_p = -1;    // the producer whose failure ended the last attempt
  // Where bytes land (engine/param_set.h): the param buffers, their registrations and
  // placements, the committed view and what the params hold. Set by start().
  std::unique_ptr<ParamSet> param_set;
  static constexpr int kSlots = static_cast<int>(kReceiveSlots);
  uint64_t slot_bytes = 0;
  RegisteredBuffer ring;
  // The lanes (engine/lane.h): the transport's (reads into the receive ring and params),
  // and CUDA IPC (ConsumerOptions::cuda_ipc) to producers' GPU staging on this host
  // (engine/cuda_ipc.h; null: params not all on one GPU, push, or checksums). Each
  // attempt's plan (engine/sync_plan.h) says which one moves each transfer; ipc_active
  // mirrors plan.cuda_ipc for the background thread (set by the sync thread while that
  // thread is idle, read by it when unpacking: from which ring).
  std::unique_ptr<TransportLane> lane;
  std::unique_ptr<CudaIpcLane> ipc_lane;
  ConsumerAttemptPlan plan;
  std::atomic<bool> ipc_active{false};
  // Per layer group of `routes`: what to read from whom into where (the slot, or a
  // param directly: zero copy, engine/schedule.h), what to unpack, which
  // post-processing groups complete. Rebuilt when routes change or a producer's in-place
  // table does (schedule_stale).
  ConsumerSchedule schedule;
  bool schedule_stale = true;
  std::unique_ptr<Lease> lease;
  Published published;  // its plan, put back if the store lost it (republish)

  // A producer as its lease describes it (its staging and source regions are imported
  // into `lane`, its GPU staging into `ipc_lane`).
  struct Peer {
    std::string blob;
    PeerId id = 0;
    bool connected = false;
    InPlaceTable in_place;     // boxes it serves from the trainer's memory
    size_t regions = 0;        // of its source regions (in_place.keys), how many are imported
  };

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Peer> peers;
  std::map<PeerId, int> peer_rank;
  std::map<int, Status> failed;                             // producer -> why
  // An Announce (pull), Pushed (push) or RoutesNotice (group -1) as the sync loop takes it.
  struct Arrival {
    PeerId from = 0;          // sender instance
    uint64_t routes = 0;      // the routes the sender runs (laid the bytes out by)
    uint64_t slot_offset = 0; // Announce: the group's offset in the producer's staging ring
    std::optional<uint64_t> checksum;
  };
  // (version, group, producer) -> arrival. Kept even from instances not connected yet (a
  // restarted producer may announce before we re-read its lease); checked against the
  // connected instance when taken.
  std::map<std::tuple<uint64_t, int, int>, Arrival> inbox;
  std::set<uint64_t> old_hashes;  // routes abandoned during the current sync
  bool switch_routes = false;     // a producer announced other routes for this sync
  bool declare = false;           // tell producers our routes once connected (sync began on failed-over routes)
  // Push: producers sent READY this sync (they may have writes into our receive ring in
  // flight), and the FLUSHED answers to our FAILOVERs: producer -> (version, routes). mu.
  std::set<int> readied;
  std::map<int, std::pair<uint64_t, uint64_t>> flushed_from;
  // Push: per producer, READYs of this sync not answered by PUSHED yet: its writes of
  // those groups may be in flight (sync thread only).
  std::map<int, int> unanswered;
  std::map<uint64_t, std::string> dropped_versions;  // version -> which producer dropped us and why
  std::atomic<bool> crashed{false};  // simulate_crash (test hook)
  std::optional<uint64_t> syncing;  // the version of the sync in progress; mu
  std::set<uint64_t> attempted;     // versions this instance began syncs of (the last 64); mu
  // Producers that announced, during this sync, an older version this instance never
  // synced (so not a late message): producer -> that version. mu.
  std::map<int, uint64_t> behind;
  std::set<uint64_t> mismatched;  // versions producers served when ours differed (the last 64); mu
  SyncTrace trace;        // this sync's events (the unpack worker records too); rep's sums come from it
  SyncReport last;        // last_report(): the last sync's report, failed or not
  // The unpack + post-processing thread (unpack_worker.h). Last: destroyed first.
  std::unique_ptr<UnpackWorker> worker;

  Impl(int r, Transport& t, Store& s, const ConsumerOptions& opt)
      : rank(r), transport(t), store(s), opts(opt), keys(opt.job), route_state(s, JobKeys(opt.job), opt.failover) {}

  ~Impl() {
    worker.reset();  // stops after its current job
    transport.set_message_handler({});
    transport.set_peer_failure_handler({});
    if (lease) lease->release().ignore();
  }

  void point(int g, int phase) {
    if (opts.test_hooks && opts.test_hooks->consumer_point) opts.test_hooks->consumer_point(g, phase);
  }

  void on_message(PeerId from, std::span<const std::byte> payload) {
    auto decoded = decode_message(payload);
    if (!decoded.ok()) return;
    const Message& msg = *decoded;
    std::lock_guard<std::mutex> lk(mu);
    const int p = static_cast<int>(sender_of(msg));
    if (p < 0 || p >= opts.num_producers) return;
    auto it = peer_rank.find(from);
    const bool known = it != peer_rank.end() && it->second == p;
    const uint64_t mv = version_of(msg);
    auto keep = [&](int group, const Arrival& a) {
      if (syncing && mv != *syncing && (attempted.count(mv) || mismatched.count(mv)))
        return false;  // of a sync this instance already ran or gave up: stale
      if (syncing && mv < *syncing) {  // the producer is behind
        if (known) {
          behind[p] = mv;
          cv.notify_all();
        }
        return false;
      }
      // Bounded by what producers can legitimately have outstanding (two versions of
      // every group each), whoever sends: the sender is verified only when taken.
      const size_t bound = 4 * (static_cast<size_t>(routes.num_groups()) + 1) * static_cast<size_t>(opts.num_producers);
      if (inbox.size() >= bound && !inbox.count({mv, group, p})) return false;
      inbox[{mv, group, p}] = a;
      return true;
    };
    if (const auto* m = std::get_if<Announce>(&msg)) {
      if (!keep(m->group, Arrival{from, m->routes, m->slot_offset, m->checksum})) return;
    } else if (const auto* m = std::get_if<Pushed>(&msg)) {
      if (!keep(m->group, Arrival{from, m->routes, 0, m->checksum})) return;
    } else if (const auto* m = std::get_if<RoutesNotice>(&msg)) {
      // Kept under group -1 (never awaited): await_any sees its routes and switches.
      if (!keep(-1, Arrival{from, m->routes, 0, std::nullopt})) return;
    } else if (const auto* m = std::get_if<Flushed>(&msg)) {
      if (!known) return;
      flushed_from[p] = {m->version, m->routes};
    } else if (const auto* m = std::get_if<Dropped>(&msg)) {
      if (!known) return;
      dropped_versions.emplace(m->version, fmt::format("producer {}: {}", p, m->reason));
    } else {
      return;
    }
    cv.notify_all();
  }

  void on_peer_failure(PeerId peer, const Status& why) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = peer_rank.find(peer);
    if (it == peer_rank.end()) return;
    Peer& p = peers[static_cast<size_t>(it->second)];
    if (p.id != peer) return;
    p.connected = false;
    failed[it->second] = why;
    if (ipc_lane) ipc_lane->disconnect(it->second);
    cv.notify_all();
  }

  // The worker's job steps (on its thread).
  Status unpack_job(const UnpackWorker::Job& job) {
    point(job.group, 3);
    const uint64_t n = plan_route->groups[static_cast<size_t>(job.group)].recv_bytes;
    const std::byte* recv = ipc_active ? ipc_lane->ring() : ring.data;
    Status s = unpack_group(schedule.unpack, job.group,
                            std::span<const std::byte>(recv + static_cast<uint64_t>(job.slot) * slot_bytes, n),
                            param_set->loaded());
    param_set->touch();  // (even a failed unpack may have written some params)
    if (!s.ok()) return s.with_context(fmt::format("consumer {} unpack group {}", rank, job.group));
    return s;
  }
  Status post_job(const UnpackWorker::Job& job) {
    for (int k : schedule.groups[static_cast<size_t>(job.group)].post_groups) {
      Status s = model.post_process(k, param_set->work());
      if (!s.ok())
        return s.with_context(fmt::format("consumer {} post-processing {}", rank, model.post_group_names[static_cast<size_t>(k)]));
    }
    return Status::Ok();
  }
  void wake() {
    std::lock_guard<std::mutex> lk(mu);
    cv.notify_all();
  }
  std::string who() const { return fmt::format("consumer {}", rank); }

  Status refresh_producers() {
    for (int p = 0; p < opts.num_producers; ++p) {
      if (route_state.dead().count(p)) continue;  // failed over: not read from
      auto blob = store.get(keys.producer(p));
      if (!blob.ok()) {
        if (blob.status().code() != StatusCode::kNotFound) return blob.status();
        // Its lease lapsed: it may only be paused (its lease heals when it resumes), so
        // keep reading from the instance we are connected to — a dead one is reported by
        // the transport and failed over.
        {
          std::lock_guard<std::mutex> lk(mu);
          const Peer& pe = peers[static_cast<size_t>(p)];
          if (pe.connected && !failed.count(p)) continue;
        }
        // One we never reached: its lease may be healing (it resumed from a pause, or
        // the store restarted or paused and every lease lapsed), which takes at most
        // ttl/3 once it runs. Give it one lease_ttl before it is a failover candidate,
        // so that a live producer is not marked dead for good.
        heal_leases(
            opts.lease_ttl, [&] { return !blob.ok() && blob.status().code() == StatusCode::kNotFound; },
            [&] { blob = store.get(keys.producer(p)); });
        if (!blob.ok()) {
          if (blob.status().code() != StatusCode::kNotFound) return blob.status();
          failed_p = p;
          return unavailable("producer {} is not registered (no live lease {} within lease_ttl {} ms)", p,
                             keys.producer(p), opts.lease_ttl.count());
        }
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        const Peer& pe = peers[static_cast<size_t>(p)];
        if (pe.connected && pe.blob == *blob) continue;
      }
      auto lease = decode_producer_lease(*blob);
      if (!lease.ok()) return lease.status().with_context(fmt::format("lease of producer {}", p));
      auto table = InPlaceTable::decode(lease->in_place, route_state.inputs().holdings[static_cast<size_t>(p)].boxes.size());
      if (!table.ok()) return table.status().with_context(fmt::format("in-place table of producer {}", p));
      auto id = transport.connect(string_bytes(lease->address));
      if (!id.ok()) {
        failed_p = p;  // a candidate for failover
        return id.status().with_context(fmt::format("connecting to producer {}", p));
      }
      // Its staging (and, pulling, its source regions) for the transport lane; its GPU
      // staging, mapped for device-to-device copies when we can take them.
      static const std::vector<std::string> kNone;
      auto imported = lane->import(p, lease->staging_key, opts.mode == SyncMode::kPull ? table->keys : kNone);
      if (!imported.ok()) {
        failed_p = p;
        return imported.status();
      }
      if (ipc_lane) ipc_lane->connect(p, lease->cuda_ipc);
      std::lock_guard<std::mutex> lk(mu);
      Peer& pe = peers[static_cast<size_t>(p)];
      pe.blob = *blob;
      pe.id = *id;
      pe.connected = true;
      pe.in_place = opts.mode == SyncMode::kPull ? std::move(*table) : InPlaceTable{};
      pe.regions = *imported;
      schedule_stale = true;
      peer_rank[*id] = p;
      failed.erase(p);
    }
    return Status::Ok();
  }

  // A producer we wait for serves another version than this sync's: the trainer and this
  // inference rank disagree (a caller bug or a rollback on one side only). Fails at once
  // rather than at the timeout. Older versions are those this instance never synced
  // (an announcement of a version it did sync may just be late). mu held.
  Status version_mismatch_locked(uint64_t v, const std::set<int>& from) {
    auto mismatch = [&](int p, uint64_t mv) {
      mismatched.insert(mv);
      if (mismatched.size() > 64) mismatched.erase(mismatched.begin());
      return failed_precondition(
          "consumer {} syncs version {} but producer {} serves version {}: every rank of the job must sync the "
          "same version",
          rank, v, p, mv);
    };
    for (const auto& [p, mv] : behind) {
      if (from.count(p)) return mismatch(p, mv);
    }
    for (const auto& [key, e] : inbox) {
      const auto& [mv, g, p] = key;
      if (mv > v && from.count(p) && e.from == peers[static_cast<size_t>(p)].id) return mismatch(p, mv);
    }
    return Status::Ok();
  }

  // Sends m to producer p; the completion, when the send was posted (it completes once
  // the message has left: delivered to the peer, for inproc).
  std::optional<Completion> send_to(int p, const Message& m) {
    PeerId id;
    {
      std::lock_guard<std::mutex> lk(mu);
      id = peers[static_cast<size_t>(p)].id;
    }
    auto c = transport.send(id, kEngineTag, encode_message(m));
    if (!c.ok()) return std::nullopt;
    return *c;
  }
  uint32_t me() const { return static_cast<uint32_t>(rank); }

  // Waits for the message (v, g, p) from any producer p in `from`; fails when one of
  // them failed, when we were dropped, or after `timeout`.
  // `none` (polling): return at once with *none = true when nothing is there yet.
  Result<std::pair<int, Arrival>> await_any(uint64_t v, int g, const std::set<int>& from, const char* what,
                                            bool* none = nullptr) {
    std::unique_lock<std::mutex> lk(mu);
    const auto deadline = Clock::now() + opts.timeout;
    // Checked each lease_ttl of silence: producers whose lease was gone at the last check
    // too (lost_producer).
    auto next_check = Clock::now() + opts.lease_ttl;
    std::set<int> lapsed;
    for (;;) {
      for (int p : from) {
        auto it = inbox.find({v, g, p});
        // A message of another attempt (other routes) stays: it may be the next one's.
        if (it == inbox.end() || it->second.routes != routes_hash) continue;
        if (it->second.from != peers[static_cast<size_t>(p)].id) continue;  // not the connected instance
        Arrival a = it->second;
        inbox.erase(it);
        return std::make_pair(p, a);
      }
      // A producer restarted this sync with other routes (failover another consumer
      // started): follow it.
      for (const auto& [key, e] : inbox) {
        if (std::get<0>(key) == v && e.routes != routes_hash && !old_hashes.count(e.routes)) {
          switch_routes = true;
          return unavailable("consumer {}: producer {} switched routes for sync {}", rank, std::get<2>(key), v);
        }
      }
      for (int p : from) {
        if (auto it = failed.find(p); it != failed.end()) {
          failed_p = p;
          return peer_failed("producer {} failed during sync {} (group {}): {}", p, v, g, it->second.to_string());
        }
      }
      if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
      if (auto d = dropped_versions.find(v); d != dropped_versions.end())
        return cancelled("consumer {} was dropped from sync {} by {}", rank, v, d->second);
      if (Status m = version_mismatch_locked(v, from); !m.ok()) return m;
      if (Status w = worker->status(); !w.ok()) return w;
      if (none) {
        *none = true;
        return timeout_error("consumer {}: no {} yet", rank, what);
      }
      const bool watch = opts.failover && opts.lease_ttl.count() > 0;
      if (cv.wait_until(lk, watch ? std::min(deadline, next_check) : deadline) == std::cv_status::timeout &&
          watch && Clock::now() >= next_check && Clock::now() < deadline) {
        lk.unlock();
        const int lost = lost_producer(from, lapsed);
        lk.lock();
        next_check = Clock::now() + opts.lease_ttl;
        if (lost >= 0) {
          failed_p = lost;
          return peer_failed("producer {} lost during sync {} (group {}): no {} and its lease {} gone for over "
                             "{} ms (cut off or paused)", lost, v, g, what, keys.producer(lost), opts.lease_ttl.count());
        }
        continue;
      }
      if (Clock::now() >= deadline) {
        std::string missing;
        for (int p : from) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
        return timeout_error("consumer {}: no {} from producer(s) {} for version {} group {} within {} ms", rank, what,
                             missing, v, g, opts.timeout.count());
      }
    }
  }

  // A producer of `from` that went silent and lost its lease (its heartbeat renews it
  // every ttl/3) at two checks a lease_ttl apart — so not a lease that a store restart
  // dropped and that is healing — and whose boxes the others hold: cut off or paused,
  // it cannot be told from dead by the transport, and waiting for it would get this
  // consumer dropped as a stalled reader by every other producer. It is failed over
  // (it rejoins at the next sync: Producer::sync clears its mark once alive). -1: none.
  // A store that cannot be reached tells nothing: no lease is judged then.
  int lost_producer(const std::set<int>& from, std::set<int>& lapsed) {
    for (int p : from) {
      if (route_state.dead().count(p)) continue;
      auto blob = store.get(keys.producer(p));
      if (blob.ok() || blob.status().code() != StatusCode::kNotFound) {
        lapsed.erase(p);
        continue;
      }
      if (!lapsed.insert(p).second) {
        std::set<int> d = route_state.dead();
        d.insert(p);
        if (route_state.routes_without(d).ok()) return p;
      }
    }
    return -1;
  }

  // wait_all for reads from producer p, bounded by timeout; kPeerFailed as soon as p is
  // lost (lost_producer): a host cut off mid-read stalls tcp, it does not fail it.
  Status wait_reads(std::span<const Completion> ops, int p, uint64_t v, int g) {
    const auto deadline = Clock::now() + opts.timeout;
    const bool watch = opts.failover && opts.lease_ttl.count() > 0;
    std::set<int> lapsed;
    for (;;) {
      const auto left = std::max(std::chrono::milliseconds(0),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      Status st = wait_all(ops, watch ? std::min(left, opts.lease_ttl) : left);
      if (st.code() != StatusCode::kTimeout || !watch || Clock::now() >= deadline) return st;
      if (lost_producer({p}, lapsed) == p)
        return peer_failed("producer {} lost during sync {} (group {}): reads pending and its lease {} gone for over "
                           "{} ms (cut off or paused)", p, v, g, keys.producer(p), opts.lease_ttl.count());
    }
  }

  Result<int> acquire_slot(int g) {
    auto s = worker->acquire(g % kSlots, opts.timeout, [this] { return crashed.load(); }, who());
    if (!s.ok() && s.status().code() == StatusCode::kCancelled && crashed)
      return cancelled("consumer {} crashed (test hook)", rank);
    return s;
  }

  // await_any for an announcement, working through the backlog while none is there.
  Result<std::pair<int, Arrival>> await_working(uint64_t v, int g, const std::set<int>& from, AttemptReads& reads) {
    while (!reads.backlog_empty()) {
      bool none = false;
      auto r = await_any(v, g, from, "announce", &none);
      if (!none) return r;
      FERRY_RETURN_IF_ERROR(posted(reads, reads.work_one()));
    }
    return await_any(v, g, from, "announce");
  }

  // A post's status; a failed one names its producer as the attempt's failure (failed_p).
  Status posted(const AttemptReads& reads, Status st) {
    if (!st.ok()) failed_p = reads.failed_producer();
    return st;
  }
  // Waits for producer p's reads; a failure is p's, in the consumer's words.
  Status waited(std::span<const Completion> ops, int p, uint64_t v, int g) {
    Status st = wait_reads(ops, p, v, g);
    if (st.ok()) return st;
    failed_p = p;
    return Status(st.code(), fmt::format("consumer {} reading group {} from producer {}: {}", rank, g, p, st.message()));
  }

  Status sync_groups(uint64_t v, SyncReport& rep) {
    FERRY_RETURN_IF_ERROR(refresh_producers());
    {
      std::lock_guard<std::mutex> lk(mu);  // the background thread is idle between attempts
      if (schedule_stale) rebuild_schedule();
      plan = make_consumer_attempt_plan(rank, schedule, ipc_lane.get());
      ipc_active = plan.cuda_ipc;
      for (std::string& note : plan.notes) rep.failures.push_back(std::move(note));
    }
    if (declare) {
      declare = false;
      declare_routes(v);
    }
    // Pull. In-place bytes are the trainer's weights of v from the start of the
    // producer's sync v until it ends (after our DONE). So once a producer announced
    // anything of v in this attempt (in_v), its in-place bytes that land in params are
    // read *ahead*, with no handshake, whenever the consumer would otherwise wait for an
    // announcement (a chunk at a time, so staging slots are still released promptly:
    // producers pack group g+2 only once every consumer released group g); in-place
    // bytes that land in the receive ring are read as soon as the group's slot is ours;
    // only staged bytes wait for the group's announcement. The reads themselves, and
    // draining them on an error return, are AttemptReads' (engine/attempt_reads.h).
    std::set<int> in_v;
    AttemptReads reads(plan, *lane, ipc_lane.get(), opts.timeout);
    for (int g = 0; g < routes.num_groups(); ++g) {
      const ConsumerGroupSchedule& gs = schedule.groups[static_cast<size_t>(g)];
      const ConsumerGroupPlan& gp = plan.groups[static_cast<size_t>(g)];
      const std::set<int> from(gp.from.begin(), gp.from.end());
      if (from.empty()) {
        worker->enqueue({v, g, -1});
        continue;
      }
      FERRY_ASSIGN_OR_RETURN(int s, acquire_slot(g));
      point(g, 0);
      const auto tg = Clock::now();
      const uint64_t base = static_cast<uint64_t>(s) * slot_bytes;
      std::map<int, Arrival> got;
      if (opts.mode == SyncMode::kPull) {
        // Staged bytes: read from each producer as soon as it announced, and release it
        // at once (before any in-place bytes are waited for), so that one slow producer
        // never holds another's staging slot and producers pack on while we copy.
        auto tr0 = Clock::now();
        for (int p : from) {
          if (in_v.count(p)) FERRY_RETURN_IF_ERROR(posted(reads, reads.post_to_slot(g, p, base)));
        }
        trace.record(TracePhase::kRead, g, -1, tr0, Clock::now());
        std::set<int> remaining = from;
        bool first = true;
        while (!remaining.empty()) {
          auto tw = Clock::now();
          FERRY_ASSIGN_OR_RETURN(auto pm, await_working(v, g, remaining, reads));
          trace.record(TracePhase::kWait, g, pm.first, tw, Clock::now());
          const int p = pm.first;
          got[p] = pm.second;
          remaining.erase(p);
          auto tr1 = Clock::now();
          std::vector<Completion> staged;
          FERRY_RETURN_IF_ERROR(posted(reads, reads.post_staged(g, p, got[p].slot_offset, base, staged)));
          if (first) {
            first = false;
            point(g, 1);
          }
          FERRY_RETURN_IF_ERROR(waited(staged, p, v, g));
          send_to(p, Release{me(), v, g, routes_hash});
          if (in_v.insert(p).second) {  // p is in sync v: its in-place bytes are the weights of v
            FERRY_RETURN_IF_ERROR(posted(reads, reads.post_to_slot(g, p, base)));
            reads.enter(p, g);
          }
          trace.record(TracePhase::kRead, g, p, tr1, Clock::now());
        }
        // This group's in-place bytes: post what is left of them, wait for all.
        auto tr2 = Clock::now();
        while (reads.backlog_through(g)) FERRY_RETURN_IF_ERROR(posted(reads, reads.work_one()));
        for (int p : from) FERRY_RETURN_IF_ERROR(waited(reads.take(g, p), p, v, g));
        trace.record(TracePhase::kRead, g, -1, tr2, Clock::now());
      } else {
        if (gs.direct) param_set->touch();  // producers write into params from here on: a failure now leaves us torn
        for (int p : from) {
          readied.insert(p);
          ++unanswered[p];
          send_to(p, Ready{me(), v, g, routes_hash, static_cast<uint32_t>(s)});
        }
        point(g, 1);
        auto tw = Clock::now();
        std::set<int> remaining = from;
        while (!remaining.empty()) {
          FERRY_ASSIGN_OR_RETURN(auto pm, await_any(v, g, remaining, "push"));
          got[pm.first] = pm.second;
          remaining.erase(pm.first);
          --unanswered[pm.first];  // PUSHED: its writes of (v, g) ended (flushed before it was sent)
        }
        trace.record(TracePhase::kWait, g, -1, tw, Clock::now());
      }
      record_receives(trace, g, gs, ipc_active, tg, Clock::now());
      std::map<int, uint64_t> sums;  // checksums (the producers' option), verified on the host
      for (int p : from)
        if (got[p].checksum) sums[p] = *got[p].checksum;
      FERRY_RETURN_IF_ERROR(verify_group(rank, g, routes.group_names[static_cast<size_t>(g)], gs, sums, ring.data + base,
                                         ipc_active ? ipc_lane->ring() + base : nullptr,
                                         plan_route->groups[static_cast<size_t>(g)].recv_bytes, *param_set));
      point(g, 2);
      worker->enqueue({v, g, s});
    }
    // Drain the background thread.
    Status drained = worker->drain(opts.timeout, who());
    if (drained.code() == StatusCode::kTimeout) return drained;
    if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
    return drained;
  }

  // Installs routes (only between attempts: the background thread is idle).
  Status apply_routes(Routes r) {
    const uint64_t needed = consumer_slot_bytes(r.consumer(static_cast<size_t>(rank)));
    if (needed > slot_bytes)
      return failed_precondition("consumer {}: a group needs {} receive bytes, the ring has {}", rank, needed, slot_bytes);
    std::lock_guard<std::mutex> lk(mu);
    routes = std::move(r);
    routes_hash = routes.hash();
    plan_route = &routes.consumer(static_cast<size_t>(rank));
    rebuild_schedule();
    return Status::Ok();
  }

  // This consumer's extra memory (MemoryUse) for the routes and schedule now installed.
  // Caller thread, between attempts (mu taken for the schedule and the peers' tables).
  MemoryUse memory_use() {
    MemoryUse m;
    m.receive_ring = ring.bytes;
    m.own_params = param_set->own_bytes();
    m.registered_in_place += param_set->registered_bytes();
    const RouteInputs& in = route_state.inputs();
    m.metadata = metadata_heap_bytes(routes, in.metadata, in.holdings, in.plans);
    std::lock_guard<std::mutex> lk(mu);
    m.metadata += schedule_heap_bytes(schedule);
    for (const Peer& pe : peers) m.metadata += pe.in_place.boxes.capacity() * sizeof(InPlaceTable::At);
    return m;
  }

  // The schedule of the current routes with the producers' current in-place tables
  // (only those whose source regions are imported). mu held.
  void rebuild_schedule() {
    ConsumerScheduleInputs in;
    in.routes = &routes;
    in.rank = rank;
    in.direct_min_bytes = opts.direct_min_bytes;
    in.params = &param_set->placements();
    in.holdings = &route_state.inputs().holdings;
    for (const Peer& pe : peers) {
      const bool usable = !pe.in_place.empty() && pe.regions == pe.in_place.keys.size();
      in.in_place.push_back(usable ? &pe.in_place : nullptr);
    }
    if (model.post_process) {
      in.post_group_of = model.post_group_of;
      in.num_post_groups = model.post_group_names.size();
    }
    schedule = make_consumer_schedule(in);
    schedule_stale = false;
  }

  Status refresh_routes() {
    return route_state.refresh([this](Routes r) { return apply_routes(std::move(r)); });
  }

  // Waits for the background thread to go idle, then resets it for a new attempt.
  void reset_background() {
    worker->reset(opts.timeout);
    param_set->retry();
  }

  // After producer failed_p failed: mark it dead and rebuild routes without it, if the
  // remaining producers hold everything. Then ask live producers to restart.
  Status failover(uint64_t v, const Status& why, SyncReport& rep) {
    std::set<int> d = route_state.dead();
    d.insert(failed_p);
    {
      std::lock_guard<std::mutex> lk(mu);
      for (const auto& [p, st] : failed) d.insert(p);
    }
    if (auto stored = route_state.read_dead(); stored.ok()) d.insert(stored->begin(), stored->end());
    auto r = route_state.routes_without(d);
    if (!r.ok())
      return Status(why.code(), fmt::format("{}; no failover: {}", why.message(), r.status().message()));
    FERRY_RETURN_IF_ERROR(route_state.mark_dead(d));
    reset_background();
    FERRY_RETURN_IF_ERROR(route_state.adopt(d, std::move(*r), [this](Routes x) { return apply_routes(std::move(x)); }));
    rep.failures.push_back(fmt::format("consumer {}: {}; failover: routes rebuilt without producer(s) {}", rank,
                                       why.to_string(), rank_list(d)));
    declare_routes(v);
    return Status::Ok();
  }

  // Tells every live producer which routes this consumer reads sync v with (FAILOVER): a
  // producer on other routes restarts the sync with these, and no producer keeps a slot
  // of routes this consumer does not read waiting for it. Needed also when this sync
  // began on failed-over routes (the dead set was already in the store): otherwise
  // producers still on the old routes wait for releases that never come while this
  // consumer waits for announcements of the new ones.
  void declare_routes(uint64_t v) {
    for (int p = 0; p < opts.num_producers; ++p) {
      bool ok;
      {
        std::lock_guard<std::mutex> lk(mu);
        ok = !route_state.dead().count(p) && peers[static_cast<size_t>(p)].connected && !failed.count(p);
      }
      if (ok) send_to(p, Failover{me(), v, routes_hash});
    }
  }

  // Push: waits until each producer of `from` answered with FLUSHED for (v, our routes)
  // (sent once none of its writes to us is in flight), has failed, or is dead; bounded
  // by `timeout`, after which `late(p)` says why. A crash (test hook) ends the wait:
  // with kCancelled when `cancel_on_crash`.
  template <typename Late>
  Status await_flushed(uint64_t v, const std::vector<int>& from, bool cancel_on_crash, Late late) {
    std::unique_lock<std::mutex> lk(mu);
    const auto deadline = Clock::now() + opts.timeout;
    for (int p : from) {
      while (!route_state.dead().count(p) && !failed.count(p) && peers[static_cast<size_t>(p)].connected) {
        auto it = flushed_from.find(p);
        if (it != flushed_from.end() && it->second == std::make_pair(v, routes_hash)) break;
        if (crashed) return cancel_on_crash ? cancelled("consumer {} crashed (test hook)", rank) : Status::Ok();
        if (cv.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline) return late(p);
      }
    }
    return Status::Ok();
  }

  // Push, after moving to new routes mid-sync: a producer that we asked to write (READY)
  // under the old routes may still have those writes in flight into our receive ring,
  // where they would land on top of the new attempt's groups. Waits until each of them
  // answered our FAILOVER with FLUSHED.
  Status wait_flushed(uint64_t v) {
    if (opts.mode != SyncMode::kPush) return Status::Ok();
    std::vector<int> from;
    {
      std::lock_guard<std::mutex> lk(mu);
      from.assign(readied.begin(), readied.end());
    }
    FERRY_RETURN_IF_ERROR(await_flushed(v, from, true, [&](int p) {
      return timeout_error("consumer {}: producer {} did not confirm within {} ms that its writes of abandoned "
                           "routes into this consumer's receive ring ended (sync {})", rank, p, opts.timeout.count(), v);
    }));
    std::lock_guard<std::mutex> lk(mu);
    readied.clear();
    unanswered.clear();
    return Status::Ok();
  }

  // Push, after giving up sync v (ABORT sent): a producer whose READY we have not seen
  // answered may still be writing into our receive ring and params, which the caller
  // owns again once sync() returns. Waits until each such producer answered the ABORT
  // with FLUSHED. Returns why when one did not.
  Status wait_aborted_writes(uint64_t v) {
    if (opts.mode != SyncMode::kPush) return Status::Ok();
    std::vector<int> from;
    for (const auto& [p, n] : unanswered) {
      if (n > 0) from.push_back(p);
    }
    return await_flushed(v, from, false, [&](int p) {
      return timeout_error("consumer {}: producer {} did not confirm within {} ms, after this consumer gave up "
                           "sync {}, that its writes into this consumer's receive ring and params ended",
                           rank, p, opts.timeout.count(), v);
    });
  }

  // Producers connected and not failed: those told of the end of a sync (ABORT, DONE).
  std::vector<int> reachable_producers() {
    std::vector<int> out;
    std::lock_guard<std::mutex> lk(mu);
    for (int p = 0; p < opts.num_producers; ++p) {
      if (peers[static_cast<size_t>(p)].connected && !failed.count(p)) out.push_back(p);
    }
    return out;
  }

  Result<std::vector<TensorDecl>> await_metadata();
  Status start(const std::vector<TensorDecl>& metadata, TensorMap params);

  Result<SyncReport> sync(uint64_t v) {
    const auto t0 = Clock::now();
    readied.clear();
    unanswered.clear();
    SyncReport rep;
    rep.version = v;
    trace.begin(t0);
    // The report's sums from the trace; kept for last_report() whatever the outcome.
    auto finish_report = [&](const Status& st) {
      if (rep.seconds == 0) rep.seconds = seconds_since(t0);
      rep.status = st;
      rep.trace = trace.take();
      rep.start_unix_ns = trace.start_unix_ns();
      derive_report_sums(rep);
      last = rep;
    };
    if (opts.before_sync) opts.before_sync(v);
    {
      std::lock_guard<std::mutex> lk(mu);
      // Drop announcements of older versions and of other syncs this instance ran or gave
      // up (a rollback after a failed sync must not take them for a producer ahead).
      // An older version this instance never synced, from the instance we are connected
      // to, is a producer behind (as on_message judges one arriving during the sync): it
      // came before this sync began, and dropping it silently left the consumer waiting
      // out its timeout for announcements that never come.
      behind.clear();
      for (auto it = inbox.begin(); it != inbox.end();) {
        const auto& [mv, g, p] = it->first;
        const bool ran = attempted.count(mv) || mismatched.count(mv);
        if (mv < v && !ran && peers[static_cast<size_t>(p)].connected && it->second.from == peers[static_cast<size_t>(p)].id)
          behind[p] = mv;
        const bool stale = mv < v || (mv != v && ran);
        it = stale ? inbox.erase(it) : std::next(it);
      }
      syncing = v;
      attempted.insert(v);
      if (attempted.size() > 64) attempted.erase(attempted.begin());
    }
    reset_background();
    param_set->begin(v);
    old_hashes.clear();
    const uint64_t previous = routes_hash;
    Status s = Status::Ok();
    if (auto again = republish(store, published); !again.ok()) {
      s = again.status();
    } else if (*again > 0) {
      rep.failures.push_back(fmt::format("consumer {}: the store {} had lost its rendezvous keys (restarted?); "
                                         "re-published its plan", rank, store.url()));
    }
    if (s.ok()) s = refresh_routes();
    s = s.with_context(fmt::format("consumer {} sync {}", rank, v));
    // Routes changed before we began (another participant already failed over this
    // sync): announcements made with the old ones are stale, not a reason to switch.
    if (routes_hash != previous) old_hashes.insert(previous);
    declare = !route_state.dead().empty();
    for (int tries = 0; s.ok() || tries > 0; ++tries) {
      failed_p = -1;
      {
        std::lock_guard<std::mutex> lk(mu);
        switch_routes = false;
      }
      s = sync_groups(v, rep);
      if (s.ok() || !opts.failover || tries >= 2 * opts.num_producers) break;
      bool follow;
      {
        std::lock_guard<std::mutex> lk(mu);
        follow = switch_routes;
      }
      if (follow) {
        const uint64_t before = routes_hash;
        reset_background();
        Status f = refresh_routes();
        if (!f.ok() || routes_hash == before) {
          if (!f.ok()) s = f;
          break;
        }
        old_hashes.insert(before);
        rep.failures.push_back(fmt::format("consumer {}: followed producers to routes without a failed producer", rank));
        declare_routes(v);
        if (Status w = wait_flushed(v); !w.ok()) {
          s = w;
          break;
        }
        trace.new_attempt(false);
        continue;
      }
      if (failed_p < 0) break;
      old_hashes.insert(routes_hash);
      Status f = failover(v, s, rep);
      if (f.ok()) f = wait_flushed(v);
      if (!f.ok()) {
        s = f;
        break;
      }
      trace.new_attempt(false);
    }
    // On failure, let the background thread finish what it holds, then tell producers we gave up.
    if (!s.ok()) worker->clear(opts.timeout);
    std::unique_lock<std::mutex> lk(mu);
    syncing.reset();
    if (!s.ok()) {
      param_set->abort();
      for (const auto& [p, n] : unanswered) flushed_from.erase(p);  // an answer to an earlier FAILOVER is not one to this ABORT
      lk.unlock();
      for (int p : reachable_producers()) send_to(p, Abort{me(), v, routes_hash});
      if (Status w = wait_aborted_writes(v); !w.ok()) s = Status(s.code(), fmt::format("{}; {}", s.message(), w.message()));
      finish_report(s);
      return s;
    }
    param_set->finish(v);
    lk.unlock();
    const auto tc = Clock::now();
    std::vector<Completion> dones;
    for (int p : reachable_producers()) {
      if (auto c = send_to(p, Done{me(), v, routes_hash})) dones.push_back(*c);
    }
    // For committed_versions(): what a framework asks before it serves with these weights.
    if (Status c = store.set(keys.committed(rank), std::to_string(v)); !c.ok())
      rep.failures.push_back(fmt::format("consumer {}: recording committed version {}: {}", rank, v, c.to_string()));
    // The DONEs have left before sync returns: a caller that closes the consumer right
    // after (its last sync) must not cancel them in its transport's queue, or producers
    // would count this consumer as having missed a version it holds. Bounded; a producer
    // that died meanwhile does not matter here.
    wait_all(dones, std::min<std::chrono::milliseconds>(opts.timeout, std::chrono::milliseconds(2000))).ignore();
    trace.record(TracePhase::kCommit, -1, -1, tc, Clock::now());
    rep.seconds = seconds_since(t0);
    rep.memory = memory_use();
    finish_report(Status::Ok());
    if (opts.after_sync) opts.after_sync(v);
    return rep;
  }
};

Consumer::Consumer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Consumer::~Consumer() = default;
Result<SyncReport> Consumer::sync(uint64_t version) { return impl_->sync(version); }
const SyncReport& Consumer::last_report() const { return impl_->last; }
ConsumerState Consumer::state() const { return impl_->param_set->state(); }
const TensorMap& Consumer::params() const { return impl_->param_set->committed(); }
const Routes& Consumer::routes() const { return impl_->routes; }
int Consumer::rank() const { return impl_->rank; }
void engine::TestAccess::simulate_crash(Consumer& c) {
  Consumer::Impl* impl_ = c.impl_.get();
  impl_->transport.simulate_crash().ignore();
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->crashed = true;
    impl_->cv.notify_all();
    impl_->worker->interrupt();
  }
  if (impl_->lease) impl_->lease->release().ignore();
}

Status Consumer::check_params(const TensorMap& current) const { return impl_->param_set->check_rebound(current); }

Result<std::unique_ptr<Consumer>> Consumer::create(const ModelLoader& loader, int rank, Transport& transport, Store& store,
                                                   const ConsumerOptions& options, TensorMap params) {
  auto impl = std::make_unique<Impl>(rank, transport, store, options);
  Impl& m = *impl;
  if (rank < 0 || rank >= options.num_consumers)
    return invalid_argument("consumer rank {} outside num_consumers {}", rank, options.num_consumers);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const RankLoader> rank_loader, loader.rank(rank));
  FERRY_RETURN_IF_ERROR(check_param_devices(rank, params));
  FERRY_ASSIGN_OR_RETURN(auto metadata, m.await_metadata());
  FERRY_ASSIGN_OR_RETURN(m.model, record_rank_model(loader, std::move(rank_loader), rank, metadata));
  FERRY_RETURN_IF_ERROR(m.start(metadata, std::move(params)));
  return std::unique_ptr<Consumer>(new Consumer(std::move(impl)));
}

Result<std::unique_ptr<Consumer>> Consumer::create(ConsumerModel model, int rank, Transport& transport, Store& store,
                                                   const ConsumerOptions& options) {
  auto impl = std::make_unique<Impl>(rank, transport, store, options);
  Impl& m = *impl;
  if (rank < 0 || rank >= options.num_consumers)
    return invalid_argument("consumer rank {} outside num_consumers {}", rank, options.num_consumers);
  FERRY_RETURN_IF_ERROR(check_param_devices(rank, model.params));
  FERRY_ASSIGN_OR_RETURN(auto metadata, m.await_metadata());
  TensorMap params = std::move(model.params);
  FERRY_ASSIGN_OR_RETURN(m.model, adopt_rank_model(std::move(model), rank, metadata));
  FERRY_RETURN_IF_ERROR(m.start(metadata, std::move(params)));
  return std::unique_ptr<Consumer>(new Consumer(std::move(impl)));
}

Result<std::vector<TensorDecl>> Consumer::Impl::await_metadata() {
  const Participant me{"consumer", rank};
  FERRY_RETURN_IF_ERROR(publish_world(store, keys, opts, me));
  FERRY_RETURN_IF_ERROR(
      await_keys(store, keys, opts, me, {keys.meta()}, "the trainer's metadata").with_context("engine rendezvous"));
  FERRY_ASSIGN_OR_RETURN(auto meta_text, store.get(keys.meta()));
  return decode_decls(meta_text);
}

// The rest of creation, the same for both kinds of model: publish the plan, build
// routes, set up param buffers and the receive ring, wait for producers, publish the lease.
Status Consumer::Impl::start(const std::vector<TensorDecl>& metadata, TensorMap params) {
  Impl& m = *this;
  const ConsumerOptions& options = opts;
  m.published.emplace_back(m.keys.plan(rank), m.model.plan.encode());
  FERRY_RETURN_IF_ERROR(store.set(m.keys.plan(rank), m.published.back().second));
  FERRY_ASSIGN_OR_RETURN(auto inputs, rendezvous_inputs(store, m.keys, options, Participant{"consumer", rank}, metadata));
  FERRY_ASSIGN_OR_RETURN(auto routes, m.route_state.start(std::move(inputs)));
  m.slot_bytes = consumer_slot_bytes(routes.consumer(static_cast<size_t>(rank)));
  auto set = ParamSet::create(ParamSetOptions{rank, options.mode == SyncMode::kPush, options.direct_min_bytes},
                              m.model.param_decls, params, transport_param_memory(transport));
  if (!set.ok()) return set.status();
  m.param_set = std::move(*set);
  const std::optional<Device> cuda = m.param_set->device();  // where the caller's params are, when in GPU memory
  FERRY_RETURN_IF_ERROR(m.apply_routes(std::move(routes)));
  // Padding: the plan's zeros are written once (routes carry only source bytes).
  FERRY_RETURN_IF_ERROR(m.param_set->write_padding(m.model.plan));
  FERRY_RETURN_IF_ERROR(m.ring.allocate(transport, m.slot_bytes * Impl::kSlots));
  m.lane = std::make_unique<TransportLane>(rank, transport, m.ring.region, *m.param_set);
  // CUDA IPC: a receive ring on the params' device, when every param is there (the
  // caller's), in pull mode, without checksums (verified on the host).
  if (options.cuda_ipc && m.param_set->all_on_device() && options.mode == SyncMode::kPull && !options.checksums) {
    FERRY_ASSIGN_OR_RETURN(m.ipc_lane, CudaIpcLane::create(rank, *cuda, m.slot_bytes * Impl::kSlots));
  }
  if (cuda) {
    FERRY_RETURN_IF_ERROR(m.ring.make_cuda_visible(*cuda).with_context(
        fmt::format("consumer {}: the receive ring, for params on {}", rank, device_str(*cuda))));
  }
  FERRY_ASSIGN_OR_RETURN(auto key, transport.export_key(m.ring.region));
  m.peers.resize(static_cast<size_t>(options.num_producers));
  Impl* self = this;
  transport.set_message_handler([self](PeerId from, uint32_t tag, std::span<const std::byte> payload) {
    if (tag == kEngineTag) self->on_message(from, payload);
  });
  transport.set_peer_failure_handler([self](PeerId peer, const Status& why) { self->on_peer_failure(peer, why); });
  std::vector<std::string> producer_keys;
  for (int p = 0; p < options.num_producers; ++p) producer_keys.push_back(m.keys.producer(p));
  FERRY_RETURN_IF_ERROR(await_keys(store, m.keys, options, Participant{"consumer", rank}, producer_keys,
                                   "every producer's lease"));
  FERRY_RETURN_IF_ERROR(m.refresh_producers());
  m.worker = std::make_unique<UnpackWorker>(
      Impl::kSlots, [self](const UnpackWorker::Job& j) { return self->unpack_job(j); },
      [self](const UnpackWorker::Job& j) { return self->post_job(j); },
      [self](const UnpackWorker::Job& j) {
        if (self->opts.after_group) self->opts.after_group(j.version, j.group);
      },
      [self] { self->wake(); }, &m.trace);
  m.worker->start();
  // Push: where producers may write into params. In the lease (not in each READY) because
  // it is fixed for the instance's life and producers derive every write from it and
  // the routes once, as they read the lease of a new instance anyway.
  ParamTable param_table;
  if (options.mode == SyncMode::kPush && !m.param_set->placements().empty()) {
    param_table.min_bytes = options.direct_min_bytes;
    for (const MemoryRegion& r : m.param_set->registrations()) {
      FERRY_ASSIGN_OR_RETURN(auto k, transport.export_key(r));
      param_table.keys.push_back(bytes_to_string(k));
    }
    param_table.params = m.param_set->placements();
  }
  const std::string blob = encode_lease(
      ConsumerLease{bytes_to_string(transport.address()), bytes_to_string(key), m.slot_bytes, param_table.encode()});
  FERRY_ASSIGN_OR_RETURN(m.lease, store.hold_lease(m.keys.consumer(rank), blob, options.lease_ttl));
  return Status::Ok();
}

}  // namespace ferry
