// libFuzzer target: apply_patch on arbitrary bytes, over a target of the size the header
// names (up to 64 KiB; a fixed pseudo-random base). It must never touch memory outside
// the target or the patch; when it succeeds, the target must hash to the header's hash
// (apply checked it) and a patch re-encoded from the base must reproduce the target.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "delta/patch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry::delta;
  const std::span<const std::byte> patch(reinterpret_cast<const std::byte*>(data), size);
  auto header = read_patch_header(patch);
  if (!header.ok()) return 0;
  if (header->elems > (1u << 16) / header->elem_size) return 0;
  std::vector<std::byte> base(header->elems * header->elem_size);
  uint32_t x = 12345;
  for (auto& b : base) b = std::byte((x = x * 1103515245u + 12345u) >> 24);
  std::vector<std::byte> target = base;
  if (!apply_patch(target, patch).ok()) return 0;
  auto again = encode_patch(base, target, header->elem_size);
  if (!again.ok()) __builtin_trap();
  std::vector<std::byte> check = base;
  if (!apply_patch(check, *again).ok() || check != target) __builtin_trap();
  return 0;
}
