// Shapes, layouts, layout coalescing and the strided copy kernel.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FERRY_X86_DISPATCH 1  // an AVX2 kernel compiled for that target alone, chosen at run time
#endif

#include "ferry/tensor.h"
#include "tensor/convert_kernels.h"

namespace ferry {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

Layout Layout::contiguous(Shape shape, int64_t offset) {
  Layout l;
  l.strides = contiguous_strides(shape);
  l.shape = std::move(shape);
  l.offset = offset;
  return l;
}

bool Layout::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (shape[i] == 0) return true;
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

int64_t Layout::min_offset() const {
  int64_t o = offset;
  if (numel() == 0) return offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (strides[i] < 0) o += strides[i] * (shape[i] - 1);
  }
  return o;
}

int64_t Layout::max_offset() const {
  int64_t o = offset;
  if (numel() == 0) return offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (strides[i] > 0) o += strides[i] * (shape[i] - 1);
  }
  return o;
}

int64_t Layout::offset_of(const Shape& index) const {
  int64_t o = offset;
  for (size_t i = 0; i < index.size(); ++i) o += index[i] * strides[i];
  return o;
}

std::string Layout::to_string() const {
  return fmt::format("{} strides {} offset {}", shape_str(shape), shape_str(strides), offset);
}

namespace {

// Drops size-1 dims and merges neighbours contiguous in every layout of `ls`.
template <size_t N>
void coalesce_n(Layout* const (&ls)[N]) {
  Layout& first = *ls[0];
  const size_t nd = first.shape.size();
  bool empty = false;
  for (int64_t s : first.shape) empty |= (s == 0);
  if (empty) {
    for (Layout* l : ls) {
      l->shape = {0};
      l->strides = {1};
    }
    return;
  }
  std::vector<int64_t> shape;
  std::vector<std::vector<int64_t>> strides(N);
  for (size_t d = 0; d < nd; ++d) {
    const int64_t size = first.shape[d];
    if (size == 1) continue;
    bool merge = !shape.empty();
    if (merge) {
      for (size_t k = 0; k < N; ++k) {
        if (strides[k].back() != ls[k]->strides[d] * size) merge = false;
      }
    }
    if (merge) {
      shape.back() *= size;
      for (size_t k = 0; k < N; ++k) strides[k].back() = ls[k]->strides[d];
    } else {
      shape.push_back(size);
      for (size_t k = 0; k < N; ++k) strides[k].push_back(ls[k]->strides[d]);
    }
  }
  for (size_t k = 0; k < N; ++k) {
    ls[k]->shape = shape;
    ls[k]->strides = std::move(strides[k]);
  }
}

}  // namespace

void coalesce_layouts(Layout& a, Layout& b) {
  Layout* const ls[2] = {&a, &b};
  coalesce_n(ls);
}

void coalesce_layout(Layout& a) {
  Layout* const ls[1] = {&a};
  coalesce_n(ls);
}

namespace {

template <typename T>
void copy_run(const std::byte* src, int64_t ss, std::byte* dst, int64_t ds, int64_t n) {
  // ss, ds in bytes.
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * ss, sizeof(T));
    std::memcpy(dst + i * ds, &v, sizeof(T));
  }
}

// Copies n bytes with non-temporal stores (no read-for-ownership of the destination,
// no cache pollution): what glibc's memcpy does for copies larger than the cache, so a
// large copy cut into many runs keeps memcpy's bandwidth. Caller issues the fence.
void stream_copy(std::byte* dst, const std::byte* src, size_t n, const std::byte* next) {
#if defined(__SSE2__)
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (n < head + 64) {
    std::memcpy(dst, src, n);
    return;
  }
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    // Fetch the next run in lockstep: hardware prefetchers stop at page boundaries,
    // and a strided copy starts a new run every few KiB (a prefetch never faults).
    _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_NTA);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  (void)next;
  std::memcpy(dst, src, n);
#endif
}

// The conversions a trainer's fp32 masters meet every sync (f32 <-> bf16), element by
// element with the bits of load_element/store_element (dtype.cpp: round to nearest even,
// overflow to infinity, a NaN keeps its sign and becomes all-ones mantissa; a bf16 NaN
// loads as the canonical quiet NaN) but without going through double: plain integer
// operations the compiler vectorises. False for any other pair (the caller's generic
// loop). Strides in elements.
inline uint16_t f32_to_bf16(uint32_t u) {
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fffu;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline uint32_t bf16_to_f32(uint16_t b) {
  return (b & 0x7fffu) > 0x7f80u ? 0x7fc00000u : static_cast<uint32_t>(b) << 16;
}

template <class From, class To, To (*F)(From)>
void convert_each(const std::byte* src, int64_t sis, std::byte* dst, int64_t dis, int64_t n) {
  if (sis == 1 && dis == 1) {  // the common case, kept apart so that it vectorises
    for (int64_t i = 0; i < n; ++i) {
      From x;
      std::memcpy(&x, src + i * static_cast<int64_t>(sizeof(From)), sizeof(From));
      const To y = F(x);
      std::memcpy(dst + i * static_cast<int64_t>(sizeof(To)), &y, sizeof(To));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    From x;
    std::memcpy(&x, src + i * sis * static_cast<int64_t>(sizeof(From)), sizeof(From));
    const To y = F(x);
    std::memcpy(dst + i * dis * static_cast<int64_t>(sizeof(To)), &y, sizeof(To));
  }
}

// f32 -> bf16 of a contiguous run, 8 elements at a time with SSE2 (the x86-64 baseline;
// the build targets no more): f32_to_bf16's operations on four lanes, the 16-bit results
// packed by sign-extending them first (packs_epi32 saturates signed values). (Streaming
// stores for long runs were tried: half the rate here.)
int64_t f32_to_bf16_sse2(const std::byte* src, std::byte* dst, int64_t n) {
#if defined(__SSE2__)
  const __m128i k7fff = _mm_set1_epi32(0x7fff), kone = _mm_set1_epi32(1), kabs = _mm_set1_epi32(0x7fffffff);
  const __m128i kinf = _mm_set1_epi32(0x7f800000), ksign = _mm_set1_epi32(0x8000);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i out[2];
    for (int h = 0; h < 2; ++h) {
      const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (i + 4 * h) * 4));
      const __m128i hi = _mm_srli_epi32(u, 16);
      const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, k7fff), _mm_and_si128(hi, kone)), 16);
      const __m128i nan = _mm_or_si128(_mm_and_si128(hi, ksign), k7fff);
      const __m128i is_nan = _mm_cmpgt_epi32(_mm_and_si128(u, kabs), kinf);
      const __m128i r = _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, rounded));
      out[h] = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * 2), _mm_packs_epi32(out[0], out[1]));
  }
  return i;
#else
  (void)src, (void)dst, (void)n;
  return 0;
#endif
}

#if defined(FERRY_X86_DISPATCH)
// The same operations on 8 lanes (AVX2), compiled for that target only and taken when
// the CPU has it (the build itself targets the x86-64 baseline): the SSE2 loop is
// compute-bound at ~0.7x torch's conversion on one thread; this one reaches memory
// speed. (An AVX-512F kernel narrowing with vpmovdw was measured slower than SSE2 on
// this AMD EPYC, 13 against 19-22 GB/s: not kept.)
__attribute__((target("avx2"))) int64_t f32_to_bf16_avx2(const std::byte* src, std::byte* dst, int64_t n) {
  const __m256i k7fff = _mm256_set1_epi32(0x7fff), kone = _mm256_set1_epi32(1), kabs = _mm256_set1_epi32(0x7fffffff);
  const __m256i kinf = _mm256_set1_epi32(0x7f800000), ksign = _mm256_set1_epi32(0x8000);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i out[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (i + 8 * h) * 4));
      const __m256i hi = _mm256_srli_epi32(u, 16);
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, k7fff), _mm256_and_si256(hi, kone)), 16);
      const __m256i nan = _mm256_or_si256(_mm256_and_si256(hi, ksign), k7fff);
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, kabs), kinf);
      const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);
      out[h] = _mm256_srai_epi32(_mm256_slli_epi32(r, 16), 16);
    }
    // packs works within 128-bit lanes: [a0 b0 a1 b1] -> [a0 a1 b0 b1].
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(out[0], out[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * 2), packed);
  }
  return i;
}

#endif

}  // namespace

std::vector<detail::F32ToBf16Kernel> detail::f32_to_bf16_kernels() {
  std::vector<F32ToBf16Kernel> out;
#if defined(FERRY_X86_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) out.push_back({"avx2", &f32_to_bf16_avx2});
#endif
  out.push_back({"sse2", &f32_to_bf16_sse2});
  return out;
}

namespace {

// The widest kernel this CPU runs, chosen once; FERRY_CONVERT_ISA=sse2|avx2 picks
// a narrower one (benchmarks compare them side by side; one the CPU lacks is not taken).
detail::F32ToBf16Kernel::Run f32_to_bf16_kernel() {
  static const detail::F32ToBf16Kernel::Run kernel = [] {
    const auto kernels = detail::f32_to_bf16_kernels();
    const char* isa = std::getenv("FERRY_CONVERT_ISA");
    for (const auto& k : kernels)
      if (isa && std::string_view(isa) == k.isa) return k.run;
    return kernels.front().run;
  }();
  return kernel;
}

bool convert_run(const std::byte* src, int64_t sis, DType src_dtype, std::byte* dst, int64_t dis, DType dst_dtype,
                 int64_t n) {
  if (src_dtype == DType::kF32 && dst_dtype == DType::kBF16) {
    const int64_t done = sis == 1 && dis == 1 ? f32_to_bf16_kernel()(src, dst, n) : 0;
    convert_each<uint32_t, uint16_t, f32_to_bf16>(src + done * 4, sis, dst + done * 2, dis, n - done);
    return true;
  }
  if (src_dtype == DType::kBF16 && dst_dtype == DType::kF32) {
    convert_each<uint16_t, uint32_t, bf16_to_f32>(src, sis, dst, dis, n);
    return true;
  }
  return false;
}

// Copies of at least this many bytes in total use streaming stores for long runs.
constexpr int64_t kStreamMinTotal = 32 << 20;
constexpr int64_t kStreamMinRun = 2048;

}  // namespace

void strided_copy(const std::byte* src, const Layout& src_layout, DType src_dtype, std::byte* dst,
                  const Layout& dst_layout, DType dst_dtype) {
  Layout s = src_layout;
  Layout d = dst_layout;
  coalesce_layouts(s, d);
  if (s.numel() == 0) return;
  const int64_t nd = s.ndim();
  const int64_t ses = static_cast<int64_t>(dtype_size(src_dtype));
  const int64_t des = static_cast<int64_t>(dtype_size(dst_dtype));
  const bool same = src_dtype == dst_dtype;
  const int64_t inner = nd == 0 ? 1 : s.shape[nd - 1];
  const int64_t sis = nd == 0 ? 1 : s.strides[nd - 1];
  const int64_t dis = nd == 0 ? 1 : d.strides[nd - 1];
  const bool memcpy_run = same && sis == 1 && dis == 1;
  const bool streaming = memcpy_run && inner * ses >= kStreamMinRun && s.numel() * ses >= kStreamMinTotal;

  // Iterate the outer dims with an odometer.
  const int64_t outer_nd = std::max<int64_t>(nd - 1, 0);
  std::vector<int64_t> idx(static_cast<size_t>(outer_nd), 0);
  int64_t so = s.offset, dof = d.offset;
  while (true) {
    const std::byte* sp = src + so * ses;
    std::byte* dp = dst + dof * des;
    if (streaming) {
      stream_copy(dp, sp, static_cast<size_t>(inner * ses), sp + (outer_nd > 0 ? s.strides[outer_nd - 1] * ses : 0));
    } else if (memcpy_run) {
      std::memcpy(dp, sp, static_cast<size_t>(inner * ses));
    } else if (same) {
      switch (ses) {
        case 1: copy_run<uint8_t>(sp, sis, dp, dis, inner); break;
        case 2: copy_run<uint16_t>(sp, sis * 2, dp, dis * 2, inner); break;
        case 4: copy_run<uint32_t>(sp, sis * 4, dp, dis * 4, inner); break;
        default: copy_run<uint64_t>(sp, sis * 8, dp, dis * 8, inner); break;
      }
    } else if (!convert_run(sp, sis, src_dtype, dp, dis, dst_dtype, inner)) {
      for (int64_t i = 0; i < inner; ++i) {
        store_element(dp + i * dis * des, dst_dtype, load_element(sp + i * sis * ses, src_dtype));
      }
    }
    // Advance.
    int64_t k = outer_nd - 1;
    for (; k >= 0; --k) {
      idx[k]++;
      so += s.strides[k];
      dof += d.strides[k];
      if (idx[k] < s.shape[k]) break;
      so -= s.strides[k] * s.shape[k];
      dof -= d.strides[k] * d.shape[k];
      idx[k] = 0;
    }
    if (k < 0) break;
  }
#if defined(__SSE2__)
  if (streaming) _mm_sfence();  // streamed stores visible before we return
#endif
}

void strided_zero(std::byte* base, const Layout& layout, DType dtype) {
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  Layout l = layout;
  coalesce_layout(l);
  if (l.numel() == 0) return;
  if (l.ndim() == 0) {
    std::memset(base + l.offset * es, 0, static_cast<size_t>(es));
    return;
  }
  const int64_t inner = l.shape.back();
  const int64_t istride = l.strides.back();
  Shape outer(l.shape.begin(), l.shape.end() - 1);
  const int64_t rows = shape_numel(outer);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = l.offset;
    int64_t rem = r;
    for (size_t k = outer.size(); k-- > 0;) {
      off += (rem % outer[k]) * l.strides[k];
      rem /= outer[k];
    }
    if (istride == 1) {
      std::memset(base + off * es, 0, static_cast<size_t>(inner * es));
    } else {
      for (int64_t i = 0; i < inner; ++i) std::memset(base + (off + i * istride) * es, 0, static_cast<size_t>(es));
    }
  }
}

}  // namespace ferry
