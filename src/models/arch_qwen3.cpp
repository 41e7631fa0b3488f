// Qwen3ForCausalLM (vLLM: model_executor/models/qwen3.py).
// As Llama (attention_bias honoured, false in released models) plus per-head RMSNorms
// self_attn.q_norm.weight and self_attn.k_norm.weight [head_dim], replicated on every
// rank; head_dim is explicit in the config (128) and independent of hidden_size.
#include "models/archs.h"
#include "models/dense.h"

namespace ferry::models {

ArchEntry qwen3_arch() {
  return ArchEntry{
      "Qwen3ForCausalLM",
      [](const ModelConfig& cfg, const InferenceLayout& layout,
         const LoaderOptions& opts) -> Result<std::unique_ptr<ModelLoader>> {
        DenseOptions o;
        FERRY_ASSIGN_OR_RETURN(bool attention_bias, cfg.get_bool_or("attention_bias", false));
        o.qkv_bias = attention_bias;
        o.qk_norm = true;
        return make_dense_loader(cfg, layout, opts, o);
      },
      nullptr,
  };
}

}  // namespace ferry::models
