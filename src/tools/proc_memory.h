// What a process holds, from /proc (internal): resident and peak resident memory of a
// process, and the memory the machine has available. Linux only; the figures a user
// compares against the engine's own accounting (SyncReport::memory).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry::tools {

struct ProcMemory {
  uint64_t rss_bytes = 0;       // VmRSS now
  uint64_t peak_rss_bytes = 0;  // VmHWM: the most resident so far
  // Of rss_bytes: private memory (RssAnon) and shared memory (RssShmem). Shared memory
  // includes pages of a peer's UCX region this process has read (mapped by UCX), so
  // RSS can count a producer's staging ring in its consumers too.
  uint64_t anon_bytes = 0, shmem_bytes = 0;
};
// Of process `pid` (0: this one). kNotFound when /proc has no such process.
Result<ProcMemory> proc_memory(pid_t pid = 0);
// MemAvailable of /proc/meminfo: what the kernel could give without swapping.
Result<uint64_t> mem_available_bytes();
// What this process can still allocate, and what bounds it: the least of what its
// address-space limit (ulimit -v) leaves beyond what it maps now and the machine's
// MemAvailable. nullopt where neither is known.
struct MemoryRoom {
  uint64_t bytes = 0;
  std::string bound;  // "this process's address-space limit (ulimit -v)" or "the machine's MemAvailable"
};
std::optional<MemoryRoom> memory_room();

// A MemoryUse as the JSON object `ferry worker`, `ferry bench --json` and the tests
// read: one key per kind (bytes) and "extra".
nlohmann::json memory_use_json(const MemoryUse& m);

}  // namespace ferry::tools
