// LlamaForCausalLM (vLLM: model_executor/models/llama.py).
// Checkpoint: model.embed_tokens, model.layers.{i}.self_attn.{q,k,v,o}_proj (biases when
// attention_bias), model.layers.{i}.mlp.{gate,up,down}_proj (biases when mlp_bias), norms,
// lm_head (absent when tie_word_embeddings). Params: qkv_proj and gate_up_proj fused.
#include "models/archs.h"
#include "models/dense.h"

namespace ferry::models {

ArchEntry llama_arch() {
  return ArchEntry{
      "LlamaForCausalLM",
      [](const ModelConfig& cfg, const InferenceLayout& layout,
         const LoaderOptions& opts) -> Result<std::unique_ptr<ModelLoader>> {
        DenseOptions o;
        FERRY_ASSIGN_OR_RETURN(bool attention_bias, cfg.get_bool_or("attention_bias", false));
        FERRY_ASSIGN_OR_RETURN(o.mlp_bias, cfg.get_bool_or("mlp_bias", false));
        o.qkv_bias = o.o_bias = attention_bias;
        return make_dense_loader(cfg, layout, opts, o);
      },
      nullptr,
  };
}

}  // namespace ferry::models
