#include "transport/harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "transport/peer_service.h"
#include "transport/protocol.h"

#ifndef FERRY_TRANSPORT_PEER_BIN
#error "FERRY_TRANSPORT_PEER_BIN must name the transport_peer helper"
#endif

namespace ferry::transport_test {

TransportOptions options_for(const BackendCase& c) {
  TransportOptions o;
  o.backend = c.backend;
  if (c.backend == "ucx") {
    o.params = {{"tls", c.tls}, {"net_devices", "lo"}, {"tcp_control", c.tcp_control ? "1" : "0"}};
  }
  return o;
}

namespace {

class InprocRemote final : public Remote {
 public:
  ~InprocRemote() override {
    svc.reset();
    t.reset();
  }
  Status kill() override { return t->simulate_crash(); }
  std::unique_ptr<Transport> t;
  std::unique_ptr<PeerService> svc;
};

class ProcessRemote final : public Remote {
 public:
  ~ProcessRemote() override {
    if (to_child >= 0) close(to_child);  // EOF on its stdin: it exits
    if (from_child >= 0) close(from_child);
    reap(std::chrono::seconds(5));
  }
  Status kill() override {
    if (pid <= 0) return failed_precondition("remote already reaped");
    if (::kill(pid, SIGKILL) != 0) return io_error("kill({}): {}", pid, std::strerror(errno));
    reap(std::chrono::seconds(5));
    return Status::Ok();
  }
  void reap(std::chrono::milliseconds timeout) {
    if (pid <= 0) return;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int st = 0;
      pid_t r = waitpid(pid, &st, WNOHANG);
      if (r == pid || r < 0) break;
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    pid = -1;
  }
  pid_t pid = -1;
  int to_child = -1, from_child = -1;
};

Result<std::string> read_line(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return timeout_error("no line from transport_peer within {} ms", timeout.count());
    pollfd p{fd, POLLIN, 0};
    int r = poll(&p, 1, int(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) return unavailable("transport_peer exited before it was ready");
    line.append(buf, size_t(n));
    // UCX may log to stdout before we are ready: skip anything but the READY line.
    for (auto nl = line.find('\n'); nl != std::string::npos; nl = line.find('\n')) {
      std::string l = line.substr(0, nl);
      line.erase(0, nl + 1);
      if (l.rfind("READY ", 0) == 0) return l;
      std::fprintf(stderr, "transport_peer: %s\n", l.c_str());
    }
  }
}

Result<std::unique_ptr<Remote>> spawn_process(const BackendCase& c, Transport& local, uint64_t bytes) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return io_error("pipe2: {}", std::strerror(errno));
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return io_error("pipe2: {}", std::strerror(errno));
  }
  std::string addr = to_hex(local.address());
  std::string nbytes = std::to_string(bytes);
  const char* argv[] = {FERRY_TRANSPORT_PEER_BIN, "--tls", c.tls.c_str(), "--bytes", nbytes.c_str(),
                        "--parent", addr.c_str(), "--tcp-control", c.tcp_control ? "1" : "0", nullptr};
  pid_t pid = fork();
  if (pid < 0) return io_error("fork: {}", std::strerror(errno));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    dup2(in[0], 0);
    dup2(out[1], 1);
    execv(argv[0], const_cast<char* const*>(argv));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  auto r = std::make_unique<ProcessRemote>();
  r->pid = pid;
  r->to_child = in[1];
  r->from_child = out[0];
  FERRY_ASSIGN_OR_RETURN(std::string line, read_line(r->from_child, std::chrono::seconds(30)));
  // "READY <addr> <key>"
  auto s1 = line.find(' '), s2 = line.rfind(' ');
  if (line.rfind("READY ", 0) != 0 || s1 == s2) return corrupt("transport_peer said '{}'", line);
  std::vector<std::byte> paddr, pkey;
  if (!from_hex(line.substr(s1 + 1, s2 - s1 - 1), &paddr) || !from_hex(line.substr(s2 + 1), &pkey)) {
    return corrupt("transport_peer sent bad hex");
  }
  FERRY_ASSIGN_OR_RETURN(r->peer, local.connect(paddr));
  FERRY_ASSIGN_OR_RETURN(r->region, local.import_key(pkey));
  return std::unique_ptr<Remote>(std::move(r));
}

}  // namespace

Result<std::unique_ptr<Remote>> spawn_remote(const BackendCase& c, Transport& local, uint64_t bytes) {
  if (c.backend == "ucx") return spawn_process(c, local, bytes);
  auto r = std::make_unique<InprocRemote>();
  FERRY_ASSIGN_OR_RETURN(r->t, Transport::create(options_for(c)));
  FERRY_ASSIGN_OR_RETURN(r->svc, PeerService::start(*r->t, bytes, local.address()));
  FERRY_ASSIGN_OR_RETURN(r->peer, local.connect(r->t->address()));
  FERRY_ASSIGN_OR_RETURN(r->region, local.import_key(r->svc->key()));
  return std::unique_ptr<Remote>(std::move(r));
}

void Mailbox::attach(Transport& t) {
  t.set_message_handler([this](PeerId from, uint32_t tag, std::span<const std::byte> payload) {
    if (tag == kFlood) {
      floods_++;
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      q_.push_back({from, tag, std::vector<std::byte>(payload.begin(), payload.end())});
    }
    cv_.notify_all();
  });
}

Result<std::vector<std::byte>> Mailbox::wait(uint32_t tag, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    for (auto it = q_.begin(); it != q_.end(); ++it) {
      if (it->tag == tag) {
        auto p = std::move(it->payload);
        q_.erase(it);
        return p;
      }
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      return timeout_error("no message with tag {} within {} ms", tag, timeout.count());
    }
  }
}

size_t Mailbox::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return q_.size();
}

Buffer::Buffer(uint64_t bytes) : n_(bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  p_ = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
}
Buffer::~Buffer() {
  if (p_ != nullptr) munmap(p_, n_);
}

}  // namespace ferry::transport_test
