// Producer: the staging slots' readers: announcements (pull) and pushes, releases, the
// turns of the rotated order (Pacer), and the wait for a free slot that drops
// stragglers and stalled consumers (engine/straggler.h). Impl (and what each method
// does): engine/producer_impl.h.
#include "engine/producer_impl.h"

namespace ferry {

int Producer::Impl::slot_of_locked(int g, uint64_t hash) {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].group == g && slots[i].packed && slots[i].hash == hash) return static_cast<int>(i);
  }
  return -1;
}

uint64_t Producer::Impl::served(const std::map<uint32_t, uint64_t>& by_class, uint32_t cls) {
  auto it = by_class.find(cls);
  return it == by_class.end() ? 0 : it->second;
}

void Producer::Impl::release_locked(int s, int c, uint8_t took) {
  Slot& sl = slots[static_cast<size_t>(s)];
  if (sl.pending.erase(c)) {
    sl.last_release = Clock::now();
    const ProducerGroupSchedule& gs = schedule.groups[static_cast<size_t>(sl.group)];
    const uint64_t b = served(gs.served, cls(c)), ip = served(gs.served_in_place, cls(c));
    Clock::time_point from = sl.since;  // from its turn
    pacer.note_released(c, sl.group);
    if (auto o = sl.opened.find(c); o != sl.opened.end()) from = o->second;
    if (took == Release::kRelayed) {  // c copied the group from a relay on its host: nothing went to it from here
      cv.notify_all();
      return;
    }
    const uint64_t patch = took != Release::kDense ? sl.patches.bytes_for(cls(c)).value_or(0) : 0;
    if (patch > 0) {
      trace.record(TracePhase::kSend, sl.group, c, from, *sl.last_release, TraceLane::kPatch, patch);
      if (took == Release::kPatch) report.patched_dense_bytes += b - ip;
    }
    if ((patch == 0 || took == Release::kRepaired) && (b > ip || ip == 0)) {
      trace.record(TracePhase::kSend, sl.group, c, from, *sl.last_release, TraceLane::kTransport, b - ip);
    }
    if (ip > 0) trace.record(TracePhase::kSend, sl.group, c, from, *sl.last_release, TraceLane::kInPlace, ip);
    cv.notify_all();
  }
}

void Producer::Impl::push_done(int c) {
  PeerId to = 0;
  uint64_t v = 0, hash = 0;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (--pushes.inflight[c] > 0) return;
    auto it = pushes.flushed_owed.find(c);
    if (it == pushes.flushed_owed.end() || !peers[c].connected) return;
    v = it->second.first;
    hash = it->second.second;
    pushes.flushed_owed.erase(it);
    to = peers[c].id;
  }
  send_flushed(to, v, hash);
}

void Producer::Impl::send_flushed(PeerId to, uint64_t v, uint64_t hash) {
  transport.send(to, kEngineTag, encode_message(Flushed{static_cast<uint32_t>(rank), v, hash})).status().ignore();
}

bool Producer::Impl::read_finished_locked(const ServedRead& r) const {
  if (!members.member(r.consumer)) return true;
  if (members.committed(r.consumer, members.version)) return true;
  if (auto h = members.consumer_hash.find(r.consumer); h != members.consumer_hash.end() && h->second != routes_hash) return true;
  if (static_cast<size_t>(r.group) >= plan.groups.size()) return true;
  const std::vector<int>& t = plan.groups[static_cast<size_t>(r.group)].targets;
  return !std::binary_search(t.begin(), t.end(), r.consumer);
}

Announce Producer::Impl::announce_locked(const Slot& sl, int c, size_t s) {
  Announce m{static_cast<uint32_t>(rank), members.version, sl.group, sl.hash, staging->slot_offset(s), std::nullopt};
  if (opts.checksums) m.checksum = served(sl.checksum, cls(c));
  if (auto pb = sl.patches.bytes_for(cls(c))) {
    m.patch_base = sl.patches.base;
    m.patch_bytes = *pb;
    m.patch_offset = sl.patches.patch_offset;
    m.dense_offset = sl.patches.dense_offset;
  }
  return m;
}

std::optional<Producer::Impl::Serve> Producer::Impl::turn_came_locked(int s, int c) {
  Slot& sl = slots[static_cast<size_t>(s)];
  if (!sl.pending.count(c) || sl.opened.count(c)) return std::nullopt;
  sl.opened[c] = Clock::now();
  Serve out{s, c, sl.group, members.version, sl.hash, peers[c].id};
  if (opts.mode == SyncMode::kPull) {
    out.announce = announce_locked(sl, c, static_cast<size_t>(s));
    return out;
  }
  auto it = pushes.ready.find({members.version, sl.group, c});
  if (it == pushes.ready.end() || it->second.from != out.id || it->second.hash != sl.hash) return std::nullopt;
  out.push = true;
  out.recv_slot = it->second.slot;
  out.landing = it->second.landing;
  return out;
}

std::vector<Producer::Impl::Serve> Producer::Impl::open_waves_locked() {
  std::vector<Serve> out;
  if (!members.in_sync || plan.routes_hash != routes_hash) return out;
  for (const ServedRead& r : pacer.open([this](const ServedRead& x) { return read_finished_locked(x); })) {
    const int s = slot_of_locked(r.group, routes_hash);
    if (s < 0) continue;
    if (auto sv = turn_came_locked(s, r.consumer)) out.push_back(*sv);
  }
  return out;
}

void Producer::Impl::serve(const std::vector<Serve>& todo) {
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

void Producer::Impl::start_push(int s, int c, uint32_t rslot, uint8_t landing, int g, uint64_t v) {
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
    if (!members.in_sync || members.version != v || sl.group != g || sl.hash != routes_hash || !sl.pending.count(c) ||
        sl.pushing.count(c))
      return;
    sl.pushing.insert(c);
    hash = sl.hash;
    ++pushes.inflight[c];
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
      auto rf = pushes.ready.find({v, g, c});
      const Read* read = single_read_from(routes.consumer(static_cast<size_t>(c)).groups[static_cast<size_t>(g)],
                                          static_cast<uint32_t>(rank));
      if (rf != pushes.ready.end() && rf->second.base == sl.patches.base && read && *pb <= read->length) {
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
    if (members.version == v) drop_locked(c, "push failed: " + st.to_string(), nullptr);
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
          if (members.version == v && sl.group == g && sl.hash == hash) release_locked(s, c, patch_base ? Release::kPatch : Release::kDense);
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

void Producer::Impl::forget_ready_locked(int c, uint64_t v) {
  for (auto it = pushes.ready.lower_bound({v, std::numeric_limits<int>::min(), std::numeric_limits<int>::min()});
       it != pushes.ready.end() && std::get<0>(it->first) == v;) {
    it = std::get<2>(it->first) == c ? pushes.ready.erase(it) : std::next(it);
  }
}

Status Producer::Impl::wait_slot(size_t s, bool stop_on_restart) {
  std::vector<int> n;
  std::unique_lock<std::mutex> lk(mu);
  if (!local_failure.ok()) return local_failure;
  while (!slots[s].pending.empty() && !(stop_on_restart && restart.to_other_than(routes_hash)) &&
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
    // A stop of ours that ended while we waited is seen after the wait, before any
    // verdict: the loop judges again, every clock restarted from the resume.
    const std::optional<Clock::time_point> resumed = pause_watch.last_resume();
    auto resumed_while_waiting = [&] { return pause_watch.last_resume() != resumed; };
    auto stall_from = [&](int c) -> std::optional<Clock::time_point> {
      Clock::time_point from = slots[s].since;
      if (any_open) {
        auto o = slots[s].opened.find(c);
        if (o == slots[s].opened.end()) return std::nullopt;  // its turn has not come
        from = o->second;
      }
      if (resumed) from = std::max(from, *resumed);
      if (auto pr = members.consumer_progress.find(c); pr != members.consumer_progress.end()) from = std::max(from, pr->second);
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
    const StragglerPolicy policy = straggler_policy();
    RoutesKnown known{routes_hash, &members.consumer_hash, &members.consumer_joined, members.undeclared_hash};
    known.progress = &members.consumer_progress;
    known.resumed = resumed;
    if (pace_slot) known.opened = &slots[s].opened;
    auto pace = [&] { return SlotPace{slots[s].group, slots[s].hash, slots[s].since, slots[s].last_release}; };
    const Clock::duration bound = slots[s].last_release ? straggler_bound(policy, pace()) : Clock::duration{};
    if (auto at = next_straggler(policy, bound, pace(), known, slots[s].pending, deadline)) {
      if (cv.wait_until(lk, std::min(*at, probe_at)) == std::cv_status::timeout && Clock::now() >= *at &&
          slots[s].last_release && !slots[s].pending.empty() && !resumed_while_waiting()) {
        for (const auto& [c, why] : stragglers(policy, bound, pace(), known, slots[s].pending, Clock::now()))
          drop_locked(c, why, &n);
      }
      continue;
    }
    if (cv.wait_until(lk, std::min(deadline, probe_at)) == std::cv_status::timeout && Clock::now() >= deadline &&
        !resumed_while_waiting()) {
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
  const uint64_t v = members.version;
  lk.unlock();
  send_dropped(n, v);
  std::lock_guard<std::mutex> relock(mu);
  return local_failure;
}

}  // namespace ferry
