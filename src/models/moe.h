// src/models/moe.h — pieces shared by the MoE / MLA architectures (Qwen3-MoE, Mixtral,
// DeepSeek-V3 / Kimi-K2, Llama-4): FP8 block-quantised checkpoints, linears assembled
// from (ranges of) several checkpoint linears with their block scales, routed experts
// (per-expert 2-D tensors, or Llama-4's fused transposed tensors), and shrink helpers.
//
// FP8 checkpoints (config quantization_config {quant_method: fp8, weight_block_size
// [128, 128]}): every quantised linear `X.weight` [out, in] is e4m3 and has a sibling
// `X.weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)]. A loaded param that takes rows
// (or columns) [s, s + n) of a weight takes the scale rows (columns) of the 128-blocks
// covering them (block_shard): when a rank's shard starts or ends inside a block, that
// block's scale is held by both ranks. A param fused from several parts (qkv, gate_up,
// fused_qkv_a, w13) has a scale param whose rows are the covering blocks of each part,
// concatenated in part order — so part p's local row i uses scale row
// offset_p + (start_p + i) / 128 - start_p / 128.
//
// Routed experts (vLLM FusedMoE): per rank `P.w13_weight` [E_local, 2*I_local, H] (rows
// [gate | up] of each expert's TP shard) and `P.w2_weight` [E_local, H, I_local]; with EP
// rank k of ep owns experts [k*E/ep, (k+1)*E/ep) whole; without EP every expert is split
// over all T*D engine ranks (RankInfo::expert_tp_rank/size). FP8: `P.w13_weight_scale_inv`
// [E_local, nb(gate shard) + nb(up shard), ceil(H/128)] and `P.w2_weight_scale_inv`
// [E_local, ceil(H/128), nb(I shard)].
#pragma once

#include <string>
#include <vector>

#include "models/builder.h"
#include "models/dense.h"
#include "models/shrink.h"

namespace ferry::models {

// ---------------------------------------------------------------------------------------
// FP8 block-quantised checkpoints.

struct Fp8Checkpoint {
  bool enabled = false;
  std::vector<std::string> not_converted;  // quantization_config.modules_to_not_convert

  // From config.quantization_config: absent -> disabled; quant_method "fp8" with
  // weight_block_size [128, 128] (and fmt e4m3 when given) -> enabled; anything else is
  // kInvalidArgument naming the field.
  static Result<Fp8Checkpoint> from(const ModelConfig& cfg);
  // Whether linear module `module` ("model.layers.0.self_attn.q_proj") is stored as e4m3
  // + scales: enabled and not listed in modules_to_not_convert (an entry matches the
  // module itself or a module under it, as vLLM's is_layer_skipped).
  bool quantized(const std::string& module) const;
};

// Declares `module.weight` [out, in]: e4m3 plus fp32 `module.weight_scale_inv`
// [ceil(out/128), ceil(in/128)] when fp8; the config's dtype otherwise.
Status declare_linear(CheckpointBuilder& c, const std::string& module, int64_t out, int64_t in, bool fp8);

// One part of a linear param: rows (dim 0) or columns (dim 1) `range` of checkpoint
// linear `module` (its weight and, when fp8, its scale), placed after the previous parts.
struct LinearPart {
  std::string module;
  Range range;
};

// Declares param `param`.weight assembled along `dim` from `parts` (the other dim whole),
// and, when `fp8` (the sources are e4m3 + scales), `param`.weight_scale_inv from the
// covering blocks of each part. `quantizable` marks the weight for Quantize::kFp8 (only
// when not already fp8). Every part must have the same dtype and other-dim size.
Status build_linear(RankBuilder& b, const std::string& param, const std::vector<LinearPart>& parts, int64_t dim,
                    int group, bool fp8, bool quantizable = true);

// Attention of a Llama-family layer from an FP8 checkpoint: q/k/v (+ scales) fused into
// qkv_proj [q | k | v] with GQA replication, o_proj row-parallel, q_norm/k_norm when
// `o.qk_norm`. Names as dense.h. Declare with declare_fp8_attention.
Status declare_fp8_attention(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer,
                             const Fp8Checkpoint& fp8);
Status build_fp8_attention(RankBuilder& b, const DenseDims& d, const DenseOptions& o, int layer,
                           const Fp8Checkpoint& fp8);

// A dense (or shared-expert) MLP `module_prefix`{gate,up,down}_proj with optional FP8:
// gate_up_proj merged column-parallel, down_proj row-parallel, both split by `split`.
Status declare_mlp(CheckpointBuilder& c, const std::string& module_prefix, int64_t hidden, int64_t intermediate,
                   const Fp8Checkpoint& fp8);
// `param_prefix`: the params' (gate_up_proj, down_proj) prefix; empty: `module_prefix`.
Status build_mlp(RankBuilder& b, const std::string& module_prefix, int64_t intermediate, int group, Split split,
                 const Fp8Checkpoint& fp8, const std::string& param_prefix = "");

// ---------------------------------------------------------------------------------------
// Routed experts.

struct ExpertDims {
  int64_t experts = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
};

// Checkpoint names of expert e: `prefix`{e}.{gate}.weight etc.
struct ExpertNames {
  std::string gate = "gate_proj";
  std::string up = "up_proj";
  std::string down = "down_proj";
};

// E divisible by ep; I divisible by the expert TP size (T*D without EP). Errors name the
// config fields. Before anything is declared: `moe_layers` x E experts x 3 linears (x 2
// with FP8 scales, `tensors_per_linear`) checkpoint tensors within kMaxCheckpointTensors,
// so `num_experts: 1e9` is refused at once, saying how many tensors it would declare.
Status validate_experts(const ModelConfig& cfg, const InferenceLayout& layout, std::string_view experts_field,
                        int64_t experts, std::string_view intermediate_field, int64_t intermediate,
                        int64_t moe_layers, int64_t tensors_per_linear = 1);

// Per-expert 2-D checkpoint tensors (Qwen3-MoE, Mixtral, DeepSeek-V3).
Status declare_experts(CheckpointBuilder& c, const std::string& src_prefix, const ExpertNames& names,
                       const ExpertDims& d, const Fp8Checkpoint& fp8);
// Params `param_prefix`w13_weight / w2_weight (+ scales); routes only the rank's experts.
Status build_experts(RankBuilder& b, const std::string& param_prefix, const std::string& src_prefix,
                     const ExpertNames& names, const ExpertDims& d, int group, const Fp8Checkpoint& fp8);

// Llama-4: `src_prefix`gate_up_proj [E, H, 2I] (transposed, last dim gate then up) and
// `src_prefix`down_proj [E, I, H] (transposed). No `.weight` suffix, never FP8 here.
Status declare_fused_transposed_experts(CheckpointBuilder& c, const std::string& src_prefix, const ExpertDims& d);
Status build_fused_transposed_experts(RankBuilder& b, const std::string& param_prefix, const std::string& src_prefix,
                                      const ExpertDims& d, int group);

// ---------------------------------------------------------------------------------------
// A Llama-family decoder whose MLP is a sparse MoE in some layers (Qwen3-MoE, Mixtral):
// attention as dense.h (from an FP8 checkpoint: build_fp8_attention), MoE layers with a
// replicated router `P`layers.i.`moe_module`gate.weight [E, H] (never quantised) and
// routed experts `P`layers.i.`moe_module`experts.{e}.*; other layers a dense MLP
// `P`layers.i.mlp.* of intermediate_size.

struct MoeDecoderSpec {
  DenseDims dims;
  DenseOptions dense;
  Fp8Checkpoint fp8;
  ExpertDims experts;
  ExpertNames names;
  std::string moe_module = "mlp.";
  std::vector<bool> moe_layer;  // per layer: MoE (true) or dense MLP
};

class MoeDecoderLoader : public ModelLoaderBase {
 public:
  MoeDecoderLoader(ModelConfig cfg, InferenceLayout layout, LoaderOptions opts, MoeDecoderSpec spec)
      : ModelLoaderBase(std::move(cfg), layout, opts), spec_(std::move(spec)) {}
  int num_layers() const override { return static_cast<int>(spec_.dims.layers); }

 protected:
  Status declare_checkpoint(CheckpointBuilder& c) const override;
  Status build_rank(RankBuilder& b) const override;

 private:
  MoeDecoderSpec spec_;
};

// ---------------------------------------------------------------------------------------
// Shrink helpers.

// Experts of a shrunk model: ep * min(E/ep, 2) with EP, min(E, 4) without.
int64_t shrink_expert_count(int64_t experts, const InferenceLayout& layout);
// The expert TP size of a layout: 1 with EP, T*D without.
int64_t expert_tp_size(const InferenceLayout& layout);
// Sets `field` like shrink_set, but when an earlier change of the same field was recorded
// (shrink_dense_fields shrank it with the dense rule) that change is amended instead, so
// each field is reported once with its original value.
void shrink_override(nlohmann::json& root, const std::string& field, const nlohmann::json& value, ShrinkContext& ctx);
// A per-layer list field (layer indices, e.g. mlp_only_layers / moe_layers): keeps the
// entries below `layers`. A per-layer array of length `old_layers` (no_rope_layers) is
// truncated to `layers`.
void shrink_layer_index_list(nlohmann::json& root, const std::string& field, int64_t layers, ShrinkContext& ctx);
void shrink_per_layer_list(nlohmann::json& root, const std::string& field, int64_t old_layers, int64_t layers,
                           ShrinkContext& ctx);
// An expert intermediate size: a multiple of lcm(expert TP size, `also`) near 96 per
// expert-TP rank (kShrinkIntermediatePerRank: partial FP8 blocks, shared scale blocks).
int64_t shrink_expert_intermediate(int64_t intermediate, const InferenceLayout& layout, int64_t also);

}  // namespace ferry::models
