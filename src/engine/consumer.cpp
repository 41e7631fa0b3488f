// Consumer: one per inference rank; the sync protocol of its control plane (a sync's
// attempts, announcements, failover, commit). Impl and what lives where:
// engine/consumer_impl.h.
#include "engine/consumer_impl.h"
#include "delta/patch.h"

namespace ferry {

Status Consumer::Impl::version_mismatch_locked(uint64_t v, const std::set<int>& from) {
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
    if (mv > v && from.count(p) && e.from == peers[p].id) return mismatch(p, mv);
  }
  return Status::Ok();
}

Status Consumer::Impl::moved_on_locked(uint64_t v, const std::set<int>& from) {
  // A producer that dropped this consumer from v, or that already serves a later
  // version, has moved on: its slots and its trainer's weights may hold a later version
  // now, so nothing of v it announced earlier may be read, and in push nothing asked of
  // it (a consumer entering v after being dropped as absent read version v+1 bytes
  // through announcements of v it had been sent before the drop).
  for (auto d = dropped_versions.lower_bound({v, 0}); d != dropped_versions.end() && d->first.first == v; ++d) {
    if (!route_state.dead().count(d->first.second))
      return cancelled("consumer {} was dropped from sync {} by {}", rank, v, d->second);
  }
  return version_mismatch_locked(v, from);
}

Result<std::pair<int, Consumer::Impl::Arrival>> Consumer::Impl::await_any(uint64_t v, int g, const std::set<int>& from, const char* what,
                                          bool* none) {
  using Answer = Result<std::pair<int, Arrival>>;
  std::unique_lock<std::mutex> lk(mu);
  // Leases checked each lease_ttl of silence: producers whose lease was gone at the last
  // check too (lost_producer).
  const bool watch = opts.failover && opts.lease_ttl.count() > 0;
  WaitTicks ticks{Clock::now() + opts.timeout, health_probe_every(opts.lease_ttl), keepalive_every(),
                  watch ? Clock::duration(opts.lease_ttl) : Clock::duration{}};
  LapseWatch lapses;
  auto step = [&]() -> std::optional<Answer> {
    for (;;) {
      // Checked before any announcement is taken (see moved_on_locked).
      if (Status m = moved_on_locked(v, from); !m.ok()) return Answer(m);
      for (int p : from) {
        auto it = inbox.find({v, g, p});
        // A message of another attempt (other routes) stays: it may be the next one's.
        if (it == inbox.end() || it->second.routes != routes_hash) continue;
        if (it->second.from != peers[p].id) continue;  // not the connected instance
        Arrival a = it->second;
        inbox.erase(it);
        return Answer(std::make_pair(p, a));
      }
      // A producer on routes this consumer has not run this sync. Newer ones (a failover
      // another consumer started: it marks the dead in the store before any producer
      // hears of them) are followed. Routes the store's dead marks do not give are a
      // producer behind (it has not yet heard of a failover this consumer knows): wait
      // for it to catch up rather than give up the sync (following would rebuild the
      // same routes, and a new attempt would wait for announcements this one already took).
      std::optional<std::pair<uint64_t, int>> foreign;
      for (const auto& [key, e] : inbox) {
        if (std::get<0>(key) == v && e.routes != routes_hash && !old_hashes.count(e.routes)) {
          foreign = std::make_pair(e.routes, std::get<2>(key));
          break;
        }
      }
      if (!foreign) break;
      lk.unlock();
      auto stored = route_state.read_dead();
      lk.lock();
      if (!stored.ok() || *stored != route_state.dead()) {
        switch_routes = true;
        return Answer(unavailable("consumer {}: producer {} switched routes for sync {}", rank, foreign->second, v));
      }
      old_hashes.insert(foreign->first);
    }
    for (int p : from) {
      if (auto it = failed.find(p); it != failed.end()) {
        failed_p = p;
        return Answer(peer_failed("producer {} failed during sync {} (group {}): {}", p, v, g, it->second.to_string()));
      }
    }
    if (crashed) return Answer(cancelled("consumer {} crashed (test hook)", rank));
    if (Status h = own_transport_health(); !h.ok()) return Answer(h);  // (rather than wait out timeout)
    if (Status w = worker->status(); !w.ok()) return Answer(w);
    if (none) {
      *none = true;
      return Answer(timeout_error("consumer {}: no {} yet", rank, what));
    }
    return std::nullopt;
  };
  // Held up by producer(s) in `from` (silent: paused, cut off, slow to pack): say so to
  // the others with a JOIN, which restarts this consumer's straggler and stall clocks
  // there, so that no healthy producer drops a consumer another producer is holding up
  // (issue 30). A consumer slow on its own (its hooks, its unpacking, a pause of its
  // process) is not in this wait and sends nothing.
  auto keepalive = [&] {
    for (int q : reachable_producers()) {
      if (!from.count(q)) send_to(q, Join{me(), v, routes_hash});
    }
  };
  auto check = [&]() -> std::optional<Answer> {
    const int lost = lost_producer(from, lapses);
    if (lost < 0) return std::nullopt;
    failed_p = lost;
    return Answer(peer_failed("producer {} lost during sync {} (group {}): no {} and its lease {} gone for over {} ms "
                              "(cut off or paused)", lost, v, g, what, keys.producer(lost), opts.lease_ttl.count()));
  };
  auto late = [&] {
    std::string missing;
    for (int p : from) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
    return Answer(timeout_error("consumer {}: no {} from producer(s) {} for version {} group {} within {} ms", rank,
                                what, missing, v, g, opts.timeout.count()));
  };
  return wait_loop<Answer>(lk, cv, ticks, step, keepalive, check, late);
}

int Consumer::Impl::lost_producer(const std::set<int>& from, LapseWatch& lapses) {
  for (int p : from) {
    if (route_state.dead().count(p)) continue;
    auto blob = store.get(keys.producer(p));
    if (lapses.lapsed(p, !blob.ok() && blob.status().code() == StatusCode::kNotFound)) {
      std::set<int> d = route_state.dead();
      d.insert(p);
      if (route_state.routes_without(d).ok()) return p;
    }
  }
  return -1;
}

Status Consumer::Impl::wait_reads(std::span<const Completion> ops, int p, uint64_t v, int g) {
  const auto deadline = Clock::now() + opts.timeout;
  const bool watch = opts.failover && opts.lease_ttl.count() > 0;
  LapseWatch lapses;
  for (;;) {
    const auto left = std::max(std::chrono::milliseconds(0),
                               std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    Status st = wait_all(ops, watch ? std::min(left, opts.lease_ttl) : left);
    if (st.code() != StatusCode::kTimeout || !watch || Clock::now() >= deadline) return st;
    if (lost_producer({p}, lapses) == p)
      return peer_failed("producer {} lost during sync {} (group {}): reads pending and its lease {} gone for over "
                         "{} ms (cut off or paused)", p, v, g, keys.producer(p), opts.lease_ttl.count());
  }
}

Result<int> Consumer::Impl::acquire_slot(int at) {
  auto s = worker->acquire(at % kSlots, opts.timeout, [this] { return crashed.load(); }, who());
  if (!s.ok() && s.status().code() == StatusCode::kCancelled && crashed)
    return cancelled("consumer {} crashed (test hook)", rank);
  if (s.ok() && opts.relay) relay_reuse(*s);  // members reading the slot's last group finish first (bounded)
  return s;
}

Result<std::pair<int, Consumer::Impl::Arrival>> Consumer::Impl::await_working(uint64_t v, int g, const std::set<int>& from, AttemptReads& reads) {
  while (!reads.backlog_empty()) {
    bool none = false;
    auto r = await_any(v, g, from, "announce", &none);
    if (!none) return r;
    FERRY_RETURN_IF_ERROR(posted(reads, reads.work_one()));
  }
  return await_any(v, g, from, "announce");
}

Status Consumer::Impl::posted(const AttemptReads& reads, Status st) {
  if (!st.ok()) failed_p = reads.failed_producer();
  return st;
}

Status Consumer::Impl::waited(std::span<const Completion> ops, int p, uint64_t v, int g) {
  Status st = wait_reads(ops, p, v, g);
  if (st.ok()) return st;
  failed_p = p;
  return Status(st.code(), fmt::format("consumer {} reading group {} from producer {}: {}", rank, g, p, st.message()));
}

bool Consumer::Impl::takes_patch(int g, uint64_t base) const {
  if (!opts.delta || param_set->device() || landed_groups.count(g)) return false;
  const ConsumerState st = param_set->state();
  return st.has_version && st.version == base && !st.torn && !st.mixed;
}

Status Consumer::Impl::apply_segment_patch(int g, int p, const Read& read, uint64_t patch_bytes, std::byte* slot) {
  std::byte* seg = slot + read.recv_offset;
  patch_copy.assign(seg, seg + patch_bytes);
  // The base: the live params as loaded, not the shadow syncs land in nor the tensors
  // post-processing replaced params with (committed()'s view): in place the buffers
  // loaded; under shadow and groups the live buffers (a flip makes the buffers a sync
  // unpacked into live; a groups commit copies the unpacked bytes into them; a shadow
  // copy commit leaves a replaced param's live buffer as it was: its patches are repaired).
  const TensorMap& live = param_set->groups() || param_set->shadow() ? param_set->live() : param_set->loaded();
  const uint64_t n = plan_route->groups[static_cast<size_t>(g)].recv_bytes;
  Status st = gather_group(schedule.unpack, g, read.recv_offset, read.recv_offset + read.length, live,
                           std::span<std::byte>(slot, n));
  if (st.ok()) st = delta::apply_patch(std::span<std::byte>(seg, read.length), patch_copy);
  if (!st.ok()) return st.with_context(fmt::format("consumer {} group {} producer {}", rank, g, p));
  return st;
}

Status Consumer::Impl::sync_groups(uint64_t v, SyncReport& rep) {
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
  refresh_relay(rep);
  // Pull. In-place bytes are the trainer's weights of v from the start of the
  // producer's sync v until it ends (after our DONE). So once a producer announced
  // anything of v in this attempt (in_v), its in-place bytes that land in params are
  // read *ahead*, with no handshake, whenever the consumer would otherwise wait for an
  // announcement (a chunk at a time, so staging slots are still released promptly:
  // producers pack group g+2 only once every consumer released group g); in-place
  // bytes that land in the receive ring are read as soon as the group's slot is ours;
  // only staged bytes wait for the group's announcement. The reads themselves, and
  // draining them on an error return, are AttemptReads' (engine/attempt_reads.h).
  //
  // In the rotated order (EngineOptions::group_order) producers pace their announcements
  // (docs/group-order.md), and in-place reads keep that pace: a group's in-place bytes
  // from a producer are read once it announced that group, none ahead.
  const bool rotated = opts.group_order == GroupOrderKind::kRotated;
  std::set<int> in_v;
  AttemptReads reads(plan, *lane, ipc_lane.get(), opts.timeout);
  for (size_t at = 0; at < order.size(); ++at) {
    const int g = order[at];
    const ConsumerGroupSchedule& gs = schedule.groups[static_cast<size_t>(g)];
    const ConsumerGroupPlan& gp = plan.groups[static_cast<size_t>(g)];
    const std::set<int> from(gp.from.begin(), gp.from.end());
    if (from.empty()) {
      worker->enqueue({v, g, -1});
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(int s, acquire_slot(static_cast<int>(at)));
    point(g, 0);
    const auto tg = Clock::now();
    const uint64_t base = static_cast<uint64_t>(s) * slot_bytes;
    std::map<int, Arrival> got;
    std::map<int, uint64_t> patched;  // delta: producers whose segment came as a patch, its bytes
    std::set<int> repaired;           // ... and of those, whose dense bytes were read after it
    // Relay within a host (ConsumerOptions::relay): a member copies the group from its
    // relay's receive ring once every producer announced it (pull), then releases them
    // all (took_patch 3: nothing read from them; push: no write owed). When the relay
    // cannot offer it, cut it short or is lost, the group is read from the producers
    // below, which still hold it staged: `announced` keeps what came meanwhile.
    std::map<int, Arrival> announced;
    bool relayed = false;
    bool use_relay;
    {
      std::lock_guard<std::mutex> lk(mu);  // (`lost` is set by the handlers too)
      use_relay = relay_link.rank >= 0 && !relay_link.lost;
    }
    if (use_relay) {
      if (opts.mode == SyncMode::kPull) {
        std::set<int> remaining = from;
        auto tw = Clock::now();
        while (!remaining.empty()) {
          FERRY_ASSIGN_OR_RETURN(auto pm, await_any(v, g, remaining, "announce"));
          announced[pm.first] = pm.second;
          remaining.erase(pm.first);
        }
        trace.record(TracePhase::kWait, g, -1, tw, Clock::now());
      }
      point(g, 1);
      auto tr = Clock::now();
      FERRY_ASSIGN_OR_RETURN(relayed, copy_from_relay(v, g, base, from));
      trace.record(TracePhase::kRead, g, -1, tr, Clock::now());
      if (relayed) {
        for (int p : from) send_to(p, Release{me(), v, g, routes_hash, 3});
        got = announced;
      } else {
        std::lock_guard<std::mutex> lk(mu);
        if (relay_link.lost)
          rep.failures.push_back(fmt::format("consumer {}: relay consumer {} lost at group {} ({}); the rest of the "
                                             "attempt is read from the producers", rank, relay_link.rank, g,
                                             relay_link.why));
      }
    }
    // Delta: a patch that failed its check is repaired by reading producer p's dense bytes
    // of the group from its kept copy (both modes: its staging ring is imported).
    auto repair = [&](int p, const Status& why) -> Status {
      ++rep.patches_repaired;
      rep.failures.push_back(fmt::format("consumer {}: the patch of group {} from producer {} failed its check ({}); "
                                         "read its dense bytes instead", rank, g, p, why.message()));
      std::vector<Completion> dense;
      FERRY_RETURN_IF_ERROR(posted(reads, reads.post_staged(g, p, got[p].dense_offset, base, dense)));
      return waited(dense, p, v, g);
    };
    if (relayed) {
    } else if (opts.mode == SyncMode::kPull) {
      // Staged bytes: read from each producer as soon as it announced, and release it
      // at once (before any in-place bytes are waited for), so that one slow producer
      // never holds another's staging slot and producers pack on while we copy.
      auto tr0 = Clock::now();
      for (int p : from) {
        if (in_v.count(p) && !rotated) FERRY_RETURN_IF_ERROR(posted(reads, reads.post_to_slot(g, p, base)));
      }
      trace.record(TracePhase::kRead, g, -1, tr0, Clock::now());
      std::set<int> remaining = from;
      bool first = true;
      while (!remaining.empty()) {
        auto tw = Clock::now();
        std::pair<int, Arrival> pm;
        if (!announced.empty()) {  // announced while we waited for the relay
          pm = *announced.begin();
          announced.erase(announced.begin());
        } else {
          FERRY_ASSIGN_OR_RETURN(pm, await_working(v, g, remaining, reads));
        }
        trace.record(TracePhase::kWait, g, pm.first, tw, Clock::now());
        const int p = pm.first;
        got[p] = pm.second;
        remaining.erase(p);
        auto tr1 = Clock::now();
        std::vector<Completion> staged;
        // Delta: our segment is a patch. Read it where we hold its base; else the dense
        // bytes, from the kept copy (over the CUDA IPC lane: the GPU slot, never patched).
        const Arrival& a = got[p];
        const Read* pr =
            a.patch_base ? single_read_from(plan_route->groups[static_cast<size_t>(g)], static_cast<uint32_t>(p)) : nullptr;
        const bool use_patch = pr && a.patch_bytes <= pr->length && !ipc_active && takes_patch(g, *a.patch_base);
        if (use_patch) {
          const SubRead sr{0, pr->recv_offset, a.patch_bytes, nullptr, 0, -1, pr->offset, static_cast<uint32_t>(p)};
          if (Status st = lane->post(Transfer{LaneKind::kTransport, g, p, &sr}, 0, a.patch_bytes, a.patch_offset, base,
                                     staged);
              !st.ok()) {
            failed_p = p;
            return st;
          }
        } else {
          const uint64_t at = a.patch_base && !ipc_active ? a.dense_offset : a.slot_offset;
          FERRY_RETURN_IF_ERROR(posted(reads, reads.post_staged(g, p, at, base, staged)));
        }
        if (first) {
          first = false;
          point(g, 1);
        }
        FERRY_RETURN_IF_ERROR(waited(staged, p, v, g));
        uint8_t took = 0;  // Release::took_patch: what the producer's report counts
        if (use_patch) {   // (applied before the release: a repair reads the producer's memory too)
          patched[p] = a.patch_bytes;
          took = 1;
          if (Status applied = apply_segment_patch(g, p, *pr, a.patch_bytes, ring.data + base); !applied.ok()) {
            FERRY_RETURN_IF_ERROR(repair(p, applied));
            repaired.insert(p);
            took = 2;
          }
        }
        send_to(p, Release{me(), v, g, routes_hash, took});
        if (rotated) {  // this group's in-place bytes from p, now that p announced it
          FERRY_RETURN_IF_ERROR(posted(reads, reads.post_to_slot(g, p, base)));
          reads.enter_group(p, g);
        } else if (in_v.insert(p).second) {  // p is in sync v: its in-place bytes are the weights of v
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
      {
        std::lock_guard<std::mutex> lk(mu);
        FERRY_RETURN_IF_ERROR(moved_on_locked(v, from));  // (before any producer is asked to write)
      }
      if (gs.direct) param_set->touch();  // producers write into params from here on: a failure now leaves us torn
      // Delta: the version our live params hold intact for this group, if we take patches.
      std::optional<uint64_t> live;
      if (const ConsumerState st = param_set->state(); opts.delta && st.has_version && !ipc_active &&
                                                       takes_patch(g, st.version))
        live = st.version;
      for (int p : from) {
        readied.insert(p);
        ++unanswered[p];
        send_to(p, Ready{me(), v, g, routes_hash, static_cast<uint32_t>(s),
                         static_cast<uint8_t>(param_set->landing_index()), live});
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
      for (int p : from) {  // delta: patches written into the slot, applied here
        const Arrival& a = got[p];
        if (!a.patch_base) continue;
        const Read* pr = single_read_from(plan_route->groups[static_cast<size_t>(g)], static_cast<uint32_t>(p));
        Status applied = !live || *a.patch_base != *live || !pr || a.patch_bytes > pr->length
                             ? failed_precondition("a patch against version {} it did not ask for", *a.patch_base)
                             : apply_segment_patch(g, p, *pr, a.patch_bytes, ring.data + base);
        patched[p] = a.patch_bytes;  // (written into our slot whatever follows)
        if (!applied.ok()) {
          FERRY_RETURN_IF_ERROR(repair(p, applied));
          repaired.insert(p);
        }
      }
    }
    if (!relayed) record_receives(trace, g, gs, ipc_active, tg, Clock::now(), patched, repaired);
    std::map<int, uint64_t> sums;  // checksums (the producers' option), verified on the host
    for (int p : from)
      if (got[p].checksum) sums[p] = *got[p].checksum;
    FERRY_RETURN_IF_ERROR(verify_group(rank, g, routes.group_names[static_cast<size_t>(g)], gs, sums, ring.data + base,
                                       ipc_active ? ipc_lane->ring() + base : nullptr,
                                       plan_route->groups[static_cast<size_t>(g)].recv_bytes, *param_set));
    point(g, 2);
    if (opts.relay && !ipc_active) relay_landed(v, g, s);  // members on this host may copy it now
    landed_groups.insert(g);  // (delta: its params hold this sync's bytes from now on)
    worker->enqueue({v, g, s});
  }
  // Drain the background thread.
  Status drained = worker->drain(opts.timeout, who());
  if (drained.code() == StatusCode::kTimeout) return drained;
  if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
  return drained;
}

Status Consumer::Impl::failover(uint64_t v, const Status& why, SyncReport& rep) {
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
  FERRY_RETURN_IF_ERROR(reset_background());
  FERRY_RETURN_IF_ERROR(route_state.adopt(d, std::move(*r), [this](Routes x) { return apply_routes(std::move(x)); }));
  rep.failures.push_back(fmt::format("consumer {}: {}; failover: routes rebuilt without producer(s) {}", rank,
                                     why.to_string(), rank_list(d)));
  declare_routes(v);
  return Status::Ok();
}

Status Consumer::Impl::await_restart(uint64_t v, int p, Clock::time_point deadline, SyncReport& rep) {
  std::string gone;
  {
    std::lock_guard<std::mutex> lk(mu);
    gone = peers[p].gone.value_or(std::string());
  }
  // The store polled with backoff: 10 ms doubling up to a quarter of the straggler floor
  // (keepalive_every, at most 500 ms). JOINs to the others at that pace keep this
  // consumer's progress fresh there.
  WaitTicks ticks{deadline, health_probe_every(opts.lease_ttl), keepalive_every(), keepalive_every(),
                  std::chrono::milliseconds(10)};
  const auto t = Clock::now();
  std::set<int> everyone;
  for (int q = 0; q < opts.num_producers; ++q) everyone.insert(q);
  auto step = [&]() -> std::optional<Status> {
    if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
    if (Status m = moved_on_locked(v, everyone); !m.ok()) return m;  // another producer dropped us meanwhile
    return std::nullopt;
  };
  auto keepalive = [&] {
    for (int q : reachable_producers()) {
      if (q != p) send_to(q, Join{me(), v, routes_hash});
    }
  };
  auto check = [&]() -> std::optional<Status> {
    auto blob = store.get(keys.producer(p));
    if (blob.ok() && *blob != gone) {
      rep.failures.push_back(fmt::format("consumer {}: producer {} was gone as sync {} began (no DP replica); a "
                                         "restarted instance registered {} ms later: syncing from it",
                                         rank, p, v, ms_since(t)));
      return Status::Ok();
    }
    if (!blob.ok() && blob.status().code() != StatusCode::kNotFound) return blob.status();
    return std::nullopt;
  };
  auto late = [&] {
    return timeout_error("no restarted instance of producer {} registered within the sync's timeout {} ms "
                         "(waited {} ms)", p, opts.timeout.count(), ms_since(t));
  };
  keepalive();  // (at once: the wait may be long before the first tick)
  std::unique_lock<std::mutex> lk(mu);
  return wait_loop<Status>(lk, cv, ticks, step, keepalive, check, late);
}

void Consumer::Impl::declare_routes(uint64_t v) {
  for (int p = 0; p < opts.num_producers; ++p) {
    bool ok;
    {
      std::lock_guard<std::mutex> lk(mu);
      ok = !route_state.dead().count(p) && peers[p].connected && !failed.count(p);
    }
    if (ok) send_to(p, Failover{me(), v, routes_hash});
  }
}

template <typename Late>
Status Consumer::Impl::await_flushed(uint64_t v, const std::vector<int>& from, bool cancel_on_crash, Late late) {
  std::unique_lock<std::mutex> lk(mu);
  const auto deadline = Clock::now() + opts.timeout;
  for (int p : from) {
    while (!route_state.dead().count(p) && !failed.count(p) && peers[p].connected) {
      auto it = flushed_from.find(p);
      if (it != flushed_from.end() && it->second == std::make_pair(v, routes_hash)) break;
      if (crashed) return cancel_on_crash ? cancelled("consumer {} crashed (test hook)", rank) : Status::Ok();
      // Our own transport dead: no FLUSHED can come, and no write can land any more.
      if (Status h = own_transport_health(); !h.ok()) return cancel_on_crash ? h : Status::Ok();
      const auto probe_at = Clock::now() + health_probe_every(opts.lease_ttl);
      if (cv.wait_until(lk, std::min(deadline, probe_at)) == std::cv_status::timeout && Clock::now() >= deadline)
        return late(p);
    }
  }
  return Status::Ok();
}

Status Consumer::Impl::wait_flushed(uint64_t v) {
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

Status Consumer::Impl::wait_aborted_writes(uint64_t v) {
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

std::vector<int> Consumer::Impl::reachable_producers() {
  std::vector<int> out;
  std::lock_guard<std::mutex> lk(mu);
  for (int p = 0; p < opts.num_producers; ++p) {
    if (peers[p].connected && !failed.count(p)) out.push_back(p);
  }
  return out;
}

Status Consumer::Impl::publish_versions() {
  if (!lease) return Status::Ok();
  const ConsumerState st = param_set->state();
  ConsumerLease l = lease_value;
  l.committed = st.has_version ? std::optional<uint64_t>(st.version) : std::nullopt;
  l.received = st.received;
  if (l == lease_value) return Status::Ok();
  FERRY_RETURN_IF_ERROR(lease->update(encode_lease(l)).with_context(
      fmt::format("consumer {}: publishing the versions it holds in its lease", rank)));
  lease_value = std::move(l);
  return Status::Ok();
}

Result<double> Consumer::Impl::commit() {
  const std::optional<uint64_t> v = param_set->state().received;
  if (!v) return param_set->commit().status();  // (its error: nothing received)
  if (opts.before_commit) opts.before_commit(*v);
  const auto t = Clock::now();
  Result<uint64_t> done = param_set->commit();
  const double seconds = seconds_since(t);
  if (opts.after_commit) opts.after_commit(*v);
  FERRY_RETURN_IF_ERROR(done.status());
  if (Status c = store.set(keys.committed(rank), std::to_string(*v)); !c.ok())
    return c.with_context(fmt::format("consumer {}: recording committed version {}", rank, *v));
  FERRY_RETURN_IF_ERROR(publish_versions());
  return seconds;
}

Result<SyncReport> Consumer::Impl::sync(uint64_t v, bool commit_it) {
  if (!commit_it && opts.commit != CommitPolicy::kShadow)
    return invalid_argument("consumer {}: sync(commit=false) needs the shadow commit policy", rank);
  FERRY_RETURN_IF_ERROR(check_claim(*claim, store, Participant{"consumer", rank}, instance));
  const auto t0 = Clock::now();
  // Relay: asks of this sync that came after its last attempt ended (and before it was
  // over: they were kept, as of a group still to land) are answered gone on the way out.
  struct RelayFlush {
    Impl* self;
    uint64_t v;
    ~RelayFlush() {
      if (self->opts.relay) self->relay_attempt_over(v);
    }
  } relay_flush{this, v};
  readied.clear();
  unanswered.clear();
  SyncReport rep;
  rep.version = v;
  trace.begin(t0);
  // The report's sums from the trace; kept for last_report() whatever the outcome.
  auto finish_report = [&](const Status& st) {
    if (rep.seconds == 0) rep.seconds = seconds_since(t0);
    rep.status = st;
    const ConsumerState held = param_set->state();
    rep.live_version = held.has_version ? std::optional<uint64_t>(held.version) : std::nullopt;
    if (opts.commit == CommitPolicy::kGroups) {
      std::lock_guard<std::mutex> lk(mu);
      rep.groups_live = groups_live;
      rep.commit_seconds = group_commit_seconds;
    }
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
      // (Nor is one whose producer dropped this consumer from that version: it ran that
      // sync without us, and is not behind.)
      const bool ran = attempted.count(mv) || mismatched.count(mv) || dropped_versions.count({mv, p});
      if (mv < v && !ran && peers[p].connected && it->second.from == peers[p].id)
        behind[p] = mv;
      const bool stale = mv < v || (mv != v && ran);
      it = stale ? inbox.erase(it) : std::next(it);
    }
    dropped_versions.erase(dropped_versions.begin(), dropped_versions.lower_bound({v, 0}));
    syncing = v;
    relay_passed.clear();  // (groups this relay took its slots back from: of earlier syncs)
    groups_live.clear();
    group_commit_seconds = 0;
    attempted.insert(v);
    if (attempted.size() > 64) attempted.erase(attempted.begin());
  }
  Status s = reset_background();  // not ok: a job of the last attempt still runs, this sync fails
  const bool dropping_received = param_set->state().received.has_value();
  param_set->begin(v);
  if (dropping_received) {  // a version received and not committed is gone now: say so
    if (Status c = publish_versions(); !c.ok()) rep.failures.push_back(c.to_string());
  }
  old_hashes.clear();
  landed_groups.clear();
  const uint64_t previous = routes_hash;
  if (!s.ok()) {
  } else if (auto again = republish(store, published); !again.ok()) {
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
  // Tell the producers this consumer is in the sync: from now on it can straggle; until
  // now only their join window applied (rollouts end seconds apart, engine/straggler.h).
  if (s.ok()) {
    for (int p : reachable_producers()) send_to(p, Join{me(), v, routes_hash});
  }
  int restart_waits = 0;
  for (int tries = 0; s.ok() || tries > 0; ++tries) {
    failed_p = -1;
    {
      std::lock_guard<std::mutex> lk(mu);
      switch_routes = false;
    }
    s = sync_groups(v, rep);
    relay_attempt_over(v);  // (members still asking for groups it did not land read them from the producers)
    if (s.ok()) break;
    // A producer gone as the attempt began (nothing of v read yet) that no DP replica
    // covers: wait, within the sync's timeout, for a restarted instance of it, then
    // begin again with it (issue 30: a trainer rank restarted between syncs lost the
    // next sync for every consumer).
    if (failed_p >= 0 && restart_waits < opts.num_producers + 1) {
      bool gone;
      {
        std::lock_guard<std::mutex> lk(mu);
        gone = peers[failed_p].gone.has_value();
      }
      std::set<int> d = route_state.dead();
      d.insert(failed_p);
      if (gone && !(opts.failover && route_state.routes_without(d).ok())) {
        ++restart_waits;
        if (Status w = await_restart(v, failed_p, t0 + opts.timeout, rep); !w.ok()) {
          s = Status(s.code(), fmt::format("{}; {}", s.message(), w.message()));
          break;
        }
        trace.new_attempt(false);
        continue;
      }
    }
    if (!opts.failover || tries >= 2 * opts.num_producers) break;
    bool follow;
    {
      std::lock_guard<std::mutex> lk(mu);
      follow = switch_routes;
    }
    if (follow) {
      const uint64_t before = routes_hash;
      Status f = reset_background();
      if (f.ok()) f = refresh_routes();
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
    std::vector<Completion> aborts;
    for (int p : reachable_producers()) {
      if (auto c = send_to(p, Abort{me(), v, routes_hash})) aborts.push_back(*c);
    }
    // The ABORTs have left before sync returns (as the DONEs below): one still queued when
    // the caller begins another sync would reach a producer in that sync as news of this
    // one, and a later version's ABORT drops its sender from an earlier sync (CI, a
    // loaded machine: PushVersionMismatchAskedBeforeTheProducersBegan's rollback to 2).
    wait_all(aborts, std::min<std::chrono::milliseconds>(opts.timeout, std::chrono::milliseconds(2000))).ignore();
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
  if (opts.commit != CommitPolicy::kShadow) {
    rep.committed = true;
    if (Status c = store.set(keys.committed(rank), std::to_string(v)); !c.ok())
      rep.failures.push_back(fmt::format("consumer {}: recording committed version {}: {}", rank, v, c.to_string()));
  }
  if (opts.commit != CommitPolicy::kShadow || !commit_it) {  // (a commit below publishes its own)
    if (Status c = publish_versions(); !c.ok()) rep.failures.push_back(c.to_string());
  }
  // The DONEs have left before sync returns: a caller that closes the consumer right
  // after (its last sync) must not cancel them in its transport's queue, or producers
  // would count this consumer as having missed a version it holds. Bounded; a producer
  // that died meanwhile does not matter here.
  wait_all(dones, std::min<std::chrono::milliseconds>(opts.timeout, std::chrono::milliseconds(2000))).ignore();
  trace.record(TracePhase::kCommit, -1, -1, tc, Clock::now());
  if (opts.commit == CommitPolicy::kShadow && commit_it) {
    Result<double> c = commit();
    if (!c.ok()) {
      finish_report(c.status());
      return c.status();
    }
    rep.committed = true;
    rep.commit_seconds = *c;
  }
  rep.seconds = seconds_since(t0);
  rep.memory = memory_use();
  finish_report(Status::Ok());
  if (opts.after_sync) opts.after_sync(v);
  return rep;
}


Consumer::Consumer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Consumer::~Consumer() = default;
Result<SyncReport> Consumer::sync(uint64_t version) { return impl_->sync(version, true); }
Result<SyncReport> Consumer::sync(uint64_t version, bool commit) { return impl_->sync(version, commit); }
Result<double> Consumer::commit() { return impl_->commit(); }
Status Consumer::discard() {
  FERRY_RETURN_IF_ERROR(impl_->param_set->discard());
  return impl_->publish_versions();
}
const SyncReport& Consumer::last_report() const { return impl_->last; }
ConsumerState Consumer::state() const { return impl_->param_set->state(); }
const TensorMap& Consumer::params() const { return impl_->param_set->committed(); }
const Routes& Consumer::routes() const { return impl_->routes; }
int Consumer::rank() const { return impl_->rank; }
bool engine::TestAccess::knows_failed(Consumer& c, int p) {
  std::lock_guard<std::mutex> lk(c.impl_->mu);
  return c.impl_->failed.count(p) > 0 || !c.impl_->peers[p].connected;
}

bool engine::TestAccess::knows_dropped(Consumer& c, uint64_t version) {
  std::lock_guard<std::mutex> lk(c.impl_->mu);
  auto d = c.impl_->dropped_versions.lower_bound({version, 0});
  return d != c.impl_->dropped_versions.end() && d->first.first == version;
}

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

}  // namespace ferry
