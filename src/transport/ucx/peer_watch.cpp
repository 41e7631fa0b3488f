// The UCX backend's watch of same-host peer processes through pidfds (peers whose
// endpoints have no peer-failure support, and liveness checks before UCX attaches a
// peer's shared memory).
#include "transport/ucx/ucx_backend.h"

namespace ferry::detail::ucx {

// Whether the address is of a process on this host that has exited (a zombie counts).
bool UcxBackend::local_process_exited(const wire::Address& a) {
  if (a.pid == 0 || a.host_tag == 0 || a.host_tag != wire::local_host_tag()) return false;
  int fd = int(syscall(SYS_pidfd_open, pid_t(a.pid), 0));
  if (fd < 0) return errno == ESRCH;
  pollfd p{fd, POLLIN, 0};
  const bool exited = poll(&p, 1, 0) > 0;
  close(fd);
  return exited;
}

// A peer on this host whose process has exited (its pidfd is readable).
bool UcxBackend::process_exited(const Peer& p) {
  if (p.pidfd < 0) return false;
  pollfd fd{p.pidfd, POLLIN, 0};
  return poll(&fd, 1, 0) > 0;
}

// Peers whose liveness ferry watches (mode NONE endpoints): a readable pidfd means
// the process exited.
void UcxBackend::check_watched_processes() {
  std::vector<std::shared_ptr<Peer>> watch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : peers_) {
      if (p->watched && !p->failed) watch.push_back(p);
    }
  }
  if (watch.empty()) return;
  std::vector<pollfd> fds;
  for (auto& p : watch) fds.push_back(pollfd{p->pidfd, POLLIN, 0});
  if (poll(fds.data(), fds.size(), 0) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents != 0) on_peer_failure(watch[i].get(), fmt::format("process {} exited", watch[i]->pid));
  }
}

}  // namespace ferry::detail::ucx
