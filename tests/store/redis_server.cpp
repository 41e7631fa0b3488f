#include "store/redis_server.h"

#include <fcntl.h>
#include <hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

namespace ferry::testing {

namespace {

std::string find_redis_server() {
  if (const char* env = std::getenv("FERRY_REDIS_SERVER"); env && *env) {
    return ::access(env, X_OK) == 0 ? std::string(env) : std::string();
  }
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    std::string d;
    while (std::getline(ss, d, ':')) dirs.push_back(d);
  }
  dirs.insert(dirs.end(), {"/usr/bin", "/usr/sbin", "/usr/local/bin"});
  for (const auto& d : dirs) {
    std::string p = d + "/redis-server";
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

std::string tail_of(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
}

bool answers_ping(int port, const std::string& token) {
  timeval tv{0, 200 * 1000};
  redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
  if (!c || c->err) {
    if (c) redisFree(c);
    return false;
  }
  redisSetTimeout(c, tv);
  bool ok = false;
  if (auto* r = static_cast<redisReply*>(redisCommand(c, "AUTH %s", token.c_str()))) {
    ok = r->type == REDIS_REPLY_STATUS;
    freeReplyObject(r);
  }
  if (ok) {
    ok = false;
    if (auto* r = static_cast<redisReply*>(redisCommand(c, "PING"))) {
      ok = r->type == REDIS_REPLY_STATUS && std::string(r->str, r->len) == "PONG";
      freeReplyObject(r);
    }
  }
  // Serving, not loading its data set (a restart with persistence answers PING while it
  // loads, but LOADING to commands on data).
  if (ok) {
    ok = false;
    if (auto* r = static_cast<redisReply*>(redisCommand(c, "EXISTS ferry-ping"))) {
      ok = r->type == REDIS_REPLY_INTEGER;
      freeReplyObject(r);
    }
  }
  redisFree(c);
  return ok;
}

}  // namespace

Result<int> free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return io_error("socket: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return io_error("bind 127.0.0.1:0: {}", std::strerror(errno));
  }
  ::close(fd);
  return static_cast<int>(ntohs(a.sin_port));
}

int wait_for_exit(pid_t pid, int ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (true) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

Result<std::unique_ptr<RedisServer>> RedisServer::start(const std::string& token, bool persist) {
  const std::string bin = find_redis_server();
  if (bin.empty()) {
    return not_found(
        "redis-server not found (looked in $FERRY_REDIS_SERVER, PATH, /usr/bin, /usr/sbin). The Redis store "
        "tests never skip: install it with scripts/install-deps.sh (Debian package redis-server)");
  }
  std::unique_ptr<RedisServer> server(new RedisServer(bin, token, persist));
  if (persist) {
    char dir_template[] = "/tmp/ferry-redis-data-XXXXXX";
    if (!::mkdtemp(dir_template)) return io_error("mkdtemp: {}", std::strerror(errno));
    server->dir_ = dir_template;
  }
  Status last;
  for (int attempt = 0; attempt < 5; ++attempt) {
    FERRY_ASSIGN_OR_RETURN(int port, free_loopback_port());
    last = server->launch(port);
    if (last.ok()) return server;
    // Retry on another port (another process may have taken ours).
  }
  return last;
}

Status RedisServer::launch(int port) {
  if (log_.empty()) {
    char log_template[] = "/tmp/ferry-redis-XXXXXX";
    int fd = ::mkstemp(log_template);
    if (fd < 0) return io_error("mkstemp: {}", std::strerror(errno));
    ::close(fd);
    log_ = log_template;
  }
  int log_fd = ::open(log_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (log_fd < 0) return io_error("open {}: {}", log_, std::strerror(errno));
  const std::string port_s = std::to_string(port);
  std::vector<std::string> args = {bin_, "--port", port_s, "--bind", "127.0.0.1", "--requirepass", token_,
                                   "--save", "", "--daemonize", "no", "--protected-mode", "yes"};
  if (persist_) {
    args.insert(args.end(), {"--dir", dir_, "--appendonly", "yes", "--appendfsync", "always"});
  } else {
    args.insert(args.end(), {"--dir", "/tmp", "--appendonly", "no"});
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    return io_error("fork: {}", std::strerror(errno));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(log_fd);
  pid_ = pid;
  port_ = port;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool exited = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (answers_ping(port, token_)) return Status::Ok();
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      pid_ = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!exited) {
    ::kill(pid, SIGKILL);
    wait_for_exit(pid, 5000);
    pid_ = -1;
  }
  return unavailable("redis-server on port {} {}; its log:\n{}", port,
                     exited ? "exited at start (port taken?)" : "did not answer PING within 10 s", tail_of(log_));
}

Status RedisServer::restart() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    wait_for_exit(pid_, 5000);
    pid_ = -1;
  }
  return launch(port_);
}

RedisServer::~RedisServer() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    if (wait_for_exit(pid_, 2000) == -1) {
      ::kill(pid_, SIGKILL);
      wait_for_exit(pid_, 5000);
    }
  }
  ::unlink(log_.c_str());
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

}  // namespace ferry::testing
