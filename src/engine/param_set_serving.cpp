// ParamSet's live params as replicas read them, and a joiner's catch-up into its own
// (Consumer::catch_up, docs/elastic.md): where each live host param lies in registered
// memory, and the version the params hold around a catch-up. See param_set.h.
#include <map>

#include <fmt/format.h>

#include "engine/param_set.h"

namespace ferry::engine {

Result<const ParamSet::ServingLayout*> ParamSet::serving_layout() {
  if (serving_) return &*serving_;
  if (device_)
    return unimplemented("consumer {}: its params are on {}; a catch-up from replicas reads host memory only (it "
                         "receives the version from the producers at its next sync)",
                         opts_.rank, device_str(*device_));
  ServingLayout out;
  if (flips_) {
    // Both sets are ours, one registered arena each, laid out alike (create): the
    // placements name a param in either.
    out.sets[0] = published_[0];
    out.sets[1] = published_[1];
    out.params = placements_;
    serving_ = std::move(out);
    return &*serving_;
  }
  // The live buffers: each found in a registration that holds it whole, else registered
  // (the arena whole, once; a caller's buffer alone).
  std::map<const void*, uint32_t> key_of;  // registration (by base) -> index in sets[0]
  auto place = [&](const MemoryRegion& r, const std::byte* at, uint64_t bytes) {
    auto [it, fresh] = key_of.try_emplace(r.base, static_cast<uint32_t>(out.sets[0].size()));
    if (fresh) out.sets[0].push_back(r);
    return ParamTable::Param{it->second, static_cast<uint64_t>(at - static_cast<const std::byte*>(r.base)), bytes};
  };
  auto holding = [&](const std::byte* at, uint64_t bytes) -> const MemoryRegion* {
    for (const MemoryRegion& r : registrations_) {
      const auto* base = static_cast<const std::byte*>(r.base);
      if (at >= base && at + bytes <= base + r.length) return &r;
    }
    return nullptr;
  };
  for (const auto& [name, t] : live_) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype());
    if (bytes == 0) continue;
    FERRY_ASSIGN_OR_RETURN(void* data, t.data_ptr());
    const auto* at = static_cast<const std::byte*>(data);
    const MemoryRegion* r = holding(at, bytes);
    if (!r && arena_ && at >= arena_.get() && at + bytes <= arena_.get() + own_bytes_) {
      auto reg = memory_->register_memory(arena_.get(), own_bytes_);
      if (!reg.ok()) return reg.status().with_context(fmt::format("consumer {}: registering its params", opts_.rank));
      registrations_.push_back(*reg);
      r = &registrations_.back();
    } else if (!r) {
      auto reg = memory_->register_memory(data, bytes);
      if (!reg.ok()) return reg.status().with_context(fmt::format("consumer {}: registering param '{}'", opts_.rank, name));
      registrations_.push_back(*reg);
      r = &registrations_.back();
    }
    out.params[name] = place(*r, at, bytes);
  }
  serving_ = std::move(out);
  return &*serving_;
}

void ParamSet::catch_up_begin() {
  work_ = live_;
  made_anew_.clear();
  std::lock_guard<std::mutex> lk(mu_);
  catching_up_ = true;
  held_.received.reset();
}

void ParamSet::catch_up_abort() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!catching_up_) return;  // (nothing written: the params hold what they held)
  catching_up_ = false;
  held_.torn = true;  // (the live buffers themselves were written, whatever the policy)
}

void ParamSet::catch_up_finish(uint64_t version) {
  committed_ = work_;
  std::lock_guard<std::mutex> lk(mu_);
  catching_up_ = false;
  held_.version = version;
  held_.has_version = true;
  held_.torn = false;
  held_.mixed = false;
}

}  // namespace ferry::engine
