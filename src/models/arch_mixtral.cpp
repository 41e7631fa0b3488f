// MixtralForCausalLM (vLLM: model_executor/models/mixtral.py).
// Attention as Llama (no biases, no qk norm). Every layer is MoE: router
// block_sparse_moe.gate.weight [E, H] replicated; experts
// block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down) .weight, each 2-D, fused per
// rank into block_sparse_moe.experts.w13_weight [E_local, 2*I_local, H] (rows w1 | w3) and
// w2_weight [E_local, H, I_local] (moe.h). E = num_local_experts, I = intermediate_size.
#include "models/archs.h"
#include "models/moe.h"

namespace ferry::models {

namespace {

Result<std::unique_ptr<ModelLoader>> make_mixtral(const ModelConfig& cfg, const InferenceLayout& layout,
                                                  const LoaderOptions& opts) {
  MoeDecoderSpec s;
  FERRY_ASSIGN_OR_RETURN(s.dims, DenseDims::from(cfg));
  FERRY_ASSIGN_OR_RETURN(s.fp8, Fp8Checkpoint::from(cfg));
  FERRY_ASSIGN_OR_RETURN(s.experts.experts, cfg.get_int("num_local_experts"));
  s.experts.intermediate = s.dims.intermediate;
  s.experts.hidden = s.dims.hidden;
  s.names = ExpertNames{"w1", "w3", "w2"};
  s.moe_module = "block_sparse_moe.";
  s.moe_layer.assign(static_cast<size_t>(s.dims.layers), true);
  FERRY_RETURN_IF_ERROR(validate_dense(cfg, s.dims, layout, /*check_intermediate=*/false));
  FERRY_RETURN_IF_ERROR(
      validate_experts(cfg, layout, "num_local_experts", s.experts.experts, "intermediate_size", s.experts.intermediate,
                       s.dims.layers, s.fp8.enabled ? 2 : 1));
  return make_loader<MoeDecoderLoader>(cfg, layout, opts, std::move(s));
}

Status shrink_mixtral(nlohmann::json& root, ShrinkContext& ctx) {
  const int64_t inter = shrink_get_int(root, "intermediate_size", 0);
  FERRY_RETURN_IF_ERROR(shrink_dense_fields(root, "", ctx));
  // intermediate_size is the experts': divisible by the expert TP size, not only tp.
  if (inter > 0) shrink_override(root, "intermediate_size", shrink_expert_intermediate(inter, ctx.layout, 1), ctx);
  if (const int64_t e = shrink_get_int(root, "num_local_experts", 0); e > 0) {
    const int64_t e2 = shrink_expert_count(e, ctx.layout);
    shrink_set(root, "num_local_experts", e2, ctx);
    if (shrink_get_int(root, "num_experts_per_tok", 0) > e2) shrink_set(root, "num_experts_per_tok", e2, ctx);
  }
  return Status::Ok();
}

}  // namespace

ArchEntry mixtral_arch() { return ArchEntry{"MixtralForCausalLM", make_mixtral, shrink_mixtral}; }

}  // namespace ferry::models
