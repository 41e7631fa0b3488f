// Consumer: one per inference rank; the sync protocol of its control plane (a sync's
// attempts, announcements, failover, commit). Impl and what lives where:
// engine/consumer_impl.h.
#include "engine/consumer_impl.h"

namespace ferry {

Result<int> Consumer::Impl::acquire_slot(int at) {
  auto s = worker->acquire(at % kSlots, opts.timeout, [this] { return crashed.load(); }, who());
  if (!s.ok() && s.status().code() == StatusCode::kCancelled && crashed)
    return cancelled("consumer {} crashed (test hook)", rank);
  if (s.ok()) relay_reuse(*s);  // members reading the slot's last group finish first (bounded)
  return s;
}

Status Consumer::Impl::sync_groups(uint64_t v, SyncReport& rep) {
  attempts.group = -1;
  trace.stage(SyncStage::kRendezvous);
  FERRY_RETURN_IF_ERROR(refresh_producers());
  trace.stage(SyncStage::kRouting);
  plan_attempt();
  if (attempts.declare) {
    attempts.declare = false;
    declare_routes(v);
  }
  refresh_relay();
  // Pull: the reads of this attempt, at their pace (engine/attempt_reads.h: in-place
  // bytes read ahead, or at the producers' pace under the rotated order), and draining
  // them on an error return.
  AttemptReads reads(lanes.plan, *lanes.transport, lanes.cuda_ipc.get(), lanes.relay.get(),
                     opts.group_order == GroupOrderKind::kRotated, opts.timeout);
  for (size_t at = 0; at < schedule.order.size(); ++at) {
    const int g = schedule.order[at];
    attempts.group = g;
    const ConsumerGroupSchedule& gs = schedule.groups[static_cast<size_t>(g)];
    const ConsumerGroupPlan& gp = lanes.plan.groups[static_cast<size_t>(g)];
    const std::set<int> from(gp.from.begin(), gp.from.end());
    if (from.empty()) {
      worker->enqueue({v, g, -1});
      continue;
    }
    trace.stage(SyncStage::kTransform);  // (a slot is freed by the unpack worker)
    FERRY_ASSIGN_OR_RETURN(int s, acquire_slot(static_cast<int>(at)));
    trace.stage(SyncStage::kReceive);
    point(g, 0);
    GroupRx rx{v, g, s, recv.offset(s), from};
    FERRY_RETURN_IF_ERROR(receive_group(rx, gs, reads, rep));
    std::map<int, uint64_t> sums;  // checksums (the producers' option), verified on the host
    for (int p : from)
      if (rx.got[p].checksum) sums[p] = *rx.got[p].checksum;
    content.add(g, std::map<int64_t, uint64_t>(sums.begin(), sums.end()));
    FERRY_RETURN_IF_ERROR(verify_group(rank, g, routes.group_names[static_cast<size_t>(g)], gs, sums, recv.host_slot(s),
                                       recv.device_slot(s),
                                       plan_route()->groups[static_cast<size_t>(g)].recv_bytes, *param_set));
    point(g, 2);
    relay_landed(v, g, s);  // members on this host may copy it now (relay on)
    delta.landed(g);  // (its params hold this sync's bytes from now on: no patch of it is taken)
    worker->enqueue({v, g, s});
  }
  attempts.group = -1;
  // Drain the background thread. Unpacking and post-processing the last groups may take
  // seconds (RL post-processing): JOINs each keepalive_every meanwhile say this consumer
  // is moving, so that no producer waiting for its DONE takes it for hung (a producer
  // drops one that stays silent past its straggler bound once the others committed).
  trace.stage(SyncStage::kTransform);
  Status drained;
  for (const auto deadline = Clock::now() + opts.timeout;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const auto slice = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(keepalive_every()),
                                  std::chrono::milliseconds(0), std::max(left, std::chrono::milliseconds(0)));
    drained = worker->drain(slice, who());
    if (drained.code() != StatusCode::kTimeout || Clock::now() >= deadline) break;
    join_producers(v);
  }
  if (drained.code() == StatusCode::kTimeout)
    return timeout_error("{}: unpacking did not finish within {} ms", who(), opts.timeout.count());
  if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
  return drained;
}

Status Consumer::Impl::failover(uint64_t v, const Status& why) {
  trace.stage(SyncStage::kRouting);
  // Held up by the failed producer until the FAILOVER below: the others hear it moves
  // (the background reset may wait for an unpack in progress).
  join_producers(v, {attempts.failed_p});
  std::set<int> d = route_state.dead();
  d.insert(attempts.failed_p);
  {
    std::lock_guard<std::mutex> lk(mu);
    for (int p = 0; p < peers.size(); ++p)
      if (peers[p].failure) d.insert(p);
  }
  if (auto stored = route_state.read_dead(); stored.ok()) d.insert(stored->begin(), stored->end());
  auto r = route_state.routes_without(d);
  if (!r.ok())
    return Status(why.code(), fmt::format("{}; no failover: {}", why.message(), r.status().message()));
  FERRY_RETURN_IF_ERROR(route_state.mark_dead(d));
  FERRY_RETURN_IF_ERROR(reset_background());
  FERRY_RETURN_IF_ERROR(route_state.adopt(d, std::move(*r), [this](Routes x) { return apply_routes(std::move(x)); }));
  trace.control(ControlKind::kFailover, attempts.failed_p, -1, fmt::format("consumer {}: {}; failover: routes rebuilt without producer(s) {}", rank,
                                     why.to_string(), rank_list(d)));
  declare_routes(v);
  return Status::Ok();
}

void Consumer::Impl::declare_routes(uint64_t v) {
  for (int p = 0; p < opts.num_producers; ++p) {
    bool ok;
    {
      std::lock_guard<std::mutex> lk(mu);
      ok = !route_state.dead().count(p) && peers[p].connected && !peers[p].failure;
    }
    if (ok) send_to(p, Failover{me(), v, routes_hash});
  }
}

std::vector<int> Consumer::Impl::reachable_producers() {
  std::vector<int> out;
  std::lock_guard<std::mutex> lk(mu);
  for (int p = 0; p < opts.num_producers; ++p) {
    if (peers[p].connected && !peers[p].failure) out.push_back(p);
  }
  return out;
}

void Consumer::Impl::join_producers(uint64_t v, const std::set<int>& except) {
  for (int q : reachable_producers()) {
    if (!except.count(q)) send_to(q, Join{me(), v, routes_hash});
  }
}

Status Consumer::Impl::publish_versions() {
  if (!reg.lease) return Status::Ok();
  const ConsumerState st = param_set->state();
  FERRY_ASSIGN_OR_RETURN(ConsumerLease l, decode_consumer_lease(reg.lease_value));
  l.committed = st.has_version ? std::optional<uint64_t>(st.version) : std::nullopt;
  l.received = st.received;
  std::string value = encode_lease(l);
  if (value == reg.lease_value) return Status::Ok();
  FERRY_RETURN_IF_ERROR(reg.lease->update(value).with_context(
      fmt::format("consumer {}: publishing the versions it holds in its lease", rank)));
  reg.lease_value = std::move(value);
  return Status::Ok();
}

Status Consumer::Impl::record_committed(uint64_t v) {
  return store.set(keys.committed(rank), std::to_string(v))
      .with_context(fmt::format("consumer {}: recording committed version {}", rank, v));
}

Status Consumer::Impl::record_not_whole(uint64_t v) {
  const ConsumerState held = param_set->state();
  if (!held.mixed && !held.torn) return Status::Ok();
  const std::string value = fmt::format("{} {} {}", held.has_version ? std::to_string(held.version) : "none",
                                        held.mixed ? "mixed" : "torn", v);
  return store.set(keys.committed(rank), value)
      .with_context(fmt::format("consumer {}: recording that sync {} left its params {}", rank, v,
                                held.mixed ? "mixed" : "torn"));
}

Result<WeightCheck> Consumer::Impl::check_weights() {
  if (!opts.weight_digests)
    return failed_precondition("consumer {}: check_weights needs EngineOptions::weight_digests (on every rank)", rank);
  return weights.check(param_set->committed(), store, keys, opts.num_producers);
}

void Consumer::Impl::check_weights_held() {
  Result<WeightCheck> w = check_weights();
  if (!w.ok()) {
    trace.control(ControlKind::kWeights, -1, -1, fmt::format("consumer {}: the weight check could not run: {}", rank,
                                                             w.status().to_string()));
    return;
  }
  for (const std::string& p : w->changed)
    trace.control(ControlKind::kWeights, -1, -1,
                  fmt::format("consumer {}: param '{}' changed since version {} went live", rank, p, *w->version));
  for (const std::string& d : w->drifted)
    trace.control(ControlKind::kWeights, -1, -1, fmt::format("consumer {}: {}", rank, d));
}

Result<double> Consumer::Impl::commit() {
  const std::optional<uint64_t> v = param_set->state().received;
  if (!v) return commit_rule->commit(*param_set);  // (its error: nothing received)
  const ServingPause paused = pause_serving();  // (joiners reading the live params first: they change now)
  FERRY_ASSIGN_OR_RETURN(const double seconds, commit_rule->commit(*param_set));
  trace.committed(*v, seconds);
  if (opts.weight_digests) weights.take(*v, param_set->committed());
  FERRY_RETURN_IF_ERROR(record_committed(*v));
  FERRY_RETURN_IF_ERROR(publish_versions());
  return seconds;
}

Result<SyncReport> Consumer::Impl::sync(uint64_t v, bool commit_it) {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (syncs.left) return failed_precondition("consumer {} left the job (leave()): it syncs no more", rank);
  }
  FERRY_RETURN_IF_ERROR(commit_rule->check_sync(commit_it));
  FERRY_RETURN_IF_ERROR(check_claim(*reg.claim, store, Participant{"consumer", rank}, reg.instance));
  const auto t0 = Clock::now();
  // Relay: asks of this sync that came after its last attempt ended (and before it was
  // over: they were kept, as of a group still to land) are answered gone on the way out.
  struct RelayFlush {
    Impl* self;
    uint64_t v;
    ~RelayFlush() { self->relay_attempt_over(v); }
  } relay_flush{this, v};
  push.readied.clear();
  push.unanswered.clear();
  SyncReport rep;
  rep.version = v;
  trace.set_sink(opts.sink.get(), "consumer", rank);
  trace.begin(t0, v);
  // The report's sums from the trace; kept for last_report() whatever the outcome.
  auto finish_report = [&](const Status& st) {
    if (rep.seconds == 0) rep.seconds = seconds_since(t0);
    rep.status = st;
    rep.unchanged = content.finish(routes_hash, st.ok());
    const ConsumerState held = param_set->state();
    rep.live_version = held.has_version ? std::optional<uint64_t>(held.version) : std::nullopt;
    commit_rule->report(rep);
    trace.finish_report(rep);
    last = rep;
  };
  if (opts.before_sync) opts.before_sync(v);  // (the caller's: no stage claims it)
  trace.stage(SyncStage::kRendezvous);
  // Joiners reading our live params first (bounded), then none until it ends.
  const ServingPause paused = pause_serving();
  if (opts.weight_digests && opts.check_weights_each_sync) check_weights_held();
  {
    std::lock_guard<std::mutex> lk(mu);
    // Drop announcements of older versions and of other syncs this instance ran or gave
    // up (a rollback after a failed sync must not take them for a producer ahead).
    // An older version this instance never synced, from the instance we are connected
    // to, is a producer behind (as on_message judges one arriving during the sync): it
    // came before this sync began, and dropping it silently left the consumer waiting
    // out its timeout for announcements that never come.
    syncs.behind.clear();
    for (auto it = inbox.begin(); it != inbox.end();) {
      const auto& [mv, g, p] = it->first;
      // (Nor is one whose producer dropped this consumer from that version: it ran that
      // sync without us, and is not behind.)
      const bool ran = syncs.attempted.count(mv) || syncs.mismatched.count(mv) || syncs.dropped.count({mv, p});
      if (mv < v && !ran && peers[p].connected && it->second.from == peers[p].id)
        syncs.behind[p] = mv;
      const bool stale = mv < v || (mv != v && ran);
      it = stale ? inbox.erase(it) : std::next(it);
    }
    syncs.dropped.erase(syncs.dropped.begin(), syncs.dropped.lower_bound({v, 0}));
    syncs.syncing = v;
    relay.passed.clear();  // (groups this relay took its slots back from: of earlier syncs)
    syncs.attempted.insert(v);
    if (syncs.attempted.size() > 64) syncs.attempted.erase(syncs.attempted.begin());
  }
  Status s = reset_background();  // not ok: a job of the last attempt still runs, this sync fails
  const bool dropping_received = param_set->state().received.has_value();
  param_set->begin(v);
  if (dropping_received) {  // a version received and not committed is gone now: say so
    content.forget();
    if (Status c = publish_versions(); !c.ok()) trace.control(ControlKind::kStore, -1, -1, c.to_string());
  }
  attempts.old_hashes.clear();
  delta.begin_sync();
  const uint64_t previous = routes_hash;
  if (!s.ok()) {
  } else if (auto again = republish(store, reg.published); !again.ok()) {
    s = again.status();
  } else if (*again > 0) {
    trace.control(ControlKind::kRepublish, -1, -1, fmt::format("consumer {}: the store {} had lost its rendezvous keys (restarted?); "
                                       "re-published its plan", rank, store.url()));
  }
  commit_rule->begin_sync();
  trace.stage(SyncStage::kRouting);
  if (s.ok()) s = refresh_routes();
  content.begin(routes_hash);
  s = s.with_context(fmt::format("consumer {} sync {}", rank, v));
  // Routes changed before we began (another participant already failed over this
  // sync): announcements made with the old ones are stale, not a reason to switch.
  if (routes_hash != previous) attempts.old_hashes.insert(previous);
  attempts.declare = !route_state.dead().empty();
  // Tell the producers this consumer is in the sync: from now on it can straggle; until
  // now only their join window applied (rollouts end seconds apart, engine/straggler.h).
  if (s.ok()) join_producers(v);
  int restart_waits = 0;
  for (int tries = 0; s.ok() || tries > 0; ++tries) {
    attempts.failed_p = -1;
    {
      std::lock_guard<std::mutex> lk(mu);
      attempts.switch_routes = false;
    }
    s = sync_groups(v, rep);
    if (!s.ok()) trace.failed_at(attempts.failed_p, attempts.group);
    relay_attempt_over(v);  // (members still asking for groups it did not land read them from the producers)
    if (s.ok()) break;
    // A producer gone as the attempt began (nothing of v read yet) that no DP replica
    // covers: wait, within the sync's timeout, for a restarted instance of it, then
    // begin again with it (issue 30: a trainer rank restarted between syncs lost the
    // next sync for every consumer).
    if (attempts.failed_p >= 0 && restart_waits < opts.num_producers + 1) {
      bool gone;
      {
        std::lock_guard<std::mutex> lk(mu);
        gone = peers[attempts.failed_p].gone.has_value();
      }
      std::set<int> d = route_state.dead();
      d.insert(attempts.failed_p);
      if (gone && !(opts.failover && route_state.routes_without(d).ok())) {
        ++restart_waits;
        if (Status w = await_restart(v, attempts.failed_p, t0 + opts.timeout); !w.ok()) {
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
      follow = attempts.switch_routes;
    }
    if (follow) {
      const uint64_t before = routes_hash;
      trace.stage(SyncStage::kRouting);
      Status f = reset_background();
      if (f.ok()) f = refresh_routes();
      if (!f.ok() || routes_hash == before) {
        if (!f.ok()) s = f;
        break;
      }
      attempts.old_hashes.insert(before);
      trace.control(ControlKind::kFollow, -1, -1, fmt::format("consumer {}: followed producers to routes without a failed producer", rank));
      declare_routes(v);
      if (Status w = wait_flushed(v); !w.ok()) {
        s = w;
        break;
      }
      trace.new_attempt(false);
      continue;
    }
    if (attempts.failed_p < 0) break;
    attempts.old_hashes.insert(routes_hash);
    Status f = failover(v, s);
    if (f.ok()) f = wait_flushed(v);
    if (!f.ok()) {
      s = f;
      break;
    }
    trace.new_attempt(false);
  }
  // On failure, let the background thread finish what it holds, then tell producers we gave up.
  if (!s.ok()) worker->clear(opts.timeout);
  trace.stage(SyncStage::kCommit);  // (the DONEs or ABORTs, and the commit)
  std::unique_lock<std::mutex> lk(mu);
  // Dropped by a producer while its groups still came (through this host's relay, which
  // asks no producer): committing v anyway would make that producer's report, which names
  // this consumer as missing v, untrue. (Seen: StragglerIsDroppedEarlyAndCatchesUp, push,
  // relay, 1 run in 12 on a loaded box.)
  if (s.ok()) s = dropped_locked(v);
  syncs.syncing.reset();
  if (!s.ok()) {
    param_set->abort();
    for (const auto& [p, n] : push.unanswered) push.flushed_from.erase(p);  // an answer to an earlier FAILOVER is not one to this ABORT
    lk.unlock();
    std::vector<Completion> aborts;
    for (int p : reachable_producers()) {
      if (auto c = send_to(p, Abort{me(), v, routes_hash, s.message()})) aborts.push_back(*c);
    }
    // The ABORTs have left before sync returns (as the DONEs below): one still queued when
    // the caller begins another sync would reach a producer in that sync as news of this
    // one, and a later version's ABORT drops its sender from an earlier sync (CI, a
    // loaded machine: PushVersionMismatchAskedBeforeTheProducersBegan's rollback to 2).
    wait_all(aborts, std::min<std::chrono::milliseconds>(opts.timeout, std::chrono::milliseconds(2000))).ignore();
    if (Status w = wait_aborted_writes(v); !w.ok()) s = Status(s.code(), fmt::format("{}; {}", s.message(), w.message()));
    if (Status r = record_not_whole(v); !r.ok()) trace.control(ControlKind::kStore, -1, -1, r.to_string());
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
  // The DONEs have left before sync returns: a caller that closes the consumer right
  // after (its last sync) must not cancel them in its transport's queue, or producers
  // would count this consumer as having missed a version it holds. Bounded; a producer
  // that died meanwhile does not matter here.
  wait_all(dones, std::min<std::chrono::milliseconds>(opts.timeout, std::chrono::milliseconds(2000))).ignore();
  trace.record(TracePhase::kCommit, -1, -1, tc, Clock::now());
  // What the commit rule makes of the received version: live now, or held for commit().
  Result<CommitRule::Finished> c = commit_rule->finish(*param_set, v, commit_it);
  if (!c.ok()) {
    finish_report(c.status());
    return c.status();
  }
  rep.committed = c->live;
  rep.commit_seconds = c->commit_seconds;
  if (c->live) {
    if (Status r = record_committed(v); !r.ok()) trace.control(ControlKind::kStore, -1, -1, r.to_string());
    if (opts.weight_digests) weights.take(v, param_set->committed());
  }
  if (Status p = publish_versions(); !p.ok()) trace.control(ControlKind::kStore, -1, -1, p.to_string());
  rep.seconds = seconds_since(t0);
  rep.memory = memory_use();
  finish_report(Status::Ok());
  if (opts.after_sync) opts.after_sync(v);
  return rep;
}


Result<WeightCheck> Consumer::check_weights() { return impl_->check_weights(); }

Consumer::Consumer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Consumer::~Consumer() = default;
Result<SyncReport> Consumer::sync(uint64_t version) { return impl_->sync(version, true); }
Result<SyncReport> Consumer::sync(uint64_t version, bool commit) { return impl_->sync(version, commit); }
Result<double> Consumer::commit() { return impl_->commit(); }
Result<SyncReport> Consumer::catch_up() { return impl_->catch_up(); }
Status Consumer::leave() {
  Consumer::Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.syncs.syncing) return failed_precondition("consumer {}: leave() while a sync runs", m.rank);
    if (m.syncs.left) return Status::Ok();
  }
  m.close_serving();  // (joiners reading from it first, bounded)
  FERRY_RETURN_IF_ERROR(m.store.set(m.keys.left(m.rank), m.reg.instance)
                            .with_context(fmt::format("consumer {}: marking it left", m.rank)));
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.syncs.left = true;
    if (m.reg.lease) m.reg.lease->release().ignore();
    if (m.reg.claim) m.reg.claim->release().ignore();  // (a new instance may take the rank at once)
  }
  // Producers in a sync that counted it a member stop waiting for it now (bounded, as
  // the DONEs: one that does not hear it finds the mark when its sync ends).
  const ConsumerState held = m.param_set->state();
  std::vector<Completion> sent;
  for (int p : m.reachable_producers()) {
    if (auto c = m.send_to(p, Leave{m.me(), held.has_version ? held.version : 0, m.routes_hash})) sent.push_back(*c);
  }
  wait_all(sent, std::min<std::chrono::milliseconds>(m.opts.timeout, std::chrono::milliseconds(2000))).ignore();
  return Status::Ok();
}

Status Consumer::discard() {
  FERRY_RETURN_IF_ERROR(impl_->param_set->discard());
  impl_->content.forget();  // (the reference was never made live)
  return impl_->publish_versions();
}
const SyncReport& Consumer::last_report() const { return impl_->last; }
ConsumerState Consumer::state() const { return impl_->param_set->state(); }
const TensorMap& Consumer::params() const { return impl_->param_set->committed(); }
const Routes& Consumer::routes() const { return impl_->routes; }
int Consumer::rank() const { return impl_->rank; }
bool engine::TestAccess::knows_failed(Consumer& c, int p) {
  std::lock_guard<std::mutex> lk(c.impl_->mu);
  return c.impl_->peers[p].failure || !c.impl_->peers[p].connected;
}

bool engine::TestAccess::knows_dropped(Consumer& c, uint64_t version) {
  std::lock_guard<std::mutex> lk(c.impl_->mu);
  auto d = c.impl_->syncs.dropped.lower_bound({version, 0});
  return d != c.impl_->syncs.dropped.end() && d->first.first == version;
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
  if (impl_->reg.lease) impl_->reg.lease->release().ignore();
}

Status Consumer::check_params(const TensorMap& current) const { return impl_->param_set->check_rebound(current); }

}  // namespace ferry
