// src/models/dense.h — the decoder pieces shared by Llama-family architectures
// (Llama, Qwen2, Qwen3, Phi-3) and reusable by the MoE ones (attention, embeddings,
// norms, dense MLP layers; MoE layers replace only the MLP).
//
// Checkpoint names (HF) and param names (vLLM), with P = options.prefix ("model."):
//   P embed_tokens.weight [V, H]        -> P embed_tokens.weight [pad64(V)/T, H]   vocab-parallel
//   P layers.i.self_attn.{q,k,v}_proj.{weight,bias}
//                                       -> P layers.i.self_attn.qkv_proj.{weight,bias}  fused, GQA
//   (fused_qkv: P layers.i.self_attn.qkv_proj.weight in the checkpoint, rows q,k,v)
//   P layers.i.self_attn.o_proj.weight  -> same name, row-parallel (bias replicated)
//   P layers.i.self_attn.{q,k}_norm.weight (qk_norm)  -> replicated
//   P layers.i.mlp.{gate,up}_proj.weight -> P layers.i.mlp.gate_up_proj.weight  [gate | up]
//   (fused_gate_up: P layers.i.mlp.gate_up_proj.weight in the checkpoint, gate rows first)
//   P layers.i.mlp.down_proj.weight     -> same name, row-parallel
//   P layers.i.{input,post_attention}_layernorm.weight, P norm.weight -> replicated
//   lm_head.weight [V, H] (or P embed_tokens.weight when tied) -> lm_head.weight vocab-parallel
#pragma once

#include <string>

#include "models/builder.h"

namespace ferry::models {

// Dimensions of a decoder-only transformer, read from config fields under `prefix`
// ("" or "text_config."): hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads (default: heads), head_dim (default: hidden / heads),
// intermediate_size (required only when `need_intermediate`), vocab_size,
// tie_word_embeddings (default false).
struct DenseDims {
  int64_t hidden = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  int64_t vocab = 0;
  bool tie_embeddings = false;

  static Result<DenseDims> from(const ModelConfig& cfg, const std::string& prefix = "", bool need_intermediate = true);
  QkvGeometry qkv(Split tp) const { return QkvGeometry{heads, kv_heads, head_dim, tp}; }
};

struct DenseOptions {
  std::string prefix = "model.";
  bool qkv_bias = false;       // q/k/v biases (Qwen2; Llama attention_bias)
  bool o_bias = false;         // o_proj bias (Llama attention_bias)
  bool mlp_bias = false;       // gate/up/down biases (Llama mlp_bias)
  bool qk_norm = false;        // q_norm / k_norm [head_dim] (Qwen3)
  bool fused_qkv = false;      // the checkpoint holds qkv_proj (Phi-3)
  bool fused_gate_up = false;  // the checkpoint holds gate_up_proj (Phi-3)
};

// Layout checks for attention, vocab and the dense MLP (errors name the config field).
Status validate_dense(const ModelConfig& cfg, const DenseDims& d, const InferenceLayout& layout,
                      bool check_intermediate = true);

// Checkpoint declarations.
Status declare_embedding(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o);
Status declare_attention(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer);
Status declare_layer_norms(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer);
// mlp_prefix: "mlp." (dense), or e.g. "mlp.shared_experts." for DeepSeek's shared experts.
Status declare_dense_mlp(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer,
                         int64_t intermediate, const std::string& mlp_prefix = "mlp.");
Status declare_final(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o);
// All of the above for every layer (a dense model).
Status declare_dense_model(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o);

// Rank builds (groups: ModelLoaderBase's convention).
Status build_embedding(RankBuilder& b, const DenseDims& d, const DenseOptions& o);
Status build_attention(RankBuilder& b, const DenseDims& d, const DenseOptions& o, int layer);
Status build_layer_norms(RankBuilder& b, const DenseDims& d, const DenseOptions& o, int layer);
Status build_dense_mlp(RankBuilder& b, const DenseDims& d, const DenseOptions& o, int layer, int64_t intermediate,
                       Split split, const std::string& mlp_prefix = "mlp.");
Status build_final(RankBuilder& b, const DenseDims& d, const DenseOptions& o);
Status build_dense_model(RankBuilder& b, const DenseDims& d, const DenseOptions& o);

// A whole dense Llama-family model: the loader of Llama, Qwen2, Qwen3 and Phi-3.
class DenseLoader : public ModelLoaderBase {
 public:
  DenseLoader(ModelConfig cfg, InferenceLayout layout, LoaderOptions opts, DenseDims dims, DenseOptions dense)
      : ModelLoaderBase(std::move(cfg), layout, opts), dims_(dims), dense_(std::move(dense)) {}
  int num_layers() const override { return static_cast<int>(dims_.layers); }

 protected:
  Status declare_checkpoint(CheckpointBuilder& c) const override { return declare_dense_model(c, dims_, dense_); }
  Status build_rank(RankBuilder& b) const override { return build_dense_model(b, dims_, dense_); }

 private:
  DenseDims dims_;
  DenseOptions dense_;
};

// Reads dims, validates the layout and makes a DenseLoader.
Result<std::unique_ptr<ModelLoader>> make_dense_loader(const ModelConfig& cfg, const InferenceLayout& layout,
                                                       const LoaderOptions& opts, const DenseOptions& dense);

}  // namespace ferry::models
