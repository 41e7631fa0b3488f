// Test harness: a local Transport plus a "remote rank" — another Transport on the
// same process (inproc) or a transport_peer child process (ucx) — that owns a region
// filled with pattern seed 1 and answers the protocol.h messages.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>

#include "ferry/transport.h"

namespace ferry::transport_test {

struct BackendCase {
  std::string name;     // test-name suffix
  std::string backend;  // "inproc" | "ucx"
  std::string tls;      // UCX_TLS for ucx
  bool tcp_control = true;  // the ucx param tcp_control
};

TransportOptions options_for(const BackendCase& c);
inline void PrintTo(const BackendCase& c, std::ostream* os) { *os << c.name; }

class Remote {
 public:
  virtual ~Remote() = default;
  PeerId peer = 0;
  RemoteRegion region;
  // inproc: simulate_crash; ucx: SIGKILL the process.
  virtual Status kill() = 0;
};

// Starts the remote rank with a `bytes`-byte region, connects `local` to it and
// imports its key. Bounded: fails with kTimeout rather than waiting forever.
Result<std::unique_ptr<Remote>> spawn_remote(const BackendCase& c, Transport& local, uint64_t bytes);

// Collects messages delivered to a Transport's handler.
class Mailbox {
 public:
  void attach(Transport& t);
  // The payload of the first message with `tag` (older ones with other tags are kept).
  Result<std::vector<std::byte>> wait(uint32_t tag, std::chrono::milliseconds timeout);
  size_t size();
  // kFlood messages received (counted, never queued).
  uint64_t floods() const { return floods_.load(); }

 private:
  struct Msg {
    PeerId from;
    uint32_t tag;
    std::vector<std::byte> payload;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Msg> q_;
  std::atomic<uint64_t> floods_{0};
};

// Memory for large tests (mmap, page aligned, freed on destruction).
class Buffer {
 public:
  explicit Buffer(uint64_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::byte* data() const { return p_; }
  uint64_t size() const { return n_; }

 private:
  std::byte* p_ = nullptr;
  uint64_t n_ = 0;
};

}  // namespace ferry::transport_test
