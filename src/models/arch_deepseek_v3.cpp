// DeepseekV3ForCausalLM (vLLM: model_executor/models/deepseek_v2.py): DeepSeek-V3 and
// Kimi-K2.
//
// Attention is MLA. Checkpoint (per layer, under model.layers.i.self_attn.):
//   q_a_proj [q_lora, H], q_a_layernorm [q_lora], q_b_proj [heads*(nope+rope), q_lora]
//     (or, when q_lora_rank is null, q_proj [heads*(nope+rope), H]);
//   kv_a_proj_with_mqa [kv_lora+rope, H], kv_a_layernorm [kv_lora],
//   kv_b_proj [heads*(nope+v), kv_lora], o_proj [H, heads*v].
// Params (vLLM): fused_qkv_a_proj [q_lora + kv_lora + rope, H] replicated, rows
// [q_a_proj | kv_a_proj_with_mqa] (with q_lora_rank null: q_proj column-parallel and
// kv_a_proj_with_mqa replicated); the layernorms replicated; q_b_proj and kv_b_proj
// column-parallel (whole heads per rank); o_proj row-parallel.
// MLP: layers below first_k_dense_replace (and those with i % moe_layer_freq != 0) are
// dense (mlp.{gate,up,down}_proj, intermediate_size, TP-split); the others are MoE:
// router mlp.gate.weight [E, H] (bf16) and, with topk_method noaux_tc,
// mlp.gate.e_score_correction_bias [E] (fp32), both replicated; routed experts
// mlp.experts.{e}.* fused per rank (moe.h); shared experts mlp.shared_experts.* (one MLP of
// moe_intermediate_size * n_shared_experts) TP-split within each DP rank.
// FP8 checkpoints (quantization_config, 128x128 blocks): every linear except the router
// and lm_head is e4m3 with a weight_scale_inv sibling; scales follow their weights at block
// granularity (moe.h).
// MTP layers (num_nextn_predict_layers, model.layers.{L..}): by LoaderOptions::mtp. none:
// the checkpoint has none; skip: declared, nothing loaded (vLLM's DeepseekV3ForCausalLM);
// draft: loaded as vLLM's DeepSeekMTP names them: the decoder layer (MLA, MoE or dense as
// the rule for its index says) under model.layers.{i}.mtp_block., sharded as the main
// layers; embed_tokens and shared_head.head vocab-parallel; enorm, hnorm, shared_head.norm
// and eh_proj [H, 2H] (a plain linear in vLLM, bf16 in every checkpoint) replicated. Each
// MTP layer is a layer group of its own after the decoder layers.
#include <algorithm>

#include "models/archs.h"
#include "models/moe.h"

namespace ferry::models {

namespace {

struct MlaDims {
  int64_t heads = 0;
  int64_t q_lora = 0;  // 0: q_lora_rank null (q_proj)
  int64_t kv_lora = 0;
  int64_t nope = 0;
  int64_t rope = 0;
  int64_t v = 0;
  int64_t qk() const { return nope + rope; }
};

class DeepseekV3Loader : public ModelLoaderBase {
 public:
  DeepseekV3Loader(ModelConfig cfg, InferenceLayout layout, LoaderOptions opts)
      : ModelLoaderBase(std::move(cfg), layout, opts) {}

  Status read() {
    const ModelConfig& cfg = config();
    d_.layers = 0;
    FERRY_ASSIGN_OR_RETURN(d_.hidden, cfg.get_int("hidden_size"));
    FERRY_ASSIGN_OR_RETURN(d_.layers, cfg.get_int("num_hidden_layers"));
    FERRY_ASSIGN_OR_RETURN(d_.vocab, cfg.get_int("vocab_size"));
    FERRY_ASSIGN_OR_RETURN(d_.intermediate, cfg.get_int_or("intermediate_size", 0));
    FERRY_ASSIGN_OR_RETURN(d_.tie_embeddings, cfg.get_bool_or("tie_word_embeddings", false));
    FERRY_ASSIGN_OR_RETURN(m_.heads, cfg.get_int("num_attention_heads"));
    FERRY_ASSIGN_OR_RETURN(m_.q_lora, cfg.get_int_or("q_lora_rank", 0));
    FERRY_ASSIGN_OR_RETURN(m_.kv_lora, cfg.get_int("kv_lora_rank"));
    FERRY_ASSIGN_OR_RETURN(m_.nope, cfg.get_int("qk_nope_head_dim"));
    FERRY_ASSIGN_OR_RETURN(m_.rope, cfg.get_int("qk_rope_head_dim"));
    FERRY_ASSIGN_OR_RETURN(m_.v, cfg.get_int("v_head_dim"));
    struct Pos {
      const char* name;
      int64_t v;
    };
    for (const Pos& p : {Pos{"hidden_size", d_.hidden}, Pos{"num_hidden_layers", d_.layers}, Pos{"vocab_size", d_.vocab},
                         Pos{"num_attention_heads", m_.heads}, Pos{"kv_lora_rank", m_.kv_lora},
                         Pos{"qk_nope_head_dim", m_.nope}, Pos{"qk_rope_head_dim", m_.rope}, Pos{"v_head_dim", m_.v}}) {
      if (p.v <= 0) return invalid_argument("{}: field '{}' must be positive, got {}", cfg.path(), p.name, p.v);
    }
    if (m_.q_lora < 0) return invalid_argument("{}: field 'q_lora_rank' must be positive or null", cfg.path());
    if (d_.layers > 100000) return invalid_argument("{}: field 'num_hidden_layers' = {} is implausible", cfg.path(), d_.layers);
    d_.heads = d_.kv_heads = m_.heads;
    d_.head_dim = m_.qk();
    FERRY_ASSIGN_OR_RETURN(fp8_, Fp8Checkpoint::from(cfg));
    FERRY_ASSIGN_OR_RETURN(ex_.experts, cfg.get_int_or("n_routed_experts", 0));
    FERRY_ASSIGN_OR_RETURN(ex_.intermediate, cfg.get_int_or("moe_intermediate_size", 0));
    ex_.hidden = d_.hidden;
    FERRY_ASSIGN_OR_RETURN(int64_t n_shared, cfg.get_int_or("n_shared_experts", 0));
    shared_ = n_shared * ex_.intermediate;
    FERRY_ASSIGN_OR_RETURN(int64_t first_dense, cfg.get_int_or("first_k_dense_replace", 0));
    FERRY_ASSIGN_OR_RETURN(int64_t freq, cfg.get_int_or("moe_layer_freq", 1));
    if (freq <= 0) return invalid_argument("{}: field 'moe_layer_freq' must be positive, got {}", cfg.path(), freq);
    FERRY_ASSIGN_OR_RETURN(std::string topk_method, cfg.get_string_or("topk_method", ""));
    router_bias_ = topk_method == "noaux_tc";
    FERRY_ASSIGN_OR_RETURN(int64_t nextn, cfg.get_int_or("num_nextn_predict_layers", 0));
    if (nextn < 0 || nextn > 64)
      return invalid_argument("{}: field 'num_nextn_predict_layers' = {} (0 to 64)", cfg.path(), nextn);
    mtp_ = options().mtp == MtpLayers::kNone ? 0 : nextn;
    bool any_dense = false, any_moe = false;
    for (int64_t i = 0; i < d_.layers + mtp_; ++i) {
      const bool moe = ex_.experts > 0 && i >= first_dense && i % freq == 0;
      moe_.push_back(moe);
      (moe ? any_moe : any_dense) = true;
    }

    // Layout constraints.
    const InferenceLayout& l = layout();
    FERRY_RETURN_IF_ERROR(require_divisible(cfg, "num_attention_heads", m_.heads, "tp", l.tp));
    if (padded_vocab(d_.vocab) % l.tp != 0) {
      return invalid_argument("vocab_size {} padded to {} is not divisible by tp {} ({})", d_.vocab,
                              padded_vocab(d_.vocab), l.tp, cfg.path());
    }
    if (any_dense) {
      if (d_.intermediate <= 0) return invalid_argument("{}: field 'intermediate_size' must be positive", cfg.path());
      FERRY_RETURN_IF_ERROR(require_divisible(cfg, "intermediate_size", d_.intermediate, "tp", l.tp));
    }
    if (any_moe) {
      FERRY_RETURN_IF_ERROR(
          validate_experts(cfg, l, "n_routed_experts", ex_.experts, "moe_intermediate_size", ex_.intermediate,
                           std::count(moe_.begin(), moe_.end(), true), fp8_.enabled ? 2 : 1));
      if (shared_ > 0) {
        FERRY_RETURN_IF_ERROR(require_divisible(cfg, "moe_intermediate_size * n_shared_experts", shared_, "tp", l.tp));
      }
    }
    return Status::Ok();
  }

  // The decoder layers, then the MTP layers loaded as the draft (each a group).
  int num_layers() const override {
    return static_cast<int>(d_.layers + (options().mtp == MtpLayers::kDraft ? mtp_ : 0));
  }

 protected:
  Status declare_checkpoint(CheckpointBuilder& c) const override {
    FERRY_RETURN_IF_ERROR(declare_embedding(c, d_, o_));
    for (int i = 0; i < d_.layers + mtp_; ++i) {
      const std::string p = fmt::format("model.layers.{}.", i), a = p + "self_attn.";
      if (i >= d_.layers) {  // an MTP layer's own tensors, beside its decoder layer
        FERRY_RETURN_IF_ERROR(c.add(p + "embed_tokens.weight", {d_.vocab, d_.hidden}));
        FERRY_RETURN_IF_ERROR(c.add(p + "enorm.weight", {d_.hidden}));
        FERRY_RETURN_IF_ERROR(c.add(p + "hnorm.weight", {d_.hidden}));
        FERRY_RETURN_IF_ERROR(c.add(p + "eh_proj.weight", {d_.hidden, 2 * d_.hidden}));
        FERRY_RETURN_IF_ERROR(c.add(p + "shared_head.norm.weight", {d_.hidden}));
        FERRY_RETURN_IF_ERROR(c.add(p + "shared_head.head.weight", {d_.vocab, d_.hidden}));
      }
      FERRY_RETURN_IF_ERROR(declare_layer_norms(c, d_, o_, i));
      auto lin = [&](const std::string& m, int64_t out, int64_t in) {
        return declare_linear(c, a + m, out, in, fp8_.quantized(a + m));
      };
      if (m_.q_lora > 0) {
        FERRY_RETURN_IF_ERROR(lin("q_a_proj", m_.q_lora, d_.hidden));
        FERRY_RETURN_IF_ERROR(c.add(a + "q_a_layernorm.weight", {m_.q_lora}));
        FERRY_RETURN_IF_ERROR(lin("q_b_proj", m_.heads * m_.qk(), m_.q_lora));
      } else {
        FERRY_RETURN_IF_ERROR(lin("q_proj", m_.heads * m_.qk(), d_.hidden));
      }
      FERRY_RETURN_IF_ERROR(lin("kv_a_proj_with_mqa", m_.kv_lora + m_.rope, d_.hidden));
      FERRY_RETURN_IF_ERROR(c.add(a + "kv_a_layernorm.weight", {m_.kv_lora}));
      FERRY_RETURN_IF_ERROR(lin("kv_b_proj", m_.heads * (m_.nope + m_.v), m_.kv_lora));
      FERRY_RETURN_IF_ERROR(lin("o_proj", d_.hidden, m_.heads * m_.v));
      if (moe_[static_cast<size_t>(i)]) {
        FERRY_RETURN_IF_ERROR(c.add(p + "mlp.gate.weight", {ex_.experts, d_.hidden}));
        if (router_bias_) FERRY_RETURN_IF_ERROR(c.add(p + "mlp.gate.e_score_correction_bias", {ex_.experts}, DType::kF32));
        FERRY_RETURN_IF_ERROR(declare_experts(c, p + "mlp.experts.", ExpertNames{}, ex_, fp8_));
        if (shared_ > 0) FERRY_RETURN_IF_ERROR(declare_mlp(c, p + "mlp.shared_experts.", d_.hidden, shared_, fp8_));
      } else {
        FERRY_RETURN_IF_ERROR(declare_mlp(c, p + "mlp.", d_.hidden, d_.intermediate, fp8_));
      }
    }
    return declare_final(c, d_, o_);
  }

  Status build_rank(RankBuilder& b) const override {
    FERRY_RETURN_IF_ERROR(build_embedding(b, d_, o_));
    const Split tp = b.tp();
    const int64_t layers = options().mtp == MtpLayers::kDraft ? d_.layers + mtp_ : d_.layers;
    for (int i = 0; i < layers; ++i) {
      // p: the checkpoint's prefix; q: the params' (an MTP layer's decoder layer lies under
      // mtp_block., as vLLM's DeepSeekMTP loads it).
      const std::string p = fmt::format("model.layers.{}.", i);
      const bool mtp = i >= d_.layers;
      const std::string q = mtp ? p + "mtp_block." : p;
      const std::string a = p + "self_attn.", qa = q + "self_attn.";
      const int g = layer_group(i);
      if (mtp) {
        FERRY_RETURN_IF_ERROR(b.vocab_parallel(p + "embed_tokens.weight", p + "embed_tokens.weight", d_.vocab, g, tp));
        for (const char* n : {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"})
          FERRY_RETURN_IF_ERROR(b.replicated(p + n, p + n, g));
        FERRY_RETURN_IF_ERROR(
            b.vocab_parallel(p + "shared_head.head.weight", p + "shared_head.head.weight", d_.vocab, g, tp));
      }
      FERRY_RETURN_IF_ERROR(b.replicated(q + "input_layernorm.weight", p + "input_layernorm.weight", g));
      FERRY_RETURN_IF_ERROR(b.replicated(q + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", g));
      auto q8 = [&](const std::string& m) { return fp8_.quantized(a + m); };
      const Range kv_a{0, m_.kv_lora + m_.rope};
      if (m_.q_lora > 0) {
        // q_a_proj and kv_a_proj_with_mqa fused into one replicated param (vLLM's
        // fused_qkv_a_proj, a MergedColumnParallelLinear with TP disabled).
        if (q8("q_a_proj") != q8("kv_a_proj_with_mqa")) {
          return invalid_argument("{}: modules_to_not_convert lists one of q_a_proj / kv_a_proj_with_mqa of layer {} but not "
                                  "the other (they are fused)", config().path(), i);
        }
        FERRY_RETURN_IF_ERROR(build_linear(b, qa + "fused_qkv_a_proj",
                                           {{a + "q_a_proj", Range{0, m_.q_lora}}, {a + "kv_a_proj_with_mqa", kv_a}}, 0, g,
                                           q8("q_a_proj")));
        FERRY_RETURN_IF_ERROR(b.replicated(qa + "q_a_layernorm.weight", a + "q_a_layernorm.weight", g));
        FERRY_RETURN_IF_ERROR(build_linear(b, qa + "q_b_proj", {{a + "q_b_proj", even_shard(m_.heads * m_.qk(), tp)}}, 0, g,
                                           q8("q_b_proj")));
      } else {
        FERRY_RETURN_IF_ERROR(
            build_linear(b, qa + "q_proj", {{a + "q_proj", even_shard(m_.heads * m_.qk(), tp)}}, 0, g, q8("q_proj")));
        FERRY_RETURN_IF_ERROR(build_linear(b, qa + "kv_a_proj_with_mqa", {{a + "kv_a_proj_with_mqa", kv_a}}, 0, g,
                                           q8("kv_a_proj_with_mqa")));
      }
      FERRY_RETURN_IF_ERROR(b.replicated(qa + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", g));
      FERRY_RETURN_IF_ERROR(build_linear(b, qa + "kv_b_proj",
                                         {{a + "kv_b_proj", even_shard(m_.heads * (m_.nope + m_.v), tp)}}, 0, g,
                                         q8("kv_b_proj")));
      FERRY_RETURN_IF_ERROR(
          build_linear(b, qa + "o_proj", {{a + "o_proj", even_shard(m_.heads * m_.v, tp)}}, 1, g, q8("o_proj")));
      if (moe_[static_cast<size_t>(i)]) {
        FERRY_RETURN_IF_ERROR(b.replicated(q + "mlp.gate.weight", p + "mlp.gate.weight", g));
        if (router_bias_) {
          FERRY_RETURN_IF_ERROR(
              b.replicated(q + "mlp.gate.e_score_correction_bias", p + "mlp.gate.e_score_correction_bias", g));
        }
        FERRY_RETURN_IF_ERROR(build_experts(b, q + "mlp.experts.", p + "mlp.experts.", ExpertNames{}, ex_, g, fp8_));
        if (shared_ > 0) FERRY_RETURN_IF_ERROR(build_mlp(b, p + "mlp.shared_experts.", shared_, g, tp, fp8_, q + "mlp.shared_experts."));
      } else {
        FERRY_RETURN_IF_ERROR(build_mlp(b, p + "mlp.", d_.intermediate, g, tp, fp8_, q + "mlp."));
      }
    }
    return build_final(b, d_, o_);
  }

 private:
  DenseDims d_;
  DenseOptions o_;  // prefix "model."
  MlaDims m_;
  Fp8Checkpoint fp8_;
  ExpertDims ex_;
  int64_t shared_ = 0;
  bool router_bias_ = false;
  int64_t mtp_ = 0;  // MTP layers the checkpoint declares (LoaderOptions::mtp not none)
  std::vector<bool> moe_;
};

Result<std::unique_ptr<ModelLoader>> make_deepseek_v3(const ModelConfig& cfg, const InferenceLayout& layout,
                                                      const LoaderOptions& opts) {
  auto loader = std::make_unique<DeepseekV3Loader>(cfg, layout, opts);
  FERRY_RETURN_IF_ERROR(loader->read());
  FERRY_RETURN_IF_ERROR(loader->init());
  return std::unique_ptr<ModelLoader>(std::move(loader));
}

Status shrink_deepseek_v3(nlohmann::json& root, ShrinkContext& ctx) {
  const bool had_head_dim = root.contains("head_dim");
  FERRY_RETURN_IF_ERROR(shrink_dense_fields(root, "", ctx));
  if (!had_head_dim) {
    // MLA has no head_dim: drop the one the dense rule derived.
    root.erase("head_dim");
    auto& ch = *ctx.changes;
    ch.erase(std::remove_if(ch.begin(), ch.end(), [](const ShrinkChange& c) { return c.field == "head_dim"; }), ch.end());
  }
  const int64_t layers2 = shrink_get_int(root, "num_hidden_layers", 0);
  // Keep one dense layer (when there were any) and at least one MoE layer.
  if (const int64_t k = shrink_get_int(root, "first_k_dense_replace", 0); k >= layers2) {
    shrink_set(root, "first_k_dense_replace", std::max<int64_t>(0, layers2 - 1), ctx);
  }
  if (shrink_get_int(root, "moe_layer_freq", 1) > 1) shrink_set(root, "moe_layer_freq", 1, ctx);
  if (const int64_t e = shrink_get_int(root, "n_routed_experts", 0); e > 0) {
    const int64_t e2 = shrink_expert_count(e, ctx.layout);
    shrink_set(root, "n_routed_experts", e2, ctx);
    if (shrink_get_int(root, "num_experts_per_tok", 0) > e2) shrink_set(root, "num_experts_per_tok", e2, ctx);
    const int64_t groups = shrink_get_int(root, "n_group", 1);
    if (groups > 1 && e2 % groups != 0) {
      shrink_set(root, "n_group", 1, ctx);
      shrink_set(root, "topk_group", 1, ctx);
    }
  }
  if (const int64_t i = shrink_get_int(root, "moe_intermediate_size", 0); i > 0) {
    // Routed experts split by the expert TP size, shared experts by tp.
    shrink_set(root, "moe_intermediate_size", shrink_expert_intermediate(i, ctx.layout, ctx.layout.tp), ctx);
  }
  // MLA ranks and head dims: small, and not multiples of 128 (partial FP8 blocks).
  if (const int64_t q = shrink_get_int(root, "q_lora_rank", 0); q > 192) shrink_set(root, "q_lora_rank", 192, ctx);
  if (const int64_t kv = shrink_get_int(root, "kv_lora_rank", 0); kv > 160) shrink_set(root, "kv_lora_rank", 160, ctx);
  if (shrink_get_int(root, "qk_nope_head_dim", 0) > 16) shrink_set(root, "qk_nope_head_dim", 16, ctx);
  if (shrink_get_int(root, "qk_rope_head_dim", 0) > 8) shrink_set(root, "qk_rope_head_dim", 8, ctx);
  if (shrink_get_int(root, "v_head_dim", 0) > 16) shrink_set(root, "v_head_dim", 16, ctx);
  return Status::Ok();
}

}  // namespace

ArchEntry deepseek_v3_arch() { return ArchEntry{"DeepseekV3ForCausalLM", make_deepseek_v3, shrink_deepseek_v3}; }

}  // namespace ferry::models
