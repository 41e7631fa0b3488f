#include "engine/pacer.h"

#include <fmt/format.h>

namespace ferry::engine {

Result<Pacer> Pacer::make(const Routes& routes, int rank, const GroupOrderOptions& order) {
  Pacer p;
  if (order.kind != GroupOrderKind::kRotated || !order.paced) return p;
  const GroupOrder o = make_group_order(routes, order);
  FERRY_RETURN_IF_ERROR(check_group_order(routes, o).with_context(fmt::format("producer {}", rank)));
  p.waves_ = serve_waves(routes, o, rank);
  for (size_t i = 0; i < p.waves_.size(); ++i)
    for (const ServedRead& x : p.waves_[i]) p.wave_of_[{x.consumer, x.group}] = static_cast<int>(i);
  p.pack_at_.assign(static_cast<size_t>(routes.num_groups()), -1);
  const std::vector<int>& mine = o.producer[static_cast<size_t>(rank)];
  for (size_t i = 0; i < mine.size(); ++i) p.pack_at_[static_cast<size_t>(mine[i])] = static_cast<int>(i);
  return p;
}

int Pacer::pack_position(int g) const {
  const auto gi = static_cast<size_t>(g);
  return gi < pack_at_.size() && pack_at_[gi] >= 0 ? pack_at_[gi] : g;
}

bool Pacer::turn(int c, int g) const {
  auto it = wave_of_.find({c, g});
  return it == wave_of_.end() || static_cast<size_t>(it->second) <= wave_open_;
}

void Pacer::begin_attempt() {
  wave_open_ = 0;
  released_.clear();
}

void Pacer::note_released(int c, int g) {
  if (!waves_.empty()) released_.emplace(c, g);
}

std::vector<ServedRead> Pacer::open(const std::function<bool(const ServedRead&)>& finished) {
  std::vector<ServedRead> opened;
  while (wave_open_ + 1 < waves_.size()) {
    for (const ServedRead& r : waves_[wave_open_])
      if (!released(r.consumer, r.group) && !finished(r)) return opened;
    ++wave_open_;
    opened.insert(opened.end(), waves_[wave_open_].begin(), waves_[wave_open_].end());
  }
  return opened;
}

uint64_t Pacer::heap_bytes() const {
  if (waves_.empty()) return 0;
  uint64_t b = waves_.capacity() * sizeof(waves_[0]) + pack_at_.capacity() * sizeof(int) +
               wave_of_.size() * (sizeof(std::pair<const std::pair<int, int>, int>) + 4 * sizeof(void*)) +
               released_.size() * (sizeof(std::pair<int, int>) + 4 * sizeof(void*));
  for (const auto& w : waves_) b += w.capacity() * sizeof(ServedRead);
  return b;
}

}  // namespace ferry::engine
