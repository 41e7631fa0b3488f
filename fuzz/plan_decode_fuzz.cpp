// libFuzzer target: Plan::decode on arbitrary bytes. A decoded plan must validate,
// re-encode to a plan that decodes equal, canonicalise, and (when small) replay
// without touching memory outside its tensors.
#include <cstddef>
#include <cstdint>

#include "ferry/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry;
  auto plan = Plan::decode(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (!plan.ok()) return 0;
  if (!plan->validate().ok()) __builtin_trap();
  auto again = Plan::decode(plan->encode());
  if (!again.ok() || !(*again == *plan)) __builtin_trap();
  Plan canon = *plan;
  canon.canonicalize();
  if (!canon.validate().ok()) __builtin_trap();

  // Replay small plans for real: ASan catches any access outside the tensors.
  int64_t total = 0;
  for (const auto& d : plan->sources()) total += shape_numel(d.shape);
  for (const auto& d : plan->params()) total += shape_numel(d.shape);
  uint64_t work = 0;
  for (const auto& c : plan->copies()) work += static_cast<uint64_t>(c.src.numel());
  for (const auto& z : plan->zeros()) work += static_cast<uint64_t>(z.dst.numel());
  if (total > (1 << 16) || work > (1 << 18)) return 0;
  (void)plan->check_coverage(true);
  TensorMap sources, params;
  for (const auto& d : plan->sources()) sources.emplace(d.name, Tensor::empty(d.shape, d.dtype));
  for (const auto& d : plan->params()) params.emplace(d.name, Tensor::empty(d.shape, d.dtype));
  if (!execute(*plan, sources, params).ok()) __builtin_trap();
  if (!execute(canon, sources, params).ok()) __builtin_trap();
  return 0;
}
