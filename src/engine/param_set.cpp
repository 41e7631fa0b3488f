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
  // The caller's buffers (each registered, if large enough to be read or written into
  // directly), or ours: one arena (zeroed; one registration). In push, their keys go to
  // producers in the lease (ParamTable), so that they write there.
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
  MemoryRegion arena_region;
  if (arena_bytes) {
    arena_bytes = align_up(arena_bytes, 4096);
    m.own_bytes_ = arena_bytes;
    if (opts.push) {
      // Producers write into it: the transport's own memory, which peers on the host
      // write by plain copy (UCX shared memory writes memory registered in place only by
      // message, at tcp speed). Freed with its registration when the consumer goes.
      auto r = m.memory_->allocate(arena_bytes);
      if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: allocating {} bytes of params", rank, arena_bytes));
      arena_region = *r;
      m.registrations_.push_back(*r);
      std::memset(r->base, 0, arena_bytes);
      m.arena_ = std::shared_ptr<std::byte>(static_cast<std::byte*>(r->base), [](std::byte*) {});
    } else {
      void* mem = std::aligned_alloc(4096, arena_bytes);
      if (!mem) return io_error("consumer {}: allocating {} bytes of params", rank, arena_bytes);
      std::memset(mem, 0, arena_bytes);
      m.arena_ = std::shared_ptr<std::byte>(static_cast<std::byte*>(mem), [](std::byte* b) { std::free(b); });
      auto r = m.memory_->register_memory(mem, arena_bytes);
      if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: registering its params", rank));
      arena_region = *r;
      m.registrations_.push_back(*r);
    }
  }
  uint64_t at = 0;
  for (const TensorDecl& d : decls) {
    const uint64_t bytes = shape_numel(d.shape) * dtype_size(d.dtype);
    auto it = caller.find(d.name);
    if (it == caller.end()) {
      m.loaded_.emplace(d.name, Tensor::borrow(m.arena_.get() + at, d.shape, d.dtype, m.arena_, d.name));
      m.placements_[d.name] = ParamTable::Param{0, at, bytes};  // the arena is registration 0
      at += align_up(bytes, 64);
      continue;
    }
    const Tensor& t = it->second;
    m.loaded_.emplace(d.name, t);
    m.given_.emplace(d.name, t);
    if (t.device().is_cuda()) {
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
    if (bytes < opts.direct_min_bytes || bytes == 0) continue;
    FERRY_ASSIGN_OR_RETURN(void* data, t.data_ptr());
    auto r = m.memory_->register_memory(data, bytes);
    if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: registering param '{}'", rank, d.name));
    m.registrations_.push_back(*r);
    m.placements_[d.name] = ParamTable::Param{static_cast<uint32_t>(m.registrations_.size() - 1), 0, bytes};
  }
  m.all_on_device_ = m.device_.has_value();
  for (const TensorDecl& d : decls) {
    auto it = caller.find(d.name);
    m.all_on_device_ &= it != caller.end() && it->second.device().is_cuda();
  }
  m.work_ = m.committed_ = m.loaded_;
  return set;
}

Status ParamSet::write_padding(const Plan& plan) {
  if (!plan.zeros().empty()) {
    // Per place (host, the GPU): a plan runs on one device.
    Plan zeros_only[2];
    for (Plan& z : zeros_only) {
      for (const auto& d : plan.params()) FERRY_RETURN_IF_ERROR(z.declare_param(d).status());
    }
    for (const auto& z : plan.zeros()) {
      auto it = loaded_.find(plan.params()[z.param].name);
      const bool on_gpu = it != loaded_.end() && it->second.device().is_cuda();
      FERRY_RETURN_IF_ERROR(zeros_only[on_gpu ? 1 : 0].add_zero(z));
    }
    for (const Plan& z : zeros_only) {
      if (!z.zeros().empty()) {
        FERRY_RETURN_IF_ERROR(
            execute(z, {}, loaded_).with_context(fmt::format("consumer {}: writing its params' padding", opts_.rank)));
      }
    }
  }
  work_ = committed_ = loaded_;
  return Status::Ok();
}

ParamSet::Landing ParamSet::landing(const ParamTable::Param& p, uint64_t at) const {
  const MemoryRegion& r = registrations_[p.key];
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
  for (const MemoryRegion& r : registrations_) n += r.length;
  return n;
}

void ParamSet::begin(uint64_t) {
  work_ = loaded_;
  std::lock_guard<std::mutex> lk(mu_);
  touched_ = false;
}

void ParamSet::retry() { work_ = loaded_; }

void ParamSet::touch() {
  std::lock_guard<std::mutex> lk(mu_);
  touched_ = true;
}

void ParamSet::finish(uint64_t version) {
  committed_ = work_;
  std::lock_guard<std::mutex> lk(mu_);
  held_.version = version;
  held_.has_version = true;
  held_.torn = false;
}

void ParamSet::abort() {
  std::lock_guard<std::mutex> lk(mu_);
  if (touched_) held_.torn = true;
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
