// Phi3ForCausalLM (vLLM: model_executor/models/phi3.py, a Llama with a fused checkpoint).
// The checkpoint already holds self_attn.qkv_proj.weight [(nq + 2 nkv) hd, H] (rows q, k,
// v) and mlp.gate_up_proj.weight [2I, H] (gate rows first): each rank slices its q, k and
// v heads (kv replicated when tp > nkv) and its gate and up rows out of the fused source,
// as vLLM's QKVParallelLinear / MergedColumnParallelLinear weight_loader do with
// loaded_shard_id None.
#include "models/archs.h"
#include "models/dense.h"

namespace ferry::models {

ArchEntry phi3_arch() {
  return ArchEntry{
      "Phi3ForCausalLM",
      [](const ModelConfig& cfg, const InferenceLayout& layout,
         const LoaderOptions& opts) -> Result<std::unique_ptr<ModelLoader>> {
        DenseOptions o;
        o.fused_qkv = true;
        o.fused_gate_up = true;
        return make_dense_loader(cfg, layout, opts, o);
      },
      nullptr,
  };
}

}  // namespace ferry::models
