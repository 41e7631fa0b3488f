// Llama4ForConditionalGeneration, text part (vLLM: model_executor/models/llama4.py).
// Fields under text_config; checkpoint names under language_model.model. (the vision tower
// and projector are not loaded). Attention as Llama (q/k/v/o, GQA; Llama-4's qk norm has
// no weights). Layer i is MoE when it is in text_config.moe_layers, or, without that list,
// when i % interleave_moe_layer_step == step - 1 (HF's default list); other layers are a
// dense MLP feed_forward.{gate,up,down}_proj of intermediate_size_mlp.
// MoE layers: router feed_forward.router.weight [E, H] replicated; routed experts stored
// fused and transposed: feed_forward.experts.gate_up_proj [E, H, 2I] (no .weight; last
// dim gate then up) and feed_forward.experts.down_proj [E, I, H]. Each rank takes its
// experts, transposes them to nn.Linear layout and splits gate/up into
// feed_forward.experts.w13_weight [E_local, 2*I_local, H] (rows [gate | up]) and
// w2_weight [E_local, H, I_local] (moe.h); the shared expert
// feed_forward.shared_expert.{gate,up,down}_proj (intermediate_size) is TP-split.
// lm_head is language_model.lm_head.weight (vocab-parallel; tied to the embedding when
// text_config.tie_word_embeddings).
#include <algorithm>

#include "models/archs.h"
#include "models/moe.h"

namespace ferry::models {

namespace {

class Llama4Loader : public ModelLoaderBase {
 public:
  Llama4Loader(ModelConfig cfg, InferenceLayout layout, LoaderOptions opts, DenseDims d, DenseOptions o, ExpertDims ex,
               int64_t mlp_inter, std::vector<bool> moe)
      : ModelLoaderBase(std::move(cfg), layout, opts),
        d_(d),
        o_(std::move(o)),
        ex_(ex),
        mlp_inter_(mlp_inter),
        moe_(std::move(moe)) {}
  int num_layers() const override { return static_cast<int>(d_.layers); }

 protected:
  Status declare_checkpoint(CheckpointBuilder& c) const override {
    const Fp8Checkpoint none;
    FERRY_RETURN_IF_ERROR(declare_embedding(c, d_, o_));
    for (int i = 0; i < d_.layers; ++i) {
      const std::string f = fmt::format("{}layers.{}.feed_forward.", o_.prefix, i);
      FERRY_RETURN_IF_ERROR(declare_layer_norms(c, d_, o_, i));
      FERRY_RETURN_IF_ERROR(declare_attention(c, d_, o_, i));
      if (moe_[static_cast<size_t>(i)]) {
        FERRY_RETURN_IF_ERROR(c.add(f + "router.weight", {ex_.experts, d_.hidden}));
        FERRY_RETURN_IF_ERROR(declare_fused_transposed_experts(c, f + "experts.", ex_));
        FERRY_RETURN_IF_ERROR(declare_mlp(c, f + "shared_expert.", d_.hidden, ex_.intermediate, none));
      } else {
        FERRY_RETURN_IF_ERROR(declare_mlp(c, f, d_.hidden, mlp_inter_, none));
      }
    }
    FERRY_RETURN_IF_ERROR(c.add(o_.prefix + "norm.weight", {d_.hidden}));
    if (!d_.tie_embeddings) FERRY_RETURN_IF_ERROR(c.add(lm_head(), {d_.vocab, d_.hidden}));
    return Status::Ok();
  }

  Status build_rank(RankBuilder& b) const override {
    const Fp8Checkpoint none;
    FERRY_RETURN_IF_ERROR(build_embedding(b, d_, o_));
    for (int i = 0; i < d_.layers; ++i) {
      const std::string f = fmt::format("{}layers.{}.feed_forward.", o_.prefix, i);
      const int g = layer_group(i);
      FERRY_RETURN_IF_ERROR(build_layer_norms(b, d_, o_, i));
      FERRY_RETURN_IF_ERROR(build_attention(b, d_, o_, i));
      if (moe_[static_cast<size_t>(i)]) {
        FERRY_RETURN_IF_ERROR(b.replicated(f + "router.weight", f + "router.weight", g));
        FERRY_RETURN_IF_ERROR(build_fused_transposed_experts(b, f + "experts.", f + "experts.", ex_, g));
        FERRY_RETURN_IF_ERROR(build_mlp(b, f + "shared_expert.", ex_.intermediate, g, b.tp(), none));
      } else {
        FERRY_RETURN_IF_ERROR(build_mlp(b, f, mlp_inter_, g, b.tp(), none));
      }
    }
    const int g = b.final_group();
    FERRY_RETURN_IF_ERROR(b.replicated(o_.prefix + "norm.weight", o_.prefix + "norm.weight", g));
    const std::string src = d_.tie_embeddings ? o_.prefix + "embed_tokens.weight" : lm_head();
    return b.vocab_parallel(lm_head(), src, d_.vocab, g, b.tp());
  }

 private:
  static std::string lm_head() { return "language_model.lm_head.weight"; }
  DenseDims d_;
  DenseOptions o_;
  ExpertDims ex_;
  int64_t mlp_inter_ = 0;
  std::vector<bool> moe_;
};

Result<std::vector<bool>> moe_layers(const ModelConfig& cfg, int64_t layers) {
  std::vector<bool> moe(static_cast<size_t>(layers), false);
  if (cfg.has("text_config.moe_layers")) {
    FERRY_ASSIGN_OR_RETURN(std::vector<int64_t> list, cfg.get_int_list_or("text_config.moe_layers", {}));
    for (int64_t i : list) {
      if (i < 0 || i >= layers) {
        return invalid_argument("{}: text_config.moe_layers holds {}, outside [0, {})", cfg.path(), i, layers);
      }
      moe[static_cast<size_t>(i)] = true;
    }
    return moe;
  }
  FERRY_ASSIGN_OR_RETURN(int64_t step, cfg.get_int_or("text_config.interleave_moe_layer_step", 1));
  if (step <= 0) {
    return invalid_argument("{}: field 'text_config.interleave_moe_layer_step' must be positive, got {}", cfg.path(), step);
  }
  for (int64_t i = 0; i < layers; ++i) moe[static_cast<size_t>(i)] = i % step == step - 1;
  return moe;
}

Result<std::unique_ptr<ModelLoader>> make_llama4(const ModelConfig& cfg, const InferenceLayout& layout,
                                                 const LoaderOptions& opts) {
  FERRY_ASSIGN_OR_RETURN(DenseDims d, DenseDims::from(cfg, "text_config."));
  DenseOptions o;
  o.prefix = "language_model.model.";
  FERRY_ASSIGN_OR_RETURN(bool attention_bias, cfg.get_bool_or("text_config.attention_bias", false));
  o.qkv_bias = o.o_bias = attention_bias;
  ExpertDims ex{0, d.hidden, d.intermediate};
  FERRY_ASSIGN_OR_RETURN(ex.experts, cfg.get_int("text_config.num_local_experts"));
  FERRY_ASSIGN_OR_RETURN(int64_t mlp_inter, cfg.get_int_or("text_config.intermediate_size_mlp", 0));
  FERRY_ASSIGN_OR_RETURN(std::vector<bool> moe, moe_layers(cfg, d.layers));
  const bool any_moe = std::find(moe.begin(), moe.end(), true) != moe.end();
  const bool any_dense = std::find(moe.begin(), moe.end(), false) != moe.end();
  FERRY_RETURN_IF_ERROR(validate_dense(cfg, d, layout, /*check_intermediate=*/false));
  if (any_dense) {
    if (mlp_inter <= 0) {
      return invalid_argument("{}: field 'text_config.intermediate_size_mlp' must be positive (dense layers)", cfg.path());
    }
    FERRY_RETURN_IF_ERROR(require_divisible(cfg, "text_config.intermediate_size_mlp", mlp_inter, "tp", layout.tp));
  }
  if (any_moe) {
    FERRY_RETURN_IF_ERROR(validate_experts(cfg, layout, "text_config.num_local_experts", ex.experts,
                                           "text_config.intermediate_size", ex.intermediate,
                                           std::count(moe.begin(), moe.end(), true)));
    // The shared expert is TP-split.
    FERRY_RETURN_IF_ERROR(require_divisible(cfg, "text_config.intermediate_size", ex.intermediate, "tp", layout.tp));
  }
  return make_loader<Llama4Loader>(cfg, layout, opts, d, std::move(o), ex, mlp_inter, std::move(moe));
}

Status shrink_llama4(nlohmann::json& root, ShrinkContext& ctx) {
  const std::string t = "text_config.";
  const int64_t layers = shrink_get_int(root, t + "num_hidden_layers", 0);
  const int64_t inter = shrink_get_int(root, t + "intermediate_size", 0);
  FERRY_RETURN_IF_ERROR(shrink_dense_fields(root, t, ctx));
  const int64_t layers2 = shrink_get_int(root, t + "num_hidden_layers", 0);
  // intermediate_size is the experts' (and the shared expert's): divisible by the expert
  // TP size and by tp.
  if (inter > 0) shrink_override(root, t + "intermediate_size", shrink_expert_intermediate(inter, ctx.layout, ctx.layout.tp), ctx);
  if (const int64_t m = shrink_get_int(root, t + "intermediate_size_mlp", 0); m > 0) {
    shrink_set(root, t + "intermediate_size_mlp",
               shrink_multiple(m, ctx.layout.tp, kShrinkIntermediatePerRank * ctx.layout.tp), ctx);
  }
  if (const int64_t e = shrink_get_int(root, t + "num_local_experts", 0); e > 0) {
    const int64_t e2 = shrink_expert_count(e, ctx.layout);
    shrink_set(root, t + "num_local_experts", e2, ctx);
    if (shrink_get_int(root, t + "num_experts_per_tok", 0) > e2) shrink_set(root, t + "num_experts_per_tok", e2, ctx);
  }
  shrink_layer_index_list(root, t + "moe_layers", layers2, ctx);
  if (shrink_get_int(root, t + "interleave_moe_layer_step", 1) > layers2) {
    shrink_set(root, t + "interleave_moe_layer_step", layers2, ctx);
  }
  shrink_per_layer_list(root, t + "no_rope_layers", layers, layers2, ctx);
  return Status::Ok();
}

}  // namespace

ArchEntry llama4_arch() { return ArchEntry{"Llama4ForConditionalGeneration", make_llama4, shrink_llama4}; }

}  // namespace ferry::models
