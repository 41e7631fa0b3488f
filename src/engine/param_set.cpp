#include "engine/param_set.h"

#include <cstdlib>
#include <cstring>
#include <set>
#include <algorithm>

#include <fmt/format.h>

#include "engine/registered_buffer.h"
#include "engine/schedule.h"

namespace ferry::engine {

namespace {

class TransportParamMemory final : public ParamMemory {
 public:
  explicit TransportParamMemory(Transport& t) : t_(t) {}
  Result<MemoryRegion> allocate(uint64_t bytes) override { return t_.allocate_memory(bytes); }
  Result<MemoryRegion> register_memory(void* base, uint64_t bytes) override { return t_.register_memory(base, bytes); }
  void release(const MemoryRegion& region) override { t_.deregister_memory(region).ignore(); }

 private:
  Transport& t_;
};

class HostParamMemory final : public ParamMemory {
 public:
  Result<MemoryRegion> allocate(uint64_t bytes) override {
    void* mem = std::aligned_alloc(4096, align_up(std::max<uint64_t>(bytes, 1), 4096));
    if (!mem) return io_error("allocating {} bytes of host memory", bytes);
    std::memset(mem, 0, bytes);
    allocated_.insert(mem);
    return MemoryRegion{0, mem, bytes, MemoryKind::kHost};
  }
  Result<MemoryRegion> register_memory(void* base, uint64_t bytes) override {
    return MemoryRegion{0, base, bytes, MemoryKind::kHost};
  }
  void release(const MemoryRegion& region) override {
    if (allocated_.erase(region.base)) std::free(region.base);
  }
  ~HostParamMemory() override {
    for (void* p : allocated_) std::free(p);
  }

 private:
  std::set<void*> allocated_;
};

}  // namespace

std::unique_ptr<ParamMemory> host_param_memory() { return std::make_unique<HostParamMemory>(); }

std::unique_ptr<ParamMemory> transport_param_memory(Transport& t) { return std::make_unique<TransportParamMemory>(t); }

ParamSet::ParamSet(const ParamSetOptions& opts, std::unique_ptr<ParamMemory> memory)
    : opts_(opts), memory_(std::move(memory)) {}

ParamSet::~ParamSet() {
  for (const MemoryRegion& r : registrations_) memory_->release(r);
}

Result<std::unique_ptr<ParamSet>> ParamSet::create(const ParamSetOptions& opts, const std::vector<TensorDecl>& decls,
                                                   const TensorMap& caller, std::unique_ptr<ParamMemory> memory) {
  std::unique_ptr<ParamSet> set(new ParamSet(opts, std::move(memory)));
  ParamSet& m = *set;
  const int rank = opts.rank;
  // Shadow: the two sets swap roles at commit when both are ours (so on the host). In
  // push, producers write into whichever of the two sets each READY names.
  m.flips_ = opts.shadow && caller.empty();
  // The caller's buffers (each registered, if large enough to be read or written into
  // directly), or ours: one arena (zeroed; one registration). In push, their keys go to
  // producers in the lease (ParamTable), so that they write there. Under shadow the
  // live buffers are landed in by nobody (the shadow is; unless they flip): not
  // registered.
  const bool land_live = !opts.shadow && !opts.groups;
  uint64_t arena_bytes = 0;
  for (const TensorDecl& d : decls) {
    auto it = caller.find(d.name);
    if (it == caller.end()) {
      arena_bytes += align_up(shape_numel(d.shape) * dtype_size(d.dtype), 64);
      continue;
    }
    const Tensor& t = it->second;
    if (!t.is_real() || !t.is_contiguous() || t.dtype() != d.dtype || t.shape() != d.shape)
      return invalid_argument("consumer {}: param buffer '{}' must be real, contiguous, {} {}", rank, d.name,
                              dtype_name(d.dtype), shape_str(d.shape));
  }
  auto own_heap = [&](uint64_t bytes, bool registered,
                      std::shared_ptr<std::byte>& out) -> Result<std::optional<MemoryRegion>> {
    void* mem = std::aligned_alloc(4096, bytes);
    if (!mem) return io_error("consumer {}: allocating {} bytes of params", rank, bytes);
    std::memset(mem, 0, bytes);
    out = std::shared_ptr<std::byte>(static_cast<std::byte*>(mem), [](std::byte* b) { std::free(b); });
    if (!registered) return std::optional<MemoryRegion>();
    auto r = m.memory_->register_memory(mem, bytes);
    if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: registering its params", rank));
    m.registrations_.push_back(*r);
    return std::optional<MemoryRegion>(*r);
  };
  auto own_arena = [&](uint64_t bytes, bool registered, bool by_transport,
                       std::shared_ptr<std::byte>& out) -> Result<std::optional<MemoryRegion>> {
    if (by_transport) {
      // Producers write into it (push), or joiners read it (a catch-up): the transport's
      // own memory, which peers on the host reach by plain copy (UCX shared memory reads
      // and writes memory registered in place only by message, at tcp speed). Freed with
      // its registration when the consumer goes. In pull a transport that cannot allocate
      // it (a small /dev/shm) leaves it to the heap below.
      auto r = m.memory_->allocate(bytes);
      if (!r.ok() && !opts.push) return own_heap(bytes, registered, out);
      if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: allocating {} bytes of params", rank, bytes));
      m.registrations_.push_back(*r);
      std::memset(r->base, 0, bytes);
      out = std::shared_ptr<std::byte>(static_cast<std::byte*>(r->base), [](std::byte*) {});
      return std::optional<MemoryRegion>(*r);
    }
    return own_heap(bytes, registered, out);
  };
  std::optional<MemoryRegion> arena_region;
  if (arena_bytes) {
    arena_bytes = align_up(arena_bytes, 4096);
    m.own_bytes_ = arena_bytes;
    FERRY_ASSIGN_OR_RETURN(arena_region, own_arena(arena_bytes, land_live || m.flips_,
                                                   (land_live || m.flips_) && (opts.push || opts.own_in_transport), m.arena_));
  }
  if (arena_region && land_live) m.landing_.push_back(*arena_region);  // the arena is registration 0
  if (arena_region && m.flips_) m.other_.push_back(*arena_region);
  uint64_t at = 0, host_bytes = 0, device_bytes = 0;
  for (const TensorDecl& d : decls) {
    const uint64_t bytes = shape_numel(d.shape) * dtype_size(d.dtype);
    auto it = caller.find(d.name);
    const bool on_gpu = it != caller.end() && it->second.device().is_cuda();
    (on_gpu ? device_bytes : host_bytes) += align_up(bytes, 64);
    if (it == caller.end()) {
      m.live_.emplace(d.name, Tensor::borrow(m.arena_.get() + at, d.shape, d.dtype, m.arena_, d.name));
      if (land_live) m.placements_[d.name] = ParamTable::Param{0, at, bytes};
      at += align_up(bytes, 64);
      continue;
    }
    const Tensor& t = it->second;
    m.live_.emplace(d.name, t);
    m.given_.emplace(d.name, t);
    if (on_gpu) {
      // In GPU memory: unpacked there by a kernel from the receive ring (made visible to
      // the device, or on the device for CUDA IPC), never read into directly. Even a
      // transport that moves CUDA memory (Transport::supports_memory) reaches some peers
      // only by ferry's host-side message emulation (tcp, shared-memory regions
      // registered in place), which refuses CUDA memory: reading straight into GPU params
      // needs that choice made per peer, not built yet.
      if (m.device_ && *m.device_ != t.device()) {
        return invalid_argument("consumer {}: params on {} and {} ('{}'); ferry stages for one GPU per rank", rank,
                                device_str(*m.device_), device_str(t.device()), d.name);
      }
      m.device_ = t.device();
      continue;
    }
    if (!land_live || bytes < opts.direct_min_bytes || bytes == 0) continue;
    FERRY_ASSIGN_OR_RETURN(void* data, t.data_ptr());
    auto r = m.memory_->register_memory(data, bytes);
    if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: registering param '{}'", rank, d.name));
    m.registrations_.push_back(*r);
    m.landing_.push_back(*r);
    m.placements_[d.name] = ParamTable::Param{static_cast<uint32_t>(m.landing_.size() - 1), 0, bytes};
  }
  m.all_on_device_ = m.device_.has_value();
  for (const TensorDecl& d : decls) {
    auto it = caller.find(d.name);
    m.all_on_device_ &= it != caller.end() && it->second.device().is_cuda();
  }
  if (!opts.shadow) {
    m.loaded_ = m.live_;
  } else {
    // The shadow: every param again, laid out as the own arena is (so that a flip keeps
    // every placement), host params in one registered arena (the transport's memory in
    // push: producers write there), GPU params in one device allocation.
    if (host_bytes) {
      host_bytes = align_up(host_bytes, 4096);
      FERRY_ASSIGN_OR_RETURN(auto r, own_arena(host_bytes, true, opts.push || (m.flips_ && opts.own_in_transport),
                                               m.shadow_arena_));
      m.landing_.push_back(*r);
    }
    if (device_bytes) {
      auto dev = device_alloc(*m.device_, device_bytes);
      if (!dev.ok()) return dev.status().with_context(fmt::format("consumer {}: the shadow of its GPU params", rank));
      m.shadow_device_ = *dev;  // (every byte is written: by write_padding, or by every sync)
    }
    m.shadow_bytes_ = host_bytes + device_bytes;
    uint64_t host_at = 0, device_at = 0;
    for (const TensorDecl& d : decls) {
      const uint64_t bytes = shape_numel(d.shape) * dtype_size(d.dtype);
      const Tensor& live = m.live_.at(d.name);
      if (live.device().is_cuda()) {
        m.loaded_.emplace(d.name, Tensor::borrow_device(m.shadow_device_.get() + device_at, d.shape, d.dtype,
                                                        live.device(), m.shadow_device_, d.name));
        device_at += align_up(bytes, 64);
        continue;
      }
      m.loaded_.emplace(d.name, Tensor::borrow(m.shadow_arena_.get() + host_at, d.shape, d.dtype, m.shadow_arena_, d.name));
      if (bytes) m.placements_[d.name] = ParamTable::Param{0, host_at, bytes};
      host_at += align_up(bytes, 64);
    }
  }
  m.work_ = m.loaded_;
  m.committed_ = m.live_;
  m.published_[0] = m.landing_;
  m.published_[1] = m.other_;
  return set;
}

Status ParamSet::write_padding(const Plan& plan) {
  // Groups: the params a sync does not write every element of (padding, or a plan that
  // leaves some unwritten) are filled from the live params as their room opens; the
  // others are written whole by the sync, so their room needs no filling.
  written_whole_.clear();
  if (opts_.groups) {
    std::vector<int64_t> written(plan.params().size(), 0);
    for (const Copy& c : plan.copies()) written[c.param] += c.dst.numel();
    for (size_t i = 0; i < plan.params().size(); ++i)
      if (written[i] >= shape_numel(plan.params()[i].shape)) written_whole_.insert(plan.params()[i].name);
  }
  if (!plan.zeros().empty()) {
    // Per place (host, the GPU): a plan runs on one device. Into both sets under shadow
    // (padding is never sent: each set keeps its zeros).
    // Only the padded params are declared: the others may not be as the plan loads them
    // (a producer-quantised param is e4m3 here, RouterOptions::quantize_on).
    Plan zeros_only[2];
    for (const auto& z : plan.zeros()) {
      const TensorDecl& d = plan.params()[z.param];
      auto it = loaded_.find(d.name);
      const bool on_gpu = it != loaded_.end() && it->second.device().is_cuda();
      Plan& into = zeros_only[on_gpu ? 1 : 0];
      FERRY_ASSIGN_OR_RETURN(const uint32_t i, into.declare_param(d));
      Zero local = z;
      local.param = i;
      FERRY_RETURN_IF_ERROR(into.add_zero(std::move(local)));
    }
    for (const Plan& z : zeros_only) {
      if (z.zeros().empty()) continue;
      for (const TensorMap* into : {&loaded_, &live_}) {
        if (into == &live_ && !opts_.shadow && !opts_.groups) continue;
        if (into == &loaded_ && opts_.groups) continue;  // (the bounded shadow is filled from the live params)
        FERRY_RETURN_IF_ERROR(
            execute(z, {}, *into).with_context(fmt::format("consumer {}: writing its params' padding", opts_.rank)));
      }
    }
  }
  work_ = loaded_;
  committed_ = live_;
  return Status::Ok();
}

ParamSet::Landing ParamSet::landing(const ParamTable::Param& p, uint64_t at) const {
  const MemoryRegion& r = landing_[p.key];
  return Landing{r, p.offset + at, static_cast<std::byte*>(r.base) + p.offset + at};
}

ParamSet::Landing ParamSet::landing(const SubRead& sr) const { return landing(*sr.param, sr.param_offset); }

Status ParamSet::check_rebound(const TensorMap& current) const {
  auto where = [](const Tensor& t) {
    auto p = t.device_ptr();
    return fmt::format("{} {}", device_str(t.device()), fmt::ptr(p.ok() ? *p : nullptr));
  };
  for (const auto& [name, was] : given_) {
    auto now = current.find(name);
    if (now == current.end()) {
      return failed_precondition(
          "consumer {}: param '{}' passed to create is no longer among the params; the consumer would write memory "
          "nobody reads. Create a new Consumer for the new params",
          opts_.rank, name);
    }
    auto was_at = was.device_ptr();
    auto now_at = now->second.device_ptr();
    if (now->second.device() != was.device() || !now_at.ok() || !was_at.ok() || *now_at != *was_at) {
      return failed_precondition(
          "consumer {}: param '{}' was re-bound after create (its memory moved from {} to {}, e.g. by torch's "
          "`p.data = new_tensor`); the consumer writes the memory it was given at create. Copy into that memory "
          "instead (p.data.copy_(new)), or create a new Consumer for the new memory",
          opts_.rank, name, where(was), where(now->second));
    }
  }
  return Status::Ok();
}

uint64_t ParamSet::registered_bytes() const {
  uint64_t n = 0;
  for (const MemoryRegion& r : registrations_) {
    if (!shadow_arena_ || r.base != shadow_arena_.get()) n += r.length;  // (the shadow is extra, not in place)
  }
  return n;
}

void ParamSet::begin(uint64_t) {
  work_ = loaded_;
  made_anew_.clear();
  std::lock_guard<std::mutex> lk(mu_);
  touched_ = false;
  committed_some_ = false;
  held_.received.reset();  // a new sync overwrites the shadow
}

void ParamSet::retry() {
  // (Groups: a param an earlier attempt made live is written again, from its room in the
  // shadow, with the same version's bytes.)
  work_ = loaded_;
}

void ParamSet::touch() {
  std::lock_guard<std::mutex> lk(mu_);
  touched_ = true;
}

void ParamSet::finish(uint64_t version) {
  if (opts_.shadow) {
    std::lock_guard<std::mutex> lk(mu_);
    held_.received = version;
    return;
  }
  if (opts_.groups) {
    // Every group is live already; what post-processing made anew joins the view.
    for (auto& [name, t] : made_anew_) committed_.insert_or_assign(name, std::move(t));
    made_anew_.clear();
  } else {
    committed_ = work_;
  }
  std::lock_guard<std::mutex> lk(mu_);
  held_.version = version;
  held_.has_version = true;
  held_.torn = false;
  held_.mixed = false;
}

void ParamSet::abort() {
  std::lock_guard<std::mutex> lk(mu_);
  held_.received.reset();
  if (opts_.groups) {
    if (committed_some_) held_.mixed = true;
    return;
  }
  if (touched_ && !opts_.shadow) held_.torn = true;
}

namespace {

// Whether two tensors view the same bytes (post-processing may replace a param with a
// tensor of its own).
bool same_bytes(const Tensor& a, const Tensor& b) {
  auto pa = a.device_ptr(), pb = b.device_ptr();
  return pa.ok() && pb.ok() && *pa == *pb && a.device() == b.device() && a.dtype() == b.dtype() &&
         a.shape() == b.shape();
}


// Copies `from`'s bytes into `to` (same dtype and shape): memcpy on the host, device to
// device where either is on a GPU. The error names the consumer and the param.
Status copy_bytes(const Tensor& to, const Tensor& from, int rank, const std::string& name, const char* what) {
  auto dst = to.device_ptr();
  auto src = from.device_ptr();
  if (!dst.ok() || !src.ok())
    return (!dst.ok() ? dst.status() : src.status()).with_context(fmt::format("consumer {}: {} param '{}'", rank, what, name));
  const uint64_t bytes = static_cast<uint64_t>(to.numel()) * dtype_size(to.dtype());
  if (to.device().is_cuda() || from.device().is_cuda())
    return device_memcpy(*dst, *src, bytes).with_context(fmt::format("consumer {}: {} param '{}'", rank, what, name));
  std::memcpy(*dst, *src, bytes);
  return Status::Ok();
}

}  // namespace

Status ParamSet::copy_live(const Tensor& to, const Tensor& from, const std::string& name) {
  Status st = copy_bytes(to, from, opts_.rank, name, "committing");
  if (!st.ok()) {  // (a param before it may already be the new version)
    std::lock_guard<std::mutex> lk(mu_);
    held_.torn = true;
  }
  return st;
}

Result<uint64_t> ParamSet::commit() {
  uint64_t v;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!opts_.shadow) return failed_precondition("consumer {}: commit() needs the shadow commit policy", opts_.rank);
    if (!held_.received)
      return failed_precondition("consumer {}: no received version to commit (sync with commit=false first)", opts_.rank);
    v = *held_.received;
  }
  if (flips_) {
    // Both sets are ours, laid out alike: the shadow becomes the live set and the old
    // live set the landing of the next sync. Nothing is copied.
    std::swap(loaded_, live_);
    std::swap(landing_, other_);
    landing_index_ ^= 1;
    committed_ = work_;
  } else {
    TensorMap next = live_;
    for (const auto& [name, w] : work_) {
      auto shadow = loaded_.find(name);
      auto live = live_.find(name);
      if (shadow == loaded_.end() || live == live_.end() || !same_bytes(w, shadow->second)) {
        next[name] = w;  // replaced by post-processing: taken as it is
        continue;
      }
      FERRY_RETURN_IF_ERROR(copy_live(live->second, w, name));
    }
    committed_ = std::move(next);
  }
  std::lock_guard<std::mutex> lk(mu_);
  held_.version = v;
  held_.has_version = true;
  held_.torn = false;
  held_.received.reset();
  return v;
}

Status ParamSet::set_group_shadow(GroupShadow layout, const std::vector<TensorDecl>& params) {
  if (!opts_.groups) return failed_precondition("consumer {}: a group shadow needs the groups commit policy", opts_.rank);
  std::optional<Device> device;
  for (size_t i = 0; i < params.size(); ++i) {
    if (layout.offset[i] == GroupShadow::kNone) continue;
    auto live = live_.find(params[i].name);
    if (live == live_.end())
      return invalid_argument("consumer {}: the routes write param '{}', which it does not have", opts_.rank,
                              params[i].name);
    if (live->second.device().is_cuda()) device = live->second.device();
  }
  if (layout.host_bytes > group_host_capacity_) {
    const uint64_t bytes = align_up(layout.host_bytes, 4096);
    void* mem = std::aligned_alloc(4096, bytes);
    if (!mem) return io_error("consumer {}: allocating {} bytes for its group shadow", opts_.rank, bytes);
    shadow_arena_ = std::shared_ptr<std::byte>(static_cast<std::byte*>(mem), [](std::byte* b) { std::free(b); });
    group_host_capacity_ = bytes;
  }
  if (layout.device_bytes > group_device_capacity_ && device) {
    auto dev = device_alloc(*device, layout.device_bytes);
    if (!dev.ok()) return dev.status().with_context(fmt::format("consumer {}: its group shadow on {}", opts_.rank, device_str(*device)));
    shadow_device_ = *dev;
    group_device_capacity_ = layout.device_bytes;
  }
  shadow_bytes_ = group_host_capacity_ + group_device_capacity_;
  loaded_ = live_;
  group_names_.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    group_names_.push_back(params[i].name);
    if (layout.offset[i] == GroupShadow::kNone) continue;
    const TensorDecl& d = params[i];
    const Tensor& live = live_.at(d.name);
    if (live.dtype() != d.dtype || live.shape() != d.shape)
      return invalid_argument("consumer {}: the routes write param '{}' as {} {}, it holds {} {}", opts_.rank, d.name,
                              dtype_name(d.dtype), shape_str(d.shape), dtype_name(live.dtype()), shape_str(live.shape()));
    loaded_.insert_or_assign(
        d.name, live.device().is_cuda()
                    ? Tensor::borrow_device(shadow_device_.get() + layout.offset[i], d.shape, d.dtype, live.device(),
                                            shadow_device_, d.name)
                    : Tensor::borrow(shadow_arena_.get() + layout.offset[i], d.shape, d.dtype, shadow_arena_, d.name));
  }
  group_shadow_ = std::move(layout);
  work_ = loaded_;
  return Status::Ok();
}

Status ParamSet::open_at(int position) {
  if (!opts_.groups || position < 0 || static_cast<size_t>(position) >= group_shadow_.opens.size()) return Status::Ok();
  for (uint32_t i : group_shadow_.opens[static_cast<size_t>(position)]) {
    const std::string& name = group_names_[i];
    const Tensor& room = loaded_.at(name);
    work_.insert_or_assign(name, room);
    if (!written_whole_.count(name))
      FERRY_RETURN_IF_ERROR(copy_bytes(room, live_.at(name), opts_.rank, name, "filling the shadow of"));
  }
  return Status::Ok();
}

Status ParamSet::commit_at(int position) {
  if (!opts_.groups || position < 0 || static_cast<size_t>(position) >= group_shadow_.commits.size()) return Status::Ok();
  auto like = [](const Tensor& a, const Tensor& b) {
    return a.dtype() == b.dtype() && a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous();
  };
  // Post-processing's own tensors made since the last commit: into the live buffer of
  // the same layout where there is one (a later sync's), else taken at finish().
  for (auto& [name, w] : work_) {
    auto room = loaded_.find(name);
    if (room != loaded_.end() && same_bytes(w, room->second)) continue;  // in the shadow: below
    auto live = committed_.find(name);
    if (live != committed_.end() && same_bytes(w, live->second)) continue;  // live already
    if (made_anew_.count(name) && same_bytes(made_anew_.at(name), w)) continue;
    if (live != committed_.end() && like(w, live->second) && w.is_real()) {
      FERRY_RETURN_IF_ERROR(copy_live(live->second, w, name));
      w = live->second;
      continue;
    }
    made_anew_.insert_or_assign(name, w);
  }
  // The params themselves: the live buffers get what was unpacked (also where post-
  // processing replaced the param with a tensor of its own, which readers see instead:
  // the live buffer stays the loaded bytes of the committed version, what a delta patch
  // is applied against, as in place), unless that replacement went into the live buffer.
  for (uint32_t i : group_shadow_.commits[static_cast<size_t>(position)]) {
    const std::string& name = group_names_[i];
    Tensor& w = work_.at(name);
    const Tensor& live = live_.at(name);
    const Tensor& room = loaded_.at(name);
    const bool replaced = !same_bytes(w, room);
    auto shown = committed_.find(name);
    if (replaced && !made_anew_.count(name) && shown != committed_.end() && same_bytes(shown->second, live)) continue;
    FERRY_RETURN_IF_ERROR(copy_live(live, room, name));
    if (!replaced) w = live;  // (its room may hold another param from now on)
  }
  std::lock_guard<std::mutex> lk(mu_);
  committed_some_ = true;
  return Status::Ok();
}

Status ParamSet::discard() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!held_.received) return failed_precondition("consumer {}: no received version to discard", opts_.rank);
  held_.received.reset();
  return Status::Ok();
}

bool ParamSet::torn() const {
  std::lock_guard<std::mutex> lk(mu_);
  return held_.torn;
}

ConsumerState ParamSet::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  return held_;
}

}  // namespace ferry::engine
