// Conversion of one element between ferry's float dtypes (bf16, f16, f32, float8 e4m3fn,
// float8 e5m2), shared by the CUDA batch kernel (batch_layout.h's copy_word) and the
// host, so that a conversion on the GPU gives the same bits as strided_copy on the CPU.
//
// The host converts through double (dtype.cpp's load_element / store_element). Every
// value of these dtypes is exact in float, and each step below (scaling by a power of
// two, rounding a value below 2^11 to an integer, to nearest even) is exact in float
// too, so going through float gives the same bits: rounding to nearest even, e4m3fn
// saturating to +-448, the others overflowing to infinity, a NaN staying NaN (the
// canonical quiet NaN when it comes from a small format, as the host decodes it).
// Tested exhaustively against load_element / store_element (device_test).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FERRY_CONVERT_HD __host__ __device__
#else
#define FERRY_CONVERT_HD
#endif

namespace ferry::batch {

// DType's values (ferry/tensor.h) of the float dtypes, as the kernel sees them.
enum ElementType : uint8_t { kElemBF16 = 0, kElemF16 = 1, kElemF32 = 2, kElemE4M3 = 3, kElemE5M2 = 4 };
// CopyDesc::src_type / dst_type of a plain byte copy.
inline constexpr uint8_t kNoConversion = 0xff;

struct MiniFormat {
  int ebits, mbits;
  bool fn;  // e4m3fn: no infinities, only all-ones is NaN, overflow saturates
};

FERRY_CONVERT_HD inline MiniFormat mini_format(uint8_t type) {
  switch (type) {
    case kElemBF16: return {8, 7, false};
    case kElemF16: return {5, 10, false};
    case kElemE4M3: return {4, 3, true};
    default: return {5, 2, false};  // kElemE5M2
  }
}

FERRY_CONVERT_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

FERRY_CONVERT_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

FERRY_CONVERT_HD inline float scale2(float x, int e) {
#if defined(__CUDA_ARCH__)
  return ldexpf(x, e);
#else
  return std::ldexp(x, e);
#endif
}

FERRY_CONVERT_HD inline float round_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

FERRY_CONVERT_HD inline int exponent_of(float a) {  // a in [2^e, 2^(e+1)), a > 0 finite
#if defined(__CUDA_ARCH__)
  int e2;
  frexpf(a, &e2);
  return e2 - 1;
#else
  int e2;
  std::frexp(a, &e2);
  return e2 - 1;
#endif
}

FERRY_CONVERT_HD inline float decode_mini(uint32_t bits, MiniFormat f) {
  const uint32_t mmask = (1u << f.mbits) - 1;
  const uint32_t emask = (1u << f.ebits) - 1;
  const bool neg = (bits >> (f.ebits + f.mbits)) & 1;
  const uint32_t e = (bits >> f.mbits) & emask;
  const uint32_t m = bits & mmask;
  const int bias = (1 << (f.ebits - 1)) - 1;
  if (f.fn) {
    if (e == emask && m == mmask) return bits_float(0x7fc00000u);
  } else if (e == emask) {
    if (m != 0) return bits_float(0x7fc00000u);
    return bits_float(neg ? 0xff800000u : 0x7f800000u);
  }
  const float v = e == 0 ? scale2(static_cast<float>(m), 1 - bias - f.mbits)
                         : scale2(static_cast<float>(m | (1u << f.mbits)), static_cast<int>(e) - bias - f.mbits);
  return neg ? -v : v;
}

FERRY_CONVERT_HD inline uint32_t encode_mini(float x, MiniFormat f) {
  const uint32_t xb = float_bits(x);
  const uint32_t sign = (xb >> 31) ? (1u << (f.ebits + f.mbits)) : 0;
  const uint32_t emask = (1u << f.ebits) - 1;
  const uint32_t mmask = (1u << f.mbits) - 1;
  const uint32_t max_finite = f.fn ? ((emask << f.mbits) | (mmask - 1)) : (((emask - 1) << f.mbits) | mmask);
  const uint32_t mag = xb & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | (emask << f.mbits) | mmask;                                   // NaN
  if (mag == 0x7f800000u) return f.fn ? (sign | max_finite) : (sign | (emask << f.mbits));          // infinity
  if (mag == 0) return sign;
  const float a = bits_float(mag);
  int exp = exponent_of(a);
  const int bias = (1 << (f.ebits - 1)) - 1;
  const int min_exp = 1 - bias;
  uint32_t code;
  if (exp < min_exp) {
    // Subnormal: units of 2^(min_exp - mbits); rounding up to 2^mbits gives the smallest
    // normal, whose code is the same integer.
    code = static_cast<uint32_t>(round_even(scale2(a, f.mbits - min_exp)));
  } else {
    float mant = round_even(scale2(a, f.mbits - exp)) - static_cast<float>(1u << f.mbits);
    if (mant >= static_cast<float>(1u << f.mbits)) {
      mant = 0;
      exp += 1;
    }
    const int efield = exp + bias;
    code = efield > static_cast<int>(emask) ? max_finite + 1
                                            : (static_cast<uint32_t>(efield) << f.mbits) | static_cast<uint32_t>(mant);
  }
  if (code > max_finite) return f.fn ? (sign | max_finite) : (sign | (emask << f.mbits));
  return sign | code;
}

FERRY_CONVERT_HD inline uint32_t element_size(uint8_t type) {
  return type == kElemF32 ? 4 : (type == kElemBF16 || type == kElemF16) ? 2 : 1;
}

FERRY_CONVERT_HD inline float load_float(const unsigned char* p, uint8_t type) {
  switch (type) {
    case kElemF32: {
      uint32_t u = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
                   (static_cast<uint32_t>(p[3]) << 24);
      return bits_float(u);
    }
    case kElemBF16:
    case kElemF16: return decode_mini(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8), mini_format(type));
    default: return decode_mini(p[0], mini_format(type));
  }
}

FERRY_CONVERT_HD inline void store_float(unsigned char* p, uint8_t type, float v) {
  switch (type) {
    case kElemF32: {
      const uint32_t u = float_bits(v);
      for (int b = 0; b < 4; ++b) p[b] = static_cast<unsigned char>(u >> (8 * b));
      return;
    }
    case kElemBF16:
    case kElemF16: {
      const uint32_t c = encode_mini(v, mini_format(type));
      p[0] = static_cast<unsigned char>(c);
      p[1] = static_cast<unsigned char>(c >> 8);
      return;
    }
    default: p[0] = static_cast<unsigned char>(encode_mini(v, mini_format(type))); return;
  }
}

}  // namespace ferry::batch
