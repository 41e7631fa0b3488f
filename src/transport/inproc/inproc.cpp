// The in-process backend: ranks are threads of one process. Every Transport ("core")
// is in a process-wide registry by instance id; read/write are memcpy between
// registered regions, checked on both sides; each core has one progress thread that
// runs its operations, completion callbacks and handlers, like a UCX worker's.
#include <openssl/crypto.h>
#include <sys/mman.h>

#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <shared_mutex>
#include <unordered_map>

#include "transport/backend.h"
#include "transport/wire.h"

namespace ferry::detail {
namespace {

namespace wire = ferry::transport_wire;

class Core;

// Process-wide: instance id -> live core.
struct Registry {
  std::mutex mu;
  std::unordered_map<uint64_t, std::weak_ptr<Core>> cores;
};
Registry& inproc_registry() {
  static Registry* r = new Registry();  // never destroyed: cores may outlive static destruction order
  return *r;
}

std::shared_ptr<Core> find_core(uint64_t id) {
  Registry& r = inproc_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.cores.find(id);
  if (it == r.cores.end()) return nullptr;
  return it->second.lock();
}

struct Region {
  void* base;
  uint64_t length;
  MemoryKind kind;
  bool owned = false;  // allocate_memory: munmap on deregister
  bool exported = false;  // export_key was called: only then may peers read/write it
};

void release(const Region& r) {
  if (r.owned) munmap(r.base, r.length);
}

struct ImportedKey {
  PeerId peer;
  uint64_t region_id;
  uint64_t base;
  uint64_t length;
  MemoryKind kind;
};

struct PeerState {
  bool failed = false;
  Status why;
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  explicit Core(const TransportOptions& options) : options_(options), id_(new_instance_id()) {}

  void start() { thread_ = std::thread([this] { run(); }); }

  uint64_t id() const { return id_; }
  const TransportOptions& options() const { return options_; }
  const std::atomic<std::thread::id>* progress_thread() const { return &progress_tid_; }
  bool dead() const { return crashed_.load() || closed_.load(); }
  AtomicStats& stats() { return stats_; }

  // Runs `fn` on the progress thread; fn(true) if the core shut down or crashed first.
  void post(std::function<void(bool cancelled)> fn) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (!stopping_) {
        queue_.push_back(std::move(fn));
        fn = nullptr;
      }
    }
    if (fn) {
      fn(true);
      return;
    }
    queue_cv_.notify_one();
  }

  // Stops the progress thread; tasks still queued run cancelled.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    queue_cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // --- state shared with peers --------------------------------------------------------
  std::shared_mutex regions_mu;
  std::map<uint64_t, Region> regions;  // guarded by regions_mu
  uint64_t next_region_id = 1;         // guarded by regions_mu

  std::mutex mu;  // guards peers, accepted, keys, handlers
  std::map<PeerId, PeerState> peers;
  // Cores that connected to this one with its token (when it has one): the only ones
  // whose messages, reads and writes it serves.
  std::set<uint64_t> accepted;
  std::map<uint64_t, ImportedKey> keys;
  uint64_t next_key_id = 1;
  std::shared_ptr<const MessageHandler> message_handler;
  std::shared_ptr<const PeerFailureHandler> failure_handler;
  std::mutex handler_mu;  // held while a handler runs: set_*_handler waits for it

  std::atomic<bool> crashed_{false};
  std::atomic<bool> closed_{false};

  // A peer this core is connected to died: mark it, run the failure handler once.
  void on_peer_failed(PeerId peer, const Status& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = peers.find(peer);
      if (it == peers.end() || it->second.failed) return;
      it->second.failed = true;
      it->second.why = why;
    }
    stats_.failed_peers++;
    auto self = shared_from_this();
    post([self, peer, why](bool cancelled) {
      if (cancelled || self->dead()) return;
      // The handler is read under handler_mu, as it is called: one replaced before this
      // took handler_mu (its owner may be gone since) is never called.
      std::lock_guard<std::mutex> invoke(self->handler_mu);
      std::shared_ptr<const PeerFailureHandler> h;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        h = self->failure_handler;
      }
      if (h && *h) (*h)(peer, why);
    });
  }

  // Whether `peer` may be served: this core has no token, or `peer` connected with it.
  // Counts a refusal.
  bool serves(uint64_t peer) {
    if (options_.token.empty()) return true;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (accepted.contains(peer)) return true;
    }
    stats_.refused_unauthenticated++;
    return false;
  }

  // A message from `sender` arrives (called on the sender's progress thread).
  void deliver(uint64_t sender, uint32_t tag, std::shared_ptr<std::vector<std::byte>> payload) {
    auto self = shared_from_this();
    post([self, sender, tag, payload](bool cancelled) {
      if (cancelled || self->dead()) return;
      if (!self->serves(sender)) return;
      // Same framing check as the UCX backend (never trust the frame).
      std::byte header[wire::kMessageHeaderSize];
      wire::encode_message_header({sender, tag, uint32_t(payload->size())}, header);
      auto h = wire::decode_message_header(std::span<const std::byte>(header, sizeof header), payload->size(),
                                           self->options_.max_message_bytes);
      if (!h.ok()) {
        self->stats_.malformed_messages++;
        return;
      }
      self->stats_.messages_received++;
      std::lock_guard<std::mutex> invoke(self->handler_mu);  // (read as called: see on_peer_failed)
      std::shared_ptr<const MessageHandler> handler;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        handler = self->message_handler;
      }
      if (!handler || !*handler) {
        self->stats_.dropped_messages++;
        return;
      }
      (*handler)(h->sender_id, h->tag, std::span<const std::byte>(payload->data(), payload->size()));
    });
  }

 private:
  void run() {
    progress_tid_ = std::this_thread::get_id();
    for (;;) {
      std::deque<std::function<void(bool)>> batch;
      bool stopping = false;
      {
        std::unique_lock<std::mutex> lock(queue_mu_);
        queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        batch.swap(queue_);
        stopping = stopping_;
      }
      for (auto& fn : batch) fn(stopping || crashed_.load());
      if (stopping) {
        std::lock_guard<std::mutex> lock(queue_mu_);
        if (queue_.empty()) break;
      }
    }
  }

  TransportOptions options_;
  uint64_t id_;
  AtomicStats stats_;
  std::thread thread_;
  std::atomic<std::thread::id> progress_tid_{};
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void(bool)>> queue_;
  bool stopping_ = false;
};

// Every core connected to `dead` learns about it.
void broadcast_failure(uint64_t dead, const Status& why) {
  std::vector<std::shared_ptr<Core>> live;
  {
    Registry& r = inproc_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& [id, weak] : r.cores) {
      if (auto c = weak.lock()) live.push_back(std::move(c));
    }
  }
  for (auto& c : live) {
    if (c->id() != dead) c->on_peer_failed(dead, why);
  }
}

class InprocBackend final : public TransportBackend {
 public:
  explicit InprocBackend(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  ~InprocBackend() override {
    bool was_crashed = core_->crashed_.load();
    core_->closed_ = true;
    {
      Registry& r = inproc_registry();
      std::lock_guard<std::mutex> lock(r.mu);
      r.cores.erase(core_->id());
    }
    if (!was_crashed) broadcast_failure(core_->id(), peer_failed("inproc peer {:#x} was destroyed", core_->id()));
    core_->stop();
    std::unique_lock<std::shared_mutex> lock(core_->regions_mu);  // waits for peers' copies in progress
    for (auto& [id, r] : core_->regions) release(r);
    core_->regions.clear();
  }

  std::string_view name() const override { return "inproc"; }
  PeerId id() const override { return core_->id(); }

  std::vector<std::byte> address() const override {
    return wire::encode_address({wire::Backend::kInproc, core_->id(), 0, 0, {}});
  }

  Result<PeerId> connect(std::span<const std::byte> address) override {
    FERRY_RETURN_IF_ERROR(alive("connect"));
    FERRY_ASSIGN_OR_RETURN(wire::Address a, wire::decode_address(address, wire::Backend::kInproc));
    if (!a.payload.empty()) return corrupt("inproc address: unexpected {}-byte payload", a.payload.size());
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      auto it = core_->peers.find(a.instance_id);
      if (it != core_->peers.end()) {
        if (it->second.failed) return it->second.why;
        return a.instance_id;
      }
    }
    auto target = find_core(a.instance_id);
    if (!target || target->dead()) {
      return peer_failed("connect: inproc transport {:#x} does not exist (any more)", a.instance_id);
    }
    // The token handshake, in process: each side must hold the other's token (an empty
    // one on both sides: no authentication). Compared in constant time as ucx would.
    const std::string& mine = core_->options().token;
    const std::string& theirs = target->options().token;
    const bool same = mine.size() == theirs.size() &&
                      (mine.empty() || CRYPTO_memcmp(mine.data(), theirs.data(), mine.size()) == 0);
    if (!same) {
      if (!theirs.empty()) target->stats().refused_unauthenticated++;
      return permission_denied("connect: inproc transport {:#x} and this one {:#x} do not share the job's token ({})",
                               a.instance_id, core_->id(),
                               theirs.empty() ? "the peer has none" : mine.empty() ? "this transport has none"
                                                                                   : "they differ");
    }
    if (!theirs.empty()) {
      std::lock_guard<std::mutex> lock(target->mu);
      if (target->accepted.insert(core_->id()).second) target->stats().authenticated_peers++;
    }
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->peers.emplace(a.instance_id, PeerState{});
    return a.instance_id;
  }

  Status disconnect(PeerId peer) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->peers.erase(peer) == 0) return not_found("disconnect: peer {:#x} is not connected", peer);
    for (auto it = core_->keys.begin(); it != core_->keys.end();) {
      it = it->second.peer == peer ? core_->keys.erase(it) : std::next(it);
    }
    return Status::Ok();
  }

  Result<MemoryRegion> register_memory(void* base, uint64_t length, MemoryKind kind) override {
    FERRY_RETURN_IF_ERROR(alive("register_memory"));
    if (kind != MemoryKind::kHost) {
      return unimplemented("register_memory: {} memory is not supported by the inproc backend",
                           memory_kind_name(kind));
    }
    std::unique_lock<std::shared_mutex> lock(core_->regions_mu);
    uint64_t id = core_->next_region_id++;
    core_->regions.emplace(id, Region{base, length, kind});
    return MemoryRegion{id, base, length, kind};
  }

  Result<MemoryRegion> allocate_memory(uint64_t length, MemoryKind kind) override {
    FERRY_RETURN_IF_ERROR(alive("allocate_memory"));
    if (kind != MemoryKind::kHost) {
      return unimplemented("allocate_memory: {} memory is not supported by the inproc backend", memory_kind_name(kind));
    }
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return io_error("allocate_memory: mmap of {} bytes failed", length);
    std::unique_lock<std::shared_mutex> lock(core_->regions_mu);
    uint64_t id = core_->next_region_id++;
    core_->regions.emplace(id, Region{p, length, kind, true});
    return MemoryRegion{id, p, length, kind};
  }

  Status deregister_memory(const MemoryRegion& region) override {
    std::unique_lock<std::shared_mutex> lock(core_->regions_mu);
    auto it = core_->regions.find(region.id);
    if (it == core_->regions.end() || it->second.base != region.base || it->second.length != region.length) {
      return not_found("deregister_memory: region {} is not registered", region.id);
    }
    release(it->second);
    core_->regions.erase(it);
    return Status::Ok();
  }

  Result<std::vector<std::byte>> export_key(const MemoryRegion& region) override {
    FERRY_RETURN_IF_ERROR(alive("export_key"));
    std::unique_lock<std::shared_mutex> lock(core_->regions_mu);  // sets `exported`
    FERRY_RETURN_IF_ERROR(check_local(region, "export_key"));
    core_->regions.at(region.id).exported = true;
    return wire::encode_key({wire::Backend::kInproc, region.kind, core_->id(), region.id,
                             uint64_t(reinterpret_cast<uintptr_t>(region.base)), region.length, {}});
  }

  Result<RemoteRegion> import_key(std::span<const std::byte> bytes) override {
    FERRY_RETURN_IF_ERROR(alive("import_key"));
    FERRY_ASSIGN_OR_RETURN(wire::Key k, wire::decode_key(bytes, wire::Backend::kInproc));
    if (!k.payload.empty()) return corrupt("inproc key: unexpected {}-byte payload", k.payload.size());
    std::lock_guard<std::mutex> lock(core_->mu);
    auto p = core_->peers.find(k.owner_id);
    if (p == core_->peers.end()) return not_found("import_key: the key's owner {:#x} is not connected", k.owner_id);
    if (p->second.failed) return p->second.why;
    uint64_t id = core_->next_key_id++;
    core_->keys.emplace(id, ImportedKey{k.owner_id, k.region_id, k.base, k.length, k.kind});
    return RemoteRegion{id, k.owner_id, k.base, k.length, k.kind};
  }

  Status release_key(const RemoteRegion& remote) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->keys.erase(remote.id) == 0) return not_found("release_key: key {} is not imported", remote.id);
    return Status::Ok();
  }

  // Every inproc read and write is the caller's own memcpy.
  Result<RmaPath> rma_path(const RemoteRegion& remote) const override {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (!core_->keys.count(remote.id)) return not_found("rma_path: key {} is not imported", remote.id);
    return RmaPath::kNative;
  }

  Result<Completion> rma(bool is_write, const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                         uint64_t remote_offset, uint64_t length, CompletionCallback on_done) override {
    const char* op = is_write ? "write" : "read";
    FERRY_RETURN_IF_ERROR(alive(op));
    {
      std::shared_lock<std::shared_mutex> lock(core_->regions_mu);
      FERRY_RETURN_IF_ERROR(check_local(local, op));
    }
    ImportedKey key;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      auto k = core_->keys.find(remote.id);
      if (k == core_->keys.end() || k->second.peer != remote.peer || k->second.length != remote.length) {
        return not_found("{}: remote region {} is not an imported key", op, remote.id);
      }
      key = k->second;
      FERRY_RETURN_IF_ERROR(check_peer(key.peer, op));
    }
    (is_write ? core_->stats().writes : core_->stats().reads)++;
    auto state = std::make_shared<OpState>(std::move(on_done), core_->progress_thread());
    std::shared_ptr<Core> self = core_;
    core_->post([self, state, is_write, local, local_offset, key, remote_offset, length](bool cancelled) {
      if (cancelled) {
        state->complete(cancelled_error());
        return;
      }
      state->complete(execute(*self, is_write, local, local_offset, key, remote_offset, length));
    });
    return Completion(state);
  }

  Result<Completion> flush(PeerId peer, CompletionCallback on_done) override {
    FERRY_RETURN_IF_ERROR(alive("flush"));
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      FERRY_RETURN_IF_ERROR(check_peer(peer, "flush"));
    }
    // Copies run in order on the progress thread, so every earlier write is done when
    // this task runs.
    auto state = std::make_shared<OpState>(std::move(on_done), core_->progress_thread());
    core_->post([state](bool cancelled) { state->complete(cancelled ? cancelled_error() : Status::Ok()); });
    return Completion(state);
  }

  Result<Completion> send(PeerId peer, uint32_t tag, std::span<const std::byte> payload,
                          CompletionCallback on_done) override {
    FERRY_RETURN_IF_ERROR(alive("send"));
    if (payload.size() > core_->options().max_message_bytes) {
      return invalid_argument("send: payload of {} bytes exceeds max_message_bytes {}", payload.size(),
                              core_->options().max_message_bytes);
    }
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      FERRY_RETURN_IF_ERROR(check_peer(peer, "send"));
    }
    core_->stats().sends++;
    auto copy = std::make_shared<std::vector<std::byte>>(payload.begin(), payload.end());
    auto state = std::make_shared<OpState>(std::move(on_done), core_->progress_thread());
    std::shared_ptr<Core> self = core_;
    core_->post([self, state, peer, tag, copy](bool cancelled) {
      if (cancelled) {
        state->complete(cancelled_error());
        return;
      }
      auto target = find_core(peer);
      if (!target || target->dead()) {
        state->complete(peer_failed("send: inproc peer {:#x} is gone", peer));
        return;
      }
      target->deliver(self->id(), tag, copy);
      state->complete(Status::Ok());
    });
    return Completion(state);
  }

  void set_message_handler(MessageHandler handler) override {
    auto h = std::make_shared<const MessageHandler>(std::move(handler));
    std::unique_lock<std::mutex> invoke;
    if (core_->progress_thread()->load() != std::this_thread::get_id()) invoke = std::unique_lock<std::mutex>(core_->handler_mu);
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->message_handler = std::move(h);
  }

  void set_peer_failure_handler(PeerFailureHandler handler) override {
    auto h = std::make_shared<const PeerFailureHandler>(std::move(handler));
    std::unique_lock<std::mutex> invoke;
    if (core_->progress_thread()->load() != std::this_thread::get_id()) invoke = std::unique_lock<std::mutex>(core_->handler_mu);
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->failure_handler = std::move(h);
  }

  Status simulate_crash() override {
    if (core_->crashed_.exchange(true)) return failed_precondition("simulate_crash: already crashed");
    broadcast_failure(core_->id(), peer_failed("inproc peer {:#x} crashed (failure injection)", core_->id()));
    return Status::Ok();
  }

  Status health() const override { return alive("transport"); }

  TransportStats stats() const override { return core_->stats().snapshot(); }
  bool supports_memory(MemoryKind kind) const override { return kind == MemoryKind::kHost; }
  std::string memory_support() const override { return "host only (the inproc backend copies with memcpy)"; }

 private:
  static Status cancelled_error() { return cancelled("operation cancelled: the transport shut down or crashed"); }

  Status alive(const char* op) const {
    if (core_->crashed_.load()) return failed_precondition("{}: this transport crashed (failure injection)", op);
    return Status::Ok();
  }

  // Caller holds regions_mu (any mode).
  Status check_local(const MemoryRegion& region, const char* op) const {
    auto it = core_->regions.find(region.id);
    if (it == core_->regions.end() || it->second.base != region.base || it->second.length != region.length) {
      return not_found("{}: local region {} is not registered", op, region.id);
    }
    return Status::Ok();
  }

  // Caller holds core_->mu.
  Status check_peer(PeerId peer, const char* op) const {
    auto p = core_->peers.find(peer);
    if (p == core_->peers.end()) return not_found("{}: peer {:#x} is not connected", op, peer);
    if (p->second.failed) return peer_failed("{}: peer {:#x} failed: {}", op, peer, p->second.why.message());
    return Status::Ok();
  }

  // Runs on the initiator's progress thread; checks the target side again.
  static Status execute(Core& self, bool is_write, const MemoryRegion& local, uint64_t local_offset,
                        const ImportedKey& key, uint64_t remote_offset, uint64_t length) {
    const char* op = is_write ? "write" : "read";
    std::shared_ptr<Core> target = self.id() == key.peer ? self.shared_from_this() : find_core(key.peer);
    if (!target || target->dead()) return peer_failed("{}: inproc peer {:#x} is gone", op, key.peer);
    {
      std::lock_guard<std::mutex> lock(self.mu);
      auto p = self.peers.find(key.peer);
      if (p == self.peers.end() || p->second.failed) return peer_failed("{}: peer {:#x} failed", op, key.peer);
    }
    if (!target->serves(self.id())) {
      return permission_denied("{}: peer {:#x} refused: this transport did not prove its token to it", op, key.peer);
    }
    std::shared_lock<std::shared_mutex> tlock(target->regions_mu);
    std::shared_lock<std::shared_mutex> llock;
    if (target.get() != &self) llock = std::shared_lock<std::shared_mutex>(self.regions_mu);
    auto t = target->regions.find(key.region_id);
    if (t == target->regions.end() || !t->second.exported) {
      target->stats().refused_region++;
      return not_found("{}: peer {:#x} has no exported region {} (deregistered?)", op, key.peer, key.region_id);
    }
    // Target-side bounds: the registered region, not what the key claimed.
    if (uint64_t(reinterpret_cast<uintptr_t>(t->second.base)) != key.base) {
      target->stats().refused_bounds++;
      return out_of_range("{}: peer {:#x} region {} moved", op, key.peer, key.region_id);
    }
    if (Status in = check_range(op, "target", remote_offset, length, t->second.length); !in.ok()) {
      target->stats().refused_bounds++;
      return in;
    }
    auto l = self.regions.find(local.id);
    if (l == self.regions.end() || l->second.base != local.base) {
      return not_found("{}: local region {} was deregistered", op, local.id);
    }
    FERRY_RETURN_IF_ERROR(check_range(op, "local", local_offset, length, l->second.length));
    std::byte* lp = static_cast<std::byte*>(l->second.base) + local_offset;
    std::byte* rp = static_cast<std::byte*>(t->second.base) + remote_offset;
    if (length > 0) {
      if (is_write) {
        std::memmove(rp, lp, length);
      } else {
        std::memmove(lp, rp, length);
      }
    }
    (is_write ? self.stats().bytes_written : self.stats().bytes_read) += length;
    return Status::Ok();
  }

  std::shared_ptr<Core> core_;
};

}  // namespace

namespace {

const BackendInfo& inproc_info() {
  static const BackendInfo info{"inproc", "ranks are threads of one process; memcpy between registered regions", {}};
  return info;
}

Result<TransportParams> inproc_resolve(const TransportParams& params) {
  FERRY_RETURN_IF_ERROR(check_params(inproc_info(), params));
  return TransportParams{};
}

// Every peer is in this process: bytes are copied within its memory.
Result<bool> inproc_shared_memory(const TransportParams& params) {
  FERRY_RETURN_IF_ERROR(check_params(inproc_info(), params));
  return true;
}

Result<std::unique_ptr<TransportBackend>> make_inproc_backend(const TransportOptions& options) {
  FERRY_RETURN_IF_ERROR(check_params(inproc_info(), options.params));
  auto core = std::make_shared<Core>(options);
  {
    Registry& r = inproc_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.cores.emplace(core->id(), core);
  }
  core->start();
  return std::unique_ptr<TransportBackend>(new InprocBackend(std::move(core)));
}

}  // namespace

const BackendEntry& inproc_backend_entry() {
  static const BackendEntry entry{&inproc_info, &inproc_resolve, &inproc_shared_memory, &make_inproc_backend};
  return entry;
}

}  // namespace ferry::detail
