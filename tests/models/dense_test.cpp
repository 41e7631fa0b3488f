// Dense architectures (Llama, Qwen2, Qwen3, Phi-3): plan replay equals direct load over
// many layouts, and expectation tests written without the loader for the tricky cases.
#include <set>

#include "models/test_util.h"

namespace ferry {
namespace {

using testing::config_from;
using testing::dense_config;
using testing::expect_replay_equals_direct;
using testing::loader_for;
using testing::row_of;
using testing::values;

struct ArchCase {
  std::string arch;
  std::string extra;
};

// Small configs: 4 q heads / 2 kv heads (tp 4 and 8 replicate kv), vocab 1000 (padded
// to 1024: the last rank holds 24 zero rows), tied and untied.
std::vector<ArchCase> dense_archs() {
  return {{"LlamaForCausalLM", ""},
          {"LlamaForCausalLM", ", \"attention_bias\": true, \"mlp_bias\": true"},
          {"Qwen2ForCausalLM", ""},
          {"Qwen3ForCausalLM", ", \"head_dim\": 8"},
          {"Phi3ForCausalLM", ""}};
}

class DenseLayouts : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(DenseLayouts, ReplayEqualsDirect) {
  const auto& [arch_index, layout] = GetParam();
  const ArchCase a = dense_archs()[static_cast<size_t>(arch_index)];
  for (bool tie : {false, true}) {
    SCOPED_TRACE(a.arch + a.extra + " tie=" + std::to_string(tie) + " layout " + layout);
    const ModelConfig cfg = config_from(dense_config(a.arch, 2, 64, 8, 2, 64, 1000, tie, a.extra));
    auto loader = loader_for(cfg, layout);
    ASSERT_NE(loader, nullptr);
    const auto hashes = expect_replay_equals_direct(*loader);
    // Plans of the same rank in different replicas (and DP ranks: dense weights are
    // per-DP copies) hash equal; different TP ranks differ.
    const InferenceLayout& l = loader->layout();
    ASSERT_EQ(hashes.size(), static_cast<size_t>(l.world_size()));
    for (int r = 0; r < l.world_size(); ++r) {
      EXPECT_EQ(hashes[static_cast<size_t>(r)], hashes[static_cast<size_t>(r % l.tp)]) << "rank " << r;
    }
    std::set<uint64_t> distinct(hashes.begin(), hashes.end());
    EXPECT_EQ(distinct.size(), static_cast<size_t>(l.tp));
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, DenseLayouts,
                         ::testing::Combine(::testing::Range(0, 5),
                                            ::testing::Values("tp=1", "tp=2", "tp=4", "tp=8", "tp=2,dp=2",
                                                              "tp=2,replicas=2", "tp=4,dp=2,replicas=2")));

// --- expectation tests (written without the loader) --------------------------------

// Finds a param of rank `r` by name in a direct load.
TensorMap direct(const ModelLoader& l, int r, const TensorMap& ckpt) {
  auto m = load_rank_direct(l, r, ckpt);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? *m : TensorMap();
}

// qkv rows of rank r under kv replication, by hand: nq=8, nkv=2, hd=4, tp=8. Rank r has
// q head r and kv head r / (8 / 2) = r / 4, rows [q | k | v].
TEST(DenseExpect, QkvRowsUnderKvReplication) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=8");
  auto ckpt = random_checkpoint(loader->checkpoint(), 7);
  ASSERT_TRUE(ckpt.ok());
  const Tensor q = ckpt->at("model.layers.0.self_attn.q_proj.weight");
  const Tensor k = ckpt->at("model.layers.0.self_attn.k_proj.weight");
  const Tensor v = ckpt->at("model.layers.0.self_attn.v_proj.weight");
  const int64_t hd = 32 / 8;
  for (int r = 0; r < 8; ++r) {
    const TensorMap p = direct(*loader, r, *ckpt);
    const Tensor qkv = p.at("model.layers.0.self_attn.qkv_proj.weight");
    ASSERT_EQ(qkv.shape(), (Shape{3 * hd, 32}));
    const int64_t kv_head = r / 4;
    for (int64_t i = 0; i < hd; ++i) {
      EXPECT_EQ(row_of(qkv, i), row_of(q, r * hd + i)) << "rank " << r << " q row " << i;
      EXPECT_EQ(row_of(qkv, hd + i), row_of(k, kv_head * hd + i)) << "rank " << r << " k row " << i;
      EXPECT_EQ(row_of(qkv, 2 * hd + i), row_of(v, kv_head * hd + i)) << "rank " << r << " v row " << i;
    }
  }
}

// Without replication (tp=2, nkv=2): rank r has q heads [4r, 4r+4), kv head r; Qwen2's
// biases follow the same rows.
TEST(DenseExpect, QkvRowsAndBiasesSplit) {
  const ModelConfig cfg = config_from(dense_config("Qwen2ForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=2");
  auto ckpt = random_checkpoint(loader->checkpoint(), 8);
  ASSERT_TRUE(ckpt.ok());
  const int64_t hd = 4;
  for (const char* kind : {"weight", "bias"}) {
    const std::string pre = "model.layers.0.self_attn.";
    const Tensor q = ckpt->at(pre + "q_proj." + kind), k = ckpt->at(pre + "k_proj." + kind),
                 v = ckpt->at(pre + "v_proj." + kind);
    for (int r = 0; r < 2; ++r) {
      const TensorMap p = direct(*loader, r, *ckpt);
      const Tensor qkv = p.at(pre + "qkv_proj." + kind);
      ASSERT_EQ(qkv.size(0), (4 + 2) * hd);
      for (int64_t i = 0; i < 4 * hd; ++i) EXPECT_EQ(row_of(qkv, i), row_of(q, r * 4 * hd + i));
      for (int64_t i = 0; i < hd; ++i) {
        EXPECT_EQ(row_of(qkv, 4 * hd + i), row_of(k, r * hd + i));
        EXPECT_EQ(row_of(qkv, 5 * hd + i), row_of(v, r * hd + i));
      }
    }
  }
}

// Phi-3: the rank's shard is sliced out of the fused checkpoint tensors. qkv_proj
// [(nq + 2 nkv) hd, H] rows q, k, v with nq=8, nkv=2, hd=4, tp=4 (kv replicated: rank r
// takes kv head r / 2); gate_up_proj [2I, H] gate rows first, I=64.
TEST(DenseExpect, Phi3FusedSourceSplit) {
  const ModelConfig cfg = config_from(dense_config("Phi3ForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=4");
  auto ckpt = random_checkpoint(loader->checkpoint(), 9);
  ASSERT_TRUE(ckpt.ok());
  const Tensor fused = ckpt->at("model.layers.0.self_attn.qkv_proj.weight");
  ASSERT_EQ(fused.shape(), (Shape{(8 + 4) * 4, 32}));
  const Tensor gate_up = ckpt->at("model.layers.0.mlp.gate_up_proj.weight");
  ASSERT_EQ(gate_up.shape(), (Shape{128, 32}));
  const int64_t hd = 4, q_rows = 8 * hd, kv_rows = 2 * hd;
  for (int r = 0; r < 4; ++r) {
    const TensorMap p = direct(*loader, r, *ckpt);
    const Tensor qkv = p.at("model.layers.0.self_attn.qkv_proj.weight");
    ASSERT_EQ(qkv.shape(), (Shape{(2 + 2) * hd, 32}));
    const int64_t kv_head = r / 2;
    for (int64_t i = 0; i < 2 * hd; ++i) EXPECT_EQ(row_of(qkv, i), row_of(fused, r * 2 * hd + i)) << r;
    for (int64_t i = 0; i < hd; ++i) {
      EXPECT_EQ(row_of(qkv, 2 * hd + i), row_of(fused, q_rows + kv_head * hd + i)) << r;
      EXPECT_EQ(row_of(qkv, 3 * hd + i), row_of(fused, q_rows + kv_rows + kv_head * hd + i)) << r;
    }
    const Tensor gu = p.at("model.layers.0.mlp.gate_up_proj.weight");
    ASSERT_EQ(gu.shape(), (Shape{32, 32}));
    for (int64_t i = 0; i < 16; ++i) {
      EXPECT_EQ(row_of(gu, i), row_of(gate_up, r * 16 + i)) << "gate " << r;
      EXPECT_EQ(row_of(gu, 16 + i), row_of(gate_up, 64 + r * 16 + i)) << "up " << r;
    }
    // down_proj: row-parallel, columns [16r, 16r + 16).
    const Tensor down = p.at("model.layers.0.mlp.down_proj.weight");
    const Tensor src = ckpt->at("model.layers.0.mlp.down_proj.weight");
    EXPECT_EQ(values(down), values(src.narrow(1, r * 16, 16).contiguous()));
  }
}

// Vocab-parallel embedding and lm_head: vocab 1000 padded to 1024, tp=4: 256 rows each;
// rank 3 holds vocab rows 768..999 and 24 zero rows. Tied: lm_head loads from
// embed_tokens (no lm_head.weight in the checkpoint).
TEST(DenseExpect, VocabPaddingAndTiedEmbeddings) {
  for (bool tie : {false, true}) {
    const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 64, 1000, tie));
    auto loader = loader_for(cfg, "tp=4");
    bool has_lm_head = false;
    for (const auto& d : loader->checkpoint()) has_lm_head |= d.name == "lm_head.weight";
    EXPECT_EQ(has_lm_head, !tie);
    auto ckpt = random_checkpoint(loader->checkpoint(), 10);
    ASSERT_TRUE(ckpt.ok());
    const Tensor embed = ckpt->at("model.embed_tokens.weight");
    const Tensor head = tie ? embed : ckpt->at("lm_head.weight");
    for (int r = 0; r < 4; ++r) {
      const TensorMap p = direct(*loader, r, *ckpt);
      for (const auto& [param, src] : {std::pair{"model.embed_tokens.weight", embed}, std::pair{"lm_head.weight", head}}) {
        const Tensor t = p.at(param);
        ASSERT_EQ(t.shape(), (Shape{256, 32}));
        for (int64_t i = 0; i < 256; ++i) {
          const int64_t vocab_row = r * 256 + i;
          if (vocab_row < 1000) {
            ASSERT_EQ(row_of(t, i), row_of(src, vocab_row)) << param << " rank " << r << " row " << i;
          } else {
            ASSERT_EQ(row_of(t, i), std::vector<double>(32, 0.0)) << param << " rank " << r << " padding row " << i;
          }
        }
      }
    }
    // The padding is recorded as explicit zeros, never read from the source.
    auto plan = record_plan(*loader, 3);
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->stats().zero_elements, 2u * 24 * 32);
    auto plan0 = record_plan(*loader, 0);
    ASSERT_TRUE(plan0.ok());
    EXPECT_EQ(plan0->stats().zero_elements, 0u);
  }
}

// Qwen3's q_norm / k_norm are replicated on every rank.
TEST(DenseExpect, Qwen3QkNormReplicated) {
  const ModelConfig cfg =
      config_from(dense_config("Qwen3ForCausalLM", 1, 32, 8, 2, 64, 1000, true, ", \"head_dim\": 8"));
  auto loader = loader_for(cfg, "tp=8");
  auto ckpt = random_checkpoint(loader->checkpoint(), 11);
  ASSERT_TRUE(ckpt.ok());
  for (int r : {0, 5}) {
    const TensorMap p = direct(*loader, r, *ckpt);
    for (const char* n : {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}) {
      ASSERT_EQ(p.at(n).shape(), (Shape{8}));
      EXPECT_EQ(values(p.at(n)), values(ckpt->at(n)));
    }
    // head_dim 8 is independent of hidden / heads (= 4).
    EXPECT_EQ(p.at("model.layers.0.self_attn.qkv_proj.weight").shape(), (Shape{(1 + 2) * 8, 32}));
    EXPECT_EQ(p.at("model.layers.0.self_attn.o_proj.weight").shape(), (Shape{32, 8}));
  }
}

// vLLM's param names for a Llama rank.
TEST(DenseExpect, ParamNamesAndShapes) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=2");
  auto params = loader->params(1);
  ASSERT_TRUE(params.ok());
  std::map<std::string, Shape> got;
  for (const auto& d : *params) got[d.name] = d.shape;
  const std::map<std::string, Shape> want = {
      {"model.embed_tokens.weight", {512, 32}},
      {"model.layers.0.input_layernorm.weight", {32}},
      {"model.layers.0.post_attention_layernorm.weight", {32}},
      {"model.layers.0.self_attn.qkv_proj.weight", {(4 + 2) * 4, 32}},
      {"model.layers.0.self_attn.o_proj.weight", {32, 16}},
      {"model.layers.0.mlp.gate_up_proj.weight", {64, 32}},
      {"model.layers.0.mlp.down_proj.weight", {32, 32}},
      {"model.norm.weight", {32}},
      {"lm_head.weight", {512, 32}},
  };
  EXPECT_EQ(got, want);
}

// --- errors --------------------------------------------------------------------------

TEST(DenseErrors, UnknownSourceName) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=2");
  TensorMap params;
  const auto decls = *loader->params(0);
  for (const auto& d : decls) params[d.name] = Tensor::empty(d.shape, d.dtype, d.name);
  Status st = loader->load(0, "model.layers.0.self_attn.qkv.weight", Tensor::empty({4, 4}, DType::kBF16), params);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
  EXPECT_NE(st.message().find("model.layers.0.self_attn.qkv.weight"), std::string::npos);
  // In recorded metadata (what a trainer exposes) too.
  std::vector<TensorDecl> meta = loader->checkpoint();
  meta.push_back(TensorDecl{"model.layers.9.mlp.up_proj.weight", DType::kBF16, {64, 32}});
  auto plan = record_plan(*loader, 0, meta);
  EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
  EXPECT_NE(plan.status().message().find("model.layers.9.mlp.up_proj.weight"), std::string::npos);
}

TEST(DenseErrors, MissingSourceIsACoverageError) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=2");
  std::vector<TensorDecl> meta;
  for (const auto& d : loader->checkpoint()) {
    if (d.name != "model.layers.0.self_attn.k_proj.weight") meta.push_back(d);
  }
  auto plan = record_plan(*loader, 0, meta);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("'model.layers.0.self_attn.qkv_proj.weight'"), std::string::npos)
      << plan.status().to_string();
  EXPECT_NE(plan.status().message().find("written by no copy"), std::string::npos) << plan.status().to_string();
  // A param nothing writes at all.
  meta = loader->checkpoint();
  meta.erase(std::remove_if(meta.begin(), meta.end(), [](const TensorDecl& d) { return d.name == "model.norm.weight"; }),
             meta.end());
  plan = record_plan(*loader, 0, meta);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("'model.norm.weight'"), std::string::npos) << plan.status().to_string();
}

TEST(DenseErrors, SourceShapeDisagreement) {
  const ModelConfig cfg = config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 64, 1000, false));
  auto loader = loader_for(cfg, "tp=2");
  std::vector<TensorDecl> meta = loader->checkpoint();
  for (auto& d : meta) {
    if (d.name == "model.norm.weight") d.shape = {31};
  }
  auto plan = record_plan(*loader, 0, meta);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("model.norm.weight"), std::string::npos);
}

TEST(DenseErrors, LayoutTheModelCannotTake) {
  // 8 heads over tp=3; kv 2 vs tp 4 is fine (replication), kv 3 vs tp 2 is not.
  auto a = make_model_loader(config_from(dense_config("LlamaForCausalLM", 1, 48, 6, 3, 64, 1000, false)),
                             testing::layout_from("tp=4"));
  EXPECT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("num_attention_heads 6"), std::string::npos) << a.status().to_string();
  auto b = make_model_loader(config_from(dense_config("LlamaForCausalLM", 1, 48, 6, 3, 64, 1000, false)),
                             testing::layout_from("tp=2"));
  EXPECT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("num_key_value_heads 3"), std::string::npos) << b.status().to_string();
  auto c = make_model_loader(config_from(dense_config("LlamaForCausalLM", 1, 32, 8, 2, 66, 1000, false)),
                             testing::layout_from("tp=4"));
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("intermediate_size 66"), std::string::npos) << c.status().to_string();
}

}  // namespace
}  // namespace ferry
