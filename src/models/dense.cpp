// Llama-family decoder pieces (see dense.h).
#include "models/dense.h"

namespace ferry::models {

namespace {
std::string layer_prefix(const DenseOptions& o, int layer) { return fmt::format("{}layers.{}.", o.prefix, layer); }
}  // namespace

Result<DenseDims> DenseDims::from(const ModelConfig& cfg, const std::string& prefix, bool need_intermediate) {
  DenseDims d;
  auto f = [&](const char* name) { return prefix + name; };
  FERRY_ASSIGN_OR_RETURN(d.hidden, cfg.get_int(f("hidden_size")));
  FERRY_ASSIGN_OR_RETURN(d.layers, cfg.get_int(f("num_hidden_layers")));
  FERRY_ASSIGN_OR_RETURN(d.heads, cfg.get_int(f("num_attention_heads")));
  FERRY_ASSIGN_OR_RETURN(d.kv_heads, cfg.get_int_or(f("num_key_value_heads"), d.heads));
  FERRY_ASSIGN_OR_RETURN(d.vocab, cfg.get_int(f("vocab_size")));
  if (need_intermediate) {
    FERRY_ASSIGN_OR_RETURN(d.intermediate, cfg.get_int(f("intermediate_size")));
  } else {
    FERRY_ASSIGN_OR_RETURN(d.intermediate, cfg.get_int_or(f("intermediate_size"), 0));
  }
  FERRY_ASSIGN_OR_RETURN(d.tie_embeddings, cfg.get_bool_or(f("tie_word_embeddings"), false));
  struct Pos {
    const char* name;
    int64_t v;
  };
  for (const Pos& p : {Pos{"hidden_size", d.hidden}, Pos{"num_hidden_layers", d.layers},
                       Pos{"num_attention_heads", d.heads}, Pos{"num_key_value_heads", d.kv_heads},
                       Pos{"vocab_size", d.vocab}}) {
    if (p.v <= 0) return invalid_argument("{}: field '{}' must be positive, got {}", cfg.path(), f(p.name), p.v);
  }
  if (need_intermediate && d.intermediate <= 0) {
    return invalid_argument("{}: field '{}' must be positive, got {}", cfg.path(), f("intermediate_size"), d.intermediate);
  }
  if (d.layers > 100000) return invalid_argument("{}: field '{}' = {} is implausible", cfg.path(), f("num_hidden_layers"), d.layers);
  if (cfg.has(f("head_dim"))) {
    FERRY_ASSIGN_OR_RETURN(d.head_dim, cfg.get_int(f("head_dim")));
    if (d.head_dim <= 0) return invalid_argument("{}: field '{}' must be positive, got {}", cfg.path(), f("head_dim"), d.head_dim);
  } else {
    if (d.hidden % d.heads != 0) {
      return invalid_argument("{}: hidden_size {} is not divisible by num_attention_heads {} (and no head_dim)", cfg.path(),
                              d.hidden, d.heads);
    }
    d.head_dim = d.hidden / d.heads;
  }
  return d;
}

Status validate_dense(const ModelConfig& cfg, const DenseDims& d, const InferenceLayout& layout,
                      bool check_intermediate) {
  FERRY_RETURN_IF_ERROR(d.qkv(Split{0, layout.tp}).validate().with_context(cfg.path()));
  const int64_t padded = padded_vocab(d.vocab);
  if (padded % layout.tp != 0) {
    return invalid_argument("vocab_size {} padded to {} is not divisible by tp {} ({})", d.vocab, padded, layout.tp,
                            cfg.path());
  }
  if (check_intermediate) FERRY_RETURN_IF_ERROR(require_divisible(cfg, "intermediate_size", d.intermediate, "tp", layout.tp));
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Checkpoint

Status declare_embedding(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o) {
  return c.add(o.prefix + "embed_tokens.weight", {d.vocab, d.hidden});
}

Status declare_attention(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer) {
  const std::string p = layer_prefix(o, layer) + "self_attn.";
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  if (o.fused_qkv) {
    FERRY_RETURN_IF_ERROR(c.add(p + "qkv_proj.weight", {q + 2 * kv, d.hidden}));
    if (o.qkv_bias) FERRY_RETURN_IF_ERROR(c.add(p + "qkv_proj.bias", {q + 2 * kv}));
  } else {
    FERRY_RETURN_IF_ERROR(c.add(p + "q_proj.weight", {q, d.hidden}));
    if (o.qkv_bias) FERRY_RETURN_IF_ERROR(c.add(p + "q_proj.bias", {q}));
    FERRY_RETURN_IF_ERROR(c.add(p + "k_proj.weight", {kv, d.hidden}));
    if (o.qkv_bias) FERRY_RETURN_IF_ERROR(c.add(p + "k_proj.bias", {kv}));
    FERRY_RETURN_IF_ERROR(c.add(p + "v_proj.weight", {kv, d.hidden}));
    if (o.qkv_bias) FERRY_RETURN_IF_ERROR(c.add(p + "v_proj.bias", {kv}));
  }
  FERRY_RETURN_IF_ERROR(c.add(p + "o_proj.weight", {d.hidden, q}));
  if (o.o_bias) FERRY_RETURN_IF_ERROR(c.add(p + "o_proj.bias", {d.hidden}));
  if (o.qk_norm) {
    FERRY_RETURN_IF_ERROR(c.add(p + "q_norm.weight", {d.head_dim}));
    FERRY_RETURN_IF_ERROR(c.add(p + "k_norm.weight", {d.head_dim}));
  }
  return Status::Ok();
}

Status declare_layer_norms(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer) {
  const std::string p = layer_prefix(o, layer);
  FERRY_RETURN_IF_ERROR(c.add(p + "input_layernorm.weight", {d.hidden}));
  return c.add(p + "post_attention_layernorm.weight", {d.hidden});
}

Status declare_dense_mlp(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer,
                         int64_t intermediate, const std::string& mlp_prefix) {
  const std::string p = layer_prefix(o, layer) + mlp_prefix;
  if (o.fused_gate_up) {
    FERRY_RETURN_IF_ERROR(c.add(p + "gate_up_proj.weight", {2 * intermediate, d.hidden}));
    if (o.mlp_bias) FERRY_RETURN_IF_ERROR(c.add(p + "gate_up_proj.bias", {2 * intermediate}));
  } else {
    FERRY_RETURN_IF_ERROR(c.add(p + "gate_proj.weight", {intermediate, d.hidden}));
    if (o.mlp_bias) FERRY_RETURN_IF_ERROR(c.add(p + "gate_proj.bias", {intermediate}));
    FERRY_RETURN_IF_ERROR(c.add(p + "up_proj.weight", {intermediate, d.hidden}));
    if (o.mlp_bias) FERRY_RETURN_IF_ERROR(c.add(p + "up_proj.bias", {intermediate}));
  }
  FERRY_RETURN_IF_ERROR(c.add(p + "down_proj.weight", {d.hidden, intermediate}));
  if (o.mlp_bias) FERRY_RETURN_IF_ERROR(c.add(p + "down_proj.bias", {d.hidden}));
  return Status::Ok();
}

Status declare_final(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o) {
  FERRY_RETURN_IF_ERROR(c.add(o.prefix + "norm.weight", {d.hidden}));
  if (!d.tie_embeddings) FERRY_RETURN_IF_ERROR(c.add("lm_head.weight", {d.vocab, d.hidden}));
  return Status::Ok();
}

Status declare_dense_model(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o) {
  FERRY_RETURN_IF_ERROR(declare_embedding(c, d, o));
  for (int i = 0; i < d.layers; ++i) {
    FERRY_RETURN_IF_ERROR(declare_layer_norms(c, d, o, i));
    FERRY_RETURN_IF_ERROR(declare_attention(c, d, o, i));
    FERRY_RETURN_IF_ERROR(declare_dense_mlp(c, d, o, i, d.intermediate));
  }
  return declare_final(c, d, o);
}

// ---------------------------------------------------------------------------------------
// Rank

Status build_embedding(RankBuilder& b, const DenseDims& d, const DenseOptions& o) {
  const std::string name = o.prefix + "embed_tokens.weight";
  return b.vocab_parallel(name, name, d.vocab, ModelLoaderBase::embedding_group(), b.tp());
}

Status build_attention(RankBuilder& b, const DenseDims& d, const DenseOptions& o, int layer) {
  const std::string p = layer_prefix(o, layer) + "self_attn.";
  const int g = ModelLoaderBase::layer_group(layer);
  const QkvGeometry geo = d.qkv(b.tp());
  if (o.fused_qkv) {
    FERRY_RETURN_IF_ERROR(b.qkv_fused(p + "qkv_proj.weight", p + "qkv_proj.weight", geo, g));
    if (o.qkv_bias) FERRY_RETURN_IF_ERROR(b.qkv_fused(p + "qkv_proj.bias", p + "qkv_proj.bias", geo, g));
  } else {
    FERRY_RETURN_IF_ERROR(b.qkv(p + "qkv_proj.weight", {p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"}, geo, g));
    if (o.qkv_bias) {
      FERRY_RETURN_IF_ERROR(b.qkv(p + "qkv_proj.bias", {p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias"}, geo, g));
    }
  }
  FERRY_RETURN_IF_ERROR(b.row_parallel(p + "o_proj.weight", p + "o_proj.weight", g, b.tp()));
  if (o.o_bias) FERRY_RETURN_IF_ERROR(b.replicated(p + "o_proj.bias", p + "o_proj.bias", g));
  if (o.qk_norm) {
    FERRY_RETURN_IF_ERROR(b.replicated(p + "q_norm.weight", p + "q_norm.weight", g));
    FERRY_RETURN_IF_ERROR(b.replicated(p + "k_norm.weight", p + "k_norm.weight", g));
  }
  return Status::Ok();
}

Status build_layer_norms(RankBuilder& b, const DenseDims&, const DenseOptions& o, int layer) {
  const std::string p = layer_prefix(o, layer);
  const int g = ModelLoaderBase::layer_group(layer);
  FERRY_RETURN_IF_ERROR(b.replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", g));
  return b.replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", g);
}

Status build_dense_mlp(RankBuilder& b, const DenseDims&, const DenseOptions& o, int layer, int64_t intermediate,
                       Split split, const std::string& mlp_prefix) {
  const std::string p = layer_prefix(o, layer) + mlp_prefix;
  const int g = ModelLoaderBase::layer_group(layer);
  if (o.fused_gate_up) {
    FERRY_RETURN_IF_ERROR(
        b.merged_column_fused(p + "gate_up_proj.weight", p + "gate_up_proj.weight", {intermediate, intermediate}, g, split));
    if (o.mlp_bias) {
      FERRY_RETURN_IF_ERROR(
          b.merged_column_fused(p + "gate_up_proj.bias", p + "gate_up_proj.bias", {intermediate, intermediate}, g, split));
    }
  } else {
    FERRY_RETURN_IF_ERROR(b.merged_column(p + "gate_up_proj.weight", {p + "gate_proj.weight", p + "up_proj.weight"}, g, split));
    if (o.mlp_bias) {
      FERRY_RETURN_IF_ERROR(b.merged_column(p + "gate_up_proj.bias", {p + "gate_proj.bias", p + "up_proj.bias"}, g, split));
    }
  }
  FERRY_RETURN_IF_ERROR(b.row_parallel(p + "down_proj.weight", p + "down_proj.weight", g, split));
  if (o.mlp_bias) FERRY_RETURN_IF_ERROR(b.replicated(p + "down_proj.bias", p + "down_proj.bias", g));
  return Status::Ok();
}

Status build_final(RankBuilder& b, const DenseDims& d, const DenseOptions& o) {
  const int g = b.final_group();
  FERRY_RETURN_IF_ERROR(b.replicated(o.prefix + "norm.weight", o.prefix + "norm.weight", g));
  // Tied embeddings: there is no lm_head.weight; the lm_head param loads from embed_tokens.
  const std::string src = d.tie_embeddings ? o.prefix + "embed_tokens.weight" : "lm_head.weight";
  return b.vocab_parallel("lm_head.weight", src, d.vocab, g, b.tp());
}

Status build_dense_model(RankBuilder& b, const DenseDims& d, const DenseOptions& o) {
  FERRY_RETURN_IF_ERROR(build_embedding(b, d, o));
  for (int i = 0; i < d.layers; ++i) {
    FERRY_RETURN_IF_ERROR(build_layer_norms(b, d, o, i));
    FERRY_RETURN_IF_ERROR(build_attention(b, d, o, i));
    FERRY_RETURN_IF_ERROR(build_dense_mlp(b, d, o, i, d.intermediate, b.tp()));
  }
  return build_final(b, d, o);
}

Result<std::unique_ptr<ModelLoader>> make_dense_loader(const ModelConfig& cfg, const InferenceLayout& layout,
                                                       const LoaderOptions& opts, const DenseOptions& dense) {
  FERRY_ASSIGN_OR_RETURN(DenseDims d, DenseDims::from(cfg));
  FERRY_RETURN_IF_ERROR(validate_dense(cfg, d, layout));
  return make_loader<DenseLoader>(cfg, layout, opts, d, dense);
}

}  // namespace ferry::models
