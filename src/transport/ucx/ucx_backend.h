// transport/ucx/ucx_backend.h — the UCX backend (internal): UCP RMA (get/put) for read/write, active messages for control
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
//    the tcp_control param is off (config.h).
//  * Where UCX_TLS still offers no transport with peer-failure support to a peer,
//    and the peer is a process on this host (same boot id and PID namespace, carried in
//    the address), the single endpoint is created in mode NONE and ferry watches the
//    peer's process through a pidfd: its exit is reported exactly like a UCX endpoint
//    error. Messages then go over shared memory, and the FIFO risk above remains (the
//    transport says so once, on stderr).
#pragma once

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

#include "transport/auth.h"
#include "transport/backend.h"
#include "transport/ucx/config.h"
#include "transport/wire.h"

namespace ferry::detail::ucx {

namespace wire = ferry::transport_wire;
using Clock = std::chrono::steady_clock;

inline constexpr unsigned kAmId = 0x4652;        // "FR": control messages (send)
// ferry's own get/put where UCX would emulate them, see "RMA by message" below.
inline constexpr unsigned kAmReadReq = 0x4653;
inline constexpr unsigned kAmReadData = 0x4654;
inline constexpr unsigned kAmWrite = 0x4655;
inline constexpr unsigned kAmFlushReq = 0x4656;
inline constexpr unsigned kAmFlushAck = 0x4657;
inline constexpr unsigned kAmHandshake = 0x4658;  // the token handshake (handshake.cpp)
// Handshakes answered but not finished (HELLO seen, no PROOF yet) kept at most; the
// oldest is dropped beyond it, so unauthenticated peers cannot grow the table.
inline constexpr size_t kMaxPendingAccepts = 256;
inline constexpr uint32_t kReadMagic = 0x46524452;  // "FRDR"
// RMA by message. A READ_DATA reply carries at most kReadChunk bytes: with its headers
// it fits one tcp active-message fragment (UCX 1.13: am_zcopy <= 64 KiB), so the reader
// gets it in UCX's receive buffer and copies it into place once; a longer message is
// sent in fragments that UCX first reassembles in a buffer of its own (one copy more).
// A target keeps at most kReadWindow replies of one read in flight (~1 MiB).
inline constexpr uint64_t kReadChunk = (64 << 10) - 512;
inline constexpr int kReadWindow = 16;
// A WRITE message carries at most this much (UCX fragments it; writes were at or above
// ucx_perftest's put with it, docs/RESULTS.md).
inline constexpr uint64_t kWriteChunk = 1 << 20;
// True while a caller thread runs an operation directly on the worker (see rma()).
inline thread_local bool direct_caller = false;
// Control calls (connect, register, ...) wait at most this long for the progress thread.
inline constexpr auto kControlTimeout = std::chrono::seconds(30);
// Without an event fd the progress thread sleeps in slices of kIdleSleep (commands wake
// it at once) once the spin_us param has passed.
inline constexpr auto kIdleSleep = std::chrono::microseconds(500);
// Longest sleep on the worker's event fd (wake-ups come from UCX events or posts).
inline constexpr auto kMaxSleep = std::chrono::milliseconds(100);
// With operations in flight the progress thread spins at most UcxConfig::busy_spin
// (kBusySpin by default, config.h), then sleeps on the event fd at most kBusySleep.
inline constexpr auto kBusySleep = std::chrono::milliseconds(1);
// How often watched peer processes (see below) are polled.
inline constexpr auto kWatchInterval = std::chrono::milliseconds(20);

// A ucs_status_t as a Status: `what` and UCX's text, with ferry's code for it.
Status from_ucs(ucs_status_t st, const std::string& what);


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
  // The token handshake with this peer (we connected) finished: it proved the token
  // and accepted ours (progress thread).
  bool authenticated = false;
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
  bool exported = false;  // export_key was called: only then is it served by message
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
  int32_t refusal = 0;          // non-zero: answer only this status (an unauthenticated reader)
};

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

// The token handshake (handshake.cpp), progress thread only. As connector: one per
// peer we connect to, until its ACCEPT or REFUSE.
struct PendingConnect {
  transport_auth::Nonce nonce{};
  bool proved = false;  // the acceptor's CHALLENGE carried a valid proof; our PROOF is sent
  std::vector<std::shared_ptr<OpState>> waiters;  // connect() calls waiting for the verdict
};
// As acceptor: one per endpoint whose HELLO we answered, until its PROOF.
struct PendingAccept {
  uint64_t connector = 0;
  transport_auth::Nonce connector_nonce{}, acceptor_nonce{};
  uint64_t seq = 0;  // arrival order (the oldest is dropped at kMaxPendingAccepts)
};

// Progress thread only.
struct Inflight {
  const Peer* peer;
  std::function<void(ucs_status_t)> fn;
};

// One UCX worker and its progress thread. The methods are defined by topic:
// ucx_backend.cpp (init, memory, keys, read/write, send, flush, shutdown),
// endpoints.cpp, rma_by_message.cpp, progress.cpp, peer_watch.cpp.
class UcxBackend final : public TransportBackend {
 public:
  UcxBackend(const TransportOptions& options, UcxConfig config)
      : opt_(options), id_(new_instance_id()), cfg_(std::move(config)) {}

  std::string_view name() const override { return "ucx"; }
  PeerId id() const override { return id_; }
  std::vector<std::byte> address() const override { return address_; }
  TransportStats stats() const override { return stats_.snapshot(); }
  bool supports_memory(MemoryKind kind) const override;
  std::string memory_support() const override;
  // The TransportBackend interface (and init, for create()).
  Status init();
  ~UcxBackend() override;
  Result<MemoryRegion> register_memory(void* base, uint64_t length, MemoryKind kind) override;
  Result<MemoryRegion> allocate_memory(uint64_t length, MemoryKind kind) override;
  Status deregister_memory(const MemoryRegion& region) override;
  Result<std::vector<std::byte>> export_key(const MemoryRegion& region) override;
  Result<RemoteRegion> import_key(std::span<const std::byte> bytes) override;
  Status release_key(const RemoteRegion& remote) override;
  Result<RmaPath> rma_path(const RemoteRegion& remote) const override;
  Result<Completion> rma(bool is_write, const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                         uint64_t remote_offset, uint64_t length, CompletionCallback on_done) override;
  Result<Completion> flush(PeerId id, CompletionCallback on_done) override;
  Result<Completion> send(PeerId id, uint32_t tag, std::span<const std::byte> payload,
                          CompletionCallback on_done) override;
  void set_message_handler(MessageHandler handler) override;
  void set_peer_failure_handler(PeerFailureHandler handler) override;
  Status simulate_crash() override;
  Result<PeerId> connect(std::span<const std::byte> bytes) override;
  Status disconnect(PeerId id) override;

 private:
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
  // Shared-memory transports that map a peer's memory: native get/put on its segments,
  // and a receive FIFO for messages (cma and knem serve UCX's rendezvous only).
  static bool maps_peer_memory(std::string_view tl) { return tl == "posix" || tl == "sysv" || tl == "xpmem"; }
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

  // ---- ucx_backend.cpp -------------------------------------------------------
  Result<MemoryRegion> map_memory(void* base, uint64_t length, MemoryKind kind, bool allocate);
  bool start_rma(const RmaOp& r);
  void rma_done(const RmaOp& r, ucs_status_t st);
  void complete_op(const std::shared_ptr<OpState>& state, Status st);
  Result<Completion> flush_ep(PeerId id, bool control, CompletionCallback on_done);
  static ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param);
  void shutdown();

  // ---- endpoints.cpp ---------------------------------------------------------
  Result<PeerId> create_ep(wire::Address a);
  bool context_has_shared_memory();
  // The context's transports that move CUDA memory (cuda_copy, cuda_ipc, gdr_copy), as
  // ucp_context_print_info lists them; "" for a UCX built without CUDA.
  std::string context_cuda_transports();
  static std::string ep_info(ucp_ep_h ep);
  static std::vector<std::string> lane_transports(const std::string& info);
  static bool is_shared_memory_transport(std::string_view tl);
  static bool rma_lanes_only_shared_memory(const std::string& info);
  static bool no_get_lane(const std::string& info);
  bool peer_usable(const Peer& p);
  Result<std::shared_ptr<Peer>> usable_peer(PeerId id, const char* op);
  static void ep_err_cb(void* arg, ucp_ep_h, ucs_status_t status);
  void on_peer_failure(Peer* raw, const std::string& reason);
  void close_ep(const std::shared_ptr<Peer>& p, bool flush);
  void close_one(const std::shared_ptr<Peer>& p, ucp_ep_h ep, bool force);

  // ---- rma_by_message.cpp ----------------------------------------------------
  ucp_request_param_t eager_params();
  bool start_read_by_message(const RmaOp& r);
  static ucs_status_t read_req_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                  const ucp_am_recv_param_t* param);
  void pump_reply(const std::shared_ptr<ReadReply>& rp);
  TargetRange check_target_range(uint64_t region, uint64_t addr, uint64_t length);
  void region_send_done(uint64_t region);
  bool start_write_by_message(const RmaOp& r);
  static ucs_status_t write_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  void start_flush_by_message(const std::shared_ptr<Peer>& peer, std::function<void(ucs_status_t)> done);
  std::pair<ucp_ep_h, std::shared_ptr<Peer>> answer_ep(uint64_t sender, const ucp_am_recv_param_t* param);
  static ucs_status_t flush_req_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                   const ucp_am_recv_param_t* param);
  static ucs_status_t flush_ack_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                   const ucp_am_recv_param_t*);
  static ucs_status_t read_data_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param);

  // ---- handshake.cpp ---------------------------------------------------------
  Status handshake(PeerId id);
  static ucs_status_t handshake_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                   const ucp_am_recv_param_t* param);
  void on_hello(const wire::Handshake& h, ucp_ep_h reply_ep);
  void on_proof(const wire::Handshake& h, ucp_ep_h reply_ep);
  // A wrong proof (a wrong token, or guessing): counted (stats) and said on stderr at most
  // once per kWrongProofLogEvery, with how many came since the last line, as the store
  // does for its own handshake (issue 49, finding 8). Progress thread.
  void note_wrong_proof(uint64_t claimed_sender);
  static constexpr std::chrono::seconds kWrongProofLogEvery{10};
  uint64_t wrong_proofs_unlogged_ = 0;
  std::chrono::steady_clock::time_point wrong_proofs_logged_{};
  void on_challenge(const wire::Handshake& h, ucp_ep_h reply_ep);
  void on_verdict(const wire::Handshake& h, ucp_ep_h reply_ep);
  void send_handshake(ucp_ep_h ep, const wire::Handshake& h, const std::shared_ptr<Peer>& peer);
  void end_connect(PeerId id, Status st);
  // Whether a message, read, write or flush that arrived with `param` may be served:
  // no token, or it came on an endpoint that proved it for `claimed` (the sender id in
  // the message). Counts a refusal. Progress thread.
  bool authorized(const ucp_am_recv_param_t* param, uint64_t claimed);
  void forget_authentication(PeerId id);

  // ---- progress.cpp ----------------------------------------------------------
  bool post(std::function<void()> fn);
  void wake();
  void kick();
  void run();
  uint64_t track(const Peer* peer, std::function<void(ucs_status_t)> fn);
  void finish(uint64_t id, ucs_status_t st);
  void fail_inflight(const Peer* peer);
  void settle(uint64_t op_id, ucs_status_ptr_t r);
  static void send_cb(void* request, ucs_status_t status, void* user_data);
  Status run_status(std::function<Status()> fn);

  // ---- peer_watch.cpp --------------------------------------------------------
  static bool local_process_exited(const wire::Address& a);
  static bool process_exited(const Peer& p);
  void check_watched_processes();

  TransportOptions opt_;
  uint64_t id_;
  UcxConfig cfg_;  // the params and FERRY_UCX_* variables, parsed (config.h)
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
  uint64_t memory_types_ = 0;    // UCP_ATTR_FIELD_MEMORY_TYPES of the context (init)
  std::string cuda_transports_;  // the context's transports on CUDA memory, ", "-joined (init)
  Clock::time_point next_watch_{};
  mutable std::mutex mu_;  // tables and handlers
  std::map<uint64_t, Region> regions_;
  uint64_t next_region_ = 1;
  std::map<PeerId, std::shared_ptr<Peer>> peers_;
  std::map<uint64_t, Key> keys_;
  uint64_t next_key_ = 1;
  std::shared_ptr<const MessageHandler> message_handler_;
  std::shared_ptr<const PeerFailureHandler> failure_handler_;
  std::map<uint64_t, ucs_status_t> refused_writes_;  // writer id -> refused WRITE since its last flush
  std::mutex handler_mu_;  // held while a handler runs (set_* waits for a running one)
  std::unordered_map<uint64_t, Inflight> inflight_;
  std::unordered_map<uint64_t, AmRead> am_reads_;  // reads by message, by op id
  std::unordered_set<uint64_t> am_flushes_;        // flushes by message, by op id
  std::unordered_map<uint64_t, int> region_sends_;  // region id -> zero-copy READ_DATA sends in flight
  std::unordered_map<uint64_t, ucp_mem_h> dying_;   // deregistered, unmapped when its sends complete
  uint64_t next_op_ = 1;
  // The token handshake (progress thread only): endpoints that proved the token, as the
  // other side of a handshake (acceptor: its PROOF; connector: its CHALLENGE), to the
  // instance id they proved it for; handshakes in progress.
  std::unordered_map<ucp_ep_h, PeerId> authenticated_eps_;
  std::map<PeerId, PendingConnect> connects_;
  std::unordered_map<ucp_ep_h, PendingAccept> accepts_;
  uint64_t accept_seq_ = 0;
};

}  // namespace ferry::detail::ucx
