// The broadcast baseline (internal to the tools): what the NCCL-style design that ferry
// replaces moves, for `ferry plan`, `ferry bench` and `ferry demo` to print beside ferry's
// figures. Not part of the router: no route depends on it.
#pragma once

#include <cstdint>
#include <vector>

#include "ferry/source.h"

namespace ferry::tools {

// One rank per PP stage sends every full tensor of its stage to every inference rank
// (NCCL broadcast designs).
struct BroadcastStats {
  uint64_t bytes = 0;               // total bytes received over all consumers
  uint64_t max_producer_bytes = 0;  // the busiest stage sender
  uint64_t max_consumer_bytes = 0;  // every consumer receives the whole model
  int senders = 0;
};
// `tensor_stage`: the PP stage of each metadata tensor (TrainerHoldings::tensor_stage);
// a tensor past its end counts as stage 0. A pure function.
BroadcastStats broadcast_baseline(const std::vector<TensorDecl>& metadata, const std::vector<int>& tensor_stage,
                                  int num_consumers);

}  // namespace ferry::tools
