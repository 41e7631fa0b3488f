#include "engine/push_writes.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/schedule.h"
#include "engine/staging_ring.h"

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

void post_push_writes(Transport& transport, const StagingRing& staging, uint64_t staging_offset,
                      const std::vector<PushWrite>& writes, const PushTarget& to,
                      std::function<void(const Status&)> first_error, std::function<void(const Status&)> end) {
  // The sequence ends once every write posted has completed, not at the first error:
  // until then bytes may still land in the consumer's params. `left` counts the writes
  // not yet completed plus this posting thread, so the end runs exactly once.
  struct Sequence {
    std::mutex mu;
    size_t left = 0;
    Status error;
  };
  auto seq = std::make_shared<Sequence>();
  seq->left = writes.size() + 1;
  const PeerId peer = to.peer;
  auto flushed = [&transport, peer, first_error, end]() {
    auto fl = transport.flush(peer, [first_error, end](const Status& st) {
      if (!st.ok()) first_error(st);
      end(st);
    });
    if (!fl.ok()) {
      first_error(fl.status());
      end(fl.status());
    }
  };
  auto one_done = [seq, first_error, end, flushed](const Status& st) {
    Status error;
    bool first = false, last;
    {
      std::lock_guard<std::mutex> lk(seq->mu);
      if (!st.ok() && seq->error.ok()) {
        seq->error = st;
        first = true;
      }
      last = --seq->left == 0;
      error = seq->error;
    }
    if (first) first_error(st);
    if (!last) return;
    if (error.ok()) {
      flushed();
    } else {
      end(error);
    }
  };
  bool refused = false;
  for (const PushWrite& w : writes) {
    if (refused) {  // not posted after an error: nothing of it can land
      one_done(Status::Ok());
      continue;
    }
    const MemoryRegion& from = staging.region(w.region);
    const uint64_t from_at = w.region < 0 ? staging_offset + w.local : w.local;
    const bool to_param = w.param_key >= 0 && static_cast<size_t>(w.param_key) < to.params.size();
    const RemoteRegion& into = to_param ? to.params[static_cast<size_t>(w.param_key)] : to.recv;
    const uint64_t to_at = to_param ? w.remote : to.slot_offset + w.remote;
    auto posted = transport.write(from, from_at, into, to_at, w.length, one_done);
    if (!posted.ok()) {
      refused = true;
      one_done(posted.status());
    }
  }
  one_done(Status::Ok());
}

}  // namespace ferry::engine
