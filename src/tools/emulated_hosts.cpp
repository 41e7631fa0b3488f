#include "tools/emulated_hosts.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <fmt/format.h>

#include "tools/config_path.h"
#include "tools/subprocess.h"

namespace ferry::tools {

std::string LinkShape::to_string() const {
  std::string s;
  if (!rate.empty()) s = "rate=" + rate;
  if (loss > 0) s += fmt::format("{}loss={}", s.empty() ? "" : ",", loss);
  return s;
}

std::string EmulatedHosts::script() {
  const char* env = std::getenv("FERRY_HOSTS_SCRIPT");
  if (env != nullptr && *env != '\0') return env;
  // Found as the model configs are: the working directory, the installed share/ferry
  // beside the executable (cmake/FerryInstall.cmake installs it), the source tree.
  auto found = find_model_config("scripts/hosts.sh");
  return found.ok() ? *found : source_tree() + "/scripts/hosts.sh";
}

Result<std::string> run_hosts_script(const std::vector<std::string>& args, int timeout_ms) {
  char tmpl[] = "/tmp/ferry-hosts-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  if (fd < 0) return io_error("hosts.sh: mkstemp failed");
  ::close(fd);
  ProcessSpec ps;
  ps.argv = {"/bin/sh", EmulatedHosts::script()};
  ps.argv.insert(ps.argv.end(), args.begin(), args.end());
  ps.env = environment_with("FERRY_HOSTS_OWNER", std::to_string(::getpid()));
  ps.log = tmpl;
  ps.name = "hosts.sh " + (args.empty() ? std::string() : args.front());
  auto child = spawn(ps);
  if (!child.ok()) return child.status();
  const auto status = wait_exit(*child, std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms));
  const std::string out = read_log(*child);
  ::unlink(tmpl);
  if (!status) {
    kill_now(*child);
    return timeout_error("{} did not finish within {} ms: {}", ps.name, timeout_ms, out);
  }
  if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    return unavailable("{} failed (wait status {}): {}", ps.name, *status, out);
  }
  return out;
}

Result<std::unique_ptr<EmulatedHosts>> EmulatedHosts::create(int hosts, const LinkShape& link) {
  if (::geteuid() != 0) {
    return unavailable("emulated hosts need root (network namespaces need CAP_SYS_ADMIN); euid is {}", ::geteuid());
  }
  static std::atomic<int> counter{0};
  std::string pid36;
  for (auto p = static_cast<uint64_t>(::getpid()); p > 0; p /= 36) pid36.insert(pid36.begin(), "0123456789abcdefghijklmnopqrstuvwxyz"[p % 36]);
  const std::string prefix = fmt::format("fm{}{}", pid36, "abcdefghijklmnopqrstuvwxyz"[counter++ % 26]);
  std::vector<std::string> args = {"up", prefix, std::to_string(hosts)};
  if (!link.to_string().empty()) args.push_back(link.to_string());
  auto out = run_hosts_script(args, 60000);
  // The script deletes what it made when it fails half way.
  if (!out.ok()) return out.status();
  return std::unique_ptr<EmulatedHosts>(new EmulatedHosts(prefix, hosts));
}

EmulatedHosts::~EmulatedHosts() {
  auto out = run_hosts_script({"down", prefix_}, 60000);
  if (!out.ok()) std::fprintf(stderr, "emulated hosts %s: teardown: %s\n", prefix_.c_str(), out.status().to_string().c_str());
}

std::string EmulatedHosts::address(int host) const { return fmt::format("10.77.0.{}", host + 1); }

std::vector<std::string> EmulatedHosts::exec_prefix(int host) const {
  return {"/bin/sh", script(), "exec", prefix_, std::to_string(host)};
}

Status EmulatedHosts::shape(int host, const LinkShape& link) {
  return run_hosts_script({"shape", prefix_, std::to_string(host), link.to_string()}).status();
}

Status EmulatedHosts::set_link(int host, bool up) {
  return run_hosts_script({"link", prefix_, std::to_string(host), up ? "up" : "down"}).status();
}

Result<LinkCounters> EmulatedHosts::counters(int host) const {
  auto out = run_hosts_script({"exec", prefix_, std::to_string(host), "cat", "/sys/class/net/eth0/statistics/rx_bytes",
                               "/sys/class/net/eth0/statistics/tx_bytes"});
  if (!out.ok()) return out.status();
  std::istringstream in(*out);
  LinkCounters c;
  if (!(in >> c.rx_bytes >> c.tx_bytes)) return internal_error("host {} counters: unreadable output '{}'", host, *out);
  return c;
}

Result<EmulatedHosts::Inside> EmulatedHosts::enter(int host) const {
  const int saved = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (saved < 0) return io_error("enter host {}: open /proc/thread-self/ns/net: {}", host, std::strerror(errno));
  const std::string path = fmt::format("/run/netns/{}-h{}", prefix_, host);
  const int target = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (target < 0 || ::setns(target, CLONE_NEWNET) != 0) {
    const int err = errno;
    if (target >= 0) ::close(target);
    ::close(saved);
    return io_error("enter host {}: setns {}: {}", host, path, std::strerror(err));
  }
  ::close(target);
  return Inside(saved);
}

EmulatedHosts::Inside::~Inside() {
  if (saved_ < 0) return;
  if (::setns(saved_, CLONE_NEWNET) != 0) std::fprintf(stderr, "emulated hosts: leaving a host: setns failed\n");
  ::close(saved_);
}

}  // namespace ferry::tools
