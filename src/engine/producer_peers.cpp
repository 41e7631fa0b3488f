// Producer: its creation (claim, rendezvous, staging ring, lease); its consumers: their
// leases and connections (admit, refresh_membership), their messages and failures,
// drops and what the report says of them, routes and memory. Impl (and what each method
// does): engine/producer_impl.h.
#include "engine/cuda_ipc.h"  // host_identity
#include "engine/producer_impl.h"

namespace ferry {

Status Producer::Impl::send(PeerId to, const Message& m) {
  auto sent = transport.send(to, kEngineTag, encode_message(m));
  if (!sent.ok()) note_local_failure(sent.status());
  return sent.status();
}

void Producer::Impl::drop_locked(int c, const std::string& why, std::vector<int>* notify) {
  if (!members.member(c)) return;
  report.dropped.push_back(c);
  trace.control(ControlKind::kDrop, c, -1, fmt::format("producer {} dropped consumer {}: {}", rank, c, why));
  members.drop_reason[c] = why;
  if (notify) notify->push_back(c);
  forget_member_locked(c);
}

void Producer::Impl::forget_member_locked(int c) {
  members.live[static_cast<size_t>(c)] = false;
  for (auto& s : slots) {
    s.pending.erase(c);
    s.pushing.erase(c);
  }
  cv.notify_all();
}

std::set<int> Producer::Impl::leavers(uint64_t v) {
  std::set<int> left = roll.left(), ask;
  {
    std::lock_guard<std::mutex> lk(mu);
    for (int c = 0; c < opts.num_consumers; ++c)
      if (!left.count(c) && !members.committed(c, v)) ask.insert(c);
  }
  for (int c : ask) {  // (a member at the start that left during the sync)
    auto l = roll.has_left(c);
    if (l.ok() && *l) left.insert(c);
  }
  return left;
}

void Producer::Impl::note_missed_locked(uint64_t v, const std::set<int>& left) {
  std::vector<bool> served(static_cast<size_t>(opts.num_consumers), false);
  for (const ProducerGroupSchedule& gs : schedule.groups) {
    for (int c = 0; c < opts.num_consumers; ++c) {
      if (gs.served.count(cls(c))) served[static_cast<size_t>(c)] = true;
    }
  }
  const std::set<int> dropped(report.dropped.begin(), report.dropped.end());
  for (int c = 0; c < opts.num_consumers; ++c) {
    if (!served[static_cast<size_t>(c)] || members.committed(c, v)) continue;
    if (left.count(c)) {
      report.left.push_back(c);
      continue;
    }
    report.missed.push_back(c);
    if (dropped.count(c)) continue;
    if (!members.member(c)) {
      trace.control(ControlKind::kMissed, c, -1, fmt::format("producer {}: consumer {} is not a member of sync {} (no live lease {})",
                                            rank, c, v, keys.consumer(c)));
    } else {
      trace.control(ControlKind::kMissed, c, -1, fmt::format("producer {}: consumer {} did not confirm it committed sync {} within "
                                            "stall_timeout {} ms", rank, c, v, opts.stall_timeout.count()));
    }
  }
}

void Producer::Impl::send_dropped(const std::vector<int>& cs, uint64_t v) {
  for (int c : cs) {
    PeerId id;
    std::string why;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!peers[c].connected) continue;
      id = peers[c].id;
      why = members.drop_reason[c];
    }
    send(id, Dropped{static_cast<uint32_t>(rank), v, routes_hash, why}).ignore();
  }
}

void Producer::Impl::send_routes_notice(uint64_t v) {
  std::vector<PeerId> to;
  {
    std::lock_guard<std::mutex> lk(mu);
    for (int c = 0; c < opts.num_consumers; ++c) {
      if (!members.member(c) || !peers[c].connected || members.committed(c, v)) continue;
      if (auto it = members.consumer_hash.find(c); it != members.consumer_hash.end() && it->second == routes_hash) continue;
      to.push_back(peers[c].id);
    }
  }
  const RoutesNotice m{static_cast<uint32_t>(rank), v, routes_hash};
  for (PeerId id : to) transport.send(id, kEngineTag, encode_message(m)).status().ignore();
}

bool Producer::Impl::own_transport_dead(std::unique_lock<std::mutex>& lk) {
  Status h = transport.health();
  if (h.ok()) return false;
  lk.unlock();
  note_local_failure(h);
  lk.lock();
  return !local_failure.ok();
}

void Producer::Impl::note_local_failure(const Status& st) {
  if (st.code() != StatusCode::kCancelled && st.code() != StatusCode::kFailedPrecondition) return;
  std::lock_guard<std::mutex> lk(mu);
  if (local_failure.ok()) local_failure = st.with_context(fmt::format("producer {}: its transport failed", rank));
  cv.notify_all();
}

void Producer::Impl::on_message(PeerId from, std::span<const std::byte> payload) {
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
    const bool current = members.in_sync && mv == members.version;
    if (current && known && (std::holds_alternative<Release>(msg) || std::holds_alternative<Ready>(msg) ||
                    std::holds_alternative<Join>(msg))) {
      members.consumer_progress[c] = Clock::now();  // its straggler clock restarts (wait_slot)
      cv.notify_all();
    }
    if (std::holds_alternative<Leave>(msg)) {
      // It left the job on purpose: nobody waits for it (leavers() then reports it left),
      // nor counts it a member again (a roll call that still found its lease).
      members.left_instance[c] = peers[c].instance;
      if (members.member(c)) forget_member_locked(c);
      return;
    }
    if (std::holds_alternative<Join>(msg)) {
      if (!current && mv > members.version) members.early_join[c] = mv;
      return;
    }
    if (const auto* m = std::get_if<Release>(&msg)) {
      if (!current) return;
      const int s = slot_of_locked(m->group, m->routes);
      if (s >= 0) release_locked(s, c, m->took);
    } else if (const auto* m = std::get_if<Failover>(&msg)) {
      if (opts.mode == SyncMode::kPush) {
        // Reply FLUSHED once no write of ours to c is in flight: c reuses its receive
        // slots for the new routes only then. (Below, c leaves every slot of other
        // routes, so no new write of those starts.)
        if (pushes.inflight[c] == 0) {
          flushed = std::make_pair(m->version, m->routes);
        } else {
          pushes.flushed_owed[c] = {m->version, m->routes};
        }
      }
      if (!current) {
        // A later version's (this producer is not in it yet, or still in the one
        // before): applied when that sync starts.
        if (m->version > members.version) members.early_failover[c] = {m->version, m->routes};
      } else {
        // c abandoned its attempt: it reads none of the slots it had pending.
        members.consumer_hash[c] = m->routes;
        members.consumer_joined[c] = Clock::now();
        cv.notify_all();  // its straggler clock (wait_slot) starts now
        const bool behind = restart.abandoned.count(m->routes) > 0;
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
          restart.asked = true;
          restart.routes = m->routes;
          cv.notify_all();
        }
      }
    } else if (const auto* m = std::get_if<Done>(&msg)) {
      members.done[c] = m->version;  // (not max: a rollback commits an older version)
      members.done_at[c] = Clock::now();
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
        if (pushes.inflight[c] == 0) {
          flushed = std::make_pair(m->version, m->routes);
        } else {
          pushes.flushed_owed[c] = {m->version, m->routes};
        }
      }
      if (current) {
        drop_locked(c, aborted_because(m->reason), nullptr);
      } else if (!members.in_sync && m->version > members.version) {
        members.early_abort[c] = {m->version, m->reason};
      } else if (members.in_sync && m->version > members.version) {
        // It gave up a later version than ours: it is not in this sync (a version
        // mismatch), so waiting for it would only hold the slots to the stall timeout.
        drop_locked(c, fmt::format("it synced version {}, not this sync's {}", m->version, members.version), nullptr);
      }
    } else if (const auto* m = std::get_if<Ready>(&msg)) {
      // A consumer may ask before this producer's sync of that version started.
      if (members.in_sync && m->version < members.version) return;
      // ... but only once it committed ours: one that asks for a later version while a
      // member of this sync syncs another version than ours (a caller's mismatch).
      // Drop it, and tell it under its own version so that it fails now, naming both.
      if (known && members.in_sync && m->version > members.version && !members.committed(c, members.version) &&
          members.member(c)) {
        const std::string why = fmt::format("it syncs version {} but this producer serves version {}", m->version, members.version);
        drop_locked(c, why, nullptr);
        mismatch_drop = Dropped{static_cast<uint32_t>(rank), m->version, routes_hash, why};
      }
      if (m->recv_slot >= kReceiveSlots) return;  // not a slot of the consumer's ring
      if (pushes.ready.size() > 100000) return;
      const Peer& p = peers[c];
      if (known &&
          (m->landing > 1 || (m->landing == 1 && p.other_param_regions.size() != p.param_regions.size()))) {
        // A set its lease does not publish: the writes meant for its params would miss them.
        const std::string why = fmt::format("its READY names param set {}, which its lease does not publish",
                                            int(m->landing));
        if (current) drop_locked(c, why, nullptr);
        mismatch_drop = Dropped{static_cast<uint32_t>(rank), m->version, routes_hash, why};
      } else {
        pushes.ready[{m->version, m->group, c}] = ReadyFrom{from, m->recv_slot, m->routes, m->landing, m->base};
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

void Producer::Impl::on_peer_failure(PeerId peer, const Status& why) {
  std::lock_guard<std::mutex> lk(mu);
  const std::optional<int> failed = peers.fail(peer);  // (one not mapped yet: refresh_membership refuses it)
  if (!failed) return;
  const int c = *failed;
  // One that committed this sync (DONE) and then closed is not dropped: nothing is
  // missed and the report names no one (issue 30: it said ok while naming a consumer
  // that closed right after syncing). Nor is one that died between refresh and the
  // sync: neither is waited for.
  if (members.in_sync && !members.committed(c, members.version)) {
    drop_locked(c, "transport: " + why.to_string(), nullptr);
  } else if (static_cast<size_t>(c) < members.live.size()) {
    members.live[static_cast<size_t>(c)] = false;
  }
}

Status Producer::Impl::apply_routes(Routes r) {
  FERRY_RETURN_IF_ERROR(check_routes_hold(r, route_state.router()).with_context(fmt::format("producer {}", rank)));
  FERRY_ASSIGN_OR_RETURN(auto sched, make_producer_schedule(r, rank, own_holdings(), staging->in_place(), staging->slot_bytes()));
  FERRY_ASSIGN_OR_RETURN(Pacer pace, Pacer::make(r, rank, GroupOrderOptions{opts.group_order, true,
                                                                           relay_groups(route_state.inputs(), r.consumer_plan)}));
  std::lock_guard<std::mutex> lk(mu);
  pacer = std::move(pace);
  routes = std::move(r);
  routes_hash = routes.fingerprint();
  schedule = std::move(sched);
  delta->install(routes.producers[static_cast<size_t>(rank)]);
  return Status::Ok();
}

MemoryUse Producer::Impl::memory_use() {
  MemoryUse m = routes_memory_use();
  m.metadata += plan.heap_bytes();
  m.metadata += pacer.heap_bytes();  // the rotated order's waves (docs/group-order.md, "Memory")
  m.kept_copy += delta->state_bytes();  // (delta_block_bytes: its block hashes, filled as it packs)
  return m;
}

MemoryUse Producer::Impl::routes_memory_use() {
  if (memory_cache.routes != routes_hash || memory_cache.epoch != roll.epoch()) {
    MemoryUse m;
    m.kept_copy = staging->kept_bytes();
    m.staging_ring = staging->host_bytes() - m.kept_copy;
    for (const MemoryRegion& r : regions_served_in_place(opts.source_regions, delta->on()))
      m.registered_in_place += r.length;
    const RouteInputs& in = route_state.inputs();
    m.metadata = metadata_heap_bytes(routes, in.metadata, in.holdings, in.plans) + schedule_heap_bytes(schedule) +
                 staging->in_place().boxes.capacity() * sizeof(InPlaceTable::At);
    memory_cache.use = m;
    memory_cache.routes = routes_hash;
    memory_cache.epoch = roll.epoch();
  }
  return memory_cache.use;
}

Status Producer::Impl::refresh_routes() {
  return route_state.refresh([this](Routes r) { return apply_routes(std::move(r)); });
}

bool Producer::Impl::admit(int c, const std::string& raw) {
  auto lease = decode_consumer_lease(raw);
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
    p.host = lease->host;
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
  return true;
}

void Producer::Impl::refresh_membership(uint64_t v, bool store_lost_keys) {
  // Consumers it serves that are still connected from an earlier sync but have no
  // lease: paused past the ttl, or every lease lapsed because the store paused or
  // restarted. A live one heals its lease within ttl/3 of resuming (Lease), so the roll
  // call waits up to one lease_ttl for it before leaving it out of v; one still paused
  // is told at once that it is not a member of v, so that it fails v as soon as it
  // resumes instead of waiting out `timeout` for announcements that never come, and
  // rejoins at the next sync. (A dead one is not connected: the transport reported it.)
  auto counted_on = [&](int c) {
    std::lock_guard<std::mutex> lk(mu);
    if (!(peers[c].connected || store_lost_keys)) return false;
    bool serves = false;
    for (const ProducerGroupSchedule& gs : schedule.groups) serves |= gs.served.count(cls(c)) > 0;
    return serves;
  };
  std::vector<bool> now(static_cast<size_t>(roll.size()), false);
  if (auto leases = roll.call(counted_on); leases.ok()) {  // (the store unreachable: no consumer is a member)
    for (int c = 0; c < roll.size(); ++c) {
      const std::optional<std::string>& lease = (*leases)[static_cast<size_t>(c)];
      now[static_cast<size_t>(c)] = lease && admit(c, *lease);
    }
  }
  std::vector<int> left_out;  // (not those that left on purpose: nobody waits for them)
  for (int c = 0; c < roll.size(); ++c)
    if (!now[static_cast<size_t>(c)] && !roll.left().count(c) && counted_on(c)) left_out.push_back(c);
  if (store_lost_keys) {  // told only if connected: one never reached may be dead
    std::lock_guard<std::mutex> lk(mu);
    std::erase_if(left_out, [&](int c) { return !peers[c].connected; });
  }
  std::unique_lock<std::mutex> lk(mu);
  for (int c = 0; c < roll.size(); ++c) {
    if (!peers[c].connected) now[static_cast<size_t>(c)] = false;  // failed since connecting
    auto gone = members.left_instance.find(c);  // an instance that said it left
    if (gone == members.left_instance.end()) continue;
    if (gone->second == peers[c].instance) {
      now[static_cast<size_t>(c)] = false;
    } else if (now[static_cast<size_t>(c)]) {
      members.left_instance.erase(gone);  // another instance of the rank joined
    }
  }
  members.live = now;
  report.epoch = roll.epoch();
  report.joined = roll.joined();
  for (int c : left_out) {
    members.drop_reason[c] = fmt::format("not a member of sync {}: no live lease {} within lease_ttl {} ms of its start "
                                 "(paused?); rejoin at the next sync", v, keys.consumer(c), opts.lease_ttl.count());
  }
  lk.unlock();
  send_dropped(left_out, v);
}

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
    if (options.delta_block_bytes != 0 && options.delta_block_bytes < kMinDeltaBlockBytes)
      return invalid_argument(
          "producer {}: delta_block_bytes {} is below {} (a hash of 8 bytes per block would take more memory than "
          "the copy it replaces saves); 0 keeps a copy instead",
          m.rank, options.delta_block_bytes, kMinDeltaBlockBytes);
    FERRY_ASSIGN_OR_RETURN(m.reg.claim, claim_rank(store, m.keys, options, me, m.reg.instance));
    FERRY_RETURN_IF_ERROR(StagingRing::check_device(m.rank, options.staging_device));  // before any rendezvous
    FERRY_RETURN_IF_ERROR(publish_world(store, m.keys, options, me));
    FERRY_ASSIGN_OR_RETURN(const Holdings holdings, source.holdings(m.rank));  // (then route_state's inputs)
    const std::string meta = encode_decls(source.metadata());
    {  // (before the holdings: whoever sees them sees this too)
      const std::string key = m.keys.host(me.role, m.rank);
      FERRY_ASSIGN_OR_RETURN(std::string host, publish_once(store, key, host_identity()));
      m.reg.published.emplace_back(key, std::move(host));
    }
    if (m.rank == 0) m.reg.published.emplace_back(m.keys.meta(), meta);
    m.reg.published.emplace_back(m.keys.holdings(m.rank), encode_holdings(holdings));
    for (const auto& [key, value] : m.reg.published) FERRY_RETURN_IF_ERROR(store.set(key, value));
    // A restarted producer is alive again: take it out of the dead set (put back below
    // if this create fails: the store must never say alive a producer with no lease).
    if (options.failover) {
      was_dead = store.get(m.keys.dead(m.rank)).ok();
      store.remove(m.keys.dead(m.rank)).status().ignore();
    }
    FERRY_ASSIGN_OR_RETURN(auto inputs, rendezvous_inputs(store, m.keys, options, me, source.metadata()));
    // As this producer runs them: delta off where every rank met on one host (delta_runs).
    ProducerOptions run = options;
    run.delta = delta_runs(options, inputs);
    FERRY_ASSIGN_OR_RETURN(auto routes, m.route_state.start(std::move(inputs)));
    {
      // Within staging_budget: worst-case slots when it holds them, else as large as it
      // allows (memory.h, staging_ring).
      const uint64_t worst = producer_slot_bytes(routes, m.rank, m.route_state.inputs().metadata,
                                                 m.route_state.inputs().holdings, options.failover);
      const uint64_t needed = producer_slot_bytes(routes, m.rank, {}, false);
      FERRY_ASSIGN_OR_RETURN(StagingSlots sr, staging_ring(m.rank, needed, worst, options.staging_budget));
      // What is served in place, and delta's kept copy after the slots.
      StagingRingOptions so{m.rank,
                            sr.slot_bytes,
                            sr.slots,
                            options.staging_device,
                            regions_served_in_place(options.source_regions, run.delta),
                            options.direct_min_bytes,
                            options.checksums,
                            delta_kept_bytes(run, routes.producers[static_cast<size_t>(m.rank)], sr)};
      FERRY_ASSIGN_OR_RETURN(m.staging, StagingRing::create(m.ring_memory, source, m.own_holdings(), so));
    }
    m.delta = std::make_unique<DeltaEncoder>(*m.staging, run);
    FERRY_RETURN_IF_ERROR(m.apply_routes(std::move(routes)));
    m.slots.resize(static_cast<size_t>(m.staging->slots()));
    m.peers.resize(options.num_consumers);
    m.members.live.assign(static_cast<size_t>(options.num_consumers), false);
    Impl* self = impl.get();
    transport.set_message_handler([self](PeerId from, uint32_t tag, std::span<const std::byte> payload) {
      if (tag == kEngineTag) self->on_message(from, payload);
    });
    transport.set_peer_failure_handler([self](PeerId peer, const Status& why) { self->on_peer_failure(peer, why); });
    const std::string blob =
        encode_lease(ProducerLease{bytes_to_string(transport.address()), m.staging->host_key(), m.staging->slot_bytes(),
                                   m.staging->in_place().encode(), m.staging->cuda_ipc()});
    FERRY_ASSIGN_OR_RETURN(m.reg.lease, store.hold_lease(m.keys.producer(m.rank), blob, options.lease_ttl));
    m.reg.lease_value = blob;
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
  publish_failure(store, m.keys, options, me, m.reg.instance, joined);
  FERRY_RETURN_IF_ERROR(joined);
  return std::unique_ptr<Producer>(new Producer(std::move(impl)));
}

}  // namespace ferry
