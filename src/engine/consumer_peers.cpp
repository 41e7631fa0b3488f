// Consumer: joining the job and keeping track of the producers (create/start, their
// leases and connections, messages and failures, routes and schedule). Impl:
// engine/consumer_impl.h.
#include "engine/consumer_impl.h"

namespace ferry {

void Consumer::Impl::on_message(PeerId from, std::span<const std::byte> payload) {
  auto decoded = decode_message(payload);
  if (!decoded.ok()) return;
  const Message& msg = *decoded;
  if (const auto* m = std::get_if<Relay>(&msg)) return on_relay(from, *m);  // between consumers (relay within a host)
  if (const auto* m = std::get_if<Replica>(&msg)) return replicas->on_message(from, *m);  // a joiner, or its source
  std::lock_guard<std::mutex> lk(mu);
  const int p = static_cast<int>(sender_of(msg));
  if (p < 0 || p >= opts.num_producers) return;
  const bool known = peers.made_for(from, p);
  const uint64_t mv = version_of(msg);
  auto keep = [&](int group, const Arrival& a) {
    if (syncs.syncing && mv != *syncs.syncing && (syncs.attempted.count(mv) || syncs.mismatched.count(mv)))
      return false;  // of a sync this instance already ran or gave up: stale
    if (syncs.syncing && mv < *syncs.syncing) {  // the producer is behind
      if (known) {
        syncs.behind[p] = mv;
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
    if (!keep(m->group, Arrival{from, m->routes, m->slot_offset, m->checksum, m->patch_base, m->patch_bytes,
                                m->dense_offset, m->patch_offset}))
      return;
  } else if (const auto* m = std::get_if<Pushed>(&msg)) {
    if (!keep(m->group, Arrival{from, m->routes, 0, m->checksum, m->patch_base, m->patch_bytes, m->dense_offset})) return;
  } else if (const auto* m = std::get_if<RoutesNotice>(&msg)) {
    // Kept under group -1 (never awaited): await_any sees its routes and switches.
    if (!keep(-1, Arrival{from, m->routes, 0, std::nullopt})) return;
  } else if (const auto* m = std::get_if<Flushed>(&msg)) {
    if (!known) return;
    push.flushed_from[p] = {m->version, m->routes};
  } else if (const auto* m = std::get_if<Dropped>(&msg)) {
    if (!known) return;
    syncs.dropped.emplace(std::make_pair(m->version, p), fmt::format("producer {}: {}", p, m->reason));
  } else {
    return;
  }
  cv.notify_all();
}

void Consumer::Impl::on_peer_failure(PeerId peer, const Status& why) {
  if (replicas) replicas->peer_failed(peer, why);  // (a joiner we hold for, or a source we read from)
  std::lock_guard<std::mutex> lk(mu);
  if (opts.relay) {  // relay within a host: our relay, or a member reading one of our slots
    if (relay.link.rank >= 0 && peer == relay.link.id && !relay.link.lost) {
      relay.link.lost = true;
      relay.link.why = "transport: " + why.to_string();
    }
    for (RelaySlot& sl : relay.slots) {
      for (auto it = sl.readers.begin(); it != sl.readers.end();) it = it->second == peer ? sl.readers.erase(it) : std::next(it);
    }
    for (auto it = relay.members.begin(); it != relay.members.end();)
      it = it->second == peer ? relay.members.erase(it) : std::next(it);
    cv.notify_all();
  }
  const std::optional<int> p = peers.fail(peer);
  if (!p) return;
  peers[*p].failure = why;
  if (lanes.cuda_ipc) lanes.cuda_ipc->disconnect(*p);
  cv.notify_all();
}

Status Consumer::Impl::unpack_job(const UnpackWorker::Job& job) {
  point(job.group, 3);
  FERRY_RETURN_IF_ERROR(commit_rule->before_unpack(*param_set, job.group));
  const uint64_t n = plan_route()->groups[static_cast<size_t>(job.group)].recv_bytes;
  Status s = unpack_group(schedule.unpack, job.group, std::span<const std::byte>(recv.landing(job.slot), n),
                          param_set->loaded());
  param_set->touch();  // (even a failed unpack may have written some params)
  if (!s.ok()) return s.with_context(fmt::format("consumer {} unpack group {}", rank, job.group));
  return s;
}

Status Consumer::Impl::post_job(const UnpackWorker::Job& job) {
  for (int k : schedule.groups[static_cast<size_t>(job.group)].post_groups) {
    Status s = model.post_process(k, param_set->work());
    if (!s.ok())
      return s.with_context(fmt::format("consumer {} post-processing {}", rank, model.post_group_names[static_cast<size_t>(k)]));
  }
  return Status::Ok();
}

Status Consumer::Impl::refresh_producers() {
  {
    std::lock_guard<std::mutex> lk(mu);
    for (Peer& pe : peers) pe.gone.reset();  // (what this refresh finds, not an earlier one)
  }
  // A producer whose lease lapsed may only be paused (its lease heals when it resumes):
  // one we are connected to is read from as before (a dead one is reported by the
  // transport and failed over); one we never reached is given a lease_ttl to heal
  // (Membership) before it is a failover candidate, so that a live producer is not
  // marked dead for good. Failed-over ones are not read from.
  auto connected = [&](int p) {
    std::lock_guard<std::mutex> lk(mu);
    return peers[p].connected && !peers[p].failure;
  };
  FERRY_ASSIGN_OR_RETURN(
      const Membership::Roll leases,
      roll.call([&](int p) { return !route_state.dead().count(p) && !connected(p); }));
  for (int p = 0; p < roll.size(); ++p) {
    if (route_state.dead().count(p)) continue;
    const std::optional<std::string>& blob = leases[static_cast<size_t>(p)];
    if (!blob && connected(p)) continue;
    if (!blob) {
      attempts.failed_p = p;
      {
        std::lock_guard<std::mutex> lk(mu);
        peers[p].gone = std::string();
      }
      return unavailable("producer {} is not registered (no live lease {} within lease_ttl {} ms)", p,
                         keys.producer(p), opts.lease_ttl.count());
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      if (peers.current(p, *blob)) continue;
    }
    auto lease = decode_producer_lease(*blob);
    if (!lease.ok()) return lease.status().with_context(fmt::format("lease of producer {}", p));
    const Holdings& held = route_state.inputs().holdings[static_cast<size_t>(p)];
    auto table = InPlaceTable::decode(lease->in_place, held);
    if (!table.ok()) return table.status().with_context(fmt::format("in-place table of producer {}", p));
    auto id = transport.connect(string_bytes(lease->address));
    if (!id.ok()) {
      attempts.failed_p = p;  // a candidate for failover
      std::lock_guard<std::mutex> lk(mu);
      peers[p].gone = *blob;
      return id.status().with_context(fmt::format("connecting to producer {}", p));
    }
    // Its staging (and, pulling, its source regions) for the transport lane; its GPU
    // staging, mapped for device-to-device copies when we can take them.
    static const std::vector<std::string> kNone;
    auto imported = lanes.transport->import(p, lease->staging_key, opts.mode == SyncMode::kPull ? table->keys : kNone);
    if (!imported.ok()) {
      attempts.failed_p = p;
      return imported.status();
    }
    if (opts.mode == SyncMode::kPull) {  // its in-place boxes inside its regions, before any read
      if (Status w = lanes.transport->check_in_place(p, *table, held); !w.ok()) {
        lanes.transport->disconnect(p);
        return w.with_context(fmt::format("in-place table of producer {}", p));
      }
    }
    if (lanes.cuda_ipc) lanes.cuda_ipc->connect(p, lease->cuda_ipc);
    std::lock_guard<std::mutex> lk(mu);
    if (!peers.adopt(p, *blob, *id)) {  // its connection failed while we connected
      lanes.transport->disconnect(p);
      if (lanes.cuda_ipc) lanes.cuda_ipc->disconnect(p);
      attempts.failed_p = p;
      return peer_failed("producer {}: its connection failed as it was made", p);
    }
    Peer& pe = peers[p];
    pe.in_place = opts.mode == SyncMode::kPull ? std::move(*table) : InPlaceTable{};
    pe.regions = *imported;
    pe.in_schedule = false;
    peers[p].failure.reset();
  }
  return Status::Ok();
}

std::optional<Completion> Consumer::Impl::send_to(int p, const Message& m) {
  PeerId id;
  {
    std::lock_guard<std::mutex> lk(mu);
    id = peers[p].id;
  }
  auto c = transport.send(id, kEngineTag, encode_message(m));
  if (!c.ok()) return std::nullopt;
  return *c;
}

Status Consumer::Impl::apply_routes(Routes r) {
  FERRY_RETURN_IF_ERROR(check_routes_hold(r, route_state.router()).with_context(fmt::format("consumer {}", rank)));
  // A failover's routes that change which params arrive quantised (a producer that alone
  // held some tile whole died) would write buffers of another dtype: refused, naming it.
  const std::vector<TensorDecl>& now = r.consumer(static_cast<size_t>(rank)).params;
  if (!model.routed_params.empty() && now != model.routed_params) {
    for (size_t i = 0; i < std::max(now.size(), model.routed_params.size()); ++i) {
      if (i < now.size() && i < model.routed_params.size() && now[i] == model.routed_params[i]) continue;
      const TensorDecl& d = i < model.routed_params.size() ? model.routed_params[i] : now[i];
      return failed_precondition(
          "consumer {}: the new routes deliver param '{}' otherwise than its buffers were made for ({} {} then, "
          "{} now): the producers left cannot quantise it as before; restart the consumer",
          rank, d.name, dtype_name(d.dtype), shape_str(d.shape),
          i < now.size() ? dtype_name(now[i].dtype) : std::string_view("absent"),
          i < now.size() ? shape_str(now[i].shape) : std::string());
    }
  }
  const uint64_t needed = consumer_slot_bytes(r.consumer(static_cast<size_t>(rank)));
  if (needed > recv.slot_bytes())
    return failed_precondition("consumer {}: a group needs {} receive bytes, the ring has {}", rank, needed,
                               recv.slot_bytes());
  std::vector<int> mine(static_cast<size_t>(r.num_groups()));
  for (size_t g = 0; g < mine.size(); ++g) mine[g] = static_cast<int>(g);
  if (opts.group_order == GroupOrderKind::kRotated) {
    const GroupOrder o =
        make_group_order(r, {GroupOrderKind::kRotated, true, relay_groups(route_state.inputs(), r.consumer_plan)});
    FERRY_RETURN_IF_ERROR(check_group_order(r, o).with_context(fmt::format("consumer {}", rank)));
    mine = o.consumer[static_cast<size_t>(rank)];
    if (opts.relay) relay.orders = o.consumer;  // a relay and its members read in one order
  } else {
    relay.orders.clear();
  }
  std::lock_guard<std::mutex> lk(mu);
  routes = std::move(r);
  routes_hash = routes.fingerprint();
  schedule.order = std::move(mine);
  rebuild_schedule();
  CommitLayout layout{plan_route(), &schedule.order, &model.post_group_of, &model.post_group_names, {}};
  for (const TensorDecl& d : plan_route()->params) {
    auto it = param_set->committed().find(d.name);
    layout.on_device.push_back(it != param_set->committed().end() && it->second.device().is_cuda());
  }
  // Registering the params with the transport for the new routes (the commit rule's).
  trace.stage(SyncStage::kRegistration);
  Status installed = commit_rule->install(*param_set, layout);
  trace.stage(SyncStage::kRouting);
  return installed;
}

MemoryUse Consumer::Impl::memory_use() {
  MemoryUse m;
  m.receive_ring = recv.host().bytes;
  m.own_params = param_set->own_bytes();
  m.shadow = param_set->shadow_bytes();
  m.registered_in_place += param_set->registered_bytes();
  const RouteInputs& in = route_state.inputs();
  m.metadata = metadata_heap_bytes(routes, in.metadata, in.holdings, in.plans);
  std::lock_guard<std::mutex> lk(mu);
  m.metadata += schedule_heap_bytes(schedule);
  for (const Peer& pe : peers) m.metadata += pe.in_place.boxes.capacity() * sizeof(InPlaceTable::At);
  return m;
}

void Consumer::Impl::rebuild_schedule() {
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
  const std::vector<int> order = std::move(schedule.order);  // (kept: set with the routes)
  in.order = &order;
  schedule = make_consumer_schedule(in);
  for (Peer& pe : peers) pe.in_schedule = true;
}

Status Consumer::Impl::refresh_routes() {
  return route_state.refresh([this](Routes r) { return apply_routes(std::move(r)); });
}

Status Consumer::Impl::reset_background() {
  FERRY_RETURN_IF_ERROR(worker->reset(opts.timeout).with_context(who()));
  param_set->retry();
  return Status::Ok();
}

Status Consumer::Impl::join(const std::function<Status()>& steps) {
  const Participant me{"consumer", rank};
  Status s = [&]() -> Status {
    if (rank < 0 || rank >= opts.num_consumers)
      return invalid_argument("consumer rank {} outside num_consumers {}", rank, opts.num_consumers);
    FERRY_ASSIGN_OR_RETURN(reg.claim, claim_rank(store, keys, opts, me, reg.instance));
    return steps();
  }();
  publish_failure(store, keys, opts, me, reg.instance, s);  // (not when it is not this rank's own)
  return s;
}

Result<std::unique_ptr<Consumer>> Consumer::create(const ModelLoader& loader, int rank, Transport& transport, Store& store,
                                                   const ConsumerOptions& options, TensorMap params) {
  auto impl = std::make_unique<Impl>(rank, transport, store, options);
  Impl& m = *impl;
  FERRY_RETURN_IF_ERROR(m.join([&]() -> Status {
    FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const RankLoader> rank_loader, loader.rank(rank));
    FERRY_RETURN_IF_ERROR(check_param_devices(rank, params));
    FERRY_ASSIGN_OR_RETURN(auto metadata, m.await_metadata());
    FERRY_ASSIGN_OR_RETURN(m.model, record_rank_model(loader, std::move(rank_loader), rank, metadata));
    return m.start(metadata, std::move(params));
  }));
  return std::unique_ptr<Consumer>(new Consumer(std::move(impl)));
}

Result<std::unique_ptr<Consumer>> Consumer::create(ConsumerModel model, int rank, Transport& transport, Store& store,
                                                   const ConsumerOptions& options) {
  auto impl = std::make_unique<Impl>(rank, transport, store, options);
  Impl& m = *impl;
  FERRY_RETURN_IF_ERROR(m.join([&]() -> Status {
    FERRY_RETURN_IF_ERROR(check_param_devices(rank, model.params));
    FERRY_ASSIGN_OR_RETURN(auto metadata, m.await_metadata());
    TensorMap params = std::move(model.params);
    FERRY_ASSIGN_OR_RETURN(m.model, adopt_rank_model(std::move(model), rank, metadata));
    return m.start(metadata, std::move(params));
  }));
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
  // Before the plan: whoever sees the plan sees these too. (Whether it relays is written
  // either way, so that a later instance with another ConsumerOptions::relay keeps the
  // first one's: every rank builds the same cohorts, whenever it meets.)
  const std::pair<std::string, std::string> once[] = {{m.keys.host("consumer", rank), host_identity()},
                                                      {m.keys.relays(rank), options.relay ? "1" : "0"}};
  for (const auto& [key, value] : once) {
    FERRY_ASSIGN_OR_RETURN(std::string held, publish_once(store, key, value));
    m.reg.published.emplace_back(key, std::move(held));
  }
  m.reg.published.emplace_back(m.keys.plan(rank), m.model.plan.encode());
  FERRY_RETURN_IF_ERROR(store.set(m.keys.plan(rank), m.reg.published.back().second));
  FERRY_ASSIGN_OR_RETURN(auto inputs, rendezvous_inputs(store, m.keys, options, Participant{"consumer", rank}, metadata));
  // Nothing is read straight into params where a part needs every byte in the receive
  // ring: delta where it runs (a patch is applied in the receive slot, then unpacked;
  // rendezvous.h, delta_runs), the groups commit rule (every byte lands in the bounded
  // shadow by unpack), relay (members copy the relay's receive ring).
  const bool delta_on = delta_runs(opts, inputs);
  m.delta = DeltaApplier(rank, delta_on);
  if (delta_on || !m.commit_rule->lands_direct() || opts.relay) opts.direct_min_bytes = std::numeric_limits<uint64_t>::max();
  FERRY_ASSIGN_OR_RETURN(auto routes, m.route_state.start(std::move(inputs)));
  m.recv.set_slot_bytes(consumer_slot_bytes(routes.consumer(static_cast<size_t>(rank))));
  // Params producers quantise (EngineOptions::quantize_on) arrive as e4m3 with their
  // scales: their buffers are made so, and each scale goes live with its weight.
  const PlanRoute& mine = routes.consumer(static_cast<size_t>(rank));
  m.model.routed_params = mine.params;
  std::vector<TensorDecl> decls = m.model.param_decls;
  for (const QuantizedParam& q : mine.quantized) {
    const TensorDecl& weight = mine.params[q.param];
    const TensorDecl& scale = mine.params[q.scale];
    for (TensorDecl& d : decls)
      if (d.name == weight.name) d = weight;
    decls.push_back(scale);
    auto g = m.model.post_group_of.find(weight.name);
    if (g != m.model.post_group_of.end()) m.model.post_group_of[scale.name] = g->second;
    // A caller's buffer of the loaded dtype can't hold FP8: ferry's is used (params()
    // names it), as post-processing's replacement would be.
    auto given = params.find(weight.name);
    if (given != params.end() && given->second.dtype() != weight.dtype) params.erase(given);
    given = params.find(scale.name);
    if (given != params.end() && (given->second.dtype() != scale.dtype || given->second.shape() != scale.shape)) {
      params.erase(given);
    }
  }
  auto set = ParamSet::create(ParamSetOptions{rank, options.mode == SyncMode::kPush, options.direct_min_bytes,
                                                  m.commit_rule->needs_shadow(), m.commit_rule->needs_group_shadow(),
                                                  options.own_params_in_transport_memory},
                              decls, params, transport_param_memory(transport));
  if (!set.ok()) return set.status();
  m.param_set = std::move(*set);
  const std::optional<Device> cuda = m.param_set->device();  // where the caller's params are, when in GPU memory
  FERRY_RETURN_IF_ERROR(m.apply_routes(std::move(routes)));
  // Padding: the plan's zeros are written once (routes carry only source bytes).
  FERRY_RETURN_IF_ERROR(m.param_set->write_padding(m.model.plan));
  FERRY_RETURN_IF_ERROR(m.recv.allocate(transport));
  m.lanes.transport = std::make_unique<TransportLane>(rank, transport, m.recv.host().region, *m.param_set);
  if (options.relay) m.lanes.relay = std::make_unique<RelayLane>(rank, transport, m.recv.host().region);
  // CUDA IPC: a receive ring on the params' device, when every param is there (the
  // caller's), in pull mode, without checksums (verified on the host).
  if (options.cuda_ipc && m.param_set->all_on_device() && options.mode == SyncMode::kPull && !options.checksums) {
    FERRY_ASSIGN_OR_RETURN(m.lanes.cuda_ipc, CudaIpcLane::create(rank, *cuda, m.recv.slot_bytes() * Impl::kSlots));
  }
  if (cuda) {
    FERRY_RETURN_IF_ERROR(m.recv.host().make_cuda_visible(*cuda).with_context(
        fmt::format("consumer {}: the receive ring, for params on {}", rank, device_str(*cuda))));
  }
  FERRY_ASSIGN_OR_RETURN(auto key, transport.export_key(m.recv.host().region));
  m.peers.resize(options.num_producers);
  Impl* self = this;
  // Catch-up, both roles: answers go out on our own connection to the joiner its lease names.
  m.replicas = std::make_unique<ReplicaServer>(
      rank, m.model.plan.hash(),
      [self](int c) -> Result<PeerId> {
        if (c < 0 || c >= self->opts.num_consumers || c == self->rank) return invalid_argument("consumer {}: not a joiner", c);
        FERRY_ASSIGN_OR_RETURN(std::string blob, self->store.get(self->keys.consumer(c)));
        FERRY_ASSIGN_OR_RETURN(ConsumerLease lease, decode_consumer_lease(blob));
        return self->transport.connect(string_bytes(lease.address));
      },
      [self](PeerId to, const Replica& msg) { return self->transport.send(to, kEngineTag, encode_message(msg)).status(); });
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
      [self] { self->wake(); }, &m.trace,
      [self](const UnpackWorker::Job& j) {
        return self->commit_rule->group_done(*self->param_set, j.version, j.group, self->trace);
      });
  m.worker->start();
  // Push: where producers may write into params. In the lease (not in each READY) because
  // it is fixed for the instance's life and producers derive every write from it and
  // the routes once, as they read the lease of a new instance anyway. A consumer that
  // commits by a flip publishes both its sets; each READY names the one a sync lands in.
  ParamTable param_table;
  if (options.mode == SyncMode::kPush && !m.param_set->placements().empty()) {
    param_table.min_bytes = options.direct_min_bytes;
    for (const MemoryRegion& r : m.param_set->published_set(0)) {
      FERRY_ASSIGN_OR_RETURN(auto k, transport.export_key(r));
      param_table.keys.push_back(bytes_to_string(k));
    }
    if (m.param_set->flips()) {
      for (const MemoryRegion& r : m.param_set->published_set(1)) {
        FERRY_ASSIGN_OR_RETURN(auto k, transport.export_key(r));
        param_table.other_keys.push_back(bytes_to_string(k));
      }
    }
    param_table.params = m.param_set->placements();
  }
  m.reg.lease_value = encode_lease(ConsumerLease{bytes_to_string(transport.address()), bytes_to_string(key), m.recv.slot_bytes(),
                                                 param_table.encode(), host_identity()});
  // Joining (again): a mark that an earlier instance of this rank left goes before the
  // lease shows it live.
  if (auto cleared = store.remove(m.keys.left(rank)); !cleared.ok())
    return cleared.status().with_context(fmt::format("consumer {}: clearing its left mark", rank));
  FERRY_ASSIGN_OR_RETURN(m.reg.lease, store.hold_lease(m.keys.consumer(rank), m.reg.lease_value, options.lease_ttl));
  return Status::Ok();
}

}  // namespace ferry
