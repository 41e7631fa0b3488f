// common/host.h — where this process runs, as its peers compare it (internal, header
// only). The one notion of "same host" in ferry: the transport's address carries
// `process_space_tag()` (a peer's pid names a process it can watch), and the engine's
// CUDA IPC export carries `host` (a peer's device memory can be mapped here). Both are
// read from the same facts, once per process:
//   * the boot id (/proc/sys/kernel/random/boot_id): one running kernel, one machine;
//   * the network namespace: the emulated hosts of the multi-host tests (network
//     namespaces of one machine, scripts/hosts.sh) are different hosts, as a fabric
//     sees them;
//   * the PID namespace: containers of one host with their own pids.
// Two processes are on the same host iff `host` is equal; they share a process space
// (pidfd_open of the peer's pid reaches it) iff `process_space_tag()` is equal. Same
// host does not imply same process space (containers), nor the reverse (network
// namespaces of one PID namespace).
#pragma once

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>

namespace ferry::common {

struct HostIdentity {
  // hostname|boot id|network namespace: equal iff the same host.
  std::string host;
  // The boot id and the PID namespace's inode ("" when unreadable).
  std::string boot_id;
  uint64_t pid_namespace = 0;
};

inline const HostIdentity& this_host() {
  static const HostIdentity id = [] {
    HostIdentity h;
    char name[HOST_NAME_MAX + 1] = {};
    if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
    std::ifstream("/proc/sys/kernel/random/boot_id") >> h.boot_id;
    char ns[128] = {};
    const ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
    h.host = std::string(name) + "|" + h.boot_id + "|" + (n > 0 ? std::string(ns, static_cast<size_t>(n)) : "");
    struct stat st {};
    if (stat("/proc/self/ns/pid", &st) == 0) h.pid_namespace = static_cast<uint64_t>(st.st_ino);
    return h;
  }();
  return id;
}

// Equal for two processes iff they run on one kernel in one PID namespace (0: unknown,
// equal to nothing). What a transport address carries so that a peer can tell whether
// it may watch this process by its pid.
inline uint64_t process_space_tag() {
  static const uint64_t tag = [] {
    const HostIdentity& h = this_host();
    if (h.boot_id.empty() || h.pid_namespace == 0) return uint64_t(0);
    const uint64_t t = std::hash<std::string>{}(h.boot_id) ^ (h.pid_namespace * 0x9e3779b97f4a7c15ULL);
    return t == 0 ? uint64_t(1) : t;
  }();
  return tag;
}

}  // namespace ferry::common
