#include "engine/push_writes.h"

#include <map>
#include <string>

#include "engine/schedule.h"

namespace ferry::engine {

std::vector<std::vector<PushWrite>> push_writes(const Routes& routes, int rank, int c, const ParamTable& table,
                                                const std::vector<Holdings>& holdings, const InPlaceTable& in_place) {
  ConsumerScheduleInputs in;
  in.routes = &routes;
  in.rank = c;
  in.direct_min_bytes = table.min_bytes;
  in.params = &table.params;  // the consumer's placements, as its ParamSet has them
  in.holdings = &holdings;
  in.in_place.assign(routes.producers.size(), nullptr);
  if (!in_place.empty()) in.in_place[static_cast<size_t>(rank)] = &in_place;
  const ConsumerSchedule cs = make_consumer_schedule(in);
  std::vector<std::vector<PushWrite>> out(cs.groups.size());
  for (size_t g = 0; g < cs.groups.size(); ++g) {
    for (const SubRead& sr : cs.groups[g].reads) {
      if (sr.producer != static_cast<uint32_t>(rank) || !sr.length) continue;
      PushWrite w{sr.region, sr.remote, -1, sr.recv_offset, sr.length};
      if (sr.param) {
        w.param_key = static_cast<int32_t>(sr.param->key);
        w.remote = sr.param->offset + sr.param_offset;
      }
      out[g].push_back(w);
    }
  }
  return out;
}

}  // namespace ferry::engine
