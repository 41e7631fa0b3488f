// Unit tests for dtypes, layouts and every Tensor op: semantics, edge cases, errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "ferry/plan.h"
#include "ferry/tensor.h"
#include "tensor/convert_kernels.h"

namespace ferry {
namespace {

Tensor iota(Shape shape, DType dtype = DType::kI32) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  std::byte* p = *t.data_ptr();
  for (int64_t i = 0; i < t.numel(); ++i) store_element(p + i * dtype_size(dtype), dtype, static_cast<double>(i));
  return t;
}

std::vector<double> values(const Tensor& t) {
  auto v = t.to_vector();
  EXPECT_TRUE(v.ok()) << v.status().to_string();
  return v.ok() ? *v : std::vector<double>{};
}

#define EXPECT_ERROR(tensor_expr, substr)                                         \
  do {                                                                            \
    Tensor _t = (tensor_expr);                                                    \
    EXPECT_FALSE(_t.ok());                                                        \
    EXPECT_NE(_t.status().message().find(substr), std::string::npos)             \
        << "message: " << _t.status().message() << "\nexpected to contain: " << substr; \
  } while (0)

// ---- dtypes -------------------------------------------------------------------------

TEST(DType, SizesAndNames) {
  const std::pair<DType, size_t> sizes[] = {{DType::kBF16, 2}, {DType::kF16, 2},   {DType::kF32, 4},  {DType::kF8E4M3, 1},
                                            {DType::kF8E5M2, 1}, {DType::kI8, 1},  {DType::kI16, 2},  {DType::kI32, 4},
                                            {DType::kI64, 8},  {DType::kU8, 1},    {DType::kBool, 1}};
  for (auto [d, s] : sizes) {
    EXPECT_EQ(dtype_size(d), s);
    auto parsed = parse_dtype(dtype_name(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(dtype_name(DType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(*parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(*parse_dtype("float8_e4m3fn"), DType::kF8E4M3);
  auto bad = parse_dtype("F128");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("F128"), std::string::npos);
  EXPECT_TRUE(is_floating(DType::kF8E5M2));
  EXPECT_FALSE(is_floating(DType::kI8));
}

double roundtrip(DType d, double v) {
  std::byte buf[8] = {};
  store_element(buf, d, v);
  return load_element(buf, d);
}

TEST(DType, FloatConversions) {
  // bf16: 8 bits of mantissa precision, round to nearest even.
  EXPECT_EQ(roundtrip(DType::kBF16, 1.0), 1.0);
  EXPECT_EQ(roundtrip(DType::kBF16, 1.0 + 1.0 / 256), 1.0);              // tie -> even
  EXPECT_EQ(roundtrip(DType::kBF16, 1.0 + 3.0 / 256), 1.0 + 4.0 / 256);  // tie -> even (up)
  EXPECT_EQ(roundtrip(DType::kBF16, -2.5), -2.5);
  EXPECT_TRUE(std::isinf(roundtrip(DType::kBF16, 1e39)));
  EXPECT_TRUE(std::isnan(roundtrip(DType::kBF16, NAN)));
  // bf16 bit pattern of 1.0 is 0x3F80.
  std::byte b[2];
  store_element(b, DType::kBF16, 1.0);
  uint16_t bits;
  std::memcpy(&bits, b, 2);
  EXPECT_EQ(bits, 0x3F80);
  // fp16
  EXPECT_EQ(roundtrip(DType::kF16, 65504.0), 65504.0);
  EXPECT_TRUE(std::isinf(roundtrip(DType::kF16, 70000.0)));
  EXPECT_EQ(roundtrip(DType::kF16, std::ldexp(1.0, -24)), std::ldexp(1.0, -24));  // smallest subnormal
  store_element(b, DType::kF16, 1.0);
  std::memcpy(&bits, b, 2);
  EXPECT_EQ(bits, 0x3C00);
  // fp8 e4m3fn: max 448, saturating; NaN is 0x7F.
  EXPECT_EQ(roundtrip(DType::kF8E4M3, 448.0), 448.0);
  EXPECT_EQ(roundtrip(DType::kF8E4M3, 1000.0), 448.0);
  EXPECT_EQ(roundtrip(DType::kF8E4M3, -1e9), -448.0);
  EXPECT_EQ(roundtrip(DType::kF8E4M3, 0.0625), 0.0625);
  EXPECT_EQ(roundtrip(DType::kF8E4M3, std::ldexp(1.0, -9)), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(roundtrip(DType::kF8E4M3, NAN)));
  std::byte f8;
  store_element(&f8, DType::kF8E4M3, 1.0);
  EXPECT_EQ(static_cast<int>(f8), 0x38);
  // fp8 e5m2: IEEE-like, max 57344.
  EXPECT_EQ(roundtrip(DType::kF8E5M2, 57344.0), 57344.0);
  EXPECT_TRUE(std::isinf(roundtrip(DType::kF8E5M2, 1e6)));
  store_element(&f8, DType::kF8E5M2, 1.0);
  EXPECT_EQ(static_cast<int>(f8), 0x3C);
  // Every e4m3 code decodes and re-encodes to itself (except the NaNs).
  for (int c = 0; c < 256; ++c) {
    std::byte in = static_cast<std::byte>(c), out;
    double v = load_element(&in, DType::kF8E4M3);
    if (std::isnan(v)) continue;
    store_element(&out, DType::kF8E4M3, v);
    EXPECT_EQ(static_cast<int>(out), c == 0x80 ? 0x80 : c) << "code " << c;
  }
  // Integers saturate and truncate.
  EXPECT_EQ(roundtrip(DType::kI8, 300.0), 127.0);
  EXPECT_EQ(roundtrip(DType::kU8, -3.0), 0.0);
  EXPECT_EQ(roundtrip(DType::kI32, -7.9), -7.0);
  EXPECT_EQ(roundtrip(DType::kBool, 5.0), 1.0);
}

// ---- layouts --------------------------------------------------------------------------

TEST(Layout, ContiguousAndOffsets) {
  Layout l = Layout::contiguous({2, 3, 4});
  EXPECT_EQ(l.strides, (Shape{12, 4, 1}));
  EXPECT_TRUE(l.is_contiguous());
  EXPECT_EQ(l.max_offset(), 23);
  EXPECT_EQ(l.offset_of({1, 2, 3}), 23);
  Layout t{{3, 2}, {1, 3}, 0};
  EXPECT_FALSE(t.is_contiguous());
  Layout n{{4}, {-2}, 10};
  EXPECT_EQ(n.min_offset(), 4);
  EXPECT_EQ(n.max_offset(), 10);
}

TEST(Layout, Coalesce) {
  Layout a{{2, 1, 3, 4}, {12, 99, 4, 1}, 5};
  Layout b{{2, 1, 3, 4}, {24, 7, 4, 1}, 0};
  coalesce_layouts(a, b);
  EXPECT_EQ(a.shape, (Shape{2, 12}));
  EXPECT_EQ(a.strides, (Shape{12, 1}));
  EXPECT_EQ(b.strides, (Shape{24, 1}));
  Layout c = Layout::contiguous({3, 0, 2});
  coalesce_layout(c);
  EXPECT_EQ(c.shape, (Shape{0}));
}

// ---- construction ---------------------------------------------------------------------

TEST(Tensor, ConstructionAndAccessors) {
  Tensor t = Tensor::empty({2, 3}, DType::kBF16, "buf");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t.is_real());
  EXPECT_EQ(t.nbytes(), 12);
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.size(2), -1);
  EXPECT_EQ(t.describe(), "buffer 'buf' [2, 3] BF16");
  EXPECT_EQ(values(t), std::vector<double>(6, 0.0));  // zero-filled

  Tensor s = Tensor::source("model.norm.weight", {8}, DType::kBF16);
  EXPECT_TRUE(s.is_recording());
  EXPECT_EQ(s.storage_kind(), StorageKind::kSource);
  EXPECT_EQ(s.describe(), "source 'model.norm.weight' [8] BF16");
  EXPECT_EQ(Tensor::param("p", {2}, DType::kF32).storage_kind(), StorageKind::kParam);

  EXPECT_ERROR(Tensor::empty({2, -1}, DType::kF32), "negative size");
  EXPECT_ERROR(Tensor::source("", {2}, DType::kF32), "needs a name");
  EXPECT_ERROR(Tensor::borrow(nullptr, {2}, DType::kF32), "null data");
  Tensor undefined;
  EXPECT_FALSE(undefined.ok());
  EXPECT_ERROR(undefined.narrow(0, 0, 1), "undefined");

  std::vector<float> host = {1, 2, 3, 4};
  auto keep = std::make_shared<int>(7);
  Tensor b = Tensor::borrow(host.data(), {2, 2}, DType::kF32, keep);
  EXPECT_EQ(keep.use_count(), 2);
  EXPECT_EQ(values(b.t()), (std::vector<double>{1, 3, 2, 4}));
}

// ---- views ----------------------------------------------------------------------------

TEST(TensorViews, Narrow) {
  Tensor t = iota({4, 3});
  EXPECT_EQ(values(t.narrow(0, 1, 2)), (std::vector<double>{3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(values(t.narrow(1, -1, 1)), (std::vector<double>{2, 5, 8, 11}));
  EXPECT_EQ(t.narrow(0, 4, 0).numel(), 0);
  EXPECT_ERROR(t.narrow(0, 3, 2), "start 3 + length 2 exceeds size 4 of dim 0 of [4, 3]");
  EXPECT_ERROR(t.narrow(2, 0, 1), "dim 2 out of range");
  EXPECT_ERROR(t.narrow(0, 5, 0), "start 5 out of range");
  EXPECT_ERROR(t.narrow(0, 0, -1), "length -1");
  EXPECT_ERROR(iota({}).narrow(0, 0, 1), "0-d");
}

TEST(TensorViews, SelectAndIndex) {
  Tensor t = iota({2, 3});
  EXPECT_EQ(values(t[1]), (std::vector<double>{3, 4, 5}));
  EXPECT_EQ(values(t.select(1, -1)), (std::vector<double>{2, 5}));
  EXPECT_EQ(t.select(0, 0).select(0, 2).dim(), 0);
  EXPECT_EQ(*t.select(0, 1).select(0, 2).item(), 5.0);
  EXPECT_ERROR(t.select(0, 2), "index 2 out of range for size 2 of dim 0");
  EXPECT_ERROR(t.select(-3, 0), "dim -3 out of range");
  EXPECT_ERROR(iota({}).select(0, 0), "0-d");
}

TEST(TensorViews, Slice) {
  Tensor t = iota({10});
  EXPECT_EQ(values(t.slice(0, 1, 8, 3)), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(values(t.slice(0, -3, std::nullopt)), (std::vector<double>{7, 8, 9}));
  EXPECT_EQ(values(t.slice(0, std::nullopt, -8)), (std::vector<double>{0, 1}));
  EXPECT_EQ(t.slice(0, 20, 30).numel(), 0);   // clamped like Python
  EXPECT_EQ(t.slice(0, 5, 2).numel(), 0);
  EXPECT_EQ(values(t.slice(0, -100, 100, 4)), (std::vector<double>{0, 4, 8}));
  EXPECT_ERROR(t.slice(0, 0, 5, 0), "step must be positive, got 0");
  EXPECT_ERROR(t.slice(0, 0, 5, -1), "step must be positive");
  EXPECT_ERROR(t.slice(1, 0, 5), "dim 1 out of range");
}

TEST(TensorViews, ViewAndReshape) {
  Tensor t = iota({2, 3, 4});
  EXPECT_EQ(t.view({6, -1}).shape(), (Shape{6, 4}));
  EXPECT_EQ(t.view({24}).shape(), (Shape{24}));
  EXPECT_EQ(t.view({1, 2, 1, 12}).shape(), (Shape{1, 2, 1, 12}));
  EXPECT_ERROR(t.view({5, -1}), "shape [5, -1] is invalid for input of size 24");
  EXPECT_ERROR(t.view({-1, -1}), "only one dimension can be -1");
  EXPECT_ERROR(t.view({2, -2, 6}), "invalid size -2");
  // A transposed tensor can split dims but not merge non-contiguous ones.
  Tensor tt = t.transpose(1, 2);  // [2, 4, 3]
  EXPECT_TRUE(tt.view({2, 2, 2, 3}).ok());
  EXPECT_ERROR(tt.view({2, 12}), "not compatible with strides");
  // reshape copies where view can't.
  Tensor r = tt.reshape({2, 12});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(values(r), values(tt));
  // reshape of a viewable shape is a view (shares storage).
  Tensor v = t.reshape({4, 6});
  EXPECT_EQ(*v.data_ptr(), *t.data_ptr());
  // 0-d and empty.
  EXPECT_EQ(iota({}).view({1, 1}).shape(), (Shape{1, 1}));
  EXPECT_EQ(iota({}).reshape({-1}).shape(), (Shape{1}));
  EXPECT_EQ(iota({0, 3}).view({3, 0}).shape(), (Shape{3, 0}));
  EXPECT_ERROR(iota({0, 3}).view({-1, 0}), "invalid for input of size 0");
}

TEST(TensorViews, TransposePermuteT) {
  Tensor t = iota({2, 3});
  EXPECT_EQ(values(t.t()), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(values(t.transpose(-1, 0)), values(t.t()));
  EXPECT_EQ(iota({5}).t().shape(), (Shape{5}));
  EXPECT_ERROR(iota({2, 2, 2}).t(), "expects a tensor with <= 2 dims");
  EXPECT_ERROR(t.transpose(0, 2), "dims (0, 2) out of range");
  Tensor p = iota({2, 3, 4}).permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.strides(), (Shape{1, 12, 4}));
  EXPECT_ERROR(iota({2, 3}).permute({0, 0}), "invalid permutation [0, 0]");
  EXPECT_ERROR(iota({2, 3}).permute({0}), "1 dims given for 2-d shape");
}

TEST(TensorViews, FlattenUnflatten) {
  Tensor t = iota({2, 3, 4});
  EXPECT_EQ(t.flatten().shape(), (Shape{24}));
  EXPECT_EQ(t.flatten(1).shape(), (Shape{2, 12}));
  EXPECT_EQ(t.flatten(0, 1).shape(), (Shape{6, 4}));
  EXPECT_EQ(t.flatten(1, 1).shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(iota({}).flatten().shape(), (Shape{1}));
  EXPECT_ERROR(t.flatten(2, 1), "invalid dims start 2 end 1");
  EXPECT_EQ(t.unflatten(2, {2, 2}).shape(), (Shape{2, 3, 2, 2}));
  EXPECT_EQ(t.unflatten(-1, {-1, 2}).shape(), (Shape{2, 3, 2, 2}));
  EXPECT_ERROR(t.unflatten(1, {2, 2}), "do not multiply to size 3");
  EXPECT_ERROR(t.unflatten(1, {}), "sizes must be non-empty");
  // flatten of a transposed tensor copies, preserving values.
  EXPECT_EQ(values(iota({2, 3}).t().flatten()), (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

TEST(TensorViews, SqueezeUnsqueeze) {
  Tensor t = iota({1, 3, 1});
  EXPECT_EQ(t.squeeze().shape(), (Shape{3}));
  EXPECT_EQ(t.squeeze(0).shape(), (Shape{3, 1}));
  EXPECT_EQ(t.squeeze(1).shape(), (Shape{1, 3, 1}));  // not size 1: no-op
  EXPECT_EQ(t.squeeze(-1).shape(), (Shape{1, 3}));
  EXPECT_ERROR(t.squeeze(3), "dim 3 out of range");
  EXPECT_EQ(iota({3}).unsqueeze(0).shape(), (Shape{1, 3}));
  EXPECT_EQ(iota({3}).unsqueeze(-1).shape(), (Shape{3, 1}));
  EXPECT_EQ(iota({}).unsqueeze(0).shape(), (Shape{1}));
  EXPECT_ERROR(iota({3}).unsqueeze(2), "dim 2 out of range");
  EXPECT_EQ(values(iota({2, 3}).unsqueeze(1).squeeze()), values(iota({2, 3})));
}

TEST(TensorViews, ChunkSplitUnbind) {
  Tensor t = iota({5, 2});
  auto c = t.chunk(2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].shape(), (Shape{3, 2}));
  EXPECT_EQ(c[1].shape(), (Shape{2, 2}));
  EXPECT_EQ(iota({4}).chunk(3).size(), 2u);  // torch: ceil(4/3)=2 per chunk -> 2 chunks
  EXPECT_EQ(iota({0}).chunk(3).size(), 3u);
  EXPECT_FALSE(t.chunk(0).ok());
  EXPECT_NE(t.chunk(0).status().message().find("chunks must be positive"), std::string::npos);
  EXPECT_ERROR(c[2], "index 2 out of range for a list of 2 tensors");

  auto s = t.split(2);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[2].shape(), (Shape{1, 2}));
  auto s2 = t.split(std::vector<int64_t>{1, 4});
  EXPECT_EQ(s2[1].shape(), (Shape{4, 2}));
  EXPECT_EQ(values(s2[0]), (std::vector<double>{0, 1}));
  auto bad = t.split(std::vector<int64_t>{1, 3});
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sizes [1, 3] sum to 4 but dim 0 has size 5"), std::string::npos);
  EXPECT_ERROR(bad[0], "sum to 4");
  EXPECT_FALSE(t.split(0).ok());
  EXPECT_FALSE(t.split(1, 2).ok());

  auto u = t.unbind(1);
  ASSERT_EQ(u.size(), 2u);
  EXPECT_EQ(values(u[1]), (std::vector<double>{1, 3, 5, 7, 9}));
  int n = 0;
  for (const Tensor& part : t.unbind()) n += part.ok();
  EXPECT_EQ(n, 5);
}

TEST(TensorViews, ErrorsPropagateThroughChains) {
  Tensor t = iota({4, 4});
  Tensor bad = t.narrow(0, 3, 5).transpose(0, 1).reshape({-1}).select(0, 0);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("narrow"), std::string::npos);
  Status st = iota({1}).copy_(bad);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("narrow"), std::string::npos);
}

// ---- writes and values ----------------------------------------------------------------

TEST(TensorWrites, CopyRealWithConversionAndStrides) {
  Tensor src = iota({2, 3}, DType::kF32);
  Tensor dst = Tensor::empty({3, 2}, DType::kBF16);
  ASSERT_TRUE(dst.t().copy_(src).ok());
  EXPECT_EQ(values(dst), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  // Shapes that differ only by size-1 dims: as torch.
  Tensor flat = Tensor::empty({6}, DType::kF32);
  ASSERT_TRUE(flat.unsqueeze(0).copy_(src.t().reshape({6})).ok());
  EXPECT_EQ(values(flat), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  // Errors.
  Status st = Tensor::empty({5}, DType::kF32).copy_(src);
  EXPECT_NE(st.message().find("numel 6"), std::string::npos) << st.message();
  st = Tensor::empty({6}, DType::kI32).copy_(flat);
  EXPECT_NE(st.message().find("cannot convert"), std::string::npos) << st.message();
}

// f32 <-> bf16, the conversions a trainer's fp32 masters meet every sync, take a path of
// their own in strided_copy (integer bit operations, no double): the same bits as the
// element path (load_element / store_element) for every bf16 value, and for f32 values
// of every sign/exponent/top-mantissa (all 2^16 high halves) with low halves at each
// rounding boundary (below, at and above a tie, even and odd) and random ones: NaNs of
// both signs and payloads, infinities, zeros, subnormals, overflow to infinity.
// Contiguous and strided.
TEST(TensorWrites, Bf16F32ConversionsHaveTheElementPathsBits) {
  std::vector<uint32_t> lows = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
  std::mt19937 rng(7);
  for (int k = 0; k < 4; ++k) lows.push_back(rng() & 0xffff);
  std::vector<uint32_t> f32;
  for (uint32_t hi = 0; hi < 0x10000; ++hi)
    for (uint32_t lo : lows) f32.push_back(hi << 16 | lo);
  const int64_t n = static_cast<int64_t>(f32.size());
  auto bytes = [](const auto& v) { return reinterpret_cast<const std::byte*>(v.data()); };
  // f32 -> bf16, contiguous.
  std::vector<uint16_t> fast(f32.size()), slow(f32.size());
  strided_copy(bytes(f32), Layout::contiguous({n}), DType::kF32, reinterpret_cast<std::byte*>(fast.data()),
               Layout::contiguous({n}), DType::kBF16);
  for (int64_t i = 0; i < n; ++i)
    store_element(reinterpret_cast<std::byte*>(&slow[i]), DType::kBF16, load_element(bytes(f32) + 4 * i, DType::kF32));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (fast[i] != slow[i] && bad++ < 5) {
      ADD_FAILURE() << std::hex << "f32 0x" << f32[i] << " -> bf16 0x" << fast[i] << ", element path 0x" << slow[i];
    }
  }
  EXPECT_EQ(bad, 0);
  // Each kernel this CPU runs (strided_copy takes the widest), on the same values, at an
  // odd length and an odd start (the kernels convert a prefix; the caller the tail).
  for (const detail::F32ToBf16Kernel& k : detail::f32_to_bf16_kernels()) {
    std::vector<uint16_t> out(f32.size(), 0xabcd);
    const int64_t len = n - 3;
    const int64_t done = k.run(bytes(f32) + 4, reinterpret_cast<std::byte*>(out.data() + 1), len);
    EXPECT_GT(done, len - 16) << k.isa;
    EXPECT_LE(done, len) << k.isa;
    int64_t wrong = 0;
    for (int64_t i = 0; i < done; ++i) {
      if (out[i + 1] != slow[i + 1] && wrong++ < 5) {
        ADD_FAILURE() << k.isa << std::hex << ": f32 0x" << f32[i + 1] << " -> bf16 0x" << out[i + 1]
                      << ", element path 0x" << slow[i + 1];
      }
    }
    EXPECT_EQ(wrong, 0) << k.isa;
    EXPECT_EQ(out[0], 0xabcd) << k.isa;
    for (int64_t i = done + 1; i < n; ++i) ASSERT_EQ(out[i], 0xabcd) << k.isa << " wrote past what it converted";
  }
  // f32 -> bf16, strided: every third source element into every second destination one.
  const int64_t m = n / 3;
  std::vector<uint16_t> strided(static_cast<size_t>(2 * m), 0xabcd);
  strided_copy(bytes(f32), Layout{{m}, {3}, 0}, DType::kF32, reinterpret_cast<std::byte*>(strided.data()),
               Layout{{m}, {2}, 0}, DType::kBF16);
  for (int64_t i = 0; i < m; ++i) {
    ASSERT_EQ(strided[2 * i], slow[3 * i]) << i;
    ASSERT_EQ(strided[2 * i + 1], 0xabcd) << i;
  }
  // bf16 -> f32: every value.
  std::vector<uint16_t> bf(0x10000);
  std::iota(bf.begin(), bf.end(), uint16_t{0});
  std::vector<uint32_t> wide(bf.size()), wide_slow(bf.size());
  strided_copy(bytes(bf), Layout::contiguous({0x10000}), DType::kBF16, reinterpret_cast<std::byte*>(wide.data()),
               Layout::contiguous({0x10000}), DType::kF32);
  for (size_t i = 0; i < bf.size(); ++i) {
    store_element(reinterpret_cast<std::byte*>(&wide_slow[i]), DType::kF32, load_element(bytes(bf) + 2 * i, DType::kBF16));
    ASSERT_EQ(wide[i], wide_slow[i]) << std::hex << "bf16 0x" << bf[i];
  }
}

TEST(TensorWrites, CopyFollowsTorchBroadcastingRules) {
  // Equal numels are not enough: torch refuses p(8,4).copy_(w.t()) for w (8,4), and (6,) <- (2,3).
  Tensor w = iota({8, 4}, DType::kF32);
  Status st = Tensor::empty({8, 4}, DType::kF32).copy_(w.t());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("does not broadcast"), std::string::npos) << st.message();
  EXPECT_FALSE(Tensor::empty({6}, DType::kF32).copy_(iota({2, 3}, DType::kF32)).ok());
  EXPECT_FALSE(Tensor::empty({4}, DType::kF32).copy_(iota({1, 4}, DType::kF32)).ok());  // more dims than dst
  // What torch accepts: broadcasting a row, a column, a scalar-like tensor.
  Tensor row = Tensor::empty({3, 4}, DType::kF32);
  ASSERT_TRUE(row.copy_(iota({4}, DType::kF32)).ok());
  EXPECT_EQ(values(row), (std::vector<double>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}));
  Tensor col = Tensor::empty({2, 3}, DType::kF32);
  ASSERT_TRUE(col.copy_(iota({2, 1}, DType::kF32)).ok());
  EXPECT_EQ(values(col), (std::vector<double>{0, 0, 0, 1, 1, 1}));
  Tensor one = Tensor::empty({1, 1, 2}, DType::kF32);
  ASSERT_TRUE(one.copy_(iota({2}, DType::kF32)).ok());
  EXPECT_EQ(values(one), (std::vector<double>{0, 1}));
  // Recorded: a broadcast source is one copy per slice of the param.
  Recorder rec;
  ASSERT_TRUE(Tensor::param("p", {3, 4}, DType::kF32).copy_(Tensor::source("b", {4}, DType::kF32)).ok());
  st = Tensor::param("q", {8, 4}, DType::kF32).copy_(Tensor::source("w", {8, 4}, DType::kF32).t());
  EXPECT_NE(st.message().find("does not broadcast"), std::string::npos) << st.message();
}

TEST(TensorWrites, LargeCopiesUseStreamingStoresCorrectly) {
  // > 32 MiB in runs of >= 2 KiB takes the streaming path; odd offsets test the
  // unaligned head and tail.
  const int64_t rows = 4099, cols = 12289;
  Tensor src = Tensor::empty({rows, cols}, DType::kU8);
  std::byte* p = *src.data_ptr();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  Tensor dst = Tensor::empty({rows, 8195}, DType::kU8);
  ASSERT_TRUE(dst.copy_(src.narrow(1, 3, 8195)).ok());
  const std::byte* d = *dst.data_ptr();
  int64_t mismatches = 0;
  for (int64_t r = 0; r < rows; ++r) {
    mismatches += std::memcmp(d + r * 8195, p + r * cols + 3, 8195) != 0;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(TensorWrites, ReadOnlyBorrowsRefuseWrites) {
  const float host[3] = {1, 2, 3};
  Tensor r = Tensor::borrow_readonly(host, {3}, DType::kF32);
  ASSERT_TRUE(r.is_read_only());
  EXPECT_EQ(*r.narrow(0, 1, 1).item(), 2.0);
  Status st = r.copy_(iota({3}, DType::kF32));
  EXPECT_NE(st.message().find("read-only"), std::string::npos) << st.message();
  EXPECT_NE(r.narrow(0, 0, 1).zero_().message().find("read-only"), std::string::npos);
  Tensor c = r.clone();
  EXPECT_FALSE(c.is_read_only());
  EXPECT_TRUE(c.copy_(iota({3}, DType::kF32)).ok());
}

TEST(TensorWrites, Zero) {
  Tensor t = iota({3, 4}, DType::kF32);
  ASSERT_TRUE(t.narrow(1, 1, 2).zero_().ok());
  EXPECT_EQ(values(t), (std::vector<double>{0, 0, 0, 3, 4, 0, 0, 7, 8, 0, 0, 11}));
  ASSERT_TRUE(t.t().select(0, 0).zero_().ok());
  EXPECT_EQ(values(t.select(1, 0)), (std::vector<double>{0, 0, 0}));
  Tensor scalar = iota({3}, DType::kF32).select(0, 2);  // 0-d
  ASSERT_TRUE(scalar.zero_().ok());
  EXPECT_EQ(*scalar.item(), 0.0);
  Status st = Tensor::source("s", {2}, DType::kF32).zero_();
  EXPECT_NE(st.message().find("recording source"), std::string::npos);
  st = Tensor::param("p", {2}, DType::kF32).zero_();
  EXPECT_NE(st.message().find("no Recorder is active"), std::string::npos);
}

TEST(TensorValues, ValuesOps) {
  Tensor a = iota({2, 2}, DType::kF32);
  EXPECT_TRUE(*a.equal(a.clone()));
  EXPECT_FALSE(*a.equal(a.t()));
  EXPECT_EQ(values(*a.add(a)), (std::vector<double>{0, 2, 4, 6}));
  EXPECT_EQ(values(*a.mul(0.5)), (std::vector<double>{0, 0.5, 1, 1.5}));
  EXPECT_FALSE(a.item().ok());
  EXPECT_FALSE(a.add(iota({4}, DType::kF32)).ok());
}

TEST(TensorValues, RecordingTensorsRefuseValueOps) {
  Tensor s = Tensor::source("model.embed_tokens.weight", {4, 2}, DType::kBF16);
  auto expect = [&](const Status& st, const char* op) {
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(op), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("model.embed_tokens.weight"), std::string::npos) << st.message();
  };
  expect(s.data_ptr().status(), "data_ptr");
  expect(s.item().status(), "item");
  expect(s.to_vector().status(), "to_vector");
  expect(s.equal(s).status(), "equal");
  expect(s.add(s).status(), "add");
  expect(s.mul(2).status(), "mul");
  EXPECT_ERROR(s.clone(), "clone");
  // copy_ from a recording source with no recorder.
  Status st = Tensor::param("p", {4, 2}, DType::kBF16).copy_(s);
  expect(st, "copy_");
  EXPECT_NE(st.message().find("no Recorder"), std::string::npos);
  // copy_ from real values into a recording param is refused.
  st = Tensor::param("p", {2}, DType::kF32).copy_(iota({2}, DType::kF32));
  EXPECT_NE(st.message().find("cannot record a copy of real values"), std::string::npos) << st.message();
}

TEST(TensorMaps, ElementMapOfAPlainViewIsItsLayout) {
  Tensor s = Tensor::source("w", {4, 6}, DType::kBF16);
  Tensor v = s.narrow(1, 2, 3).t();
  auto m = v.element_map();
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->size(), 1u);
  EXPECT_EQ((*m)[0].root, v.layout());
  EXPECT_FALSE(v.is_recorded_copy());
}

TEST(TensorMaps, RecordedCopyOfATransposeFlatten) {
  // w.t().reshape(-1) is not a view; its map is 3 pieces of 2 (one per source column).
  Tensor s = Tensor::source("w", {2, 3}, DType::kF32);
  Tensor f = s.t().reshape({-1});
  EXPECT_TRUE(f.is_recorded_copy());
  auto m = f.element_map();
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ((*m)[k].start, (Shape{2 * k}));
    EXPECT_EQ((*m)[k].root.shape, (Shape{2}));
    EXPECT_EQ((*m)[k].root.strides, (Shape{3}));
    EXPECT_EQ((*m)[k].root.offset, k);
  }
  // Recorded into a plan, the pieces coalesce into one 2-D copy.
  Recorder rec;
  ASSERT_TRUE(Tensor::param("p", {6}, DType::kF32).copy_(f).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->copies().size(), 1u);
  EXPECT_EQ(plan->copies()[0].dst.shape, (Shape{3, 2}));
  EXPECT_EQ(plan->copies()[0].src.strides, (Shape{1, 3}));
}

TEST(TensorMaps, WritingIntoARecordedCopyIsRefused) {
  Recorder rec;
  Tensor p = Tensor::param("p", {2, 3}, DType::kF32);
  Tensor s = Tensor::source("s", {6}, DType::kF32);
  Status st = p.t().reshape({-1}).copy_(s);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("would be lost"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// A map over as many pieces as a row-parallel weight has holders under fsdp=10^6: the
// recursion once per cut overflowed the stack (SIGSEGV), and every cut rescanned every
// piece (quadratic). Each element lands in its own piece, in one pass.
TEST(TensorMaps, ComposeLayoutOverManyPieces) {
  const int64_t n = 300000;
  std::vector<MapPiece> pieces;
  pieces.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pieces.push_back(MapPiece{{i}, Layout::contiguous({1})});
  // Reversed: a view whose first element lies in the last piece.
  const Layout reversed{{n}, {-1}, n - 1};
  auto out = compose_layout(reversed, {n}, pieces);
  ASSERT_EQ(out.size(), static_cast<size_t>(n));
  std::vector<char> seen(static_cast<size_t>(n), 0);
  for (const MapPiece& m : out) {
    ASSERT_EQ(m.root.numel(), 1);
    ASSERT_EQ(m.root.offset, 0);
    const int64_t element = m.start[0];
    EXPECT_EQ(m.part, static_cast<uint32_t>(n - 1 - element));
    seen[static_cast<size_t>(element)]++;
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n);
  // A 2-D weight split on dim 1 (row-parallel) into many column slices.
  const int64_t rows = 3, cols = 20000;
  std::vector<MapPiece> slices;
  for (int64_t c = 0; c < cols; ++c) slices.push_back(MapPiece{{0, c}, Layout::contiguous({rows, 1})});
  auto cut = compose_layout(Layout::contiguous({rows, cols}), {rows, cols}, slices);
  int64_t covered = 0;
  for (const MapPiece& m : cut) covered += m.root.numel();
  EXPECT_EQ(covered, rows * cols);
  EXPECT_EQ(cut.size(), static_cast<size_t>(cols));
}

// compose_layout against brute force: a random view of a random shape, the shape cut
// into a grid of boxes each stored contiguously on its own; every element must land in
// exactly the box that holds it, at the right local offset.
TEST(TensorMaps, ComposeLayoutMatchesBruteForce) {
  std::mt19937_64 rng(7);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < 500; ++trial) {
    Shape radix;
    const int nd = static_cast<int>(uni(1, 3));
    for (int d = 0; d < nd; ++d) radix.push_back(uni(1, 7));
    // Grid cuts per dim.
    std::vector<std::vector<int64_t>> cuts(nd);
    for (int d = 0; d < nd; ++d) {
      cuts[d] = {0};
      for (int64_t x = 1; x < radix[d]; ++x) {
        if (uni(0, 2) == 0) cuts[d].push_back(x);
      }
      cuts[d].push_back(radix[d]);
    }
    std::vector<MapPiece> pieces;
    std::function<void(int, Shape, Shape)> grid = [&](int d, Shape start, Shape size) {
      if (d == nd) {
        pieces.push_back(MapPiece{start, Layout::contiguous(size)});
        return;
      }
      for (size_t k = 0; k + 1 < cuts[d].size(); ++k) {
        Shape s1 = start, z1 = size;
        s1.push_back(cuts[d][k]);
        z1.push_back(cuts[d][k + 1] - cuts[d][k]);
        grid(d + 1, s1, z1);
      }
    };
    grid(0, {}, {});
    // A random view: the radix space transposed, narrowed and flattened.
    Tensor s = Tensor::source("w", radix, DType::kF32);
    Tensor v = s.permute([&] {
      std::vector<int64_t> p(nd);
      std::iota(p.begin(), p.end(), 0);
      std::shuffle(p.begin(), p.end(), rng);
      return p;
    }());
    const int64_t d0 = uni(0, nd - 1);
    const int64_t st = uni(0, v.size(d0) - 1);
    v = v.narrow(d0, st, uni(1, v.size(d0) - st));
    auto out = compose_layout(v.layout(), radix, pieces);
    // Brute force: each element of v's index space -> (piece, local offset).
    std::vector<int> seen(static_cast<size_t>(v.numel()), 0);
    for (const MapPiece& m : out) {
      Shape idx(m.root.shape.size(), 0);
      for (int64_t e = 0; e < m.root.numel(); ++e) {
        int64_t rem = e;
        for (size_t k = idx.size(); k-- > 0;) {
          idx[k] = rem % m.root.shape[k];
          rem /= m.root.shape[k];
        }
        Shape full(idx.size());
        for (size_t k = 0; k < idx.size(); ++k) full[k] = m.start[k] + idx[k];
        int64_t flat = v.layout().offset_of(full);
        Shape q(radix.size());
        for (size_t j = radix.size(); j-- > 0;) {
          q[j] = flat % radix[j];
          flat /= radix[j];
        }
        const MapPiece& piece = pieces[m.part];
        Shape local(radix.size());
        for (size_t j = 0; j < radix.size(); ++j) {
          ASSERT_GE(q[j], piece.start[j]);
          ASSERT_LT(q[j], piece.start[j] + piece.root.shape[j]);
          local[j] = q[j] - piece.start[j];
        }
        ASSERT_EQ(m.root.offset_of(idx), piece.root.offset_of(local)) << "trial " << trial;
        int64_t row_major = 0;
        for (size_t k = 0; k < full.size(); ++k) row_major = row_major * v.shape()[k] + full[k];
        seen[static_cast<size_t>(row_major)]++;
      }
    }
    for (int c : seen) ASSERT_EQ(c, 1) << "trial " << trial;
  }
}

}  // namespace
}  // namespace ferry
