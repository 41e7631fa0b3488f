// engine/attempt_reads.h — a consumer's reads of one attempt (internal): the data plane
// that follows the attempt's plan (engine/sync_plan.h) through the lanes
// (engine/lane.h). It owns the reads in flight, the read-ahead backlog and its pace, and
// knows nothing of announcements, membership or failover: the consumer (the control
// plane) tells it when a group's receive slot is ours, when a producer announced a
// group, when to take a patch or the relay's copy, and waits for what it posted.
//
// Pace (pull): once a producer announced anything of the sync in this attempt, its
// in-place bytes are the trainer's weights of that version until the producer's sync
// ends, so by default they are read *ahead* (into params, lowest group first, a chunk
// at a time while the consumer would otherwise wait) and into each later group's slot
// as soon as the slot is ours. Paced (the rotated order, docs/group-order.md: producers
// pace their announcements), a group's in-place bytes from a producer are read once it
// announced that group, none ahead.
//
// Threading: the consumer's sync thread only. Errors: the lane's (naming the consumer,
// the group and the producer); failed_producer() says whose transfer failed last.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/lane.h"
#include "engine/sync_plan.h"

namespace ferry::engine {

class ParamSet;

class AttemptReads {
 public:
  // `plan` and the lanes outlive this. `ipc`: the CUDA IPC lane, `relay`: the relay lane
  // (null when none). `paced`: see above. `drain_limit` bounds the wait, on
  // destruction, for each read still in flight.
  AttemptReads(const ConsumerAttemptPlan& plan, Lane& transport, Lane* ipc, Lane* relay, bool paced,
               std::chrono::milliseconds drain_limit)
      : plan_(plan), transport_(transport), ipc_(ipc), relay_(relay), paced_(paced), drain_limit_(drain_limit) {}
  // Waits (bounded) for every read still in flight: they must land before the next
  // attempt reuses the receive slots, and before params are declared torn.
  ~AttemptReads();
  AttemptReads(const AttemptReads&) = delete;
  AttemptReads& operator=(const AttemptReads&) = delete;

  // Group g's receive slot, at `slot_offset`, is ours: the in-place bytes into it from
  // producers already in the sync are posted (not paced), kept until take(g, p).
  Status begin_group(int g, uint64_t slot_offset);
  // Producer p announced group g, whose slot is at `slot_offset`: its in-place bytes
  // into the slot are posted and into params join the backlog (paced: of group g; not
  // paced, on p's first announcement this attempt: of g and every later group).
  Status announced(int g, int p, uint64_t slot_offset);
  // Delta: producer p's patch of group g, `patch_bytes` staged at `staging_offset` (its
  // announcement), into its segment's place in the slot at `slot_offset`; appended to
  // `ops`. kNotFound when the plan has no patch read for p (its segment is not one read).
  Status post_patch(int g, int p, uint64_t staging_offset, uint64_t patch_bytes, uint64_t slot_offset,
                    std::vector<Completion>& ops);
  // Whether the plan copies group g from the relay (a relay lane, the host ring).
  bool relayed(int g) const { return relay_ && plan_.groups[static_cast<size_t>(g)].relayed != nullptr; }
  // Group g's bytes from the relay's slot at `offered` (its offer) into the receive slot
  // at `slot_offset`; appended to `ops`.
  Status post_relayed(int g, uint64_t offered, uint64_t slot_offset, std::vector<Completion>& ops);

  // The steps begin_group and announced take (tests drive them one by one).
  // Producer p's bytes of group g in place into the receive slot at `slot_offset` (the
  // slot is ours and p is in the sync): posted, kept until take(g, p).
  Status post_to_slot(int g, int p, uint64_t slot_offset);
  // Producer p's staged bytes of group g, from its staging slot at `staging_offset` (its
  // announcement) into the receive slot at `slot_offset`; appended to `ops`.
  Status post_staged(int g, int p, uint64_t staging_offset, uint64_t slot_offset, std::vector<Completion>& ops);
  // Producer p is known to be in the sync from group g on (it announced g): its bytes in
  // place into params of groups g and later join the backlog (sync_plan's read_ahead).
  void enter(int p, int g);
  // Producer p announced group g (the rotated order, EngineOptions::group_order): its
  // bytes in place into params of group g alone join the backlog, so that reads keep the
  // producer's pace (docs/group-order.md).
  void enter_group(int p, int g);
  // Whether the backlog holds anything (of a group <= g).
  bool backlog_empty() const { return backlog_.empty(); }
  bool backlog_through(int g) const { return !backlog_.empty() && backlog_.begin()->first <= g; }
  // Posts one chunk (kChunk) of the lowest group's backlog. Over shared memory a read is
  // a copy made by the posting thread: in chunks, so the consumer answers
  // announcements between them.
  Status work_one();
  static constexpr uint64_t kChunk = 1 << 20;
  // The reads of group g from producer p posted so far (into the slot, and read ahead
  // into params), for the caller to wait on; forgotten here.
  std::vector<Completion> take(int g, int p);
  // The producer whose transfer failed last (-1: none).
  int failed_producer() const { return failed_; }

 private:
  Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
              std::vector<Completion>& ops);
  struct Item {
    const Transfer* t;
    uint64_t done;
  };
  const ConsumerAttemptPlan& plan_;
  Lane& transport_;
  Lane* ipc_;
  Lane* relay_;
  bool paced_;
  std::chrono::milliseconds drain_limit_;
  std::set<int> in_sync_;  // producers that announced something of the sync this attempt
  std::map<std::pair<int, int>, std::vector<Completion>> posted_;  // (group, producer) -> reads in flight
  std::map<int, std::deque<Item>> backlog_;                        // group -> in-place bytes into params not posted
  int failed_ = -1;
};

// The checksums of group g: each producer's segment (ConsumerGroupSchedule::
// checksum_order: its bytes in staging order, wherever they landed: the receive slot in
// host memory at `slot`, or params) against `sums` (producer -> what it sent). With a
// device receive slot (`device_slot`, CUDA IPC), its `slot_bytes` are copied to `slot`
// first. kCorrupt naming the consumer, the producer and the group on a mismatch.
Status verify_group(int rank, int g, const std::string& group_name, const ConsumerGroupSchedule& gs,
                    const std::map<int, uint64_t>& sums, std::byte* slot, const std::byte* device_slot,
                    uint64_t slot_bytes, const ParamSet& params);

}  // namespace ferry::engine
