// engine/clock.h — the engine's clock (internal).
#pragma once

#include <algorithm>
#include <chrono>

namespace ferry::engine {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
// How often a wait for peers' messages asks the transport whether this side still runs
// (Transport::health: a dead transport delivers nothing, and with nothing to send no op
// fails): lease_ttl / 3, within [50 ms, 1 s].
inline Clock::duration health_probe_every(std::chrono::milliseconds lease_ttl) {
  return std::clamp<Clock::duration>(lease_ttl / 3, std::chrono::milliseconds(50), std::chrono::milliseconds(1000));
}
inline long long ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

}  // namespace ferry::engine
