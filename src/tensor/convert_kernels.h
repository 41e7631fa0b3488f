// The host's f32 -> bf16 kernels (internal; strided_copy takes the widest the CPU runs):
// exposed so that tests check each one's bits against the element path, not only the one
// this machine picks, and benchmarks compare them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ferry::detail {

struct F32ToBf16Kernel {
  // Converts the longest prefix of `n` contiguous f32 at `src` that is a multiple of the
  // kernel's width into bf16 at `dst` (round to nearest even, NaN kept quiet with its
  // sign: load_element/store_element's bits) and returns its length; the caller converts
  // the rest.
  using Run = int64_t (*)(const std::byte* src, std::byte* dst, int64_t n);
  const char* isa;  // "avx2" | "sse2"
  Run run;
};

// Every kernel this CPU runs, widest first (SSE2, the x86-64 baseline, last and always).
std::vector<F32ToBf16Kernel> f32_to_bf16_kernels();

}  // namespace ferry::detail
