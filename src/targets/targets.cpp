// Targets (ferry/targets.h, docs/targets.md): target job names, the switch group's one
// decision per version over the store, and one rank's adapter slot table.
#include "ferry/targets.h"

#include "ferry/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

namespace ferry {
namespace {

using Millis = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

Status check_name(std::string_view what, std::string_view name) {
  if (name.empty() || name.size() > 64)
    return invalid_argument("{} name '{}' must be 1 to 64 bytes", what, name);
  for (char ch : name) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                    ch == '.' || ch == '-';
    if (!ok) return invalid_argument("{} name '{}' has '{}': only [A-Za-z0-9_.-]", what, name, ch);
  }
  return Status::Ok();
}

std::string switch_prefix(std::string_view job, uint64_t version) { return fmt::format("{}/switch/{}/", job, version); }
std::string serving_key(std::string_view job, int rank) { return fmt::format("{}/adapter/serving/{}", job, rank); }

// A vote as stored: "ready changed", "ready same" or "not <why>".
std::string encode_vote(const SwitchVote& v) {
  if (!v.ready) return "not " + v.why;
  return v.changed ? "ready changed" : "ready same";
}

std::optional<SwitchDecision> decode_decision(std::string_view s) {
  if (s == "switch") return SwitchDecision::kSwitch;
  if (s == "keep") return SwitchDecision::kKeep;
  if (s == "abort") return SwitchDecision::kAbort;
  return std::nullopt;
}

}  // namespace

Result<std::string> target_job(std::string_view job, std::string_view target) {
  if (target.empty()) return std::string(job);
  FERRY_RETURN_IF_ERROR(check_name("target", target));
  if (job.find('#') != std::string_view::npos)
    return invalid_argument("job name '{}' has '#', which separates a job from its targets", job);
  return fmt::format("{}#{}", job, target);
}

const char* switch_decision_name(SwitchDecision d) {
  switch (d) {
    case SwitchDecision::kSwitch: return "switch";
    case SwitchDecision::kKeep: return "keep";
    case SwitchDecision::kAbort: return "abort";
  }
  return "?";
}

Result<SwitchDecision> agree_switch(Store& store, std::string_view job, uint64_t version, int rank,
                                    const std::vector<int>& group, const SwitchVote& vote, Millis timeout,
                                    Millis keep) {
  if (group.empty()) return invalid_argument("agree_switch: the switch group is empty");
  for (int r : group)
    if (r < 0) return invalid_argument("agree_switch: rank {} in the switch group", r);
  if (std::find(group.begin(), group.end(), rank) == group.end())
    return invalid_argument("agree_switch: rank {} is not in its switch group", rank);
  const Millis ttl = std::max(keep, 4 * timeout);
  const std::string prefix = switch_prefix(job, version);
  const std::string decision_key = prefix + "decision";
  auto vote_key = [&](int r) { return fmt::format("{}vote/{}", prefix, r); };
  // Decides `d` unless another rank did first; either way, the decision.
  auto decide = [&](SwitchDecision d) -> Result<SwitchDecision> {
    FERRY_ASSIGN_OR_RETURN(CompareSetResult cs,
                           store.compare_set(decision_key, std::nullopt, switch_decision_name(d), ttl));
    if (!cs.value) return internal_error("agree_switch: the decision {} vanished as it was written", decision_key);
    auto got = decode_decision(*cs.value);
    if (!got) return corrupt("agree_switch: {} holds '{}', not a decision", decision_key, *cs.value);
    return *got;
  };
  const std::set<int> members(group.begin(), group.end());
  const auto deadline = Clock::now() + timeout;
  Status last_error;
  // A store error is retried until the deadline (a vote or a decision whose reply was
  // lost may have landed: the others may be deciding with it).
  bool voted = false;
  for (Millis nap{1};; nap = std::min(nap * 2, Millis{50})) {
    if (!voted) {
      Status s = store.set(vote_key(rank), encode_vote(vote), ttl);
      voted = s.ok();
      if (!voted) last_error = s;
    }
    if (voted && !vote.ready) {
      auto d = decide(SwitchDecision::kAbort);
      if (d.ok()) return d;
      last_error = d.status();
    }
    auto d = store.get(decision_key);
    if (d.ok()) {
      auto got = decode_decision(*d);
      if (!got) return corrupt("agree_switch: {} holds '{}', not a decision", decision_key, *d);
      return *got;
    }
    if (d.status().code() != StatusCode::kNotFound) last_error = d.status();
    // Every vote in: the decision follows from them.
    bool all = true, any_not = false, any_changed = false;
    if (voted && vote.ready && d.status().code() == StatusCode::kNotFound) {
      for (int r : members) {
        auto v = store.get(vote_key(r));
        if (!v.ok()) {
          all = false;
          if (v.status().code() != StatusCode::kNotFound) last_error = v.status();
          continue;
        }
        if (v->starts_with("not")) any_not = true;
        if (*v == "ready changed") any_changed = true;
      }
      if (any_not || all) {
        auto got = decide(any_not ? SwitchDecision::kAbort
                                  : any_changed ? SwitchDecision::kSwitch : SwitchDecision::kKeep);
        if (got.ok()) return got;
        last_error = got.status();
      }
    }
    if (Clock::now() >= deadline) {
      auto late = decide(SwitchDecision::kAbort);
      if (late.ok()) return late;
      return Status(late.status().code(),
                    fmt::format("agree_switch: version {} of {}: no decision within {} ms: {}{}", version, job,
                                timeout.count(), late.status().message(),
                                last_error.ok() ? "" : "; last store error: " + last_error.to_string()));
    }
    // (The TCP store wakes a wait on the write itself: the decision ends the nap at once.)
    store.wait({decision_key}, std::min(nap, std::chrono::duration_cast<Millis>(deadline - Clock::now()) + Millis{1}))
        .ignore();
  }
}

// --- AdapterSlots ----------------------------------------------------------------------

struct AdapterSlots::Impl {
  struct Slot {
    TensorMap params;  // owned buffers, the adapter consumer's params' shapes
    std::string name;
    std::optional<uint64_t> version;
    int readers = 0;
  };
  AdapterSlotOptions options;
  std::string job;
  int rank = 0;
  Store* store = nullptr;
  std::unique_ptr<Consumer> consumer;
  std::vector<int> group;
  mutable std::mutex mu;  // slots' names, versions, readers, serving
  std::condition_variable freed;  // a lease let go of its slot
  std::vector<Slot> slots;  // (readers counted under mu by const leases)
  int serving = -1;
  std::optional<uint64_t> last_decided;  // versions increase (a decision key is the version's)
  std::atomic<bool> syncing{false};
};

using Slot = AdapterSlots::Impl::Slot;

struct AdapterSlots::Lease::Held {
  AdapterSlots::Impl* impl;
  int slot;
};

AdapterSlots::Lease::Lease(Held* held) : held_(held) {}
AdapterSlots::Lease::Lease(Lease&& other) noexcept : held_(std::exchange(other.held_, nullptr)) {}
AdapterSlots::Lease& AdapterSlots::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Lease gone(std::move(*this));
    held_ = std::exchange(other.held_, nullptr);
  }
  return *this;
}
AdapterSlots::Lease::~Lease() {
  if (!held_) return;
  {
    // (Notified under the lock: once it is released the slots may be destroyed.)
    std::lock_guard<std::mutex> lk(held_->impl->mu);
    --held_->impl->slots[static_cast<size_t>(held_->slot)].readers;
    held_->impl->freed.notify_all();
  }
  delete held_;
}
// (A held slot's name, version and params change only when it is filled, never while held.)
const std::string& AdapterSlots::Lease::name() const { return held_->impl->slots[static_cast<size_t>(held_->slot)].name; }
uint64_t AdapterSlots::Lease::version() const {
  return held_->impl->slots[static_cast<size_t>(held_->slot)].version.value_or(0);
}
const TensorMap& AdapterSlots::Lease::params() const {
  return held_->impl->slots[static_cast<size_t>(held_->slot)].params;
}
int AdapterSlots::Lease::slot() const { return held_->slot; }

AdapterSlots::AdapterSlots(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdapterSlots::~AdapterSlots() = default;

Result<std::unique_ptr<AdapterSlots>> AdapterSlots::create(ConsumerModel model, int rank, Transport& transport,
                                                           Store& store, const ConsumerOptions& options,
                                                           const AdapterSlotOptions& slot_options) {
  FERRY_RETURN_IF_ERROR(check_name("adapter", slot_options.adapter));
  if (slot_options.slots < 2)
    return invalid_argument("adapter '{}': {} slots; at least 2 (one serving, one to fill)", slot_options.adapter,
                            slot_options.slots);
  if (options.commit != CommitPolicy::kInPlace)
    return invalid_argument("adapter '{}': commit policy {}: the slots make versions live themselves, so the "
                            "adapter's consumer lands them in place (CommitPolicy::kInPlace)",
                            slot_options.adapter, commit_policy_name(options.commit));
  if (slot_options.switch_timeout.count() <= 0 || slot_options.slot_wait.count() < 0)
    return invalid_argument("adapter '{}': switch_timeout must be positive and slot_wait not negative",
                            slot_options.adapter);
  auto impl = std::make_unique<Impl>();
  impl->options = slot_options;
  impl->job = options.job;
  impl->rank = rank;
  impl->store = &store;
  impl->group = slot_options.switch_group;
  if (impl->group.empty()) {
    for (int c = 0; c < options.num_consumers; ++c) impl->group.push_back(c);
  }
  if (std::find(impl->group.begin(), impl->group.end(), rank) == impl->group.end())
    return invalid_argument("adapter '{}': rank {} is not in its switch group", slot_options.adapter, rank);
  FERRY_ASSIGN_OR_RETURN(impl->consumer, Consumer::create(std::move(model), rank, transport, store, options));
  for (int s = 0; s < slot_options.slots; ++s) {
    Slot slot;
    for (const auto& [name, t] : impl->consumer->params()) {
      if (!t.device().is_host())
        return unimplemented("adapter '{}': param {} is on {}; adapter slots are host memory", slot_options.adapter,
                             name, device_str(t.device()));
      Tensor buf = Tensor::empty(t.shape(), t.dtype(), name);
      FERRY_RETURN_IF_ERROR(buf.zero_());
      slot.params.emplace(name, buf);
    }
    impl->slots.push_back(std::move(slot));
  }
  return std::unique_ptr<AdapterSlots>(new AdapterSlots(std::move(impl)));
}

Result<AdapterSlots::Report> AdapterSlots::sync(uint64_t version) {
  Impl& m = *impl_;
  if (m.syncing.exchange(true)) return failed_precondition("adapter '{}': sync while another runs", m.options.adapter);
  struct Done {
    std::atomic<bool>& f;
    ~Done() { f = false; }
  } done{m.syncing};
  if (m.last_decided && version <= *m.last_decided)
    return invalid_argument("adapter '{}' rank {}: version {} is not above {}, the last its switch group decided (a "
                            "version is decided once: sync a rollback under a new number)",
                            m.options.adapter, m.rank, version, *m.last_decided);
  Report rep;
  SwitchVote vote;
  auto synced = m.consumer->sync(version);
  if (synced.ok()) {
    rep.sync = *synced;
  } else {
    rep.sync = m.consumer->last_report();
    if (rep.sync.status.ok()) rep.sync.status = synced.status();
  }
  // A slot to fill: neither serving nor held by a reader (readers hold only the serving
  // slot or ones that served before; a slot chosen here is not serving, so no reader can
  // take it until it is switched to). A reader still on an older version is waited for,
  // up to slot_wait: it lets go as soon as it is done with that version.
  int fill = -1;
  if (synced.ok()) {
    std::unique_lock<std::mutex> lk(m.mu);
    auto choose = [&] {
      for (int s = 0; s < static_cast<int>(m.slots.size()); ++s) {
        const Slot& sl = m.slots[static_cast<size_t>(s)];
        if (s == m.serving || sl.readers > 0) continue;
        if (fill < 0 || !sl.version || (m.slots[static_cast<size_t>(fill)].version &&
                                        *sl.version < *m.slots[static_cast<size_t>(fill)].version))
          fill = s;  // (the emptiest, else the oldest)
      }
      return fill >= 0;
    };
    m.freed.wait_for(lk, m.options.slot_wait, choose);
    if (fill >= 0) {
      Slot& sl = m.slots[static_cast<size_t>(fill)];
      sl.name.clear();
      sl.version.reset();
    }
  }
  if (!synced.ok()) {
    vote.why = synced.status().to_string();
  } else if (fill < 0) {
    vote.why = fmt::format("adapter '{}' rank {}: all {} slots are serving or held by readers after {} ms",
                           m.options.adapter, m.rank, m.slots.size(), m.options.slot_wait.count());
    rep.sync.failures.push_back(vote.why);
  } else {
    // Copy into the slot (no reader can hold it), comparing with what serves.
    Slot& sl = m.slots[static_cast<size_t>(fill)];
    const Slot* live = m.serving >= 0 ? &m.slots[static_cast<size_t>(m.serving)] : nullptr;
    bool changed = live == nullptr;
    Status copied;
    for (const auto& [name, t] : m.consumer->params()) {
      auto src = t.data_ptr();
      auto dst = sl.params.at(name).data_ptr();
      if (!src.ok() || !dst.ok()) {
        copied = !src.ok() ? src.status() : dst.status();
        break;
      }
      const size_t n = static_cast<size_t>(t.nbytes());
      std::memcpy(*dst, *src, n);
      if (!changed) {
        auto was = live->params.at(name).data_ptr();
        changed = !was.ok() || std::memcmp(*was, *dst, n) != 0;
      }
    }
    if (copied.ok()) {
      vote.ready = true;
      vote.changed = changed;
      rep.unchanged = !changed;
      rep.slot = fill;
    } else {
      vote.why = copied.to_string();
    }
  }
  FERRY_ASSIGN_OR_RETURN(rep.decision, agree_switch(*m.store, m.job, version, m.rank, m.group, vote,
                                                   m.options.switch_timeout));
  m.last_decided = version;
  std::lock_guard<std::mutex> lk(m.mu);
  if (rep.decision == SwitchDecision::kSwitch && vote.ready) {
    Slot& sl = m.slots[static_cast<size_t>(fill)];
    sl.version = version;
    sl.name = fmt::format("{}@{}", m.options.adapter, version);
    m.serving = fill;
  } else if (rep.decision == SwitchDecision::kSwitch) {
    // (The group switched without this rank: it cannot, since it voted not ready. A
    // decision against its own vote is the store's or another writer's fault.)
    return corrupt("adapter '{}' rank {}: the group switched to version {} that this rank did not receive",
                     m.options.adapter, m.rank, version);
  } else {
    rep.slot = rep.decision == SwitchDecision::kKeep ? -1 : rep.slot;
    if (rep.decision == SwitchDecision::kAbort && vote.ready)
      rep.sync.failures.push_back(fmt::format("adapter '{}' rank {}: version {} aborted by its switch group; {} "
                                              "keeps serving", m.options.adapter, m.rank, version,
                                              m.serving >= 0 ? m.slots[static_cast<size_t>(m.serving)].name
                                                             : std::string("nothing")));
    if (rep.decision == SwitchDecision::kAbort) rep.slot = -1;
  }
  rep.serving = m.serving >= 0 ? m.slots[static_cast<size_t>(m.serving)].name : "";
  // What this rank serves, for operators (adapter_serving): the store's committed version
  // is what the adapter consumer received, which an abort or a keep leaves ahead of it.
  if (Status w = m.store->set(serving_key(m.job, m.rank), rep.serving); !w.ok())
    rep.sync.failures.push_back(fmt::format("adapter '{}' rank {}: recording what it serves: {}", m.options.adapter,
                                            m.rank, w.to_string()));
  return rep;
}

Result<std::vector<std::optional<std::string>>> adapter_serving(Store& store, std::string_view job,
                                                                 int num_consumers) {
  if (num_consumers < 0) return invalid_argument("adapter_serving: num_consumers {} < 0", num_consumers);
  std::vector<std::optional<std::string>> out;
  for (int c = 0; c < num_consumers; ++c) {
    auto v = store.get(serving_key(job, c));
    if (v.ok()) {
      out.push_back(v->empty() ? std::nullopt : std::optional<std::string>(*v));
    } else if (v.status().code() == StatusCode::kNotFound) {
      out.push_back(std::nullopt);
    } else {
      return v.status();
    }
  }
  return out;
}

std::optional<AdapterSlots::Lease> AdapterSlots::acquire() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  if (impl_->serving < 0) return std::nullopt;
  ++impl_->slots[static_cast<size_t>(impl_->serving)].readers;
  return Lease(new Lease::Held{impl_.get(), impl_->serving});
}

std::vector<AdapterSlots::SlotState> AdapterSlots::slots() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  std::vector<SlotState> out;
  for (int s = 0; s < static_cast<int>(impl_->slots.size()); ++s) {
    const Slot& sl = impl_->slots[static_cast<size_t>(s)];
    out.push_back({s, sl.name, sl.version, s == impl_->serving, sl.readers});
  }
  return out;
}

Consumer& AdapterSlots::consumer() { return *impl_->consumer; }

}  // namespace ferry
