// What the two sides of `ferry bench` (tools/bench.h) agree on: the driver (bench.cpp)
// posts each step under a store key and collects every rank's result under another; the
// ranks (`ferry worker --bench`, bench_worker.cpp) wait for it and start at the instant it
// names on CLOCK_MONOTONIC (engine::Clock; one host, so the clocks agree). Internal.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "engine/clock.h"

namespace ferry::tools::bench_steps {

inline int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(engine::Clock::now().time_since_epoch()).count();
}

inline std::string key_go(const std::string& job, int step) { return fmt::format("{}/bench/go/{}", job, step); }
inline std::string key_result(const std::string& job, int step, const std::string& role, int rank) {
  return fmt::format("{}/bench/result/{}/{}{}", job, step, role, rank);
}
inline std::string key_raw(const std::string& job, const std::string& role, int rank) {
  return fmt::format("{}/bench/raw/{}{}", job, role, rank);
}
inline std::string key_ready(const std::string& job, const std::string& role, int rank) {
  return fmt::format("{}/bench/ready/{}{}", job, role, rank);
}

}  // namespace ferry::tools::bench_steps
