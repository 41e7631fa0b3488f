// Qwen3MoeForCausalLM (vLLM: model_executor/models/qwen3_moe.py).
// Attention as Qwen3 (q_norm/k_norm [head_dim], replicated). Layer i is MoE when it is not
// in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (and num_experts > 0): router
// mlp.gate.weight [E, H] replicated, experts mlp.experts.{e}.{gate,up,down}_proj.weight
// (2-D each) fused per rank into mlp.experts.w13_weight / w2_weight (moe.h); other layers
// a dense MLP of intermediate_size. An FP8 checkpoint (quantization_config, 128x128 blocks;
// Qwen3-235B-A22B-FP8) stores every linear not in modules_to_not_convert as e4m3 with a
// weight_scale_inv sibling; the loader copies both (moe.h), scales at block granularity.
#include <algorithm>

#include "models/archs.h"
#include "models/moe.h"

namespace ferry::models {

namespace {

Result<std::unique_ptr<ModelLoader>> make_qwen3_moe(const ModelConfig& cfg, const InferenceLayout& layout,
                                                    const LoaderOptions& opts) {
  MoeDecoderSpec s;
  FERRY_ASSIGN_OR_RETURN(s.dims, DenseDims::from(cfg, "", /*need_intermediate=*/false));
  FERRY_ASSIGN_OR_RETURN(bool attention_bias, cfg.get_bool_or("attention_bias", false));
  s.dense.qkv_bias = attention_bias;
  s.dense.qk_norm = true;
  FERRY_ASSIGN_OR_RETURN(s.fp8, Fp8Checkpoint::from(cfg));
  FERRY_ASSIGN_OR_RETURN(s.experts.experts, cfg.get_int_or("num_experts", 0));
  FERRY_ASSIGN_OR_RETURN(s.experts.intermediate, cfg.get_int_or("moe_intermediate_size", 0));
  s.experts.hidden = s.dims.hidden;
  FERRY_ASSIGN_OR_RETURN(int64_t step, cfg.get_int_or("decoder_sparse_step", 1));
  FERRY_ASSIGN_OR_RETURN(std::vector<int64_t> mlp_only, cfg.get_int_list_or("mlp_only_layers", {}));
  if (step <= 0) return invalid_argument("{}: field 'decoder_sparse_step' must be positive, got {}", cfg.path(), step);
  bool any_dense = false, any_moe = false;
  for (int64_t i = 0; i < s.dims.layers; ++i) {
    const bool moe = s.experts.experts > 0 && std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() &&
                     (i + 1) % step == 0;
    s.moe_layer.push_back(moe);
    (moe ? any_moe : any_dense) = true;
  }
  FERRY_RETURN_IF_ERROR(validate_dense(cfg, s.dims, layout, /*check_intermediate=*/any_dense));
  if (any_moe) {
    FERRY_RETURN_IF_ERROR(validate_experts(cfg, layout, "num_experts", s.experts.experts, "moe_intermediate_size",
                                           s.experts.intermediate,
                                           std::count(s.moe_layer.begin(), s.moe_layer.end(), true),
                                           s.fp8.enabled ? 2 : 1));
  }
  return make_loader<MoeDecoderLoader>(cfg, layout, opts, std::move(s));
}

Status shrink_qwen3_moe(nlohmann::json& root, ShrinkContext& ctx) {
  const int64_t layers = shrink_get_int(root, "num_hidden_layers", 0);
  FERRY_RETURN_IF_ERROR(shrink_dense_fields(root, "", ctx));
  const int64_t layers2 = shrink_get_int(root, "num_hidden_layers", 0);
  shrink_layer_index_list(root, "mlp_only_layers", layers2, ctx);
  if (layers2 < layers) shrink_set(root, "max_window_layers", layers2, ctx);
  if (const int64_t e = shrink_get_int(root, "num_experts", 0); e > 0) {
    const int64_t e2 = shrink_expert_count(e, ctx.layout);
    shrink_set(root, "num_experts", e2, ctx);
    const int64_t k = shrink_get_int(root, "num_experts_per_tok", 0);
    if (k > e2) shrink_set(root, "num_experts_per_tok", e2, ctx);
  }
  if (const int64_t i = shrink_get_int(root, "moe_intermediate_size", 0); i > 0) {
    shrink_set(root, "moe_intermediate_size", shrink_expert_intermediate(i, ctx.layout, 1), ctx);
  }
  return Status::Ok();
}

}  // namespace

ArchEntry qwen3_moe_arch() { return ArchEntry{"Qwen3MoeForCausalLM", make_qwen3_moe, shrink_qwen3_moe}; }

}  // namespace ferry::models
