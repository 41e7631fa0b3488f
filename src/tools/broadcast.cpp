#include "tools/broadcast.h"

#include <algorithm>
#include <unordered_map>

namespace ferry::tools {

BroadcastStats broadcast_baseline(const std::vector<TensorDecl>& metadata, const std::vector<int>& tensor_stage,
                                  int num_consumers) {
  BroadcastStats b;
  std::unordered_map<int, uint64_t> stage_bytes;
  uint64_t model = 0;
  for (size_t t = 0; t < metadata.size(); ++t) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(metadata[t].shape)) * dtype_size(metadata[t].dtype);
    model += bytes;
    stage_bytes[t < tensor_stage.size() ? tensor_stage[t] : 0] += bytes;
  }
  const uint64_t n = static_cast<uint64_t>(std::max(num_consumers, 0));
  b.bytes = model * n;
  b.max_consumer_bytes = n ? model : 0;
  b.senders = static_cast<int>(stage_bytes.size());
  for (auto& [s, bytes] : stage_bytes) b.max_producer_bytes = std::max(b.max_producer_bytes, bytes * n);
  return b;
}

}  // namespace ferry::tools
