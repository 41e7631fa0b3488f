// FP8 e4m3 block quantisation, one tile at a time: the arithmetic the CUDA kernel
// (src/tensor/cuda/) and the host (fp8_block_quantize on Device::host()) share, so both
// give the same bits. Each value becomes e4m3(v / scale) rounded to nearest even and
// saturated at +-448; a NaN quotient stays NaN with v's sign (the same on every machine,
// not the platform's NaN of 0/0 or inf/inf). Tiles and scales by format
// (Fp8ScaleFormat): block x block squares of the last two dims with scale amax / 448 in
// fp32 (1 when amax is 0: vLLM/DeepSeek's weight_scale_inv), the same squares with the
// scale rounded up to a power of two and stored as its E8M0 byte (UE8M0: DeepGEMM /
// SGLang), or 1 x block runs of a row (MXFP8, OCP MX v1.0: scale 2^(floor(log2 amax) - 8),
// E8M0). NaNs are ignored in amax; an all-zero tile's scale is 1 (E8M0 byte 127, never
// the byte 0 some kernels misread), an infinite amax's 2^127; E8M0 exponents are clamped
// to [-127, 127].
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

// Fp8Scales (ferry/device.h) as the kernel sees it.
enum Fp8ScaleFormat : uint8_t { kScaleF32 = 0, kScaleUe8m0 = 1, kScaleMx = 2 };

FERRY_CONVERT_HD inline int64_t fp8_tile_rows(uint8_t format, int64_t block) { return format == kScaleMx ? 1 : block; }
FERRY_CONVERT_HD inline uint32_t fp8_scale_bytes(uint8_t format) { return format == kScaleF32 ? 4u : 1u; }

// floor / ceil of log2 of a positive float, exactly, from its bits (subnormals included;
// infinity gives 128).
FERRY_CONVERT_HD inline int fp8_floor_log2(float a) {
  const uint32_t u = float_bits(a) & 0x7fffffffu;
  const int e = static_cast<int>(u >> 23);
  if (e == 0xff) return 128;
  if (e != 0) return e - 127;
  int k = 22;  // subnormal: a = m x 2^-149
  while (k > 0 && !((u >> k) & 1u)) --k;
  return k - 149;
}
FERRY_CONVERT_HD inline int fp8_ceil_log2(float a) {
  const uint32_t u = float_bits(a) & 0x7fffffffu;
  const int f = fp8_floor_log2(a);
  if (f == 128) return 128;
  const bool power_of_two = (u >> 23) != 0 ? (u & 0x7fffffu) == 0 : (u & (u - 1)) == 0;
  return power_of_two ? f : f + 1;
}
// 2^e for e in [-127, 127] (2^-127 is subnormal).
FERRY_CONVERT_HD inline float fp8_pow2(int e) {
  return e >= -126 ? bits_float(static_cast<uint32_t>(e + 127) << 23) : bits_float(0x00400000u);
}

// A tile's scale under `format` from its amax, written to `stored` (4 bytes of fp32, or
// the E8M0 byte); returns the scale values are divided by.
FERRY_CONVERT_HD inline float fp8_scale(uint8_t format, float amax, unsigned char* stored) {
  if (format == kScaleF32) {
    const float s = fp8_tile_scale(amax);
    std::memcpy(stored, &s, 4);
    return s;
  }
  int e = 0;  // an all-zero tile: scale 1
  if (amax > 0.0f) {
    const int lg = format == kScaleUe8m0 ? fp8_ceil_log2(amax / kE4M3Max) : fp8_floor_log2(amax);
    e = lg == 128 ? 127 : (format == kScaleUe8m0 ? lg : lg - 8);  // an infinite amax: the largest scale
  }
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  *stored = static_cast<unsigned char>(e + 127);
  return fp8_pow2(e);
}

// encode_mini(x, e4m3fn) in integer arithmetic on x's bits, the same code for every
// float (FP8.E4m3EncoderEqualsTheGenericOne; the generic one calls frexp, ldexp and
// nearbyint per element, which made the host quantiser run at ~30 M elements/s):
// round to nearest even, saturating at +-448 (infinity too), NaN as 0x7f with x's sign.
FERRY_CONVERT_HD inline unsigned char encode_e4m3fn(float x) {
  const uint32_t xb = float_bits(x);
  const uint32_t sign = (xb >> 31) << 7;
  const uint32_t mag = xb & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7f);  // NaN
  const int e = static_cast<int>(mag >> 23) - 127;                        // (denormal floats: -127)
  uint32_t code;
  if (e < -6) {
    // Below e4m3's smallest normal (2^-6): units of 2^-9, the 24-bit significand shifted
    // down with round to nearest even (8 units is the smallest normal's code too).
    if (mag < 0x00800000u) return static_cast<unsigned char>(sign);  // a float denormal: below 2^-126
    const uint32_t sig = (mag & 0x7fffffu) | 0x800000u;
    const int shift = 14 - e;  // sig x 2^(e - 23) / 2^-9
    if (shift >= 32) return static_cast<unsigned char>(sign);
    const uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
    code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  } else {
    if (e > 8) return static_cast<unsigned char>(sign | 0x7e);  // beyond 448 (and infinity): saturate
    uint32_t q = (mag & 0x7fffffu) >> 20;
    const uint32_t rem = mag & 0xfffffu, half = 0x80000u;
    q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
    code = (static_cast<uint32_t>(e + 7) << 3) + q;  // a mantissa rounding up to 8 carries into the exponent
    if (code > 0x7eu) code = 0x7eu;
  }
  return static_cast<unsigned char>(sign | code);
}

FERRY_CONVERT_HD inline unsigned char fp8_quantize(float v, float scale) {
  const float x = v / scale;
  if (x != x) return static_cast<unsigned char>(((float_bits(v) >> 31) << 7) | 0x7f);
  return encode_e4m3fn(x);
}

// Where tile `tile` (over batch x brows x bcols, row-major; tiles of `trows` x `block`)
// lies: rows [r0, r1), cols [c0, c1) of matrix `b`.
struct Fp8Tile {
  int64_t b, r0, r1, c0, c1;
};
FERRY_CONVERT_HD inline int64_t fp8_num_tiles(int64_t batch, int64_t rows, int64_t cols, int64_t trows, int64_t block) {
  return batch * ((rows + trows - 1) / trows) * ((cols + block - 1) / block);
}
FERRY_CONVERT_HD inline Fp8Tile fp8_tile(int64_t tile, int64_t rows, int64_t cols, int64_t trows, int64_t block) {
  const int64_t brows = (rows + trows - 1) / trows, bcols = (cols + block - 1) / block;
  const int64_t b = tile / (brows * bcols), rem = tile % (brows * bcols);
  const int64_t br = rem / bcols, bc = rem % bcols;
  const int64_t r0 = br * trows, c0 = bc * block;
  return {b, r0, r0 + trows < rows ? r0 + trows : rows, c0, c0 + block < cols ? c0 + block : cols};
}

// An element as the quantiser reads it. bf16 is the top half of an f32, so its bits
// shifted are its value (load_float's generic decoder, with ldexp, gives the same value:
// every non-NaN bf16 is exact in f32, and a NaN's payload is never looked at: amax skips
// it and a NaN quotient becomes 0x7f with the element's sign).
inline constexpr uint8_t kElemAny = 255;  // fp8_load: the type given at run time

template <uint8_t kType>
inline float fp8_load(const unsigned char* p, uint8_t type) {
  if constexpr (kType == kElemBF16) {
    return bits_float((static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8)) << 16);
  } else if constexpr (kType == kElemF32) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return bits_float(u);
  } else {
    return load_float(p, type);
  }
}

template <uint8_t kType>
inline void fp8_quantize_tiles_of(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols, int64_t block,
                                  uint8_t format, unsigned char* q, unsigned char* scales) {
  const int64_t trows = fp8_tile_rows(format, block);
  const int64_t tiles = fp8_num_tiles(batch, rows, cols, trows, block);
  const uint32_t es = element_size(type);
  for (int64_t t = 0; t < tiles; ++t) {
    const Fp8Tile tl = fp8_tile(t, rows, cols, trows, block);
    const int64_t base = tl.b * rows * cols;
    float amax = 0.0f;
    for (int64_t r = tl.r0; r < tl.r1; ++r) {
      const unsigned char* row = in + (base + r * cols) * es;
      for (int64_t c = tl.c0; c < tl.c1; ++c) amax = fp8_amax(amax, fp8_load<kType>(row + c * es, type));
    }
    const float scale = fp8_scale(format, amax, scales + fp8_scale_bytes(format) * t);  // (any alignment)
    for (int64_t r = tl.r0; r < tl.r1; ++r) {
      const unsigned char* row = in + (base + r * cols) * es;
      unsigned char* out = q + base + r * cols;
      for (int64_t c = tl.c0; c < tl.c1; ++c) out[c] = fp8_quantize(fp8_load<kType>(row + c * es, type), scale);
    }
  }
}

// Every tile, one after another: the host's fp8_block_quantize and the emulated
// plugin's kernel (the real kernel runs the same per-tile steps, a tile per block).
inline void fp8_quantize_tiles(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols,
                               int64_t block, uint8_t format, unsigned char* q, unsigned char* scales) {
  switch (type) {
    case kElemBF16: return fp8_quantize_tiles_of<kElemBF16>(in, type, batch, rows, cols, block, format, q, scales);
    case kElemF32: return fp8_quantize_tiles_of<kElemF32>(in, type, batch, rows, cols, block, format, q, scales);
    default: return fp8_quantize_tiles_of<kElemAny>(in, type, batch, rows, cols, block, format, q, scales);
  }
}

}  // namespace ferry::batch
