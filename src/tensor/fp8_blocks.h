// FP8 e4m3 block quantisation, one tile at a time: the arithmetic the CUDA kernel
// (src/tensor/cuda/) and the host (fp8_block_quantize on Device::host()) share, so both
// give the same bits. A tile is a block x block square of the last two dims; its scale
// is amax / 448 (1 when amax is 0, NaNs ignored), each value becomes e4m3(v / scale)
// rounded to nearest even and saturated at +-448; a NaN quotient stays NaN with v's
// sign (the same on every machine, not the platform's NaN of 0/0 or inf/inf).
#pragma once

#include "tensor/element_convert.h"

namespace ferry::batch {

inline constexpr float kE4M3Max = 448.0f;

// The running amax of a tile after seeing v (NaN ignored, as std::max(amax, |v|)).
FERRY_CONVERT_HD inline float fp8_amax(float amax, float v) {
  const float a = bits_float(float_bits(v) & 0x7fffffffu);
  return a > amax ? a : amax;
}

FERRY_CONVERT_HD inline float fp8_tile_scale(float amax) { return amax > 0.0f ? amax / kE4M3Max : 1.0f; }

FERRY_CONVERT_HD inline unsigned char fp8_quantize(float v, float scale) {
  const float x = v / scale;
  if (x != x) return static_cast<unsigned char>(((float_bits(v) >> 31) << 7) | 0x7f);
  return static_cast<unsigned char>(encode_mini(x, mini_format(kElemE4M3)));
}

// Where tile `tile` (over batch x brows x bcols, row-major) lies: rows [r0, r1), cols
// [c0, c1) of matrix `b`.
struct Fp8Tile {
  int64_t b, r0, r1, c0, c1;
};
FERRY_CONVERT_HD inline Fp8Tile fp8_tile(int64_t tile, int64_t rows, int64_t cols, int64_t block) {
  const int64_t brows = (rows + block - 1) / block, bcols = (cols + block - 1) / block;
  const int64_t b = tile / (brows * bcols), rem = tile % (brows * bcols);
  const int64_t br = rem / bcols, bc = rem % bcols;
  const int64_t r0 = br * block, c0 = bc * block;
  return {b, r0, r0 + block < rows ? r0 + block : rows, c0, c0 + block < cols ? c0 + block : cols};
}

// Every tile, one after another: the host's fp8_block_quantize and the emulated
// plugin's kernel (the real kernel runs the same per-tile steps, a tile per block).
inline void fp8_quantize_tiles(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols,
                               int64_t block, unsigned char* q, unsigned char* scales) {
  const int64_t tiles = batch * ((rows + block - 1) / block) * ((cols + block - 1) / block);
  const uint32_t es = element_size(type);
  for (int64_t t = 0; t < tiles; ++t) {
    const Fp8Tile tl = fp8_tile(t, rows, cols, block);
    const int64_t base = tl.b * rows * cols;
    float amax = 0.0f;
    for (int64_t r = tl.r0; r < tl.r1; ++r)
      for (int64_t c = tl.c0; c < tl.c1; ++c) amax = fp8_amax(amax, load_float(in + (base + r * cols + c) * es, type));
    const float scale = fp8_tile_scale(amax);
    std::memcpy(scales + 4 * t, &scale, 4);  // (any alignment)
    for (int64_t r = tl.r0; r < tl.r1; ++r)
      for (int64_t c = tl.c0; c < tl.c1; ++c) {
        const int64_t i = base + r * cols + c;
        q[i] = fp8_quantize(load_float(in + i * es, type), scale);
      }
  }
}

}  // namespace ferry::batch
