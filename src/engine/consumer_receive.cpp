// Consumer: one layer group of an attempt received from its producers, pulled (read
// from their staging and the trainers' memory through the lanes) or pushed (written into
// this consumer's receive slot and params), and under delta syncs its patches applied or
// repaired. Impl and what lives where: engine/consumer_impl.h.
#include "engine/consumer_impl.h"

namespace ferry {

void Consumer::Impl::plan_attempt() {
  std::lock_guard<std::mutex> lk(mu);  // the background thread is idle between attempts
  if (std::any_of(peers.begin(), peers.end(), [](const Peer& pe) { return !pe.in_schedule; })) rebuild_schedule();
  lanes.plan = make_consumer_attempt_plan(rank, schedule, lanes.cuda_ipc.get(), plan_route(), lanes.relay.get());
  recv.land_on(lanes.plan.cuda_ipc ? lanes.cuda_ipc->ring() : nullptr);
  delta.begin_attempt(recv.on_device());
  for (std::string& note : lanes.plan.notes) trace.control(ControlKind::kNote, -1, -1, std::move(note));
}

Status Consumer::Impl::receive_group(GroupRx& rx, const ConsumerGroupSchedule& gs, AttemptReads& reads,
                                     SyncReport& rep) {
  const auto t0 = Clock::now();
  FERRY_ASSIGN_OR_RETURN(const bool relayed, relay_group(rx, reads));  // (false: no relay, or not this group)
  if (relayed) return Status::Ok();
  FERRY_RETURN_IF_ERROR(opts.mode == SyncMode::kPull ? pull_group(rx, reads, rep) : push_group(rx, gs, reads, rep));
  record_receives(trace, rx.g, gs, recv.on_device(), t0, Clock::now(), rx.patched, rx.repaired);
  return Status::Ok();
}

Status Consumer::Impl::pull_group(GroupRx& rx, AttemptReads& reads, SyncReport& rep) {
  const uint64_t v = rx.v;
  const int g = rx.g;
  const uint64_t base = rx.base;
  const std::set<int>& from = rx.from;
  std::map<int, Arrival>& got = rx.got;
  std::map<int, Arrival>& announced = rx.announced;
  std::map<int, uint64_t>& patched = rx.patched;
  std::set<int>& repaired = rx.repaired;
  // Staged bytes: read from each producer as soon as it announced, and release it
  // at once (before any in-place bytes are waited for), so that one slow producer
  // never holds another's staging slot and producers pack on while we copy.
  auto tr0 = Clock::now();
  FERRY_RETURN_IF_ERROR(posted(reads, reads.begin_group(g, base)));
  trace.record(TracePhase::kRead, g, -1, tr0, Clock::now());
  std::set<int> remaining = from;
  bool first = true;
  while (!remaining.empty()) {
    trace.stage(SyncStage::kWire);
    auto tw = Clock::now();
    std::pair<int, Arrival> pm;
    if (!announced.empty()) {  // announced while we waited for the relay
      pm = *announced.begin();
      announced.erase(announced.begin());
    } else {
      FERRY_ASSIGN_OR_RETURN(pm, await_working(v, g, remaining, reads));
    }
    trace.record(TracePhase::kWait, g, pm.first, tw, Clock::now());
    trace.stage(SyncStage::kReceive);
    const int p = pm.first;
    got[p] = pm.second;
    remaining.erase(p);
    auto tr1 = Clock::now();
    std::vector<Completion> staged;
    // Delta: our segment is a patch. Read it where we hold its base; else the dense
    // bytes, from the kept copy (over the CUDA IPC lane: the GPU slot, never patched).
    const Arrival& a = got[p];
    const Read* pr =
        a.patch_base ? single_read_from(plan_route()->groups[static_cast<size_t>(g)], static_cast<uint32_t>(p)) : nullptr;
    const bool use_patch = pr && a.patch_bytes <= pr->length && delta.takes_patch(*param_set, g, *a.patch_base);
    if (use_patch) {
      FERRY_RETURN_IF_ERROR(posted(reads, reads.post_patch(g, p, a.patch_offset, a.patch_bytes, base, staged)));
    } else {
      const uint64_t at = a.patch_base && !recv.on_device() ? a.dense_offset : a.slot_offset;
      FERRY_RETURN_IF_ERROR(posted(reads, reads.post_staged(g, p, at, base, staged)));
    }
    if (first) {
      first = false;
      point(g, 1);
    }
    FERRY_RETURN_IF_ERROR(waited(staged, p, v, g));
    uint8_t took = Release::kDense;  // (what the producer's report counts)
    if (use_patch) {   // (applied before the release: a repair reads the producer's memory too)
      patched[p] = a.patch_bytes;
      took = Release::kPatch;
      if (Status applied = apply_patch(g, p, *pr, a.patch_bytes, base); !applied.ok()) {
        FERRY_RETURN_IF_ERROR(repair_patch(rx, reads, p, applied, rep));
        repaired.insert(p);
        took = Release::kRepaired;
      }
    }
    send_to(p, Release{me(), v, g, routes_hash, took});
    FERRY_RETURN_IF_ERROR(posted(reads, reads.announced(g, p, base)));  // (its in-place bytes, at reads' pace)
    trace.record(TracePhase::kRead, g, p, tr1, Clock::now());
  }
  // This group's in-place bytes: post what is left of them, wait for all.
  auto tr2 = Clock::now();
  while (reads.backlog_through(g)) FERRY_RETURN_IF_ERROR(posted(reads, reads.work_one()));
  for (int p : from) FERRY_RETURN_IF_ERROR(waited(reads.take(g, p), p, v, g));
  trace.record(TracePhase::kRead, g, -1, tr2, Clock::now());
  return Status::Ok();
}

Status Consumer::Impl::push_group(GroupRx& rx, const ConsumerGroupSchedule& gs, AttemptReads& reads, SyncReport& rep) {
  const uint64_t v = rx.v;
  const int g = rx.g;
  const uint64_t base = rx.base;
  const std::set<int>& from = rx.from;
  std::map<int, Arrival>& got = rx.got;
  const int s = rx.slot;
  std::map<int, uint64_t>& patched = rx.patched;
  std::set<int>& repaired = rx.repaired;
  {
    std::lock_guard<std::mutex> lk(mu);
    FERRY_RETURN_IF_ERROR(moved_on_locked(v, from));  // (before any producer is asked to write)
  }
  if (gs.direct) param_set->touch();  // producers write into params from here on: a failure now leaves us torn
  // Delta: the version our live params hold intact for this group, if we take patches.
  const std::optional<uint64_t> live = delta.patch_base(*param_set, g);
  for (int p : from) {
    push.readied.insert(p);
    ++push.unanswered[p];
    send_to(p, Ready{me(), v, g, routes_hash, static_cast<uint32_t>(s),
                     static_cast<uint8_t>(param_set->landing_index()), live});
  }
  point(g, 1);
  trace.stage(SyncStage::kWire);  // (push: the bytes move while we wait)
  auto tw = Clock::now();
  std::set<int> remaining = from;
  while (!remaining.empty()) {
    FERRY_ASSIGN_OR_RETURN(auto pm, await_any(v, g, remaining, "push"));
    got[pm.first] = pm.second;
    remaining.erase(pm.first);
    --push.unanswered[pm.first];  // PUSHED: its writes of (v, g) ended (flushed before it was sent)
  }
  trace.record(TracePhase::kWait, g, -1, tw, Clock::now());
  trace.stage(SyncStage::kReceive);
  for (int p : from) {  // delta: patches written into the slot, applied here
    const Arrival& a = got[p];
    if (!a.patch_base) continue;
    const Read* pr = single_read_from(plan_route()->groups[static_cast<size_t>(g)], static_cast<uint32_t>(p));
    Status applied = !live || *a.patch_base != *live || !pr || a.patch_bytes > pr->length
                         ? failed_precondition("a patch against version {} it did not ask for", *a.patch_base)
                         : apply_patch(g, p, *pr, a.patch_bytes, base);
    patched[p] = a.patch_bytes;  // (written into our slot whatever follows)
    if (!applied.ok()) {
      FERRY_RETURN_IF_ERROR(repair_patch(rx, reads, p, applied, rep));
      repaired.insert(p);
    }
  }
  return Status::Ok();
}

Status Consumer::Impl::repair_patch(GroupRx& rx, AttemptReads& reads, int p, const Status& why, SyncReport& rep) {
  ++rep.patches_repaired;
  trace.control(ControlKind::kRepair, p, rx.g, fmt::format("consumer {}: the patch of group {} from producer {} failed its check ({}); "
                                     "read its dense bytes instead", rank, rx.g, p, why.message()));
  std::vector<Completion> dense;
  FERRY_RETURN_IF_ERROR(posted(reads, reads.post_staged(rx.g, p, rx.got[p].dense_offset, rx.base, dense)));
  return waited(dense, p, rx.v, rx.g);
}

Status Consumer::Impl::apply_patch(int g, int p, const Read& read, uint64_t patch_bytes, uint64_t base) {
  return delta.apply(*param_set, schedule.unpack, g, p, read, patch_bytes,
                     plan_route()->groups[static_cast<size_t>(g)].recv_bytes, recv.host().data + base);
}

}  // namespace ferry
