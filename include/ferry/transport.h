// ferry/transport.h — one-sided reads and writes of registered memory, small tagged
// control messages and peer-failure notification, behind one interface.
//
// Backends (chosen by name in TransportOptions::backend, see Transport::create):
//   "ucx"     UCP RMA (get/put) + active messages over whatever UCX_TLS allows on the
//             host (shm/cma, tcp, rdma verbs). Ranks are processes (or hosts).
//   "inproc"  ranks are threads of one process; read/write are memcpy between
//             registered regions, with the same semantics and checks as "ucx", plus
//             failure injection (Transport::simulate_crash) for tests.
//
// Vocabulary
//   * A Transport is one endpoint of the data plane: one UCX worker (one progress
//     thread) per Transport. Every Transport has a random 64-bit instance id; its
//     address() bytes carry it, and connect() to those bytes returns it as the PeerId.
//     So the PeerId a message handler is given for a sender equals what connect()
//     returns for that sender's address, in every process.
//   * A MemoryRegion is local memory registered with register_memory(). Only
//     registered memory can be the local side of read/write or be exposed to peers.
//   * export_key(region) yields bytes (a "remote key") that a peer passes to
//     import_key() to obtain a RemoteRegion: the right to read/write that region.
//     A key carries the owner's instance id, the region's base and length: the
//     importer refuses any access outside [0, length) *before* posting it. The
//     in-process backend checks the target side again (region still registered,
//     range inside it); UCX relies on its rkey checks there.
//
// Ownership
//   * Transport::create returns a unique_ptr; destroying the Transport stops its
//     progress thread, closes every endpoint (waiting at most close_timeout for
//     in-flight operations to drain), completes every still-pending operation with
//     kCancelled, deregisters every region and releases every imported key.
//   * MemoryRegion / RemoteRegion are small value handles (ids plus bounds). Using a
//     handle after deregister_memory/release_key, or a handle of another Transport,
//     fails with kNotFound — never undefined behaviour. The *memory* behind a region
//     is the caller's: it must stay valid until deregister_memory returns, and must
//     not be deregistered while operations on it are in flight.
//   * Payloads of send() are copied before send() returns; the buffer may be reused.
//     The local buffer of read()/write() belongs to the transport until completion.
//
// Completion
//   read/write/send/flush return Result<Completion>. An error Result means nothing was
//   posted (bad argument, range outside the region, unknown or failed peer) and the
//   callback will never run. Otherwise the operation is in flight: its Completion
//   becomes done exactly once, and the optional callback runs exactly once, on this
//   Transport's progress thread, never inline inside the call that posted it. Any
//   number of operations may be outstanding at once, to any number of peers.
//   * read completes when the bytes are in local memory.
//   * write completes when the local buffer may be reused. The bytes are NOT
//     guaranteed visible at the target yet: call flush(peer) and wait for it; every
//     write to that peer posted before flush() is then visible to the target.
//     (UCX's put completion is local; its ep flush is what makes writes remote-visible.)
//     To tell the target "your data is there": write... -> flush -> wait -> send.
//   * send completes when the payload has left the local buffer (not when handled).
//   * Operations on one peer are not ordered with respect to each other, except
//     as stated for flush.
//
// Threading and progress
//   * Every method is thread-safe and may be called from any thread, including from
//     inside callbacks and handlers. The transport has one progress thread, started by
//     create(): it drives UCX (or runs in-process copies), runs completion callbacks,
//     the message handler and the peer-failure handler, one at a time. Callbacks and
//     handlers must not block waiting for another operation of the same Transport
//     (Completion::wait from the progress thread returns kFailedPrecondition at once
//     instead of deadlocking); they may post new operations.
//   * Remote progress: where UCX has no native RMA to a peer (tcp), ferry reads and
//     writes by active messages (UCX's own emulation aborts the target process when
//     the initiator dies mid-operation), so the *target* must progress too. The
//     progress thread does that for as long as the Transport lives; the application
//     never has to call a progress function. Results and checks are the same either
//     way; the target also checks every such access against its registered region.
//   * read()/write() may post from the calling thread when the worker is free; they
//     never wait for the progress thread.
//   * After a pass that made no progress, the progress thread sleeps until UCX reports
//     an event or an operation is posted (UCX event fd; timed naps of 0.5 ms where there
//     is none): at once while operations are in flight (at most 1 ms per sleep;
//     the ucx param busy_spin_us spins that long first), after spin_us when idle. So an idle Transport costs no CPU, and a busy one leaves the cores to the
//     threads with work (ranks often outnumber cores).
//
// Messages
//   send(peer, tag, payload) delivers payload (at most max_message_bytes) to the
//   peer's message handler with this Transport's instance id as `from`. Messages to
//   one peer from one sender are delivered in order. Incoming messages whose framing
//   is malformed (bad magic/version, length disagreeing with the frame) are dropped
//   and counted (stats().malformed_messages), never handed to the handler. The
//   handler's payload view is valid only during the call. A message that arrives while
//   no handler is set is dropped (counted in stats().dropped_messages).
//
// Errors and peer failure
//   * Codes: kInvalidArgument (malformed argument), kOutOfRange (range outside a region),
//     kNotFound (unknown region/key/peer handle), kCorrupt (malformed address or key
//     bytes), kPeerFailed (peer died or its endpoint broke), kTimeout (bounded wait
//     ran out), kCancelled (transport destroyed with the operation pending),
//     kUnimplemented (memory kind or feature this backend lacks), kUnavailable
//     (backend could not start, e.g. UCX found no usable transport).
//   * When an endpoint to a connected peer fails (peer process SIGKILLed, connection
//     reset, keepalive timeout), the peer-failure handler runs once for that peer with
//     the reason; every in-flight operation to it completes with an error, and every
//     later operation on it is refused with kPeerFailed. A failed peer stays failed;
//     a restarted peer has a new instance id and is connected afresh. Only peers this
//     Transport connect()ed to are watched.
//   * Detection time is bounded by the backend: immediate for inproc; for UCX the
//     broken connection is seen by UCX (tcp: at once; otherwise UCX keepalive, set to
//     the ucx param keepalive_ms). UCX: every message to a peer goes on an
//     endpoint with peer-failure support (tcp on one host); a peer on this host is also
//     read and written over shared memory on a second endpoint that carries no message
//     (UCX 1.13's shared-memory receive queue can be wedged by a sender killed mid-send;
//     docs/transport.md; tls sm,self gets tcp added, see the ucx param tcp_control). Where
//     there is still no transport with peer-failure support to a peer on this host,
//     messages go over shared memory and ferry watches the process itself (pidfd, exit
//     reported within ~20 ms), with that risk (warned on stderr); a remote peer without
//     such a transport is refused at connect.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry {

// Where the bytes of a region live. kHost: every backend. kCuda: only a backend whose
// supports_memory(kCuda) says so (ucx over a UCX with CUDA memory support; see there);
// the kind travels in key bytes, so both ends know what a region holds.
enum class MemoryKind : uint8_t {
  kHost = 0,
  kCuda = 1,
};
const char* memory_kind_name(MemoryKind kind);

// How the bytes of a read or write reach an imported region (Transport::rma_path).
enum class RmaPath : uint8_t {
  kNative = 0,     // the backend's own get/put
  kByMessage = 1,  // messages the owner serves (ferry's RMA emulation)
};
const char* rma_path_name(RmaPath path);

// A connected peer: the remote Transport's instance id (see the vocabulary above).
using PeerId = uint64_t;

// A backend's own options, by name, passed through by generic code unchanged. Each
// backend declares what it accepts (Transport::backend_info; docs/transport.md) and
// Transport::create refuses an unknown or malformed one with kInvalidArgument naming it
// and listing the backend's options.
using TransportParams = std::map<std::string, std::string>;

struct TransportOptions {
  // "ucx" or "inproc" (Transport::backends() lists what this build has).
  std::string backend = "ucx";
  // Options of that backend, e.g. for "ucx" {{"tls", "sm,tcp,self"}, {"net_devices", "lo"}}
  // (src/transport/ucx/config.h). "inproc" has none.
  TransportParams params;
  // Largest payload send() accepts (and a receiver hands to its handler).
  size_t max_message_bytes = 64 * 1024;
  // How long the destructor / disconnect waits for endpoints to flush and close.
  std::chrono::milliseconds close_timeout{2000};
  // The job's shared secret (the store's token). Set: every connection runs a
  // challenge-response handshake (HMAC-SHA256 over nonces of both sides) in connect(),
  // each side proving the token to the other, and this transport serves messages,
  // reads, writes and flushes only to peers that proved it (to anyone else: refused,
  // stats().refused_unauthenticated). connect() fails with kPermissionDenied when the
  // peer refuses our proof or cannot prove the token itself. Every backend honours it.
  // Empty (the default): no handshake, every peer is served — for tests and one-user
  // machines only; production should set it (docs/transport.md, "Authentication").
  // When set, at least kMinTransportTokenBytes long (Transport::create refuses less).
  std::string token;
};

// Shortest TransportOptions::token accepted: 16 bytes, the store's kMinTokenBytes (the
// same secret serves both).
inline constexpr size_t kMinTransportTokenBytes = 16;

// One option a backend accepts in TransportOptions::params.
struct BackendOption {
  // The param's name; a name ending in '.' is a prefix: "ucx." stands for every
  // "ucx.<KEY>".
  std::string name;
  std::string default_value;  // as a param string; empty: unset (see doc)
  std::string doc;            // one line
};

// What Transport::backend_info says about a backend.
struct BackendInfo {
  std::string name;
  std::string doc;  // one line
  std::vector<BackendOption> options;
  // Whether `param` names one of `options` (a prefix option covers every name it starts).
  bool accepts(std::string_view param) const;
};

// A locally registered region: value handle. Offsets in read/write are relative to
// `base`.
struct MemoryRegion {
  uint64_t id = 0;
  void* base = nullptr;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// A peer's region, imported from its key bytes: value handle.
struct RemoteRegion {
  uint64_t id = 0;      // local handle of the imported key
  PeerId peer = 0;      // the owner
  uint64_t base = 0;    // the owner's address (informational; offsets are relative)
  uint64_t length = 0;  // accesses must stay inside [0, length)
  MemoryKind kind = MemoryKind::kHost;
};

using CompletionCallback = std::function<void(const Status&)>;
// Runs on the progress thread; `payload` is valid only during the call.
using MessageHandler = std::function<void(PeerId from, uint32_t tag, std::span<const std::byte> payload)>;
// Runs on the progress thread, once per failed peer.
using PeerFailureHandler = std::function<void(PeerId peer, const Status& why)>;

namespace detail {
class OpState;
class TransportBackend;
}  // namespace detail

// The future-like handle of one posted operation. Cheap to copy (shared state).
class Completion final {
 public:
  Completion() = default;  // an empty handle: done() is false, wait() fails at once
  bool valid() const { return state_ != nullptr; }
  bool done() const;
  // Waits at most `timeout` for the operation; kTimeout if it is still pending then
  // (the operation itself goes on). The operation's Status once done.
  Status wait(std::chrono::milliseconds timeout) const;
  // The operation's Status when done; kFailedPrecondition while pending.
  Status status() const;

  explicit Completion(std::shared_ptr<detail::OpState> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<detail::OpState> state_;
};

// Waits for every completion, in total at most `timeout`. The first error (in order of
// `ops`), or kTimeout naming how many are still pending.
Status wait_all(std::span<const Completion> ops, std::chrono::milliseconds timeout);

struct TransportStats {
  uint64_t reads = 0, writes = 0, sends = 0;          // operations posted
  uint64_t bytes_read = 0, bytes_written = 0;         // bytes of completed ok ops
  uint64_t messages_received = 0;
  uint64_t malformed_messages = 0, dropped_messages = 0;
  uint64_t failed_peers = 0;
  // Reads/writes carried by messages instead of native get/put (UCX: over tcp, or to a
  // region that a shared-memory data endpoint cannot map; see docs/transport.md).
  uint64_t reads_by_message = 0, writes_by_message = 0;
  // Peers connected so far whose messages travel over shared memory: UCX offered no
  // transport with peer-failure support to them, and a peer killed mid-send can then
  // wedge this process's receive queue (UCX 1.13; see the ucx param tcp_control). 0 is the goal.
  uint64_t shared_memory_message_peers = 0;
  // What this transport refused to serve as a target (docs/transport.md,
  // "Authentication"): a message, read, write, flush or handshake from a peer that did
  // not prove the token (or failed the handshake); a read/write naming a region that
  // was never exported (export_key) or is deregistered; one outside its region's bounds.
  uint64_t refused_unauthenticated = 0, refused_region = 0, refused_bounds = 0;
  // Connections that proved the token to this transport (as acceptor).
  uint64_t authenticated_peers = 0;
};

class Transport final {
 public:
  // The factory: builds the backend named by options.backend, starts its progress
  // thread. kNotFound for an unknown backend name, kInvalidArgument for a param the
  // backend does not declare or a malformed value (the message names the param and
  // lists the backend's options) or a token shorter than kMinTransportTokenBytes,
  // kUnavailable when the backend cannot start (e.g. UCX
  // has no transport for the given tls).
  static Result<std::unique_ptr<Transport>> create(const TransportOptions& options);
  // Backend names this build supports, from the backend registry: {"inproc", "ucx"}.
  static std::vector<std::string> backends();
  // A backend's options (name, default, doc); kNotFound for an unknown backend.
  static Result<BackendInfo> backend_info(std::string_view backend);
  // The value of every option of `backend` that create() would use with `params`: the
  // backend's defaults, overridden by `params`, and by its environment variables where
  // the backend documents them (ucx: FERRY_UCX_*). Errors as create(). Starts nothing.
  static Result<TransportParams> resolve_params(std::string_view backend, const TransportParams& params);
  // Whether a transport of `backend` created with `params` would move bytes between
  // processes of one host over shared memory, as its configuration says (not whether
  // this host has such a transport). ucx: the UCX_TLS in force (the tls param or its
  // default, else UCX_TLS, else UCX's own: all) lists a shared-memory transport (sm,
  // shm, mm, posix, sysv, cma, xpmem, knem, or all), or is an exclusion list naming none
  // of them; inproc: always (one process). Errors as resolve_params. Starts nothing.
  static Result<bool> moves_bytes_over_shared_memory(std::string_view backend, const TransportParams& params);

  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  std::string_view backend() const;
  // This transport's instance id (what peers get back from connect()).
  PeerId id() const;
  // Opaque bytes a peer passes to connect() (for UCX: a versioned frame around the
  // UCP worker address). Publish them through the store.
  std::vector<std::byte> address() const;

  // Connects to the transport whose address() is `address`. Idempotent: connecting to
  // an already connected peer returns its id again. Connecting to yourself is allowed.
  // kCorrupt for malformed bytes, kInvalidArgument for another backend's address,
  // kPeerFailed when that peer already failed. The endpoint is usable at once
  // (operations queue until it is wired up).
  Result<PeerId> connect(std::span<const std::byte> address);
  // Closes the endpoint (flushing in-flight writes, bounded by close_timeout) and
  // releases every key imported from that peer. No failure handler runs.
  Status disconnect(PeerId peer);

  // Whether this transport can register memory of `kind` and move it (read into it,
  // write from it), as its backend found when it started; detected, never assumed.
  // Host: always. CUDA: ucx where its context lists the CUDA memory type (a UCX built
  // with cuda_copy / cuda_ipc / GPUDirect transports that UCX_TLS enables; Debian's UCX
  // 1.13 is built without them, so ferry stages GPU memory through host memory there);
  // inproc never. Even then, an access to CUDA memory of a peer reached without native
  // get/put (tcp, where ferry emulates RMA by messages copied on the host) is refused.
  bool supports_memory(MemoryKind kind) const;
  // One line on what supports_memory found and why ("host, cuda (cuda_copy, cuda_ipc)";
  // "host only: ... lists no CUDA memory type ...").
  std::string memory_support() const;

  // Registers [base, base + length). kInvalidArgument for a null base or zero length,
  // kUnimplemented for a memory kind the backend lacks (supports_memory).
  Result<MemoryRegion> register_memory(void* base, uint64_t length, MemoryKind kind = MemoryKind::kHost);
  // Allocates `length` bytes already registered with this transport, owned by it and
  // freed by deregister_memory (or the transport's destruction). ucx: allocated by UCX
  // (UCP_MEM_MAP_ALLOCATE); over shared memory the segment is mapped by peers on the
  // same host, which then read/write it with a plain copy instead of a protocol round
  // trip — the fast choice for staging buffers (with UCX 1.13, RMA to user memory
  // registered over sm falls back to software emulation). inproc: page-aligned memory.
  Result<MemoryRegion> allocate_memory(uint64_t length, MemoryKind kind = MemoryKind::kHost);
  // Deregisters (and frees, for allocate_memory regions); kNotFound if it is not
  // registered (any more). Peers' later accesses
  // to it fail (inproc: kNotFound/kOutOfRange; UCX: a remote access error).
  Status deregister_memory(const MemoryRegion& region);

  // The remote key of a registered region, as bytes for a peer's import_key().
  Result<std::vector<std::byte>> export_key(const MemoryRegion& region);
  // Imports a key exported by a peer this transport is connected to. kCorrupt for
  // malformed bytes, kInvalidArgument for another backend's key, kNotFound when the
  // owner is not connected, kPeerFailed when it has failed.
  Result<RemoteRegion> import_key(std::span<const std::byte> key);
  Status release_key(const RemoteRegion& remote);
  // How reads and writes of an imported region travel: natively (the backend's own get
  // and put: UCX's shared-memory, cma or RDMA lanes; inproc's memcpy), or carried by
  // messages that the owner's progress thread serves (UCX over tcp, or a region a
  // shared-memory data endpoint cannot map; see "Remote progress"). Fixed at import.
  // A lane that needs the owner's memory mapped natively (device memory, say) asks
  // this per peer region. kNotFound when `remote` is not imported (any more).
  Result<RmaPath> rma_path(const RemoteRegion& remote) const;

  // Copies `length` bytes from remote [remote_offset, +length) into local
  // [local_offset, +length). Ranges are checked against both regions first
  // (kOutOfRange, overflow-safe). length 0 is allowed and completes at once.
  Result<Completion> read(const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                          uint64_t remote_offset, uint64_t length, CompletionCallback on_done = {});
  // Copies local [local_offset, +length) to remote [remote_offset, +length). See
  // "Completion" for when the bytes are visible at the target (after flush).
  Result<Completion> write(const MemoryRegion& local, uint64_t local_offset, const RemoteRegion& remote,
                           uint64_t remote_offset, uint64_t length, CompletionCallback on_done = {});
  // Completes when every write to `peer` posted before this call is visible there.
  Result<Completion> flush(PeerId peer, CompletionCallback on_done = {});

  // A tagged control message (payload copied; at most max_message_bytes).
  Result<Completion> send(PeerId peer, uint32_t tag, std::span<const std::byte> payload,
                          CompletionCallback on_done = {});
  // Replaces the message handler (empty: drop incoming messages). When called from
  // another thread than the progress thread, it returns only after any running call of
  // the previous handler has returned, so state the old handler used may be freed then.
  void set_message_handler(MessageHandler handler);
  // Replaces the peer-failure handler (same guarantee as set_message_handler).
  void set_peer_failure_handler(PeerFailureHandler handler);

  // Failure injection. inproc: this transport behaves as if its process was SIGKILLed
  // — peers' operations on it fail, peers connected to it get their failure handler,
  // its own calls fail with kFailedPrecondition, it handles no more messages. ucx:
  // kUnimplemented (tests SIGKILL a real process instead).
  Status simulate_crash();
  // Not ok once this side can no longer send or be reached (inproc: after
  // simulate_crash, kFailedPrecondition). The engine probes it while it waits for peers'
  // messages, which a dead transport never delivers and no failing op would reveal.
  // ucx: always ok (its endpoint failures reach the failure handler instead).
  Status health() const;

  TransportStats stats() const;

  explicit Transport(std::unique_ptr<detail::TransportBackend> impl);

 private:
  std::unique_ptr<detail::TransportBackend> impl_;
};

}  // namespace ferry
