// Emulated hosts for `ferry demo --hosts` and the tests (tests/multihost): H network
// namespaces (with UTS and IPC namespaces their processes share) joined by a bridge
// through shaped veth links, made and torn down by scripts/hosts.sh (the one
// implementation; docs/multihost.md). Linux only, needs root.
//
// Ownership: an EmulatedHosts owns its hosts; the destructor kills every process left in
// them and deletes them, whatever the test did. Each instance has its own prefix ("fm" +
// this process's pid in base 36 + a counter), recorded with this process as its owner, so
// the next `up` of anyone deletes the hosts of a run that crashed (ctest's cleanup
// fixture runs `hosts.sh clean` too). Threading: one thread uses an instance.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::tools {

// A host link's shape: rate (tc syntax, e.g. "1gbit"; empty: unlimited) and loss (the
// fraction of packets dropped at random each way; 0: none). No delay: no netem here.
struct LinkShape {
  std::string rate;
  double loss = 0;
  std::string to_string() const;  // "rate=1gbit,loss=0.01" (hosts.sh's syntax)
};

struct LinkCounters {
  uint64_t rx_bytes = 0, tx_bytes = 0;  // of the host's eth0, as the kernel counted them
};

class EmulatedHosts {
 public:
  // kUnavailable when this process cannot make namespaces: not root, no iproute2, or the
  // kernel refused (the message says which; tests skip on it, printing it).
  static Result<std::unique_ptr<EmulatedHosts>> create(int hosts, const LinkShape& link = {});
  ~EmulatedHosts();
  EmulatedHosts(const EmulatedHosts&) = delete;
  EmulatedHosts& operator=(const EmulatedHosts&) = delete;

  const std::string& prefix() const { return prefix_; }
  int size() const { return hosts_; }
  // $FERRY_HOSTS_SCRIPT, else scripts/hosts.sh where tools/config_path.h finds files
  // (working directory, installed share/ferry, source tree).
  static std::string script();
  std::string address(int host) const;   // "10.77.0.<host+1>"
  // The argv prefix that runs a command on `host` (its pid is the command's: every step
  // execs), e.g. {script, "exec", prefix, "1"}.
  std::vector<std::string> exec_prefix(int host) const;
  Status shape(int host, const LinkShape& link);
  Status set_link(int host, bool up);
  Result<LinkCounters> counters(int host) const;

  // Moves the calling thread into `host`'s network namespace until the guard dies
  // (threads it starts meanwhile are born there): how a test's driver reaches the
  // hosts' addresses. Restore before the EmulatedHosts dies.
  class Inside {
   public:
    ~Inside();
    Inside(Inside&& o) noexcept : saved_(o.saved_) { o.saved_ = -1; }
    Inside(const Inside&) = delete;
    Inside& operator=(const Inside&) = delete;
    Inside& operator=(Inside&&) = delete;

   private:
    friend class EmulatedHosts;
    explicit Inside(int saved) : saved_(saved) {}
    int saved_;
  };
  Result<Inside> enter(int host) const;

 private:
  EmulatedHosts(std::string prefix, int hosts) : prefix_(std::move(prefix)), hosts_(hosts) {}
  std::string prefix_;
  int hosts_;
};

// Runs scripts/hosts.sh with `args`, bounded by `timeout_ms`: its output, or the error
// with the output in the message.
Result<std::string> run_hosts_script(const std::vector<std::string>& args, int timeout_ms = 30000);

}  // namespace ferry::tools
