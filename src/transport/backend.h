// transport/backend.h — what a transport backend implements (internal). The public
// ferry::Transport is a final class forwarding to one of these (tensorpipe style).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

#include "ferry/transport.h"

namespace ferry::detail {

// Shared state behind a Completion. complete() runs the callback first, then marks
// the op done and wakes waiters, so "wait() returned" implies "callback has run".
class OpState {
 public:
  OpState(CompletionCallback cb, const std::atomic<std::thread::id>* progress_thread)
      : cb_(std::move(cb)), progress_thread_(progress_thread) {}

  // First call wins; later calls are ignored. Returns whether this call completed it.
  bool complete(Status status) {
    if (completing_.exchange(true)) return false;
    if (cb_) {
      cb_(status);
      cb_ = nullptr;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(status);
      done_ = true;
    }
    cv_.notify_all();
    return true;
  }

  // Set at construction and only cleared by complete(): safe to ask before completion.
  bool has_callback() const { return !completing_.load() && static_cast<bool>(cb_); }

  bool done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  Status wait(std::chrono::milliseconds timeout) const {
    std::unique_lock<std::mutex> lock(mu_);
    if (done_) return status_;
    if (progress_thread_ != nullptr && progress_thread_->load() == std::this_thread::get_id()) {
      return failed_precondition("Completion::wait called on the transport's progress thread (would deadlock)");
    }
    const auto start = std::chrono::steady_clock::now();
    if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
      return timeout_error("operation still pending after {} ms",
                           std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start)
                               .count());
    }
    return status_;
  }

  Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) return failed_precondition("operation still pending");
    return status_;
  }

 private:
  CompletionCallback cb_;
  const std::atomic<std::thread::id>* progress_thread_;
  std::atomic<bool> completing_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

class TransportBackend {
 public:
  virtual ~TransportBackend() = default;
  virtual std::string_view name() const = 0;
  virtual PeerId id() const = 0;
  virtual std::vector<std::byte> address() const = 0;
  virtual Result<PeerId> connect(std::span<const std::byte> address) = 0;
  virtual Status disconnect(PeerId peer) = 0;
  virtual Result<MemoryRegion> register_memory(void* base, uint64_t length, MemoryKind kind) = 0;
  virtual Result<MemoryRegion> allocate_memory(uint64_t length, MemoryKind kind) = 0;
  virtual Status deregister_memory(const MemoryRegion& region) = 0;
  virtual Result<std::vector<std::byte>> export_key(const MemoryRegion& region) = 0;
  virtual Result<RemoteRegion> import_key(std::span<const std::byte> key) = 0;
  virtual Status release_key(const RemoteRegion& remote) = 0;
  virtual Result<RmaPath> rma_path(const RemoteRegion& remote) const = 0;
  // is_write: local -> remote; else remote -> local.
  virtual Result<Completion> rma(bool is_write, const MemoryRegion& local, uint64_t local_offset,
                                 const RemoteRegion& remote, uint64_t remote_offset, uint64_t length,
                                 CompletionCallback on_done) = 0;
  virtual Result<Completion> flush(PeerId peer, CompletionCallback on_done) = 0;
  virtual Result<Completion> send(PeerId peer, uint32_t tag, std::span<const std::byte> payload,
                                  CompletionCallback on_done) = 0;
  virtual void set_message_handler(MessageHandler handler) = 0;
  virtual void set_peer_failure_handler(PeerFailureHandler handler) = 0;
  virtual Status simulate_crash() = 0;
  // Whether this side can still send and be reached (Transport::health). Default: ok.
  virtual Status health() const { return Status::Ok(); }
  virtual bool supports_memory(MemoryKind kind) const = 0;
  virtual std::string memory_support() const = 0;
  virtual TransportStats stats() const = 0;
};

// Overflow-safe: [offset, offset + length) inside [0, region_length).
inline Status check_range(std::string_view op, std::string_view side, uint64_t offset, uint64_t length,
                          uint64_t region_length) {
  if (offset > region_length || length > region_length - offset) {
    return out_of_range("{}: {} range [{}, {} + {}) is outside the {}-byte region", op, side, offset, offset,
                        length, region_length);
  }
  return Status::Ok();
}

// A random, non-zero 64-bit instance id (random_device, pid and clock mixed).
uint64_t new_instance_id();

// Counters shared by the backends.
struct AtomicStats {
  std::atomic<uint64_t> reads{0}, writes{0}, sends{0}, bytes_read{0}, bytes_written{0};
  std::atomic<uint64_t> messages_received{0}, malformed_messages{0}, dropped_messages{0}, failed_peers{0};
  std::atomic<uint64_t> reads_by_message{0}, writes_by_message{0}, shared_memory_message_peers{0};
  std::atomic<uint64_t> refused_unauthenticated{0}, refused_region{0}, refused_bounds{0}, authenticated_peers{0};
  TransportStats snapshot() const {
    TransportStats s;
    s.reads = reads;
    s.writes = writes;
    s.sends = sends;
    s.bytes_read = bytes_read;
    s.bytes_written = bytes_written;
    s.messages_received = messages_received;
    s.malformed_messages = malformed_messages;
    s.dropped_messages = dropped_messages;
    s.failed_peers = failed_peers;
    s.reads_by_message = reads_by_message;
    s.writes_by_message = writes_by_message;
    s.shared_memory_message_peers = shared_memory_message_peers;
    s.refused_unauthenticated = refused_unauthenticated;
    s.refused_region = refused_region;
    s.refused_bounds = refused_bounds;
    s.authenticated_peers = authenticated_peers;
    return s;
  }
};

// One entry of the backend registry (transport.cpp), provided by each backend's own
// directory: what it accepts, the values it would use, whether those move bytes over
// shared memory, and how to start it. resolve, shared_memory and create validate
// options.params (check_params, then the values).
struct BackendEntry {
  const BackendInfo& (*info)();
  Result<TransportParams> (*resolve)(const TransportParams& params);
  Result<bool> (*shared_memory)(const TransportParams& params);
  Result<std::unique_ptr<TransportBackend>> (*create)(const TransportOptions& options);
};
const BackendEntry& inproc_backend_entry();
const BackendEntry& ucx_backend_entry();

// kInvalidArgument for the first param `info` does not declare, naming it and listing
// the backend's options.
Status check_params(const BackendInfo& info, const TransportParams& params);
// kInvalidArgument for a malformed value of param `name` ("expected ...").
Status bad_param(const BackendInfo& info, std::string_view name, std::string_view value, std::string_view expected);
// The names of `info`'s options, for messages: "tls, net_devices, ucx.<KEY>".
std::string option_list(const BackendInfo& info);

}  // namespace ferry::detail
