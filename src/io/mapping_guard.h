// io/mapping_guard.h — what a read of a file mapping does when the file was truncated
// under it (internal; `ferry serve` and ferry.serve, over the checkpoint they serve in
// place).
//
// A page of a MAP_SHARED or MAP_PRIVATE file mapping that lies past the file's end after
// a truncation raises SIGBUS on its next touch, in whichever thread touches it: the
// producer packing a strided box, UCX's progress thread answering a read by message, a
// checksum. No check made before the touch can rule the truncation out (it can land right
// after the check), the touches are not all ferry's (UCX's), and the bytes are needed in
// place (copying the file into owned memory is what --read-checkpoint does, at its whole
// size in RAM). So the fault itself is made the error: a TruncationGuard names a mapped
// range, and a SIGBUS whose address lies in a watched range ends the process at once
// with a message naming the file and the byte, and a chosen exit status — instead of
// "Bus error" (status 135) with no word of why. Ending, rather than mapping zero pages
// over the hole and carrying on, is deliberate: the bytes past the new end are not the
// checkpoint any more, and a consumer must never receive them as if they were; peers see
// a producer that is gone, which they already handle (failover, or a failed sync).
//
// The handler is installed once, through libc's own sigaction: UCX overrides sigaction()
// for the signals it handles itself (UCX_ERROR_SIGNALS, SIGBUS among them) and silently
// keeps its own handler. A SIGBUS outside every watched range goes to the handler that
// was there before (UCX's backtrace, Python's faulthandler), or takes the default action.
#pragma once

#include <cstddef>
#include <string>

#include "ferry/status.h"

namespace ferry::io {

class TruncationGuard {
 public:
  // Watches [base, base + size): a SIGBUS there writes `message` + " (byte B of the S
  // mapped)\n" to stderr and _exit(exit_code)s. At most 64 ranges are watched at once
  // (kFailedPrecondition beyond); kInternal when the handler cannot be installed.
  static Result<TruncationGuard> watch(const void* base, size_t size, const std::string& message, int exit_code);

  TruncationGuard() = default;
  TruncationGuard(TruncationGuard&& other) noexcept : slot_(other.slot_) { other.slot_ = -1; }
  TruncationGuard& operator=(TruncationGuard&& other) noexcept;
  TruncationGuard(const TruncationGuard&) = delete;
  TruncationGuard& operator=(const TruncationGuard&) = delete;
  // Stops watching (the mapping may be unmapped after this).
  ~TruncationGuard();

 private:
  explicit TruncationGuard(int slot) : slot_(slot) {}
  int slot_ = -1;
};

}  // namespace ferry::io
