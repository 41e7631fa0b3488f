// Patch codec (src/delta/patch.h): round trips per encoding, element size, change rate
// and pattern; byte-for-byte agreement with naive reference encoders; the size bound;
// malformed patches (every truncation, every bit flip) as errors; the no-copy block mode.
#include "delta/patch.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace ferry::delta {
namespace {

using Bytes = std::vector<std::byte>;

enum class Pattern { kScattered, kClustered };

struct Pair {
  Bytes base, next;
};

// `n` elements of `es` random bytes; about `fraction` of them changed (every changed
// element differs in at least one byte), scattered one by one or in contiguous runs.
Pair make_pair(size_t n, size_t es, double fraction, Pattern pattern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Pair p;
  p.base.resize(n * es);
  for (auto& b : p.base) b = std::byte(rng() & 0xff);
  p.next = p.base;
  auto change = [&](size_t i) {
    const size_t byte = rng() % es;
    p.next[i * es + byte] ^= std::byte(1 + rng() % 255);
  };
  if (n == 0 || fraction <= 0) return p;
  if (fraction >= 1) {
    for (size_t i = 0; i < n; ++i) change(i);
    return p;
  }
  if (pattern == Pattern::kScattered) {
    std::bernoulli_distribution pick(fraction);
    for (size_t i = 0; i < n; ++i)
      if (pick(rng)) change(i);
  } else {
    // Runs of 1..3*kBitmapBlockElems elements at random places, until the target count.
    const size_t target = static_cast<size_t>(std::llround(fraction * static_cast<double>(n)));
    std::vector<bool> done(n);
    size_t count = 0;
    while (count < target) {
      const size_t len = 1 + rng() % std::min<size_t>(n, 3 * kBitmapBlockElems);
      const size_t start = rng() % n;
      for (size_t i = start; i < std::min(n, start + len) && count < target; ++i) {
        if (done[i]) continue;
        done[i] = true;
        change(i);
        ++count;
      }
    }
  }
  return p;
}

// The changed element indices, by the most naive loop there is.
std::vector<size_t> naive_changed(const Bytes& base, const Bytes& next, size_t es) {
  std::vector<size_t> out;
  for (size_t i = 0; i * es < next.size(); ++i)
    if (std::memcmp(&base[i * es], &next[i * es], es) != 0) out.push_back(i);
  return out;
}

void put_varint(Bytes& out, uint64_t v) {
  do {
    uint8_t b = v & 0x7f;
    v >>= 7;
    if (v) b |= 0x80;
    out.push_back(std::byte(b));
  } while (v);
}

// Reference payloads (docs/delta.md), built element by element from naive_changed.
Bytes naive_positions_payload(const Bytes& next, size_t es, const std::vector<size_t>& changed) {
  Bytes out;
  put_varint(out, changed.size());
  size_t expect = 0;
  for (size_t i : changed) {
    put_varint(out, i - expect);
    expect = i + 1;
  }
  for (size_t i : changed) out.insert(out.end(), next.begin() + i * es, next.begin() + (i + 1) * es);
  return out;
}

Bytes naive_bitmap_payload(const Bytes& next, size_t es, const std::vector<size_t>& changed) {
  const size_t n = next.size() / es, B = kBitmapBlockElems, nblocks = (n + B - 1) / B;
  std::vector<bool> is_changed(n);
  for (size_t i : changed) is_changed[i] = true;
  Bytes states((nblocks + 3) / 4), maps, values;
  for (size_t b = 0; b < nblocks; ++b) {
    const size_t lo = b * B, hi = std::min(n, lo + B);
    size_t c = 0;
    for (size_t i = lo; i < hi; ++i) c += is_changed[i];
    if (c == 0) continue;
    const unsigned st = c == hi - lo ? 2 : 1;
    states[b / 4] |= std::byte(st << (2 * (b % 4)));
    if (st == 1) {
      Bytes m((hi - lo + 7) / 8);
      for (size_t i = lo; i < hi; ++i)
        if (is_changed[i]) m[(i - lo) / 8] |= std::byte(1u << ((i - lo) % 8));
      maps.insert(maps.end(), m.begin(), m.end());
    }
    for (size_t i = lo; i < hi; ++i)
      if (is_changed[i]) values.insert(values.end(), next.begin() + i * es, next.begin() + (i + 1) * es);
  }
  Bytes out = states;
  out.insert(out.end(), maps.begin(), maps.end());
  out.insert(out.end(), values.begin(), values.end());
  return out;
}

Bytes payload_of(const Bytes& patch) { return Bytes(patch.begin() + kPatchHeaderBytes, patch.end()); }

PatchChoice choice_of(PatchEncoding e) {
  switch (e) {
    case PatchEncoding::kBitmap: return PatchChoice::kBitmap;
    case PatchEncoding::kPositions: return PatchChoice::kPositions;
    default: return PatchChoice::kDense;
  }
}

// Encodes with `choice`, applies to a copy of base, expects next; returns the patch.
Bytes round_trip(const Pair& p, size_t es, PatchChoice choice) {
  Result<Bytes> patch = encode_patch(p.base, p.next, es, choice);
  EXPECT_TRUE(patch.ok()) << patch.status().to_string();
  if (!patch.ok()) return {};
  Bytes target = p.base;
  Status st = apply_patch(target, *patch);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(target == p.next);
  return *patch;
}

// ---- round trips ----

using Param = std::tuple<size_t /*es*/, double /*fraction*/, Pattern>;
class PatchRoundTrip : public ::testing::TestWithParam<Param> {};

TEST_P(PatchRoundTrip, EveryEncodingRoundTripsAndSmallestIsBounded) {
  const auto [es, fraction, pattern] = GetParam();
  const size_t n = 5 * kBitmapBlockElems + 37;  // not a whole number of blocks
  const Pair p = make_pair(n, es, fraction, pattern, 1000 + es);
  const std::vector<size_t> changed = naive_changed(p.base, p.next, es);

  const Bytes dense = round_trip(p, es, PatchChoice::kDense);
  const Bytes bitmap = round_trip(p, es, PatchChoice::kBitmap);
  const Bytes positions = round_trip(p, es, PatchChoice::kPositions);
  const Bytes smallest = round_trip(p, es, PatchChoice::kSmallest);
  EXPECT_EQ(dense.size(), kPatchHeaderBytes + n * es);
  EXPECT_EQ(payload_of(bitmap), naive_bitmap_payload(p.next, es, changed));
  EXPECT_EQ(payload_of(positions), naive_positions_payload(p.next, es, changed));
  EXPECT_EQ(smallest.size(), std::min({dense.size(), bitmap.size(), positions.size()}));
  EXPECT_LE(smallest.size(), max_patch_bytes(n * es));

  // The caller-buffer form writes the same bytes and reports every candidate's size.
  Bytes out(max_patch_bytes(n * es));
  Result<PatchInfo> info = encode_patch_into(p.base, p.next, es, out);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->bytes, smallest.size());
  EXPECT_TRUE(std::equal(smallest.begin(), smallest.end(), out.begin()));
  EXPECT_EQ(info->changed, changed.size());
  EXPECT_EQ(info->dense_bytes, dense.size());
  EXPECT_EQ(info->bitmap_bytes, bitmap.size());
  EXPECT_EQ(info->positions_bytes, positions.size());
  Result<PatchInfo> header = read_patch_header(smallest);
  ASSERT_TRUE(header.ok()) << header.status().to_string();
  EXPECT_EQ(header->encoding, info->encoding);
  EXPECT_EQ(header->elem_size, es);
  EXPECT_EQ(header->elems, n);
  EXPECT_EQ(header->content_hash, info->content_hash);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto [es, fraction, pattern] = info.param;
  std::string f = std::to_string(static_cast<int>(std::lround(fraction * 10000)));  // basis points
  return "es" + std::to_string(es) + "_bp" + f + (pattern == Pattern::kScattered ? "_scattered" : "_clustered");
}

INSTANTIATE_TEST_SUITE_P(Fractions, PatchRoundTrip,
                         ::testing::Combine(::testing::Values<size_t>(1, 2, 4),
                                            ::testing::Values(0.0, 0.0005, 0.01, 0.02, 0.10, 0.50, 1.0),
                                            ::testing::Values(Pattern::kScattered, Pattern::kClustered)),
                         param_name);

TEST(Patch, EmptyInput) {
  const Pair p;
  for (size_t es : {1, 2, 4}) {
    for (PatchChoice c : {PatchChoice::kSmallest, PatchChoice::kDense, PatchChoice::kBitmap, PatchChoice::kPositions}) {
      const Bytes patch = round_trip(p, es, c);
      EXPECT_LE(patch.size(), kPatchHeaderBytes + 1);
    }
    EXPECT_EQ(round_trip(p, es, PatchChoice::kSmallest).size(), kPatchHeaderBytes);
  }
}

TEST(Patch, SmallSizesAroundBlockAndChunkEdges) {
  for (size_t n : {1, 7, 8, 9, 63, 64, 65, 1023, 1024, 1025, 2047, 2049, 4095, 4096, 4097, 8193}) {
    for (size_t es : {1, 2, 4}) {
      for (double f : {0.0, 0.3, 1.0}) {
        const Pair p = make_pair(n, es, f, Pattern::kScattered, n * 31 + es);
        for (PatchChoice c :
             {PatchChoice::kSmallest, PatchChoice::kDense, PatchChoice::kBitmap, PatchChoice::kPositions})
          round_trip(p, es, c);
      }
    }
  }
}

// The size targets, on bf16 of 1M elements (sizes, not times).
TEST(Patch, SizeTargets) {
  const size_t n = 1 << 20, es = 2, dense = n * es;
  const Pair p1 = make_pair(n, es, 0.01, Pattern::kScattered, 7);
  const Pair p005 = make_pair(n, es, 0.0005, Pattern::kScattered, 8);
  Result<Bytes> a = encode_patch(p1.base, p1.next, es);
  Result<Bytes> b = encode_patch(p005.base, p005.next, es);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LE(static_cast<double>(a->size()), 0.04 * dense);
  EXPECT_LE(static_cast<double>(b->size()), 0.005 * dense);
  const Pair p100 = make_pair(n, es, 1.0, Pattern::kScattered, 9);
  Result<Bytes> c = encode_patch(p100.base, p100.next, es);
  ASSERT_TRUE(c.ok());
  EXPECT_LE(static_cast<double>(c->size()), 1.02 * dense);
}

// Bit patterns, not float values: NaNs with different payloads and +-0 are changes;
// the same NaN is not.
TEST(Patch, ComparesBitsNotFloats) {
  std::vector<float> base = {0.0f, std::nanf("1"), std::nanf("2"), 1.0f};
  std::vector<float> next = {-0.0f, std::nanf("3"), std::nanf("2"), 1.0f};
  auto bytes = [](const std::vector<float>& v) {
    Bytes out(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  };
  const Pair p{bytes(base), bytes(next)};
  Bytes out(max_patch_bytes(16));
  Result<PatchInfo> info = encode_patch_into(p.base, p.next, 4, out, PatchChoice::kPositions);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->changed, 2u);
  round_trip(p, 4, PatchChoice::kPositions);
  round_trip(p, 4, PatchChoice::kBitmap);
}

// ---- property test against the naive oracle ----

TEST(Patch, PropertyAgainstNaiveOracle) {
  std::mt19937_64 rng(12345);
  for (int iter = 0; iter < 60; ++iter) {
    const size_t es = size_t{1} << (rng() % 3);
    const size_t n = rng() % (3 * kBitmapBlockElems);
    const double fractions[] = {0.0, 0.0005, 0.003, 0.02, 0.1, 0.4, 0.9, 1.0};
    const double f = fractions[rng() % 8];
    const Pattern pat = rng() % 2 ? Pattern::kScattered : Pattern::kClustered;
    const Pair p = make_pair(n, es, f, pat, rng());
    const std::vector<size_t> changed = naive_changed(p.base, p.next, es);
    // Oracle apply: copy the new element at every listed position.
    Bytes oracle = p.base;
    for (size_t i : changed) std::memcpy(&oracle[i * es], &p.next[i * es], es);
    ASSERT_TRUE(oracle == p.next);
    for (PatchEncoding e : {PatchEncoding::kDense, PatchEncoding::kBitmap, PatchEncoding::kPositions}) {
      Result<Bytes> patch = encode_patch(p.base, p.next, es, choice_of(e));
      ASSERT_TRUE(patch.ok());
      if (e == PatchEncoding::kPositions) {
        EXPECT_EQ(payload_of(*patch), naive_positions_payload(p.next, es, changed));
      } else if (e == PatchEncoding::kBitmap) {
        EXPECT_EQ(payload_of(*patch), naive_bitmap_payload(p.next, es, changed));
      }
      Bytes target = p.base;
      ASSERT_TRUE(apply_patch(target, *patch).ok()) << "iter " << iter << " " << patch_encoding_name(e);
      EXPECT_TRUE(target == oracle) << "iter " << iter << " " << patch_encoding_name(e);
    }
    Result<Bytes> smallest = encode_patch(p.base, p.next, es);
    ASSERT_TRUE(smallest.ok());
    EXPECT_LE(smallest->size(), max_patch_bytes(n * es));
  }
}

// ---- errors ----

TEST(Patch, ArgumentErrors) {
  Bytes a(8), b(10), out(100);
  EXPECT_EQ(encode_patch(a, b, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_patch(a, a, 3).status().code(), StatusCode::kInvalidArgument);
  Bytes c(9);
  EXPECT_EQ(encode_patch(c, c, 2).status().code(), StatusCode::kInvalidArgument);
  // Output too small: one byte short of the dense bound.
  const Pair p = make_pair(64, 2, 1.0, Pattern::kScattered, 3);
  Bytes small(max_patch_bytes(128) - 1);
  Result<PatchInfo> r = encode_patch_into(p.base, p.next, 2, small);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  Bytes exact(max_patch_bytes(128));
  EXPECT_TRUE(encode_patch_into(p.base, p.next, 2, exact).ok());
  // Target of the wrong size.
  Result<Bytes> patch = encode_patch(p.base, p.next, 2);
  ASSERT_TRUE(patch.ok());
  Bytes wrong(126);
  EXPECT_EQ(apply_patch(wrong, *patch).code(), StatusCode::kInvalidArgument);
}

TEST(Patch, WrongBaseIsCaughtByTheHash) {
  const Pair p = make_pair(10000, 2, 0.01, Pattern::kScattered, 4);
  for (PatchChoice c : {PatchChoice::kSmallest, PatchChoice::kBitmap, PatchChoice::kPositions}) {
    Result<Bytes> patch = encode_patch(p.base, p.next, 2, c);
    ASSERT_TRUE(patch.ok());
    Bytes other = p.base;
    other[5000] ^= std::byte(1);  // an element the patch does not touch (most likely)
    const bool touched = p.base[5000] != p.next[5000] || p.base[5001] != p.next[5001];
    if (touched) other[4000] ^= std::byte(1);
    Status st = apply_patch(other, *patch);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
    EXPECT_NE(st.message().find("hash"), std::string::npos) << st.message();
    Result<PatchInfo> h = read_patch_header(*patch);
    ASSERT_TRUE(h.ok());
    EXPECT_NE(st.message().find(fmt::format("{:016x}", h->content_hash)), std::string::npos) << st.message();
  }
}

// Small patches of every encoding (and a blocks patch) for the malformed-input tests.
std::vector<std::pair<std::string, Bytes>> small_patches(Bytes* base_out) {
  const Pair p = make_pair(100, 2, 0.1, Pattern::kScattered, 5);
  *base_out = p.base;
  std::vector<std::pair<std::string, Bytes>> out;
  for (PatchChoice c : {PatchChoice::kDense, PatchChoice::kBitmap, PatchChoice::kPositions}) {
    Result<Bytes> patch = encode_patch(p.base, p.next, 2, c);
    EXPECT_TRUE(patch.ok());
    out.emplace_back(std::to_string(static_cast<int>(c)), *patch);
  }
  Result<std::vector<uint64_t>> prev = block_hashes(p.base, 16);
  EXPECT_TRUE(prev.ok());
  Bytes blocks(max_block_patch_bytes(p.next.size(), 16));
  Result<PatchInfo> info = encode_changed_blocks(*prev, p.next, 16, blocks);
  EXPECT_TRUE(info.ok());
  blocks.resize(info->bytes);
  out.emplace_back("blocks", blocks);
  return out;
}

TEST(Patch, EveryTruncationIsAnErrorAndLeavesTheTargetAlone) {
  Bytes base;
  for (const auto& [name, patch] : small_patches(&base)) {
    for (size_t len = 0; len < patch.size(); ++len) {
      Bytes target = base;
      Status st = apply_patch(target, std::span<const std::byte>(patch.data(), len));
      EXPECT_EQ(st.code(), StatusCode::kCorrupt) << name << " at " << len << ": " << st.to_string();
      EXPECT_TRUE(target == base) << name << " at " << len;
    }
    // Trailing bytes are refused too.
    Bytes longer = patch;
    longer.push_back(std::byte(0));
    Bytes target = base;
    EXPECT_EQ(apply_patch(target, longer).code(), StatusCode::kCorrupt) << name;
  }
}

TEST(Patch, EveryBitFlipIsAnError) {
  Bytes base;
  for (const auto& [name, patch] : small_patches(&base)) {
    for (size_t i = 0; i < patch.size(); ++i) {
      for (int bit = 0; bit < 8; ++bit) {
        Bytes bad = patch;
        bad[i] ^= std::byte(1u << bit);
        Bytes target = base;
        Status st = apply_patch(target, bad);
        EXPECT_FALSE(st.ok()) << name << " byte " << i << " bit " << bit;
      }
    }
  }
}

// Scrambled payloads: each is refused as corrupt (a structure the decoders reject, or
// content whose hash is not the one the header names), or, where the scramble left it
// valid (a byte set to the value it had), applied into exactly the version it names.
TEST(Patch, RandomGarbageIsRefusedAsCorruptOrGivesTheVersionItNames) {
  std::mt19937_64 rng(99);
  Bytes base;
  const auto patches = small_patches(&base);
  const Bytes next = make_pair(100, 2, 0.1, Pattern::kScattered, 5).next;  // (small_patches' pair)
  int refused = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    const auto& [name, patch] = patches[rng() % patches.size()];
    Bytes bad = patch;
    // Keep the header (so the payload decoders run), scramble a few payload bytes.
    const int flips = 1 + static_cast<int>(rng() % 6);
    for (int k = 0; k < flips && bad.size() > kPatchHeaderBytes; ++k)
      bad[kPatchHeaderBytes + rng() % (bad.size() - kPatchHeaderBytes)] = std::byte(rng() & 0xff);
    Bytes target = base;
    const Status st = apply_patch(target, bad);
    if (st.ok()) {
      EXPECT_TRUE(target == next) << name << ", iteration " << iter << ": applied, but not into the version it names";
    } else {
      ++refused;
      EXPECT_EQ(st.code(), StatusCode::kCorrupt) << name << ", iteration " << iter << ": " << st.to_string();
      EXPECT_FALSE(st.message().empty());
    }
  }
  EXPECT_GT(refused, 1800) << "most scrambles change a byte, and every change is caught";
}

// Positions past the end, hand-made: 10 elements, one change at 9.
TEST(Patch, OutOfRangePositions) {
  Bytes base(20), next(20);
  next[18] = std::byte(1);
  Result<Bytes> patch = encode_patch(base, next, 2, PatchChoice::kPositions);
  ASSERT_TRUE(patch.ok());
  const Bytes good = *patch;
  ASSERT_EQ(payload_of(good), (Bytes{std::byte(1), std::byte(9), std::byte(1), std::byte(0)}));
  {
    Bytes bad = good;
    bad[kPatchHeaderBytes + 1] = std::byte(10);  // position 10 of 10
    Bytes target = base;
    Status st = apply_patch(target, bad);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt);
    EXPECT_NE(st.message().find("past"), std::string::npos) << st.message();
  }
  {
    // A gap of 2^64-1 (ten LEB128 bytes) in place of 9: no overflow, an error.
    Bytes bad(good.begin(), good.begin() + kPatchHeaderBytes);
    Bytes payload = {std::byte(1)};
    for (int i = 0; i < 9; ++i) payload.push_back(std::byte(0xff));
    payload.push_back(std::byte(0x01));
    payload.push_back(std::byte(1));
    payload.push_back(std::byte(0));
    bad.insert(bad.end(), payload.begin(), payload.end());
    const uint64_t len = payload.size();
    std::memcpy(&bad[24], &len, 8);
    Bytes target = base;
    EXPECT_EQ(apply_patch(target, bad).code(), StatusCode::kCorrupt);
  }
  {
    // More changes claimed than elements.
    Bytes bad = good;
    bad[kPatchHeaderBytes] = std::byte(11);
    Bytes target = base;
    EXPECT_EQ(apply_patch(target, bad).code(), StatusCode::kCorrupt);
  }
}

TEST(Patch, BadBitmapStates) {
  Bytes base(2 * 10), next = base;
  next[0] = std::byte(1);
  Result<Bytes> patch = encode_patch(base, next, 2, PatchChoice::kBitmap);
  ASSERT_TRUE(patch.ok());
  // payload: state byte (block 0: some), 2 bitmap bytes, 2 value bytes.
  ASSERT_EQ(patch->size(), kPatchHeaderBytes + 5);
  for (uint8_t state : {0x03, 0x05, 0x02}) {  // invalid, a second block, "all" (value count wrong)
    Bytes bad = *patch;
    bad[kPatchHeaderBytes] = std::byte(state);
    Bytes target = base;
    EXPECT_EQ(apply_patch(target, bad).code(), StatusCode::kCorrupt) << int(state);
    EXPECT_TRUE(target == base);
  }
  Bytes bad = *patch;
  bad[kPatchHeaderBytes + 2] |= std::byte(0x04);  // element 10 of a 10-element block
  Bytes target = base;
  EXPECT_EQ(apply_patch(target, bad).code(), StatusCode::kCorrupt);
}

TEST(Patch, BadHeaders) {
  const Pair p = make_pair(50, 4, 0.1, Pattern::kScattered, 6);
  Result<Bytes> patch = encode_patch(p.base, p.next, 4);
  ASSERT_TRUE(patch.ok());
  auto with = [&](size_t at, uint8_t v) {
    Bytes b = *patch;
    b[at] = std::byte(v);
    Bytes target = p.base;
    return apply_patch(target, b).code();
  };
  EXPECT_EQ(with(0, 'X'), StatusCode::kCorrupt);  // magic
  EXPECT_EQ(with(4, 2), StatusCode::kCorrupt);    // version
  EXPECT_EQ(with(5, 4), StatusCode::kCorrupt);    // encoding
  EXPECT_EQ(with(6, 3), StatusCode::kCorrupt);    // element size
  EXPECT_EQ(with(7, 1), StatusCode::kCorrupt);    // reserved
  EXPECT_EQ(with(8, 51), StatusCode::kInvalidArgument);  // element count vs target
}

// ---- no-copy producers: changed blocks ----

TEST(ChangedBlocks, RoundTripsAndSkipsUnchangedBlocks) {
  for (size_t bb : {1, 100, 4096, 65536}) {
    for (double f : {0.0, 0.0005, 0.01, 0.5, 1.0}) {
      for (Pattern pat : {Pattern::kScattered, Pattern::kClustered}) {
        const Pair p = make_pair(50000, 2, f, pat, bb + 17);
        Result<std::vector<uint64_t>> prev = block_hashes(p.base, bb);
        ASSERT_TRUE(prev.ok());
        ASSERT_EQ(prev->size(), (p.base.size() + bb - 1) / bb);
        Bytes out(max_block_patch_bytes(p.next.size(), bb));
        std::vector<uint64_t> next_hashes;
        Result<PatchInfo> info = encode_changed_blocks(*prev, p.next, bb, out, &next_hashes);
        ASSERT_TRUE(info.ok()) << info.status().to_string();
        EXPECT_EQ(next_hashes, *block_hashes(p.next, bb));
        size_t changed_blocks = 0, changed_bytes = 0;
        for (size_t b = 0; b < prev->size(); ++b) {
          const size_t lo = b * bb, len = std::min(bb, p.next.size() - lo);
          if (std::memcmp(&p.base[lo], &p.next[lo], len) != 0) {
            ++changed_blocks;
            changed_bytes += len;
          }
        }
        EXPECT_EQ(info->changed, changed_blocks);
        EXPECT_EQ(info->bytes, kPatchHeaderBytes + 8 + (prev->size() + 7) / 8 + changed_bytes);
        Bytes target = p.base;
        Status st = apply_patch(target, std::span<const std::byte>(out.data(), info->bytes));
        EXPECT_TRUE(st.ok()) << st.to_string();
        EXPECT_TRUE(target == p.next);
      }
    }
  }
}

TEST(ChangedBlocks, Errors) {
  Bytes data(100);
  EXPECT_EQ(block_hashes(data, 0).status().code(), StatusCode::kInvalidArgument);
  Bytes out(max_block_patch_bytes(100, 10));
  std::vector<uint64_t> wrong(9);
  EXPECT_EQ(encode_changed_blocks(wrong, data, 10, out).status().code(), StatusCode::kInvalidArgument);
  std::vector<uint64_t> right(10);
  Bytes small(out.size() - 1);
  EXPECT_EQ(encode_changed_blocks(right, data, 10, small).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_changed_blocks(right, data, 10, out).ok());
  // A stale hash list (receiver holds something else): the content hash catches it.
  Result<std::vector<uint64_t>> h = block_hashes(data, 10);
  Bytes next = data;
  next[55] = std::byte(7);
  Result<PatchInfo> info = encode_changed_blocks(*h, next, 10, out);
  ASSERT_TRUE(info.ok());
  Bytes other = data;
  other[3] = std::byte(1);
  EXPECT_EQ(apply_patch(other, std::span<const std::byte>(out.data(), info->bytes)).code(), StatusCode::kCorrupt);
}


// --- predicted_patch_ratio against the encoder -------------------------------------------

// The size model (what `ferry simulate --changed-fraction` uses) against real patches:
// scattered changes as make_pair makes them; clustered as whole "tensors" of 32 Ki
// elements changed (what the model assumes: runs long against a bitmap block).
TEST(PatchModel, PredictsTheEncodersSize) {
  const size_t n = 1 << 20;
  for (size_t es : {size_t{1}, size_t{2}, size_t{4}}) {
    for (double f : {0.0005, 0.01, 0.02, 0.1, 0.5, 1.0}) {
      for (ChangeLayout layout : {ChangeLayout::kScattered, ChangeLayout::kClustered}) {
        Pair p;
        double f_made = f;  // the fraction changed (clustered: whole runs, rounded up)
        if (layout == ChangeLayout::kScattered) {
          p = make_pair(n, es, f, Pattern::kScattered, 77 + es);
        } else {
          p = make_pair(n, es, 0, Pattern::kScattered, 78 + es);
          const size_t run = 4 * kBitmapBlockElems, runs = n / run;
          const size_t changed_runs = static_cast<size_t>(std::ceil(f * static_cast<double>(runs)));
          f_made = static_cast<double>(changed_runs * run) / static_cast<double>(n);
          for (size_t r = 0; r < changed_runs; ++r) {  // every (runs / changed_runs)-th run
            const size_t at = (r * runs / std::max<size_t>(changed_runs, 1)) * run;
            for (size_t i = at; i < at + run; ++i) p.next[i * es] ^= std::byte(0x5a);
          }
        }
        auto patch = encode_patch(p.base, p.next, es);
        ASSERT_TRUE(patch.ok()) << patch.status().to_string();
        const double actual = static_cast<double>(patch->size() - kPatchHeaderBytes) / static_cast<double>(n * es);
        const double predicted = predicted_patch_ratio(f_made, static_cast<double>(es), layout);
        EXPECT_NEAR(predicted, actual, 0.03 * actual + 0.0003)
            << "es " << es << " fraction " << f << " " << change_layout_name(layout);
      }
    }
  }
  EXPECT_EQ(predicted_patch_ratio(0, 2, ChangeLayout::kScattered), 0.0);  // (a count of 0: one byte)
  EXPECT_LE(predicted_patch_ratio(1.5, 2, ChangeLayout::kScattered), 1.0);
  EXPECT_TRUE(parse_change_layout("clustered").ok());
  EXPECT_FALSE(parse_change_layout("random").ok());
}

}  // namespace
}  // namespace ferry::delta
