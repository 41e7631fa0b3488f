#include "ferry/transport.h"

#include <unistd.h>

#include <map>
#include <random>

#include "common/token_rule.h"
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
  const auto start = std::chrono::steady_clock::now();
  auto deadline = start + timeout;
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
    return timeout_error(
        "{} of {} operations still pending after {} ms", pending, ops.size(),
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count());
  }
  return Status::Ok();
}

namespace detail {

std::string option_list(const BackendInfo& info) {
  if (info.options.empty()) return "none";
  std::string out;
  for (const BackendOption& o : info.options) {
    if (!out.empty()) out += ", ";
    out += o.name;
    if (o.name.ends_with('.')) out += "<KEY>";
  }
  return out;
}

Status check_params(const BackendInfo& info, const TransportParams& params) {
  for (const auto& [name, value] : params) {
    if (!info.accepts(name)) {
      return invalid_argument("transport backend '{}': unknown param '{}' (its params: {})", info.name, name,
                              option_list(info));
    }
  }
  return Status::Ok();
}

Status bad_param(const BackendInfo& info, std::string_view name, std::string_view value, std::string_view expected) {
  return invalid_argument("transport backend '{}': param '{}' = '{}' is malformed: expected {} (its params: {})",
                          info.name, name, value, expected, option_list(info));
}

namespace {

// The backend registry: every backend this build has, by name.
const std::map<std::string, const BackendEntry*, std::less<>>& registry() {
  static const std::map<std::string, const BackendEntry*, std::less<>> r = [] {
    std::map<std::string, const BackendEntry*, std::less<>> m;
    for (const BackendEntry* e : {&inproc_backend_entry(), &ucx_backend_entry()}) m.emplace(e->info().name, e);
    return m;
  }();
  return r;
}

Result<const BackendEntry*> find_backend(std::string_view name) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string names;
    for (const auto& [n, e] : registry()) names += (names.empty() ? "" : ", ") + n;
    return not_found("transport backend '{}' does not exist (this build has: {})", name, names);
  }
  return it->second;
}

}  // namespace
}  // namespace detail

bool BackendInfo::accepts(std::string_view param) const {
  for (const BackendOption& o : options) {
    if (o.name.ends_with('.') ? (param.starts_with(o.name) && param.size() > o.name.size()) : param == o.name) {
      return true;
    }
  }
  return false;
}

Result<std::unique_ptr<Transport>> Transport::create(const TransportOptions& options) {
  // The store's rule (a guessable secret proves nothing); the transport does not depend
  // on the store, so the figure is its own constant, kept equal to kMinTokenBytes.
  if (!options.token.empty()) {
    if (auto weak = token_weakness(options.token, kMinTransportTokenBytes))
      return invalid_argument("the transport token is {} (e.g. `openssl rand -hex 16`), or none at all", *weak);
  }
  FERRY_ASSIGN_OR_RETURN(const detail::BackendEntry* entry, detail::find_backend(options.backend));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<detail::TransportBackend> impl, entry->create(options));
  return std::make_unique<Transport>(std::move(impl));
}

std::vector<std::string> Transport::backends() {
  std::vector<std::string> names;
  for (const auto& [name, entry] : detail::registry()) names.push_back(name);
  return names;
}

Result<BackendInfo> Transport::backend_info(std::string_view backend) {
  FERRY_ASSIGN_OR_RETURN(const detail::BackendEntry* entry, detail::find_backend(backend));
  return entry->info();
}

Result<TransportParams> Transport::resolve_params(std::string_view backend, const TransportParams& params) {
  FERRY_ASSIGN_OR_RETURN(const detail::BackendEntry* entry, detail::find_backend(backend));
  return entry->resolve(params);
}

Result<bool> Transport::moves_bytes_over_shared_memory(std::string_view backend, const TransportParams& params) {
  FERRY_ASSIGN_OR_RETURN(const detail::BackendEntry* entry, detail::find_backend(backend));
  return entry->shared_memory(params);
}

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
Result<RmaPath> Transport::rma_path(const RemoteRegion& remote) const { return impl_->rma_path(remote); }

const char* rma_path_name(RmaPath path) {
  switch (path) {
    case RmaPath::kNative: return "native";
    case RmaPath::kByMessage: return "by message";
  }
  return "unknown";
}

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
Status Transport::health() const { return impl_->health(); }
bool Transport::supports_memory(MemoryKind kind) const { return impl_->supports_memory(kind); }
std::string Transport::memory_support() const { return impl_->memory_support(); }
TransportStats Transport::stats() const { return impl_->stats(); }

}  // namespace ferry
