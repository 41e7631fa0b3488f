#include "ferry/transport.h"

#include <unistd.h>

#include <random>

#include "transport/backend.h"

namespace ferry {

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kCuda: return "cuda";
  }
  return "unknown";
}

namespace detail {
uint64_t new_instance_id() {
  static std::mutex mu;
  static std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), unsigned(getpid()),
                      unsigned(std::chrono::steady_clock::now().time_since_epoch().count())};
    return std::mt19937_64(seq);
  }();
  std::lock_guard<std::mutex> lock(mu);
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
}
}  // namespace detail

bool Completion::done() const { return state_ != nullptr && state_->done(); }

Status Completion::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return failed_precondition("Completion::wait on an empty completion");
  return state_->wait(timeout);
}

Status Completion::status() const {
  if (!state_) return failed_precondition("Completion::status on an empty completion");
  return state_->status();
}

Status wait_all(std::span<const Completion> ops, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  Status first;
  size_t pending = 0;
  for (const Completion& op : ops) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() < 0) left = std::chrono::milliseconds(0);
    Status st = op.wait(left);
    if (st.code() == StatusCode::kTimeout) {
      ++pending;
      continue;
    }
    if (!st.ok() && first.ok()) first = st;
  }
  if (!first.ok()) return first;
  if (pending > 0) {
    return timeout_error("{} of {} operations still pending after {} ms", pending, ops.size(), timeout.count());
  }
  return Status::Ok();
}

Result<std::unique_ptr<Transport>> Transport::create(const TransportOptions& options) {
  Result<std::unique_ptr<detail::TransportBackend>> impl = not_found("");
  if (options.backend == "inproc") {
    impl = detail::make_inproc_backend(options);
  } else if (options.backend == "ucx") {
    impl = detail::make_ucx_backend(options);
  } else {
    return not_found("transport backend '{}' does not exist (this build has: inproc, ucx)", options.backend);
  }
  if (!impl.ok()) return impl.status();
  return std::make_unique<Transport>(std::move(impl).value());
}

std::vector<std::string> Transport::backends() { return {"inproc", "ucx"}; }

Transport::Transport(std::unique_ptr<detail::TransportBackend> impl) : impl_(std::move(impl)) {}
Transport::~Transport() = default;

std::string_view Transport::backend() const { return impl_->name(); }
PeerId Transport::id() const { return impl_->id(); }
std::vector<std::byte> Transport::address() const { return impl_->address(); }
Result<PeerId> Transport::connect(std::span<const std::byte> address) { return impl_->connect(address); }
Status Transport::disconnect(PeerId peer) { return impl_->disconnect(peer); }

Result<MemoryRegion> Transport::register_memory(void* base, uint64_t length, MemoryKind kind) {
  if (base == nullptr) return invalid_argument("register_memory: null base");
  if (length == 0) return invalid_argument("register_memory: zero length");
  if (reinterpret_cast<uintptr_t>(base) > std::numeric_limits<uintptr_t>::max() - length) {
    return invalid_argument("register_memory: base {} + length {} wraps around", base, length);
  }
  return impl_->register_memory(base, length, kind);
}
Result<MemoryRegion> Transport::allocate_memory(uint64_t length, MemoryKind kind) {
  if (length == 0) return invalid_argument("allocate_memory: zero length");
  return impl_->allocate_memory(length, kind);
}
Status Transport::deregister_memory(const MemoryRegion& region) { return impl_->deregister_memory(region); }
Result<std::vector<std::byte>> Transport::export_key(const MemoryRegion& region) { return impl_->export_key(region); }
Result<RemoteRegion> Transport::import_key(std::span<const std::byte> key) { return impl_->import_key(key); }
Status Transport::release_key(const RemoteRegion& remote) { return impl_->release_key(remote); }

Result<Completion> Transport::read(const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                                   uint64_t remote_offset, uint64_t length, CompletionCallback on_done) {
  FERRY_RETURN_IF_ERROR(detail::check_range("read", "local", local_offset, length, local.length));
  FERRY_RETURN_IF_ERROR(detail::check_range("read", "remote", remote_offset, length, remote.length));
  return impl_->rma(false, local, local_offset, remote, remote_offset, length, std::move(on_done));
}

Result<Completion> Transport::write(const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                                    uint64_t remote_offset, uint64_t length, CompletionCallback on_done) {
  FERRY_RETURN_IF_ERROR(detail::check_range("write", "local", local_offset, length, local.length));
  FERRY_RETURN_IF_ERROR(detail::check_range("write", "remote", remote_offset, length, remote.length));
  return impl_->rma(true, local, local_offset, remote, remote_offset, length, std::move(on_done));
}

Result<Completion> Transport::flush(PeerId peer, CompletionCallback on_done) {
  return impl_->flush(peer, std::move(on_done));
}

Result<Completion> Transport::send(PeerId peer, uint32_t tag, std::span<const std::byte> payload,
                                   CompletionCallback on_done) {
  return impl_->send(peer, tag, payload, std::move(on_done));
}

void Transport::set_message_handler(MessageHandler handler) { impl_->set_message_handler(std::move(handler)); }
void Transport::set_peer_failure_handler(PeerFailureHandler handler) {
  impl_->set_peer_failure_handler(std::move(handler));
}
Status Transport::simulate_crash() { return impl_->simulate_crash(); }
TransportStats Transport::stats() const { return impl_->stats(); }

}  // namespace ferry
