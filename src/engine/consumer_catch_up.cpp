// A joiner catches up from the replicas of its plan class (Consumer::catch_up), and a
// consumer serves its live params to joiners (engine/replica_server.h, docs/elastic.md).
#include <algorithm>
#include <thread>

#include <xxhash.h>

#include "engine/consumer_impl.h"

namespace ferry {

Clock::duration Consumer::Impl::catch_up_hold() const {
  // A joiner's hold delays this consumer's next sync (or commit) by at most this: the
  // straggler floor (what producers let a consumer lag by), within [100 ms, timeout].
  const Clock::duration floor = opts.straggler_floor.count() > 0 ? Clock::duration(opts.straggler_floor)
                                                                  : Clock::duration(opts.timeout);
  return std::clamp<Clock::duration>(floor, std::chrono::milliseconds(100),
                                     std::max<Clock::duration>(opts.timeout, std::chrono::milliseconds(100)));
}

void Consumer::Impl::close_serving() {
  const auto t0 = Clock::now();
  for (int joiner : replicas->close(catch_up_hold())) {
    trace.control(ControlKind::kCatchUp, joiner, -1,
                  fmt::format("consumer {}: gave up consumer {}'s catch-up hold after {} ms (its own sync or commit "
                              "could not wait longer); that joiner reads elsewhere",
                              rank, joiner, ms_since(t0)));
  }
}

Consumer::Impl::ServingPause::~ServingPause() {
  if (Status st = m->serve_live(); !st.ok()) m->trace.control(ControlKind::kStore, -1, -1, st.to_string());
}

Status Consumer::Impl::serve_live() {
  const ConsumerState held = param_set->state();
  if (!held.has_version || held.torn || held.mixed) return Status::Ok();  // nothing whole to serve
  uint64_t hash = replicas->table();
  if (hash == 0) {
    Result<const ParamSet::ServingLayout*> layout = param_set->serving_layout();
    if (!layout.ok()) return Status::Ok();  // (GPU params: joiners of this class catch up from the producers)
    ParamTable table;
    for (int s = 0; s < 2; ++s) {
      for (const MemoryRegion& r : (*layout)->sets[s]) {
        FERRY_ASSIGN_OR_RETURN(auto k, transport.export_key(r));
        (s == 0 ? table.keys : table.other_keys).push_back(bytes_to_string(k));
      }
    }
    table.params = (*layout)->params;
    std::string blob = table.encode();
    hash = XXH3_64bits(blob.data(), blob.size());
    const std::string key = keys.serving(rank);
    FERRY_RETURN_IF_ERROR(store.set(key, blob).with_context(
        fmt::format("consumer {}: publishing where its live params lie for joiners", rank)));
    reg.published.emplace_back(key, std::move(blob));  // (put back if the store loses it: republish)
  }
  replicas->serve(held.version, static_cast<uint8_t>(param_set->live_set()), hash);
  return Status::Ok();
}

namespace {

// A consumer's lease as the store has it now (nullopt: none live, or it does not decode).
std::optional<ConsumerLease> lease_of(Store& store, const JobKeys& keys, int c) {
  auto blob = store.get(keys.consumer(c));
  if (!blob.ok()) return std::nullopt;
  auto lease = decode_consumer_lease(*blob);
  if (!lease.ok()) return std::nullopt;
  return std::move(*lease);
}

}  // namespace

Result<Consumer::Impl::CatchUpSources> Consumer::Impl::catch_up_sources() {
  const uint32_t mine = routes.consumer_plan[static_cast<size_t>(rank)];
  CatchUpSources out;
  std::map<int, uint64_t> live;  // every other consumer's committed version, from its lease
  std::vector<int> joiners;      // of this plan class, catching up now (this one included)
  for (int c = 0; c < opts.num_consumers; ++c) {
    if (c == rank) {
      joiners.push_back(c);
      continue;
    }
    std::optional<ConsumerLease> lease = lease_of(store, keys, c);
    if (lease && lease->committed) live[c] = *lease->committed;
    if (routes.consumer_plan[static_cast<size_t>(c)] == mine && store.get(keys.catching_up(c)).ok()) joiners.push_back(c);
  }
  if (live.empty())
    return not_found("consumer {}: no other inference rank holds a version yet; this one receives the first from the "
                     "producers at its first sync",
                     rank);
  for (const auto& [c, v] : live) out.version = std::max(out.version, v);
  for (const auto& [c, v] : live) {
    if (v == out.version && routes.consumer_plan[static_cast<size_t>(c)] == mine) out.holders.push_back(c);
  }
  if (out.holders.empty())
    return not_found("consumer {}: no replica of its plan class holds the live version {} (only other layouts do); it "
                     "receives it from the producers at its next sync",
                     rank, out.version);
  // Joiners that hold the version by now are holders; the rest fan out as a tree
  // (catch_up_parent: each round doubles the sources, one joiner each).
  joiners.erase(std::remove_if(joiners.begin(), joiners.end(),
                               [&](int c) { return c != rank && live.count(c) && live[c] == out.version; }),
                joiners.end());
  const size_t s = out.holders.size();
  const size_t i = static_cast<size_t>(std::find(joiners.begin(), joiners.end(), rank) - joiners.begin());
  const size_t parent = catch_up_parent(s, i);
  if (parent >= s) out.parent = joiners[parent - s];
  // Then the holders, starting at the parent's place among them (joiners of one round
  // start at different holders), turned by the version (a lone joiner of each version
  // does not always take the same one).
  for (size_t k = 0; k < s; ++k) out.order.push_back(out.holders[(parent + out.version + k) % s]);
  return out;
}

Status Consumer::Impl::read_replica(int c, uint64_t v, const ParamSet::ServingLayout& mine) {
  const auto deadline = Clock::now() + opts.timeout;
  std::optional<ConsumerLease> lease = lease_of(store, keys, c);
  if (!lease || lease->committed != v) return unavailable("consumer {} holds version {} no more", c, v);
  trace.stage(SyncStage::kRendezvous);
  FERRY_ASSIGN_OR_RETURN(const PeerId id, transport.connect(string_bytes(lease->address)));
  auto stop = [this] { return own_transport_health(); };
  replicas->forget(id);
  FERRY_RETURN_IF_ERROR(
      transport.send(id, kEngineTag, encode_message(Replica{me(), v, model.plan.hash(), Replica::kAsk, 0, 0})).status());
  trace.stage(SyncStage::kWire);
  FERRY_ASSIGN_OR_RETURN(const Replica offer, replicas->await_answer(id, {Replica::kOffer, Replica::kRefuse}, deadline, stop));
  if (offer.kind == Replica::kRefuse)
    return unavailable("consumer {} cannot serve version {} now (syncing, committing or holding another)", c, v);
  if (opts.test_hooks && opts.test_hooks->catch_up_offered) opts.test_hooks->catch_up_offered(v, c);
  trace.stage(SyncStage::kRegistration);
  // The serving table its offer names, and its live set's keys.
  FERRY_ASSIGN_OR_RETURN(const std::string blob, store.get(keys.serving(c)));
  if (XXH3_64bits(blob.data(), blob.size()) != offer.table)
    return unavailable("consumer {}'s serving table in the store is not the one it offered", c);
  FERRY_ASSIGN_OR_RETURN(const ParamTable table, ParamTable::decode(blob));
  const std::vector<std::string>& key_blobs = offer.set == 0 ? table.keys : table.other_keys;
  std::vector<RemoteRegion> remote;
  struct Release {
    Transport& t;
    std::vector<RemoteRegion>& r;
    ~Release() {
      for (const RemoteRegion& x : r) t.release_key(x).ignore();
    }
  } release{transport, remote};
  for (const std::string& k : key_blobs) {
    FERRY_ASSIGN_OR_RETURN(RemoteRegion r, transport.import_key(string_bytes(k)));
    remote.push_back(r);
  }
  // Every live param of ours from the same param of its (the same plan class: the same
  // params, laid out by each side's own registrations).
  const std::vector<MemoryRegion>& local = mine.sets[param_set->live_set()];
  if (table.params.size() != mine.params.size())
    return failed_precondition("consumer {} serves {} params, this one has {}", c, table.params.size(), mine.params.size());
  trace.stage(SyncStage::kReceive);
  const auto t0 = Clock::now();
  param_set->catch_up_begin();
  std::vector<Completion> ops;
  uint64_t bytes = 0;
  for (const auto& [name, at] : mine.params) {
    auto theirs = table.params.find(name);
    if (theirs == table.params.end() || theirs->second.bytes != at.bytes || theirs->second.key >= remote.size())
      return failed_precondition("consumer {} serves param '{}' unlike this one", c, name);
    FERRY_ASSIGN_OR_RETURN(Completion op, transport.read(local[at.key], at.offset, remote[theirs->second.key],
                                                         theirs->second.offset, at.bytes));
    ops.push_back(std::move(op));
    bytes += at.bytes;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  FERRY_RETURN_IF_ERROR(wait_all(ops, std::max(left, std::chrono::milliseconds(1))));
  const auto t1 = Clock::now();
  FERRY_RETURN_IF_ERROR(
      transport.send(id, kEngineTag, encode_message(Replica{me(), v, model.plan.hash(), Replica::kDone, 0, 0})).status());
  FERRY_ASSIGN_OR_RETURN(const Replica verdict,
                         replicas->await_answer(id, {Replica::kIntact, Replica::kRevoked}, deadline, stop));
  if (verdict.kind == Replica::kRevoked)
    return cancelled("consumer {} gave its hold up before the reads ended (its own sync began): discarded", c);
  trace.record(TracePhase::kRead, -1, c, t0, t1);
  trace.record(TracePhase::kReceive, -1, c, t0, t1, TraceLane::kReplica, bytes, true);
  return Status::Ok();
}

Result<SyncReport> Consumer::Impl::catch_up() {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (syncs.left) return failed_precondition("consumer {} left the job (leave()): it catches up no more", rank);
    if (syncs.syncing) return failed_precondition("consumer {}: catch_up() while a sync runs", rank);
  }
  content.forget();  // (what goes live now is no sync's: SyncReport::unchanged compares with nothing)
  FERRY_RETURN_IF_ERROR(check_claim(*reg.claim, store, Participant{"consumer", rank}, reg.instance));
  const auto t0 = Clock::now();
  FERRY_ASSIGN_OR_RETURN(const ParamSet::ServingLayout* mine, param_set->serving_layout());
  // A consumer that holds a version serves it; its live params are written from here on:
  // joiners reading them first (bounded), then none until the version it ends with.
  const ServingPause paused = pause_serving();
  // Counted among the joiners (the tree) while it catches up; the mark lapses if it dies.
  FERRY_RETURN_IF_ERROR(store.set(keys.catching_up(rank), reg.instance, opts.timeout)
                            .with_context(fmt::format("consumer {}: marking it catching up", rank)));
  struct Unmark {
    Impl* self;
    ~Unmark() { self->store.remove(self->keys.catching_up(self->rank)).status().ignore(); }
  } unmark{this};
  FERRY_ASSIGN_OR_RETURN(CatchUpSources from, catch_up_sources());
  const uint64_t v = from.version;
  SyncReport rep;
  rep.version = v;
  trace.set_sink(opts.sink.get(), "consumer", rank);
  trace.begin(t0, v);
  auto finish_report = [&](const Status& st) {
    rep.seconds = seconds_since(t0);
    rep.status = st;
    const ConsumerState held = param_set->state();
    rep.live_version = held.has_version ? std::optional<uint64_t>(held.version) : std::nullopt;
    rep.committed = st.ok();
    trace.finish_report(rep);
    last = rep;
  };
  trace.stage(SyncStage::kWire);
  std::vector<int> order = from.order;
  if (from.parent) {
    // A joiner of an earlier round: wait (bounded) for it to hold the version, then read
    // from it; a parent that fails or is slow leaves this one to the holders.
    const auto until = t0 + opts.timeout / 2;
    for (;;) {
      std::optional<ConsumerLease> lease = lease_of(store, keys, *from.parent);
      if (lease && lease->committed == v) {
        order.insert(order.begin(), *from.parent);
        break;
      }
      if (Clock::now() >= until || !store.get(keys.catching_up(*from.parent)).ok()) {
        trace.control(ControlKind::kCatchUp, *from.parent, -1,
                      fmt::format("consumer {}: joiner consumer {} did not come to hold version {}; reading from the "
                                  "replicas that do",
                                  rank, *from.parent, v));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  Status st = not_found("consumer {}: no replica could serve version {}", rank, v);
  int served_by = -1;
  for (int c : order) {
    Status s = read_replica(c, v, *mine);
    if (s.ok()) {
      served_by = c;
      st = Status::Ok();
      break;
    }
    trace.control(ControlKind::kCatchUp, c, -1,
                  fmt::format("consumer {}: catching up version {} from consumer {} failed: {}", rank, v, c, s.to_string()));
    st = Status(s.code(), fmt::format("consumer {}: catching up version {}: the last replica tried, consumer {}: {}", rank,
                                      v, c, s.message()));
  }
  if (!st.ok()) {
    param_set->catch_up_abort();  // (torn only when some reads had begun)
    if (Status r = record_not_whole(v); !r.ok()) trace.control(ControlKind::kStore, -1, -1, r.to_string());
    finish_report(st);
    return st;
  }
  // Post-processing, as a sync's groups end with it: the live buffers hold the version's
  // unpacked bytes (what the replica's unpack wrote), the same code makes the rest.
  trace.stage(SyncStage::kTransform);
  const auto tp = Clock::now();
  for (size_t k = 0; k < model.post_group_names.size(); ++k) {
    if (!model.post_process) break;
    Status s = model.post_process(static_cast<int>(k), param_set->work());
    if (!s.ok()) {
      param_set->catch_up_abort();
      st = s.with_context(fmt::format("consumer {} post-processing {} after its catch-up", rank, model.post_group_names[k]));
      finish_report(st);
      return st;
    }
  }
  trace.record(TracePhase::kPost, -1, -1, tp, Clock::now());
  trace.stage(SyncStage::kCommit);
  param_set->catch_up_finish(v);
  if (Status r = record_committed(v); !r.ok()) trace.control(ControlKind::kStore, -1, -1, r.to_string());
  if (opts.weight_digests) weights.take(v, param_set->committed());
  if (Status p = publish_versions(); !p.ok()) trace.control(ControlKind::kStore, -1, -1, p.to_string());
  rep.catch_up_source = served_by;
  finish_report(Status::Ok());
  return rep;
}

}  // namespace ferry
