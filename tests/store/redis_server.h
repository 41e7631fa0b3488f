// Test helper: a private redis-server on a free loopback port, killed by the destructor
// (and by the kernel if the test process dies first: PR_SET_PDEATHSIG).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "ferry/status.h"

namespace ferry::testing {

class RedisServer {
 public:
  // Finds redis-server ($FERRY_REDIS_SERVER, else PATH, else /usr/bin, /usr/sbin), starts
  // it with `--requirepass token` and no persistence, and waits until it answers PING.
  // Fails with a message that says how to install it when it is missing.
  static Result<std::unique_ptr<RedisServer>> start(const std::string& token);
  ~RedisServer();  // SIGTERM, then SIGKILL after 2 s; always reaps the child

  int port() const { return port_; }
  pid_t pid() const { return pid_; }

 private:
  RedisServer(pid_t pid, int port, std::string log) : pid_(pid), port_(port), log_(std::move(log)) {}
  pid_t pid_;
  int port_;
  std::string log_;
};

// A free TCP port on 127.0.0.1 (bound to port 0, then released).
Result<int> free_loopback_port();

// Waits for `pid` to exit for up to `ms` milliseconds; returns the wait status or -1.
int wait_for_exit(pid_t pid, int ms);

}  // namespace ferry::testing
