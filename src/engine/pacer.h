// engine/pacer.h — the pace a producer serves its reads at (EngineOptions::group_order,
// docs/group-order.md). Under the rotated order a producer serves its reads (a consumer
// reading one of its groups) in waves (serve_waves), one per step of the consumers'
// orders, a wave once every read of the waves before it finished: released (pull) or
// written (push), or its consumer dropped, done, aborted or moved to other routes. Under
// the layer order there are no waves: every read's turn comes when its group is packed,
// and groups are packed in layer order. The producer asks the same questions either way.
// Internal.
//
// Threading: not thread-safe; the producer guards it with its mutex (install under it,
// with the routes).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "engine/group_order.h"
#include "ferry/engine.h"
#include "ferry/route.h"

namespace ferry::engine {

class Pacer {
 public:
  // The pace of producer `rank` under `routes` and `order` (rotated: its serve_waves,
  // after check_group_order; layer: none). kInternal when the order breaks its
  // invariants.
  static Result<Pacer> make(const Routes& routes, int rank, const GroupOrderOptions& order);

  // Group g's place in this producer's pack order (its staging slot is the place modulo
  // the slots): the rotated order's, else g.
  int pack_position(int g) const;
  // Whether consumer c's read of group g may be served now (its wave is open).
  bool turn(int c, int g) const;
  // A new attempt: its first wave open, no read released yet.
  void begin_attempt();
  // Consumer c released group g (or was written it): that read is finished.
  void note_released(int c, int g);
  bool released(int c, int g) const { return released_.count({c, g}) > 0; }
  // Opens every wave whose reads before it all finished (`finished(read)`, or released)
  // and returns the reads of the waves it opened, to be served where their groups are
  // packed (the others are served as they are packed).
  std::vector<ServedRead> open(const std::function<bool(const ServedRead&)>& finished);
  // Heap bytes of the waves (MemoryUse::metadata; docs/group-order.md, "Memory").
  uint64_t heap_bytes() const;

 private:
  std::vector<std::vector<ServedRead>> waves_;
  std::map<std::pair<int, int>, int> wave_of_;  // (consumer, group) -> its wave
  std::vector<int> pack_at_;                    // per group: its place in the pack order (-1: none)
  // This attempt's: the last wave open, and the reads finished by a release.
  size_t wave_open_ = 0;
  std::set<std::pair<int, int>> released_;
};

}  // namespace ferry::engine
