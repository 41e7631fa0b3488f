// The UCX backend: UCP RMA (get/put) for read/write, active messages for control
// messages, error-handling mode PEER for failure detection.
//
// Threading: the worker is created in UCS_THREAD_MODE_SINGLE and only ever touched by
// one thread at a time, whoever holds worker_mu_: the progress thread, a caller posting
// a read/write directly (rma(), when the worker is free), or the destructor after the
// progress thread has been joined. Every other API call validates against the tables
// (under mu_) and posts a command to the progress thread, which makes the UCX call.
// Commands run in FIFO order, so an operation validated before a release/deregister
// executes before the handle it uses is destroyed; a direct post holds the worker, so
// no such command runs between its validation and its post.
//
// Peer failure: endpoints use UCP_ERR_HANDLING_MODE_PEER. UCX 1.13's shared memory
// (posix/sysv) has no peer-failure support, and it has a worse problem: every process
// has one receive FIFO that all senders write, and a sender SIGKILLed between reserving
// an entry and publishing it leaves the receiver unable to read anything after it, from
// any peer, with no error. So nothing but get/put may go over shared memory:
//  * Every peer has a *control* endpoint in mode PEER. It carries every active message
//    (ferry's messages, reads/writes by message, flushes by message), and its error
//    callback is the failure report. Over a host's UCX_TLS with tcp, UCX builds it on
//    tcp only (the one transport here with peer-failure support).
//  * A peer on this host whose control endpoint has no native get lane (tcp) gets a
//    second, *data* endpoint in mode NONE, kept only if all its lanes are shared-memory
//    transports with native get/put (cma, posix/sysv rkey_ptr, xpmem, knem): reads and
//    writes go there, at memory speed, and it never sends a message. It is created
//    right after the control endpoint and closed in flush mode (UCX 1.13 refuses to
//    force-close a mode-NONE endpoint; with nothing but RMA on it, the flush is local).
//    UCX pairs a wire-up request with the peer's endpoint of the same creation index
//    (per pair of workers); a data endpoint never wires up, but takes an index. So both
//    processes must create as many endpoints per connect to each other, which they do
//    when they run with the same UCX_TLS (2 with shared memory, else 1; a connect that
//    falls back to mode NONE also takes 2). A mixed configuration where only one side
//    creates a data endpoint is safe for the first connect of each pair, and a
//    reconnect after disconnect() (same two processes) could then fail to wire up
//    (kTimeout after 30 s) rather than pair wrongly.
//  * Reads and writes of a region the data endpoint cannot map (ucp_rkey_ptr fails:
//    memory registered in place, not allocated by UCX) would be emulated by UCX with
//    messages over the shared-memory FIFO: they go by message over the control
//    endpoint instead (Key::by_message).
//  * UCX_TLS with shared memory but no transport with peer-failure support (sm,self)
//    gets tcp added (on loopback) at init, for the control endpoints, unless
//    TransportOptions::ucx_tcp_control is off.
//  * Where UCX_TLS still offers no transport with peer-failure support to a peer,
//    and the peer is a process on this host (same boot id and PID namespace, carried in
//    the address), the single endpoint is created in mode NONE and ferry watches the
//    peer's process through a pidfd: its exit is reported exactly like a UCX endpoint
//    error. Messages then go over shared memory, and the FIFO risk above remains (the
//    transport says so once, on stderr).
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "transport/backend.h"
#include "transport/wire.h"

namespace ferry::detail {
namespace {

namespace wire = ferry::transport_wire;
using Clock = std::chrono::steady_clock;

constexpr unsigned kAmId = 0x4652;        // "FR": control messages (send)
// ferry's own get/put where UCX would emulate them, see "RMA by message" below.
constexpr unsigned kAmReadReq = 0x4653;
constexpr unsigned kAmReadData = 0x4654;
constexpr unsigned kAmWrite = 0x4655;
constexpr unsigned kAmFlushReq = 0x4656;
constexpr unsigned kAmFlushAck = 0x4657;
constexpr uint32_t kReadMagic = 0x46524452;  // "FRDR"
// RMA by message. A READ_DATA reply carries at most kReadChunk bytes: with its headers
// it fits one tcp active-message fragment (UCX 1.13: am_zcopy <= 64 KiB), so the reader
// gets it in UCX's receive buffer and copies it into place once; a longer message is
// sent in fragments that UCX first reassembles in a buffer of its own (one copy more).
// A target keeps at most kReadWindow replies of one read in flight (~1 MiB).
constexpr uint64_t kReadChunk = (64 << 10) - 512;
constexpr int kReadWindow = 16;
// A WRITE message carries at most this much (UCX fragments it; writes were at or above
// ucx_perftest's put with it, docs/RESULTS.md).
constexpr uint64_t kWriteChunk = 1 << 20;
// True while a caller thread runs an operation directly on the worker (see rma()).
thread_local bool direct_caller = false;
// Control calls (connect, register, ...) wait at most this long for the progress thread.
constexpr auto kControlTimeout = std::chrono::seconds(30);
// Without an event fd the progress thread sleeps in slices of kIdleSleep (commands wake
// it at once) once TransportOptions::spin_after_activity has passed.
constexpr auto kIdleSleep = std::chrono::microseconds(500);
// Longest sleep on the worker's event fd (wake-ups come from UCX events or posts).
constexpr auto kMaxSleep = std::chrono::milliseconds(100);
// With operations in flight, the progress thread spins at most kBusySpin after the last
// event, then sleeps on the event fd as an idle one does (at most kBusySleep, a safety
// net for a transport that raises no event). Spinning for as long as operations were in
// flight made tcp reads 2-3x slower on a loaded 2-core machine: the spinning initiator
// and target took the CPU from the threads that had work (the peer's copy, the caller
// posting the next read), while a tcp arrival wakes the fd at once. Any spin longer
// than the gap between two arrivals (~50 us per 64 KiB at 1.3 GB/s) is a full spin:
// 20 and 100 us measured between that and no spin, 0 best (docs/RESULTS.md).
// FERRY_UCX_BUSY_SPIN_US overrides it.
constexpr auto kBusySpin = std::chrono::microseconds(0);
constexpr auto kBusySleep = std::chrono::milliseconds(1);
// How often watched peer processes (see below) are polled.
constexpr auto kWatchInterval = std::chrono::milliseconds(20);

Status from_ucs(ucs_status_t st, const std::string& what) {
  if (st == UCS_OK) return Status::Ok();
  std::string msg = what + ": " + ucs_status_string(st);
  switch (st) {
    case UCS_ERR_CANCELED: return cancelled("{}", msg);
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR: return peer_failed("{}", msg);
    case UCS_ERR_TIMED_OUT: return timeout_error("{}", msg);
    case UCS_ERR_NO_MEMORY: return io_error("{}", msg);
    case UCS_ERR_INVALID_PARAM: return invalid_argument("{}", msg);
    case UCS_ERR_UNSUPPORTED: return unimplemented("{}", msg);
    case UCS_ERR_OUT_OF_RANGE: return out_of_range("{} (refused by the target)", msg);
    case UCS_ERR_NO_ELEM: return not_found("{} (the target's region is not registered)", msg);
    default: return internal_error("{}", msg);
  }
}

class UcxBackend;

struct Peer {
  ~Peer() {
    if (pidfd >= 0) close(pidfd);
  }
  UcxBackend* self = nullptr;
  PeerId id = 0;
  ucp_ep_h ep = nullptr;       // control endpoint: every message (progress thread only)
  ucp_ep_h data_ep = nullptr;  // shared-memory get/put only, mode NONE (see the top); or null
  int pidfd = -1;         // >= 0: a process on this host (import_key checks it is alive)
  bool watched = false;   // mode NONE control endpoint: liveness watched through pidfd
  bool printed = false;   // FERRY_UCX_EP_INFO printed this endpoint's lanes
  bool control_by_message = false;  // the control endpoint has no native get lane (tcp; set at connect)
  // A write by message went to this peer since its last flush (a peer with a data
  // endpoint writes by message to regions that endpoint cannot map; progress thread or
  // direct caller, under worker_mu_).
  bool wrote_by_message = false;
  // The endpoint reads and writes go on, and whether they go by message on it.
  ucp_ep_h rma_ep() const { return data_ep != nullptr ? data_ep : ep; }
  bool rma_by_message() const { return data_ep == nullptr && control_by_message; }
  pid_t pid = 0;
  bool failed = false;    // under mu_
  bool closed = false;    // under mu_ (disconnect)
  Status why;
};

struct Region {
  void* base;
  uint64_t length;
  MemoryKind kind;
  ucp_mem_h memh;
  std::vector<std::byte> packed_rkey;
  bool allocated;  // allocate_memory: ferry owns the memory (see pump_reply)
};

struct Key {
  PeerId peer;
  uint64_t region_id;  // the owner's region id (reads by message name it)
  uint64_t base;
  uint64_t length;
  MemoryKind kind;
  ucp_rkey_h rkey;
  std::shared_ptr<Peer> owner;
  // Read and written by message over the control endpoint: the owner's endpoint has no
  // native get lane, or its data endpoint cannot map this region (see import_key).
  bool by_message;
};

class UcxBackend final : public TransportBackend {
 public:
  explicit UcxBackend(const TransportOptions& options) : opt_(options), id_(new_instance_id()) {
    spin_window_ = opt_.spin_after_activity;
    if (const char* us = std::getenv("FERRY_UCX_SPIN_US")) spin_window_ = std::chrono::microseconds(std::atoll(us));
    if (const char* us = std::getenv("FERRY_UCX_BUSY_SPIN_US")) busy_spin_ = std::chrono::microseconds(std::atoll(us));
  }

  Status init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return from_ucs(st, "ucx: reading the UCX configuration");
    bool keepalive_set = false;
    std::optional<std::string> tls, net_devices;  // as UCX will see them
    if (const char* e = std::getenv("UCX_TLS")) tls = e;
    if (const char* e = std::getenv("UCX_NET_DEVICES")) net_devices = e;
    for (const auto& [k, v] : opt_.ucx_config) {
      if (k == "KEEPALIVE_INTERVAL") keepalive_set = true;
      if (k == "TLS") tls = v;
      if (k == "NET_DEVICES") net_devices = v;
      st = ucp_config_modify(config, k.c_str(), v.c_str());
      if (st != UCS_OK) {
        ucp_config_release(config);
        return invalid_argument("ucx: setting {}={}: {}", k, v, ucs_status_string(st));
      }
    }
    if (!keepalive_set) {
      std::string ka = std::to_string(opt_.keepalive_interval.count()) + "ms";
      ucp_config_modify(config, "KEEPALIVE_INTERVAL", ka.c_str());  // best effort
    }
    bool tcp_control = opt_.ucx_tcp_control;
    if (const char* e = std::getenv("FERRY_UCX_TCP_CONTROL")) {  // diagnostics
      const std::string_view v(e);
      tcp_control = !(v == "0" || v == "false" || v == "off" || v == "no");
    }
    if (tcp_control && tls && needs_tcp_control(*tls)) {
      // Messages must not go over shared memory (see the top of this file): tcp carries
      // them. The list had no network transport, so loopback is all tcp needs.
      const std::string with_tcp = *tls + ",tcp";
      st = ucp_config_modify(config, "TLS", with_tcp.c_str());
      if (st == UCS_OK && !net_devices) st = ucp_config_modify(config, "NET_DEVICES", "lo");
      if (st != UCS_OK) {
        ucp_config_release(config);
        return invalid_argument("ucx: adding tcp to UCX_TLS={} for control messages: {}", *tls, ucs_status_string(st));
      }
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
        {kAmFlushReq, &UcxBackend::flush_req_cb}, {kAmFlushAck, &UcxBackend::flush_ack_cb}};
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

  // Whether UCX_TLS `tls` lists shared-memory transports and none with peer-failure
  // support: then ferry adds tcp (TransportOptions::ucx_tcp_control). A "^..." list
  // (everything but) or "all" already has tcp unless the user excluded it.
  static bool needs_tcp_control(const std::string& tls) {
    if (tls.empty() || tls.starts_with('^')) return false;
    bool shm = false;
    for (size_t at = 0; at <= tls.size();) {
      const size_t comma = std::min(tls.find(',', at), tls.size());
      const std::string tl = tls.substr(at, comma - at);
      at = comma + 1;
      for (const char* net : {"all", "tcp", "ib", "rc", "ud", "dc", "rc_v", "rc_x", "ud_v", "ud_x", "dc_x", "rc_mlx5",
                              "ud_mlx5", "dc_mlx5", "rc_verbs", "ud_verbs"}) {
        if (tl == net) return false;
      }
      for (const char* mem : {"sm", "shm", "mm", "posix", "sysv", "cma", "xpmem", "knem"}) shm |= tl == mem;
    }
    return shm;
  }

  // Whether the context's resources ("resource N : md M dev D flags -- tl/dev" lines of
  // ucp_context_print_info) include a shared-memory transport that maps a peer's memory.
  bool context_has_shared_memory() {
    const std::string info = printed([this](FILE* f) { ucp_context_print_info(ctx_, f); });
    for (size_t at = info.find("-- "); at != std::string::npos; at = info.find("-- ", at + 1)) {
      size_t slash = info.find('/', at);
      if (slash == std::string::npos) break;
      if (maps_peer_memory(std::string_view(info).substr(at + 3, slash - at - 3))) return true;
    }
    return false;
  }

  ~UcxBackend() override {
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

  std::string_view name() const override { return "ucx"; }
  PeerId id() const override { return id_; }
  std::vector<std::byte> address() const override { return address_; }

  Result<PeerId> connect(std::span<const std::byte> bytes) override {
    FERRY_ASSIGN_OR_RETURN(wire::Address a, wire::decode_address(bytes, wire::Backend::kUcx));
    if (a.payload.empty()) return corrupt("ucx address: empty worker address");
    if (local_process_exited(a)) {
      // UCX 1.13 over tcp can assert inside its wire-up when the peer is already gone.
      return peer_failed("connect: peer {:#x} (process {}) has exited", a.instance_id, a.pid);
    }
    FERRY_ASSIGN_OR_RETURN(PeerId id, create_ep(std::move(a)));
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

  Result<PeerId> create_ep(wire::Address a) {
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
                       "without tcp, and TransportOptions::ucx_tcp_control off or tcp unusable): messages go "
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
      peer->control_by_message = forced_reads().value_or(no_get_lane(control_info));
      const auto control_tls = lane_transports(control_info);
      if (std::any_of(control_tls.begin(), control_tls.end(), maps_peer_memory)) stats_.shared_memory_message_peers++;
      if (local && !peer->watched && peer->control_by_message && shm_transports_ && !forced_reads().value_or(false)) {
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

  Status disconnect(PeerId id) override {
    return run_status([this, id]() -> Status {
      std::shared_ptr<Peer> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(id);
        if (it == peers_.end()) return not_found("disconnect: peer {:#x} is not connected", id);
        p = it->second;
        p->closed = true;
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
      close_ep(p, !p->failed);
      // Nothing of this peer may stay in flight for good: a read by message still
      // waiting for its data, a flush for its ack. A late answer finds nothing.
      fail_inflight(p.get());
      return Status::Ok();
    });
  }

  Result<MemoryRegion> register_memory(void* base, uint64_t length, MemoryKind kind) override {
    return map_memory(base, length, kind, false);
  }

  Result<MemoryRegion> allocate_memory(uint64_t length, MemoryKind kind) override {
    return map_memory(nullptr, length, kind, true);
  }

  Result<MemoryRegion> map_memory(void* base, uint64_t length, MemoryKind kind, bool allocate) {
    const char* op = allocate ? "allocate_memory" : "register_memory";
    if (kind != MemoryKind::kHost) {
      return unimplemented("{}: {} memory is not supported yet by the ucx backend", op, memory_kind_name(kind));
    }
    return run_sync<MemoryRegion>([this, base, length, kind, allocate, op]() -> Result<MemoryRegion> {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = base;
      mp.length = length;
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

  Status deregister_memory(const MemoryRegion& region) override {
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

  Result<std::vector<std::byte>> export_key(const MemoryRegion& region) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region.id);
    if (it == regions_.end() || it->second.base != region.base || it->second.length != region.length) {
      return not_found("export_key: region {} is not registered", region.id);
    }
    return wire::encode_key({wire::Backend::kUcx, region.kind, id_, region.id,
                             uint64_t(reinterpret_cast<uintptr_t>(region.base)), region.length,
                             it->second.packed_rkey});
  }

  Result<RemoteRegion> import_key(std::span<const std::byte> bytes) override {
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
      if (process_exited(*p)) {
        // Unpacking a shared-memory rkey attaches the owner's segment; UCX 1.13 crashes
        // (SIGSEGV in ucp_rkey_destroy) when that fails because the owner is gone.
        on_peer_failure(p.get(), fmt::format("process {} exited", p->pid));
        return peer_failed("import_key: peer {:#x} (process {}) has exited", k.owner_id, p->pid);
      }
      ucp_rkey_h rkey = nullptr;
      ucs_status_t st = ucp_ep_rkey_unpack(p->rma_ep(), k.payload.data(), &rkey);
      if (st != UCS_OK) return corrupt("import_key: UCX refused the packed rkey: {}", ucs_status_string(st));
      bool by_message = p->rma_by_message();
      if (!by_message && p->data_ep != nullptr) {
        // (Unpacking on the data endpoint attaches the owner's segment: the
        // process_exited() check above narrows, but cannot close, the window in which
        // UCX 1.13 crashes if the owner dies just then.)
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

  Status release_key(const RemoteRegion& remote) override {
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

  Result<Completion> rma(bool is_write, const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                         uint64_t remote_offset, uint64_t length, CompletionCallback on_done) override {
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

  // One validated read/write, ready to post.
  struct RmaOp {
    std::shared_ptr<OpState> state;
    bool is_write = false;
    void* local = nullptr;
    uint64_t remote_addr = 0;
    uint64_t length = 0;
    ucp_mem_h memh = nullptr;
    ucp_rkey_h rkey = nullptr;
    std::shared_ptr<Peer> peer;
    uint64_t region_id = 0;  // the target's
    bool by_message = false;  // Key::by_message
  };

  // Posts `r` on the worker (the caller holds it). Returns whether it is still in
  // flight (false: already completed, successfully or not).
  bool start_rma(const RmaOp& r) {
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

  void rma_done(const RmaOp& r, ucs_status_t st) {
    if (st == UCS_OK) (r.is_write ? stats_.bytes_written : stats_.bytes_read) += r.length;
    if (debug_ep_info_ && r.peer->ep != nullptr && !r.peer->printed) {
      r.peer->printed = true;
      ucp_ep_print_info(r.peer->ep, stderr);
      if (r.peer->data_ep != nullptr) ucp_ep_print_info(r.peer->data_ep, stderr);
    }
    complete_op(r.state, from_ucs(st, r.is_write ? "write" : "read"));
  }

  // ---- RMA by message ---------------------------------------------------------------
  // Where an endpoint has no native get lane (UCX 1.13 over tcp), UCX emulates get and
  // put with messages, and its target-side handlers abort the whole process (ucs_fatal
  // "unexpected error") when they answer an initiator that has just died. So ferry
  // emulates them itself, with active messages whose send errors are reported, never
  // fatal:
  //  * read: the reader sends READ_REQ (region id, address, length); the target checks
  //    the range against its registered region, copies the bytes out in chunks of
  //    kReadChunk (at most kReadWindow in flight per request) and sends them as eager
  //    READ_DATA messages; the reader copies each into place and completes the read
  //    when every byte arrived. Late data of a read already failed is dropped.
  //  * write: WRITE messages (region id, address, bytes) in chunks, straight from the
  //    caller's buffer; complete when every chunk was sent. The target checks each
  //    against its region, copies it in, and remembers a refused one for the writer.
  //  * flush: FLUSH_REQ after the writes (messages on one endpoint arrive in order);
  //    the target answers FLUSH_ACK once every earlier WRITE is applied, with an error
  //    if one was refused since the last flush.
  struct ReadReq {
    uint32_t magic;
    uint32_t reserved;
    uint64_t op;      // the reader's op id
    uint64_t reader;  // the reader's instance id
    uint64_t region;  // the target's region id
    uint64_t addr;
    uint64_t length;
  };
  struct ReadData {
    uint32_t magic;
    int32_t status;  // 0, or a ucs_status_t refusing the whole read
    uint64_t target;  // the target's instance id (the reader checks it is the one it asked)
    uint64_t op;
    uint64_t offset;  // within the read
    uint64_t length;  // of this chunk (== the message's data length)
  };
  struct AmRead {
    PeerId target;
    std::byte* dst;
    uint64_t length;
    uint64_t got;
  };
  // One request being answered (target side).
  struct ReadReply {
    ucp_ep_h ep;                  // the reader's endpoint (ours if connected, else the reply ep)
    std::shared_ptr<Peer> peer;   // null when answering on the reply ep
    uint64_t op, region, addr, length;
    uint64_t sent = 0;            // bytes handed to UCX
    int in_flight = 0;
    bool stopped = false;
    bool pumping = false;         // inside pump_reply (see there)
  };

  // An eager active-message send completing through send_cb (op id in the request).
  // reply: the receiver may answer on the sender's reply ep.
  ucp_request_param_t eager_params(bool reply) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    prm.cb.send = &UcxBackend::send_cb;
    prm.user_data = this;
    prm.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
    return prm;
  }

  // FERRY_UCX_READS=message|rma forces reads/writes by message or by UCX's get/put
  // (tests, diagnostics); nullopt: not forced.
  static std::optional<bool> forced_reads() {
    if (const char* force = std::getenv("FERRY_UCX_READS")) {
      if (std::strcmp(force, "message") == 0) return true;
      if (std::strcmp(force, "rma") == 0) return false;
    }
    return std::nullopt;
  }

  // What a UCX print function (ucp_ep_print_info, ucp_context_print_info) writes.
  template <typename Print>
  static std::string printed(Print print) {
    char* text = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&text, &len);
    if (f == nullptr) return {};
    print(f);
    std::fclose(f);
    std::string out(text == nullptr ? "" : text, len);
    std::free(text);
    return out;
  }

  // UCX's description of an endpoint's lanes, e.g.
  //   "#   lane[0]:  8:tcp/lo.0 md[4]  -> md[4]/tcp/sysdev[255] rma_bw#0 am am_bw#0".
  static std::string ep_info(ucp_ep_h ep) {
    return printed([ep](FILE* f) { ucp_ep_print_info(ep, f); });
  }

  // The transport of each "lane[N]:  I:tl/dev" line of ep_info.
  static std::vector<std::string> lane_transports(const std::string& info) {
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

  static bool is_shared_memory_transport(std::string_view tl) {
    return maps_peer_memory(tl) || tl == "cma" || tl == "knem" || tl == "self";
  }
  // Shared-memory transports that map a peer's memory: native get/put on its segments,
  // and a receive FIFO for messages (cma and knem serve UCX's rendezvous only).
  static bool maps_peer_memory(std::string_view tl) { return tl == "posix" || tl == "sysv" || tl == "xpmem"; }

  // Whether a data endpoint may be kept: it has native get and put lanes, and every lane
  // is a shared-memory transport (no network lane, which in mode NONE could hang).
  static bool rma_lanes_only_shared_memory(const std::string& info) {
    const auto tls = lane_transports(info);
    if (tls.empty() || info.find("get[") == std::string::npos || info.find("put[") == std::string::npos) return false;
    return std::all_of(tls.begin(), tls.end(), is_shared_memory_transport);
  }

  // Whether an endpoint (its ep_info) has no native get lane: then it reads by message.
  static bool no_get_lane(const std::string& info) {
    if (info.find("lane[") == std::string::npos) return false;  // unknown format: trust UCX
    return info.find("get[") == std::string::npos;
  }

  // Caller holds the worker. Returns true (the read is in flight).
  bool start_read_by_message(const RmaOp& r) {
    uint64_t op_id = track(r.peer.get(), [this, r](ucs_status_t st) { rma_done(r, st); });
    am_reads_.emplace(op_id, AmRead{r.peer->id, static_cast<std::byte*>(r.local), r.length, 0});
    auto req = std::make_shared<ReadReq>(ReadReq{kReadMagic, 0, op_id, id_, r.region_id, r.remote_addr, r.length});
    ucp_request_param_t prm = eager_params(true);
    uint64_t send_id = track(r.peer.get(), [this, op_id, req](ucs_status_t st) {
      if (st != UCS_OK) finish(op_id, st);  // the request never left: fail the read
    });
    settle(send_id, ucp_am_send_nbx(r.peer->ep, kAmReadReq, req.get(), sizeof(ReadReq), nullptr, 0, &prm));
    return true;
  }

  // Target: a READ_REQ arrived (progress thread, inside ucp_worker_progress).
  static ucs_status_t read_req_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                  const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxBackend*>(arg);
    ReadReq q{};
    if (header_length != sizeof q || length != 0) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    std::memcpy(&q, header, sizeof q);
    if (q.magic != kReadMagic) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    auto reply = std::make_shared<ReadReply>();
    reply->op = q.op;
    reply->region = q.region;
    reply->addr = q.addr;
    reply->length = q.length;
    std::tie(reply->ep, reply->peer) = self->answer_ep(q.reader, param);
    if (reply->ep == nullptr) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    self->pump_reply(reply);
    return UCS_OK;
  }

  // Target: sends the next chunks of `rp` (progress thread).
  void pump_reply(const std::shared_ptr<ReadReply>& rp) {
    // A send that completes inside its post (the socket took it all) runs its
    // completion, which calls this again: that inner call returns at once and this loop
    // goes on. Recursing instead nested a call per chunk — 16 000 for a 1 GiB read —
    // and overflowed the progress thread's stack (seen under ASan).
    if (rp->pumping) return;
    rp->pumping = true;
    while (!rp->stopped && rp->in_flight < kReadWindow && (rp->sent < rp->length || rp->length == 0)) {
      if (rp->peer && !peer_usable(*rp->peer)) {
        rp->stopped = true;
        break;
      }
      auto buf = std::make_shared<std::vector<std::byte>>();
      ReadData d{kReadMagic, 0, id_, rp->op, rp->sent, 0};
      // Checked again for every chunk: the region may have been deregistered since (only
      // by a command of this thread, so not during the send below).
      const TargetRange t = check_target_range(rp->region, rp->addr, rp->length);
      d.status = t.status;
      const std::byte* src = nullptr;
      if (d.status == 0) {
        d.length = std::min(kReadChunk, rp->length - rp->sent);
        src = reinterpret_cast<const std::byte*>(rp->addr + rp->sent);
        if (!t.allocated) {
          // The caller's memory (register_memory) must be free to go once
          // deregister_memory returns, which may be called on this thread and cannot
          // wait for a send: copy.
          buf->assign(src, src + d.length);
          src = buf->data();
        }
      }
      const bool zero_copy = d.length > 0 && buf->empty();
      auto hdr = std::make_shared<ReadData>(d);
      rp->sent += d.length;
      rp->in_flight++;
      if (d.status != 0 || rp->length == 0) rp->stopped = true;  // the last message of this request
      ucp_request_param_t prm = eager_params(false);
      if (zero_copy) {
        // Sent straight from the region: it stays mapped until UCX has completed the send
        // (region_sends_, see deregister_memory).
        region_sends_[rp->region]++;
      }
      // A zero-copy send is tracked without its peer: only UCX's own completion (an
      // error once the reader failed) may release the region, not ferry's early failing
      // of a dead peer's operations.
      uint64_t id = track(zero_copy ? nullptr : rp->peer.get(),
                          [this, rp, hdr, buf, zero_copy, region = rp->region](ucs_status_t st) {
        rp->in_flight--;
        if (zero_copy) region_send_done(region);
        if (st != UCS_OK) {
          rp->stopped = true;  // the reader is gone or unreachable: nothing to answer
          return;
        }
        pump_reply(rp);
      });
      settle(id, ucp_am_send_nbx(rp->ep, kAmReadData, hdr.get(), sizeof(ReadData), src, d.length, &prm));
    }
    rp->pumping = false;
  }

  struct WriteData {
    uint32_t magic;
    uint32_t reserved;
    uint64_t writer;  // the writer's instance id
    uint64_t region;  // the target's region id
    uint64_t addr;
    uint64_t length;  // == the message's data length
  };
  struct FlushMsg {
    uint32_t magic;
    int32_t status;   // FLUSH_ACK: 0, or the ucs_status_t of a refused write
    uint64_t op;      // the flusher's op id
    uint64_t sender;  // the sender's instance id
  };

  struct TargetRange {
    int32_t status = 0;  // 0, or the ucs_status_t refusing the access
    bool allocated = false;
  };
  // Whether [addr, addr + length) lies inside registered region `region`.
  TargetRange check_target_range(uint64_t region, uint64_t addr, uint64_t length) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region);
    if (it == regions_.end()) return {int32_t(UCS_ERR_NO_ELEM)};
    const uint64_t base = uint64_t(reinterpret_cast<uintptr_t>(it->second.base));
    if (addr < base || length > it->second.length || addr - base > it->second.length - length) {
      return {int32_t(UCS_ERR_OUT_OF_RANGE)};
    }
    return {0, it->second.allocated};
  }

  // A zero-copy READ_DATA send from `region` completed (progress thread, possibly inside
  // a UCX callback): the last one of a deregistered region unmaps it, from a command
  // (not inside the callback).
  void region_send_done(uint64_t region) {
    auto it = region_sends_.find(region);
    if (it == region_sends_.end() || --it->second > 0) return;
    region_sends_.erase(it);
    if (!dying_.contains(region)) return;
    post([this, region] {
      auto d = dying_.find(region);
      if (d == dying_.end() || region_sends_.contains(region)) return;
      ucp_mem_unmap(ctx_, d->second);
      dying_.erase(d);
    });  // if the transport is stopping, shutdown() unmaps it
  }

  // Caller holds the worker. Returns true (in flight, or already completed).
  bool start_write_by_message(const RmaOp& r) {
    uint64_t op_id = track(r.peer.get(), [this, r](ucs_status_t st) { rma_done(r, st); });
    const uint64_t chunks = (r.length + kWriteChunk - 1) / kWriteChunk;
    auto left = std::make_shared<uint64_t>(chunks);
    for (uint64_t i = 0; i < chunks; ++i) {
      const uint64_t off = i * kWriteChunk;
      const uint64_t len = std::min(kWriteChunk, r.length - off);
      auto hdr = std::make_shared<WriteData>(WriteData{kReadMagic, 0, id_, r.region_id, r.remote_addr + off, len});
      ucp_request_param_t prm = eager_params(false);
      uint64_t send_id = track(r.peer.get(), [this, op_id, left, hdr](ucs_status_t st) {
        if (st != UCS_OK) return finish(op_id, st);
        if (--*left == 0) finish(op_id, UCS_OK);
      });
      settle(send_id, ucp_am_send_nbx(r.peer->ep, kAmWrite, hdr.get(), sizeof(WriteData),
                                      static_cast<const std::byte*>(r.local) + off, len, &prm));
    }
    return true;
  }

  // Target: a WRITE chunk arrived (progress thread).
  static ucs_status_t write_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxBackend*>(arg);
    WriteData w{};
    if (header_length != sizeof w || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    std::memcpy(&w, header, sizeof w);
    if (w.magic != kReadMagic || w.length != length) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    const int32_t refused = self->check_target_range(w.region, w.addr, w.length).status;
    if (refused != 0) {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->refused_writes_[w.writer] = ucs_status_t(refused);
      return UCS_OK;
    }
    // Regions are deregistered only by commands of this (the progress) thread.
    std::memcpy(reinterpret_cast<void*>(w.addr), data, length);
    return UCS_OK;
  }

  // Caller holds the worker (a flush command on the progress thread).
  void start_flush_by_message(const std::shared_ptr<Peer>& peer, std::function<void(ucs_status_t)> done) {
    peer->wrote_by_message = false;
    uint64_t op_id = track(peer.get(), std::move(done));
    am_flushes_.insert(op_id);
    auto msg = std::make_shared<FlushMsg>(FlushMsg{kReadMagic, 0, op_id, id_});
    ucp_request_param_t prm = eager_params(true);
    uint64_t send_id = track(peer.get(), [this, op_id, msg](ucs_status_t st) {
      if (st != UCS_OK) finish(op_id, st);
    });
    settle(send_id, ucp_am_send_nbx(peer->ep, kAmFlushReq, msg.get(), sizeof(FlushMsg), nullptr, 0, &prm));
  }

  // The endpoint to answer `sender` on: ours when connected to it, else UCX's reply ep.
  std::pair<ucp_ep_h, std::shared_ptr<Peer>> answer_ep(uint64_t sender, const ucp_am_recv_param_t* param) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(sender);
      if (it != peers_.end() && !it->second->failed && it->second->ep != nullptr) return {it->second->ep, it->second};
    }
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && param->reply_ep != nullptr) return {param->reply_ep, nullptr};
    return {nullptr, nullptr};
  }

  // Target: FLUSH_REQ (progress thread). Every earlier WRITE of this sender is applied.
  static ucs_status_t flush_req_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                   const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxBackend*>(arg);
    FlushMsg f{};
    if (header_length != sizeof f || length != 0) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    std::memcpy(&f, header, sizeof f);
    auto [ep, peer] = self->answer_ep(f.sender, param);
    if (f.magic != kReadMagic || ep == nullptr) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    ucs_status_t refused = UCS_OK;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->refused_writes_.find(f.sender);
      if (it != self->refused_writes_.end()) {
        refused = it->second;
        self->refused_writes_.erase(it);
      }
    }
    auto ack = std::make_shared<FlushMsg>(FlushMsg{kReadMagic, int32_t(refused), f.op, self->id_});
    ucp_request_param_t prm = self->eager_params(false);
    uint64_t id = self->track(peer.get(), [ack](ucs_status_t) {});
    self->settle(id, ucp_am_send_nbx(ep, kAmFlushAck, ack.get(), sizeof(FlushMsg), nullptr, 0, &prm));
    return UCS_OK;
  }

  // Flusher: FLUSH_ACK (progress thread).
  static ucs_status_t flush_ack_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                   const ucp_am_recv_param_t*) {
    auto* self = static_cast<UcxBackend*>(arg);
    FlushMsg f{};
    if (header_length != sizeof f || length != 0) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    std::memcpy(&f, header, sizeof f);
    if (f.magic != kReadMagic) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    if (self->am_flushes_.erase(f.op) == 0) return UCS_OK;  // a flush already failed: drop
    self->finish(f.op, f.status == 0 ? UCS_OK : ucs_status_t(f.status));
    return UCS_OK;
  }

  // Reader: a chunk of a read arrived (progress thread).
  static ucs_status_t read_data_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxBackend*>(arg);
    ReadData d{};
    if (header_length != sizeof d || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      self->stats_.malformed_messages++;
      return UCS_OK;
    }
    std::memcpy(&d, header, sizeof d);
    auto it = self->am_reads_.find(d.op);
    if (d.magic != kReadMagic || it == self->am_reads_.end() || it->second.target != d.target) {
      if (d.magic != kReadMagic) self->stats_.malformed_messages++;
      return UCS_OK;  // a read that already failed (or never was): drop
    }
    AmRead& rd = it->second;
    if (d.status != 0) {
      self->finish(d.op, ucs_status_t(d.status));
      return UCS_OK;
    }
    if (d.length != length || d.offset > rd.length || d.length > rd.length - d.offset) {
      self->stats_.malformed_messages++;
      self->finish(d.op, UCS_ERR_IO_ERROR);
      return UCS_OK;
    }
    std::memcpy(rd.dst + d.offset, data, length);
    rd.got += length;
    if (rd.got >= rd.length) self->finish(d.op, UCS_OK);
    return UCS_OK;
  }

  // Completes an op; on a caller thread posting directly, an op with a callback is
  // completed from the progress thread instead (callbacks never run inline).
  void complete_op(const std::shared_ptr<OpState>& state, Status st) {
    if (direct_caller && state->has_callback()) {
      if (post([state, st] { state->complete(st); })) return;
    }
    state->complete(std::move(st));
  }

  Result<Completion> flush(PeerId id, CompletionCallback on_done) override {
    return flush_ep(id, false, std::move(on_done));
  }

  // Flushes the endpoint writes go on (control == false), or the control endpoint (to
  // finish its wire-up at connect).
  Result<Completion> flush_ep(PeerId id, bool control, CompletionCallback on_done) {
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

  Result<Completion> send(PeerId id, uint32_t tag, std::span<const std::byte> payload,
                          CompletionCallback on_done) override {
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
      ucp_request_param_t prm = eager_params(false);
      settle(op_id, ucp_am_send_nbx(peer->ep, kAmId, buf->header, sizeof buf->header, buf->payload.data(),
                                    buf->payload.size(), &prm));
    });
    if (!posted) return cancelled("send: the transport is shutting down");
    return Completion(state);
  }

  void set_message_handler(MessageHandler handler) override {
    auto h = std::make_shared<const MessageHandler>(std::move(handler));
    std::unique_lock<std::mutex> invoke;
    if (progress_tid_.load() != std::this_thread::get_id()) invoke = std::unique_lock<std::mutex>(handler_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    message_handler_ = std::move(h);
  }

  void set_peer_failure_handler(PeerFailureHandler handler) override {
    auto h = std::make_shared<const PeerFailureHandler>(std::move(handler));
    std::unique_lock<std::mutex> invoke;
    if (progress_tid_.load() != std::this_thread::get_id()) invoke = std::unique_lock<std::mutex>(handler_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    failure_handler_ = std::move(h);
  }

  Status simulate_crash() override {
    return unimplemented("simulate_crash: the ucx backend fails for real (SIGKILL the process)");
  }

  TransportStats stats() const override { return stats_.snapshot(); }

 private:
  // ---- progress thread ---------------------------------------------------------------

  bool post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      if (stop_) return false;
      cmds_.push_back(std::move(fn));
    }
    wake();
    return true;
  }

  // Wakes the progress thread if it sleeps (ucp_worker_signal is thread-safe).
  void wake() {
    if (!sleeping_.load()) return;
    if (efd_ >= 0) ucp_worker_signal(worker_);
    cmd_cv_.notify_one();
  }

  // After a caller posted an operation directly that is still in flight: the progress
  // thread must progress it. Pairs with run()'s check before sleeping (both seq_cst):
  // either it sees direct_posts_ move, or this sees sleeping_ and signals.
  void kick() {
    direct_posts_.fetch_add(1);
    if (!sleeping_.load()) return;
    if (efd_ >= 0) ucp_worker_signal(worker_);
    cmd_cv_.notify_one();
  }

  void run() {
    progress_tid_ = std::this_thread::get_id();
    auto last_active = Clock::now();
    std::deque<std::function<void()>> batch;
    for (;;) {
      bool active = false, busy = false;
      {
        std::lock_guard<std::mutex> worker(worker_mu_);
        {
          std::lock_guard<std::mutex> lock(cmd_mu_);
          if (stop_) break;
          batch.swap(cmds_);
        }
        active = !batch.empty();
        for (auto& fn : batch) fn();
        batch.clear();
        if (watched_.load(std::memory_order_relaxed) > 0 && Clock::now() >= next_watch_) {
          next_watch_ = Clock::now() + kWatchInterval;
          check_watched_processes();
        }
        while (ucp_worker_progress(worker_) != 0) active = true;
        busy = !inflight_.empty();
      }
      const auto now = Clock::now();
      if (active) {
        last_active = now;
        continue;
      }
      // Nothing happened in this pass. With operations in flight, spin only briefly,
      // then sleep on the event fd like an idle worker (see kBusySpin).
      if (busy && (efd_ < 0 || now - last_active < busy_spin_)) continue;
      if (!busy && now - last_active < spin_window_) continue;
      const uint64_t posts_seen = direct_posts_.load();
      if (efd_ >= 0) {
        ucs_status_t st;
        {
          std::lock_guard<std::mutex> worker(worker_mu_);
          st = ucp_worker_arm(worker_);
        }
        if (st == UCS_ERR_BUSY) continue;  // events pending: progress again
        if (st == UCS_OK) {
          sleeping_.store(true);
          bool pending;
          {
            std::lock_guard<std::mutex> lock(cmd_mu_);
            // Posted before sleeping_ was visible.
            pending = stop_ || !cmds_.empty() || direct_posts_.load() != posts_seen;
          }
          if (!pending) {
            // Bounded: the process watch and stop_ are checked at least this often, and
            // an operation in flight is progressed at least every kBusySleep even if
            // some transport raised no event for it.
            auto limit = busy ? kBusySleep : watched_.load() > 0 ? kWatchInterval : kMaxSleep;
            pollfd p{efd_, POLLIN, 0};
            poll(&p, 1, int(std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()));
          }
          sleeping_.store(false);
          continue;
        }
      }
      std::unique_lock<std::mutex> lock(cmd_mu_);
      sleeping_.store(true);
      cmd_cv_.wait_for(lock, kIdleSleep, [&] { return stop_ || !cmds_.empty() || direct_posts_.load() != posts_seen; });
      sleeping_.store(false);
    }
    // Commands posted before stop still run (they complete their ops as cancelled or
    // post nothing new); the destructor finishes the shutdown on its own thread.
    std::lock_guard<std::mutex> worker(worker_mu_);
    std::deque<std::function<void()>> rest;
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      rest.swap(cmds_);
    }
    for (auto& fn : rest) fn();
  }

  // Whether the address is of a process on this host that has exited (a zombie counts).
  static bool local_process_exited(const wire::Address& a) {
    if (a.pid == 0 || a.host_tag == 0 || a.host_tag != wire::local_host_tag()) return false;
    int fd = int(syscall(SYS_pidfd_open, pid_t(a.pid), 0));
    if (fd < 0) return errno == ESRCH;
    pollfd p{fd, POLLIN, 0};
    const bool exited = poll(&p, 1, 0) > 0;
    close(fd);
    return exited;
  }

  // A peer on this host whose process has exited (its pidfd is readable).
  static bool process_exited(const Peer& p) {
    if (p.pidfd < 0) return false;
    pollfd fd{p.pidfd, POLLIN, 0};
    return poll(&fd, 1, 0) > 0;
  }

  // Peers whose liveness ferry watches (mode NONE endpoints): a readable pidfd means
  // the process exited.
  void check_watched_processes() {
    std::vector<std::shared_ptr<Peer>> watch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) {
        if (p->watched && !p->failed) watch.push_back(p);
      }
    }
    if (watch.empty()) return;
    std::vector<pollfd> fds;
    for (auto& p : watch) fds.push_back(pollfd{p->pidfd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), 0) <= 0) return;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0) on_peer_failure(watch[i].get(), fmt::format("process {} exited", watch[i]->pid));
    }
  }

  // Registers a completion continuation; returns the id stored in the UCX request.
  // `peer`: the operation is failed by ferry when that peer fails (UCX does not
  // always complete requests of a mode-NONE endpoint); nullptr for internal ops.
  uint64_t track(const Peer* peer, std::function<void(ucs_status_t)> fn) {
    uint64_t id = next_op_++;
    inflight_.emplace(id, Inflight{peer, std::move(fn)});
    return id;
  }

  // Completes op `id` once; a later UCX callback for it finds nothing and is ignored.
  void finish(uint64_t id, ucs_status_t st) {
    am_reads_.erase(id);  // late chunks of a failed read must not land in the caller's buffer
    am_flushes_.erase(id);
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    auto fn = std::move(it->second.fn);
    inflight_.erase(it);
    fn(st);
  }

  void fail_inflight(const Peer* peer) {
    std::vector<uint64_t> ids;
    for (auto& [id, op] : inflight_) {
      if (op.peer == peer) ids.push_back(id);
    }
    for (uint64_t id : ids) finish(id, UCS_ERR_CONNECTION_RESET);
  }

  // The immediate outcome of an nbx call.
  void settle(uint64_t op_id, ucs_status_ptr_t r) {
    if (r == nullptr) {
      finish(op_id, UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      finish(op_id, UCS_PTR_STATUS(r));
    } else {
      *static_cast<uint64_t*>(r) = op_id;  // the request's user area (request_size)
    }
  }

  static void send_cb(void* request, ucs_status_t status, void* user_data) {
    auto* self = static_cast<UcxBackend*>(user_data);
    uint64_t id = *static_cast<uint64_t*>(request);
    ucp_request_free(request);
    self->finish(id, status);
  }

  bool peer_usable(const Peer& p) {
    std::lock_guard<std::mutex> lock(mu_);
    return !p.failed && !p.closed && p.ep != nullptr;
  }

  // Caller holds mu_.
  Result<std::shared_ptr<Peer>> usable_peer(PeerId id, const char* op) {
    auto it = peers_.find(id);
    if (it == peers_.end()) return not_found("{}: peer {:#x} is not connected", op, id);
    if (it->second->failed) return peer_failed("{}: peer {:#x} failed: {}", op, id, it->second->why.message());
    return it->second;
  }

  static void ep_err_cb(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    p->self->on_peer_failure(p, fmt::format("endpoint error: {}", ucs_status_string(status)));
  }

  // Progress thread (inside ucp_worker_progress, or from the process watch).
  void on_peer_failure(Peer* raw, const std::string& reason) {
    std::shared_ptr<Peer> p;
    std::shared_ptr<const PeerFailureHandler> handler;
    Status why = peer_failed("peer {:#x}: {}", raw->id, reason);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (raw->failed || raw->closed) return;
      raw->failed = true;
      raw->why = why;
      auto it = peers_.find(raw->id);
      if (it != peers_.end() && it->second.get() == raw) p = it->second;
      handler = failure_handler_;
    }
    stats_.failed_peers++;
    fail_inflight(raw);
    if (p) {
      // Close outside the UCX callback; in-flight requests are completed by UCX with
      // an error status.
      post([this, p] { close_ep(p, false); });
    }
    if (handler && *handler) {
      std::lock_guard<std::mutex> invoke(handler_mu_);
      (*handler)(raw->id, why);
    }
  }

  // Progress thread (or the destructor after join). Starts closing the peer's endpoints.
  void close_ep(const std::shared_ptr<Peer>& p, bool flush) {
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

  void close_one(const std::shared_ptr<Peer>& p, ucp_ep_h ep, bool force) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    prm.cb.send = &UcxBackend::send_cb;
    prm.user_data = this;
    uint64_t id = track(nullptr, [p](ucs_status_t) {});  // keeps the Peer (error-callback arg) alive until closed
    settle(id, ucp_ep_close_nbx(ep, &prm));
  }

  static ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
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
    self->stats_.messages_received++;
    std::shared_ptr<const MessageHandler> handler;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      handler = self->message_handler_;
    }
    if (!handler || !*handler) {
      self->stats_.dropped_messages++;
      return UCS_OK;
    }
    std::lock_guard<std::mutex> invoke(self->handler_mu_);
    (*handler)(h->sender_id, h->tag, std::span<const std::byte>(static_cast<const std::byte*>(data), length));
    return UCS_OK;
  }

  // Runs fn on the progress thread (inline when already there) and waits, bounded.
  template <typename T>
  Result<T> run_sync(std::function<Result<T>()> fn) {
    if (progress_tid_.load() == std::this_thread::get_id()) return fn();
    struct Box {
      std::mutex mu;
      std::condition_variable cv;
      std::optional<Result<T>> result;
    };
    auto box = std::make_shared<Box>();
    bool posted = post([box, fn = std::move(fn)] {
      Result<T> r = fn();
      {
        std::lock_guard<std::mutex> lock(box->mu);
        box->result.emplace(std::move(r));
      }
      box->cv.notify_all();
    });
    if (!posted) return cancelled("the transport is shutting down");
    std::unique_lock<std::mutex> lock(box->mu);
    if (!box->cv.wait_for(lock, kControlTimeout, [&] { return box->result.has_value(); })) {
      return timeout_error("the progress thread did not answer within {} s", kControlTimeout.count());
    }
    return std::move(*box->result);
  }

  Status run_status(std::function<Status()> fn) {
    auto r = run_sync<bool>([fn = std::move(fn)]() -> Result<bool> {
      Status st = fn();
      if (!st.ok()) return st;
      return true;
    });
    return r.status();
  }

  // Destructor thread, after the progress thread has been joined.
  void shutdown() {
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

  TransportOptions opt_;
  uint64_t id_;
  std::chrono::microseconds spin_window_;  // spin_after_activity (or FERRY_UCX_SPIN_US)
  std::chrono::microseconds busy_spin_ = kBusySpin;  // or FERRY_UCX_BUSY_SPIN_US
  // FERRY_UCX_EP_INFO=1: print each endpoint's UCX configuration (lanes) after its
  // first completed read/write (diagnostics).
  const bool debug_ep_info_ = std::getenv("FERRY_UCX_EP_INFO") != nullptr;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<std::byte> address_;
  AtomicStats stats_;

  std::thread thread_;
  std::atomic<std::thread::id> progress_tid_{};
  std::mutex cmd_mu_;
  std::condition_variable cmd_cv_;
  std::deque<std::function<void()>> cmds_;
  bool stop_ = false;
  std::atomic<bool> sleeping_{false};
  // Serialises every use of the (single-threaded) UCP worker: the progress thread holds
  // it while it runs commands and progresses; rma() callers take it to post directly.
  // Lock order: worker_mu_, then mu_, then cmd_mu_.
  std::mutex worker_mu_;
  std::atomic<uint64_t> direct_posts_{0};  // operations left in flight by direct posts (see kick)
  int efd_ = -1;  // the worker's event fd (UCP_FEATURE_WAKEUP), -1: timed naps
  std::atomic<int> watched_{0};  // peers with `watched` set (never decremented: only a hint)
  std::atomic<bool> warned_unsafe_shm_{false};  // the mode-NONE control warning was printed
  bool shm_transports_ = false;  // the context has a transport that maps peers' memory (init)
  Clock::time_point next_watch_{};

  std::mutex mu_;  // tables and handlers
  std::map<uint64_t, Region> regions_;
  uint64_t next_region_ = 1;
  std::map<PeerId, std::shared_ptr<Peer>> peers_;
  std::map<uint64_t, Key> keys_;
  uint64_t next_key_ = 1;
  std::shared_ptr<const MessageHandler> message_handler_;
  std::shared_ptr<const PeerFailureHandler> failure_handler_;
  std::map<uint64_t, ucs_status_t> refused_writes_;  // writer id -> refused WRITE since its last flush
  std::mutex handler_mu_;  // held while a handler runs (set_* waits for a running one)

  // Progress thread only.
  struct Inflight {
    const Peer* peer;
    std::function<void(ucs_status_t)> fn;
  };
  std::unordered_map<uint64_t, Inflight> inflight_;
  std::unordered_map<uint64_t, AmRead> am_reads_;  // reads by message, by op id
  std::unordered_set<uint64_t> am_flushes_;        // flushes by message, by op id
  std::unordered_map<uint64_t, int> region_sends_;  // region id -> zero-copy READ_DATA sends in flight
  std::unordered_map<uint64_t, ucp_mem_h> dying_;   // deregistered, unmapped when its sends complete
  uint64_t next_op_ = 1;
};

}  // namespace

Result<std::unique_ptr<TransportBackend>> make_ucx_backend(const TransportOptions& options) {
  auto b = std::make_unique<UcxBackend>(options);
  FERRY_RETURN_IF_ERROR(b->init());
  return std::unique_ptr<TransportBackend>(std::move(b));
}

}  // namespace ferry::detail
