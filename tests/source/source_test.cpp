// WeightSource pieces: trainer layout parsing, groups, classification, Megatron and FSDP
// holdings, the synthetic source.
#include <cmath>
#include <cstring>
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "ferry/source.h"
#include "route/synthetic_model.h"

namespace ferry {
namespace {

TEST(TrainerLayout, Parses) {
  auto l = TrainerLayout::parse("tp=4,pp=2,ep=8,etp=1");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->dp, 2);  // the smallest dp with tp*dp a multiple of ep*etp
  EXPECT_EQ(l->world_size(), 16);
  EXPECT_EQ(l->to_string(), "tp=4,pp=2,ep=8,etp=1,dp=2");
  l = TrainerLayout::parse(" tp=8 , pp=8, ep=32, etp=1 ");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->world_size(), 256);
  l = TrainerLayout::parse("tp=2,world=16");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->dp, 8);
  l = TrainerLayout::parse("fsdp=5");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->kind, TrainerLayout::Kind::kFsdp);
  EXPECT_EQ(l->world_size(), 5);
  EXPECT_EQ(l->to_string(), "fsdp=5");
}

TEST(TrainerLayout, Errors) {
  auto msg = [](std::string_view s) { return TrainerLayout::parse(s).status().message(); };
  EXPECT_NE(msg("tp=2,foo=3").find("unknown key 'foo'"), std::string::npos);
  EXPECT_NE(msg("tp=2,tp=3").find("'tp' given twice"), std::string::npos);
  EXPECT_NE(msg("tp=0").find("positive integer"), std::string::npos);
  EXPECT_NE(msg("tp=x").find("positive integer"), std::string::npos);
  EXPECT_NE(msg("tp").find("not key=value"), std::string::npos);
  EXPECT_NE(msg("fsdp=4,tp=2").find("can't be combined"), std::string::npos);
  EXPECT_NE(msg("tp=2,ep=4,dp=1").find("must divide tp*dp"), std::string::npos);
  EXPECT_NE(msg("tp=4,pp=2,world=12").find("not a multiple"), std::string::npos);
  EXPECT_NE(msg("").find("empty"), std::string::npos);
}

// dtype=: the dtype a trainer holds the checkpoint's 16/32-bit float tensors in (fp32
// master weights, issue 29); FP8 and integer tensors stay as the checkpoint has them.
TEST(TrainerLayout, HeldDtype) {
  auto l = TrainerLayout::parse("tp=2,dtype=fp32,pp=2");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->dtype, DType::kF32);
  EXPECT_EQ(l->world_size(), 4);
  EXPECT_EQ(l->to_string(), "tp=2,pp=2,ep=1,etp=1,dp=1,dtype=fp32");
  EXPECT_EQ(TrainerLayout::parse(l->to_string())->to_string(), l->to_string());
  l = TrainerLayout::parse("fsdp=4,dtype=bfloat16");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->to_string(), "fsdp=4,dtype=bf16");
  EXPECT_FALSE(TrainerLayout::parse("tp=2")->dtype.has_value());
  auto msg = [](std::string_view s) { return TrainerLayout::parse(s).status().message(); };
  EXPECT_NE(msg("tp=2,dtype=fp8").find("dtype must be fp32, bf16 or fp16, got 'fp8'"), std::string::npos);
  EXPECT_NE(msg("tp=2,dtype=int32").find("dtype must be"), std::string::npos);
  EXPECT_NE(msg("dtype=fp32,tp=2,dtype=bf16").find("'dtype' given twice"), std::string::npos);

  const std::vector<TensorDecl> ckpt = {{"a", DType::kBF16, {2}},
                                        {"b", DType::kF8E4M3, {2}},
                                        {"b_scale_inv", DType::kF32, {1}},
                                        {"c", DType::kI64, {2}}};
  const auto meta = trainer_metadata(ckpt, TrainerLayout::parse("tp=1,dtype=fp32").value());
  EXPECT_EQ(meta[0].dtype, DType::kF32);
  EXPECT_EQ(meta[1].dtype, DType::kF8E4M3);
  EXPECT_EQ(meta[2].dtype, DType::kF32);
  EXPECT_EQ(meta[3].dtype, DType::kI64);
  EXPECT_EQ(trainer_metadata(ckpt, TrainerLayout::parse("tp=1").value()), ckpt);
}

TEST(Groups, ByName) {
  std::vector<TensorDecl> meta = {{"model.embed_tokens.weight", DType::kBF16, {4, 2}},
                                  {"model.layers.1.mlp.up_proj.weight", DType::kBF16, {2, 2}},
                                  {"model.layers.0.input_layernorm.weight", DType::kBF16, {2}},
                                  {"model.norm.weight", DType::kBF16, {2}},
                                  {"lm_head.weight", DType::kBF16, {4, 2}},
                                  {"model.mylayers.7.x", DType::kBF16, {1}}};
  Groups g(meta);
  EXPECT_EQ(g.size(), 4);
  EXPECT_EQ(g.name(0), "pre");
  EXPECT_EQ(g.name(2), "layer 1");
  EXPECT_EQ(g.name(3), "post");
  EXPECT_EQ(g.tensor_groups(), (std::vector<int>{0, 2, 1, 3, 3, 3}));
  EXPECT_EQ(g.of_name("model.layers.0.self_attn.q_proj.weight"), 1);
}

TEST(Classify, BySuffix) {
  struct Case {
    const char* name;
    TensorClass c;
  };
  const Case cases[] = {
      {"model.layers.0.self_attn.q_proj.weight", TensorClass::kColumn},
      {"model.layers.0.self_attn.k_proj.bias", TensorClass::kColumn},
      {"model.layers.0.self_attn.o_proj.weight", TensorClass::kRow},
      {"model.layers.0.self_attn.o_proj.bias", TensorClass::kReplicated},
      {"model.layers.0.self_attn.q_norm.weight", TensorClass::kReplicated},
      {"model.layers.0.self_attn.q_a_proj.weight", TensorClass::kReplicated},
      {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", TensorClass::kReplicated},
      {"model.layers.0.self_attn.q_a_layernorm.weight", TensorClass::kReplicated},
      {"model.layers.0.self_attn.q_b_proj.weight", TensorClass::kColumn},
      {"model.layers.0.self_attn.kv_b_proj.weight_scale_inv", TensorClass::kColumn},
      {"model.layers.0.self_attn.qkv_proj.weight", TensorClass::kFusedQkv},
      {"model.layers.0.mlp.gate_up_proj.weight", TensorClass::kFusedGateUp},
      {"model.layers.0.mlp.gate.weight", TensorClass::kReplicated},
      {"model.layers.0.mlp.gate.e_score_correction_bias", TensorClass::kReplicated},
      {"model.layers.0.mlp.shared_experts.gate_proj.weight", TensorClass::kColumn},
      {"model.layers.0.mlp.shared_experts.down_proj.weight", TensorClass::kRow},
      {"model.layers.0.mlp.experts.12.up_proj.weight", TensorClass::kExpertColumn},
      {"model.layers.0.mlp.experts.12.down_proj.weight", TensorClass::kExpertRow},
      {"model.layers.0.block_sparse_moe.experts.3.w1.weight", TensorClass::kExpertColumn},
      {"model.layers.0.block_sparse_moe.experts.3.w2.weight", TensorClass::kExpertRow},
      {"model.layers.0.block_sparse_moe.gate.weight", TensorClass::kReplicated},
      {"language_model.model.layers.0.feed_forward.experts.gate_up_proj", TensorClass::kExpertsGateUp},
      {"language_model.model.layers.0.feed_forward.experts.down_proj", TensorClass::kExpertsDown},
      {"language_model.model.layers.0.feed_forward.router.weight", TensorClass::kReplicated},
      {"language_model.model.layers.0.feed_forward.shared_expert.up_proj.weight", TensorClass::kColumn},
      {"model.embed_tokens.weight", TensorClass::kVocab},
      {"lm_head.weight", TensorClass::kVocab},
      {"model.layers.61.embed_tokens.weight", TensorClass::kVocab},  // DeepSeek-V3's MTP layer
      {"model.layers.61.shared_head.head.weight", TensorClass::kVocab},
      {"model.layers.61.shared_head.norm.weight", TensorClass::kReplicated},
      {"model.layers.61.eh_proj.weight", TensorClass::kColumn},
      {"model.layers.61.enorm.weight", TensorClass::kReplicated},
      {"model.norm.weight", TensorClass::kReplicated},
  };
  for (const auto& c : cases) EXPECT_EQ(classify_tensor(c.name), c.c) << c.name;
  int64_t e = -1;
  classify_tensor("model.layers.3.mlp.experts.17.gate_proj.weight", &e);
  EXPECT_EQ(e, 17);
}

// Union of the boxes of `tensor` over `ranks`: how many times each element is held.
std::vector<int> coverage(const std::vector<Holdings>& ranks, const TensorDecl& d, const std::vector<int>& which) {
  std::vector<int> n(static_cast<size_t>(shape_numel(d.shape)), 0);
  const Shape st = contiguous_strides(d.shape);
  for (int r : which) {
    const Holdings& h = ranks[static_cast<size_t>(r)];
    for (const auto& b : h.boxes) {
      if (h.tensors[b.tensor].name != d.name) continue;
      Shape idx(d.shape.size(), 0);
      for (int64_t e = 0; e < b.box.numel(); ++e) {
        int64_t f = 0;
        for (size_t k = 0; k < idx.size(); ++k) f += (b.box.start[k] + idx[k]) * st[k];
        n[static_cast<size_t>(f)]++;
        for (size_t k = idx.size(); k-- > 0;) {
          if (++idx[k] < b.box.size[k]) break;
          idx[k] = 0;
        }
      }
    }
  }
  return n;
}

TEST(Holdings, MegatronDenseTpPpDp) {
  testing::ModelSpec m;
  m.layers = 4;
  m.qkv_bias = true;
  const auto meta = testing::make_metadata(m);
  auto l = TrainerLayout::parse("tp=2,pp=2,dp=2").value();
  auto th = make_holdings(meta, l, {m.q_rows(), m.kv_rows()});
  ASSERT_TRUE(th.ok()) << th.status().to_string();
  ASSERT_EQ(th->ranks.size(), 8u);
  // Each DP replica (ranks of one dp index over both stages) holds every element exactly
  // once for TP-split tensors and tp times for replicated ones.
  for (int dp = 0; dp < 2; ++dp) {
    std::vector<int> replica;
    for (int s = 0; s < 2; ++s)
      for (int t = 0; t < 2; ++t) replica.push_back(s * 4 + dp * 2 + t);
    for (size_t i = 0; i < meta.size(); ++i) {
      const auto c = classify_tensor(meta[i].name);
      const int want = c == TensorClass::kReplicated ? 2 : 1;
      for (int x : coverage(th->ranks, meta[i], replica)) ASSERT_EQ(x, want) << meta[i].name;
    }
  }
  // Stages: layers 0-1 and embeddings on stage 0, layers 2-3, norm and lm_head on stage 1.
  auto stage_of = [&](const std::string& n) {
    for (size_t i = 0; i < meta.size(); ++i)
      if (meta[i].name == n) return th->tensor_stage[i];
    return -1;
  };
  EXPECT_EQ(stage_of("model.embed_tokens.weight"), 0);
  EXPECT_EQ(stage_of("model.layers.1.mlp.up_proj.weight"), 0);
  EXPECT_EQ(stage_of("model.layers.2.mlp.up_proj.weight"), 1);
  EXPECT_EQ(stage_of("lm_head.weight"), 1);
  // Rank 1 (stage 0, dp 0, tp 1): q_proj rows [8, 16), o_proj columns [8, 16).
  const Holdings& h = th->ranks[1];
  for (const auto& b : h.boxes) {
    const auto& n = h.tensors[b.tensor].name;
    if (n == "model.layers.0.self_attn.q_proj.weight") {
      EXPECT_EQ(b.box, (Box{{8, 0}, {8, 16}}));
    }
    if (n == "model.layers.0.self_attn.o_proj.weight") {
      EXPECT_EQ(b.box, (Box{{0, 8}, {16, 8}}));
    }
    if (n == "model.embed_tokens.weight") {  // chunk of 37 rows
      EXPECT_EQ(b.box, (Box{{19, 0}, {18, 16}}));
    }
    EXPECT_EQ(th->tensor_stage[0], 0);
  }
}

TEST(Holdings, MegatronFirstLastStageLayers) {
  testing::ModelSpec m;
  m.layers = 6;
  const auto meta = testing::make_metadata(m);
  auto l = TrainerLayout::parse("pp=3,first=1,last=1");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->to_string(), "tp=1,pp=3,ep=1,etp=1,dp=1,first=1,last=1");
  auto th = make_holdings(meta, *l, {m.q_rows(), m.kv_rows()});
  ASSERT_TRUE(th.ok()) << th.status().to_string();
  std::map<std::string, int> stage;
  for (size_t i = 0; i < meta.size(); ++i) stage[meta[i].name] = th->tensor_stage[i];
  EXPECT_EQ(stage["model.layers.0.mlp.up_proj.weight"], 0);
  EXPECT_EQ(stage["model.layers.1.mlp.up_proj.weight"], 1);
  EXPECT_EQ(stage["model.layers.4.mlp.up_proj.weight"], 1);
  EXPECT_EQ(stage["model.layers.5.mlp.up_proj.weight"], 2);
  EXPECT_FALSE(make_holdings(meta, TrainerLayout::parse("pp=3,first=4,last=3").value()).ok());
  EXPECT_FALSE(TrainerLayout::parse("first=2").ok());  // needs pp >= 2
}

// DeepSeek-V3's multi-token-prediction layer (a trailing layer with an eh_proj) sits in the
// last stage, as Megatron-Core puts it, and the decoder's layers alone are split: 3 + 1
// layers over pp=2 are [0, 1] and [2, MTP], and with first=2 the same; eh_proj's rows and
// shared_head.head's vocab rows split over TP as Megatron holds them.
TEST(Holdings, MegatronMtpLayersSitInTheLastStage) {
  testing::ModelSpec m;
  m.layers = 3;
  auto meta = testing::make_metadata(m);
  const int64_t H = 64, V = 100;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
           {"model.layers.3.embed_tokens.weight", {V, H}}, {"model.layers.3.enorm.weight", {H}},
           {"model.layers.3.hnorm.weight", {H}}, {"model.layers.3.eh_proj.weight", {H, 2 * H}},
           {"model.layers.3.shared_head.norm.weight", {H}}, {"model.layers.3.shared_head.head.weight", {V, H}},
           {"model.layers.3.mlp.down_proj.weight", {H, 4 * H}}}) {
    meta.push_back(TensorDecl{name, DType::kBF16, shape});
  }
  for (const char* text : {"tp=2,pp=2", "tp=2,pp=2,first=2"}) {
    auto th = make_holdings(meta, TrainerLayout::parse(text).value(), {m.q_rows(), m.kv_rows()});
    ASSERT_TRUE(th.ok()) << th.status().to_string();
    std::map<std::string, int> stage;
    for (size_t i = 0; i < meta.size(); ++i) stage[meta[i].name] = th->tensor_stage[i];
    EXPECT_EQ(stage["model.layers.1.mlp.up_proj.weight"], 0) << text;
    EXPECT_EQ(stage["model.layers.2.mlp.up_proj.weight"], 1) << text;
    EXPECT_EQ(stage["model.layers.3.eh_proj.weight"], 1) << text;
    EXPECT_EQ(stage["model.layers.3.embed_tokens.weight"], 1) << text;
    // Rank 3 (stage 1, TP rank 1): eh_proj's second half of rows, shared_head.head's vocab rows.
    const Holdings& h = th->ranks[3];
    for (const HeldBox& b : h.boxes) {
      const std::string& name = h.tensors[b.tensor].name;
      if (name == "model.layers.3.eh_proj.weight") {
        EXPECT_EQ(b.box.start, (Shape{H / 2, 0})) << text;
      }
      if (name == "model.layers.3.shared_head.head.weight") {
        EXPECT_EQ(b.box.size, (Shape{V / 2, H})) << text;
      }
    }
  }
  // Without the MTP layer's eh_proj, layer 3 is a decoder layer: [0, 1], [2, 3].
  std::vector<TensorDecl> plain;
  for (const TensorDecl& d : meta)
    if (d.name.find(".eh_proj.") == std::string::npos) plain.push_back(d);
  auto th = make_holdings(plain, TrainerLayout::parse("tp=2,pp=2").value(), {m.q_rows(), m.kv_rows()});
  ASSERT_TRUE(th.ok()) << th.status().to_string();
  for (size_t i = 0; i < plain.size(); ++i) {
    if (plain[i].name == "model.layers.2.mlp.up_proj.weight") {
      EXPECT_EQ(th->tensor_stage[i], 1);
    }
    if (plain[i].name == "model.layers.1.mlp.up_proj.weight") {
      EXPECT_EQ(th->tensor_stage[i], 0);
    }
  }
}

TEST(Holdings, MegatronExpertsAndFused) {
  testing::ModelSpec m;
  m.experts = 8;
  const auto meta = testing::make_metadata(m);
  auto l = TrainerLayout::parse("tp=2,pp=1,ep=2,etp=2").value();  // dp 2, edp 1
  auto th = make_holdings(meta, l, {m.q_rows(), m.kv_rows()});
  ASSERT_TRUE(th.ok()) << th.status().to_string();
  // Expert 5 of layer 0 (owner ep rank 1) lives on ranks 2 (etp 0) and 3 (etp 1).
  const TensorDecl* gp = nullptr;
  for (const auto& d : meta)
    if (d.name == "model.layers.0.mlp.experts.5.gate_proj.weight") gp = &d;
  ASSERT_TRUE(gp);
  EXPECT_EQ(coverage(th->ranks, *gp, {0, 1}), std::vector<int>(static_cast<size_t>(shape_numel(gp->shape)), 0));
  EXPECT_EQ(coverage(th->ranks, *gp, {2, 3}), std::vector<int>(static_cast<size_t>(shape_numel(gp->shape)), 1));
  // Llama-4 fused experts: dim 0 over EP, the gate|up halves over ETP (two boxes).
  m.fused_experts = true;
  const auto meta2 = testing::make_metadata(m);
  auto th2 = make_holdings(meta2, l, {m.q_rows(), m.kv_rows()});
  ASSERT_TRUE(th2.ok()) << th2.status().to_string();
  int seen = 0;
  for (const auto& b : th2->ranks[3].boxes) {
    const auto& n = th2->ranks[3].tensors[b.tensor].name;
    if (n == "model.layers.0.feed_forward.experts.gate_up_proj") {
      EXPECT_TRUE(b.box == (Box{{4, 0, 4}, {4, 16, 4}}) || b.box == (Box{{4, 0, 12}, {4, 16, 4}})) << b.box.to_string();
      ++seen;
    }
    if (n == "model.layers.0.feed_forward.experts.down_proj") {
      EXPECT_EQ(b.box, (Box{{4, 4, 0}, {4, 4, 16}}));
    }
  }
  EXPECT_EQ(seen, 2);
  // Phi-3 fused qkv: one box per part per TP rank.
  testing::ModelSpec p;
  p.phi3 = true;
  const auto meta3 = testing::make_metadata(p);
  auto th3 = make_holdings(meta3, TrainerLayout::parse("tp=2").value(), {p.q_rows(), p.kv_rows()});
  ASSERT_TRUE(th3.ok()) << th3.status().to_string();
  std::vector<Box> qkv;
  for (const auto& b : th3->ranks[1].boxes)
    if (th3->ranks[1].tensors[b.tensor].name == "model.layers.0.self_attn.qkv_proj.weight") qkv.push_back(b.box);
  EXPECT_EQ(qkv, (std::vector<Box>{Box{{8, 0}, {8, 16}}, Box{{20, 0}, {4, 16}}, Box{{28, 0}, {4, 16}}}));
  // Without head info a fused qkv can't be split: the error names the tensor.
  auto bad = make_holdings(meta3, TrainerLayout::parse("tp=2").value(), {});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'model.layers.0.self_attn.qkv_proj.weight'"), std::string::npos);
}

TEST(Holdings, MegatronErrorsNameTheTensor) {
  testing::ModelSpec m;
  m.experts = 4;
  const auto meta = testing::make_metadata(m);
  auto th = make_holdings(meta, TrainerLayout::parse("tp=8,ep=8").value(), {m.q_rows(), m.kv_rows()});
  ASSERT_FALSE(th.ok());
  EXPECT_NE(th.status().message().find("'model.layers.0."), std::string::npos) << th.status().to_string();
}

// Sizes bounded before anything is allocated: tp=100000,pp=100000 overflowed int and
// aborted on std::bad_alloc; every value and product is now checked against kMaxRanks.
TEST(TrainerLayout, RankCountsAreBounded) {
  auto msg = [](std::string_view s) { return TrainerLayout::parse(s).status().message(); };
  EXPECT_EQ(msg("tp=100000,pp=100000"),
            "trainer layout 'tp=100000,pp=100000': tp*pp = 10000000000 exceeds the limit of 1048576 ranks");
  EXPECT_EQ(msg("tp=65536,dp=65536"),
            "trainer layout 'tp=65536,dp=65536': tp*pp*dp = 4294967296 ranks exceeds the limit of 1048576");
  EXPECT_EQ(msg("fsdp=2147483647"), "trainer layout 'fsdp=2147483647': fsdp = 2147483647 exceeds the limit of 1048576 ranks");
  EXPECT_EQ(msg("ep=65536,etp=65536"), "trainer layout 'ep=65536,etp=65536': ep*etp = 4294967296 exceeds the limit of 1048576 ranks");
  EXPECT_TRUE(TrainerLayout::parse("fsdp=1048576").ok());
  // The default dp (smallest D with tp*D a multiple of ep*etp) was counted up in int and
  // overflowed tp*D (UBSan, fuzz_config_layout); now D = 1048576 and the rank bound refuses it.
  EXPECT_EQ(msg("tp=1048573,ep=1048576"),
            "trainer layout 'tp=1048573,ep=1048576': tp*pp*dp = 1099508482048 ranks exceeds the limit of 1048576");
  EXPECT_EQ(TrainerLayout::parse("tp=6,ep=4")->dp, 2);
  EXPECT_EQ(TrainerLayout::parse("tp=3,ep=4,etp=2")->dp, 8);
  // A layout built in code gets the same bound from make_holdings, before any rank is allocated.
  TrainerLayout l;
  l.tp = 1 << 16;
  l.pp = 1 << 16;
  auto th = make_holdings({{"model.norm.weight", DType::kF32, {4}}}, l);
  ASSERT_FALSE(th.ok());
  EXPECT_NE(th.status().message().find("4294967296 ranks exceeds the limit of 1048576"), std::string::npos)
      << th.status().message();
}

// More PP stages than layers left stages empty and was accepted; now refused naming the
// constraint and the numbers.
TEST(Holdings, EmptyPipelineStagesAreRefused) {
  testing::ModelSpec m;
  m.layers = 4;
  const auto meta = testing::make_metadata(m);
  auto th = make_holdings(meta, TrainerLayout::parse("pp=8").value(), {m.q_rows(), m.kv_rows()});
  ASSERT_FALSE(th.ok());
  EXPECT_EQ(th.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(th.status().message().find("pp 8 leaves PP stage 4 without layers (the model has 4 layers"),
            std::string::npos)
      << th.status().message();
  // first/last that leave a middle stage empty, too.
  auto fl = make_holdings(meta, TrainerLayout::parse("pp=3,first=2,last=2").value(), {m.q_rows(), m.kv_rows()});
  ASSERT_FALSE(fl.ok());
  EXPECT_NE(fl.status().message().find("leaves PP stage 1 without layers"), std::string::npos) << fl.status().message();
  EXPECT_TRUE(make_holdings(meta, TrainerLayout::parse("pp=4").value(), {m.q_rows(), m.kv_rows()}).ok());
}

// More FSDP ranks than rows: only the ranks holding rows are visited, the rest hold
// nothing (a million ranks over a small model is quick).
TEST(Holdings, FsdpWithMoreRanksThanRows) {
  std::vector<TensorDecl> meta = {{"model.layers.0.w", DType::kBF16, {5, 3}}, {"model.norm.weight", DType::kF32, {7}}};
  auto th = make_holdings(meta, TrainerLayout::parse("fsdp=1000000").value());
  ASSERT_TRUE(th.ok()) << th.status().to_string();
  ASSERT_EQ(th->ranks.size(), 1000000u);
  size_t boxes = 0;
  for (const auto& h : th->ranks) boxes += h.boxes.size();
  EXPECT_EQ(boxes, 12u);
  EXPECT_EQ(th->ranks[6].boxes.size(), 1u);
  EXPECT_TRUE(th->ranks[7].boxes.empty());
}

// count_held_boxes walks make_holdings without making anything: the same count of boxes
// over every rank (replicas counted at once), the same errors, for every kind of layout.
TEST(Holdings, CountedBoxesAreTheBoxesMade) {
  testing::ModelSpec dense;
  dense.layers = 3;
  dense.qkv_bias = true;
  dense.scalar = true;
  testing::ModelSpec moe = dense;
  moe.experts = 8;
  testing::ModelSpec fused = moe;
  fused.fused_experts = true;
  testing::ModelSpec phi3;
  phi3.phi3 = true;
  const std::pair<const testing::ModelSpec*, const char*> cases[] = {
      {&dense, "fsdp=1"},         {&dense, "fsdp=7"},          {&dense, "fsdp=1000"},          {&dense, "tp=2,pp=3,dp=2"},
      {&moe, "tp=2,ep=2,etp=2"},  {&moe, "tp=2,dp=4,ep=4,etp=2"}, {&fused, "tp=2,dp=2,ep=2,etp=2"}, {&phi3, "tp=2,dp=3"},
      {&moe, "fsdp=5"}};
  for (const auto& [spec, layout] : cases) {
    SCOPED_TRACE(layout);
    const auto meta = testing::make_metadata(*spec);
    const ModelInfo info{spec->q_rows(), spec->kv_rows()};
    auto l = TrainerLayout::parse(layout).value();
    auto th = make_holdings(meta, l, info);
    ASSERT_TRUE(th.ok()) << th.status().to_string();
    uint64_t made = 0;
    for (const auto& h : th->ranks) made += h.boxes.size();
    auto counted = count_held_boxes(meta, l, info);
    ASSERT_TRUE(counted.ok()) << counted.status().to_string();
    EXPECT_EQ(*counted, made);
  }
  // The same errors, and a million ranks counted without a rank made.
  const auto meta = testing::make_metadata(moe);
  auto bad = count_held_boxes(meta, TrainerLayout::parse("tp=2,dp=3,ep=3").value(), {moe.q_rows(), moe.kv_rows()});
  EXPECT_EQ(bad.status().to_string(),
            make_holdings(meta, TrainerLayout::parse("tp=2,dp=3,ep=3").value(), {moe.q_rows(), moe.kv_rows()})
                .status()
                .to_string());
  EXPECT_FALSE(bad.ok());
  auto million = count_held_boxes(meta, TrainerLayout::parse("tp=1,dp=1048576").value(), {moe.q_rows(), moe.kv_rows()});
  ASSERT_TRUE(million.ok()) << million.status().to_string();
  auto one = count_held_boxes(meta, TrainerLayout::parse("tp=1").value(), {moe.q_rows(), moe.kv_rows()});
  EXPECT_EQ(*million, *one * 1048576u);
}

TEST(Holdings, FsdpUnevenScalarsAndEmptyRanks) {
  std::vector<TensorDecl> meta = {{"model.layers.0.w", DType::kBF16, {5, 3}},
                                  {"model.layers.0.b", DType::kF32, {2}},
                                  {"model.layers.0.s", DType::kF32, {}}};
  auto th = make_holdings(meta, TrainerLayout::parse("fsdp=4").value());
  ASSERT_TRUE(th.ok());
  ASSERT_EQ(th->ranks.size(), 4u);
  // w: rows 2,2,1,0; b: 1,1,0,0; s: rank 0.
  EXPECT_EQ(th->ranks[0].boxes.size(), 3u);
  EXPECT_EQ(th->ranks[1].boxes.size(), 2u);
  EXPECT_EQ(th->ranks[2].boxes.size(), 1u);
  EXPECT_EQ(th->ranks[3].boxes.size(), 0u);
  EXPECT_EQ(th->ranks[2].boxes[0].box, (Box{{4, 0}, {1, 3}}));
  for (const auto& d : meta) {
    for (int x : coverage(th->ranks, d, {0, 1, 2, 3})) EXPECT_EQ(x, 1) << d.name;
  }
}

TEST(SyntheticSource, MaterializesBoxesOfTheFullTensor) {
  std::vector<TensorDecl> meta = {{"model.embed_tokens.weight", DType::kBF16, {6, 4}},
                                  {"model.layers.0.w", DType::kF32, {5, 3}},
                                  {"model.norm.weight", DType::kF16, {4}}};
  auto th = make_holdings(meta, TrainerLayout::parse("fsdp=3").value());
  ASSERT_TRUE(th.ok());
  auto shared = std::make_shared<const std::vector<Holdings>>(th->ranks);
  for (uint64_t v : {0, 3}) {
    for (int r = 0; r < 3; ++r) {
      SyntheticSource s(meta, shared, r, 9);
      s.set_version(v);
      for (int g = 0; g < 3; ++g) {
        auto boxes = s.materialize(g);
        ASSERT_TRUE(boxes.ok());
        for (const auto& lb : *boxes) {
          const HeldBox& hb = th->ranks[static_cast<size_t>(r)].boxes[lb.box];
          const TensorDecl& d = th->ranks[static_cast<size_t>(r)].tensors[hb.tensor];
          Tensor full = synthetic_tensor(9, v, d);
          Tensor view = full;
          for (size_t k = 0; k < hb.box.start.size(); ++k) view = view.narrow(static_cast<int64_t>(k), hb.box.start[k], hb.box.size[k]);
          EXPECT_TRUE(view.equal(lb.data).value()) << d.name;
        }
      }
    }
  }
  // Versions differ.
  EXPECT_NE(synthetic_value(1, 0, "x", 5, DType::kF32), synthetic_value(1, 1, "x", 5, DType::kF32));
  SyntheticSource s(meta, shared, 0, 9);
  EXPECT_FALSE(s.materialize(7).ok());
  EXPECT_FALSE(s.holdings(3).ok());
}

TEST(ModelInfo, FromConfig) {
  auto j = nlohmann::json::parse(R"({"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 3072})");
  auto i = model_info_from_config(j);
  EXPECT_EQ(i.q_rows, 3072);
  EXPECT_EQ(i.kv_rows, 768);
  j = nlohmann::json::parse(R"({"text_config": {"num_attention_heads": 4, "head_dim": 8, "hidden_size": 16}})");
  i = model_info_from_config(j);
  EXPECT_EQ(i.q_rows, 32);
  EXPECT_EQ(i.kv_rows, 32);
}

// heads * head_dim overflowed int64 (UBSan, fuzz_config_layout); rows that do not fit, and
// non-positive fields, now read as missing (zeros).
TEST(ModelInfo, HugeOrNegativeFieldsLeaveZeros) {
  auto i = model_info_from_config(
      nlohmann::json::parse(R"({"num_attention_heads": 4611686018427387904, "num_key_value_heads": 2, "head_dim": 4})"));
  EXPECT_EQ(i.q_rows, 0);
  EXPECT_EQ(i.kv_rows, 8);
  i = model_info_from_config(nlohmann::json::parse(R"({"num_attention_heads": -4, "head_dim": 8})"));
  EXPECT_EQ(i.q_rows, 0);
  EXPECT_EQ(i.kv_rows, 0);
}

// The table-driven fill against the element-wise definition (synthetic_value), for every
// dtype and a 0-d tensor. (Boxes of held shards against the full tensor: above.)
TEST(SyntheticSource, FillMatchesElementwiseDefinition) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI8, DType::kI16,
                   DType::kI32, DType::kI64, DType::kU8, DType::kBool}) {
    const TensorDecl d{"layers.0.w", dt, {5, 6, 7}};
    const Tensor full = synthetic_tensor(3, 2, d);
    const std::byte* p = full.data_ptr().value();
    const size_t es = dtype_size(dt);
    std::vector<std::byte> want(es);
    for (int64_t i = 0; i < 5 * 6 * 7; ++i) {
      store_element(want.data(), dt, synthetic_value(3, 2, d.name, i, dt));
      ASSERT_EQ(std::memcmp(p + static_cast<size_t>(i) * es, want.data(), es), 0) << dtype_name(dt) << " index " << i;
    }
  }
  const TensorDecl scalar{"s", DType::kBF16, {}};
  const Tensor t = synthetic_tensor(3, 2, scalar);
  std::vector<std::byte> want(2);
  store_element(want.data(), DType::kBF16, synthetic_value(3, 2, "s", 0, DType::kBF16));
  EXPECT_EQ(std::memcmp(t.data_ptr().value(), want.data(), 2), 0);
}

// The fraction of 2-byte elements that differ between two tensors of the same shape.
double differing_small(const Tensor& a, const Tensor& b) {
  const auto* x = reinterpret_cast<const uint16_t*>(a.data_ptr().value());
  const auto* y = reinterpret_cast<const uint16_t*>(b.data_ptr().value());
  const int64_t n = a.numel();
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) k += x[i] != y[i];
  return static_cast<double>(k) / static_cast<double>(n);
}

// SyntheticChanges: the fraction of elements (scattered) or whole tensors (clustered)
// redrawn between consecutive versions, against the element-wise definition and the
// source's boxes; fraction 1 is exactly the old every-element draw.
TEST(SyntheticSource, ChangedFractionBetweenVersions) {
  const TensorDecl d{"model.layers.0.mlp.w", DType::kBF16, {256, 512}};
  const int64_t n = 256 * 512;
  auto differing = [&](const Tensor& a, const Tensor& b) {
    const auto* x = reinterpret_cast<const uint16_t*>(a.data_ptr().value());
    const auto* y = reinterpret_cast<const uint16_t*>(b.data_ptr().value());
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) k += x[i] != y[i];
    return static_cast<double>(k) / static_cast<double>(n);
  };
  for (double f : {0.0005, 0.01, 0.1, 0.5}) {
    const SyntheticChanges ch{f, false};
    for (uint64_t v : {1u, 7u, 20u}) {
      const double seen = differing(synthetic_tensor(5, v - 1, d, ch), synthetic_tensor(5, v, d, ch));
      // Redrawn elements keep their value 1 time in 128; the count is binomial-like.
      const double want = f * 127.0 / 128.0;
      EXPECT_NEAR(seen, want, 4 * std::sqrt(want / static_cast<double>(n)) + 1e-4) << "f=" << f << " v=" << v;
    }
  }
  // Fraction 1 is the every-element draw; fraction 0 never changes.
  EXPECT_TRUE(synthetic_tensor(5, 3, d, {1.0, false}).equal(synthetic_tensor(5, 3, d)).value());
  EXPECT_TRUE(synthetic_tensor(5, 9, d, {0.0, false}).equal(synthetic_tensor(5, 0, d, {0.0, false})).value());
  // Clustered: whole tensors, about f of them per version.
  int changed = 0, total = 0;
  for (int t = 0; t < 400; ++t) {
    const TensorDecl e{"model.layers.0.mlp.experts." + std::to_string(t) + ".w", DType::kBF16, {4, 8}};
    const double seen = differing_small(synthetic_tensor(5, 4, e, {0.25, true}), synthetic_tensor(5, 5, e, {0.25, true}));
    EXPECT_TRUE(seen == 0.0 || seen > 0.5) << e.name << " changed in part: " << seen;
    changed += seen > 0.5;
    ++total;
  }
  EXPECT_NEAR(static_cast<double>(changed) / total, 0.25, 0.07);
  // The element-wise definition and the source's boxes agree with the fill.
  for (const SyntheticChanges ch : {SyntheticChanges{0.3, false}, SyntheticChanges{0.3, true}}) {
    const TensorDecl small{"model.layers.1.w", DType::kF32, {6, 10}};
    const Tensor full = synthetic_tensor(2, 11, small, ch);
    std::vector<std::byte> want(4);
    for (int64_t i = 0; i < 60; ++i) {
      store_element(want.data(), DType::kF32, synthetic_value(2, 11, small.name, i, DType::kF32, ch));
      ASSERT_EQ(std::memcmp(full.data_ptr().value() + i * 4, want.data(), 4), 0) << i;
    }
    auto th = make_holdings({small}, TrainerLayout::parse("fsdp=2").value());
    ASSERT_TRUE(th.ok());
    SyntheticSource s({small}, std::make_shared<const std::vector<Holdings>>(th->ranks), 1, 2);
    s.set_version(11);
    s.set_changes(ch);
    auto boxes = s.materialize(Groups(std::vector<TensorDecl>{small}).of_name(small.name));
    ASSERT_TRUE(boxes.ok());
    ASSERT_EQ(boxes->size(), 1u);
    const HeldBox& hb = th->ranks[1].boxes[(*boxes)[0].box];
    Tensor view = full;
    for (size_t k = 0; k < hb.box.start.size(); ++k) view = view.narrow(static_cast<int64_t>(k), hb.box.start[k], hb.box.size[k]);
    EXPECT_TRUE(view.equal((*boxes)[0].data).value());
  }
  EXPECT_FALSE(check_synthetic_changes({1.5, false}).ok());
  EXPECT_FALSE(check_synthetic_changes({-0.1, false}).ok());
  EXPECT_FALSE(check_synthetic_changes({std::nan(""), false}).ok());
  EXPECT_TRUE(check_synthetic_changes({0.02, true}).ok());
}

}  // namespace
}  // namespace ferry
