#include "tools/proc_memory.h"

#include "engine/report_json.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <fmt/format.h>

namespace ferry::tools {
namespace {

// The "<key>: <n> kB" line of a /proc file, in bytes.
Result<uint64_t> kb_field(const std::string& path, const char* key) {
  std::ifstream f(path);
  if (!f) return not_found("{}: cannot open", path);
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, n, key) != 0 || line.size() <= n || line[n] != ':') continue;
    unsigned long long kb = 0;
    if (std::sscanf(line.c_str() + n + 1, "%llu", &kb) != 1) return corrupt("{}: bad line '{}'", path, line);
    return static_cast<uint64_t>(kb) * 1024;
  }
  return not_found("{}: no {} line", path, key);
}

}  // namespace

Result<ProcMemory> proc_memory(pid_t pid) {
  const std::string path = pid ? fmt::format("/proc/{}/status", pid) : std::string("/proc/self/status");
  ProcMemory m;
  FERRY_ASSIGN_OR_RETURN(m.rss_bytes, kb_field(path, "VmRSS"));
  FERRY_ASSIGN_OR_RETURN(m.peak_rss_bytes, kb_field(path, "VmHWM"));
  FERRY_ASSIGN_OR_RETURN(m.anon_bytes, kb_field(path, "RssAnon"));
  FERRY_ASSIGN_OR_RETURN(m.shmem_bytes, kb_field(path, "RssShmem"));
  return m;
}

Result<uint64_t> mem_available_bytes() { return kb_field("/proc/meminfo", "MemAvailable"); }

std::optional<MemoryRoom> memory_room() {
  std::optional<MemoryRoom> room;
  if (auto avail = mem_available_bytes(); avail.ok()) room = MemoryRoom{*avail, "the machine's MemAvailable"};
  rlimit r{};
  if (::getrlimit(RLIMIT_AS, &r) == 0 && r.rlim_cur != RLIM_INFINITY) {
    size_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    const uint64_t mapped = static_cast<uint64_t>(pages) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t left = r.rlim_cur > mapped ? r.rlim_cur - mapped : 0;
    if (!room || left < room->bytes) room = MemoryRoom{left, "this process's address-space limit (ulimit -v)"};
  }
  return room;
}

nlohmann::json memory_use_json(const MemoryUse& m) { return engine::memory_use_json(m); }

}  // namespace ferry::tools
