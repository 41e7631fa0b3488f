// The UCX backend's endpoints: connect (the control endpoint, and the data endpoint
// of a same-host peer), disconnect, closing, peer failure, and what UCX says about
// an endpoint's lanes.
#include "transport/ucx/ucx_backend.h"

namespace ferry::detail::ucx {

// Whether the context's resources ("resource N : md M dev D flags -- tl/dev" lines of
// ucp_context_print_info) include a shared-memory transport that maps a peer's memory.
bool UcxBackend::context_has_shared_memory() {
  const std::string info = printed([this](FILE* f) { ucp_context_print_info(ctx_, f); });
  for (size_t at = info.find("-- "); at != std::string::npos; at = info.find("-- ", at + 1)) {
    size_t slash = info.find('/', at);
    if (slash == std::string::npos) break;
    if (maps_peer_memory(std::string_view(info).substr(at + 3, slash - at - 3))) return true;
  }
  return false;
}

std::string UcxBackend::context_cuda_transports() {
  const std::string info = printed([this](FILE* f) { ucp_context_print_info(ctx_, f); });
  std::string out;
  for (size_t at = info.find("-- "); at != std::string::npos; at = info.find("-- ", at + 1)) {
    size_t slash = info.find('/', at);
    if (slash == std::string::npos) break;
    const std::string_view tl = std::string_view(info).substr(at + 3, slash - at - 3);
    if (tl.rfind("cuda", 0) == 0 || tl.rfind("gdr", 0) == 0) {
      if (out.find(tl) == std::string::npos) out += (out.empty() ? "" : ", ") + std::string(tl);
    }
  }
  return out;
}

Result<PeerId> UcxBackend::connect(std::span<const std::byte> bytes) {
  FERRY_ASSIGN_OR_RETURN(wire::Address a, wire::decode_address(bytes, wire::Backend::kUcx));
  if (a.payload.empty()) return corrupt("ucx address: empty worker address");
  if (local_process_exited(a)) {
    // UCX 1.13 over tcp can assert inside its wire-up when the peer is already gone.
    return peer_failed("connect: peer {:#x} (process {}) has exited", a.instance_id, a.pid);
  }
  if (!opt_.token.empty() && progress_tid_.load() == std::this_thread::get_id()) {
    return failed_precondition("connect: with a token, connect cannot run on the transport's progress thread "
                               "(a callback): the token handshake must be waited for");
  }
  FERRY_ASSIGN_OR_RETURN(PeerId id, create_ep(std::move(a)));
  if (!opt_.token.empty()) {
    // Before anything else goes to the peer (a flush by message would be refused). The
    // handshake's round trip also completes the wire-up (see below).
    if (Status st = handshake(id); !st.ok()) {
      // The peer stays refused: a later connect() returns this at once (it never skips
      // the handshake), every operation on it is refused. Its endpoint is kept, not
      // closed: UCX pairs the peer's next endpoint to us with it, and a closed one
      // would leave the peer's handshake unanswered (a timeout, not a refusal).
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = peers_.find(id); it != peers_.end() && !it->second->failed) {
        it->second->failed = true;
        it->second->why = st;
      }
      return st;
    }
  }
  // Finish the wire-up now, while the peer is known to be alive: UCX 1.13 over tcp
  // asserts (wireup_ep.c "pending_count == 0") when a peer dies while messages wait
  // on a half-wired endpoint, which a lazily wired endpoint risks at its first use.
  // Not on the progress thread (a callback may connect; it cannot wait).
  if (progress_tid_.load() != std::this_thread::get_id()) {
    FERRY_ASSIGN_OR_RETURN(Completion f, flush_ep(id, true, nullptr));
    Status st = f.wait(kControlTimeout);
    if (!st.ok()) return Status(st.code(), fmt::format("connect: completing the connection to peer {:#x}: {}", id, st.message()));
  }
  return id;
}

Result<PeerId> UcxBackend::create_ep(wire::Address a) {
  return run_sync<PeerId>([this, a = std::move(a)]() -> Result<PeerId> {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(a.instance_id);
      if (it != peers_.end()) {
        if (it->second->failed) return it->second->why;
        return a.instance_id;
      }
    }
    auto peer = std::make_shared<Peer>();
    peer->self = this;
    peer->id = a.instance_id;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(a.payload.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxBackend::ep_err_cb;
    ep.err_handler.arg = peer.get();
    ucs_status_t st = ucp_ep_create(worker_, &ep, &peer->ep);
    const bool local = a.pid != 0 && a.host_tag != 0 && a.host_tag == wire::local_host_tag();
    int pidfd_errno = 0;
    if (local) {
      // Best effort: import_key checks the owner is alive before UCX attaches its
      // shared-memory segment (see there).
      peer->pidfd = int(syscall(SYS_pidfd_open, pid_t(a.pid), 0));
      if (peer->pidfd < 0) pidfd_errno = errno;
      peer->pid = pid_t(a.pid);
    }
    if (st == UCS_ERR_UNREACHABLE && local) {
      // No transport with peer-failure support (e.g. UCX 1.13 shm): watch the process.
      if (peer->pidfd < 0) {
        return unavailable("connect: peer {:#x} (pid {}) has no transport with peer-failure support and "
                           "cannot be watched: {}", a.instance_id, a.pid, std::strerror(pidfd_errno));
      }
      peer->watched = true;
      if (process_exited(*peer)) return peer_failed("connect: peer {:#x} (process {}) has exited", a.instance_id, a.pid);
      ep.field_mask &= ~uint64_t(UCP_EP_PARAM_FIELD_ERR_HANDLER);
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      st = ucp_ep_create(worker_, &ep, &peer->ep);
      if (st == UCS_OK && !warned_unsafe_shm_.exchange(true)) {
        std::fprintf(stderr,
                     "ferry: no UCX transport with peer-failure support to peers on this host (UCX_TLS "
                     "without tcp, and the ucx param tcp_control off or tcp unusable): messages go "
                     "over shared memory, where a peer killed mid-send can leave this process unable to "
                     "receive from anyone (UCX 1.13). With tcp in UCX_TLS (e.g. sm,tcp,self) messages go "
                     "over loopback tcp and reads and writes stay on shared memory.\n");
      }
    }
    if (st != UCS_OK) {
      // A malformed worker address inside a well-framed blob ends up here.
      return unavailable("connect: ucp_ep_create to peer {:#x} failed: {}", a.instance_id, ucs_status_string(st));
    }
    const std::string control_info = ep_info(peer->ep);
    peer->control_by_message = cfg_.forced_reads.value_or(no_get_lane(control_info));
    const auto control_tls = lane_transports(control_info);
    if (std::any_of(control_tls.begin(), control_tls.end(), maps_peer_memory)) stats_.shared_memory_message_peers++;
    if (local && !peer->watched && peer->control_by_message && shm_transports_ && !cfg_.forced_reads.value_or(false)) {
      // The control endpoint reads by message (tcp): read and write over shared memory
      // on a data endpoint instead (see the top of this file). Created now, right after
      // the control endpoint: the peer does the same in the same order.
      ep.field_mask &= ~uint64_t(UCP_EP_PARAM_FIELD_ERR_HANDLER);
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      ucp_ep_h data = nullptr;
      if (ucp_ep_create(worker_, &ep, &data) == UCS_OK) {
        if (rma_lanes_only_shared_memory(ep_info(data))) {
          peer->data_ep = data;
        } else {
          // Not usable (the peer lacks shared memory, or UCX picked a network lane):
          // closed at once, before anything used it.
          close_one(peer, data, false);
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (peer->watched) watched_++;
    peers_.emplace(a.instance_id, std::move(peer));
    return a.instance_id;
  });
}

Status UcxBackend::disconnect(PeerId id) {
  return run_status([this, id]() -> Status {
    std::shared_ptr<Peer> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(id);
      if (it == peers_.end()) return not_found("disconnect: peer {:#x} is not connected", id);
      p = it->second;
      p->closed = true;
      p->authenticated = false;
      peers_.erase(it);
      for (auto k = keys_.begin(); k != keys_.end();) {
        if (k->second.peer == id) {
          ucp_rkey_destroy(k->second.rkey);
          k = keys_.erase(k);
        } else {
          ++k;
        }
      }
    }
    end_connect(id, cancelled("connect: peer {:#x} was disconnected during the token handshake", id));
    forget_authentication(id);
    close_ep(p, !p->failed);
    // Nothing of this peer may stay in flight for good: a read by message still
    // waiting for its data, a flush for its ack. A late answer finds nothing.
    fail_inflight(p.get());
    return Status::Ok();
  });
}

// UCX's description of an endpoint's lanes, e.g.
//   "#   lane[0]:  8:tcp/lo.0 md[4]  -> md[4]/tcp/sysdev[255] rma_bw#0 am am_bw#0".
std::string UcxBackend::ep_info(ucp_ep_h ep) {
  return printed([ep](FILE* f) { ucp_ep_print_info(ep, f); });
}

// The transport of each "lane[N]:  I:tl/dev" line of ep_info.
std::vector<std::string> UcxBackend::lane_transports(const std::string& info) {
  std::vector<std::string> tls;
  for (size_t at = info.find("lane["); at != std::string::npos; at = info.find("lane[", at + 1)) {
    size_t colon = info.find("]:", at);
    if (colon == std::string::npos) break;
    size_t p = info.find_first_not_of(" \t", colon + 2);
    if (p == std::string::npos) break;
    p = info.find_first_not_of("0123456789", p);  // the resource index
    if (p == std::string::npos || info[p] != ':') continue;
    size_t slash = info.find('/', p + 1);
    size_t eol = info.find('\n', p + 1);
    if (slash == std::string::npos || slash > eol) continue;
    tls.push_back(info.substr(p + 1, slash - p - 1));
  }
  return tls;
}

bool UcxBackend::is_shared_memory_transport(std::string_view tl) {
  return maps_peer_memory(tl) || tl == "cma" || tl == "knem" || tl == "self";
}

// Whether a data endpoint may be kept: it has native get and put lanes, and every lane
// is a shared-memory transport (no network lane, which in mode NONE could hang).
bool UcxBackend::rma_lanes_only_shared_memory(const std::string& info) {
  const auto tls = lane_transports(info);
  if (tls.empty() || info.find("get[") == std::string::npos || info.find("put[") == std::string::npos) return false;
  return std::all_of(tls.begin(), tls.end(), is_shared_memory_transport);
}

// Whether an endpoint (its ep_info) has no native get lane: then it reads by message.
bool UcxBackend::no_get_lane(const std::string& info) {
  if (info.find("lane[") == std::string::npos) return false;  // unknown format: trust UCX
  return info.find("get[") == std::string::npos;
}

bool UcxBackend::peer_usable(const Peer& p) {
  std::lock_guard<std::mutex> lock(mu_);
  return !p.failed && !p.closed && p.ep != nullptr;
}

// Caller holds mu_.
Result<std::shared_ptr<Peer>> UcxBackend::usable_peer(PeerId id, const char* op) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return not_found("{}: peer {:#x} is not connected", op, id);
  if (it->second->failed) return peer_failed("{}: peer {:#x} failed: {}", op, id, it->second->why.message());
  return it->second;
}

void UcxBackend::ep_err_cb(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  p->self->on_peer_failure(p, fmt::format("endpoint error: {}", ucs_status_string(status)));
}

// Progress thread (inside ucp_worker_progress, or from the process watch).
void UcxBackend::on_peer_failure(Peer* raw, const std::string& reason) {
  std::shared_ptr<Peer> p;
  Status why = peer_failed("peer {:#x}: {}", raw->id, reason);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (raw->failed || raw->closed) return;
    raw->failed = true;
    raw->why = why;
    auto it = peers_.find(raw->id);
    if (it != peers_.end() && it->second.get() == raw) p = it->second;
  }
  stats_.failed_peers++;
  fail_inflight(raw);
  end_connect(raw->id, why);
  forget_authentication(raw->id);
  if (p) {
    // Close outside the UCX callback; in-flight requests are completed by UCX with
    // an error status.
    post([this, p] { close_ep(p, false); });
  }
  // The handler is read under handler_mu_, as it is called: one replaced before this
  // took handler_mu_ is never called (set_peer_failure_handler returned, and its owner
  // may be gone: a consumer destroyed while its producers' endpoints failed).
  std::lock_guard<std::mutex> invoke(handler_mu_);
  std::shared_ptr<const PeerFailureHandler> handler;
  {
    std::lock_guard<std::mutex> lock(mu_);
    handler = failure_handler_;
  }
  if (handler && *handler) (*handler)(raw->id, why);
}

// Progress thread (or the destructor after join). Starts closing the peer's endpoints.
void UcxBackend::close_ep(const std::shared_ptr<Peer>& p, bool flush) {
  if (p->data_ep != nullptr) {
    // Mode NONE: flush mode only (UCX 1.13 refuses FORCE for it). Only get/put ever
    // used it, which over shared memory complete inside their post, so its flush has
    // nothing to wait for (measured: < 0.1 ms towards a dead peer).
    close_one(p, p->data_ep, false);
    p->data_ep = nullptr;
  }
  if (p->ep != nullptr) {
    if (!flush && p->watched) {
      // A mode-NONE control endpoint to a failed peer: UCX 1.13 refuses to force-close
      // it, and a flush-mode close may wait for room in the dead peer's FIFO forever.
      // Left to ucp_worker_destroy (one endpoint per failed peer).
    } else {
      close_one(p, p->ep, !flush);
    }
    p->ep = nullptr;
  }
}

void UcxBackend::close_one(const std::shared_ptr<Peer>& p, ucp_ep_h ep, bool force) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  prm.cb.send = &UcxBackend::send_cb;
  prm.user_data = this;
  uint64_t id = track(nullptr, [p](ucs_status_t) {});  // keeps the Peer (error-callback arg) alive until closed
  settle(id, ucp_ep_close_nbx(ep, &prm));
}

}  // namespace ferry::detail::ucx
