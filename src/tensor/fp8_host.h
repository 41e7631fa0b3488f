// The host's FP8 block quantisers (internal; fp8_block_quantize on the host takes the
// widest the CPU runs): exposed so that tests check each one's bits against the element
// path (batch::fp8_quantize_tiles), not only the one this machine picks.
#pragma once

#include <cstdint>
#include <vector>

namespace ferry::detail {

struct Fp8QuantizeKernel {
  // batch::fp8_quantize_tiles' contract: every tile of `in` (element type `type`,
  // [batch, rows, cols] row-major) quantised into `q` (e4m3 bytes) and `scales`.
  using Run = void (*)(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols,
                       int64_t block, uint8_t format, unsigned char* q, unsigned char* scales);
  const char* isa;  // "avx2" | "scalar"
  Run run;
};

// Every kernel this CPU runs, widest first (the scalar element path last and always).
std::vector<Fp8QuantizeKernel> fp8_quantize_kernels();

// The widest, chosen once.
void fp8_quantize_host(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols, int64_t block,
                       uint8_t format, unsigned char* q, unsigned char* scales);

}  // namespace ferry::detail
