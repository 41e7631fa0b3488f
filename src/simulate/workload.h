// What each design moves, from a job's real routes (docs/simulation.md, "The designs"):
// the routes `ferry plan` computes give, per layer group, every producer's pack bytes,
// every consumer's reads (merged per producer: one endpoint per peer) and unpack bytes.
// The sharded-gather design is routed from the same trainer with TP gathered (tp=1, the
// TP ranks as replicas) plus the all-gather flows into each TP rank; the broadcast
// design gathers every tensor of a stage on its first rank and broadcasts it whole.
#pragma once

#include <cstdint>
#include <string>

#include "delta/patch.h"
#include "engine/group_order.h"
#include "ferry/models.h"
#include "ferry/status.h"
#include "simulate/simulate.h"

namespace ferry::simulate {

struct JobSpec {
  std::string model;             // HF config.json (tools::find_model_config)
  std::string config_overrides;  // JSON merge patch ({"quantization_config": null}: bf16)
  std::string trainer;           // TrainerLayout text
  std::string inference;         // InferenceLayout text
  uint64_t staging_budget = 0;   // ProducerOptions::staging_budget (0: two slots)
  int groups_in_flight = 1;      // Workload::groups_in_flight (a consumer's receive budget, in groups)
  // > 0: every inference rank relays (ConsumerOptions::relay) within its node of this many
  // GPUs (the cluster's gpus_per_node): relay groups as the engine makes them, in one
  // cohort each, their members copying from their relay (Workload::relay_of).
  int relay_node_gpus = 0;
  bool shrink = false;           // route shrink_config's small variant (as ferry demo does)
  // The order groups move in (ferry's design): the engine's own make_group_order.
  engine::GroupOrderOptions order;
  // What the inference ranks keep (LoaderOptions::quantize) and, with fp8, whether the
  // producers quantise the params they can: the engine's own routes under
  // RouterOptions::quantize_on (issue 29), FP8 values and scales on the wire.
  Quantize quantize = Quantize::kNone;
  bool quantize_on_producer = false;
};

struct JobWorkload {
  Workload work;
  uint64_t model_bytes = 0;
  uint64_t bytes_moved = 0;        // over the network and NVLink, all transfers
  uint64_t max_consumer_bytes = 0; // what the busiest inference rank receives
  int producers = 0, consumers = 0;
  double route_seconds = 0;        // wall time to record plans and route
  int lanes = 0;                   // the group order's lanes (engine/group_order.h)
  std::vector<int> cohort_sizes;   // consumers per cohort
  std::vector<int> lane_groups;    // layer groups per lane
  std::vector<int> round_lanes;    // lanes per round
  std::string order_summary;       // GroupOrder::summary()
  double element_bytes = 2;        // the model's bytes per element (fp8 experts beside bf16: between 1 and 2)
  // After apply_delta: each transfer's bytes as a fraction of its dense bytes.
  double patch_ratio = 1;
  // With JobSpec::quantize_on_producer: the quantised params (over plan classes) and
  // those whose every tile comes from one producer (quantised there: FP8 values and
  // scales on the wire instead of the trainer's bf16).
  uint64_t quantized_params = 0, quantized_on_producer = 0;
  // Per inference rank (replica-major: rank c is in replica c / engine_size): its plan
  // class and the bytes of its params, what a joiner's catch-up reads from a replica of
  // its class (Consumer::catch_up). Ferry's design.
  int engine_size = 0;
  std::vector<uint32_t> consumer_plan;
  std::vector<uint64_t> consumer_param_bytes;
};

// Errors: the config, the layouts, routing (each names what failed); a design that
// needs a Megatron trainer (sharded-gather, broadcast) given an FSDP one; a group order
// other than the layer order, or quantisation on the producer, for a design other than
// ferry's; quantisation on the producer without a quantize.
Result<JobWorkload> build_workload(const JobSpec& job, Design design);

// A delta sync (issue 28, docs/delta.md) instead of a dense one, ferry's design only:
// `fraction` of the elements changed since the version every consumer holds, laid out
// as `layout`. Each transfer carries the patch (delta::predicted_patch_ratio of its
// bytes, at least the 32-byte header); packing reads the kept copy and the new bytes,
// writes the patch and updates the copy ((3 + ratio) / 2 a dense pack's memory traffic);
// unpacking reads the patch, writes the changed elements and hashes every kept byte for
// the end-to-end check ((1 + 2 ratio) / 2 a dense unpack's). Errors: a fraction outside
// [0, 1]; a design other than ferry's.
Status apply_delta(JobWorkload& job, Design design, double fraction, delta::ChangeLayout layout);

// A catch-up (Consumer::catch_up, docs/elastic.md): the last `joiners` replicas of the
// job are new and read every param from the replicas that hold the version (the first
// replicas - joiners), each joiner from the place the engine's tree gives it
// (engine::catch_up_parent): per round, one flow per joiner, holder (or an earlier
// round's joiner) -> joiner, of its params' bytes (endpoints as in Flow). Errors:
// `joiners` outside [1, replicas - 1]; a workload without per-rank params (not ferry's).
Result<std::vector<std::vector<Flow>>> catch_up_rounds(const JobWorkload& job, int joiners);

}  // namespace ferry::simulate
