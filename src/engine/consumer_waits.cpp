// Consumer: its waits for producers (announcements, pushes, a restarted producer, the
// FLUSHED answers to its FAILOVERs and ABORTs), each through the one wait loop
// (engine/wait_loop.h), and the checks that end them (a producer failed, lost by its
// lease, moved on or serving another version). Impl and what lives where:
// engine/consumer_impl.h.
#include <thread>

#include "engine/consumer_impl.h"

namespace ferry {

Status Consumer::Impl::version_mismatch_locked(uint64_t v, const std::set<int>& from) {
  auto mismatch = [&](int p, uint64_t mv) {
    syncs.mismatched.insert(mv);
    if (syncs.mismatched.size() > 64) syncs.mismatched.erase(syncs.mismatched.begin());
    return failed_precondition(
        "consumer {} syncs version {} but producer {} serves version {}: every rank of the job must sync the "
        "same version",
        rank, v, p, mv);
  };
  for (const auto& [p, mv] : syncs.behind) {
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
  FERRY_RETURN_IF_ERROR(dropped_locked(v));
  return version_mismatch_locked(v, from);
}

Status Consumer::Impl::dropped_locked(uint64_t v) {
  for (auto d = syncs.dropped.lower_bound({v, 0}); d != syncs.dropped.end() && d->first.first == v; ++d) {
    if (!route_state.dead().count(d->first.second))
      return cancelled("consumer {} was dropped from sync {} by {}", rank, v, d->second);
  }
  return Status::Ok();
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
        if (std::get<0>(key) == v && e.routes != routes_hash && !attempts.old_hashes.count(e.routes)) {
          foreign = std::make_pair(e.routes, std::get<2>(key));
          break;
        }
      }
      if (!foreign) break;
      lk.unlock();
      auto stored = route_state.read_dead();
      lk.lock();
      if (!stored.ok() || *stored != route_state.dead()) {
        attempts.switch_routes = true;
        return Answer(unavailable("consumer {}: producer {} switched routes for sync {}", rank, foreign->second, v));
      }
      attempts.old_hashes.insert(foreign->first);
    }
    for (int p : from) {
      if (const std::optional<Status>& f = peers[p].failure) {
        attempts.failed_p = p;
        return Answer(peer_failed("producer {} failed during sync {} (group {}): {}", p, v, g, f->to_string()));
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
  auto keepalive = [&] { join_producers(v, from); };
  auto check = [&]() -> std::optional<Answer> {
    const int lost = lost_producer(from, lapses);
    if (lost < 0) return std::nullopt;
    attempts.failed_p = lost;
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
  using std::chrono::milliseconds;
  const auto deadline = Clock::now() + opts.timeout;
  const bool watch = opts.failover && opts.lease_ttl.count() > 0;
  LapseWatch lapses;
  auto next_check = Clock::now() + opts.lease_ttl;
  // Reads pending at p hold this consumer in the sync as an announcement does
  // (await_any): JOINs to the other producers each keepalive_every keep it from being
  // dropped there as a straggler for p's pause (issue 49, finding 1: a producer stopped
  // mid-read held one consumer, and a healthy producer dropped it 2 x lease_ttl later).
  const bool others = opts.num_producers > 1;
  Clock::time_point held_until{};
  if (opts.test_hooks && opts.test_hooks->hold_reads) held_until = Clock::now() + opts.test_hooks->hold_reads(v, g, p);
  for (;;) {
    const auto now = Clock::now();
    auto until = deadline;
    if (watch) until = std::min(until, next_check);
    if (others) until = std::min(until, now + keepalive_every());
    const auto slice = std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(until - now));
    Status st;
    if (now < held_until) {
      std::this_thread::sleep_for(std::min<Clock::duration>(slice, held_until - now));
      st = timeout_error("reads held (test hook)");
    } else {
      st = wait_all(ops, slice);
    }
    if (st.code() != StatusCode::kTimeout || Clock::now() >= deadline) return st;
    if (others) join_producers(v, {p});
    if (watch && Clock::now() >= next_check) {
      next_check = Clock::now() + opts.lease_ttl;
      if (lost_producer({p}, lapses) == p)
        return peer_failed("producer {} lost during sync {} (group {}): reads pending and its lease {} gone for over "
                           "{} ms (cut off or paused)", p, v, g, keys.producer(p), opts.lease_ttl.count());
    }
  }
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

// A read that failed because this consumer's own transport died is its failure, not the
// producer's: naming the producer would fail over a healthy one (and, with a DP replica,
// mark it dead for every rank).
Status Consumer::Impl::posted(const AttemptReads& reads, Status st) {
  if (st.ok()) return st;
  if (Status own = own_transport_health(); !own.ok()) return own;
  attempts.failed_p = reads.failed_producer();
  return st;
}

Status Consumer::Impl::waited(std::span<const Completion> ops, int p, uint64_t v, int g) {
  Status st = wait_reads(ops, p, v, g);
  if (st.ok()) return st;
  if (Status own = own_transport_health(); !own.ok()) return own;
  attempts.failed_p = p;
  return Status(st.code(), fmt::format("consumer {} reading group {} from producer {}: {}", rank, g, p, st.message()));
}

Status Consumer::Impl::await_restart(uint64_t v, int p, Clock::time_point deadline) {
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
  auto keepalive = [&] { join_producers(v, {p}); };
  auto check = [&]() -> std::optional<Status> {
    auto blob = store.get(keys.producer(p));
    if (blob.ok() && *blob != gone) {
      trace.control(ControlKind::kRestart, p, -1, fmt::format("consumer {}: producer {} was gone as sync {} began (no DP replica); a "
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

template <typename Late>
Status Consumer::Impl::await_flushed(uint64_t v, const std::vector<int>& from, bool cancel_on_crash, Late late) {
  std::unique_lock<std::mutex> lk(mu);
  const auto deadline = Clock::now() + opts.timeout;
  auto next_keepalive = Clock::now() + keepalive_every();
  for (int p : from) {
    while (!route_state.dead().count(p) && !peers[p].failure && peers[p].connected) {
      if (Clock::now() >= next_keepalive) {  // held up by p: the others hear it moves (await_any)
        lk.unlock();
        join_producers(v, {p});
        lk.lock();
        next_keepalive = Clock::now() + keepalive_every();
        continue;  // (the state may have changed meanwhile)
      }
      auto it = push.flushed_from.find(p);
      if (it != push.flushed_from.end() && it->second == std::make_pair(v, routes_hash)) break;
      if (crashed) return cancel_on_crash ? cancelled("consumer {} crashed (test hook)", rank) : Status::Ok();
      // Our own transport dead: no FLUSHED can come, and no write can land any more.
      if (Status h = own_transport_health(); !h.ok()) return cancel_on_crash ? h : Status::Ok();
      const auto probe_at = std::min(Clock::now() + health_probe_every(opts.lease_ttl), next_keepalive);
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
    from.assign(push.readied.begin(), push.readied.end());
  }
  FERRY_RETURN_IF_ERROR(await_flushed(v, from, true, [&](int p) {
    return timeout_error("consumer {}: producer {} did not confirm within {} ms that its writes of abandoned "
                         "routes into this consumer's receive ring ended (sync {})", rank, p, opts.timeout.count(), v);
  }));
  std::lock_guard<std::mutex> lk(mu);
  push.readied.clear();
  push.unanswered.clear();
  return Status::Ok();
}

Status Consumer::Impl::wait_aborted_writes(uint64_t v) {
  if (opts.mode != SyncMode::kPush) return Status::Ok();
  std::vector<int> from;
  for (const auto& [p, n] : push.unanswered) {
    if (n > 0) from.push_back(p);
  }
  return await_flushed(v, from, false, [&](int p) {
    return timeout_error("consumer {}: producer {} did not confirm within {} ms, after this consumer gave up "
                         "sync {}, that its writes into this consumer's receive ring and params ended",
                         rank, p, opts.timeout.count(), v);
  });
}

}  // namespace ferry
