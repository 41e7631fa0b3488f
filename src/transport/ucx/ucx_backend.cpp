// The UCX backend: init, memory registration, keys, read/write, send, flush,
// handlers and shutdown (see ucx_backend.h for the design), and its registry entry.
#include "transport/ucx/ucx_backend.h"
#include "transport/ucx/shared_segment.h"

namespace ferry::detail::ucx {

Status from_ucs(ucs_status_t st, const std::string& what) {
  if (st == UCS_OK) return Status::Ok();
  std::string msg = what + ": " + ucs_status_string(st);
  switch (st) {
    case UCS_ERR_CANCELED: return cancelled("{}", msg);
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR: return peer_failed("{}", msg);
    case UCS_ERR_TIMED_OUT: return timeout_error("{}", msg);
    case UCS_ERR_NO_MEMORY: return io_error("{}", msg);
    case UCS_ERR_INVALID_PARAM: return invalid_argument("{}", msg);
    case UCS_ERR_UNSUPPORTED: return unimplemented("{}", msg);
    // Ours only (ferry uses no UCX connection manager, whose refusal it also is): the
    // target refused a peer that did not prove the job's token.
    case UCS_ERR_REJECTED: return permission_denied("{} (refused by the target: this transport did not prove the job's token to it)", msg);
    case UCS_ERR_OUT_OF_RANGE: return out_of_range("{} (refused by the target)", msg);
    case UCS_ERR_NO_ELEM: return not_found("{} (the target's region is not registered)", msg);
    default: return internal_error("{}", msg);
  }
}

Status UcxBackend::init() {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return from_ucs(st, "ucx: reading the UCX configuration");
  if (Status applied = apply(cfg_, config); !applied.ok()) {
    ucp_config_release(config);
    return applied;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.request_size = sizeof(uint64_t);  // our op id lives in the request
  params.mt_workers_shared = 0;
  params.name = "ferry";
  st = ucp_init(&params, config, &ctx_);
  ucp_config_release(config);
  if (st != UCS_OK) return unavailable("ucx: ucp_init failed: {}", ucs_status_string(st));

  shm_transports_ = context_has_shared_memory();
  {
    ucp_context_attr_t ca{};
    ca.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(ctx_, &ca) == UCS_OK) memory_types_ = ca.memory_types;
    cuda_transports_ = context_cuda_transports();
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(ctx_, &wp, &worker_);
  if (st != UCS_OK) return unavailable("ucx: ucp_worker_create failed: {}", ucs_status_string(st));

  // Sleeping on the worker's event fd lets a request from a peer (UCX over tcp
  // emulates get with messages) wake this target at once. Without one, timed naps.
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (st != UCS_OK) return unavailable("ucx: ucp_worker_get_address failed: {}", ucs_status_string(st));
  wire::Address a{wire::Backend::kUcx, id_, uint32_t(getpid()), wire::local_host_tag(), {}};
  a.payload.assign(reinterpret_cast<std::byte*>(addr), reinterpret_cast<std::byte*>(addr) + addr_len);
  ucp_worker_release_address(worker_, addr);
  address_ = wire::encode_address(a);

  const std::pair<unsigned, ucp_am_recv_callback_t> handlers[] = {
      {kAmId, &UcxBackend::am_cb},          {kAmReadReq, &UcxBackend::read_req_cb},
      {kAmReadData, &UcxBackend::read_data_cb}, {kAmWrite, &UcxBackend::write_cb},
      {kAmFlushReq, &UcxBackend::flush_req_cb}, {kAmFlushAck, &UcxBackend::flush_ack_cb},
      {kAmHandshake, &UcxBackend::handshake_cb}};
  for (const auto& [id, cb] : handlers) {
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = id;
    ap.cb = cb;
    ap.arg = this;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG;
    st = ucp_worker_set_am_recv_handler(worker_, &ap);
    if (st != UCS_OK) return unavailable("ucx: setting AM handler {:#x} failed: {}", id, ucs_status_string(st));
  }

  thread_ = std::thread([this] { run(); });
  return Status::Ok();
}

UcxBackend::~UcxBackend() {
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    stop_ = true;
  }
  cmd_cv_.notify_all();
  if (worker_ != nullptr && efd_ >= 0) ucp_worker_signal(worker_);
  if (thread_.joinable()) thread_.join();
  // The progress thread is gone: this thread owns the worker now.
  if (worker_ != nullptr) shutdown();
  if (ctx_ != nullptr) ucp_cleanup(ctx_);
}

bool UcxBackend::supports_memory(MemoryKind kind) const {
  switch (kind) {
    case MemoryKind::kHost: return true;
    case MemoryKind::kCuda: return (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  return false;
}

std::string UcxBackend::memory_support() const {
  if (supports_memory(MemoryKind::kCuda)) {
    return fmt::format("host, cuda ({})", cuda_transports_.empty() ? "UCX lists the CUDA memory type" : cuda_transports_);
  }
  return fmt::format("host only: UCX {} lists no CUDA memory type (built without cuda_copy/cuda_ipc, or UCX_TLS "
                     "leaves them out); GPU memory is staged through host memory",
                     ucp_get_version_string());
}

Result<MemoryRegion> UcxBackend::register_memory(void* base, uint64_t length, MemoryKind kind) {
  return map_memory(base, length, kind, false);
}

Result<MemoryRegion> UcxBackend::allocate_memory(uint64_t length, MemoryKind kind) {
  return map_memory(nullptr, length, kind, true);
}

Result<MemoryRegion> UcxBackend::map_memory(void* base, uint64_t length, MemoryKind kind, bool allocate) {
  const char* op = allocate ? "allocate_memory" : "register_memory";
  if (!supports_memory(kind)) return unimplemented("{}: {} memory: {}", op, memory_kind_name(kind), memory_support());
  return run_sync<MemoryRegion>([this, base, length, kind, allocate, op]() -> Result<MemoryRegion> {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = length;
    if (kind == MemoryKind::kCuda) {
      mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      mp.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    if (allocate) {
      mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
      mp.flags = UCP_MEM_MAP_ALLOCATE;
    }
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
    if (st != UCS_OK) return from_ucs(st, fmt::format("{}: ucp_mem_map of {} bytes", op, length));
    void* addr = base;
    if (allocate) {
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      st = ucp_mem_query(memh, &attr);
      if (st != UCS_OK || attr.address == nullptr || attr.length < length) {
        ucp_mem_unmap(ctx_, memh);
        return internal_error("{}: ucp_mem_query after allocating {} bytes failed", op, length);
      }
      addr = attr.address;
    }
    void* packed = nullptr;
    size_t packed_len = 0;
    st = ucp_rkey_pack(ctx_, memh, &packed, &packed_len);
    if (st != UCS_OK) {
      ucp_mem_unmap(ctx_, memh);
      return from_ucs(st, fmt::format("{}: ucp_rkey_pack", op));
    }
    Region r{addr, length, kind, memh, {}, allocate};
    r.packed_rkey.assign(static_cast<std::byte*>(packed), static_cast<std::byte*>(packed) + packed_len);
    ucp_rkey_buffer_release(packed);
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = next_region_++;
    regions_.emplace(id, std::move(r));
    return MemoryRegion{id, addr, length, kind};
  });
}

Status UcxBackend::deregister_memory(const MemoryRegion& region) {
  return run_status([this, region]() -> Status {
    ucp_mem_h memh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regions_.find(region.id);
      if (it == regions_.end() || it->second.base != region.base || it->second.length != region.length) {
        return not_found("deregister_memory: region {} is not registered", region.id);
      }
      memh = it->second.memh;
      regions_.erase(it);
    }
    if (region_sends_.contains(region.id)) {
      // Peers' reads are being sent from it (allocated regions only, see pump_reply):
      // unmapped (and freed) when the last of those sends completes. From now on the
      // region is unknown, so no new ones start.
      dying_.emplace(region.id, memh);
      return Status::Ok();
    }
    ucp_mem_unmap(ctx_, memh);
    return Status::Ok();
  });
}

Result<std::vector<std::byte>> UcxBackend::export_key(const MemoryRegion& region) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end() || it->second.base != region.base || it->second.length != region.length) {
    return not_found("export_key: region {} is not registered", region.id);
  }
  it->second.exported = true;  // from now on peers may read/write it by message
  return wire::encode_key({wire::Backend::kUcx, region.kind, id_, region.id,
                           uint64_t(reinterpret_cast<uintptr_t>(region.base)), region.length,
                           it->second.packed_rkey});
}

Result<RemoteRegion> UcxBackend::import_key(std::span<const std::byte> bytes) {
  FERRY_ASSIGN_OR_RETURN(wire::Key k, wire::decode_key(bytes, wire::Backend::kUcx));
  if (k.payload.empty()) return corrupt("ucx key: empty rkey");
  return run_sync<RemoteRegion>([this, k = std::move(k)]() -> Result<RemoteRegion> {
    std::shared_ptr<Peer> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(k.owner_id);
      if (it == peers_.end()) return not_found("import_key: the key's owner {:#x} is not connected", k.owner_id);
      p = it->second;
      if (p->failed) return p->why;
    }
    if (p->ep == nullptr) return peer_failed("import_key: peer {:#x} has no endpoint", k.owner_id);
    auto exited = [&] {
      on_peer_failure(p.get(), fmt::format("process {} exited", p->pid));
      return peer_failed("import_key: peer {:#x} (process {}) has exited", k.owner_id, p->pid);
    };
    if (process_exited(*p)) return exited();
    // Unpacking attaches the owner's shared-memory segments, and UCX 1.13 crashes when
    // an attach fails: ferry opens them first (shared_segment.h).
    auto pinned = pin_shared_segments(k.payload, p->pid);
    if (!pinned.ok()) {
      if (process_exited(*p)) return exited();
      return pinned.status().with_context(fmt::format("import_key: peer {:#x}", k.owner_id));
    }
    ucp_rkey_h rkey = nullptr;
    ucs_status_t st = ucp_ep_rkey_unpack(p->rma_ep(), pinned->packed().data(), &rkey);
    if (st != UCS_OK) return corrupt("import_key: UCX refused the packed rkey: {}", ucs_status_string(st));
    bool by_message = p->rma_by_message();
    if (!by_message && p->data_ep != nullptr) {
      // The data endpoint reads memory the owner allocated through UCX (its shared-
      // memory segments) natively. For memory the owner registered in place, UCX 1.13
      // has no get lane on it and would emulate get/put with messages over the shared-
      // memory FIFO, which a peer killed mid-send can wedge (see the top): such a
      // region is read and written by message over the control endpoint instead.
      void* mapped = nullptr;
      by_message = ucp_rkey_ptr(rkey, k.base, &mapped) != UCS_OK;
    }
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = next_key_++;
    keys_.emplace(id, Key{k.owner_id, k.region_id, k.base, k.length, k.kind, rkey, p, by_message});
    return RemoteRegion{id, k.owner_id, k.base, k.length, k.kind};
  });
}

// Key::by_message, decided at import_key.
Result<RmaPath> UcxBackend::rma_path(const RemoteRegion& remote) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = keys_.find(remote.id);
  if (it == keys_.end()) return not_found("rma_path: key {} is not imported", remote.id);
  return it->second.by_message ? RmaPath::kByMessage : RmaPath::kNative;
}

Status UcxBackend::release_key(const RemoteRegion& remote) {
  return run_status([this, remote]() -> Status {
    ucp_rkey_h rkey;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = keys_.find(remote.id);
      if (it == keys_.end()) return not_found("release_key: key {} is not imported", remote.id);
      rkey = it->second.rkey;
      keys_.erase(it);
    }
    ucp_rkey_destroy(rkey);
    return Status::Ok();
  });
}

Result<Completion> UcxBackend::rma(bool is_write, const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                       uint64_t remote_offset, uint64_t length, CompletionCallback on_done) {
  const char* op = is_write ? "write" : "read";
  // Fast path: when the worker is free (the progress thread is not inside it), the
  // caller takes it (worker_mu_, before mu_: the progress thread's order) and posts
  // the operation itself. Over shared memory a get completes inside the post, so the
  // hand-off to the progress thread and the completion's hand-back were most of an
  // op's cost. Only try_lock: a caller never waits for the progress thread (which
  // may be running a callback that waits for a lock the caller holds); when the
  // worker is busy the op is queued as before. Callbacks never run inline (see
  // complete_op).
  std::unique_lock<std::mutex> worker(worker_mu_, std::defer_lock);
  if (progress_tid_.load() != std::this_thread::get_id() && worker.try_lock()) {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    if (stop_) return cancelled("{}: the transport is shutting down", op);
  }
  RmaOp r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto l = regions_.find(local.id);
    if (l == regions_.end() || l->second.base != local.base || l->second.length != local.length) {
      return not_found("{}: local region {} is not registered", op, local.id);
    }
    auto k = keys_.find(remote.id);
    if (k == keys_.end() || k->second.peer != remote.peer || k->second.length != remote.length ||
        k->second.base != remote.base) {
      return not_found("{}: remote region {} is not an imported key", op, remote.id);
    }
    const Key& key = k->second;
    if (key.by_message && (l->second.kind != MemoryKind::kHost || key.kind != MemoryKind::kHost)) {
      // The emulation copies on the host (memcpy at the target): never into GPU memory.
      return unimplemented("{}: {} memory with peer {:#x}, reached without native get/put (tcp): ferry's message "
                           "emulation copies on the host; stage it through host memory", op,
                           memory_kind_name(l->second.kind != MemoryKind::kHost ? l->second.kind : key.kind), key.peer);
    }
    if (key.owner->failed) return peer_failed("{}: peer {:#x} failed: {}", op, key.peer, key.owner->why.message());
    r = RmaOp{std::make_shared<OpState>(std::move(on_done), &progress_tid_), is_write,
              static_cast<std::byte*>(l->second.base) + local_offset, key.base + remote_offset, length,
              l->second.memh, key.rkey, key.owner, key.region_id, key.by_message};
    (is_write ? stats_.writes : stats_.reads)++;
    if (!worker.owns_lock()) {
      // Queued under mu_, so FIFO with respect to release_key/deregister/disconnect,
      // which also run as commands.
      auto state = r.state;
      if (!post([this, r = std::move(r)] { start_rma(r); })) return cancelled("{}: the transport is shutting down", op);
      return Completion(state);
    }
  }
  // We own the worker: no command (and so no release/deregister) can run meanwhile.
  direct_caller = true;
  const bool pending = start_rma(r);
  direct_caller = false;
  worker.unlock();
  if (pending) kick();  // the progress thread must progress it
  return Completion(r.state);
}

// Posts `r` on the worker (the caller holds it). Returns whether it is still in
// flight (false: already completed, successfully or not).
bool UcxBackend::start_rma(const RmaOp& r) {
  if (!peer_usable(*r.peer)) {
    complete_op(r.state, peer_failed("{}: peer {:#x} failed", r.is_write ? "write" : "read", r.peer->id));
    return false;
  }
  if (r.length == 0) {
    complete_op(r.state, Status::Ok());
    return false;
  }
  if (r.by_message) {
    if (!r.is_write) {
      stats_.reads_by_message++;
      return start_read_by_message(r);
    }
    stats_.writes_by_message++;
    r.peer->wrote_by_message = true;
    return start_write_by_message(r);
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  prm.cb.send = &UcxBackend::send_cb;
  prm.user_data = this;
  prm.memh = r.memh;  // skips UCX's registration-cache lookup
  ucp_ep_h ep = r.peer->rma_ep();
  ucs_status_ptr_t req = r.is_write ? ucp_put_nbx(ep, r.local, r.length, r.remote_addr, r.rkey, &prm)
                                    : ucp_get_nbx(ep, r.local, r.length, r.remote_addr, r.rkey, &prm);
  if (!UCS_PTR_IS_PTR(req)) {  // completed inside the post (shared memory): no tracking
    rma_done(r, UCS_PTR_STATUS(req));
    return false;
  }
  *static_cast<uint64_t*>(req) = track(r.peer.get(), [this, r](ucs_status_t st) { rma_done(r, st); });
  return true;
}

void UcxBackend::rma_done(const RmaOp& r, ucs_status_t st) {
  if (st == UCS_OK) (r.is_write ? stats_.bytes_written : stats_.bytes_read) += r.length;
  if (cfg_.ep_info && r.peer->ep != nullptr && !r.peer->printed) {
    r.peer->printed = true;
    ucp_ep_print_info(r.peer->ep, stderr);
    if (r.peer->data_ep != nullptr) ucp_ep_print_info(r.peer->data_ep, stderr);
  }
  complete_op(r.state, from_ucs(st, r.is_write ? "write" : "read"));
}

// Completes an op; on a caller thread posting directly, an op with a callback is
// completed from the progress thread instead (callbacks never run inline).
void UcxBackend::complete_op(const std::shared_ptr<OpState>& state, Status st) {
  if (direct_caller && state->has_callback()) {
    if (post([state, st] { state->complete(st); })) return;
  }
  state->complete(std::move(st));
}

Result<Completion> UcxBackend::flush(PeerId id, CompletionCallback on_done) {
  return flush_ep(id, false, std::move(on_done));
}

// Flushes the endpoint writes go on (control == false), or the control endpoint (to
// finish its wire-up at connect).
Result<Completion> UcxBackend::flush_ep(PeerId id, bool control, CompletionCallback on_done) {
  std::lock_guard<std::mutex> lock(mu_);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Peer> peer, usable_peer(id, "flush"));
  auto state = std::make_shared<OpState>(std::move(on_done), &progress_tid_);
  bool posted = post([this, state, peer, control] {
    if (!peer_usable(*peer)) {
      state->complete(peer_failed("flush: peer {:#x} failed", peer->id));
      return;
    }
    // A peer with a data endpoint may have had writes by message too (regions it
    // cannot map): then both paths are flushed, and the flush completes after both.
    // The control endpoint (connect) over tcp is flushed by a message round trip:
    // UCX's own flush may complete before the wire-up has finished both ways, and
    // UCX 1.13 asserts (ucp_request.c "got REP message") when the peer dies while a
    // wire-up reply still waits to be sent (seen in the consumer-kill tests over tcp).
    const bool by_message = control ? peer->control_by_message : (peer->rma_by_message() || peer->wrote_by_message);
    const bool by_ucx = control ? !peer->control_by_message : !peer->rma_by_message();
    struct Both {
      int left;
      ucs_status_t st = UCS_OK;
    };
    auto both = std::make_shared<Both>(Both{int(by_message) + int(by_ucx)});
    auto done = [state, both](ucs_status_t st) {
      if (st != UCS_OK && both->st == UCS_OK) both->st = st;
      if (--both->left == 0) state->complete(from_ucs(both->st, "flush"));
    };
    if (by_message) start_flush_by_message(peer, done);
    if (!by_ucx) return;
    uint64_t op_id = track(peer.get(), done);
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = &UcxBackend::send_cb;
    prm.user_data = this;
    settle(op_id, ucp_ep_flush_nbx(control ? peer->ep : peer->rma_ep(), &prm));
  });
  if (!posted) return cancelled("flush: the transport is shutting down");
  return Completion(state);
}

Result<Completion> UcxBackend::send(PeerId id, uint32_t tag, std::span<const std::byte> payload,
                        CompletionCallback on_done) {
  if (payload.size() > opt_.max_message_bytes) {
    return invalid_argument("send: payload of {} bytes exceeds max_message_bytes {}", payload.size(),
                            opt_.max_message_bytes);
  }
  struct Buf {
    std::byte header[wire::kMessageHeaderSize];
    std::vector<std::byte> payload;
  };
  auto buf = std::make_shared<Buf>();
  wire::encode_message_header({id_, tag, uint32_t(payload.size())}, buf->header);
  buf->payload.assign(payload.begin(), payload.end());
  std::lock_guard<std::mutex> lock(mu_);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Peer> peer, usable_peer(id, "send"));
  auto state = std::make_shared<OpState>(std::move(on_done), &progress_tid_);
  stats_.sends++;
  bool posted = post([this, state, peer, buf] {
    if (!peer_usable(*peer)) {
      state->complete(peer_failed("send: peer {:#x} failed", peer->id));
      return;
    }
    uint64_t op_id = track(peer.get(), [state, buf](ucs_status_t st) { state->complete(from_ucs(st, "send")); });
    ucp_request_param_t prm = eager_params();
    settle(op_id, ucp_am_send_nbx(peer->ep, kAmId, buf->header, sizeof buf->header, buf->payload.data(),
                                  buf->payload.size(), &prm));
  });
  if (!posted) return cancelled("send: the transport is shutting down");
  return Completion(state);
}

void UcxBackend::set_message_handler(MessageHandler handler) {
  auto h = std::make_shared<const MessageHandler>(std::move(handler));
  std::unique_lock<std::mutex> invoke;
  if (progress_tid_.load() != std::this_thread::get_id()) invoke = std::unique_lock<std::mutex>(handler_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  message_handler_ = std::move(h);
}

void UcxBackend::set_peer_failure_handler(PeerFailureHandler handler) {
  auto h = std::make_shared<const PeerFailureHandler>(std::move(handler));
  std::unique_lock<std::mutex> invoke;
  if (progress_tid_.load() != std::this_thread::get_id()) invoke = std::unique_lock<std::mutex>(handler_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  failure_handler_ = std::move(h);
}

Status UcxBackend::simulate_crash() {
  return unimplemented("simulate_crash: the ucx backend fails for real (SIGKILL the process)");
}

ucs_status_t UcxBackend::am_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // We only send eager messages; a rendezvous one is not ours (or is oversized).
    self->stats_.malformed_messages++;
    return UCS_OK;  // drops it
  }
  auto h = wire::decode_message_header(
      std::span<const std::byte>(static_cast<const std::byte*>(header), header_length), length,
      self->opt_.max_message_bytes);
  if (!h.ok()) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  if (!self->authorized(param, h->sender_id)) return UCS_OK;
  self->stats_.messages_received++;
  std::lock_guard<std::mutex> invoke(self->handler_mu_);  // (read as called: see on_peer_failure)
  std::shared_ptr<const MessageHandler> handler;
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    handler = self->message_handler_;
  }
  if (!handler || !*handler) {
    self->stats_.dropped_messages++;
    return UCS_OK;
  }
  (*handler)(h->sender_id, h->tag, std::span<const std::byte>(static_cast<const std::byte*>(data), length));
  return UCS_OK;
}

// Destructor thread, after the progress thread has been joined.
void UcxBackend::shutdown() {
  std::lock_guard<std::mutex> worker(worker_mu_);
  progress_tid_ = std::this_thread::get_id();
  std::map<PeerId, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, k] : keys_) ucp_rkey_destroy(k.rkey);
    keys_.clear();
    peers.swap(peers_);
    for (auto& [id, p] : peers) p->closed = true;
  }
  for (auto& [id, p] : peers) {
    bool gone = p->failed;
    if (!gone && p->pidfd >= 0) {  // a local peer may have exited since the last check
      pollfd fd{p->pidfd, POLLIN, 0};
      gone = poll(&fd, 1, 0) > 0;
    }
    close_ep(p, !gone);  // flushing towards a dead mode-NONE peer would only time out
  }
  auto deadline = Clock::now() + opt_.close_timeout;
  while (!inflight_.empty() && Clock::now() < deadline) {
    if (ucp_worker_progress(worker_) == 0) std::this_thread::yield();
  }
  // Whatever is left is cancelled (waiters must never hang).
  auto left = std::move(inflight_);
  inflight_.clear();
  for (auto& [id, op] : left) op.fn(UCS_ERR_CANCELED);
  // The worker goes first: a send UCX still holds (to a peer that stopped reading)
  // may point into a region, and nothing is sent once the worker is gone.
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : regions_) ucp_mem_unmap(ctx_, r.memh);
    regions_.clear();
  }
  for (auto& [id, memh] : dying_) ucp_mem_unmap(ctx_, memh);
  dying_.clear();
}

namespace {

Result<TransportParams> resolve(const TransportParams& params) {
  FERRY_ASSIGN_OR_RETURN(UcxConfig cfg, parse_config(params, read_env()));
  return describe(cfg);
}

// The tls in force: the param (or its defaults), else UCX_TLS, else UCX's own (all).
Result<bool> shared_memory(const TransportParams& params) {
  FERRY_ASSIGN_OR_RETURN(UcxConfig cfg, parse_config(params, read_env()));
  return tls_has_shared_memory(cfg.tls ? *cfg.tls : cfg.env_tls.value_or(""));
}

Result<std::unique_ptr<TransportBackend>> create(const TransportOptions& options) {
  FERRY_ASSIGN_OR_RETURN(UcxConfig cfg, parse_config(options.params, read_env()));
  auto b = std::make_unique<UcxBackend>(options, std::move(cfg));
  FERRY_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<TransportBackend>(std::move(b));
}

}  // namespace
}  // namespace ferry::detail::ucx

namespace ferry::detail {

const BackendEntry& ucx_backend_entry() {
  static const BackendEntry entry{&ucx::backend_info, &ucx::resolve, &ucx::shared_memory, &ucx::create};
  return entry;
}

}  // namespace ferry::detail
