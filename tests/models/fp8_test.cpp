// The FP8 post-processing hook (Quantize::kFp8): bf16 shards -> e4m3 + 128x128 block
// scales, checked against an independent scalar reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "ferry/device.h"
#include "models/builder.h"
#include "tensor/fp8_blocks.h"
#include "models/test_util.h"

namespace ferry {
namespace {

using testing::config_from;
using testing::dense_config;
using testing::loader_for;

// Independent e4m3fn encoder: nearest of the 127 finite non-negative codes, ties to the
// even code, saturating at 448.
uint8_t ref_e4m3(float x) {
  const bool neg = std::signbit(x);
  const double a = std::min<double>(std::fabs(static_cast<double>(x)), 448.0);
  int best = 0;
  double best_err = INFINITY;
  for (int code = 0; code <= 0x7e; ++code) {
    const int e = (code >> 3) & 0xf, m = code & 7;
    const double v = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    const double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && code % 2 == 0)) {
      best = code;
      best_err = err;
    }
  }
  return static_cast<uint8_t>((neg ? 0x80 : 0) | best);
}

// Reference quantisation of a [rows, cols] float matrix given as values.
void ref_quantize(const std::vector<double>& w, int64_t rows, int64_t cols, std::vector<uint8_t>& q,
                  std::vector<float>& scales) {
  const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
  q.assign(static_cast<size_t>(rows * cols), 0);
  scales.assign(static_cast<size_t>(br * bc), 0.0f);
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      float amax = 0;
      for (int64_t r = i * 128; r < std::min(rows, i * 128 + 128); ++r) {
        for (int64_t c = j * 128; c < std::min(cols, j * 128 + 128); ++c) {
          amax = std::max(amax, std::fabs(static_cast<float>(w[static_cast<size_t>(r * cols + c)])));
        }
      }
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      scales[static_cast<size_t>(i * bc + j)] = s;
      for (int64_t r = i * 128; r < std::min(rows, i * 128 + 128); ++r) {
        for (int64_t c = j * 128; c < std::min(cols, j * 128 + 128); ++c) {
          q[static_cast<size_t>(r * cols + c)] = ref_e4m3(static_cast<float>(w[static_cast<size_t>(r * cols + c)]) / s);
        }
      }
    }
  }
}

void expect_matches_reference(const Tensor& q, const Tensor& s, const std::vector<double>& w, int64_t rows,
                              int64_t cols, const std::string& what) {
  std::vector<uint8_t> rq;
  std::vector<float> rs;
  ref_quantize(w, rows, cols, rq, rs);
  ASSERT_EQ(q.dtype(), DType::kF8E4M3) << what;
  ASSERT_EQ(q.shape(), (Shape{rows, cols})) << what;
  ASSERT_EQ(s.dtype(), DType::kF32) << what;
  ASSERT_EQ(s.shape(), (Shape{(rows + 127) / 128, (cols + 127) / 128})) << what;
  const Tensor qc = q.contiguous(), sc = s.contiguous();
  const auto* qp = reinterpret_cast<const uint8_t*>(*qc.data_ptr());
  const auto* sp = reinterpret_cast<const float*>(*sc.data_ptr());
  for (size_t i = 0; i < rs.size(); ++i) ASSERT_EQ(sp[i], rs[i]) << what << " scale " << i;
  for (size_t i = 0; i < rq.size(); ++i) {
    ASSERT_EQ(qp[i], rq[i]) << what << " element " << i << " value " << w[i] << " scale " << rs[0];
  }
}

TEST(Fp8, ReferenceEncoderSanity) {
  EXPECT_EQ(ref_e4m3(0.0f), 0x00);
  EXPECT_EQ(ref_e4m3(1.0f), 0x38);
  EXPECT_EQ(ref_e4m3(448.0f), 0x7e);
  EXPECT_EQ(ref_e4m3(1000.0f), 0x7e);
  EXPECT_EQ(ref_e4m3(-2.0f), 0xc0);
  EXPECT_EQ(ref_e4m3(1.0625f), 0x38);  // halfway between 1 and 1.125: ties to even
  EXPECT_EQ(ref_e4m3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
}

TEST(Fp8, QuantizeBlocksMatchesReference) {
  // 200 x 160: blocks of 128x128, 72x128, 128x32 and 72x32 (partial blocks).
  const int64_t rows = 200, cols = 160;
  auto ckpt = random_checkpoint({{"w", DType::kBF16, {rows, cols}}}, 21);
  ASSERT_TRUE(ckpt.ok());
  Tensor w = ckpt->at("w");
  // One all-zero block (scale 1) and a large value.
  ASSERT_TRUE(w.narrow(0, 128, 72).narrow(1, 128, 32).zero_().ok());
  auto q = models::quantize_fp8_blocks(w);
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  expect_matches_reference(q->first, q->second, testing::values(w), rows, cols, "w");
  EXPECT_EQ(*q->second.select(0, 1).select(0, 1).item(), 1.0);
  // Dequantised values are within e4m3's relative precision of the input.
  const auto wv = testing::values(w);
  const auto qv = testing::values(q->first);
  const auto sv = testing::values(q->second);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double x = wv[static_cast<size_t>(r * cols + c)];
      const double back = qv[static_cast<size_t>(r * cols + c)] * sv[static_cast<size_t>((r / 128) * 2 + c / 128)];
      ASSERT_LE(std::fabs(back - x), std::fabs(x) / 16 + sv[static_cast<size_t>((r / 128) * 2 + c / 128)] / 256)
          << r << "," << c;
    }
  }
  // Leading batch dims: each [rows, cols] matrix quantised on its own.
  auto batch = random_checkpoint({{"e", DType::kBF16, {3, 40, 130}}}, 22);
  auto qb = models::quantize_fp8_blocks(batch->at("e"));
  ASSERT_TRUE(qb.ok());
  EXPECT_EQ(qb->second.shape(), (Shape{3, 1, 2}));
  for (int64_t e = 0; e < 3; ++e) {
    expect_matches_reference(qb->first.select(0, e), qb->second.select(0, e), testing::values(batch->at("e").select(0, e)),
                             40, 130, "expert " + std::to_string(e));
  }
  // Recording tensors have no values.
  EXPECT_FALSE(models::quantize_fp8_blocks(Tensor::source("s", {4, 4}, DType::kBF16)).ok());
}

// The hook on a loaded model: o_proj [128, 128] is row-parallel; at tp=2 each rank holds
// 64 columns, so the checkpoint's single 128x128 block is shared by two ranks' shards.
// Each rank quantises its own shard: its scale is amax over its 64 columns only.
TEST(Fp8, HookQuantizesEachRanksShard) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 128, 8, 2, 192, 1000, false));
  LoaderOptions opts;
  opts.quantize = Quantize::kFp8;
  auto loader = loader_for(cfg, "tp=2", opts);
  ASSERT_NE(loader, nullptr);
  auto ckpt = random_checkpoint(loader->checkpoint(), 23);
  ASSERT_TRUE(ckpt.ok());
  const std::string o = "model.layers.0.self_attn.o_proj.weight";
  const std::string down = "model.layers.0.mlp.down_proj.weight";
  // Make the two halves of the shared block differ in magnitude.
  auto quarter = ckpt->at(o).narrow(1, 64, 64).mul(0.25);
  ASSERT_TRUE(quarter.ok());
  ASSERT_TRUE(ckpt->at(o).narrow(1, 64, 64).copy_(*quarter).ok());
  std::vector<float> rank_scales;
  for (int r = 0; r < 2; ++r) {
    auto p = load_rank_direct(*loader, r, *ckpt);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    // o_proj: columns [64r, 64r + 64) of the checkpoint tensor, one (partial) block.
    const Tensor shard = ckpt->at(o).narrow(1, r * 64, 64).contiguous();
    expect_matches_reference(p->at(o), p->at(o + "_scale_inv"), testing::values(shard), 128, 64, "o_proj rank " + std::to_string(r));
    rank_scales.push_back(static_cast<float>(*p->at(o + "_scale_inv").item()));
    // down_proj [128, 192] -> [128, 96] per rank.
    const Tensor dshard = ckpt->at(down).narrow(1, r * 96, 96).contiguous();
    expect_matches_reference(p->at(down), p->at(down + "_scale_inv"), testing::values(dshard), 128, 96, "down rank " + std::to_string(r));
    // Norms, embeddings and lm_head are not quantised.
    EXPECT_EQ(p->at("model.norm.weight").dtype(), DType::kBF16);
    EXPECT_EQ(p->at("lm_head.weight").dtype(), DType::kBF16);
    EXPECT_EQ(p->count("lm_head.weight_scale_inv"), 0u);
    EXPECT_EQ(p->at("model.layers.0.self_attn.qkv_proj.weight").dtype(), DType::kF8E4M3);
    EXPECT_EQ(p->at("model.layers.0.mlp.gate_up_proj.weight").dtype(), DType::kF8E4M3);
  }
  // The shared block got two different scales (one per rank's half).
  EXPECT_NE(rank_scales[0], rank_scales[1]);
  testing::expect_replay_equals_direct(*loader, 23);
  // Final params declare the fp8 weights and their scales.
  auto rl = loader->rank(0);
  ASSERT_TRUE(rl.ok());
  bool found = false;
  for (const auto& d : (*rl)->final_params()) {
    if (d.name == o + "_scale_inv") {
      found = true;
      EXPECT_EQ(d.shape, (Shape{1, 1}));
      EXPECT_EQ(d.dtype, DType::kF32);
    }
  }
  EXPECT_TRUE(found);
}

// A plan recorded elsewhere, marked with mark_quantized, keeps the same params as the
// built-in loader with that quantize: the same plan, and quantize_kept_param gives the
// loader's post-processing bits.
TEST(Fp8, MarkedPlanEqualsTheLoadersAndKeptParamsQuantiseAlike) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 128, 8, 2, 192, 1000, false));
  for (Quantize q : {Quantize::kFp8, Quantize::kFp8Ue8m0, Quantize::kMxfp8}) {
    LoaderOptions opts;
    opts.quantize = q;
    auto fp8 = loader_for(cfg, "tp=2", opts);
    auto plain = loader_for(cfg, "tp=2");
    ASSERT_NE(fp8, nullptr);
    ASSERT_NE(plain, nullptr);
    auto want = record_plan(*fp8, 1);
    auto marked = record_plan(*plain, 1);
    ASSERT_TRUE(want.ok() && marked.ok());
    std::vector<std::string> names;
    for (const BlockQuantize& bq : want->quantized()) names.push_back(want->params()[bq.param].name);
    ASSERT_EQ(names.size(), 4u);
    ASSERT_TRUE(mark_quantized(*marked, q, names).ok());
    EXPECT_EQ(*marked, *want) << quantize_name(q);
    // The consumer's step on the loaded params equals the loader's own post-processing.
    auto ckpt = random_checkpoint(plain->checkpoint(), 5);
    ASSERT_TRUE(ckpt.ok());
    auto loaded = load_rank_direct(*plain, 1, *ckpt);
    auto direct = load_rank_direct(*fp8, 1, *ckpt);
    ASSERT_TRUE(loaded.ok() && direct.ok());
    for (const BlockQuantize& bq : marked->quantized()) {
      const std::string& name = marked->params()[bq.param].name;
      ASSERT_TRUE(quantize_kept_param(bq, name, *loaded).ok());
      ASSERT_TRUE(quantize_kept_param(bq, name, *loaded).ok()) << "arrived quantised, with its scales: accepted";
    }
    auto diff = compare_params((*fp8->rank(1))->final_params(), *direct, *loaded);
    ASSERT_TRUE(diff.ok()) << diff.status().to_string();
    if (diff->has_value()) ADD_FAILURE() << quantize_name(q) << ": " << (*diff)->param << " " << (*diff)->detail;
    // Arrived as e4m3 without its scales; missing altogether.
    const BlockQuantize& first = marked->quantized()[0];
    const std::string& name = marked->params()[first.param].name;
    loaded->erase(first.scale_name);
    EXPECT_EQ(quantize_kept_param(first, name, *loaded).code(), StatusCode::kNotFound);
    loaded->erase(name);
    EXPECT_EQ(quantize_kept_param(first, name, *loaded).code(), StatusCode::kNotFound);
  }
  // Bad marks, each named.
  auto plain = loader_for(cfg, "tp=2");
  ASSERT_NE(plain, nullptr);
  auto plan = record_plan(*plain, 0);
  ASSERT_TRUE(plan.ok());
  const Plan before = *plan;
  auto message = [&](Quantize q, std::vector<std::string> names) {
    Status s = mark_quantized(*plan, q, names);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    return s.to_string();
  };
  EXPECT_NE(message(Quantize::kNone, {"model.norm.weight"}).find("quantize is none"), std::string::npos);
  EXPECT_NE(message(Quantize::kFp8, {}).find("no param to quantise"), std::string::npos);
  EXPECT_NE(message(Quantize::kFp8, {"x.weight"}).find("'x.weight' is not a param of the plan"), std::string::npos);
  EXPECT_NE(message(Quantize::kFp8, {"model.norm.weight"}).find("not a float matrix"), std::string::npos);
  const std::string down = "model.layers.0.mlp.down_proj.weight";
  EXPECT_NE(message(Quantize::kFp8, {down, down}).find("listed as quantised twice"), std::string::npos);
  EXPECT_EQ(*plan, before);  // a refused mark leaves the plan as it was
}

// Building blocks for the MoE / FP8-checkpoint architectures.
TEST(Blocks, ExpertsAndScales) {
  using namespace models;
  // 4 experts, I=8, H=4. EP rank 1 of 2 owns experts 2..3.
  auto ck = random_checkpoint({{"gate", DType::kBF16, {8, 4}}, {"up", DType::kBF16, {8, 4}}, {"down", DType::kBF16, {4, 8}}}, 5);
  ASSERT_TRUE(ck.ok());
  Tensor w13 = Tensor::empty({2, 16, 4}, DType::kBF16, "w13");
  Tensor w2 = Tensor::empty({2, 4, 8}, DType::kBF16, "w2");
  const Range experts{2, 2};
  ASSERT_TRUE(load_expert_w13(w13, ck->at("gate"), 3, experts, 0, 8, Split{0, 1}).ok());
  ASSERT_TRUE(load_expert_w13(w13, ck->at("up"), 3, experts, 1, 8, Split{0, 1}).ok());
  ASSERT_TRUE(load_expert_w13(w13, ck->at("up"), 0, experts, 1, 8, Split{0, 1}).ok());  // not ours: no-op
  ASSERT_TRUE(load_expert_w2(w2, ck->at("down"), 3, experts, Split{0, 1}).ok());
  EXPECT_EQ(testing::values(w13.select(0, 1).narrow(0, 0, 8)), testing::values(ck->at("gate")));
  EXPECT_EQ(testing::values(w13.select(0, 1).narrow(0, 8, 8)), testing::values(ck->at("up")));
  EXPECT_EQ(testing::values(w13.select(0, 0)), std::vector<double>(64, 0.0));
  EXPECT_EQ(testing::values(w2.select(0, 1)), testing::values(ck->at("down")));
  // TP split of an expert across 2 ranks: rank 1 takes gate rows 4..7 and down cols 4..7.
  Tensor t13 = Tensor::empty({1, 8, 4}, DType::kBF16, "t13");
  Tensor t2 = Tensor::empty({1, 4, 4}, DType::kBF16, "t2");
  ASSERT_TRUE(load_expert_w13(t13, ck->at("gate"), 0, Range{0, 1}, 0, 8, Split{1, 2}).ok());
  ASSERT_TRUE(load_expert_w2(t2, ck->at("down"), 0, Range{0, 1}, Split{1, 2}).ok());
  EXPECT_EQ(testing::values(t13.select(0, 0).narrow(0, 0, 4)), testing::values(ck->at("gate").narrow(0, 4, 4)));
  EXPECT_EQ(testing::values(t2.select(0, 0)), testing::values(ck->at("down").narrow(1, 4, 4).contiguous()));
  // Scale blocks: rows [64, 128) and [128, 192) of a weight both touch... block 0 and 1.
  EXPECT_EQ(block_shard(Range{0, 64}).start, 0);
  EXPECT_EQ(block_shard(Range{64, 64}).start, 0);  // shares block 0 with the rank before
  EXPECT_EQ(block_shard(Range{64, 64}).length, 1);
  EXPECT_EQ(block_shard(Range{256, 256}).start, 2);
  EXPECT_EQ(block_shard(Range{256, 256}).length, 2);
  EXPECT_EQ(block_shard(Range{100, 100}).length, 2);
  auto sc = random_checkpoint({{"s", DType::kF32, {4, 2}}}, 6);
  Tensor local = Tensor::empty({1, 2}, DType::kF32, "ls");
  ASSERT_TRUE(load_scale_split(local, sc->at("s"), 0, Range{64, 64}).ok());
  EXPECT_EQ(testing::values(local), testing::values(sc->at("s").select(0, 0)));
}

// NaN and infinity are quantised by rule, the same on every device (not by the
// platform's NaN of 0/0 or inf/inf): a NaN is left out of its tile's amax and stays NaN
// with its sign; an infinity makes the tile's scale infinite, so its finite values
// become zeros (with their signs) and the infinities NaN with theirs.
TEST(Fp8, NanAndInfinityAreQuantisedByRule) {
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<float> a = {1.0f, -nan, 2.0f, 4.0f};  // one 2x2 tile
  std::vector<float> b = {inf, -1.0f, 3.0f, -inf};
  for (const auto& [vals, codes, scale] :
       {std::tuple{a, std::vector<uint8_t>{0x6e, 0xff, 0x76, 0x7e}, 4.0f / 448.0f},
        std::tuple{b, std::vector<uint8_t>{0x7f, 0x80, 0x00, 0xff}, inf}}) {
    Tensor w = Tensor::empty({2, 2}, DType::kF32);
    std::memcpy(*w.data_ptr(), vals.data(), 16);
    auto q = models::quantize_fp8_blocks(w);
    ASSERT_TRUE(q.ok()) << q.status().to_string();
    std::vector<uint8_t> got(4);
    std::memcpy(got.data(), *q->first.data_ptr(), 4);
    EXPECT_EQ(got, codes);
    float sc;
    std::memcpy(&sc, *q->second.data_ptr(), 4);
    EXPECT_EQ(sc, scale);
  }
}

// The scale formats (issue 29: fp8, fp8-ue8m0, mxfp8) against an independent reference
// written from the formats' definitions in double and frexp: tiles of 128x128 (or 1x32),
// amax ignoring NaN, the scale (fp32 amax/448; a power of two 2^ceil(log2(amax/448)); or
// 2^(floor(log2 amax) - 8)) with E8M0 bytes clamped to [-127, 127] and 1 for an all-zero
// tile, values e4m3(v / scale) (NaN kept with its sign). Random f32 matrices with a
// random magnitude per tile (2^-140 .. 2^120), NaNs of both signs, infinities,
// subnormals, zeros, an all-zero tile and an all-NaN one, partial tiles.
struct RefForm {
  Fp8Scales format;
  int64_t trows, tcols;
};
int ref_exponent(const RefForm& f, float amax) {
  if (!(amax > 0.0f)) return 0;
  int e = 0;
  if (std::isinf(amax)) {
    e = 128;
  } else if (f.format == Fp8Scales::kUe8m0) {
    const float x = amax / 448.0f;
    int k = 0;
    const double m = std::frexp(static_cast<double>(x), &k);  // x = m 2^k, m in [0.5, 1)
    e = m == 0.5 ? k - 1 : k;                                  // ceil(log2 x)
  } else {
    int k = 0;
    std::frexp(static_cast<double>(amax), &k);
    e = (k - 1) - 8;  // floor(log2 amax) - emax(E4M3)
  }
  return std::clamp(e, -127, 127);
}

void expect_format_matches_reference(const RefForm& f, const std::vector<float>& w, int64_t rows, int64_t cols,
                                     const Tensor& q, const Tensor& s) {
  const int64_t br = (rows + f.trows - 1) / f.trows, bc = (cols + f.tcols - 1) / f.tcols;
  ASSERT_EQ(s.numel(), br * bc);
  ASSERT_EQ(s.dtype(), f.format == Fp8Scales::kF32 ? DType::kF32 : DType::kU8);
  const auto* qp = reinterpret_cast<const uint8_t*>(*q.data_ptr());
  const auto* sp = reinterpret_cast<const uint8_t*>(*s.data_ptr());
  int64_t bad = 0;
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      float amax = 0;
      for (int64_t r = i * f.trows; r < std::min(rows, (i + 1) * f.trows); ++r)
        for (int64_t c = j * f.tcols; c < std::min(cols, (j + 1) * f.tcols); ++c) {
          const float v = w[static_cast<size_t>(r * cols + c)];
          if (!std::isnan(v)) amax = std::max(amax, std::fabs(v));
        }
      float scale;
      const size_t t = static_cast<size_t>(i * bc + j);
      if (f.format == Fp8Scales::kF32) {
        scale = amax > 0 ? amax / 448.0f : 1.0f;
        float got;
        std::memcpy(&got, sp + 4 * t, 4);
        ASSERT_EQ(std::memcmp(&got, &scale, 4), 0) << "tile " << i << "," << j << " amax " << amax;
      } else {
        const int e = ref_exponent(f, amax);
        scale = static_cast<float>(std::ldexp(1.0, e));
        ASSERT_EQ(sp[t], e + 127) << "tile " << i << "," << j << " amax " << amax;
        if (amax == 0) {
          ASSERT_EQ(sp[t], 127) << "an all-zero tile's E8M0 byte (not 0)";
        }
      }
      for (int64_t r = i * f.trows; r < std::min(rows, (i + 1) * f.trows); ++r)
        for (int64_t c = j * f.tcols; c < std::min(cols, (j + 1) * f.tcols); ++c) {
          const float v = w[static_cast<size_t>(r * cols + c)];
          const float x = v / scale;
          const uint8_t want = std::isnan(x) ? static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | 0x7f) : ref_e4m3(x);
          const uint8_t got = qp[r * cols + c];
          if (got != want && bad++ < 5) {
            ADD_FAILURE() << "element " << r << "," << c << " v " << v << " scale " << scale << ": got 0x" << std::hex
                          << int(got) << " want 0x" << int(want);
          }
        }
    }
  }
  EXPECT_EQ(bad, 0);
}

std::vector<float> special_matrix(std::mt19937& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exp(-140, 120), pick(0, 99);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  std::vector<int> tile_exp(1024);
  for (int& e : tile_exp) e = exp(rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int e = tile_exp[static_cast<size_t>(((r / 32) * 31 + c / 16) % 1024)];
      float v = std::ldexp(normal(rng), e);
      const int k = pick(rng);
      if (k == 0) v = std::nanf("");
      if (k == 1) v = -std::nanf("");
      if (k == 2 && pick(rng) < 10) v = pick(rng) % 2 ? INFINITY : -INFINITY;
      if (k == 3) v = std::ldexp(1.0f, -140 - pick(rng) % 9);  // f32 subnormals
      if (k == 4) v = pick(rng) % 2 ? 0.0f : -0.0f;
      w[static_cast<size_t>(r * cols + c)] = v;
    }
  // An all-zero tile and an all-NaN one (128x128 tile (1,0) and rows 0..0 x cols 32..63).
  for (int64_t r = 128; r < std::min<int64_t>(rows, 256); ++r)
    for (int64_t c = 0; c < std::min<int64_t>(cols, 128); ++c) w[static_cast<size_t>(r * cols + c)] = 0.0f;
  for (int64_t c = 32; c < std::min<int64_t>(cols, 64); ++c) w[static_cast<size_t>(c)] = std::nanf("");
  return w;
}

TEST(Fp8, FormatsMatchAnIndependentReference) {
  std::mt19937 rng(291);
  const RefForm forms[] = {{Fp8Scales::kF32, 128, 128}, {Fp8Scales::kUe8m0, 128, 128}, {Fp8Scales::kMx, 1, 32}};
  for (const RefForm& f : forms) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{300, 200}, {129, 97}}) {
      SCOPED_TRACE(fmt::format("format {} {}x{}", static_cast<int>(f.format), rows, cols));
      const std::vector<float> w = special_matrix(rng, rows, cols);
      Tensor t = Tensor::empty({rows, cols}, DType::kF32);
      std::memcpy(*t.data_ptr(), w.data(), w.size() * 4);
      auto q = models::quantize_fp8_blocks(t, f.tcols, f.format);
      ASSERT_TRUE(q.ok()) << q.status().to_string();
      expect_format_matches_reference(f, w, rows, cols, q->first, q->second);
    }
  }
  // The loader's forms: what each Quantize keeps, and the final params it declares.
  const auto ue = models::quantized_form(Quantize::kFp8Ue8m0);
  EXPECT_EQ(ue.scale_dtype, DType::kU8);
  EXPECT_EQ(models::quantized_scale_shape(ue, {3, 300, 200}), (Shape{3, 3, 2}));
  const auto mx = models::quantized_form(Quantize::kMxfp8);
  EXPECT_EQ(mx.scale_suffix, "_scale");
  EXPECT_EQ(models::quantized_scale_shape(mx, {300, 200}), (Shape{300, 7}));
  EXPECT_EQ(*parse_quantize("fp8-ue8m0"), Quantize::kFp8Ue8m0);
  EXPECT_EQ(*parse_quantize("mxfp8"), Quantize::kMxfp8);
  EXPECT_EQ(quantize_name(Quantize::kMxfp8), "mxfp8");
  EXPECT_FALSE(parse_quantize("nvfp4").ok());
}

// Each format through the loader's hook on a model (tp=2: each rank its own shard) and,
// where a device is usable (or emulated), in GPU memory with the host's bits.
TEST(Fp8, FormatsThroughTheHookAndOnTheDevice) {
  for (Quantize qz : {Quantize::kFp8Ue8m0, Quantize::kMxfp8}) {
    SCOPED_TRACE(quantize_name(qz));
    LoaderOptions opts;
    opts.quantize = qz;
    const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 128, 8, 2, 192, 1000, false));
    auto loader = loader_for(cfg, "tp=2", opts);
    ASSERT_NE(loader, nullptr);
    auto ckpt = random_checkpoint(loader->checkpoint(), 24);
    ASSERT_TRUE(ckpt.ok());
    auto loaded = load_rank_direct(*loader, 1, *ckpt);  // the hook runs on a real load
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    auto rl = loader->rank(1);
    ASSERT_TRUE(rl.ok());
    const auto form = models::quantized_form(qz);
    bool found = false;
    for (const TensorDecl& d : (*rl)->final_params()) {
      if (d.name.ends_with("down_proj.weight" + form.scale_suffix)) {
        found = true;
        EXPECT_EQ(d.dtype, DType::kU8) << d.name;
        ASSERT_TRUE(loaded->count(d.name)) << d.name;
        EXPECT_EQ(loaded->at(d.name).shape(), d.shape) << d.name;
        EXPECT_EQ(loaded->at(d.name).dtype(), DType::kU8) << d.name;
      }
    }
    EXPECT_TRUE(found);
    if (!cuda_status().usable()) continue;
    std::mt19937 rng(7);
    const int64_t rows = 200, cols = 300;
    const std::vector<float> w = special_matrix(rng, rows, cols);
    Tensor host = Tensor::empty({rows, cols}, DType::kF32);
    std::memcpy(*host.data_ptr(), w.data(), w.size() * 4);
    auto want = models::quantize_fp8_blocks(host, form.block, form.format);
    ASSERT_TRUE(want.ok());
    auto mem = device_alloc(Device::cuda(0), w.size() * 4);
    ASSERT_TRUE(mem.ok());
    ASSERT_TRUE(device_memcpy(mem->get(), w.data(), w.size() * 4).ok());
    auto got = models::quantize_fp8_blocks(Tensor::borrow_device(mem->get(), {rows, cols}, DType::kF32, Device::cuda(0), *mem),
                                           form.block, form.format);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    for (const auto& [a, b] : {std::pair{want->first, got->first}, std::pair{want->second, got->second}}) {
      const size_t n = static_cast<size_t>(a.numel()) * dtype_size(a.dtype());
      std::vector<std::byte> back(n);
      ASSERT_TRUE(device_memcpy(back.data(), *b.device_ptr(), n).ok());
      EXPECT_EQ(0, std::memcmp(back.data(), *a.data_ptr(), n)) << a.describe();
    }
  }
}

// The hook's device variant: a weight in GPU memory is quantised there (one kernel),
// into a weight and scales on the same device. Without a usable device it fails naming
// the device and why; a strided view in device memory is refused naming it.
TEST(Fp8, QuantizeInGpuMemoryWithoutADeviceFailsNamingIt) {
  if (cuda_status().usable()) GTEST_SKIP() << "a CUDA device is here: Fp8.GpuQuantizeMatchesTheHost covers it";
  void* fake = reinterpret_cast<void*>(uintptr_t{0x10000});
  auto q = models::quantize_fp8_blocks(Tensor::borrow_device(fake, {256, 256}, DType::kBF16, Device::cuda(0)));
  ASSERT_FALSE(q.ok());
  EXPECT_EQ(q.status().code(), StatusCode::kUnavailable) << q.status().to_string();
  EXPECT_NE(q.status().message().find("cuda:0"), std::string::npos) << q.status().to_string();
  EXPECT_NE(q.status().message().find(cuda_status().detail), std::string::npos) << q.status().to_string();
  q = models::quantize_fp8_blocks(Tensor::borrow_device(fake, {256, 256}, DType::kBF16, Device::cuda(0)).t());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("strided view in cuda:0 memory"), std::string::npos) << q.status().to_string();
}

// On a GPU: bf16, f16 and f32 weights with batch dims and partial tiles, quantised in
// device memory, give the host's bits, weights and scales.
TEST(Fp8, GpuQuantizeMatchesTheHost) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  uint64_t seed = 30;
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    auto ckpt = random_checkpoint({{"w", dt, {3, 200, 300}}}, seed++);
    ASSERT_TRUE(ckpt.ok());
    const Tensor host = ckpt->at("w");
    auto want = models::quantize_fp8_blocks(host);
    ASSERT_TRUE(want.ok()) << want.status().to_string();
    const size_t bytes = static_cast<size_t>(host.numel()) * dtype_size(dt);
    auto mem = device_alloc(Device::cuda(0), bytes);
    ASSERT_TRUE(mem.ok()) << mem.status().to_string();
    ASSERT_TRUE(device_memcpy(mem->get(), *host.data_ptr(), bytes).ok());
    auto got = models::quantize_fp8_blocks(Tensor::borrow_device(mem->get(), host.shape(), dt, Device::cuda(0), *mem));
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->first.device(), Device::cuda(0));
    for (const auto& [w, g] : {std::pair{want->first, got->first}, std::pair{want->second, got->second}}) {
      const size_t n = static_cast<size_t>(w.numel()) * dtype_size(w.dtype());
      std::vector<std::byte> back(n);
      ASSERT_TRUE(device_memcpy(back.data(), *g.device_ptr(), n).ok());
      EXPECT_EQ(0, std::memcmp(back.data(), *w.data_ptr(), n)) << dtype_name(dt) << " " << w.describe();
    }
  }
}

// The quantiser's e4m3 encoder (integer arithmetic on the float's bits) against the
// generic mini-float encoder it replaced, on every sign and exponent with a stride
// through the mantissas plus the patterns where rounding changes: zeros, float
// denormals, e4m3's subnormals and smallest normals, each rounding tie, 448 and the
// values that saturate, infinities and NaNs. (Every one of the 2^32 patterns was checked
// once, 2026-12-06, by the same comparison.)
TEST(Fp8, E4m3EncoderEqualsTheGenericOne) {
  using namespace ferry::batch;
  uint64_t checked = 0;
  auto check = [&](uint32_t bits) {
    const float x = bits_float(bits);
    ASSERT_EQ(encode_e4m3fn(x), encode_mini(x, mini_format(kElemE4M3))) << "bits 0x" << std::hex << bits;
    ++checked;
  };
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099) check(static_cast<uint32_t>(b));
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xfffffu, 0x7fffffu}) {
        for (uint32_t m3 = 0; m3 < 8; ++m3) {  // every 3-bit mantissa, around its rounding points
          const uint32_t m = (m3 << 20) | 0x80000u;
          for (uint32_t mant : {m - 1, m, m + 1, (m3 << 20) | low}) check(sign | (exp << 23) | (mant & 0x7fffffu));
        }
        if (HasFatalFailure()) return;
      }
    }
  }
  EXPECT_GT(checked, 1000000u);
}

}  // namespace
}  // namespace ferry
