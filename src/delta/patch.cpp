// Patch codec (delta/patch.h). Encoding is a scan that compares every element once,
// keeping one changed-bit per element (n/8 bytes), the count per block and the exact
// LEB128 bytes the gaps take (so the size of every encoding is known before a byte is
// written), then an emit of the chosen one from those bits. Applying is two passes too: a
// validation of the whole structure, then the writes, then the content hash.
#include "delta/patch.h"

#include <algorithm>
#include <cmath>
#include <bit>
#include <cstring>

#include <xxhash.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ferry::delta {

static_assert(std::endian::native == std::endian::little, "the patch format is little-endian; add byte swaps");
static_assert(kBitmapBlockElems % 64 == 0, "bitmap blocks are whole 64-element chunks");

const char* patch_encoding_name(PatchEncoding e) {
  switch (e) {
    case PatchEncoding::kDense: return "dense";
    case PatchEncoding::kBitmap: return "bitmap";
    case PatchEncoding::kPositions: return "positions";
    case PatchEncoding::kBlocks: return "blocks";
  }
  return "unknown";
}

namespace {

constexpr uint8_t kMagic[4] = {'F', 'R', 'Y', 'D'};
constexpr uint8_t kVersion = 1;
constexpr size_t kB = kBitmapBlockElems;

// Block states in kBitmap (2 bits per block, block i in bits 2*(i%4) of byte i/4).
constexpr unsigned kStateNone = 0, kStateSome = 1, kStateAll = 2;

uint64_t load_u64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
void store_u64(std::byte* p, uint64_t v) { std::memcpy(p, &v, 8); }

// Up to 8 bytes, zero-extended.
uint64_t load_partial(const std::byte* p, size_t n) {
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  return v;
}

size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

std::byte* put_varint(std::byte* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = std::byte(static_cast<uint8_t>(v) | 0x80);
    v >>= 7;
  }
  *p++ = std::byte(static_cast<uint8_t>(v));
  return p;
}

// Reads one LEB128 value from [*p, end); false when truncated or over 64 bits.
[[gnu::noinline]] bool get_varint_slow(const std::byte*& p, const std::byte* end, uint64_t* out) {
  uint64_t v = 0;
  for (unsigned shift = 0; shift < 64; shift += 7) {
    if (p == end) return false;
    const uint8_t b = static_cast<uint8_t>(*p++);
    if (shift == 63 && b > 1) return false;
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *out = v;
      return true;
    }
  }
  return false;
}

// The common case (a gap under 128) inline.
inline bool get_varint(const std::byte*& p, const std::byte* end, uint64_t* out) {
  if (p != end && static_cast<uint8_t>(*p) < 0x80) {
    *out = static_cast<uint8_t>(*p++);
    return true;
  }
  return get_varint_slow(p, end, out);
}

size_t ceil_div(size_t a, size_t b) { return a / b + (a % b != 0); }

// Bit i set when element i of the `cnt` (<= 64) elements at a and b differs.
template <typename T>
uint64_t changed_mask(const std::byte* a, const std::byte* b, size_t cnt) {
  if (cnt == 64) {
#if defined(__SSE2__)
    // 16 bytes at a time: compare lanes, narrow to one bit per element (movemask).
    uint64_t eq = 0;
    for (size_t v = 0; v < 4 * sizeof(T); ++v) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a) + v);
      const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b) + v);
      if constexpr (sizeof(T) == 1) {
        eq |= static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, y))) << (16 * v);
      } else if constexpr (sizeof(T) == 2) {
        eq |= static_cast<uint64_t>(_mm_movemask_epi8(_mm_packs_epi16(_mm_cmpeq_epi16(x, y), _mm_setzero_si128())))
              << (8 * v);
      } else {
        eq |= static_cast<uint64_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x, y)))) << (4 * v);
      }
    }
    return ~eq;
#else
    // Most chunks are unchanged at low change rates: one OR of XORs over the chunk.
    uint64_t acc = 0;
    for (size_t w = 0; w < 8 * sizeof(T); ++w) acc |= load_u64(a + 8 * w) ^ load_u64(b + 8 * w);
    if (acc == 0) return 0;
    T va[64], vb[64];
    std::memcpy(va, a, sizeof va);
    std::memcpy(vb, b, sizeof vb);
    uint64_t m = 0;
    for (size_t i = 0; i < 64; ++i) m |= static_cast<uint64_t>(va[i] != vb[i]) << i;
    return m;
#endif
  }
  uint64_t m = 0;
  for (size_t i = 0; i < cnt; ++i) {
    T x, y;
    std::memcpy(&x, a + i * sizeof(T), sizeof(T));
    std::memcpy(&y, b + i * sizeof(T), sizeof(T));
    m |= static_cast<uint64_t>(x != y) << i;
  }
  return m;
}

uint64_t changed_mask(size_t es, const std::byte* a, const std::byte* b, size_t cnt) {
  switch (es) {
    case 1: return changed_mask<uint8_t>(a, b, cnt);
    case 2: return changed_mask<uint16_t>(a, b, cnt);
    default: return changed_mask<uint32_t>(a, b, cnt);
  }
}

// What the scan learns: enough to size every encoding exactly.
struct Scan {
  const std::byte* base = nullptr;
  const std::byte* next = nullptr;
  size_t es = 0;
  uint64_t n = 0;                      // elements
  std::vector<uint32_t> block_changed;  // per kB block
  std::vector<uint64_t> masks;          // per 64-element chunk: bit i = element i changed
  uint64_t changed = 0;
  uint64_t gap_bytes = 0;  // LEB128 bytes of all position gaps

  size_t block_len(size_t b) const { return std::min<uint64_t>(kB, n - b * kB); }

  size_t dense_bytes() const { return kPatchHeaderBytes + n * es; }
  size_t positions_bytes() const { return kPatchHeaderBytes + varint_len(changed) + gap_bytes + changed * es; }
  size_t bitmap_bytes() const {
    size_t s = kPatchHeaderBytes + ceil_div(block_changed.size(), 4) + changed * es;
    for (size_t b = 0; b < block_changed.size(); ++b) {
      const size_t c = block_changed[b], len = block_len(b);
      if (c != 0 && c != len) s += ceil_div(len, 8);
    }
    return s;
  }
  size_t bytes(PatchEncoding e) const {
    switch (e) {
      case PatchEncoding::kBitmap: return bitmap_bytes();
      case PatchEncoding::kPositions: return positions_bytes();
      default: return dense_bytes();
    }
  }
};

Scan scan(std::span<const std::byte> base, std::span<const std::byte> next, size_t es) {
  Scan s;
  s.base = base.data();
  s.next = next.data();
  s.es = es;
  s.n = next.size() / es;
  const size_t nblocks = ceil_div(s.n, kB);
  s.block_changed.assign(nblocks, 0);
  s.masks.resize(ceil_div(s.n, 64));
  uint64_t expect = 0;  // the position after the last changed element
  for (size_t b = 0; b < nblocks; ++b) {
    const size_t len = s.block_len(b);
    // Unchanged blocks (most of them when changes cluster) cost one memcmp; in a
    // changed block memcmp stops at the first difference.
    if (std::memcmp(s.base + b * kB * es, s.next + b * kB * es, len * es) == 0) continue;
    uint32_t count = 0;
    for (size_t c = 0; c < len; c += 64) {
      const size_t i0 = b * kB + c, cnt = std::min<size_t>(64, len - c);
      const uint64_t m = changed_mask(es, s.base + i0 * es, s.next + i0 * es, cnt);
      s.masks[i0 / 64] = m;
      if (m == 0) continue;
      const unsigned pc = static_cast<unsigned>(std::popcount(m));
      count += pc;
      // Only a chunk's first change can be 64 or more past the previous one.
      s.gap_bytes += varint_len(i0 + std::countr_zero(m) - expect) + (pc - 1);
      expect = i0 + (63 - std::countl_zero(m)) + 1;
    }
    s.block_changed[b] = count;
    s.changed += count;
  }
  return s;
}

void write_header(std::byte* out, PatchEncoding e, size_t es, uint64_t elems, uint64_t hash, uint64_t payload) {
  std::memcpy(out, kMagic, 4);
  out[4] = std::byte(kVersion);
  out[5] = std::byte(static_cast<uint8_t>(e));
  out[6] = std::byte(static_cast<uint8_t>(es));
  out[7] = std::byte(0);
  store_u64(out + 8, elems);
  store_u64(out + 16, hash);
  store_u64(out + 24, payload);
}

// Calls f(element index) for every set bit of m, lowest first (i0: index of bit 0).
template <typename F>
void for_each_bit(uint64_t m, uint64_t i0, F&& f) {
  while (m) {
    f(i0 + std::countr_zero(m));
    m &= m - 1;
  }
}

template <size_t ES>
void emit_positions(const Scan& s, std::byte* p, std::byte* end) {
  p = put_varint(p, s.changed);
  std::byte* val = end - s.changed * ES;
  uint64_t expect = 0;
  for (size_t b = 0; b < s.block_changed.size(); ++b) {
    if (s.block_changed[b] == 0) continue;
    const size_t len = s.block_len(b);
    for (size_t c = 0; c < len; c += 64) {
      const size_t i0 = b * kB + c;
      const uint64_t m = s.masks[i0 / 64];
      for_each_bit(m, i0, [&](uint64_t i) {
        p = put_varint(p, i - expect);
        expect = i + 1;
        std::memcpy(val, s.next + i * ES, ES);
        val += ES;
      });
    }
  }
}

template <size_t ES>
void emit_bitmap(const Scan& s, std::byte* p, std::byte* end) {
  const size_t nblocks = s.block_changed.size();
  std::byte* states = p;
  std::memset(states, 0, ceil_div(nblocks, 4));
  p += ceil_div(nblocks, 4);
  std::byte* val = end - s.changed * ES;
  for (size_t b = 0; b < nblocks; ++b) {
    const size_t c = s.block_changed[b], len = s.block_len(b);
    if (c == 0) continue;
    const size_t i0 = b * kB;
    if (c == len) {
      states[b / 4] |= std::byte(kStateAll << (2 * (b % 4)));
      std::memcpy(val, s.next + i0 * ES, len * ES);
      val += len * ES;
      continue;
    }
    states[b / 4] |= std::byte(kStateSome << (2 * (b % 4)));
    for (size_t k = 0; k < len; k += 64) {
      const size_t cnt = std::min<size_t>(64, len - k);
      const uint64_t m = s.masks[(i0 + k) / 64];
      const size_t mb = ceil_div(cnt, 8);
      std::memcpy(p, &m, mb);
      p += mb;
      for_each_bit(m, i0 + k, [&](uint64_t i) {
        std::memcpy(val, s.next + i * ES, ES);
        val += ES;
      });
    }
  }
}

template <size_t ES>
void emit(const Scan& s, PatchEncoding e, std::byte* p, std::byte* end) {
  switch (e) {
    case PatchEncoding::kBitmap: emit_bitmap<ES>(s, p, end); break;
    case PatchEncoding::kPositions: emit_positions<ES>(s, p, end); break;
    default: if (s.n) std::memcpy(p, s.next, s.n * ES); break;
  }
}

Status check_pair(const char* op, std::span<const std::byte> base, std::span<const std::byte> next, size_t es) {
  if (es != 1 && es != 2 && es != 4) return invalid_argument("{}: element size {} (expected 1, 2 or 4)", op, es);
  if (base.size() != next.size())
    return invalid_argument("{}: base has {} bytes, next has {}", op, base.size(), next.size());
  if (next.size() % es != 0)
    return invalid_argument("{}: {} bytes is not a whole number of {}-byte elements", op, next.size(), es);
  return Status::Ok();
}

PatchEncoding pick(const Scan& s, PatchChoice choice) {
  switch (choice) {
    case PatchChoice::kDense: return PatchEncoding::kDense;
    case PatchChoice::kBitmap: return PatchEncoding::kBitmap;
    case PatchChoice::kPositions: return PatchEncoding::kPositions;
    case PatchChoice::kSmallest: break;
  }
  PatchEncoding best = PatchEncoding::kDense;
  for (PatchEncoding e : {PatchEncoding::kBitmap, PatchEncoding::kPositions})
    if (s.bytes(e) < s.bytes(best)) best = e;
  return best;
}

PatchInfo write_patch(const Scan& s, PatchEncoding e, std::byte* out) {
  PatchInfo info;
  info.encoding = e;
  info.elem_size = s.es;
  info.elems = s.n;
  info.bytes = s.bytes(e);
  info.changed = s.changed;
  info.dense_bytes = s.dense_bytes();
  info.bitmap_bytes = s.bitmap_bytes();
  info.positions_bytes = s.positions_bytes();
  info.content_hash = XXH3_64bits(s.next, s.n * s.es);
  write_header(out, e, s.es, s.n, info.content_hash, info.bytes - kPatchHeaderBytes);
  std::byte* p = out + kPatchHeaderBytes;
  std::byte* end = out + info.bytes;
  switch (s.es) {
    case 1: emit<1>(s, e, p, end); break;
    case 2: emit<2>(s, e, p, end); break;
    default: emit<4>(s, e, p, end); break;
  }
  return info;
}

// ---- apply ----

Status check_hash(std::span<const std::byte> target, uint64_t expected) {
  const uint64_t got = XXH3_64bits(target.data(), target.size());
  if (got != expected)
    return corrupt("apply_patch: result hash {:016x} is not the patch's {:016x} (wrong base, or damaged patch)", got,
                   expected);
  return Status::Ok();
}

template <size_t ES>
Status apply_positions(std::span<std::byte> target, const std::byte* p, const std::byte* end, uint64_t n) {
  uint64_t k;
  if (!get_varint(p, end, &k)) return corrupt("apply_patch: positions: truncated change count");
  if (k > n) return corrupt("apply_patch: positions: {} changes in {} elements", k, n);
  if (k * ES > static_cast<uint64_t>(end - p))
    return corrupt("apply_patch: positions: {} values of {} bytes do not fit in {} payload bytes", k, ES, end - p);
  const std::byte* values = end - k * ES;
  const std::byte* const pos0 = p;
  // Pass 1: every position in range and increasing, the stream used up exactly.
  uint64_t expect = 0;
  for (uint64_t j = 0; j < k; ++j) {
    uint64_t gap;
    if (!get_varint(p, values, &gap)) return corrupt("apply_patch: positions: position {} of {} truncated", j, k);
    if (gap >= n - expect)
      return corrupt("apply_patch: positions: position {} (gap {} after {}) is past {} elements", j, gap, expect, n);
    expect += gap + 1;
  }
  if (p != values)
    return corrupt("apply_patch: positions: {} bytes left between positions and values", values - p);
  // Pass 2: write.
  p = pos0;
  expect = 0;
  std::byte* t = target.data();
  for (uint64_t j = 0; j < k; ++j) {
    uint64_t gap;
    get_varint(p, values, &gap);
    expect += gap;
    std::memcpy(t + expect * ES, values + j * ES, ES);
    ++expect;
  }
  return Status::Ok();
}

template <size_t ES>
Status apply_bitmap(std::span<std::byte> target, const std::byte* p, const std::byte* end, uint64_t n) {
  const size_t nblocks = ceil_div(n, kB);
  const size_t state_bytes = ceil_div(nblocks, 4);
  if (state_bytes > static_cast<size_t>(end - p))
    return corrupt("apply_patch: bitmap: {} block-state bytes do not fit in {} payload bytes", state_bytes, end - p);
  const std::byte* states = p;
  p += state_bytes;
  if (nblocks % 4 && (static_cast<unsigned>(states[state_bytes - 1]) >> (2 * (nblocks % 4))) != 0)
    return corrupt("apply_patch: bitmap: state bits set past the last of {} blocks", nblocks);
  auto state = [&](size_t b) { return (static_cast<unsigned>(states[b / 4]) >> (2 * (b % 4))) & 3u; };
  auto block_len = [&](size_t b) { return static_cast<size_t>(std::min<uint64_t>(kB, n - b * kB)); };
  // Pass 1: states valid, bitmaps present with no bits past a block's end, values add up.
  const std::byte* q = p;
  uint64_t values = 0;
  for (size_t b = 0; b < nblocks; ++b) {
    const unsigned st = state(b);
    const size_t len = block_len(b);
    if (st == kStateNone) continue;
    if (st == kStateAll) {
      values += len;
      continue;
    }
    if (st != kStateSome) return corrupt("apply_patch: bitmap: block {} has invalid state {}", b, st);
    const size_t mb = ceil_div(len, 8);
    if (mb > static_cast<size_t>(end - q))
      return corrupt("apply_patch: bitmap: block {}'s bitmap is truncated", b);
    for (size_t k = 0; k < mb; k += 8) values += std::popcount(load_partial(q + k, std::min<size_t>(8, mb - k)));
    if (len % 8 && (static_cast<unsigned>(q[mb - 1]) >> (len % 8)) != 0)
      return corrupt("apply_patch: bitmap: block {} marks elements past its {} elements", b, len);
    q += mb;
  }
  if (values > static_cast<uint64_t>(end - q) / ES || values * ES != static_cast<uint64_t>(end - q))
    return corrupt("apply_patch: bitmap: {} changed elements, but {} value bytes", values, end - q);
  // Pass 2: write.
  const std::byte* val = q;
  std::byte* t = target.data();
  for (size_t b = 0; b < nblocks; ++b) {
    const unsigned st = state(b);
    const size_t len = block_len(b), i0 = b * kB;
    if (st == kStateAll) {
      std::memcpy(t + i0 * ES, val, len * ES);
      val += len * ES;
    } else if (st == kStateSome) {
      const size_t mb = ceil_div(len, 8);
      for (size_t k = 0; k < mb; k += 8) {
        for_each_bit(load_partial(p + k, std::min<size_t>(8, mb - k)), i0 + 8 * k, [&](uint64_t i) {
          std::memcpy(t + i * ES, val, ES);
          val += ES;
        });
      }
      p += mb;
    }
  }
  return Status::Ok();
}

Status apply_blocks(std::span<std::byte> target, const std::byte* p, const std::byte* end) {
  const uint64_t n = target.size();
  if (end - p < 8) return corrupt("apply_patch: blocks: truncated block size");
  const uint64_t bb = load_u64(p);
  p += 8;
  if (bb == 0) return corrupt("apply_patch: blocks: block size 0");
  const uint64_t nblocks = n / bb + (n % bb != 0);
  const uint64_t map_bytes = nblocks / 8 + (nblocks % 8 != 0);
  if (map_bytes > static_cast<uint64_t>(end - p))
    return corrupt("apply_patch: blocks: {}-byte block map does not fit in {} bytes", map_bytes, end - p);
  const std::byte* map = p;
  p += map_bytes;
  if (nblocks % 8 && (static_cast<unsigned>(map[map_bytes - 1]) >> (nblocks % 8)) != 0)
    return corrupt("apply_patch: blocks: map bits set past the last of {} blocks", nblocks);
  auto len = [&](uint64_t b) { return std::min<uint64_t>(bb, n - b * bb); };
  uint64_t data = 0;
  for (uint64_t b = 0; b < nblocks; ++b)
    if ((static_cast<unsigned>(map[b / 8]) >> (b % 8)) & 1) data += len(b);
  if (data != static_cast<uint64_t>(end - p))
    return corrupt("apply_patch: blocks: changed blocks hold {} bytes, the patch has {}", data, end - p);
  for (uint64_t b = 0; b < nblocks; ++b) {
    if (!((static_cast<unsigned>(map[b / 8]) >> (b % 8)) & 1)) continue;
    std::memcpy(target.data() + b * bb, p, len(b));
    p += len(b);
  }
  return Status::Ok();
}

}  // namespace

Result<PatchInfo> encode_patch_into(std::span<const std::byte> base, std::span<const std::byte> next,
                                    size_t elem_size, std::span<std::byte> out, PatchChoice choice) {
  FERRY_RETURN_IF_ERROR(check_pair("encode_patch", base, next, elem_size));
  const Scan s = scan(base, next, elem_size);
  const PatchEncoding e = pick(s, choice);
  if (out.size() < s.bytes(e))
    return invalid_argument("encode_patch: the {} patch needs {} bytes, the output has {}", patch_encoding_name(e),
                            s.bytes(e), out.size());
  return write_patch(s, e, out.data());
}

Result<std::vector<std::byte>> encode_patch(std::span<const std::byte> base, std::span<const std::byte> next,
                                            size_t elem_size, PatchChoice choice) {
  FERRY_RETURN_IF_ERROR(check_pair("encode_patch", base, next, elem_size));
  const Scan s = scan(base, next, elem_size);
  const PatchEncoding e = pick(s, choice);
  std::vector<std::byte> out(s.bytes(e));
  write_patch(s, e, out.data());
  return out;
}

Result<PatchInfo> read_patch_header(std::span<const std::byte> patch) {
  if (patch.size() < kPatchHeaderBytes)
    return corrupt("apply_patch: {} bytes is shorter than the {}-byte patch header", patch.size(), kPatchHeaderBytes);
  const std::byte* h = patch.data();
  if (std::memcmp(h, kMagic, 4) != 0) return corrupt("apply_patch: bad magic (not a ferry patch)");
  if (static_cast<uint8_t>(h[4]) != kVersion)
    return corrupt("apply_patch: patch version {} (this build reads {})", static_cast<unsigned>(h[4]), kVersion);
  const unsigned enc = static_cast<unsigned>(h[5]), es = static_cast<unsigned>(h[6]);
  if (enc > static_cast<unsigned>(PatchEncoding::kBlocks)) return corrupt("apply_patch: unknown encoding {}", enc);
  if (es != 1 && es != 2 && es != 4) return corrupt("apply_patch: element size {}", es);
  if (enc == static_cast<unsigned>(PatchEncoding::kBlocks) && es != 1)
    return corrupt("apply_patch: blocks patch with element size {}", es);
  if (h[7] != std::byte(0)) return corrupt("apply_patch: reserved header byte is {}", static_cast<unsigned>(h[7]));
  PatchInfo info;
  info.encoding = static_cast<PatchEncoding>(enc);
  info.elem_size = es;
  info.elems = load_u64(h + 8);
  info.content_hash = load_u64(h + 16);
  const uint64_t payload = load_u64(h + 24);
  if (payload != patch.size() - kPatchHeaderBytes)
    return corrupt("apply_patch: header names {} payload bytes, the patch has {}", payload,
                   patch.size() - kPatchHeaderBytes);
  if (info.encoding == PatchEncoding::kDense && (info.elems > payload / es || info.elems * es != payload))
    return corrupt("apply_patch: dense patch of {} elements has {} payload bytes", info.elems, payload);
  info.bytes = patch.size();
  return info;
}

Status apply_patch(std::span<std::byte> target, std::span<const std::byte> patch) {
  FERRY_ASSIGN_OR_RETURN(const PatchInfo info, read_patch_header(patch));
  const size_t es = info.elem_size;
  if (target.size() % es != 0 || info.elems != target.size() / es)
    return invalid_argument("apply_patch: the patch is for {} elements of {} bytes, the target has {} bytes",
                            info.elems, es, target.size());
  const std::byte* p = patch.data() + kPatchHeaderBytes;
  const std::byte* end = patch.data() + patch.size();
  const uint64_t n = info.elems;
  switch (info.encoding) {
    case PatchEncoding::kDense:
      if (n) std::memcpy(target.data(), p, n * es);
      break;
    case PatchEncoding::kPositions:
      FERRY_RETURN_IF_ERROR(es == 1   ? apply_positions<1>(target, p, end, n)
                            : es == 2 ? apply_positions<2>(target, p, end, n)
                                      : apply_positions<4>(target, p, end, n));
      break;
    case PatchEncoding::kBitmap:
      FERRY_RETURN_IF_ERROR(es == 1   ? apply_bitmap<1>(target, p, end, n)
                            : es == 2 ? apply_bitmap<2>(target, p, end, n)
                                      : apply_bitmap<4>(target, p, end, n));
      break;
    case PatchEncoding::kBlocks:
      FERRY_RETURN_IF_ERROR(apply_blocks(target, p, end));
      break;
  }
  return check_hash(target, info.content_hash);
}

// ---- no-copy producers ----

Result<std::vector<uint64_t>> block_hashes(std::span<const std::byte> data, size_t block_bytes) {
  if (block_bytes == 0) return invalid_argument("block_hashes: block size 0");
  std::vector<uint64_t> h(ceil_div(data.size(), block_bytes));
  for (size_t b = 0; b < h.size(); ++b)
    h[b] = XXH3_64bits(data.data() + b * block_bytes, std::min(block_bytes, data.size() - b * block_bytes));
  return h;
}

size_t max_block_patch_bytes(size_t dense_bytes, size_t block_bytes) {
  const size_t nblocks = block_bytes ? ceil_div(dense_bytes, block_bytes) : 0;
  return kPatchHeaderBytes + 8 + ceil_div(nblocks, 8) + dense_bytes;
}

Result<PatchInfo> encode_changed_blocks(std::span<const uint64_t> prev_hashes, std::span<const std::byte> next,
                                        size_t block_bytes, std::span<std::byte> out,
                                        std::vector<uint64_t>* next_hashes) {
  if (block_bytes == 0) return invalid_argument("encode_changed_blocks: block size 0");
  const size_t n = next.size(), nblocks = ceil_div(n, block_bytes);
  if (prev_hashes.size() != nblocks)
    return invalid_argument("encode_changed_blocks: {} previous block hashes for {} blocks of {} bytes",
                            prev_hashes.size(), nblocks, block_bytes);
  if (out.size() < max_block_patch_bytes(n, block_bytes))
    return invalid_argument("encode_changed_blocks: the output has {} bytes, needs {}", out.size(),
                            max_block_patch_bytes(n, block_bytes));
  if (next_hashes) next_hashes->resize(nblocks);
  std::byte* p = out.data() + kPatchHeaderBytes;
  store_u64(p, block_bytes);
  p += 8;
  std::byte* map = p;
  std::memset(map, 0, ceil_div(nblocks, 8));
  p += ceil_div(nblocks, 8);
  PatchInfo info;
  for (size_t b = 0; b < nblocks; ++b) {
    const size_t len = std::min(block_bytes, n - b * block_bytes);
    const std::byte* src = next.data() + b * block_bytes;
    const uint64_t h = XXH3_64bits(src, len);
    if (next_hashes) (*next_hashes)[b] = h;
    if (h == prev_hashes[b]) continue;
    map[b / 8] |= std::byte(1u << (b % 8));
    std::memcpy(p, src, len);
    p += len;
    ++info.changed;
  }
  info.encoding = PatchEncoding::kBlocks;
  info.elem_size = 1;
  info.elems = n;
  info.bytes = static_cast<size_t>(p - out.data());
  info.dense_bytes = kPatchHeaderBytes + n;
  info.content_hash = XXH3_64bits(next.data(), n);
  write_header(out.data(), PatchEncoding::kBlocks, 1, n, info.content_hash, info.bytes - kPatchHeaderBytes);
  return info;
}

}  // namespace ferry::delta

namespace ferry::delta {

Result<ChangeLayout> parse_change_layout(std::string_view text) {
  if (text == "scattered") return ChangeLayout::kScattered;
  if (text == "clustered") return ChangeLayout::kClustered;
  return invalid_argument("change layout '{}': expected scattered or clustered", text);
}

const char* change_layout_name(ChangeLayout l) { return l == ChangeLayout::kScattered ? "scattered" : "clustered"; }

double predicted_patch_ratio(double fraction, double elem_bytes, ChangeLayout layout) {
  const double f = std::clamp(fraction, 0.0, 1.0), es = std::max(elem_bytes, 1e-9);
  const double B = static_cast<double>(kBitmapBlockElems);
  double positions = 0, bitmap = 0;  // bytes per element of content
  if (layout == ChangeLayout::kScattered) {
    // Gaps are geometric with mean 1/f: one LEB128 byte, one more from 128 up, from
    // 2^14, from 2^21 (a gap g >= 128 with probability (1-f)^128).
    const double q = 1 - f;
    const double leb = 1 + std::pow(q, 128.0) + std::pow(q, 16384.0) + std::pow(q, 2097152.0);
    positions = f * (es + leb);
    // Per block: 2 state bits; a partly changed block (some, not all changed) its bitmap.
    const double some = 1 - std::pow(q, B) - std::pow(f, B);
    bitmap = 1 / (4 * B) + some / 8 + f * es;
  } else {
    // Whole runs: every changed element a zero gap (one byte); whole blocks all changed
    // (state 2, no bitmap), runs long against a block.
    positions = f * (es + 1);
    bitmap = 1 / (4 * B) + f * es;
  }
  return std::min(1.0, std::min(positions, bitmap) / es);
}

}  // namespace ferry::delta
