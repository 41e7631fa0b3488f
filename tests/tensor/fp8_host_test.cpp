// The host's FP8 quantiser kernels (AVX2 where the CPU has it, the element path always)
// against the element path, bit for bit: random tiles of bf16 and f32 with NaNs,
// infinities, zeros of both signs, subnormals of both float and e4m3, values that round
// at every tie and that saturate, partial tiles, every scale format.
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tensor/fp8_blocks.h"
#include "tensor/fp8_host.h"

namespace ferry {
namespace {

using namespace ferry::batch;

// A random float whose quotient by a tile scale lands anywhere e4m3 cares about.
uint32_t random_bits(std::mt19937_64& g) {
  std::uniform_int_distribution<int> pick(0, 15);
  switch (pick(g)) {
    case 0: return 0x7fc00000u | static_cast<uint32_t>(g() & 0x803fffffu);  // NaN (any payload, sign)
    case 1: return (g() & 1 ? 0x80000000u : 0) | 0x7f800000u;               // +-inf
    case 2: return g() & 1 ? 0x80000000u : 0;                                // +-0
    case 3: return static_cast<uint32_t>(g() & 0x807fffffu);                 // float denormal
    case 4: {  // e4m3 ties: 3 mantissa bits then exactly a half
      const uint32_t e = 100 + static_cast<uint32_t>(g() % 40);
      return (g() & 1 ? 0x80000000u : 0) | e << 23 | static_cast<uint32_t>(g() % 8) << 20 | 0x80000u;
    }
    default: {
      std::normal_distribution<float> n(0.0f, static_cast<float>(std::ldexp(1.0, static_cast<int>(g() % 40) - 20)));
      float f = n(g);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    }
  }
}

TEST(Fp8Host, KernelsEqualTheElementPath) {
  const auto kernels = detail::fp8_quantize_kernels();
  ASSERT_FALSE(kernels.empty());
  std::printf("kernels:");
  for (const auto& k : kernels) std::printf(" %s", k.isa);
  std::printf("\n");
  std::mt19937_64 g(29);
  for (int trial = 0; trial < 120; ++trial) {
    const uint8_t type = trial % 2 ? kElemBF16 : kElemF32;
    const uint8_t format = static_cast<uint8_t>(trial % 3);
    const int64_t block = format == kScaleMx ? 32 : (trial % 4 < 2 ? 128 : 16);
    const int64_t batch = 1 + static_cast<int64_t>(g() % 2), rows = 1 + static_cast<int64_t>(g() % 70),
                  cols = 1 + static_cast<int64_t>(g() % 300);
    const uint32_t es = element_size(type);
    const int64_t n = batch * rows * cols;
    std::vector<unsigned char> in(static_cast<size_t>(n) * es);
    // Mostly ordinary values, some tiles all special (all NaN, all zero, an infinity).
    const bool sparse = trial % 5 == 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = sparse && g() % 4 ? 0u : random_bits(g);
      if (type == kElemF32) {
        std::memcpy(in.data() + i * 4, &u, 4);
      } else {
        const uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(in.data() + i * 2, &h, 2);
      }
    }
    const int64_t tiles = fp8_num_tiles(batch, rows, cols, fp8_tile_rows(format, block), block);
    std::vector<unsigned char> want_q(static_cast<size_t>(n)), want_s(static_cast<size_t>(tiles) * fp8_scale_bytes(format));
    fp8_quantize_tiles(in.data(), type, batch, rows, cols, block, format, want_q.data(), want_s.data());
    for (const auto& k : kernels) {
      std::vector<unsigned char> q(want_q.size(), 0xee), s(want_s.size(), 0xee);
      k.run(in.data(), type, batch, rows, cols, block, format, q.data(), s.data());
      ASSERT_EQ(s, want_s) << k.isa << " trial " << trial << ": scales";
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(q[static_cast<size_t>(i)], want_q[static_cast<size_t>(i)])
            << k.isa << " trial " << trial << " element " << i << " of [" << batch << ", " << rows << ", " << cols
            << "] block " << block << " format " << int(format);
      }
    }
  }
}

}  // namespace
}  // namespace ferry
