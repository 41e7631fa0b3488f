// Consumer: relay within a host (ConsumerOptions::relay, docs/relay.md). Consumers of one
// plan class on one host read identical bytes into identical receive-slot layouts; the
// lowest live one (the relay) reads each layer group across the network, and the others
// (members) copy its receive slot over shared memory once it verified the group. The
// relay lends a slot to a member by an offer and takes it back only after the member's
// release (kept) or after relay_hold() (then the member is told the slot was cut, and
// reads that group from the producers, which keep it staged for every consumer that has
// not released it). Impl: engine/consumer_impl.h.
#include "engine/consumer_impl.h"

namespace ferry {

void Consumer::Impl::refresh_relay() {
  RelayLink before;
  {
    std::lock_guard<std::mutex> lk(mu);  // (the handlers read the link under mu)
    before = relay.link;
    relay.link = RelayLink{};
    relay.inbox.clear();
    relay.members.clear();
  }
  const RelayLink next = opts.relay ? find_relay(before) : RelayLink{};
  if (next.rank < 0 && lanes.relay) lanes.relay->disconnect();  // (find_relay connects the lane to a new one)
  {
    std::lock_guard<std::mutex> lk(mu);
    relay.link = next;
  }
  // Reading over CUDA IPC this attempt, its host ring holds nothing to offer: asks kept
  // from before (a member that began first) are answered gone now, not when it ends.
  if (opts.relay && recv.on_device()) relay_attempt_over(std::numeric_limits<uint64_t>::max());
}

Consumer::Impl::RelayLink Consumer::Impl::find_relay(const RelayLink& before) {
  const size_t mine = routes.consumer_plan[static_cast<size_t>(rank)];
  // The live consumers of this one's relay group below (relay candidates) or above it
  // (members it may relay for): same plan class, same host and, under the rotated order,
  // the same order (a rank's replicas in other cohorts read each group at other times).
  auto same_group = [&](int c) -> std::optional<ConsumerLease> {
    if (routes.consumer_plan[static_cast<size_t>(c)] != mine) return std::nullopt;
    if (!relay.orders.empty() && relay.orders[static_cast<size_t>(c)] != relay.orders[static_cast<size_t>(rank)])
      return std::nullopt;
    auto blob = store.get(keys.consumer(c));
    if (!blob.ok()) return std::nullopt;  // not live (or the store hiccuped: no relay with it this attempt)
    auto lease = decode_consumer_lease(*blob);
    if (!lease.ok() || lease->host != host_identity()) return std::nullopt;
    return std::move(*lease);
  };
  // Answers go to a peer's transport only once connected to it (an ask arrives on the
  // member's connection): every consumer connects to those it may relay for.
  std::map<int, PeerId> members;
  for (int c = rank + 1; c < opts.num_consumers; ++c) {
    auto lease = same_group(c);
    if (!lease) continue;
    auto id = transport.connect(string_bytes(lease->address));
    if (id.ok()) {
      members[c] = *id;
    } else {
      trace.control(ControlKind::kRelayUnreached, c, -1, fmt::format("consumer {}: consumer {} on this host not reached ({})", rank, c,
                                         id.status().message()));
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    relay.members = recv.on_device() ? std::map<int, PeerId>{} : std::move(members);  // (connected: told "gone")
  }
  if (recv.on_device()) return RelayLink{};  // (its ring is on the GPU: it copies from no relay either)
  for (int c = 0; c < rank; ++c) {  // the relay is the lowest live rank of the group
    auto lease = same_group(c);
    if (!lease) continue;
    RelayLink link;
    link.rank = c;
    link.lease = lease->instance();  // (not its versions: they change every sync)
    if (before.rank == c && before.lease == link.lease && lanes.relay->relay() == c) {  // the same instance: keep its import
      link.id = before.id;
      return link;
    }
    auto id = transport.connect(string_bytes(lease->address));
    if (!id.ok()) {
      trace.control(ControlKind::kRelayUnreached, c, -1, fmt::format("consumer {}: relay consumer {} not reached ({}); reading from the producers",
                                         rank, c, id.status().message()));
      return RelayLink{};
    }
    if (Status st = lanes.relay->connect(c, lease->recv_key); !st.ok()) {
      trace.control(ControlKind::kRelayUnreached, c, -1, fmt::format("consumer {}: {}; reading from the producers", rank,
                                                                     st.message()));
      return RelayLink{};
    }
    link.id = *id;
    return link;
  }
  return RelayLink{};
}

void Consumer::Impl::on_relay(PeerId from, const Relay& m) {
  const int c = static_cast<int>(m.consumer);
  if (c < 0 || c >= opts.num_consumers || c == rank) return;
  std::optional<Relay> reply;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto answer = [&](Relay::Kind kind, uint64_t offset = 0) {
      reply = Relay{me(), m.version, m.group, m.routes, static_cast<uint8_t>(kind), offset};
    };
    switch (m.kind) {
      case Relay::kAsk: {
        if (!opts.relay || recv.on_device()) {
          answer(Relay::kGone);
          break;
        }
        for (int s = 0; s < kSlots; ++s) {
          RelaySlot& sl = relay.slots[s];
          if (sl.valid && sl.version == m.version && sl.group == m.group && sl.routes == m.routes) {
            sl.readers[c] = from;
            answer(Relay::kOffer, recv.offset(s));
            break;
          }
        }
        if (reply) break;
        const auto key = std::make_tuple(m.version, static_cast<int>(m.group), m.routes);
        // A group of the sync and routes it runs, not landed yet, or, between its syncs, of
        // a sync it has not begun (a member may begin first): offered when it lands. A
        // member in another sync than the relay's reads from the producers (which then
        // tell it of a version mismatch as they would).
        const bool now = syncs.syncing && *syncs.syncing == m.version && m.routes == routes_hash && !relay.passed.count(key);
        const bool later = !syncs.syncing && !syncs.attempted.count(m.version);
        if ((now || later) && relay.asks.size() < 4 * static_cast<size_t>(routes.num_groups() + 1)) {
          relay.asks[key][c] = from;
        } else {
          answer(Relay::kGone);
        }
        break;
      }
      case Relay::kRelease: {
        bool kept = false;
        for (RelaySlot& sl : relay.slots) {
          if (sl.version != m.version || sl.group != m.group || sl.routes != m.routes) continue;
          if (auto it = sl.readers.find(c); it != sl.readers.end()) {
            sl.readers.erase(it);
            sl.released.insert(c);
            kept = true;
            cv.notify_all();
          }
        }
        if (kept && m.group >= 0 && m.group < routes.num_groups() && m.routes == routes_hash) {
          const auto now = Clock::now();
          trace.record(TracePhase::kSend, m.group, c, now, now, TraceLane::kRelay,
                       plan_route()->groups[static_cast<size_t>(m.group)].recv_bytes);
        }
        answer(kept ? Relay::kKept : Relay::kCut);
        break;
      }
      default:  // the relay's answers to this member
        if (c != relay.link.rank || from != relay.link.id) return;
        relay.inbox[{m.version, m.group}] = m;
        cv.notify_all();
        return;
    }
  }
  if (!reply || transport.send(from, kEngineTag, encode_message(*reply)).ok()) return;
  // Not connected to that member yet (it asked before this relay's attempt reached it in
  // the store): kept as an ask, answered once connected (relay_landed, relay_attempt_over).
  if (reply->kind == Relay::kOffer || reply->kind == Relay::kGone) {
    std::lock_guard<std::mutex> lk(mu);
    if (reply->kind == Relay::kOffer)
      for (RelaySlot& sl : relay.slots) sl.readers.erase(c);
    relay.asks[{m.version, m.group, m.routes}][c] = from;
  }
}

void Consumer::Impl::relay_landed(uint64_t v, int g, int s) {
  if (!opts.relay || recv.on_device()) return;  // (over CUDA IPC the group lands in the GPU ring: nothing to offer)
  std::vector<std::pair<PeerId, Relay>> offers;
  {
    std::lock_guard<std::mutex> lk(mu);
    RelaySlot& sl = relay.slots[s];
    sl.valid = true;
    sl.version = v;
    sl.group = g;
    sl.routes = routes_hash;
    // This group's asks, and any kept for a group still held here (an offer that could
    // not be sent before: tried again now that this attempt connected its members).
    for (int k = 0; k < kSlots; ++k) {
      RelaySlot& held = relay.slots[k];
      if (!held.valid) continue;
      auto it = relay.asks.find({held.version, held.group, held.routes});
      if (it == relay.asks.end()) continue;
      for (const auto& [c, id] : it->second) {
        held.readers[c] = id;
        offers.emplace_back(id, Relay{me(), held.version, held.group, held.routes, Relay::kOffer,
                                      recv.offset(k)});
      }
      relay.asks.erase(it);
    }
  }
  for (const auto& [id, m] : offers) static_cast<void>(transport.send(id, kEngineTag, encode_message(m)));
}

void Consumer::Impl::relay_reuse(int s) {
  if (!opts.relay) return;  // (no slot is lent without relay)
  std::unique_lock<std::mutex> lk(mu);
  RelaySlot& sl = relay.slots[s];
  // Every member this relay expects copies the slot's group first (it asks as soon as
  // its own slot is free, so usually before the group even landed here): a member a
  // little late must not find it gone and read it across the network.
  auto unfinished = [&] {
    std::vector<int> out;
    if (!sl.valid) return out;
    for (const auto& [c, id] : relay.members)
      if (!sl.released.count(c)) out.push_back(c);
    for (const auto& [c, id] : sl.readers)
      if (!relay.members.count(c)) out.push_back(c);
    return out;
  };
  const auto until = Clock::now() + relay_hold();
  cv.wait_until(lk, until, [&] { return unfinished().empty() || crashed; });
  for (int c : unfinished()) relay.members.erase(c);  // too slow: not waited for again this attempt
  if (sl.valid) relay.passed.insert({sl.version, sl.group, sl.routes});
  sl = RelaySlot{};  // (readers still there are cut: their release finds them in no slot)
}

void Consumer::Impl::relay_attempt_over(uint64_t version) {
  std::vector<std::pair<PeerId, Relay>> gone;
  {
    std::lock_guard<std::mutex> lk(mu);
    for (auto it = relay.asks.begin(); it != relay.asks.end();) {
      const auto& [v, g, r] = it->first;
      if (v > version) {  // a later sync's: kept for it
        ++it;
        continue;
      }
      for (const auto& [c, id] : it->second) gone.emplace_back(id, Relay{me(), v, g, r, Relay::kGone, 0});
      it = relay.asks.erase(it);
    }
  }
  for (const auto& [id, m] : gone) static_cast<void>(transport.send(id, kEngineTag, encode_message(m)));
}

Result<bool> Consumer::Impl::copy_from_relay(AttemptReads& reads, uint64_t v, int g, uint64_t base,
                                             const std::set<int>& from) {
  const int r = relay.link.rank;
  auto give_up = [&](std::string why) {
    std::lock_guard<std::mutex> lk(mu);
    relay.link.lost = true;
    relay.link.why = std::move(why);
    return false;
  };
  auto send_relay = [&](Relay::Kind kind) {
    return transport.send(relay.link.id, kEngineTag, encode_message(Relay{me(), v, g, routes_hash, kind, 0})).ok();
  };
  // Waits for the relay's answer of one of `kinds` to (v, g): the answer, or nullopt once
  // the relay is lost (failed, lease gone at two checks a lease_ttl apart, or silent past
  // the timeout). JOINs every producer meanwhile, so that none drops this member as a
  // straggler for what its relay takes.
  using Answer = Result<std::optional<Relay>>;
  auto await_answer = [&](std::initializer_list<uint8_t> kinds) -> Answer {
    std::unique_lock<std::mutex> lk(mu);
    WaitTicks ticks{Clock::now() + opts.timeout, health_probe_every(opts.lease_ttl), keepalive_every(),
                    opts.lease_ttl.count() > 0 ? Clock::duration(opts.lease_ttl) : Clock::duration{}};
    LapseWatch lapses;
    auto step = [&]() -> std::optional<Answer> {
      if (auto it = relay.inbox.find({v, g}); it != relay.inbox.end() && it->second.routes == routes_hash &&
                                                 std::find(kinds.begin(), kinds.end(), it->second.kind) != kinds.end()) {
        Relay m = it->second;
        relay.inbox.erase(it);
        return Answer(std::optional<Relay>(m));
      }
      if (relay.link.lost) return Answer(std::optional<Relay>());  // (mu held)
      // What ends a wait for producers ends this one too (await_any, polled: a producer
      // failed, dropped us or serves another version, producers switched routes, our
      // transport or unpack worker failed).
      lk.unlock();
      bool none = false;
      auto a = await_any(v, g, from, "relay answer", &none);
      lk.lock();
      if (!none) {
        if (!a.ok()) return Answer(a.status());
        inbox[{v, g, a->first}] = a->second;  // (not taken here: the fallback reads it)
      }
      return std::nullopt;
    };
    auto keepalive = [&] { join_producers(v); };
    auto check = [&]() -> std::optional<Answer> {
      auto blob = store.get(keys.consumer(r));
      const bool gone = !blob.ok() && blob.status().code() == StatusCode::kNotFound;
      bool other = false;  // another instance registered: this one is gone
      if (blob.ok()) {
        auto l = decode_consumer_lease(*blob);
        other = !l.ok() || l->instance() != relay.link.lease;
      }
      if (!lapses.lapsed(r, gone || other)) return std::nullopt;
      std::lock_guard<std::mutex> relock(mu);
      relay.link.lost = true;
      relay.link.why = fmt::format("relay consumer {}'s lease gone for over {} ms (paused, cut off or dead)", r,
                                   opts.lease_ttl.count());
      return Answer(std::optional<Relay>());
    };
    auto late = [&] {
      relay.link.lost = true;
      relay.link.why = fmt::format("no answer from relay consumer {} for group {} within {} ms", r, g,
                                   opts.timeout.count());
      return Answer(std::optional<Relay>());
    };
    return wait_loop<Answer>(lk, cv, ticks, step, keepalive, check, late);
  };
  if (!send_relay(Relay::kAsk)) return give_up(fmt::format("relay consumer {} not reachable", r));
  FERRY_ASSIGN_OR_RETURN(auto offer, await_answer({Relay::kOffer, Relay::kGone}));
  if (!offer) return false;
  if (offer->kind == Relay::kGone) return false;  // this group only: it could not keep it for us
  const uint64_t n = plan_route()->groups[static_cast<size_t>(g)].recv_bytes;
  const auto t0 = Clock::now();
  std::vector<Completion> copy;
  if (Status st = reads.post_relayed(g, offer->offset, base, copy); !st.ok())
    return give_up(fmt::format("reading relay consumer {}'s ring: {}", r, st.message()));
  if (Status st = wait_all(copy, opts.timeout); !st.ok())
    return give_up(fmt::format("reading relay consumer {}'s ring: {}", r, st.message()));
  if (!send_relay(Relay::kRelease)) return give_up(fmt::format("relay consumer {} not reachable", r));
  FERRY_ASSIGN_OR_RETURN(auto kept, await_answer({Relay::kKept, Relay::kCut}));
  if (!kept || kept->kind != Relay::kKept) return false;  // (cut: it needed the slot back before we were done)
  trace.record(TracePhase::kReceive, g, r, t0, Clock::now(), TraceLane::kRelay, n);
  return true;
}

// A member copies the group from its relay's receive ring once every producer announced
// it (pull), then releases them all (Release::kRelayed: nothing read from them; push: no write
// owed). false (the group is read from the producers, which still hold it staged;
// rx.announced keeps what came meanwhile) when this attempt has no relay, or the relay
// cannot offer the group, cut it short or is lost.
Result<bool> Consumer::Impl::relay_group(GroupRx& rx, AttemptReads& reads) {
  if (!reads.relayed(rx.g)) return false;
  {
    std::lock_guard<std::mutex> lk(mu);  // (`lost` is set by the handlers too)
    if (relay.link.rank < 0 || relay.link.lost) return false;
  }
  const uint64_t v = rx.v;
  const int g = rx.g;
  if (opts.mode == SyncMode::kPull) {
    std::set<int> remaining = rx.from;
    trace.stage(SyncStage::kWire);
    auto tw = Clock::now();
    while (!remaining.empty()) {
      FERRY_ASSIGN_OR_RETURN(auto pm, await_any(v, g, remaining, "announce"));
      rx.announced[pm.first] = pm.second;
      remaining.erase(pm.first);
    }
    trace.record(TracePhase::kWait, g, -1, tw, Clock::now());
    trace.stage(SyncStage::kReceive);
  }
  point(g, 1);
  auto tr = Clock::now();
  FERRY_ASSIGN_OR_RETURN(const bool relayed, copy_from_relay(reads, v, g, rx.base, rx.from));
  trace.record(TracePhase::kRead, g, -1, tr, Clock::now());
  if (relayed) {
    for (int p : rx.from) send_to(p, Release{me(), v, g, routes_hash, Release::kRelayed});
    rx.got = rx.announced;
    return true;
  }
  std::lock_guard<std::mutex> lk(mu);
  if (relay.link.lost)
    trace.control(ControlKind::kRelayLost, relay.link.rank, g, fmt::format("consumer {}: relay consumer {} lost at group {} ({}); the rest of the attempt "
                                       "is read from the producers", rank, relay.link.rank, g, relay.link.why));
  return false;
}

}  // namespace ferry
