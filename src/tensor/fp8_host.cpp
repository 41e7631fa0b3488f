// The host's FP8 block quantiser (fp8_block_quantize on Device::host()): the per-tile
// arithmetic of fp8_blocks.h, eight elements at a time where the CPU has AVX2 (chosen at
// run time; the build targets the x86-64 baseline), else one at a time. The same bits
// either way: amax is a max that skips NaN, the quotient an IEEE division, and the e4m3
// encoder encode_e4m3fn's integer steps done in lanes (Fp8Host.KernelsEqualTheElementPath).
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FERRY_X86_DISPATCH 1
#endif

#include "tensor/fp8_blocks.h"
#include "tensor/fp8_host.h"

namespace ferry::detail {

namespace {

void quantize_scalar(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols, int64_t block,
                     uint8_t format, unsigned char* q, unsigned char* scales) {
  batch::fp8_quantize_tiles(in, type, batch, rows, cols, block, format, q, scales);
}

#if defined(FERRY_X86_DISPATCH)

// Eight elements of a row as floats: bf16 (16 bytes) or f32 (32 bytes).
template <uint8_t kType>
__attribute__((target("avx2"))) inline __m256 load8(const unsigned char* p) {
  if constexpr (kType == batch::kElemBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// encode_e4m3fn of each lane of x (v's sign for a NaN quotient, as fp8_quantize).
__attribute__((target("avx2"))) inline __m256i encode8(__m256 x, __m256 v) {
  const __m256i xb = _mm256_castps_si256(x);
  const __m256i mag = _mm256_and_si256(xb, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(xb, 31), 7);
  const __m256i efield = _mm256_srli_epi32(mag, 23);
  // Normal (efield >= 121, e4m3's 2^-6 and up): (efield << 3 | top 3 mantissa bits),
  // rounded to nearest even with the carry into the exponent, rebased, saturated at 0x7e
  // (infinity included: its code is far above).
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(0x7ffff)), odd), 20);
  __m256i normal = _mm256_sub_epi32(rounded, _mm256_set1_epi32(120 << 3));
  normal = _mm256_min_epi32(normal, _mm256_set1_epi32(0x7e));
  // Below: the 24-bit significand in units of 2^-9, shifted down with round to nearest
  // even; shifts of 25 and more give 0, so they are clamped at 31 (float denormals too).
  const __m256i sig = _mm256_or_si256(_mm256_and_si256(mag, _mm256_set1_epi32(0x7fffff)), _mm256_set1_epi32(0x800000));
  const __m256i shift = _mm256_min_epi32(_mm256_sub_epi32(_mm256_set1_epi32(141), efield), _mm256_set1_epi32(31));
  const __m256i sq = _mm256_srlv_epi32(sig, shift);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i rem = _mm256_and_si256(sig, _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one));
  const __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
  const __m256i up = _mm256_or_si256(_mm256_cmpgt_epi32(rem, half),
                                     _mm256_and_si256(_mm256_cmpeq_epi32(rem, half),
                                                      _mm256_cmpeq_epi32(_mm256_and_si256(sq, one), one)));
  const __m256i sub = _mm256_sub_epi32(sq, up);  // (up is -1 where it rounds up)
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(121), efield);
  __m256i code = _mm256_or_si256(sign, _mm256_blendv_epi8(normal, sub, below));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i nan_code = _mm256_or_si256(
      _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(v), 31), 7), _mm256_set1_epi32(0x7f));
  return _mm256_blendv_epi8(code, nan_code, nan);
}

template <uint8_t kType>
__attribute__((target("avx2"))) void quantize_avx2(const unsigned char* in, int64_t batch, int64_t rows, int64_t cols,
                                                   int64_t block, uint8_t format, unsigned char* q,
                                                   unsigned char* scales) {
  constexpr uint32_t es = kType == batch::kElemBF16 ? 2 : 4;
  const int64_t trows = batch::fp8_tile_rows(format, block);
  const int64_t tiles = batch::fp8_num_tiles(batch, rows, cols, trows, block);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // Low byte of each 32-bit lane, four per 128-bit half.
  const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t t = 0; t < tiles; ++t) {
    const batch::Fp8Tile tl = batch::fp8_tile(t, rows, cols, trows, block);
    const int64_t base = tl.b * rows * cols;
    const int64_t width = tl.c1 - tl.c0, wide = width / 8 * 8;
    __m256 vmax = _mm256_setzero_ps();
    float amax = 0.0f;
    for (int64_t r = tl.r0; r < tl.r1; ++r) {
      const unsigned char* row = in + (base + r * cols + tl.c0) * es;
      for (int64_t c = 0; c < wide; c += 8) vmax = _mm256_max_ps(_mm256_and_ps(load8<kType>(row + c * es), abs_mask), vmax);
      for (int64_t c = wide; c < width; ++c) amax = batch::fp8_amax(amax, batch::fp8_load<kType>(row + c * es, kType));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);  // (no NaN: max_ps returns its second operand, the running max, for one)
    for (float l : lanes) amax = batch::fp8_amax(amax, l);
    const float scale = batch::fp8_scale(format, amax, scales + batch::fp8_scale_bytes(format) * t);
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t r = tl.r0; r < tl.r1; ++r) {
      const unsigned char* row = in + (base + r * cols + tl.c0) * es;
      unsigned char* out = q + base + r * cols + tl.c0;
      for (int64_t c = 0; c < wide; c += 8) {
        const __m256 v = load8<kType>(row + c * es);
        const __m256i packed = _mm256_shuffle_epi8(encode8(_mm256_div_ps(v, vscale), v), bytes);
        const int32_t lo = _mm256_extract_epi32(packed, 0), hi = _mm256_extract_epi32(packed, 4);
        std::memcpy(out + c, &lo, 4);
        std::memcpy(out + c + 4, &hi, 4);
      }
      for (int64_t c = wide; c < width; ++c) out[c] = batch::fp8_quantize(batch::fp8_load<kType>(row + c * es, kType), scale);
    }
  }
}

__attribute__((target("avx2"))) void quantize_avx2_any(const unsigned char* in, uint8_t type, int64_t batch,
                                                       int64_t rows, int64_t cols, int64_t block, uint8_t format,
                                                       unsigned char* q, unsigned char* scales) {
  if (type == batch::kElemBF16) return quantize_avx2<batch::kElemBF16>(in, batch, rows, cols, block, format, q, scales);
  if (type == batch::kElemF32) return quantize_avx2<batch::kElemF32>(in, batch, rows, cols, block, format, q, scales);
  quantize_scalar(in, type, batch, rows, cols, block, format, q, scales);
}

#endif

}  // namespace

std::vector<Fp8QuantizeKernel> fp8_quantize_kernels() {
  std::vector<Fp8QuantizeKernel> out;
#if defined(FERRY_X86_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) out.push_back({"avx2", &quantize_avx2_any});
#endif
  out.push_back({"scalar", &quantize_scalar});
  return out;
}

void fp8_quantize_host(const unsigned char* in, uint8_t type, int64_t batch, int64_t rows, int64_t cols, int64_t block,
                       uint8_t format, unsigned char* q, unsigned char* scales) {
  static const Fp8QuantizeKernel::Run kernel = fp8_quantize_kernels().front().run;
  kernel(in, type, batch, rows, cols, block, format, q, scales);
}

}  // namespace ferry::detail
