// Unit tests for the recorder, canonical plans, encoding, coverage and the executor.
#include <cstring>

#include <gtest/gtest.h>

#include "ferry/plan.h"

namespace ferry {
namespace {

Tensor iota(Shape shape, DType dtype = DType::kF32) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  std::byte* p = *t.data_ptr();
  for (int64_t i = 0; i < t.numel(); ++i) store_element(p + i * dtype_size(dtype), dtype, static_cast<double>(i));
  return t;
}

#define EXPECT_STATUS_HAS(st, substr)                                                \
  do {                                                                               \
    ::ferry::Status _s = (st);                                                       \
    EXPECT_FALSE(_s.ok());                                                           \
    EXPECT_NE(_s.message().find(substr), std::string::npos) << "message: " << _s.message(); \
  } while (0)

// A column-parallel shard: rank r of 2 takes rows [r*2, r*2+2) of a [4, 3] weight.
Result<Plan> record_row_shard(int rank, bool reversed) {
  Recorder rec;
  Tensor w = Tensor::source("w", {4, 3}, DType::kBF16);
  Tensor p = Tensor::param("p", {2, 3}, DType::kBF16);
  if (!reversed) {
    FERRY_RETURN_IF_ERROR(p.copy_(w.narrow(0, rank * 2, 2)));
  } else {
    // Same map, written row by row in reverse order.
    FERRY_RETURN_IF_ERROR(p[1].copy_(w[rank * 2 + 1]));
    FERRY_RETURN_IF_ERROR(p[0].copy_(w[rank * 2]));
  }
  return rec.finish();
}

TEST(Recorder, RecordsACanonicalPlan) {
  auto a = record_row_shard(1, false);
  auto b = record_row_shard(1, true);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  ASSERT_EQ(a->copies().size(), 1u);
  EXPECT_EQ(a->copies()[0].src, (Layout{{6}, {1}, 6}));
  EXPECT_EQ(a->copies()[0].dst, (Layout{{6}, {1}, 0}));
  EXPECT_EQ(a->encode(), b->encode());
  EXPECT_EQ(a->hash(), b->hash());
  EXPECT_NE(a->hash(), record_row_shard(0, false)->hash());
  auto st = a->stats();
  EXPECT_EQ(st.copies, 1u);
  EXPECT_EQ(st.elements, 6u);
  EXPECT_EQ(st.bytes, 12u);
  EXPECT_TRUE(a->check_coverage().ok());
}

// A plan recorded against a bf16 checkpoint, read from a trainer's fp32 masters: the
// same copies, converting; equal to the plan recorded against the fp32 sources.
TEST(Plan, SourceReadInAnotherFloatDtypeConverts) {
  auto recorded = [](DType source_dtype) {
    Recorder rec;
    Tensor w = Tensor::source("w", {4, 3}, source_dtype);
    Tensor p = Tensor::param("p", {2, 3}, DType::kBF16);
    EXPECT_TRUE(p.copy_(w.narrow(0, 2, 2)).ok());
    return rec.finish();
  };
  auto plan = recorded(DType::kBF16);
  auto masters = recorded(DType::kF32);
  ASSERT_TRUE(plan.ok() && masters.ok());
  ASSERT_TRUE(plan->set_source_dtype(0, DType::kF32).ok());
  EXPECT_EQ(*plan, *masters);
  EXPECT_TRUE(plan->validate().ok());
  // The copies convert: fp32 1.0, 2.0, ... land as bf16.
  Tensor src = iota({4, 3}, DType::kF32), dst = Tensor::empty({2, 3}, DType::kBF16);
  ASSERT_TRUE(execute(*plan, {{"w", src}}, {{"p", dst}}).ok());
  EXPECT_EQ(*dst[1][2].item(), 11.0);
  EXPECT_STATUS_HAS(plan->set_source_dtype(0, DType::kF8E4M3), "source 'w': can't be read as F8_E4M3");
  EXPECT_STATUS_HAS(plan->set_source_dtype(0, DType::kI32), "only f32, bf16 and f16 convert");
  EXPECT_EQ(plan->set_source_dtype(1, DType::kF32).code(), StatusCode::kOutOfRange);
}

TEST(Recorder, ColumnShardAndZeros) {
  Recorder rec;
  Tensor w = Tensor::source("o_proj", {4, 8}, DType::kBF16);
  Tensor p = Tensor::param("o_local", {4, 4}, DType::kBF16);
  ASSERT_TRUE(p.copy_(w.narrow(1, 4, 4)).ok());
  Tensor emb = Tensor::param("emb", {8, 2}, DType::kBF16);
  Tensor e = Tensor::source("embed", {5, 2}, DType::kBF16);
  ASSERT_TRUE(emb.narrow(0, 0, 5).copy_(e).ok());
  ASSERT_TRUE(emb.narrow(0, 5, 3).zero_().ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->check_coverage().ok()) << plan->check_coverage().to_string();
  EXPECT_EQ(plan->stats().zero_elements, 6u);
  // Sources and params sorted by name.
  EXPECT_EQ(plan->sources()[0].name, "embed");
  EXPECT_EQ(plan->params()[0].name, "emb");
  // Replay.
  Tensor o = Tensor::empty({4, 4}, DType::kBF16), em = Tensor::empty({8, 2}, DType::kBF16);
  ASSERT_TRUE(em.copy_(iota({8, 2}, DType::kBF16)).ok());  // garbage where zeros go
  ASSERT_TRUE(execute(*plan, {{"o_proj", iota({4, 8}, DType::kBF16)}, {"embed", iota({5, 2}, DType::kBF16)}},
                      {{"o_local", o}, {"emb", em}})
                  .ok());
  EXPECT_EQ(*o.to_vector(), *iota({4, 8}).narrow(1, 4, 4).to_vector());
  auto ev = *em.to_vector();
  EXPECT_EQ(std::vector<double>(ev.begin(), ev.begin() + 10), *iota({10}).to_vector());
  EXPECT_EQ(std::vector<double>(ev.begin() + 10, ev.end()), std::vector<double>(6, 0.0));
}

TEST(Recorder, CopyIntoANamedRealBuffer) {
  Recorder rec;
  Tensor buf = Tensor::empty({3}, DType::kF32, "buf");
  ASSERT_TRUE(buf.copy_(Tensor::source("s", {3}, DType::kF32)).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->params()[0].name, "buf");
  EXPECT_EQ(*buf.to_vector(), std::vector<double>(3, 0.0));  // nothing copied while recording
}

TEST(Recorder, Errors) {
  {
    Recorder rec;
    Status st = Tensor::empty({3}, DType::kF32).copy_(Tensor::source("s", {3}, DType::kF32));
    EXPECT_STATUS_HAS(st, "needs a name");
    EXPECT_STATUS_HAS(rec.finish().status(), "needs a name");  // kept
    // Every later record returns the first error.
    EXPECT_STATUS_HAS(Tensor::param("p", {3}, DType::kF32).copy_(Tensor::source("s", {3}, DType::kF32)), "needs a name");
  }
  {
    Recorder rec;
    EXPECT_STATUS_HAS(Tensor::param("p", {3}, DType::kI32).copy_(Tensor::source("s", {3}, DType::kF32)), "cannot convert");
  }
  {
    Recorder rec;
    EXPECT_STATUS_HAS(Tensor::source("t", {3}, DType::kF32).copy_(Tensor::source("s", {3}, DType::kF32)),
                      "is a checkpoint source");
  }
  {
    Recorder rec;
    EXPECT_STATUS_HAS(Tensor::param("q", {3}, DType::kF32).copy_(Tensor::param("p", {3}, DType::kF32)),
                      "is not a checkpoint source");
  }
  {
    Recorder rec;
    ASSERT_TRUE(Tensor::param("p", {3}, DType::kF32).copy_(Tensor::source("s", {3}, DType::kF32)).ok());
    // (into a [3] view of p: [1, 3] -> [3] does not broadcast, as in torch)
    EXPECT_STATUS_HAS(Tensor::param("p", {3}, DType::kF32).unsqueeze(0).copy_(Tensor::source("s", {1, 3}, DType::kF32)),
                      "source 's' declared as [3] F32 and as [1, 3] F32");
  }
  {
    // Recorders nest: the inner one is active, the outer one is restored after.
    Recorder outer;
    {
      Recorder inner;
      ASSERT_TRUE(Tensor::param("a", {1}, DType::kF32).copy_(Tensor::source("x", {1}, DType::kF32)).ok());
      EXPECT_EQ(inner.plan().copies().size(), 1u);
    }
    EXPECT_EQ(active_record_sink(), &outer);
    EXPECT_EQ(outer.plan().copies().size(), 0u);
  }
  EXPECT_EQ(active_record_sink(), nullptr);
}

TEST(Plan, AddCopyChecks) {
  Plan plan;
  ASSERT_TRUE(plan.declare_source({"s", DType::kF32, {4}}).ok());
  ASSERT_TRUE(plan.declare_param({"p", DType::kF32, {4}}).ok());
  EXPECT_STATUS_HAS(plan.add_copy({0, 0, Layout{{4}, {1}, 1}, Layout{{4}, {1}, 0}}), "outside 's' [4]");
  EXPECT_STATUS_HAS(plan.add_copy({0, 0, Layout{{4}, {1}, 0}, Layout{{2}, {1}, 0}}), "differs from destination shape");
  EXPECT_STATUS_HAS(plan.add_copy({3, 0, Layout{{4}, {1}, 0}, Layout{{4}, {1}, 0}}), "source index 3");
  EXPECT_STATUS_HAS(plan.add_copy({0, 0, Layout{{4}, {-1}, 2}, Layout{{4}, {1}, 0}}), "outside");
  EXPECT_TRUE(plan.add_copy({0, 0, Layout{{4}, {-1}, 3}, Layout{{4}, {1}, 0}}).ok());
  EXPECT_STATUS_HAS(plan.add_zero({0, Layout{{2}, {1}, 3}}), "outside");
  EXPECT_STATUS_HAS(plan.declare_source({"s", DType::kBF16, {4}}).status(), "declared as [4] F32 and as [4] BF16");
}

TEST(Plan, CoverageErrorsNameTheParam) {
  Plan plan;
  ASSERT_TRUE(plan.declare_source({"s", DType::kF32, {4}}).ok());
  ASSERT_TRUE(plan.declare_param({"layer.qkv", DType::kF32, {6}}).ok());
  ASSERT_TRUE(plan.add_copy({0, 0, Layout{{4}, {1}, 0}, Layout{{4}, {1}, 0}}).ok());
  EXPECT_STATUS_HAS(plan.check_coverage(), "param 'layer.qkv' [6]: element 4 is written by no copy");
  EXPECT_TRUE(plan.check_coverage(/*allow_unwritten=*/true).ok());
  ASSERT_TRUE(plan.add_copy({0, 0, Layout{{3}, {1}, 0}, Layout{{3}, {1}, 3}}).ok());
  EXPECT_STATUS_HAS(plan.check_coverage(), "param 'layer.qkv' [6]: element 3 is written twice");
}

TEST(Plan, CanonicalizeMergesAndIsIdempotent) {
  // Eight single-row copies of an 8x4 tensor into a transposed param coalesce to one.
  Recorder rec;
  Tensor s = Tensor::source("s", {8, 4}, DType::kF32);
  Tensor p = Tensor::param("p", {4, 8}, DType::kF32);
  for (int r = 7; r >= 0; --r) ASSERT_TRUE(p.select(1, r).copy_(s[r]).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->copies().size(), 1u) << plan->to_string();
  Plan again = *plan;
  again.canonicalize();
  EXPECT_EQ(again, *plan);
  EXPECT_EQ(again.encode(), plan->encode());
}

TEST(Plan, EncodeDecodeRoundTrip) {
  auto plan = record_row_shard(0, false);
  ASSERT_TRUE(plan.ok());
  const std::string bytes = plan->encode();
  auto back = Plan::decode(bytes);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, *plan);
  EXPECT_EQ(back->find_source("w"), std::optional<uint32_t>(0));
  EXPECT_EQ(back->find_param("nope"), std::nullopt);
}

// A plan whose consumer keeps its [4, 3] matrix block-quantised (issue 29).
Result<Plan> record_quantised() {
  FERRY_ASSIGN_OR_RETURN(Plan plan, record_row_shard(1, false));
  FERRY_RETURN_IF_ERROR(plan.set_quantized({BlockQuantize{0, 1, 2, "p_scale_inv"}}));
  return plan;
}

TEST(Plan, QuantisedParamsRoundTripAndChangeTheHash) {
  auto dense = record_row_shard(1, false);
  auto plan = record_quantised();
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  // A plan without them encodes as version 1, as before the field existed.
  EXPECT_EQ(dense->encode()[4], 1);
  EXPECT_EQ(plan->encode()[4], 2);
  EXPECT_NE(plan->hash(), dense->hash());
  EXPECT_NE(*plan, *dense);
  auto back = Plan::decode(plan->encode());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, *plan);
  ASSERT_EQ(back->quantized().size(), 1u);
  EXPECT_EQ(back->quantized()[0], (BlockQuantize{0, 1, 2, "p_scale_inv"}));
  EXPECT_NE(plan->to_string().find("p quantised: fp8 tiles of 2, scale format 1 -> p_scale_inv"), std::string::npos)
      << plan->to_string();
}

TEST(Plan, CanonicalizeRemapsQuantisedParams) {
  // Params declared out of name order: canonicalize sorts them and the entry follows "b".
  Recorder rec;
  Tensor s = Tensor::source("s", {4, 4}, DType::kBF16);
  Tensor b = Tensor::param("b", {2, 4}, DType::kBF16);
  Tensor a = Tensor::param("a", {2, 4}, DType::kBF16);
  ASSERT_TRUE(b.copy_(s.narrow(0, 0, 2)).ok());
  ASSERT_TRUE(a.copy_(s.narrow(0, 2, 2)).ok());
  Plan plan = rec.plan();
  ASSERT_EQ(plan.params()[0].name, "b");
  ASSERT_TRUE(plan.set_quantized({BlockQuantize{0, 0, 128, "b_scale_inv"}}).ok());
  plan.canonicalize();
  ASSERT_EQ(plan.params()[1].name, "b");
  ASSERT_EQ(plan.quantized().size(), 1u);
  EXPECT_EQ(plan.quantized()[0].param, 1u);
}

TEST(Plan, SetQuantizedRefusesWhatCantBeQuantised) {
  Recorder rec;
  Tensor s = Tensor::source("s", {4}, DType::kBF16);
  Tensor v = Tensor::param("v", {4}, DType::kBF16);
  Tensor m = Tensor::source("m", {2, 2}, DType::kI32);
  Tensor mi = Tensor::param("mi", {2, 2}, DType::kI32);
  ASSERT_TRUE(v.copy_(s).ok());
  ASSERT_TRUE(mi.copy_(m).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  Plan p = *plan;  // params: mi (0), v (1)
  EXPECT_STATUS_HAS(p.set_quantized({BlockQuantize{5, 0, 128, "x"}}), "index 5 of 2");
  EXPECT_STATUS_HAS(p.set_quantized({BlockQuantize{1, 0, 128, "x"}}), "not a float matrix");
  EXPECT_STATUS_HAS(p.set_quantized({BlockQuantize{0, 0, 128, "x"}}), "not a float matrix");
  auto q = record_row_shard(0, false);
  Plan r = *q;
  EXPECT_STATUS_HAS(r.set_quantized({BlockQuantize{0, 3, 128, "x"}}), "scale format 3");
  EXPECT_STATUS_HAS(r.set_quantized({BlockQuantize{0, 0, 0, "x"}}), "block 0");
  EXPECT_STATUS_HAS(r.set_quantized({BlockQuantize{0, 0, 128, ""}}), "need a name");
  EXPECT_STATUS_HAS(r.set_quantized({BlockQuantize{0, 0, 128, "p"}}), "is a param of the plan");
  EXPECT_STATUS_HAS(r.set_quantized({BlockQuantize{0, 0, 128, "x"}, BlockQuantize{0, 0, 128, "y"}}), "twice");
  EXPECT_TRUE(r.quantized().empty());  // a refused list leaves the plan as it was
}

TEST(Plan, DecodeRejectsCorruptQuantisedParams) {
  auto plan = record_quantised();
  ASSERT_TRUE(plan.ok());
  const std::string good = plan->encode();
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = Plan::decode(std::string_view(good.data(), n));
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << "prefix of " << n << " bytes";
  }
  for (size_t i = 0; i < good.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      auto r = Plan::decode(bad);
      if (r.ok()) {
        EXPECT_TRUE(r->validate().ok());
        for (const BlockQuantize& q : r->quantized()) EXPECT_LT(q.param, r->params().size());
      } else {
        EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().to_string();
      }
    }
  }
}

TEST(Plan, DecodeRejectsMalformedInput) {
  auto plan = record_row_shard(0, false);
  const std::string good = plan->encode();
  EXPECT_STATUS_HAS(Plan::decode(std::string_view("")).status(), "truncated");
  EXPECT_STATUS_HAS(Plan::decode(std::string_view("XXXX\1\0\0\0")).status(), "bad magic");
  std::string v3 = good;
  v3[4] = 3;
  EXPECT_STATUS_HAS(Plan::decode(v3).status(), "encoding version 3 is not supported");
  std::string v2 = good;  // version 2 must carry quantised params
  v2[4] = 2;
  EXPECT_FALSE(Plan::decode(v2).ok());
  // Every truncation fails cleanly.
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = Plan::decode(std::string_view(good.data(), n));
    EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes decoded";
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  }
  EXPECT_STATUS_HAS(Plan::decode(good + "x").status(), "trailing");
  // A huge count is refused before any allocation.
  std::string huge = good.substr(0, 8) + std::string("\xff\xff\xff\xff\x0f", 5);
  EXPECT_STATUS_HAS(Plan::decode(huge).status(), "exceeds");
  // Every single-byte corruption either decodes to a valid plan or fails cleanly.
  for (size_t i = 0; i < good.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      auto r = Plan::decode(bad);
      if (r.ok()) {
        EXPECT_TRUE(r->validate().ok());
      } else {
        EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().to_string();
      }
    }
  }
}

TEST(Execute, ErrorsNameTheTensor) {
  auto plan = record_row_shard(0, false);
  ASSERT_TRUE(plan.ok());
  Tensor p = Tensor::empty({2, 3}, DType::kBF16);
  EXPECT_STATUS_HAS(execute(*plan, {}, {{"p", p}}), "source 'w' [4, 3] BF16 is missing");
  EXPECT_STATUS_HAS(execute(*plan, {{"w", Tensor::empty({4, 3}, DType::kF32)}}, {{"p", p}}),
                    "source 'w' has dtype F32 but the plan expects BF16");
  EXPECT_STATUS_HAS(execute(*plan, {{"w", Tensor::empty({3, 4}, DType::kBF16)}}, {{"p", p}}),
                    "source 'w' has shape [3, 4] but the plan expects [4, 3]");
  EXPECT_STATUS_HAS(execute(*plan, {{"w", Tensor::empty({3, 4}, DType::kBF16).t()}}, {{"p", p}}), "must be contiguous");
  EXPECT_STATUS_HAS(execute(*plan, {{"w", Tensor::source("w", {4, 3}, DType::kBF16)}}, {{"p", p}}), "must be a real tensor");
  EXPECT_STATUS_HAS(execute(*plan, {{"w", Tensor::empty({4, 3}, DType::kBF16)}}, {}), "param 'p'");
}

TEST(Execute, ConvertsFloatDtypesAndRunsInParallel) {
  Recorder rec;
  Tensor s = Tensor::source("s", {64, 64}, DType::kF32);
  Tensor p = Tensor::param("p", {64, 64}, DType::kBF16);
  ASSERT_TRUE(p.copy_(s.t()).ok());
  auto plan = rec.finish();
  ASSERT_TRUE(plan.ok());
  Tensor out1 = Tensor::empty({64, 64}, DType::kBF16), out2 = Tensor::empty({64, 64}, DType::kBF16);
  Tensor src = iota({64, 64});
  ASSERT_TRUE(execute(*plan, {{"s", src}}, {{"p", out1}}).ok());
  ASSERT_TRUE(execute(*plan, {{"s", src}}, {{"p", out2}}, ExecuteOptions{4, 0}).ok());
  EXPECT_TRUE(*out1.equal(out2));
  Tensor expected = Tensor::empty({64, 64}, DType::kBF16);
  ASSERT_TRUE(expected.copy_(src.t()).ok());
  EXPECT_TRUE(*out1.equal(expected));
}

}  // namespace
}  // namespace ferry
