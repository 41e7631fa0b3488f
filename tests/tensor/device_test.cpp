// Devices and batched strided copies: the kernel's index arithmetic (batch_layout.h)
// run on the CPU against strided_copy over random layouts; device names; CUDA tensors
// refusing host ops; plans refusing mixed devices; and, where a CUDA device is
// present, the same batches and a plan run on the GPU against the host executor.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "ferry/device.h"
#include "ferry/plan.h"
#include "ferry/tensor.h"
#include "tensor/batch_layout.h"

namespace ferry {
namespace {

constexpr DType kDTypes[] = {DType::kU8, DType::kBF16, DType::kF32, DType::kI64};

// A random view of a contiguous parent of `parent_numel` elements: `shape`, with the
// parent's dims permuted and narrowed (so strides are arbitrary non-negative), or,
// when `flip` is set, one dim walked backwards (negative stride, as plan composition
// can produce).
struct RandomView {
  Layout layout;
  int64_t parent_numel = 0;
};

RandomView random_view(std::mt19937& rng, const Shape& shape, bool allow_negative) {
  const size_t nd = shape.size();
  Shape parent(nd);
  Shape start(nd);
  for (size_t k = 0; k < nd; ++k) {
    parent[k] = shape[k] + static_cast<int64_t>(rng() % 3);
    start[k] = static_cast<int64_t>(rng() % static_cast<uint32_t>(parent[k] - shape[k] + 1));
  }
  std::vector<size_t> perm(nd);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  // Parent dims in permuted order get contiguous strides.
  Shape pshape(nd), pstride(nd);
  for (size_t k = 0; k < nd; ++k) pshape[k] = parent[perm[k]];
  int64_t s = 1;
  for (size_t k = nd; k-- > 0;) {
    pstride[k] = s;
    s *= pshape[k];
  }
  RandomView v;
  v.parent_numel = s;
  v.layout.shape = shape;
  v.layout.strides.resize(nd);
  v.layout.offset = 0;
  for (size_t k = 0; k < nd; ++k) {
    const size_t at = static_cast<size_t>(std::find(perm.begin(), perm.end(), k) - perm.begin());
    v.layout.strides[k] = pstride[at];
    v.layout.offset += start[k] * pstride[at];
  }
  if (allow_negative && nd > 0 && rng() % 4 == 0) {
    const size_t k = rng() % nd;
    if (shape[k] > 1) {
      v.layout.offset += (shape[k] - 1) * v.layout.strides[k];
      v.layout.strides[k] = -v.layout.strides[k];
    }
  }
  return v;
}

std::vector<std::byte> pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return b;
}

TEST(BatchLayout, KernelArithmeticMatchesStridedCopyOnRandomLayouts) {
  std::mt19937 rng(20261201);
  int widths_seen[17] = {};
  for (int iter = 0; iter < 3000; ++iter) {
    const DType dtype = kDTypes[rng() % 4];
    const int64_t es = static_cast<int64_t>(dtype_size(dtype));
    const size_t nd = 1 + rng() % 4;
    Shape shape(nd);
    for (auto& n : shape) n = 1 + static_cast<int64_t>(rng() % (nd == 1 ? 300 : 9));
    const bool zero = rng() % 8 == 0;
    const RandomView sv = random_view(rng, shape, true);
    const RandomView dv = random_view(rng, shape, false);
    // Misalign the buffers now and then (width must drop to what the addresses allow).
    const size_t src_skew = rng() % 3 == 0 ? rng() % 16 : 0;
    const size_t dst_skew = rng() % 3 == 0 ? rng() % 16 : 0;
    std::vector<std::byte> src = pattern(static_cast<size_t>(sv.parent_numel * es) + 32, static_cast<uint8_t>(iter));
    std::vector<std::byte> want = pattern(static_cast<size_t>(dv.parent_numel * es) + 32, 7);
    std::vector<std::byte> got = want;
    // 16-byte aligned storage, then the skew.
    auto aligned = [](std::vector<std::byte>& b, size_t skew) {
      const auto a = reinterpret_cast<uintptr_t>(b.data());
      return b.data() + ((16 - (a & 15)) & 15) + skew;
    };
    std::vector<std::byte> src_store(src.size() + 32), want_store(want.size() + 32), got_store(want.size() + 32);
    std::byte* sp = aligned(src_store, src_skew);
    std::byte* wp = aligned(want_store, dst_skew);
    std::byte* gp = aligned(got_store, dst_skew);
    std::memcpy(sp, src.data(), src.size());
    std::memcpy(wp, want.data(), want.size());
    std::memcpy(gp, want.data(), want.size());

    if (zero) {
      strided_zero(wp, dv.layout, dtype);
    } else {
      strided_copy(sp, sv.layout, dtype, wp, dv.layout, dtype);
    }
    const StridedCopy c{zero ? nullptr : sp, sv.layout, gp, dv.layout, dtype};
    const uint32_t per_task = rng() % 2 ? batch::kWordsPerTask : 1 + rng() % 700;
    auto plan = batch::plan_batch(std::span<const StridedCopy>(&c, 1), per_task);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    for (const auto& d : plan->descs) {
      ++widths_seen[d.width];
      ASSERT_EQ(d.dst % d.width, 0u);
      ASSERT_EQ(d.src % d.width, 0u);
    }
    batch::emulate_batch(*plan);
    ASSERT_EQ(0, std::memcmp(wp, gp, want.size()))
        << "iteration " << iter << ": " << (zero ? "zero " : "copy ") << sv.layout.to_string() << " -> "
        << dv.layout.to_string() << " dtype " << dtype_name(dtype) << " words/task " << per_task;
  }
  // The random layouts exercised every word width.
  for (int w : {1, 2, 4, 8, 16}) EXPECT_GT(widths_seen[w], 0) << "width " << w;
}

constexpr DType kFloatDTypes[] = {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kF8E5M2};

uint8_t elem_of(DType d) {
  switch (d) {
    case DType::kBF16: return batch::kElemBF16;
    case DType::kF16: return batch::kElemF16;
    case DType::kF32: return batch::kElemF32;
    case DType::kF8E4M3: return batch::kElemE4M3;
    default: return batch::kElemE5M2;
  }
}

// The kernel's element conversion (element_convert.h, in float) gives the host's bits
// (strided_copy, in double) for every code of every small float dtype into every other
// float dtype, and for f32 at its edges (zeros, subnormals, around each format's largest
// finite value and its rounding ties, infinities, NaNs of both signs) and 2^20 random
// bit patterns.
TEST(ElementConvert, EveryCodeConvertsAsTheHostDoes) {
  std::mt19937 rng(7);
  for (DType from : kFloatDTypes) {
    const size_t fs = dtype_size(from);
    std::vector<uint32_t> codes;
    if (from == DType::kF32) {
      for (uint32_t sign : {0u, 0x80000000u}) {
        for (uint32_t u : {0u, 1u, 2u, 0x7fffffu, 0x800000u, 0x7f7fffffu, 0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu})
          codes.push_back(sign | u);
        // Near 448 / 57344 / 65504 and their halfway points, and across the subnormal edges.
        for (float f : {448.0f, 464.0f, 480.0f, 57344.0f, 61440.0f, 65504.0f, 65520.0f, 0x1p-6f, 0x1p-9f, 0x1p-10f,
                        0x1p-14f, 0x1p-16f, 0x1p-17f, 0x1p-24f, 0x1p-25f, 0x1p-126f, 0x1p-133f, 0x1p-134f}) {
          uint32_t u;
          std::memcpy(&u, &f, 4);
          for (int d = -3; d <= 3; ++d) codes.push_back(sign | static_cast<uint32_t>(static_cast<int64_t>(u) + d));
        }
      }
      for (int i = 0; i < (1 << 20); ++i) codes.push_back(static_cast<uint32_t>(rng()));
    } else {
      for (uint32_t c = 0; c < (1u << (8 * fs)); ++c) codes.push_back(c);
    }
    std::vector<std::byte> src(codes.size() * fs);
    for (size_t i = 0; i < codes.size(); ++i) std::memcpy(src.data() + i * fs, &codes[i], fs);  // little-endian
    for (DType to : kFloatDTypes) {
      if (to == from) continue;
      const size_t ts = dtype_size(to);
      const int64_t n = static_cast<int64_t>(codes.size());
      std::vector<std::byte> want(codes.size() * ts), got(codes.size() * ts);
      strided_copy(src.data(), Layout::contiguous({n}), from, want.data(), Layout::contiguous({n}), to);
      for (size_t i = 0; i < codes.size(); ++i) {
        const auto* sp = reinterpret_cast<const unsigned char*>(src.data() + i * fs);
        auto* gp = reinterpret_cast<unsigned char*>(got.data() + i * ts);
        batch::store_float(gp, elem_of(to), batch::load_float(sp, elem_of(from)));
      }
      for (size_t i = 0; i < codes.size(); ++i) {
        if (std::memcmp(want.data() + i * ts, got.data() + i * ts, ts) != 0) {
          uint32_t w = 0, g = 0;
          std::memcpy(&w, want.data() + i * ts, ts);
          std::memcpy(&g, got.data() + i * ts, ts);
          FAIL() << dtype_name(from) << " code " << std::hex << codes[i] << " -> " << dtype_name(to) << ": host " << w
                 << ", kernel " << g;
        }
      }
    }
  }
}

// Copies that convert between float dtypes, planned for the kernel and run by
// emulate_batch, give strided_copy's bytes: random dtype pairs, layouts (permuted,
// narrowed, negative strides), misaligned buffers, random bytes as values (NaNs,
// infinities and subnormals among them), tasks cut at random sizes.
TEST(BatchLayout, ConvertingCopiesMatchStridedCopyOnRandomLayouts) {
  std::mt19937 rng(20261202);
  for (int iter = 0; iter < 1500; ++iter) {
    const DType from = kFloatDTypes[rng() % 5];
    DType to = kFloatDTypes[rng() % 5];
    if (to == from) to = kFloatDTypes[(static_cast<int>(rng() % 4) + 1 + static_cast<int>(std::find(std::begin(kFloatDTypes), std::end(kFloatDTypes), from) - std::begin(kFloatDTypes))) % 5];
    const int64_t fs = static_cast<int64_t>(dtype_size(from)), ts = static_cast<int64_t>(dtype_size(to));
    const size_t nd = 1 + rng() % 4;
    Shape shape(nd);
    for (auto& n : shape) n = 1 + static_cast<int64_t>(rng() % (nd == 1 ? 300 : 9));
    const RandomView sv = random_view(rng, shape, true);
    const RandomView dv = random_view(rng, shape, false);
    std::vector<std::byte> src(static_cast<size_t>(sv.parent_numel * fs) + 16);
    for (auto& b : src) b = static_cast<std::byte>(rng());
    const size_t src_skew = rng() % 3 == 0 ? rng() % 8 : 0;
    const size_t dst_skew = rng() % 3 == 0 ? rng() % 8 : 0;
    std::vector<std::byte> src_store(src.size() + 16), want(static_cast<size_t>(dv.parent_numel * ts) + 16 + dst_skew);
    std::memcpy(src_store.data() + src_skew, src.data(), src.size());
    for (auto& b : want) b = std::byte{0x5a};
    std::vector<std::byte> got = want;
    strided_copy(src_store.data() + src_skew, sv.layout, from, want.data() + dst_skew, dv.layout, to);
    const StridedCopy c{src_store.data() + src_skew, sv.layout, got.data() + dst_skew, dv.layout, to, from};
    const uint32_t per_task = rng() % 2 ? batch::kWordsPerTask : 1 + rng() % 700;
    auto plan = batch::plan_batch(std::span<const StridedCopy>(&c, 1), per_task);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    batch::emulate_batch(*plan);
    ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size()))
        << "iteration " << iter << ": " << sv.layout.to_string() << " " << dtype_name(from) << " -> "
        << dv.layout.to_string() << " " << dtype_name(to) << " words/task " << per_task;
  }
  // A conversion outside the float dtypes is refused naming both.
  alignas(16) static std::byte a[64], b[64];
  const StridedCopy bad{a, Layout::contiguous({4}), b, Layout::contiguous({4}), DType::kF32, DType::kI32};
  auto p = batch::plan_batch(std::span<const StridedCopy>(&bad, 1));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("I32 to F32"), std::string::npos) << p.status().to_string();
}

TEST(BatchLayout, WidthFollowsAlignmentAndRuns) {
  alignas(16) static std::byte a[1 << 16], b[1 << 16];
  // A row shard: contiguous on both sides, aligned: 16-byte words, one run.
  StridedCopy row{a, Layout::contiguous({64, 256}), b, Layout::contiguous({64, 256}), DType::kBF16};
  auto p = batch::plan_batch(std::span<const StridedCopy>(&row, 1));
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->descs.size(), 1u);
  EXPECT_EQ(p->descs[0].width, 16u);
  EXPECT_EQ(p->descs[0].ndim, 1u);
  EXPECT_EQ(p->descs[0].words, 64u * 256 * 2 / 16);
  EXPECT_EQ(p->bytes, 64u * 256 * 2);
  // A column shard of a [64, 1000] bf16 tensor: 250 columns from column 3 (6 bytes in):
  // rows of 500 bytes at a 2000-byte stride, so 2-byte words (6 and 500 allow no more).
  StridedCopy col{a, Layout{{64, 250}, {1000, 1}, 3}, b, Layout::contiguous({64, 250}), DType::kBF16};
  p = batch::plan_batch(std::span<const StridedCopy>(&col, 1));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->descs[0].width, 2u);
  EXPECT_EQ(p->descs[0].ndim, 2u);
  // Column 4 (8 bytes in) with 256 columns: 8-byte words.
  col.src_layout = Layout{{64, 256}, {1000, 1}, 4};
  col.dst_layout = Layout::contiguous({64, 256});
  p = batch::plan_batch(std::span<const StridedCopy>(&col, 1));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->descs[0].width, 8u);
  // A transpose: the inner dim is strided, so each word is (part of) one element.
  StridedCopy tr{a, Layout{{32, 16}, {1, 32}, 0}, b, Layout::contiguous({32, 16}), DType::kF32};
  p = batch::plan_batch(std::span<const StridedCopy>(&tr, 1));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->descs[0].width, 4u);
  EXPECT_EQ(p->descs[0].ndim, 3u);
  // Empty copies make no descriptor; tasks cover every word exactly once.
  StridedCopy empty{a, Layout::contiguous({0, 5}), b, Layout::contiguous({0, 5}), DType::kF32};
  StridedCopy both[] = {empty, row};
  p = batch::plan_batch(both, 100);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->descs.size(), 1u);
  uint64_t covered = 0;
  for (const auto& t : p->tasks) covered += t.count;
  EXPECT_EQ(covered, p->descs[0].words);
  EXPECT_EQ(p->tasks.size(), (p->descs[0].words + 99) / 100);
}

TEST(BatchLayout, RefusesBadCopies) {
  alignas(16) static std::byte a[4096], b[4096];
  StridedCopy c{a, Layout::contiguous({4, 4}), b, Layout::contiguous({16}), DType::kF32};
  auto p = batch::plan_batch(std::span<const StridedCopy>(&c, 1));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("shapes differ"), std::string::npos) << p.status().to_string();
  // Eleven dims that cannot coalesce (every stride 3x the next's extent... and so on).
  Shape shape(11, 2), strides(11);
  int64_t s = 1;
  for (size_t k = 11; k-- > 0;) {
    strides[k] = s * 2;  // gaps between every dim's elements
    s *= 4;
  }
  c = StridedCopy{a, Layout{shape, strides, 0}, b, Layout::contiguous(shape), DType::kU8};
  p = batch::plan_batch(std::span<const StridedCopy>(&c, 1));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("at most"), std::string::npos) << p.status().to_string();
  c = StridedCopy{a, Layout::contiguous({4}), nullptr, Layout::contiguous({4}), DType::kU8};
  p = batch::plan_batch(std::span<const StridedCopy>(&c, 1));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("no destination"), std::string::npos);
  p = batch::plan_batch({}, 0);
  EXPECT_FALSE(p.ok());
}

TEST(Device, NamesParseAndPrint) {
  EXPECT_EQ(device_str(Device::host()), "cpu");
  EXPECT_EQ(device_str(Device::cuda(3)), "cuda:3");
  EXPECT_EQ(*parse_device("cpu"), Device::host());
  EXPECT_EQ(*parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(*parse_device("cuda:7"), Device::cuda(7));
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1234567", "CPU", ""}) {
    auto d = parse_device(bad);
    EXPECT_FALSE(d.ok()) << bad;
    if (!d.ok()) {
      EXPECT_NE(d.status().message().find("cuda:N"), std::string::npos);
    }
  }
}

TEST(Device, HostBatchRunsEveryCopy) {
  std::vector<float> src(64), dst(64, -1.0f);
  std::iota(src.begin(), src.end(), 0.0f);
  auto* s = reinterpret_cast<std::byte*>(src.data());
  auto* d = reinterpret_cast<std::byte*>(dst.data());
  const StridedCopy copies[] = {
      {s, Layout{{4, 4}, {1, 4}, 0}, d, Layout::contiguous({4, 4}), DType::kF32},   // transpose of the first 16
      {nullptr, {}, d, Layout::contiguous({8}, 16), DType::kF32},                  // zeros at 16..23
      {s, Layout{{8}, {2}, 33}, d, Layout::contiguous({8}, 40), DType::kF32},      // every other from 33
  };
  ASSERT_TRUE(copy_batch(Device::host(), copies).ok());
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) EXPECT_EQ(dst[i * 4 + j], src[j * 4 + i]);
  }
  for (int i = 16; i < 24; ++i) EXPECT_EQ(dst[i], 0.0f);
  for (int i = 24; i < 40; ++i) EXPECT_EQ(dst[i], -1.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(dst[40 + i], src[33 + 2 * i]);
  const StridedCopy bad{s, Layout::contiguous({3}), d, Layout::contiguous({4}), DType::kF32};
  EXPECT_FALSE(copy_batch(Device::host(), std::span<const StridedCopy>(&bad, 1)).ok());
}

TEST(Device, CudaTensorsRefuseHostOps) {
  // Never dereferenced: every op below must refuse before touching the bytes.
  void* fake = reinterpret_cast<void*>(uintptr_t{0x10000});
  Tensor t = Tensor::borrow_device(fake, {4, 8}, DType::kBF16, Device::cuda(0), nullptr, "w");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t.device(), Device::cuda(0));
  EXPECT_NE(t.describe().find("on cuda:0"), std::string::npos) << t.describe();
  auto p = t.data_ptr();
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("device memory"), std::string::npos) << p.status().to_string();
  EXPECT_EQ(*t.narrow(0, 1, 2).device_ptr(), static_cast<std::byte*>(fake) + 8 * 2);
  EXPECT_FALSE(t.to_vector().ok());
  EXPECT_FALSE(t.item().ok());
  EXPECT_FALSE(t.clone().ok());
  Tensor host = Tensor::empty({4, 8}, DType::kBF16);
  Status st = host.copy_(t);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("cpu"), std::string::npos) << st.to_string();
  // Float dtypes convert on the device (without a usable one: refused naming it); others
  // do not.
  Tensor f32 = Tensor::borrow_device(fake, {4, 8}, DType::kF32, Device::cuda(0));
  if (!cuda_status().usable()) {  // (the fake pointer must not reach a device)
    st = f32.copy_(t);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st.to_string();
  }
  Tensor i32 = Tensor::borrow_device(fake, {4, 8}, DType::kI32, Device::cuda(0));
  st = i32.copy_(t);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cannot convert"), std::string::npos) << st.to_string();
  Tensor other = Tensor::borrow_device(fake, {4, 8}, DType::kBF16, Device::cuda(1));
  EXPECT_FALSE(other.copy_(t).ok());
  EXPECT_FALSE(Tensor::borrow_device(fake, {4}, DType::kBF16, Device::cuda(-1)).ok());
  // Host tensors say nothing of devices.
  EXPECT_EQ(host.device(), Device::host());
  EXPECT_EQ(host.describe().find(" on "), std::string::npos);
}

TEST(Device, CudaStatusExplainsItself) {
  const CudaStatus& cs = cuda_status();
  std::cout << "cuda_status: plugin " << (cs.plugin_loaded ? cs.plugin_path : "none") << ", " << cs.device_count
            << " device(s): " << cs.detail << "\n";
#ifdef FERRY_TEST_HAVE_CUDA
  // Built with the plugin: it must load, driver or not.
  EXPECT_TRUE(cs.plugin_loaded) << cs.detail;
#endif
  if (cs.usable()) return;
  EXPECT_FALSE(cs.detail.empty());
  alignas(16) static std::byte a[64], b[64];
  const StridedCopy c{a, Layout::contiguous({16}), b, Layout::contiguous({16}), DType::kF32};
  Status st = copy_batch(Device::cuda(0), std::span<const StridedCopy>(&c, 1));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find(cs.detail), std::string::npos) << st.to_string();
  EXPECT_FALSE(device_alloc(Device::cuda(0), 64).ok());
  // Without a device every pointer is a host pointer.
  EXPECT_TRUE(device_memcpy(b, a, sizeof(a)).ok());
}

// A plan whose tensors sit on two devices is refused, naming the odd one.
TEST(Device, PlanOnMixedDevicesIsRefused) {
  Recorder rec;
  Tensor src = Tensor::source("w", {8, 4}, DType::kF32);
  Tensor dst = Tensor::param("p", {8, 4}, DType::kF32);
  ASSERT_TRUE(dst.copy_(src).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  Tensor host_src = Tensor::empty({8, 4}, DType::kF32, "w");
  Tensor dev_dst = Tensor::borrow_device(reinterpret_cast<void*>(uintptr_t{0x10000}), {8, 4}, DType::kF32,
                                         Device::cuda(0), nullptr, "p");
  Status st = execute(*plan, {{"w", host_src}}, {{"p", dev_dst}});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("one device"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st.to_string();
}

// --- on a GPU ---------------------------------------------------------------------

#define SKIP_WITHOUT_CUDA_DEVICE()                                             \
  do {                                                                         \
    if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail; \
  } while (0)

TEST(CudaDevice, RandomBatchesMatchTheHost) {
  SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(7);
  constexpr size_t kBytes = 1 << 20;
  auto dsrc = device_alloc(Device::cuda(0), kBytes);
  auto ddst = device_alloc(Device::cuda(0), kBytes);
  ASSERT_TRUE(dsrc.ok() && ddst.ok());
  std::vector<std::byte> src = pattern(kBytes, 3), init = pattern(kBytes, 9);
  for (int iter = 0; iter < 200; ++iter) {
    const DType dtype = kDTypes[rng() % 4];
    const int64_t es = static_cast<int64_t>(dtype_size(dtype));
    std::vector<StridedCopy> host_copies, dev_copies;
    int64_t dst_used = 0;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      const size_t nd = 1 + rng() % 3;
      Shape shape(nd);
      for (auto& x : shape) x = 1 + static_cast<int64_t>(rng() % 12);
      const RandomView sv = random_view(rng, shape, true);
      const RandomView dv = random_view(rng, shape, false);
      if ((dst_used + dv.parent_numel) * es > static_cast<int64_t>(kBytes) || sv.parent_numel * es > static_cast<int64_t>(kBytes)) break;
      Layout dl = dv.layout;
      dl.offset += dst_used;  // each copy its own destination range: no overlap
      dst_used += dv.parent_numel;
      const bool zero = rng() % 6 == 0;
      host_copies.push_back({zero ? nullptr : src.data(), sv.layout, nullptr, dl, dtype});
      dev_copies.push_back({zero ? nullptr : dsrc->get(), sv.layout, ddst->get(), dl, dtype});
    }
    std::vector<std::byte> want = init, got(kBytes);
    for (auto& c : host_copies) c.dst = want.data();
    ASSERT_TRUE(copy_batch(Device::host(), host_copies).ok());
    ASSERT_TRUE(device_memcpy(dsrc->get(), src.data(), kBytes).ok());
    ASSERT_TRUE(device_memcpy(ddst->get(), init.data(), kBytes).ok());
    Status st = copy_batch(Device::cuda(0), dev_copies);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(device_memcpy(got.data(), ddst->get(), kBytes).ok());
    ASSERT_EQ(0, std::memcmp(want.data(), got.data(), kBytes)) << "iteration " << iter;
  }
}

// A plan that converts (f32 and bf16 sources into bf16, f16 and float8 e4m3 params)
// runs on the device in one batch and gives the host executor's bits.
TEST(CudaDevice, ConvertingPlanRunsOnTheDeviceAsOnTheHost) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Recorder rec;
  Tensor a = Tensor::source("a", {64, 48}, DType::kF32);
  Tensor b = Tensor::source("b", {64, 48}, DType::kBF16);
  Tensor p = Tensor::param("p", {64, 24}, DType::kBF16);
  Tensor q = Tensor::param("q", {48, 64}, DType::kF16);
  Tensor r = Tensor::param("r", {64, 48}, DType::kF8E4M3);
  ASSERT_TRUE(p.copy_(a.narrow(1, 24, 24)).ok());
  ASSERT_TRUE(q.copy_(b.t()).ok());
  ASSERT_TRUE(r.copy_(a).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  std::mt19937 rng(5);
  std::vector<std::byte> ha(64 * 48 * 4), hb(64 * 48 * 2);
  for (size_t i = 0; i < ha.size() / 4; ++i) {
    const float v = std::ldexp(static_cast<float>(static_cast<int>(rng() % 2001) - 1000), static_cast<int>(rng() % 30) - 20);
    std::memcpy(ha.data() + i * 4, &v, 4);
  }
  for (auto& x : hb) x = static_cast<std::byte>(rng());
  const Device gpu = Device::cuda(0);
  const std::pair<const char*, std::pair<Shape, DType>> params[] = {
      {"p", {{64, 24}, DType::kBF16}}, {"q", {{48, 64}, DType::kF16}}, {"r", {{64, 48}, DType::kF8E4M3}}};
  TensorMap host_params, dev_params;
  std::vector<std::shared_ptr<std::byte>> keep;
  for (const auto& [name, sd] : params) {
    host_params.emplace(name, Tensor::empty(sd.first, sd.second, name));
    const size_t bytes = shape_numel(sd.first) * dtype_size(sd.second);
    auto d = device_alloc(gpu, bytes);
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    keep.push_back(*d);
    dev_params.emplace(name, Tensor::borrow_device(d->get(), sd.first, sd.second, gpu, nullptr, name));
  }
  ASSERT_TRUE(execute(*plan, {{"a", Tensor::borrow(ha.data(), {64, 48}, DType::kF32, nullptr, "a")},
                              {"b", Tensor::borrow(hb.data(), {64, 48}, DType::kBF16, nullptr, "b")}},
                      host_params)
                  .ok());
  auto da = device_alloc(gpu, ha.size()), db = device_alloc(gpu, hb.size());
  ASSERT_TRUE(da.ok() && db.ok());
  ASSERT_TRUE(device_memcpy(da->get(), ha.data(), ha.size()).ok());
  ASSERT_TRUE(device_memcpy(db->get(), hb.data(), hb.size()).ok());
  Status st = execute(*plan, {{"a", Tensor::borrow_device(da->get(), {64, 48}, DType::kF32, gpu, nullptr, "a")},
                              {"b", Tensor::borrow_device(db->get(), {64, 48}, DType::kBF16, gpu, nullptr, "b")}},
                      dev_params);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (const auto& [name, sd] : params) {
    const size_t bytes = shape_numel(sd.first) * dtype_size(sd.second);
    std::vector<std::byte> got(bytes);
    ASSERT_TRUE(device_memcpy(got.data(), *dev_params.at(name).device_ptr(), bytes).ok());
    EXPECT_EQ(0, std::memcmp(got.data(), *host_params.at(name).data_ptr(), bytes)) << name;
  }
}

TEST(CudaDevice, PlanRunsOnTheDeviceAsOnTheHost) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // A fused, column-sharded, zero-padded plan: [2 x 6, 4] sources into one [14, 2] param.
  Recorder rec;
  Tensor a = Tensor::source("a", {6, 4}, DType::kBF16);
  Tensor b = Tensor::source("b", {6, 4}, DType::kBF16);
  Tensor p = Tensor::param("p", {14, 2}, DType::kBF16);
  ASSERT_TRUE(p.narrow(0, 0, 6).copy_(a.narrow(1, 2, 2)).ok());
  ASSERT_TRUE(p.narrow(0, 6, 6).copy_(b.narrow(1, 2, 2)).ok());
  ASSERT_TRUE(p.narrow(0, 12, 2).zero_().ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  std::vector<std::byte> ha = pattern(48, 1), hb = pattern(48, 2);
  Tensor ta = Tensor::borrow(ha.data(), {6, 4}, DType::kBF16, nullptr, "a");
  Tensor tb = Tensor::borrow(hb.data(), {6, 4}, DType::kBF16, nullptr, "b");
  Tensor tp = Tensor::empty({14, 2}, DType::kBF16, "p");
  ASSERT_TRUE(execute(*plan, {{"a", ta}, {"b", tb}}, {{"p", tp}}).ok());
  auto da = device_alloc(Device::cuda(0), 48), db = device_alloc(Device::cuda(0), 48), dp = device_alloc(Device::cuda(0), 56);
  ASSERT_TRUE(da.ok() && db.ok() && dp.ok());
  ASSERT_TRUE(device_memcpy(da->get(), ha.data(), 48).ok());
  ASSERT_TRUE(device_memcpy(db->get(), hb.data(), 48).ok());
  std::vector<std::byte> ones(56, std::byte{0xff});
  ASSERT_TRUE(device_memcpy(dp->get(), ones.data(), 56).ok());
  const Device gpu = Device::cuda(0);
  Status st = execute(*plan, {{"a", Tensor::borrow_device(da->get(), {6, 4}, DType::kBF16, gpu, nullptr, "a")},
                              {"b", Tensor::borrow_device(db->get(), {6, 4}, DType::kBF16, gpu, nullptr, "b")}},
                      {{"p", Tensor::borrow_device(dp->get(), {14, 2}, DType::kBF16, gpu, nullptr, "p")}});
  ASSERT_TRUE(st.ok()) << st.to_string();
  std::vector<std::byte> got(56);
  ASSERT_TRUE(device_memcpy(got.data(), dp->get(), 56).ok());
  EXPECT_EQ(0, std::memcmp(got.data(), *tp.data_ptr(), 56));
  // copy_ and zero_ on device tensors.
  Tensor dev_p = Tensor::borrow_device(dp->get(), {14, 2}, DType::kBF16, gpu);
  Tensor dev_a = Tensor::borrow_device(da->get(), {6, 4}, DType::kBF16, gpu);
  ASSERT_TRUE(dev_p.narrow(0, 0, 6).copy_(dev_a.narrow(1, 0, 2)).ok());
  ASSERT_TRUE(dev_p.narrow(0, 6, 8).zero_().ok());
  ASSERT_TRUE(device_memcpy(got.data(), dp->get(), 56).ok());
  for (int r = 0; r < 6; ++r) EXPECT_EQ(0, std::memcmp(got.data() + r * 4, ha.data() + r * 8, 4)) << "row " << r;
  for (int i = 24; i < 56; ++i) EXPECT_EQ(got[i], std::byte{0});
}

}  // namespace
}  // namespace ferry
