// The consumer's side of delta syncs (engine/delta_applier.h).
#include "engine/delta_applier.h"

#include <fmt/format.h>

#include "delta/patch.h"

namespace ferry::engine {

bool DeltaApplier::takes_patch(const ParamSet& params, int g, uint64_t base) const {
  if (!enabled_ || on_device_ || params.device() || landed_.count(g)) return false;
  const ConsumerState st = params.state();
  return st.has_version && st.version == base && !st.torn && !st.mixed;
}

std::optional<uint64_t> DeltaApplier::patch_base(const ParamSet& params, int g) const {
  const ConsumerState st = params.state();
  if (st.has_version && takes_patch(params, g, st.version)) return st.version;
  return std::nullopt;
}

Status DeltaApplier::apply(const ParamSet& params, const PlanRoute& unpack, int g, int p, const Read& read,
                           uint64_t patch_bytes, uint64_t group_bytes, std::byte* slot) {
  std::byte* seg = slot + read.recv_offset;
  copy_.assign(seg, seg + patch_bytes);
  // The base: the live params as loaded, not the shadow syncs land in nor the tensors
  // post-processing replaced params with (committed()'s view): in place the buffers
  // loaded; under shadow and groups the live buffers (a flip makes the buffers a sync
  // unpacked into live; a groups commit copies the unpacked bytes into them; a shadow
  // copy commit leaves a replaced param's live buffer as it was: its patches are repaired).
  const TensorMap& live = params.groups() || params.shadow() ? params.live() : params.loaded();
  Status st = gather_group(unpack, g, read.recv_offset, read.recv_offset + read.length, live,
                           std::span<std::byte>(slot, group_bytes));
  if (st.ok()) st = delta::apply_patch(std::span<std::byte>(seg, read.length), copy_);
  if (!st.ok()) return st.with_context(fmt::format("consumer {} group {} producer {}", rank_, g, p));
  return st;
}

}  // namespace ferry::engine
