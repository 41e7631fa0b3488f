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
  // `persist`: an append-only file fsynced on every write (`--appendonly yes
  // --appendfsync always`) in a private directory, so that restart() keeps every key.
  static Result<std::unique_ptr<RedisServer>> start(const std::string& token, bool persist = false);
  ~RedisServer();  // SIGTERM, then SIGKILL after 2 s; always reaps the child

  // SIGKILLs the server and starts it again on the same port (with its data when
  // persistent), waiting until it answers PING (10 s at most).
  Status restart();

  int port() const { return port_; }
  pid_t pid() const { return pid_; }

 private:
  RedisServer(std::string bin, std::string token, bool persist) : bin_(std::move(bin)), token_(std::move(token)), persist_(persist) {}
  // Starts redis-server on `port` and waits for its PING.
  Status launch(int port);
  std::string bin_, token_;
  bool persist_ = false;
  std::string dir_;  // persistent: the data directory
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_;
};

// A free TCP port on 127.0.0.1 (bound to port 0, then released).
Result<int> free_loopback_port();

// Waits for `pid` to exit for up to `ms` milliseconds; returns the wait status or -1.
int wait_for_exit(pid_t pid, int ms);

}  // namespace ferry::testing
