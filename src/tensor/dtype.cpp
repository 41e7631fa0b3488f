// DType names, sizes and element conversion.
#include <cmath>
#include <cstring>
#include <limits>

#include "ferry/tensor.h"

namespace ferry {

namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  const char* name;       // safetensors
  const char* torch_name; // torch
  bool floating;
};

constexpr DTypeInfo kInfo[kNumDTypes] = {
    {DType::kBF16, 2, "BF16", "bfloat16", true},
    {DType::kF16, 2, "F16", "float16", true},
    {DType::kF32, 4, "F32", "float32", true},
    {DType::kF8E4M3, 1, "F8_E4M3", "float8_e4m3fn", true},
    {DType::kF8E5M2, 1, "F8_E5M2", "float8_e5m2", true},
    {DType::kI8, 1, "I8", "int8", false},
    {DType::kI16, 2, "I16", "int16", false},
    {DType::kI32, 4, "I32", "int32", false},
    {DType::kI64, 8, "I64", "int64", false},
    {DType::kU8, 1, "U8", "uint8", false},
    {DType::kBool, 1, "BOOL", "bool", false},
};

const DTypeInfo& info(DType d) { return kInfo[static_cast<int>(d)]; }

// A small IEEE-like float format: `ebits` exponent bits, `mbits` mantissa bits.
// `fn` marks e4m3fn: no infinities, only all-ones is NaN, overflow saturates.
struct MiniFloat {
  int ebits;
  int mbits;
  bool fn;
  int bias() const { return (1 << (ebits - 1)) - 1; }
};

constexpr MiniFloat kBF16{8, 7, false};
constexpr MiniFloat kF16{5, 10, false};
constexpr MiniFloat kE4M3{4, 3, true};
constexpr MiniFloat kE5M2{5, 2, false};

double decode_mini(uint32_t bits, MiniFloat f) {
  const uint32_t mmask = (1u << f.mbits) - 1;
  const uint32_t emask = (1u << f.ebits) - 1;
  const bool neg = (bits >> (f.ebits + f.mbits)) & 1;
  const uint32_t e = (bits >> f.mbits) & emask;
  const uint32_t m = bits & mmask;
  double v;
  if (f.fn) {
    if (e == emask && m == mmask) return std::numeric_limits<double>::quiet_NaN();
  } else if (e == emask) {
    if (m != 0) return std::numeric_limits<double>::quiet_NaN();
    v = std::numeric_limits<double>::infinity();
    return neg ? -v : v;
  }
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - f.bias() - f.mbits);
  } else {
    v = std::ldexp(static_cast<double>(m | (1u << f.mbits)), static_cast<int>(e) - f.bias() - f.mbits);
  }
  return neg ? -v : v;
}

uint32_t encode_mini(double x, MiniFloat f) {
  const uint32_t sign = std::signbit(x) ? (1u << (f.ebits + f.mbits)) : 0;
  const uint32_t emask = (1u << f.ebits) - 1;
  const uint32_t mmask = (1u << f.mbits) - 1;
  // Largest finite code: e4m3fn reserves only all-ones; IEEE-like reserves exponent all-ones.
  const uint32_t max_finite = f.fn ? ((emask << f.mbits) | (mmask - 1)) : (((emask - 1) << f.mbits) | mmask);
  if (std::isnan(x)) return sign | (emask << f.mbits) | mmask;
  double a = std::fabs(x);
  if (std::isinf(a)) return f.fn ? (sign | max_finite) : (sign | (emask << f.mbits));
  if (a == 0.0) return sign;
  int e2;
  std::frexp(a, &e2);  // a = frac * 2^e2, frac in [0.5, 1)
  int exp = e2 - 1;    // a in [2^exp, 2^(exp+1))
  const int min_exp = 1 - f.bias();
  uint32_t code;
  if (exp < min_exp) {
    // Subnormal: units of 2^(min_exp - mbits). Rounding up to 2^mbits gives the smallest
    // normal, whose code is the same integer.
    double units = std::nearbyint(std::ldexp(a, f.mbits - min_exp));
    code = static_cast<uint32_t>(units);
  } else {
    double mant = std::nearbyint(std::ldexp(a, f.mbits - exp)) - std::ldexp(1.0, f.mbits);
    if (mant >= std::ldexp(1.0, f.mbits)) {
      mant = 0;
      exp += 1;
    }
    int64_t efield = exp + f.bias();
    if (efield > static_cast<int64_t>(emask)) {
      code = max_finite + 1;  // overflow, handled below
    } else {
      code = (static_cast<uint32_t>(efield) << f.mbits) | static_cast<uint32_t>(mant);
    }
  }
  if (code > max_finite) {
    return f.fn ? (sign | max_finite) : (sign | (emask << f.mbits));
  }
  return sign | code;
}

}  // namespace

size_t dtype_size(DType dtype) { return info(dtype).size; }
std::string_view dtype_name(DType dtype) { return info(dtype).name; }
bool is_floating(DType dtype) { return info(dtype).floating; }

Result<DType> parse_dtype(std::string_view name) {
  for (const auto& i : kInfo) {
    if (name == i.name || name == i.torch_name) return i.dtype;
  }
  if (name == "torch.bfloat16") return DType::kBF16;
  if (name == "half" || name == "float16" || name == "torch.float16") return DType::kF16;
  if (name == "float" || name == "torch.float32" || name == "fp32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "fp16") return DType::kF16;
  if (name == "fp8" || name == "fp8_e4m3" || name == "float8_e4m3") return DType::kF8E4M3;
  return invalid_argument("unknown dtype '{}'", name);
}

double load_element(const std::byte* p, DType dtype) {
  switch (dtype) {
    case DType::kBF16: { uint16_t b; std::memcpy(&b, p, 2); return decode_mini(b, kBF16); }
    case DType::kF16: { uint16_t b; std::memcpy(&b, p, 2); return decode_mini(b, kF16); }
    case DType::kF32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::kF8E4M3: return decode_mini(static_cast<uint8_t>(*p), kE4M3);
    case DType::kF8E5M2: return decode_mini(static_cast<uint8_t>(*p), kE5M2);
    case DType::kI8: return static_cast<int8_t>(*p);
    case DType::kI16: { int16_t v; std::memcpy(&v, p, 2); return v; }
    case DType::kI32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::kI64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    case DType::kU8: return static_cast<uint8_t>(*p);
    case DType::kBool: return static_cast<uint8_t>(*p) != 0 ? 1.0 : 0.0;
  }
  return 0;
}

namespace {
template <typename T>
T saturate_int(double v) {
  if (std::isnan(v)) return 0;
  v = std::trunc(v);
  if (v <= static_cast<double>(std::numeric_limits<T>::min())) return std::numeric_limits<T>::min();
  if (v >= static_cast<double>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return static_cast<T>(v);
}
}  // namespace

void store_element(std::byte* p, DType dtype, double v) {
  switch (dtype) {
    case DType::kBF16: { uint16_t b = static_cast<uint16_t>(encode_mini(v, kBF16)); std::memcpy(p, &b, 2); return; }
    case DType::kF16: { uint16_t b = static_cast<uint16_t>(encode_mini(v, kF16)); std::memcpy(p, &b, 2); return; }
    case DType::kF32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); return; }
    case DType::kF8E4M3: *p = static_cast<std::byte>(encode_mini(v, kE4M3)); return;
    case DType::kF8E5M2: *p = static_cast<std::byte>(encode_mini(v, kE5M2)); return;
    case DType::kI8: { int8_t x = saturate_int<int8_t>(v); std::memcpy(p, &x, 1); return; }
    case DType::kI16: { int16_t x = saturate_int<int16_t>(v); std::memcpy(p, &x, 2); return; }
    case DType::kI32: { int32_t x = saturate_int<int32_t>(v); std::memcpy(p, &x, 4); return; }
    case DType::kI64: { int64_t x = saturate_int<int64_t>(v); std::memcpy(p, &x, 8); return; }
    case DType::kU8: { uint8_t x = saturate_int<uint8_t>(v); std::memcpy(p, &x, 1); return; }
    case DType::kBool: *p = static_cast<std::byte>(v != 0.0 ? 1 : 0); return;
  }
}

}  // namespace ferry
