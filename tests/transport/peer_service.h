// The remote side of the transport tests: owns a region filled with pattern seed 1,
// answers kEcho/kHash/kFill messages. Runs in a helper process (UCX) or on another
// Transport of the same process (inproc).
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <memory>
#include <thread>

#include "ferry/transport.h"

namespace ferry::transport_test {

class PeerService {
 public:
  // Registers a `bytes`-byte region, connects back to `parent_address` (replies go
  // there) and installs the message handler.
  static Result<std::unique_ptr<PeerService>> start(Transport& transport, uint64_t bytes,
                                                    std::span<const std::byte> parent_address);
  ~PeerService();

  const std::vector<std::byte>& key() const { return key_; }
  bool exit_requested() const { return exit_.load(); }

 private:
  explicit PeerService(Transport& t) : t_(t) {}
  void on_message(PeerId from, uint32_t tag, std::span<const std::byte> payload);
  void rma_loop(std::vector<std::byte> key, bool write, bool wide);
  void send_loop();
  Status copy(std::span<const std::byte> key, bool write, uint64_t offset, uint64_t length);

  Transport& t_;
  std::byte* mem_ = nullptr;
  uint64_t bytes_ = 0;
  MemoryRegion region_;
  std::vector<std::byte> key_;
  PeerId parent_ = 0;
  std::atomic<bool> exit_{false};
  std::atomic<bool> stop_reading_{false};
  std::thread reader_;  // kReadLoop
  std::thread copier_;  // kCopy
  std::atomic<bool> loop_done_{false};  // reader_ has returned from rma_loop
};

}  // namespace ferry::transport_test
