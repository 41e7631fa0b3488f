// Producer: one per trainer rank (see ferry/engine.h for the protocol). Its sync loop:
// a sync's attempts, each planned (sync_plan.h), its groups packed into the staging
// ring and served, then the wait for every live consumer; the report. Impl (and what
// each method does): engine/producer_impl.h.
#include "engine/producer_impl.h"
#include "engine/cuda_ipc.h"  // host_identity

namespace ferry {

void Producer::Impl::plan_attempt(uint64_t v) {
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
      const bool member = members.member(c) && !members.committed(c, v);
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
  std::vector<bool> on_this_host(static_cast<size_t>(opts.num_consumers));
  const std::string here = host_identity();
  for (int c = 0; c < opts.num_consumers; ++c) on_this_host[static_cast<size_t>(c)] = peers[c].host == here;
  delta->begin_attempt(routes.consumer_plan, in.members, on_this_host);
}

Status Producer::Impl::attempt(uint64_t v, bool* restarted) {
  const ProducerRoute& route = routes.producers[static_cast<size_t>(rank)];
  const uint64_t hash = routes_hash;
  auto check_restart = [&] {
    std::lock_guard<std::mutex> lk(mu);
    return restart.to_other_than(hash);
  };
  trace.stage(SyncStage::kRouting);
  plan_attempt(v);
  for (int g = 0; g < routes.num_groups(); ++g) {
    const ProducerGroup& grp = route.groups[static_cast<size_t>(g)];
    std::vector<int> targets;  // the plan's, less those dropped or done since
    {
      std::lock_guard<std::mutex> lk(mu);
      for (int c : plan.groups[static_cast<size_t>(g)].targets) {
        if (members.member(c) && !members.committed(c, v)) targets.push_back(c);
      }
    }
    if (targets.empty()) continue;
    // By place in this producer's pack order (rotated: its groups need not be consecutive).
    const int at = pacer.pack_position(g);
    const size_t s = static_cast<size_t>(at % staging->slots());
    trace.stage(SyncStage::kWire);
    auto tw = Clock::now();
    FERRY_RETURN_IF_ERROR(wait_slot(s, true));
    trace.record(TracePhase::kWait, g, -1, tw, Clock::now());
    trace.stage(SyncStage::kTransform);
    if (check_restart()) {
      *restarted = true;
      return Status::Ok();
    }
    if (opts.test_hooks && opts.test_hooks->before_materialize) opts.test_hooks->before_materialize(v, g);
    auto tm = Clock::now();
    auto boxes = source.materialize(g);
    trace.record(TracePhase::kMaterialize, g, -1, tm, Clock::now());
    if (!boxes.ok()) return boxes.status().with_context(fmt::format("producer {} materialize group {}", rank, g));
    if (opts.test_hooks && opts.test_hooks->after_materialize) opts.test_hooks->after_materialize(v, g, *boxes);
    if (opts.weight_digests) digests.add(own_holdings(), *boxes);
    auto tp = Clock::now();
    auto packed = staging->pack(schedule, g, s, *boxes);
    if (!packed.ok()) return packed.status();
    for (const QuantOp& q : grp.quants) report.quantized_bytes += q.bytes();
    std::map<uint32_t, uint64_t> sums = std::move(*packed);
    content.add(g, std::map<int64_t, uint64_t>(sums.begin(), sums.end()));
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
        if (!members.member(c) || members.committed(c, v)) continue;
        if (auto it = members.consumer_hash.find(c);
            it != members.consumer_hash.end() && it->second != hash && !restart.abandoned.count(it->second)) {
          sl.skipped.insert(c);
          continue;
        }
        sl.pending.insert(c);
        if (!pacer.turn(c, g)) continue;  // served when its wave opens
        sl.opened[c] = sl.since;
        if (opts.mode == SyncMode::kPull) {
          to_announce.push_back(AnnounceTo{c, peers[c].id, announce_locked(sl, c, s)});
        } else if (auto it = pushes.ready.find({v, g, c}); it != pushes.ready.end() &&
                                                    it->second.from == peers[c].id &&
                                                    it->second.hash == hash) {
          to_push.push_back(PushTo{c, it->second.slot, it->second.landing});
        }
      }
      todo = open_waves_locked();
    }
    trace.stage(SyncStage::kReceive);
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
  trace.stage(SyncStage::kWire);
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

Result<SyncReport> Producer::Impl::sync(uint64_t v) {
  const auto t0 = Clock::now();
  struct Returned {  // previous_sync, whatever the outcome
    Impl& self;
    uint64_t v;
    ~Returned() {
      std::lock_guard<std::mutex> lk(self.mu);
      self.members.previous_sync = std::make_pair(v, Clock::now());
    }
  } returned{*this, v};
  {
    std::lock_guard<std::mutex> lk(mu);
    // The same version again: the consumers' DONEs of the previous sync are not this
    // one's (before, every consumer counted as done at once: the sync reported ok
    // with 0 bytes sent, and the consumers timed out waiting for announcements).
    if (members.previous_sync && members.previous_sync->first == v) {
      for (auto it = members.done.begin(); it != members.done.end();) {
        const auto at = members.done_at.find(it->first);
        const bool old = it->second == v && (at == members.done_at.end() || at->second <= members.previous_sync->second);
        it = old ? members.done.erase(it) : std::next(it);
      }
    }
    report = SyncReport{};
    report.version = v;
    delta->begin_sync();
    digests.begin(v);
    trace.set_sink(opts.sink.get(), "producer", rank);
    trace.begin(t0, v);
    trace.stage(SyncStage::kRendezvous);
    restart.asked = false;
    local_failure = Status::Ok();
    members.consumer_hash.clear();
    members.consumer_joined.clear();
    restart.abandoned.clear();
    members.consumer_progress.clear();
    for (auto it = pushes.ready.begin(); it != pushes.ready.end();) it = std::get<0>(it->first) < v ? pushes.ready.erase(it) : std::next(it);
    for (auto& s : slots) s = Slot{};
  }
  // A sync that ends before it serves anything still has its report (last_report, the
  // sink's on_report), saying why.
  auto ended_early = [&](Status failed) -> Status {
    std::lock_guard<std::mutex> lk(mu);
    report.seconds = seconds_since(t0);
    report.status = failed;
    trace.finish_report(report);
    return failed;
  };
  if (Status claim = check_claim(*reg.claim, store, Participant{"producer", rank}, reg.instance); !claim.ok())
    return ended_early(claim);
  bool store_lost_keys = false;
  {
    auto again = republish(store, reg.published);
    if (!again.ok()) return ended_early(again.status().with_context(fmt::format("producer {} sync {}", rank, v)));
    store_lost_keys = *again > 0;
    if (*again > 0)
      trace.control(ControlKind::kRepublish, -1, -1, fmt::format("producer {}: the store {} had lost its rendezvous keys (restarted?); "
                                            "re-published {}", rank, store.url(), *again));
  }
  trace.stage(SyncStage::kRouting);
  if (Status routes = refresh_routes(); !routes.ok())
    return ended_early(routes.with_context(fmt::format("producer {} sync {}", rank, v)));
  trace.stage(SyncStage::kRendezvous);
  refresh_membership(v, store_lost_keys);
  {
    std::lock_guard<std::mutex> lk(mu);
    for (int c = 0; c < opts.num_consumers; ++c) {
      const Peer& p = peers[c];
      if (members.member(c) && p.committed)
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
    members.version = v;
    members.in_sync = true;
    content.begin(routes_hash);
    members.undeclared_hash.reset();
    if (route_state.dead().empty()) members.undeclared_hash = routes_hash;
    for (const auto& [c, vh] : members.early_failover) {
      if (vh.first != v) continue;
      members.consumer_hash[c] = vh.second;
      members.consumer_joined[c] = Clock::now();
      if (vh.second != routes_hash) {
        restart.asked = true;
        restart.routes = vh.second;
      }
    }
    members.early_failover.clear();
    // Consumers that entered v (JOIN, or asked for a group of it) before this producer
    // did: their clocks start with this producer's sync.
    for (const auto& [c, ev] : members.early_join) {
      if (ev == v) members.consumer_progress[c] = Clock::now();
    }
    members.early_join.clear();
    for (const auto& [key, r] : pushes.ready) {
      if (std::get<0>(key) == v) members.consumer_progress[std::get<2>(key)] = Clock::now();
    }
    for (const auto& [c, abort] : members.early_abort) {
      const auto& [ev, reason] = abort;
      if (ev == v) {
        drop_locked(c, aborted_because(reason), nullptr);
      } else if (ev > v && !members.committed(c, v)) {
        // It gave up a later version before this sync began: it is not in this sync (a
        // version mismatch), as on_message judges an ABORT that comes during it. Kept as
        // a member, it never enters, and the others waited for it the whole join window.
        drop_locked(c, fmt::format("it synced version {}, not this sync's {}", ev, v), nullptr);
      }
    }
    members.early_abort.clear();
    // A READY for a later version that came before this sync began is the same caller's
    // mismatch as one that comes during it (on_message): that consumer syncs another
    // version than ours and would otherwise wait for pushes of its version to its own
    // timeout, while this producer waits for it to the stall timeout.
    for (const auto& [key, rf] : pushes.ready) {
      const auto& [rv, g, c] = key;
      if (rv <= v || !members.member(c)) continue;
      if (!peers.made_for(rf.from, c) || members.committed(c, v)) continue;
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
      // timeout, and for each consumer by the straggler bound once others committed
      // (wait_committed).
      trace.stage(SyncStage::kCommit);
      std::unique_lock<std::mutex> lk(mu);
      const auto tc = Clock::now();
      std::vector<int> n = wait_committed(lk, v, tc);
      lk.unlock();
      send_dropped(n, v);
      lk.lock();
      if (!local_failure.ok()) failure = local_failure;
      restarted = restart.to_other_than(routes_hash);
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
      restart.abandoned.insert(routes_hash);
    }
    failure = refresh_routes().with_context(fmt::format("producer {} failover in sync {}", rank, v));
    if (!failure.ok()) break;
    {
      std::lock_guard<std::mutex> lk(mu);
      restart.abandoned.erase(routes_hash);  // (the store still had the same routes)
      if (restart.routes == routes_hash) restart.asked = false;
    }
    std::lock_guard<std::mutex> lk(mu);
    trace.control(ControlKind::kFailover, -1, -1, fmt::format("producer {}: failover, routes rebuilt without producer(s) {}", rank,
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
    trace.control(ControlKind::kRejoin, -1, -1, 
        cleared.ok() ? fmt::format("producer {}: failed over by consumers in sync {} while alive; rejoins at the "
                                   "next sync", rank, v)
                     : fmt::format("producer {}: failed over in sync {} while alive; clearing its mark {}: {}", rank,
                                   v, keys.dead(rank), cleared.to_string()));
  }
  if (failure.ok() && opts.weight_digests) {
    if (Status d = digests.publish(store, keys, rank); !d.ok()) trace.control(ControlKind::kStore, -1, -1, d.to_string());
  }
  const std::set<int> left = failure.ok() ? leavers(v) : std::set<int>{};
  std::lock_guard<std::mutex> lk(mu);
  members.in_sync = false;
  if (failure.ok()) note_missed_locked(v, left);
  report.seconds = seconds_since(t0);
  report.status = failure;
  report.unchanged = content.finish(routes_hash, failure.ok());
  report.memory = memory_use();
  trace.finish_report(report);
  if (!failure.ok()) return failure;
  return report;
}

std::vector<int> Producer::Impl::wait_committed(std::unique_lock<std::mutex>& lk, uint64_t v, Clock::time_point since) {
  std::vector<int> n;
  const auto deadline = since + opts.stall_timeout;
  const StragglerPolicy policy = straggler_policy();
  for (;;) {
    std::set<int> pending;
    std::optional<Clock::time_point> last_done;  // the others' pace: the last DONE of v
    for (int c = 0; c < opts.num_consumers; ++c) {
      if (!members.member(c)) continue;
      if (!members.committed(c, v)) {
        pending.insert(c);
      } else if (auto at = members.done_at.find(c); at != members.done_at.end()) {
        last_done = std::max(last_done.value_or(at->second), at->second);
      }
    }
    if (pending.empty() || restart.to_other_than(routes_hash) || !local_failure.ok()) break;
    if (own_transport_dead(lk)) continue;  // (ends the wait)
    // A consumer that has not committed the straggler bound after the others did, and
    // said nothing meanwhile (its drain JOINs each keepalive while it unpacks), is hung
    // as surely as one that stopped reading a slot: dropped, not waited for to
    // stall_timeout while every healthy consumer's next sync waits for this producer
    // (issue 49, finding 2). The bound's relative part: the others' time to commit after
    // this producer's last slot was done.
    const std::optional<Clock::time_point> resumed = pause_watch.last_resume();
    RoutesKnown known{routes_hash, &members.consumer_hash, &members.consumer_joined, members.undeclared_hash};
    known.progress = &members.consumer_progress;
    known.resumed = resumed;
    const SlotPace pace{-1, routes_hash, since, last_done ? std::max(*last_done, since) : last_done};
    const Clock::duration bound = pace.last_release ? straggler_bound(policy, pace) : Clock::duration{};
    const std::optional<Clock::time_point> at = next_straggler(policy, bound, pace, known, pending, deadline);
    const auto wake = std::min({deadline, at.value_or(deadline), Clock::now() + health_probe_every(opts.lease_ttl)});
    const bool timed_out = cv.wait_until(lk, wake) == std::cv_status::timeout;
    if (pause_watch.last_resume() != resumed) continue;  // stopped meanwhile: judge again from the resume
    if (timed_out && at && Clock::now() >= *at) {
      for (const auto& [c, why] : stragglers(policy, bound, pace, known, pending, Clock::now())) {
        if (!members.committed(c, v)) drop_locked(c, why, &n);
      }
    }
    if (timed_out && Clock::now() >= deadline) break;
  }
  return n;
}

Producer::Producer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Producer::~Producer() = default;
const Routes& Producer::routes() const { return impl_->routes; }
int Producer::rank() const { return impl_->rank; }
Result<SyncReport> Producer::sync(uint64_t version) { return impl_->sync(version); }
const SyncReport& Producer::last_report() const { return impl_->report; }

}  // namespace ferry
