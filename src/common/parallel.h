// parallel_for: an index range run on a few threads of its own (routing, plan recording).
// Internal; no pool: each call starts its threads and joins them before it returns.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace ferry {

// The hardware's threads, at least 1 and at most `cap`.
inline int default_threads(int cap) {
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, static_cast<unsigned>(std::max(cap, 1))));
}

// Runs fn(i) for every i in [0, n) on up to `threads` threads (the caller's among them),
// each taking the next index. Where a thread cannot be started the others do its share;
// an exception thrown by fn stops the handing out and is rethrown here, as it would have
// been from a loop.
template <typename F>
void parallel_for(size_t n, int threads, F&& fn) {
  const size_t want = std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1)));
  if (want <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::mutex mu;
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < n && !failed.load(std::memory_order_relaxed); i = next.fetch_add(1)) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(want - 1);
  for (size_t t = 1; t < want; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // fewer threads: the ones running take the rest
    }
  }
  worker();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace ferry
