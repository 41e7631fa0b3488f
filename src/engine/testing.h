// engine/testing.h — fault injection for ferry's own tests, the demo and the
// multi-process workers (internal; never set in production). The public option structs
// carry only an opaque pointer to these hooks (EngineOptions::test_hooks).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "ferry/engine.h"

namespace ferry::engine {

struct TestHooks {
  // Producer: runs before group `group` of sync `version` is materialised.
  std::function<void(uint64_t version, int group)> before_materialize;
  // Producer: after materialising a group, before packing it (a drifted replica's weights).
  std::function<void(uint64_t version, int group, std::vector<LocalBox>& boxes)> after_materialize;
  // Producer: after checksumming, flips one byte of group `corrupt_group`'s staging in
  // sync `corrupt_version` (-1: never).
  int corrupt_group = -1;
  uint64_t corrupt_version = 0;
  // Producer (push): runs before the writes of group `group` of sync `version` to
  // `consumer` are posted (after they count as in flight: a FLUSHED waits for them).
  std::function<void(uint64_t version, int group, int consumer)> before_push;
  // Consumer: runs at points of a sync — (group, phase) with phase 0: before waiting for
  // the group's data, 1: reads posted (push: READY sent), 2: group received and
  // released, 3: on the background thread before unpacking. Fault tests crash here.
  std::function<void(int group, int phase)> consumer_point;
  // Consumer: reads of group `group` of sync `version` from producer `producer` stay
  // pending for the returned time before they are waited for, as if that producer's side
  // stalled (a SIGSTOPped producer holds the reads its transport must serve); the
  // consumer waits as for real reads meanwhile. Zero: not held.
  std::function<std::chrono::milliseconds(uint64_t version, int group, int producer)> hold_reads;
  // Consumer::catch_up: runs on the joiner once replica `source` offered version
  // `version`, before any read is posted (a fault test kills the source here).
  std::function<void(uint64_t version, int source)> catch_up_offered;
};

inline std::shared_ptr<const TestHooks> make_test_hooks(TestHooks hooks) {
  return std::make_shared<const TestHooks>(std::move(hooks));
}

// What only tests may do to a live engine object.
struct TestAccess {
  // Makes consumer `c` behave as a SIGKILLed process (inproc transport): crashes its
  // transport, drops its lease, fails its waits.
  static void simulate_crash(Consumer& c);
  // Whether consumer `c` holds producer `p` for failed (its transport reported it, and no
  // later connection replaced it): a test that kills a producer between syncs waits for
  // this, as a real job's next sync comes seconds after a death.
  static bool knows_failed(Consumer& c, int p);
  // Whether a producer has told consumer `c` it was dropped from sync `version`: a test
  // that stalls a consumer until it is dropped waits for this rather than a fixed time.
  static bool knows_dropped(Consumer& c, uint64_t version);
};
inline void simulate_crash(Consumer& c) { TestAccess::simulate_crash(c); }
inline bool knows_failed(Consumer& c, int p) { return TestAccess::knows_failed(c, p); }
inline bool knows_dropped(Consumer& c, uint64_t version) { return TestAccess::knows_dropped(c, version); }

}  // namespace ferry::engine
