// `ferry simulate`'s core (docs/simulation.md): a sync as flows on a SimGrid platform
// built from a ClusterSpec. The workload is design-neutral data computed from the real
// routes (workload.h); this file owns the platform, the actors of each design and the
// figures they report.
//
// Threading and lifetime: SimGrid's engine is a process-wide singleton that cannot be
// created twice, so run_simulation() may be called once per process; a second call
// returns FailedPrecondition (the tests run each simulation in a child process).
// Errors: a workload that does not fit the cluster (more ranks than GPUs), named with
// both numbers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.h"
#include "simulate/cluster.h"

namespace ferry::simulate {

enum class Design : uint8_t { kFerry, kBroadcast, kShardedGather };
enum class Mode : uint8_t { kPull, kPush };
Result<Design> parse_design(std::string_view text);  // ferry | broadcast | sharded-gather
Result<Mode> parse_mode(std::string_view text);      // pull | push
std::string_view design_name(Design d);
std::string_view mode_name(Mode m);

// One flow between two ranks. Trainer ranks are 0..producers-1; inference ranks are
// producers..producers+consumers-1 (an "endpoint" index).
struct Flow {
  uint32_t from = 0, to = 0;
  uint64_t bytes = 0;
  uint32_t ops = 1;  // reads (or writes) this flow stands for: each costs overhead.read
};

// One layer group of a sync, in the order the engine syncs them.
struct GroupWork {
  int stage = 0;                      // the trainer PP stage that holds it
  std::vector<uint64_t> pack_bytes;   // per producer: bytes packed into its staging
  std::vector<uint64_t> unpack_bytes; // per consumer: bytes unpacked from its receive slot
  std::vector<Flow> transfers;        // producer -> consumer (one per pair: one endpoint per peer)
  std::vector<Flow> gather;           // trainer -> trainer before packing (sharded-gather, broadcast)
  int root = 0;                       // broadcast: the stage's root producer
  uint64_t broadcast_bytes = 0;       // broadcast: the group's full tensors (what the root broadcasts)
  uint32_t tensors = 0;               // broadcast: collective calls of the group
};

struct Workload {
  int producers = 0, consumers = 0;
  std::vector<GroupWork> groups;
  int staging_slots = 2;      // producer staging ring (the engine's default: two slots)
  int receive_slots = 2;      // consumer receive ring (the engine's: two slots)
  // Groups a consumer reads at once (its receive budget): 1 is the engine today (a group's
  // reads posted once the group before it landed); N > 1 posts the next group's reads
  // while up to N - 1 earlier ones are still in flight, with N - 1 more receive slots.
  int groups_in_flight = 1;
  // Relay within a node (ConsumerOptions::relay, docs/relay.md), ferry's design: per
  // consumer, the consumer it copies every group from once that one has it (its relay:
  // the lowest of its plan class on its node), or -1 where it reads from the producers.
  // A member reads nothing from the producers; its copy is a flow inside the node.
  std::vector<int> relay_of;
  bool serial_stages = false; // sharded-gather: PP stages served one after another
  // The engine's group order (engine/group_order.h), ferry's design only: per consumer the
  // groups in the order it reads them, per producer in the order it packs them. Empty:
  // every rank in layer order (the engine today).
  std::vector<std::vector<int>> consumer_order;
  std::vector<std::vector<int>> producer_order;
  // Paced (GroupOrder::paced, engine::serve_waves): per producer, its reads (consumer,
  // group) in the waves it serves them in; a wave once every read of the waves before it
  // finished. Empty: each read as soon as its group is packed.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> waves;
};

// A NIC (one direction each way) and what crossed it.
struct NicUse {
  std::string name;  // "trainer node 3 nic 1"
  bool trainer = false;
  double rate = 0;    // bytes/s one direction (payload)
  uint64_t bytes_in = 0, bytes_out = 0;
};

struct SimResult {
  double seconds = 0;  // the sync: until the last consumer holds every group
  // Critical path: the phases of the rank that finished last, summing to `seconds`.
  std::vector<std::pair<std::string, double>> critical_path;
  std::vector<NicUse> nics;
  size_t busiest_rx = 0, busiest_tx = 0;  // indices into nics
  double floor_seconds = 0;     // max(busiest receiving NIC bytes / rate, busiest sending / rate)
  double rx_floor_seconds = 0;  // busiest receiving NIC bytes / its rate
  // Sum over groups of the group's own floor (its busiest NIC, in or out): the sync if
  // every consumer took the same group at the same time. Not a bound (consumers may be
  // in different groups at once); it tells when the group order, not the bytes, decides.
  double lockstep_seconds = 0;
  // The same for the workload's group order: the sum over steps k of the busiest NIC's
  // bytes / rate when every consumer reads its k-th group at once (= lockstep_seconds in
  // layer order).
  double order_lockstep_seconds = 0;
  uint64_t flows = 0;
  // NIC receive utilisation over time (for --plot): bins of `bin_seconds`, per NIC of
  // the inference side (the busiest 8), assuming each flow's bytes spread evenly over its life.
  double bin_seconds = 0;
  std::vector<std::pair<std::string, std::vector<double>>> rx_timeline;
};

struct SimOptions {
  Design design = Design::kFerry;
  Mode mode = Mode::kPull;
  int timeline_bins = 100;
};

Result<SimResult> run_simulation(const ClusterSpec& cluster, const Workload& work, const SimOptions& options);

// The oracle tests' entry: every flow starts at time 0 on the cluster's platform (no
// engine protocol); returns the time the last one ends.
Result<double> run_flows(const ClusterSpec& cluster, int producers, int consumers, const std::vector<Flow>& flows);

// Rounds of flows, one after another (a catch-up's tree, workload.h catch_up_rounds):
// every flow of a round starts once the round before has ended. Returns each round's end
// time. One SimGrid engine, as run_flows.
Result<std::vector<double>> run_rounds(const ClusterSpec& cluster, int producers, int consumers,
                                       const std::vector<std::vector<Flow>>& rounds);

}  // namespace ferry::simulate
