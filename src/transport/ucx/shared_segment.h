// transport/ucx/shared_segment.h — a peer's posix shared-memory segments opened by
// ferry before UCX attaches them (internal to the UCX backend).
//
// Why: UCX 1.13's posix transport (with its default USE_PROC_LINK) attaches a peer's
// segment by opening /proc/<owner pid>/fd/<owner fd> inside ucp_ep_rkey_unpack. When
// that open fails (the owner exited, is exiting, or freed the segment), the unpack's
// cleanup releases the entry it failed on and the process dies (SIGSEGV at 0x8 in
// ucp_rkey_destroy). A liveness check before the unpack only narrows the window: a
// SIGKILLed owner closes its files before its pidfd turns readable. So ferry opens each
// such segment itself first. A failure is then an error status, and on success the
// packed key handed to UCX names the descriptor this process holds
// (/proc/<our pid>/fd/<ours>), an open that cannot fail while it is held.
//
// Only UCX 1.13's layout is rewritten: a packed ucp rkey (md map, memory type, then per
// memory domain a size byte and that many bytes), where a posix entry is 24 bytes (32
// in a non-default PID namespace) starting with a seg_id whose top bit says procfs
// mode and whose low 60 bits are the owner's pid (30 bits) and fd (30 bits). A key that
// does not parse that way, or that has no such entry of `owner_pid`, is passed to UCX
// unchanged.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::detail::ucx {

// A packed rkey to unpack in place of the peer's, and the descriptors it names (closed
// by the destructor: once UCX has attached the segments, they are no longer needed).
// Move-only.
class PinnedRkey final {
 public:
  PinnedRkey() = default;
  ~PinnedRkey();
  PinnedRkey(PinnedRkey&& o) noexcept;
  PinnedRkey& operator=(PinnedRkey&& o) noexcept;
  PinnedRkey(const PinnedRkey&) = delete;
  PinnedRkey& operator=(const PinnedRkey&) = delete;

  const std::vector<std::byte>& packed() const { return packed_; }
  // Segments opened here (0: the key is passed through unchanged).
  size_t pinned() const { return fds_.size(); }

 private:
  friend Result<PinnedRkey> pin_shared_segments(std::span<const std::byte>, pid_t);
  std::vector<std::byte> packed_;
  std::vector<int> fds_;
};

// Opens every posix procfs segment of `owner_pid` that the packed rkey names and
// returns the key re-pointed at this process's descriptors. kUnavailable when a
// segment cannot be opened (the message names /proc/<pid>/fd/<fd> and the errno).
Result<PinnedRkey> pin_shared_segments(std::span<const std::byte> packed_rkey, pid_t owner_pid);

}  // namespace ferry::detail::ucx
