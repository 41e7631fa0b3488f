#include "tools/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>

#include <fmt/format.h>

namespace ferry::tools {
namespace {

using SteadyClock = std::chrono::steady_clock;

// `exe` itself when it names a path; else the first executable `dir/exe` over $PATH's
// directories; empty when there is none.
std::string resolve(const std::string& exe) {
  if (exe.find('/') != std::string::npos) return exe;
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (!dir.empty() && ::access((dir + "/" + exe).c_str(), X_OK) == 0) return dir + "/" + exe;
  }
  return {};
}

std::vector<std::string> current_environment() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

// Appends `text` to `log` (stderr when empty or unopenable).
void append_to_log(const std::string& log, const std::string& text) {
  const int fd = log.empty() ? -1 : ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int out = fd >= 0 ? fd : 2;
  for (size_t at = 0; at < text.size();) {
    const ssize_t n = ::write(out, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    at += static_cast<size_t>(n);
  }
  if (fd >= 0) ::close(fd);
}

}  // namespace

Result<Child> spawn(const ProcessSpec& spec) {
  if (spec.argv.empty()) return invalid_argument("spawn {}: empty argv", spec.name);
  Child ch;
  ch.name = spec.name;
  ch.log = spec.log;
  // Everything the child uses, made here: after fork() it may only make async-signal-safe calls.
  std::vector<std::string> args = spec.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_text = spec.env ? *spec.env : current_environment();
  std::vector<char*> envp;
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string exe = resolve(args[0]);
  const char* log = spec.log.empty() ? nullptr : spec.log.c_str();
  // The child reports a failed exec (its errno) on this pipe; exec closes it (O_CLOEXEC).
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) return io_error("spawn {}: pipe: {}", spec.name, std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(report[0]);
    ::close(report[1]);
    return io_error("fork failed");
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    if (log != nullptr) {
      const int fd = ::open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
    }
    int err = ENOENT;  // not found on $PATH
    if (!exe.empty()) {
      ::execve(exe.c_str(), argv.data(), envp.data());
      err = errno;
    }
    while (::write(report[1], &err, sizeof(err)) < 0 && errno == EINTR) {
    }
    ::_exit(127);
  }
  ::close(report[1]);
  int err = 0;
  ssize_t n = 0;
  do {
    n = ::read(report[0], &err, sizeof(err));
  } while (n < 0 && errno == EINTR);
  ::close(report[0]);
  if (n == static_cast<ssize_t>(sizeof(err))) append_to_log(spec.log, fmt::format("exec {}: {}\n", args[0], std::strerror(err)));
  ch.pid = pid;
  return ch;
}

std::vector<std::string> environment_with(const std::string& name, const std::string& value) {
  const std::string prefix = name + "=";
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with(prefix)) env.emplace_back(*e);
  }
  if (!value.empty()) env.push_back(prefix + value);
  return env;
}

bool is_executable(const std::string& exe) {
  const std::string path = resolve(exe);
  return !path.empty() && ::access(path.c_str(), X_OK) == 0;
}

std::optional<int> wait_exit(Child& c, SteadyClock::time_point deadline) {
  if (c.pid <= 0) return std::nullopt;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) {
      c.pid = -1;
      return status;
    }
    if (r < 0 || SteadyClock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void kill_now(Child& c) {
  if (c.pid <= 0) return;
  ::kill(c.pid, SIGKILL);
  wait_exit(c, SteadyClock::now() + std::chrono::seconds(10));
  c.pid = -1;
}

int reap(Child& c, std::chrono::milliseconds timeout) {
  if (c.pid <= 0) return -1;
  const auto status = wait_exit(c, SteadyClock::now() + timeout);
  if (!status) {
    kill_now(c);
    return -1;
  }
  return WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

void terminate(Child& c, std::chrono::milliseconds grace) {
  if (c.pid <= 0) return;
  ::kill(c.pid, SIGTERM);
  reap(c, grace);
}

std::string read_log(const Child& c) {
  if (c.log.empty()) return {};
  std::ifstream f(c.log);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::pair<int64_t, int64_t> proc_usage(pid_t pid) {
  int64_t rss = -1, fds = 0;
  {
    std::ifstream f(fmt::format("/proc/{}/statm", pid));
    int64_t size = 0, resident = 0;
    if (f >> size >> resident) rss = resident * (::sysconf(_SC_PAGESIZE) / 1024);
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++fds;
  if (ec) fds = -1;
  return {rss, fds};
}

std::string exe_path() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec || exe.empty()) return "ferry";
  return exe.string();
}

double proc_cpu(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string text;
  std::getline(f, text);
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::stringstream ss(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && ss >> field; ++i)  // fields 14 and 15: utime, stime
    if (i >= 14) ticks += std::strtod(field.c_str(), nullptr);
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double tree_cpu(pid_t pid) {
  double sum = proc_cpu(pid);
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc", ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    std::ifstream f(it->path() / "stat");
    std::string text;
    std::getline(f, text);
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::stringstream ss(text.substr(close + 2));
    std::string state;
    long ppid = 0;
    if (ss >> state >> ppid && ppid == pid) sum += proc_cpu(static_cast<pid_t>(std::stol(name)));
  }
  return sum;
}

}  // namespace ferry::tools
