// MoE / MLA architectures (Qwen3-MoE, Mixtral, DeepSeek-V3 / Kimi-K2, Llama-4): plan
// replay equals direct load over many layouts, and expectation tests written without the
// loader for the tricky cases (EP expert ownership, Llama-4's transposed gate/up split, FP8
// scale blocks shared by two ranks, MLA's fused_qkv_a_proj rows).
#include <chrono>
#include <cstdio>
#include <set>

#include <time.h>

#include "models/test_util.h"
#include "test_paths.h"

namespace ferry {
namespace {

using testing::config_from;
using testing::expect_replay_equals_direct;
using testing::loader_for;
using testing::values;

// --- small configs -------------------------------------------------------------------
// hidden 128 (one FP8 block), 8 q heads / 2 kv heads (tp 4 and 8 replicate kv), 8 experts
// (ep up to 8), expert intermediate 192 (tp 2: 96 rows per rank, so a 128-block straddles
// two ranks), vocab 1000 (zero padding rows).

const char* kFp8Quant =
    R"(, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]})";

std::string qwen3_moe(const std::string& extra = "", int layers = 2) {
  return R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128, "num_hidden_layers": )" +
         std::to_string(layers) +
         R"(, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 256,
         "moe_intermediate_size": 192, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "vocab_size": 1000, "tie_word_embeddings": false, "torch_dtype": "bfloat16")" +
         extra + "}";
}

std::string mixtral(const std::string& extra = "") {
  return R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 192, "num_local_experts": 8,
         "num_experts_per_tok": 2, "vocab_size": 1000, "torch_dtype": "bfloat16")" +
         extra + "}";
}

std::string deepseek(const std::string& q_lora = "192", const std::string& extra = "") {
  return R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 3,
         "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
         "q_lora_rank": )" +
         q_lora + R"(, "kv_lora_rank": 160, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "intermediate_size": 256, "moe_intermediate_size": 192, "n_routed_experts": 8, "n_shared_experts": 1,
         "num_experts_per_tok": 2, "topk_method": "noaux_tc", "vocab_size": 1000, "torch_dtype": "bfloat16")" +
         extra + "}";
}

std::string llama4(const std::string& extra = "") {
  return R"({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "torch_dtype": "bfloat16",
         "text_config": {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 192, "intermediate_size_mlp": 256,
         "num_local_experts": 8, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "vocab_size": 1000,
         "use_qk_norm": true)" +
         extra + "}}";
}

struct Case {
  std::string name;
  std::string config;
};

std::vector<Case> cases() {
  return {{"qwen3_moe", qwen3_moe()},
          {"qwen3_moe_fp8", qwen3_moe(kFp8Quant)},
          {"qwen3_moe_sparse_step", qwen3_moe(R"(, "decoder_sparse_step": 2, "mlp_only_layers": [2])", 4)},
          {"mixtral", mixtral()},
          {"deepseek_v3", deepseek()},
          {"deepseek_v3_fp8", deepseek("192", kFp8Quant)},
          {"deepseek_v3_no_q_lora_fp8", deepseek("null", kFp8Quant)},
          {"llama4", llama4()},
          {"llama4_moe_layers_tied", llama4(R"(, "moe_layers": [0, 2], "tie_word_embeddings": true)")}};
}

class MoeLayouts : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(MoeLayouts, ReplayEqualsDirect) {
  const auto& [index, layout] = GetParam();
  const Case c = cases()[static_cast<size_t>(index)];
  SCOPED_TRACE(c.name + " layout " + layout);
  const ModelConfig cfg = config_from(c.config, c.name + ".json");
  auto loader = loader_for(cfg, layout);
  ASSERT_NE(loader, nullptr);
  const auto hashes = expect_replay_equals_direct(*loader);
  // The same rank of different replicas has the same plan.
  const InferenceLayout& l = loader->layout();
  ASSERT_EQ(hashes.size(), static_cast<size_t>(l.world_size()));
  for (int r = 0; r < l.world_size(); ++r) {
    EXPECT_EQ(hashes[static_cast<size_t>(r)], hashes[static_cast<size_t>(r % l.engine_size())]) << "rank " << r;
  }
  // Every engine rank differs once experts are split or spread (dp ranks hold different
  // experts or expert shards).
  std::set<uint64_t> distinct(hashes.begin(), hashes.end());
  EXPECT_EQ(distinct.size(), static_cast<size_t>(l.engine_size()));
}

INSTANTIATE_TEST_SUITE_P(Archs, MoeLayouts,
                         ::testing::Combine(::testing::Range(0, 9),
                                            ::testing::Values("tp=1", "tp=2", "tp=4", "tp=8", "tp=2,dp=2",
                                                              "tp=4,ep=4", "tp=2,dp=2,ep=4", "tp=1,dp=8,ep=8",
                                                              "tp=2,replicas=2", "tp=2,dp=2,ep=4,replicas=2")),
                         [](const auto& info) {
                           std::string s = cases()[static_cast<size_t>(std::get<0>(info.param))].name + "_" +
                                           std::get<1>(info.param);
                           for (char& ch : s) {
                             if (ch == '=' || ch == ',') ch = '_';
                           }
                           return s;
                         });

// Quantize::kFp8 on a bf16 MoE checkpoint: the 3-D expert params are quantised per expert.
TEST(MoeQuantize, Fp8HookOnExperts) {
  LoaderOptions o;
  o.quantize = Quantize::kFp8;
  for (const std::string layout : {"tp=2", "tp=2,dp=2,ep=4"}) {
    SCOPED_TRACE(layout);
    auto loader = loader_for(config_from(qwen3_moe()), layout, o);
    ASSERT_NE(loader, nullptr);
    expect_replay_equals_direct(*loader);
    auto rl = loader->rank(0);
    ASSERT_TRUE(rl.ok());
    bool found = false;
    for (const auto& d : (*rl)->final_params()) {
      if (d.name == "model.layers.0.mlp.experts.w13_weight_scale_inv") {
        found = true;
        const int64_t e_local = layout == "tp=2" ? 8 : 2, i_local = layout == "tp=2" ? 96 : 192;
        EXPECT_EQ(d.shape, (Shape{e_local, (2 * i_local + 127) / 128, 1}));
      }
    }
    EXPECT_TRUE(found);
  }
  // MLA and Llama-4's fused experts too.
  for (const std::string& c : {deepseek(), llama4()}) {
    auto loader = loader_for(config_from(c), "tp=2,dp=2,ep=4", o);
    ASSERT_NE(loader, nullptr);
    expect_replay_equals_direct(*loader);
  }
}

// --- expectation tests (written without the loader) --------------------------------

TensorMap direct(const ModelLoader& l, int r, const TensorMap& ckpt) {
  auto m = load_rank_direct(l, r, ckpt);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? *m : TensorMap();
}

std::vector<double> rows(const Tensor& t, int64_t start, int64_t n) { return values(t.narrow(0, start, n).contiguous()); }
std::vector<double> cols(const Tensor& t, int64_t start, int64_t n) { return values(t.narrow(1, start, n).contiguous()); }

// EP: tp=2,dp=2,ep=4 on 8 experts. Engine rank k = dp*2 + tp owns experts 2k and 2k+1,
// whole: w13[j] = [gate(2k+j) ; up(2k+j)], w2[j] = down(2k+j). Replica 1 repeats.
TEST(MoeExpect, ExpertsOfEpRank) {
  for (const std::string arch : {"qwen3", "mixtral"}) {
    SCOPED_TRACE(arch);
    const bool q = arch == "qwen3";
    auto loader = loader_for(config_from(q ? qwen3_moe() : mixtral()), "tp=2,dp=2,ep=4,replicas=2");
    ASSERT_NE(loader, nullptr);
    auto ckpt = random_checkpoint(loader->checkpoint(), 11);
    ASSERT_TRUE(ckpt.ok());
    const std::string mp = q ? "model.layers.1.mlp." : "model.layers.1.block_sparse_moe.";
    const std::string g = q ? "gate_proj" : "w1", u = q ? "up_proj" : "w3", dn = q ? "down_proj" : "w2";
    for (int r = 0; r < 8; ++r) {
      const int k = r % 4;
      TensorMap p = direct(*loader, r, ckpt.value());
      const Tensor w13 = p.at(mp + "experts.w13_weight"), w2 = p.at(mp + "experts.w2_weight");
      ASSERT_EQ(w13.shape(), (Shape{2, 384, 128}));
      ASSERT_EQ(w2.shape(), (Shape{2, 128, 192}));
      for (int j = 0; j < 2; ++j) {
        const std::string e = mp + "experts." + std::to_string(2 * k + j) + ".";
        EXPECT_EQ(rows(w13.select(0, j), 0, 192), values(ckpt->at(e + g + ".weight"))) << "rank " << r << " slot " << j;
        EXPECT_EQ(rows(w13.select(0, j), 192, 192), values(ckpt->at(e + u + ".weight"))) << "rank " << r;
        EXPECT_EQ(values(w2.select(0, j)), values(ckpt->at(e + dn + ".weight"))) << "rank " << r;
      }
      // The router is replicated.
      EXPECT_EQ(values(p.at(mp + "gate.weight")), values(ckpt->at(mp + "gate.weight")));
    }
  }
}

// No EP, tp=2,dp=2: every expert is split over all 4 engine ranks: rank k holds gate/up rows
// [48k, 48k+48) and down columns [48k, 48k+48) of every expert.
TEST(MoeExpect, ExpertsTpSplitAcrossDpWithoutEp) {
  auto loader = loader_for(config_from(qwen3_moe()), "tp=2,dp=2");
  ASSERT_NE(loader, nullptr);
  auto ckpt = random_checkpoint(loader->checkpoint(), 12);
  ASSERT_TRUE(ckpt.ok());
  for (int k = 0; k < 4; ++k) {
    TensorMap p = direct(*loader, k, ckpt.value());
    const Tensor w13 = p.at("model.layers.0.mlp.experts.w13_weight"), w2 = p.at("model.layers.0.mlp.experts.w2_weight");
    ASSERT_EQ(w13.shape(), (Shape{8, 96, 128}));
    for (int e = 0; e < 8; ++e) {
      const std::string s = "model.layers.0.mlp.experts." + std::to_string(e) + ".";
      EXPECT_EQ(rows(w13.select(0, e), 0, 48), rows(ckpt->at(s + "gate_proj.weight"), 48 * k, 48));
      EXPECT_EQ(rows(w13.select(0, e), 48, 48), rows(ckpt->at(s + "up_proj.weight"), 48 * k, 48));
      EXPECT_EQ(values(w2.select(0, e)), cols(ckpt->at(s + "down_proj.weight"), 48 * k, 48));
    }
  }
}

// Llama-4: gate_up_proj [E, H, 2I] is transposed; w13[j][i][h] = gate_up[e][h][off + i] for
// the gate rows and gate_up[e][h][I + off + i] for the up rows; w2[j][h][i] =
// down_proj[e][off + i][h]. Checked element by element for tp=2 (no EP: off = 96 * rank)
// and EP tp=2,dp=2,ep=4 (experts 2k, 2k+1 whole).
TEST(MoeExpect, Llama4TransposedGateUpSplit) {
  for (const std::string layout : {"tp=2", "tp=2,dp=2,ep=4"}) {
    SCOPED_TRACE(layout);
    const bool ep = layout != "tp=2";
    auto loader = loader_for(config_from(llama4()), layout);
    ASSERT_NE(loader, nullptr);
    auto ckpt = random_checkpoint(loader->checkpoint(), 13);
    ASSERT_TRUE(ckpt.ok());
    const std::string f = "language_model.model.layers.1.feed_forward.";
    const std::vector<double> gu = values(ckpt->at(f + "experts.gate_up_proj"));  // [8, 128, 384]
    const std::vector<double> dn = values(ckpt->at(f + "experts.down_proj"));     // [8, 192, 128]
    const int64_t H = 128, I = 192;
    for (int r = 0; r < loader->layout().world_size(); ++r) {
      TensorMap p = direct(*loader, r, ckpt.value());
      const std::vector<double> w13 = values(p.at(f + "experts.w13_weight"));
      const std::vector<double> w2 = values(p.at(f + "experts.w2_weight"));
      const int64_t el = ep ? 2 : 8, il = ep ? I : I / 2, e0 = ep ? 2 * r : 0, off = ep ? 0 : il * r;
      ASSERT_EQ(w13.size(), static_cast<size_t>(el * 2 * il * H));
      ASSERT_EQ(w2.size(), static_cast<size_t>(el * H * il));
      int64_t bad = 0;
      for (int64_t j = 0; j < el; ++j) {
        const int64_t e = e0 + j;
        for (int64_t i = 0; i < il; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            const double gate = gu[static_cast<size_t>((e * H + h) * 2 * I + off + i)];
            const double up = gu[static_cast<size_t>((e * H + h) * 2 * I + I + off + i)];
            bad += w13[static_cast<size_t>((j * 2 * il + i) * H + h)] != gate;
            bad += w13[static_cast<size_t>((j * 2 * il + il + i) * H + h)] != up;
            bad += w2[static_cast<size_t>((j * H + h) * il + i)] != dn[static_cast<size_t>((e * I + off + i) * H + h)];
          }
        }
      }
      EXPECT_EQ(bad, 0) << "rank " << r;
    }
    // Layer 0 is dense (interleave step 2): feed_forward.gate_up_proj from gate/up.
    TensorMap p0 = direct(*loader, 0, ckpt.value());
    EXPECT_EQ(p0.count("language_model.model.layers.0.feed_forward.gate_up_proj.weight"), 1u);
    EXPECT_EQ(p0.count("language_model.model.layers.0.feed_forward.experts.w13_weight"), 0u);
    EXPECT_EQ(p0.count("language_model.lm_head.weight"), 1u);
  }
}

// FP8 checkpoint, tp=2 without EP: each rank holds 96 of an expert's 192 intermediate rows.
// Rank 0's rows [0, 96) lie in block 0; rank 1's rows [96, 192) straddle blocks 0 and 1, so
// both ranks hold block 0's scale. w13_weight_scale_inv[e] rows: [gate blocks | up blocks];
// w2_weight_scale_inv[e] columns: the down blocks of the rank's columns.
TEST(MoeExpect, Fp8ScaleBlockSharedByTwoRanks) {
  auto loader = loader_for(config_from(qwen3_moe(kFp8Quant)), "tp=2");
  ASSERT_NE(loader, nullptr);
  auto ckpt = random_checkpoint(loader->checkpoint(), 14);
  ASSERT_TRUE(ckpt.ok());
  const std::string e3 = "model.layers.1.mlp.experts.3.";
  const Tensor gs = ckpt->at(e3 + "gate_proj.weight_scale_inv");  // [2, 1]
  const Tensor us = ckpt->at(e3 + "up_proj.weight_scale_inv");
  const Tensor ds = ckpt->at(e3 + "down_proj.weight_scale_inv");  // [1, 2]
  ASSERT_EQ(gs.shape(), (Shape{2, 1}));
  ASSERT_EQ(ckpt->at(e3 + "gate_proj.weight").dtype(), DType::kF8E4M3);
  TensorMap p0 = direct(*loader, 0, ckpt.value()), p1 = direct(*loader, 1, ckpt.value());
  const Tensor s0 = p0.at("model.layers.1.mlp.experts.w13_weight_scale_inv").select(0, 3);
  const Tensor s1 = p1.at("model.layers.1.mlp.experts.w13_weight_scale_inv").select(0, 3);
  ASSERT_EQ(s0.shape(), (Shape{2, 1}));  // gate block 0, up block 0
  ASSERT_EQ(s1.shape(), (Shape{4, 1}));  // gate blocks 0-1, up blocks 0-1
  EXPECT_EQ(values(s0), (std::vector<double>{values(gs)[0], values(us)[0]}));
  EXPECT_EQ(values(s1), (std::vector<double>{values(gs)[0], values(gs)[1], values(us)[0], values(us)[1]}));
  const Tensor d0 = p0.at("model.layers.1.mlp.experts.w2_weight_scale_inv").select(0, 3);
  const Tensor d1 = p1.at("model.layers.1.mlp.experts.w2_weight_scale_inv").select(0, 3);
  EXPECT_EQ(values(d0), (std::vector<double>{values(ds)[0]}));
  EXPECT_EQ(values(d1), (std::vector<double>{values(ds)[0], values(ds)[1]}));
  // Weights stay e4m3, bytes as in the checkpoint: rank 1 gate rows [96, 192).
  const Tensor w1 = p1.at("model.layers.1.mlp.experts.w13_weight");
  EXPECT_EQ(w1.dtype(), DType::kF8E4M3);
  EXPECT_EQ(rows(w1.select(0, 3), 0, 96), rows(ckpt->at(e3 + "gate_proj.weight"), 96, 96));
  // The router (modules_to_not_convert) is bf16 without a scale; attention is fp8: the
  // fused qkv scale of rank 1 (q rows [64, 128), k/v rows [16, 32)) is [q block 0 | k
  // block 0 | v block 0].
  EXPECT_EQ(ckpt->at("model.layers.0.mlp.gate.weight").dtype(), DType::kBF16);
  EXPECT_EQ(ckpt->count("model.layers.0.mlp.gate.weight_scale_inv"), 0u);
  const std::string a = "model.layers.0.self_attn.";
  const Tensor qs = p1.at(a + "qkv_proj.weight_scale_inv");
  ASSERT_EQ(qs.shape(), (Shape{3, 1}));
  EXPECT_EQ(values(qs), (std::vector<double>{values(ckpt->at(a + "q_proj.weight_scale_inv"))[0],
                                             values(ckpt->at(a + "k_proj.weight_scale_inv"))[0],
                                             values(ckpt->at(a + "v_proj.weight_scale_inv"))[0]}));
}

// MLA: fused_qkv_a_proj rows [q_a_proj (192) | kv_a_proj_with_mqa (160 + 8)] on every rank;
// FP8 scale rows [q_a blocks 0-1 | kv_a blocks 0-1]. q_b / kv_b split by heads, o_proj
// columns by heads; router bias fp32 replicated; shared experts TP-split.
TEST(MoeExpect, MlaFusedQkvARows) {
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    auto loader = loader_for(config_from(deepseek("192", fp8 ? kFp8Quant : "")), "tp=4,ep=4");
    ASSERT_NE(loader, nullptr);
    auto ckpt = random_checkpoint(loader->checkpoint(), 15);
    ASSERT_TRUE(ckpt.ok());
    const std::string a = "model.layers.1.self_attn.";
    for (int r = 0; r < 4; ++r) {
      TensorMap p = direct(*loader, r, ckpt.value());
      const Tensor f = p.at(a + "fused_qkv_a_proj.weight");
      ASSERT_EQ(f.shape(), (Shape{192 + 168, 128}));
      EXPECT_EQ(rows(f, 0, 192), values(ckpt->at(a + "q_a_proj.weight")));
      EXPECT_EQ(rows(f, 192, 168), values(ckpt->at(a + "kv_a_proj_with_mqa.weight")));
      EXPECT_EQ(f.dtype(), fp8 ? DType::kF8E4M3 : DType::kBF16);
      if (fp8) {
        const Tensor s = p.at(a + "fused_qkv_a_proj.weight_scale_inv");
        ASSERT_EQ(s.shape(), (Shape{4, 1}));
        EXPECT_EQ(rows(s, 0, 2), values(ckpt->at(a + "q_a_proj.weight_scale_inv")));
        EXPECT_EQ(rows(s, 2, 2), values(ckpt->at(a + "kv_a_proj_with_mqa.weight_scale_inv")));
        // q_b rows [48r, 48r + 48) of 192: blocks [48r/128, ceil((48r+48)/128)).
        const Tensor qbs = p.at(a + "q_b_proj.weight_scale_inv");
        const int64_t b0 = 48 * r / 128, b1 = (48 * r + 48 + 127) / 128;
        EXPECT_EQ(values(qbs), rows(ckpt->at(a + "q_b_proj.weight_scale_inv"), b0, b1 - b0)) << "rank " << r;
      }
      // 2 heads per rank: q_b rows [2*24*r, +48), kv_b rows [2*32*r, +64), o_proj cols [32r, +32).
      EXPECT_EQ(values(p.at(a + "q_b_proj.weight")), rows(ckpt->at(a + "q_b_proj.weight"), 48 * r, 48));
      EXPECT_EQ(values(p.at(a + "kv_b_proj.weight")), rows(ckpt->at(a + "kv_b_proj.weight"), 64 * r, 64));
      EXPECT_EQ(values(p.at(a + "o_proj.weight")), cols(ckpt->at(a + "o_proj.weight"), 32 * r, 32));
      const std::string m = "model.layers.1.mlp.";
      EXPECT_EQ(p.at(m + "gate.e_score_correction_bias").dtype(), DType::kF32);
      EXPECT_EQ(values(p.at(m + "gate.e_score_correction_bias")), values(ckpt->at(m + "gate.e_score_correction_bias")));
      // Shared experts: gate_up rows [gate 48r.. | up 48r..] of 192 (TP within the DP rank).
      const Tensor su = p.at(m + "shared_experts.gate_up_proj.weight");
      EXPECT_EQ(rows(su, 0, 48), rows(ckpt->at(m + "shared_experts.gate_proj.weight"), 48 * r, 48));
      EXPECT_EQ(rows(su, 48, 48), rows(ckpt->at(m + "shared_experts.up_proj.weight"), 48 * r, 48));
      // Layer 0 is dense (first_k_dense_replace 1).
      EXPECT_EQ(p.count("model.layers.0.mlp.gate_up_proj.weight"), 1u);
      EXPECT_EQ(p.count("model.layers.0.mlp.experts.w13_weight"), 0u);
    }
  }
}

// A DeepSeek-V3 checkpoint with its MTP layer (num_nextn_predict_layers 1: model.layers.3.*
// after 3 decoder layers), by LoaderOptions::mtp. none: the checkpoint has no MTP tensors
// and one that has them is refused, naming the first; skip: accepted, nothing loaded (the
// params are none's); draft: loaded as vLLM's DeepSeekMTP names them, the decoder layer
// under mtp_block. sharded as the main layers (MLA heads, experts over EP, shared experts
// TP-split), embed_tokens and shared_head.head vocab-parallel, the rest replicated, in a
// layer group of its own. Both load as their plans replay (bf16 and FP8 checkpoints).
TEST(MoeExpect, MtpLayersSkippedOrLoadedAsTheDraft) {
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    const ModelConfig cfg = config_from(deepseek("192", std::string(R"(, "num_nextn_predict_layers": 1)") + (fp8 ? kFp8Quant : "")));
    LoaderOptions skip_o, draft_o;
    skip_o.mtp = MtpLayers::kSkip;
    draft_o.mtp = MtpLayers::kDraft;
    auto none = loader_for(cfg, "tp=4,ep=4");
    auto skip = loader_for(cfg, "tp=4,ep=4", skip_o);
    auto draft = loader_for(cfg, "tp=4,ep=4", draft_o);
    ASSERT_TRUE(none && skip && draft);
    EXPECT_EQ(skip->checkpoint(), draft->checkpoint());
    std::set<std::string> mtp_tensors;
    for (const TensorDecl& d : skip->checkpoint())
      if (d.name.rfind("model.layers.3.", 0) == 0) mtp_tensors.insert(d.name);
    for (const TensorDecl& d : none->checkpoint()) EXPECT_EQ(mtp_tensors.count(d.name), 0u) << d.name;
    EXPECT_EQ(skip->checkpoint().size(), none->checkpoint().size() + mtp_tensors.size());
    for (const char* t : {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
                          "model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight",
                          "model.layers.3.shared_head.norm.weight", "model.layers.3.self_attn.o_proj.weight",
                          "model.layers.3.mlp.experts.7.down_proj.weight"})
      EXPECT_EQ(mtp_tensors.count(t), 1u) << t;
    auto ckpt = random_checkpoint(skip->checkpoint(), 21);
    ASSERT_TRUE(ckpt.ok());
    // none: the checkpoint with its MTP layer is refused, naming an MTP tensor.
    Status refused = check_checkpoint(none->checkpoint(), *ckpt);
    EXPECT_EQ(refused.code(), StatusCode::kNotFound) << refused.to_string();
    EXPECT_NE(refused.message().find("unknown checkpoint tensor 'model.layers.3."), std::string::npos) << refused.to_string();
    EXPECT_TRUE(check_checkpoint(skip->checkpoint(), *ckpt).ok());
    expect_replay_equals_direct(*skip);
    expect_replay_equals_direct(*draft);
    for (int r = 0; r < 4; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const TensorMap s = direct(*skip, r, *ckpt);
      const TensorMap d = direct(*draft, r, *ckpt);
      auto skip_rank = skip->rank(r);
      auto none_rank = none->rank(r);
      ASSERT_TRUE(skip_rank.ok() && none_rank.ok());
      EXPECT_EQ((*skip_rank)->param_decls(), (*none_rank)->param_decls());
      for (const auto& [name, t] : s) EXPECT_EQ(name.find("layers.3."), std::string::npos) << name;
      // The draft: the main params as skip's, plus the MTP layer's.
      for (const auto& [name, t] : s) {
        ASSERT_EQ(d.count(name), 1u) << name;
        EXPECT_EQ(values(d.at(name)), values(t)) << name;
      }
      const std::string m = "model.layers.3.", b = m + "mtp_block.";
      for (const char* n : {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"})
        EXPECT_EQ(values(d.at(m + n)), values(ckpt->at(m + n))) << n;
      EXPECT_EQ(d.at(m + "eh_proj.weight").shape(), (Shape{128, 256}));
      // Vocab-parallel: rows [256r, 256r + 256) of the padded 1024, real rows below 1000.
      const int64_t real = std::min<int64_t>(256, 1000 - 256 * r);
      for (const char* n : {"embed_tokens.weight", "shared_head.head.weight"}) {
        ASSERT_EQ(d.at(m + n).shape(), (Shape{256, 128})) << n;
        EXPECT_EQ(rows(d.at(m + n), 0, real), rows(ckpt->at(m + n), 256 * r, real)) << n;
      }
      // The decoder layer under mtp_block., as layer 1: two heads per rank, experts 2r, 2r+1.
      EXPECT_EQ(values(d.at(b + "self_attn.o_proj.weight")), cols(ckpt->at(m + "self_attn.o_proj.weight"), 32 * r, 32));
      EXPECT_EQ(values(d.at(b + "input_layernorm.weight")), values(ckpt->at(m + "input_layernorm.weight")));
      ASSERT_EQ(d.count(b + "mlp.experts.w13_weight"), 1u);
      EXPECT_EQ(d.at(b + "mlp.experts.w13_weight").shape()[0], 2);
      const Tensor su = d.at(b + "mlp.shared_experts.gate_up_proj.weight");
      EXPECT_EQ(rows(su, 0, 48), rows(ckpt->at(m + "mlp.shared_experts.gate_proj.weight"), 48 * r, 48));
      EXPECT_EQ(d.count(b + "self_attn.fused_qkv_a_proj.weight"), 1u);
      if (fp8) {
        EXPECT_EQ(d.at(b + "self_attn.o_proj.weight").dtype(), DType::kF8E4M3);
      }
      EXPECT_EQ(d.at(m + "eh_proj.weight").dtype(), DType::kBF16);
    }
    // Each MTP layer is a layer group of its own, after the decoder layers.
    auto dr = draft->rank(0);
    ASSERT_TRUE(dr.ok());
    for (const ParamInfo& p : (*dr)->params()) {
      if (p.decl.name.rfind("model.layers.3.", 0) == 0) {
        EXPECT_EQ(p.group, 4) << p.decl.name;
      }
    }
  }
  EXPECT_FALSE(parse_mtp_layers("maybe").ok());
  EXPECT_EQ(*parse_mtp_layers("draft"), MtpLayers::kDraft);
  EXPECT_EQ(mtp_layers_name(MtpLayers::kSkip), "skip");
}

// q_lora_rank null: q_proj column-parallel, kv_a_proj_with_mqa replicated on its own.
TEST(MoeExpect, MlaWithoutQLora) {
  auto loader = loader_for(config_from(deepseek("null")), "tp=2");
  ASSERT_NE(loader, nullptr);
  auto ckpt = random_checkpoint(loader->checkpoint(), 16);
  ASSERT_TRUE(ckpt.ok());
  const std::string a = "model.layers.0.self_attn.";
  EXPECT_EQ(ckpt->count(a + "q_a_proj.weight"), 0u);
  TensorMap p = direct(*loader, 1, ckpt.value());
  EXPECT_EQ(values(p.at(a + "q_proj.weight")), rows(ckpt->at(a + "q_proj.weight"), 96, 96));
  EXPECT_EQ(values(p.at(a + "kv_a_proj_with_mqa.weight")), values(ckpt->at(a + "kv_a_proj_with_mqa.weight")));
  EXPECT_EQ(p.count(a + "fused_qkv_a_proj.weight"), 0u);
}

// --- configs, shrink, errors ----------------------------------------------------------

// Every MoE / MLA config (shared ones and the hand-written Mixtrals) takes a range of
// layouts at full size (no data) and shrinks to a small model whose plan replay equals
// its direct load on every rank.
TEST(MoeConfigs, FullSizeLoadersAndShrink) {
  struct C {
    std::string path;
    std::vector<std::string> layouts;
  };
  const std::string d = FERRY_CONFIGS_DIR, t = FERRY_TEST_CONFIGS_DIR;
  const std::vector<C> configs = {
      {d + "/qwen3-30b-a3b.json", {"tp=4,dp=2,ep=8", "tp=2,dp=2"}},
      {d + "/qwen3-235b-a22b.json", {"tp=8"}},
      {d + "/qwen3-235b-a22b-fp8.json", {"tp=8,ep=8"}},
      {d + "/deepseek-v3.json", {"tp=8,dp=4,ep=32"}},
      {d + "/kimi-k2-instruct.json", {"tp=8", "tp=16,dp=2,ep=32"}},
      {d + "/llama-4-scout-17b-16e-instruct.json", {"tp=8", "tp=4,dp=4,ep=16"}},
      {t + "/mixtral-8x7b.json", {"tp=4,dp=2,ep=8"}},
      {t + "/mixtral-8x22b.json", {"tp=8"}},
  };
  for (const C& c : configs) {
    auto cfg = ModelConfig::load(c.path);
    ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
    for (const auto& layout : c.layouts) {
      SCOPED_TRACE(c.path + " " + layout);
      // shrink_config first makes the full-size loader (the original must take the layout).
      auto s = shrink_config(*cfg, testing::layout_from(layout));
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      auto small = make_model_loader(s->config, testing::layout_from(layout));
      ASSERT_TRUE(small.ok()) << small.status().to_string();
      EXPECT_LT((*small)->checkpoint().size(), 1000u);  // small: 2 layers, few experts
      // What `ferry check --shrink` does, here also under the sanitizers.
      expect_replay_equals_direct(**small, 3);
      // Each field is reported once (and there are some: a full-size config shrinks).
      ASSERT_FALSE(s->changes.empty());
      std::set<std::string> fields;
      for (const auto& ch : s->changes) EXPECT_TRUE(fields.insert(ch.field).second) << ch.field;
    }
  }
}

TEST(MoeConfigs, ShrinkKeepsExpertDivisibility) {
  auto cfg = ModelConfig::load(std::string(FERRY_CONFIGS_DIR) + "/kimi-k2-instruct.json");
  ASSERT_TRUE(cfg.ok());
  auto s = shrink_config(*cfg, testing::layout_from("tp=2,dp=4,ep=8"));
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(*s->config.get_int("n_routed_experts"), 16);  // ep * 2
  EXPECT_EQ(*s->config.get_int("num_hidden_layers"), 2);
  EXPECT_EQ(*s->config.get_int("first_k_dense_replace"), 1);  // one dense, one MoE layer
  EXPECT_FALSE(s->config.has("head_dim"));
  auto n = shrink_config(*cfg, testing::layout_from("tp=2,dp=4"));  // no EP: I % 8 == 0
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n->config.get_int("moe_intermediate_size") % 8, 0);
  EXPECT_EQ(*n->config.get_int("n_routed_experts"), 4);
}

TEST(MoeErrors, LayoutsTheModelCannotTake) {
  // 8 experts over ep 6.
  auto l = make_model_loader(config_from(mixtral()), testing::layout_from("tp=2,dp=3,ep=6"));
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().to_string().find("num_local_experts 8 is not divisible by ep 6"), std::string::npos)
      << l.status().to_string();
  // Expert intermediate 192 over 10 ranks (no EP).
  auto q = make_model_loader(config_from(qwen3_moe()), testing::layout_from("tp=2,dp=5"));
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().to_string().find("moe_intermediate_size 192"), std::string::npos) << q.status().to_string();
  // MLA heads by tp.
  auto d = make_model_loader(config_from(deepseek()), testing::layout_from("tp=16"));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().to_string().find("num_attention_heads 8 is not divisible by tp 16"), std::string::npos);
  // Unsupported quantization.
  auto u = make_model_loader(config_from(qwen3_moe(R"(, "quantization_config": {"quant_method": "awq"})")),
                             testing::layout_from("tp=1"));
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.status().to_string().find("quant_method 'awq'"), std::string::npos);
}

// A count in config.json that would make the loader declare billions of tensors
// (num_experts: 1e9 used 5.5-8 GB for 40 s before the OOM killer ended it, issue 30) is
// refused before anything is declared, naming the field and what it would cost. The
// address space is capped while the loaders run (testing::AddressSpaceCap), so a
// regression ends in an allocation failure, not in the machine swapping.
TEST(MoeErrors, ImplausibleExpertCountsAreRefusedAtOnce) {
  const testing::AddressSpaceCap cap(size_t{2} << 30);
  struct Bad {
    std::string config, field;
  };
  const std::vector<Bad> bad = {
      {qwen3_moe(R"(, "num_experts": 1e9)"), "num_experts"},
      {qwen3_moe(std::string(kFp8Quant) + R"(, "num_experts": 200000)"), "num_experts"},  // 2 x 3 x 2e5 x 2 > 2^20
      {mixtral(R"(, "num_local_experts": 1000000000)"), "num_local_experts"},
      {deepseek("192", R"(, "n_routed_experts": 1e9)"), "n_routed_experts"},
      {llama4(R"(, "num_local_experts": 1e9)"), "text_config.num_local_experts"}};
  for (const Bad& b : bad) {
    auto l = make_model_loader(config_from(b.config), testing::layout_from("tp=1"));
    ASSERT_FALSE(l.ok()) << b.field;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << l.status().to_string();
    EXPECT_NE(l.status().message().find("field '" + b.field + "'"), std::string::npos) << l.status().to_string();
    EXPECT_NE(l.status().message().find("is implausible"), std::string::npos) << l.status().to_string();
    EXPECT_NE(l.status().message().find("checkpoint tensors"), std::string::npos) << l.status().to_string();
  }
  // Real counts still load: Kimi-K2's 384 experts x 60 MoE layers with FP8 scales.
  auto k = make_model_loader(*ModelConfig::load(std::string(FERRY_CONFIGS_DIR) + "/kimi-k2-instruct.json"),
                             testing::layout_from("tp=8"));
  EXPECT_TRUE(k.ok()) << k.status().to_string();
}

// --- scale: Kimi-K2 at full size -------------------------------------------------------

// Recording one rank of Kimi-K2 (1.03T parameters, 384 experts x 60 MoE layers, FP8 with
// scales) under tp=1,dp=32,ep=32: loader construction (the whole checkpoint's metadata)
// plus record_plan of rank 5. Prints the time; not a pass/fail assertion.
TEST(MoeScale, KimiK2FullSizeRecordingOneRank) {
  auto cfg = ModelConfig::load(std::string(FERRY_CONFIGS_DIR) + "/kimi-k2-instruct.json");
  ASSERT_TRUE(cfg.ok());
  const auto cpu_ms = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
  };
  const double c0 = cpu_ms();
  const auto t0 = std::chrono::steady_clock::now();
  auto loader = make_model_loader(*cfg, testing::layout_from("tp=1,dp=32,ep=32"));
  ASSERT_TRUE(loader.ok()) << loader.status().to_string();
  const auto t1 = std::chrono::steady_clock::now();
  auto plan = record_plan(**loader, 5);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const auto t2 = std::chrono::steady_clock::now();
  const double c2 = cpu_ms();
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  const PlanStats st = plan->stats();
  auto rl = (*loader)->rank(5);
  ASSERT_TRUE(rl.ok());
  uint64_t bytes = 0;
  for (const auto& d : (*rl)->final_params()) bytes += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  std::printf("kimi-k2 tp=1,dp=32,ep=32 rank 5: checkpoint %zu tensors, rank params %zu (%.2f GiB), plan copies %llu; "
              "loader %.0f ms, record_plan %.0f ms, total %.0f ms wall, %.0f ms thread CPU\n",
              (*loader)->checkpoint().size(), (*rl)->params().size(), static_cast<double>(bytes) / (1ull << 30),
              static_cast<unsigned long long>(st.copies), ms(t0, t1), ms(t1, t2), ms(t0, t2), c2 - c0);
  // Rank 5 owns experts [60, 72) of every MoE layer (layers 1 to 60; layer 0 is dense):
  // a fused w13 of its 12 experts in each, FP8.
  int w13 = 0;
  for (const auto& p : (*rl)->params()) {
    if (!p.decl.name.ends_with(".mlp.experts.w13_weight")) continue;
    ++w13;
    EXPECT_EQ(p.decl.shape, (Shape{12, 4096, 7168})) << p.decl.name;
    EXPECT_EQ(p.decl.dtype, DType::kF8E4M3) << p.decl.name;
  }
  EXPECT_EQ(w13, 60);
  // And the plan writes every element of the rank's params once.
  uint64_t numel = 0;
  for (const auto& p : (*rl)->params()) numel += static_cast<uint64_t>(shape_numel(p.decl.shape));
  EXPECT_EQ(st.elements + st.zero_elements, numel);
}

}  // namespace
}  // namespace ferry
