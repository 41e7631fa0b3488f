// transport/ucx/shared_segment.cpp — see shared_segment.h.
#include "transport/ucx/shared_segment.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include <fmt/format.h>

namespace ferry::detail::ucx {
namespace {

// UCX 1.13, src/uct/sm/mm/posix/mm_posix.c.
constexpr uint64_t kSegProcfs = uint64_t(1) << 63;  // mmid is an fd of the owner, through procfs
constexpr uint64_t kSegPidNs = uint64_t(1) << 60;   // a 64-bit PID namespace id follows the entry
constexpr uint64_t kSegFlags = uint64_t(0xf) << 60;
constexpr int kPidBits = 30, kFdBits = 30;
constexpr uint64_t kPidMask = (uint64_t(1) << kPidBits) - 1;
constexpr uint64_t kFdMask = (uint64_t(1) << kFdBits) - 1;
constexpr size_t kPosixEntry = 24;  // seg_id, address, length

uint64_t load_u64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

PinnedRkey::~PinnedRkey() {
  for (int fd : fds_) close(fd);
}

PinnedRkey::PinnedRkey(PinnedRkey&& o) noexcept : packed_(std::move(o.packed_)), fds_(std::exchange(o.fds_, {})) {}

PinnedRkey& PinnedRkey::operator=(PinnedRkey&& o) noexcept {
  if (this != &o) {
    for (int fd : fds_) close(fd);
    packed_ = std::move(o.packed_);
    fds_ = std::exchange(o.fds_, {});
  }
  return *this;
}

Result<PinnedRkey> pin_shared_segments(std::span<const std::byte> packed_rkey, pid_t owner_pid) {
  PinnedRkey out;
  out.packed_.assign(packed_rkey.begin(), packed_rkey.end());
  if (owner_pid <= 0 || uint64_t(owner_pid) > kPidMask) return out;
  // md map (u64), memory type (u8), then per set bit: size (u8) and the entry.
  std::byte* p = out.packed_.data();
  const size_t n = out.packed_.size();
  if (n < sizeof(uint64_t) + 1) return out;
  const uint64_t md_map = load_u64(p);
  size_t at = sizeof(uint64_t) + 1;
  struct Entry {
    size_t seg_id_at;
    int fd;
  };
  std::vector<Entry> entries;
  for (int bit = 0; bit < 64; ++bit) {
    if ((md_map & (uint64_t(1) << bit)) == 0) continue;
    if (at >= n) return out;  // not the layout this knows: pass it through
    const size_t size = size_t(std::to_integer<uint8_t>(p[at]));
    ++at;
    if (size > n - at) return out;
    if (size == kPosixEntry || size == kPosixEntry + sizeof(uint64_t)) {
      const uint64_t seg_id = load_u64(p + at);
      const bool ns = (seg_id & kSegPidNs) != 0;
      if ((seg_id & kSegProcfs) != 0 && ns == (size != kPosixEntry) && (seg_id & kPidMask) == uint64_t(owner_pid)) {
        entries.push_back(Entry{at, int((seg_id >> kPidBits) & kFdMask)});
      }
    }
    at += size;
  }
  for (const Entry& e : entries) {
    const std::string path = fmt::format("/proc/{}/fd/{}", owner_pid, e.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return unavailable("the peer's shared-memory segment {} cannot be opened: {} (the peer exited, or freed "
                         "the region the key names)",
                         path, std::strerror(errno));
    }
    out.fds_.push_back(fd);
    // A regular file, or UCX's mmap of it fails as its open would have: the owner freed
    // the segment and reused the fd number since it packed the key. (Not its size: the
    // key's length is the mapping's, rounded up to pages, the file's the request's.)
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || uint64_t(fd) > kFdMask || uint64_t(getpid()) > kPidMask) {
      return unavailable("the peer's shared-memory segment {} is no longer a shared-memory file (the peer freed "
                         "the region the key names)",
                         path);
    }
    const uint64_t old_id = load_u64(p + e.seg_id_at);
    const uint64_t new_id = (old_id & kSegFlags) | uint64_t(getpid()) | (uint64_t(fd) << kPidBits);
    std::memcpy(p + e.seg_id_at, &new_id, sizeof new_id);
  }
  return out;
}

}  // namespace ferry::detail::ucx
