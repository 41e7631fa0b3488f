// Qwen2ForCausalLM (vLLM: model_executor/models/qwen2.py).
// As Llama, with biases on q/k/v (always; no config flag) that follow their weights'
// sharding into qkv_proj.bias; o_proj and the MLP have none.
#include "models/archs.h"
#include "models/dense.h"

namespace ferry::models {

ArchEntry qwen2_arch() {
  return ArchEntry{
      "Qwen2ForCausalLM",
      [](const ModelConfig& cfg, const InferenceLayout& layout,
         const LoaderOptions& opts) -> Result<std::unique_ptr<ModelLoader>> {
        DenseOptions o;
        o.qkv_bias = true;
        return make_dense_loader(cfg, layout, opts, o);
      },
      nullptr,
  };
}

}  // namespace ferry::models
