// Pieces shared by the MoE / MLA architectures (see moe.h).
#include "models/moe.h"

#include <numeric>

#include <nlohmann/json.hpp>

namespace ferry::models {

namespace {

Result<Tensor> param_of(const TensorMap& params, const std::string& name) {
  auto it = params.find(name);
  if (it == params.end()) return not_found("param '{}' is not in the params given to load()", name);
  return it->second;
}

std::string weight(const std::string& module) { return module + ".weight"; }
std::string scale(const std::string& module) { return module + ".weight_scale_inv"; }

}  // namespace

// ---------------------------------------------------------------------------------------
// FP8 checkpoints

Result<Fp8Checkpoint> Fp8Checkpoint::from(const ModelConfig& cfg) {
  Fp8Checkpoint f;
  const nlohmann::json& j = cfg.json();
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return f;
  if (!it->is_object()) return invalid_argument("{}: field 'quantization_config' must be an object", cfg.path());
  FERRY_ASSIGN_OR_RETURN(std::string method, cfg.get_string_or("quantization_config.quant_method", ""));
  if (method != "fp8") {
    return invalid_argument("{}: quantization_config.quant_method '{}' is not supported (only fp8 block checkpoints)",
                            cfg.path(), method);
  }
  FERRY_ASSIGN_OR_RETURN(std::string fmt_name, cfg.get_string_or("quantization_config.fmt", "e4m3"));
  if (fmt_name != "e4m3") {
    return invalid_argument("{}: quantization_config.fmt '{}' is not supported (only e4m3)", cfg.path(), fmt_name);
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<int64_t> block, cfg.get_int_list_or("quantization_config.weight_block_size", {}));
  if (block != std::vector<int64_t>{kFp8Block, kFp8Block}) {
    return invalid_argument("{}: quantization_config.weight_block_size must be [128, 128] (per-tensor FP8 is not supported)",
                            cfg.path());
  }
  if (auto m = it->find("modules_to_not_convert"); m != it->end() && !m->is_null()) {
    if (!m->is_array()) {
      return invalid_argument("{}: field 'quantization_config.modules_to_not_convert' must be a list", cfg.path());
    }
    for (const auto& e : *m) {
      if (!e.is_string()) {
        return invalid_argument("{}: field 'quantization_config.modules_to_not_convert' must hold strings", cfg.path());
      }
      f.not_converted.push_back(e.get<std::string>());
    }
  }
  f.enabled = true;
  return f;
}

bool Fp8Checkpoint::quantized(const std::string& module) const {
  if (!enabled) return false;
  for (const auto& m : not_converted) {
    if (module == m || (module.size() > m.size() && module.compare(0, m.size(), m) == 0 && module[m.size()] == '.')) {
      return false;
    }
  }
  return true;
}

Status declare_linear(CheckpointBuilder& c, const std::string& module, int64_t out, int64_t in, bool fp8) {
  if (!fp8) return c.add(weight(module), {out, in});
  FERRY_RETURN_IF_ERROR(c.add(weight(module), {out, in}, DType::kF8E4M3));
  return c.add(scale(module), {ceil_div(out, kFp8Block), ceil_div(in, kFp8Block)}, DType::kF32);
}

// ---------------------------------------------------------------------------------------
// Linears assembled from parts

Status build_linear(RankBuilder& b, const std::string& param, const std::vector<LinearPart>& parts, int64_t dim,
                    int group, bool fp8, bool quantizable) {
  if (parts.empty() || (dim != 0 && dim != 1)) return internal_error("build_linear '{}': no parts or dim {}", param, dim);
  const int64_t other = 1 - dim;
  struct Placed {
    std::string w, s;
    Range range;
    int64_t offset = 0;
    Range blocks;
    int64_t block_offset = 0;
  };
  std::vector<Placed> placed;
  Shape shape, scale_shape;
  DType dtype = DType::kBF16;
  int64_t total = 0, block_total = 0;
  for (const LinearPart& part : parts) {
    Placed p;
    p.w = weight(part.module);
    p.range = part.range;
    FERRY_ASSIGN_OR_RETURN(TensorDecl w, b.source(p.w));
    if (w.shape.size() != 2) return internal_error("build_linear '{}': source {} is not 2-D", param, p.w);
    if (part.range.start < 0 || part.range.length <= 0 || part.range.end() > w.shape[static_cast<size_t>(dim)]) {
      return internal_error("build_linear '{}': range [{}, {}) outside dim {} of {} {}", param, part.range.start,
                            part.range.end(), dim, p.w, shape_str(w.shape));
    }
    if (shape.empty()) {
      shape = w.shape;
      dtype = w.dtype;
    } else if (w.shape[static_cast<size_t>(other)] != shape[static_cast<size_t>(other)] || w.dtype != dtype) {
      return internal_error("build_linear '{}': part {} {} {} does not fit the others", param, p.w, shape_str(w.shape),
                            dtype_name(w.dtype));
    }
    p.offset = total;
    total += part.range.length;
    if (fp8) {
      p.s = scale(part.module);
      FERRY_ASSIGN_OR_RETURN(TensorDecl s, b.source(p.s));
      p.blocks = block_shard(part.range);
      p.block_offset = block_total;
      block_total += p.blocks.length;
      if (scale_shape.empty()) scale_shape = s.shape;
    }
    placed.push_back(std::move(p));
  }
  shape[static_cast<size_t>(dim)] = total;
  const std::string wname = weight(param), sname = scale(param);
  FERRY_RETURN_IF_ERROR(b.param(wname, shape, dtype, group, quantizable && !fp8));
  if (fp8) {
    scale_shape[static_cast<size_t>(dim)] = block_total;
    FERRY_RETURN_IF_ERROR(b.param(sname, scale_shape, DType::kF32, group, false));
  }
  for (const Placed& p : placed) {
    FERRY_RETURN_IF_ERROR(b.route(p.w, {wname}, [wname, p, dim](const Tensor& src, const TensorMap& params) -> Status {
      FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, wname));
      return t.narrow(dim, p.offset, p.range.length).copy_(src.narrow(dim, p.range.start, p.range.length));
    }));
    if (!fp8) continue;
    FERRY_RETURN_IF_ERROR(b.route(p.s, {sname}, [sname, p, dim](const Tensor& src, const TensorMap& params) -> Status {
      FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, sname));
      return load_scale_split(t.narrow(dim, p.block_offset, p.blocks.length), src, dim, p.range);
    }));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// FP8 attention and MLPs

namespace {
std::string layer_prefix(const DenseOptions& o, int layer) { return fmt::format("{}layers.{}.", o.prefix, layer); }

Result<bool> uniform_fp8(const Fp8Checkpoint& fp8, const std::vector<std::string>& modules) {
  const bool q = fp8.quantized(modules.front());
  for (const auto& m : modules) {
    if (fp8.quantized(m) != q) {
      return invalid_argument("modules_to_not_convert lists some but not all of the fused modules {} (vLLM requires all or none)",
                              fmt::format("{}", fmt::join(modules, ", ")));
    }
  }
  return q;
}
}  // namespace

Status declare_fp8_attention(CheckpointBuilder& c, const DenseDims& d, const DenseOptions& o, int layer,
                             const Fp8Checkpoint& fp8) {
  if (o.qkv_bias || o.o_bias || o.fused_qkv) {
    return unimplemented("FP8 checkpoints with attention biases or a fused qkv_proj are not supported");
  }
  const std::string p = layer_prefix(o, layer) + "self_attn.";
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim;
  FERRY_RETURN_IF_ERROR(declare_linear(c, p + "q_proj", q, d.hidden, fp8.quantized(p + "q_proj")));
  FERRY_RETURN_IF_ERROR(declare_linear(c, p + "k_proj", kv, d.hidden, fp8.quantized(p + "k_proj")));
  FERRY_RETURN_IF_ERROR(declare_linear(c, p + "v_proj", kv, d.hidden, fp8.quantized(p + "v_proj")));
  FERRY_RETURN_IF_ERROR(declare_linear(c, p + "o_proj", d.hidden, q, fp8.quantized(p + "o_proj")));
  if (o.qk_norm) {
    FERRY_RETURN_IF_ERROR(c.add(p + "q_norm.weight", {d.head_dim}));
    FERRY_RETURN_IF_ERROR(c.add(p + "k_norm.weight", {d.head_dim}));
  }
  return Status::Ok();
}

Status build_fp8_attention(RankBuilder& b, const DenseDims& d, const DenseOptions& o, int layer,
                           const Fp8Checkpoint& fp8) {
  const std::string p = layer_prefix(o, layer) + "self_attn.";
  const int g = ModelLoaderBase::layer_group(layer);
  const QkvGeometry geo = d.qkv(b.tp());
  const int64_t q_rows = geo.q_heads_local() * d.head_dim, kv_rows = geo.kv_heads_local() * d.head_dim;
  const Range q{b.tp().rank * q_rows, q_rows}, kv{geo.kv_head_start() * d.head_dim, kv_rows};
  FERRY_ASSIGN_OR_RETURN(bool qkv_fp8, uniform_fp8(fp8, {p + "q_proj", p + "k_proj", p + "v_proj"}));
  FERRY_RETURN_IF_ERROR(
      build_linear(b, p + "qkv_proj", {{p + "q_proj", q}, {p + "k_proj", kv}, {p + "v_proj", kv}}, 0, g, qkv_fp8));
  FERRY_RETURN_IF_ERROR(build_linear(b, p + "o_proj", {{p + "o_proj", even_shard(d.heads * d.head_dim, b.tp())}}, 1, g,
                                     fp8.quantized(p + "o_proj")));
  if (o.qk_norm) {
    FERRY_RETURN_IF_ERROR(b.replicated(p + "q_norm.weight", p + "q_norm.weight", g));
    FERRY_RETURN_IF_ERROR(b.replicated(p + "k_norm.weight", p + "k_norm.weight", g));
  }
  return Status::Ok();
}

Status declare_mlp(CheckpointBuilder& c, const std::string& mp, int64_t hidden, int64_t intermediate,
                   const Fp8Checkpoint& fp8) {
  FERRY_RETURN_IF_ERROR(declare_linear(c, mp + "gate_proj", intermediate, hidden, fp8.quantized(mp + "gate_proj")));
  FERRY_RETURN_IF_ERROR(declare_linear(c, mp + "up_proj", intermediate, hidden, fp8.quantized(mp + "up_proj")));
  return declare_linear(c, mp + "down_proj", hidden, intermediate, fp8.quantized(mp + "down_proj"));
}

Status build_mlp(RankBuilder& b, const std::string& mp, int64_t intermediate, int group, Split split,
                 const Fp8Checkpoint& fp8, const std::string& param_prefix) {
  if (intermediate % split.size != 0) {
    return invalid_argument("{}: intermediate size {} is not divisible by {} ranks", mp, intermediate, split.size);
  }
  const std::string pp = param_prefix.empty() ? mp : param_prefix;
  const Range r = even_shard(intermediate, split);
  FERRY_ASSIGN_OR_RETURN(bool gu_fp8, uniform_fp8(fp8, {mp + "gate_proj", mp + "up_proj"}));
  FERRY_RETURN_IF_ERROR(build_linear(b, pp + "gate_up_proj", {{mp + "gate_proj", r}, {mp + "up_proj", r}}, 0, group, gu_fp8));
  return build_linear(b, pp + "down_proj", {{mp + "down_proj", r}}, 1, group, fp8.quantized(mp + "down_proj"));
}

// ---------------------------------------------------------------------------------------
// Routed experts

Status validate_experts(const ModelConfig& cfg, const InferenceLayout& layout, std::string_view experts_field,
                        int64_t experts, std::string_view intermediate_field, int64_t intermediate,
                        int64_t moe_layers, int64_t tensors_per_linear) {
  if (experts <= 0) return invalid_argument("{}: field '{}' must be positive, got {}", cfg.path(), experts_field, experts);
  if (intermediate <= 0) {
    return invalid_argument("{}: field '{}' must be positive, got {}", cfg.path(), intermediate_field, intermediate);
  }
  // The declarations' cost, from the counts alone (in double: no int64 product to
  // overflow, and exact far past the limit).
  const double tensors = static_cast<double>(moe_layers) * static_cast<double>(experts) * 3.0 *
                         static_cast<double>(tensors_per_linear);
  if (tensors > static_cast<double>(kMaxCheckpointTensors)) {
    return invalid_argument("{}: field '{}' = {} is implausible: {} MoE layers x {} experts x {} tensors each would "
                            "declare {:.0f} checkpoint tensors (~{:.1f} GB of metadata before any other work), over "
                            "ferry's limit of {} (the largest real MoE checkpoints declare ~140k)",
                            cfg.path(), experts_field, experts, moe_layers, experts, 3 * tensors_per_linear, tensors,
                            tensors * 512 / 1e9, kMaxCheckpointTensors);
  }
  FERRY_RETURN_IF_ERROR(require_divisible(cfg, experts_field, experts, "ep", layout.ep));
  if (layout.ep > 1) return Status::Ok();
  return require_divisible(cfg, intermediate_field, intermediate, "the expert TP size (tp*dp without EP)",
                           layout.engine_size());
}

Status declare_experts(CheckpointBuilder& c, const std::string& src_prefix, const ExpertNames& names,
                       const ExpertDims& d, const Fp8Checkpoint& fp8) {
  for (int64_t e = 0; e < d.experts; ++e) {
    const std::string p = fmt::format("{}{}.", src_prefix, e);
    FERRY_RETURN_IF_ERROR(declare_linear(c, p + names.gate, d.intermediate, d.hidden, fp8.quantized(p + names.gate)));
    FERRY_RETURN_IF_ERROR(declare_linear(c, p + names.up, d.intermediate, d.hidden, fp8.quantized(p + names.up)));
    FERRY_RETURN_IF_ERROR(declare_linear(c, p + names.down, d.hidden, d.intermediate, fp8.quantized(p + names.down)));
  }
  return Status::Ok();
}

Status build_experts(RankBuilder& b, const std::string& param_prefix, const std::string& src_prefix,
                     const ExpertNames& names, const ExpertDims& d, int group, const Fp8Checkpoint& fp8) {
  const Range local = expert_range(b.info(), d.experts);
  const Split split = expert_split(b.info());
  const int64_t il = d.intermediate / split.size;
  const Range shard = even_shard(d.intermediate, split);
  const Range blocks = block_shard(shard);
  const std::string first = fmt::format("{}0.", src_prefix);
  FERRY_ASSIGN_OR_RETURN(const bool q, uniform_fp8(fp8, {first + names.gate, first + names.up, first + names.down}));
  FERRY_ASSIGN_OR_RETURN(TensorDecl g0, b.source(weight(first + names.gate)));
  const std::string w13 = param_prefix + "w13_weight", w2 = param_prefix + "w2_weight";
  const std::string s13 = param_prefix + "w13_weight_scale_inv", s2 = param_prefix + "w2_weight_scale_inv";
  FERRY_RETURN_IF_ERROR(b.param(w13, {local.length, 2 * il, d.hidden}, g0.dtype, group, !q));
  FERRY_RETURN_IF_ERROR(b.param(w2, {local.length, d.hidden, il}, g0.dtype, group, !q));
  const int64_t hb = ceil_div(d.hidden, kFp8Block);
  if (q) {
    FERRY_RETURN_IF_ERROR(b.param(s13, {local.length, 2 * blocks.length, hb}, DType::kF32, group));
    FERRY_RETURN_IF_ERROR(b.param(s2, {local.length, hb, blocks.length}, DType::kF32, group));
  }
  const int64_t inter = d.intermediate;
  for (int64_t e = local.start; e < local.end(); ++e) {
    const std::string p = fmt::format("{}{}.", src_prefix, e);
    for (const std::string* m : {&names.gate, &names.up, &names.down}) {
      if (fp8.quantized(p + *m) != q) {
        return invalid_argument("modules_to_not_convert must list every expert or none ({} differs from expert 0)", p + *m);
      }
    }
    for (int shard_id = 0; shard_id < 2; ++shard_id) {
      const std::string& m = shard_id == 0 ? names.gate : names.up;
      FERRY_RETURN_IF_ERROR(b.route(weight(p + m), {w13}, [=](const Tensor& src, const TensorMap& params) -> Status {
        FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, w13));
        return load_expert_w13(t, src, e, local, shard_id, inter, split);
      }));
      if (!q) continue;
      FERRY_RETURN_IF_ERROR(b.route(scale(p + m), {s13}, [=](const Tensor& src, const TensorMap& params) -> Status {
        FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, s13));
        return load_scale_split(t.select(0, e - local.start).narrow(0, shard_id * blocks.length, blocks.length), src, 0,
                                shard);
      }));
    }
    FERRY_RETURN_IF_ERROR(b.route(weight(p + names.down), {w2}, [=](const Tensor& src, const TensorMap& params) -> Status {
      FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, w2));
      return load_expert_w2(t, src, e, local, split);
    }));
    if (!q) continue;
    FERRY_RETURN_IF_ERROR(b.route(scale(p + names.down), {s2}, [=](const Tensor& src, const TensorMap& params) -> Status {
      FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, s2));
      return load_scale_split(t.select(0, e - local.start), src, 1, shard);
    }));
  }
  return Status::Ok();
}

Status declare_fused_transposed_experts(CheckpointBuilder& c, const std::string& src_prefix, const ExpertDims& d) {
  FERRY_RETURN_IF_ERROR(c.add(src_prefix + "gate_up_proj", {d.experts, d.hidden, 2 * d.intermediate}));
  return c.add(src_prefix + "down_proj", {d.experts, d.intermediate, d.hidden});
}

Status build_fused_transposed_experts(RankBuilder& b, const std::string& param_prefix, const std::string& src_prefix,
                                      const ExpertDims& d, int group) {
  const Range local = expert_range(b.info(), d.experts);
  const Split split = expert_split(b.info());
  const int64_t il = d.intermediate / split.size, inter = d.intermediate;
  FERRY_ASSIGN_OR_RETURN(TensorDecl gu, b.source(src_prefix + "gate_up_proj"));
  const std::string w13 = param_prefix + "w13_weight", w2 = param_prefix + "w2_weight";
  FERRY_RETURN_IF_ERROR(b.param(w13, {local.length, 2 * il, d.hidden}, gu.dtype, group, true));
  FERRY_RETURN_IF_ERROR(b.param(w2, {local.length, d.hidden, il}, gu.dtype, group, true));
  // gate_up_proj [E, H, 2I]: this rank's experts, transposed to [E_local, 2I, H]; gate is
  // rows [0, I), up rows [I, 2I); each keeps its TP shard, w13 rows [gate | up].
  FERRY_RETURN_IF_ERROR(b.route(src_prefix + "gate_up_proj", {w13}, [=](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, w13));
    const Tensor mine = src.narrow(0, local.start, local.length).transpose(1, 2);
    FERRY_RETURN_IF_ERROR(t.narrow(1, 0, il).copy_(mine.narrow(1, split.rank * il, il)));
    return t.narrow(1, il, il).copy_(mine.narrow(1, inter + split.rank * il, il));
  }));
  // down_proj [E, I, H] -> [E_local, H, I], columns split.
  return b.route(src_prefix + "down_proj", {w2}, [=](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor t, param_of(params, w2));
    return t.copy_(src.narrow(0, local.start, local.length).transpose(1, 2).narrow(2, split.rank * il, il));
  });
}

// ---------------------------------------------------------------------------------------
// MoeDecoderLoader

Status MoeDecoderLoader::declare_checkpoint(CheckpointBuilder& c) const {
  const MoeDecoderSpec& s = spec_;
  const DenseDims& d = s.dims;
  FERRY_RETURN_IF_ERROR(declare_embedding(c, d, s.dense));
  for (int i = 0; i < d.layers; ++i) {
    const std::string p = layer_prefix(s.dense, i);
    FERRY_RETURN_IF_ERROR(declare_layer_norms(c, d, s.dense, i));
    if (s.fp8.enabled) {
      FERRY_RETURN_IF_ERROR(declare_fp8_attention(c, d, s.dense, i, s.fp8));
    } else {
      FERRY_RETURN_IF_ERROR(declare_attention(c, d, s.dense, i));
    }
    if (s.moe_layer[static_cast<size_t>(i)]) {
      FERRY_RETURN_IF_ERROR(c.add(p + s.moe_module + "gate.weight", {s.experts.experts, d.hidden}));
      FERRY_RETURN_IF_ERROR(declare_experts(c, p + s.moe_module + "experts.", s.names, s.experts, s.fp8));
    } else {
      FERRY_RETURN_IF_ERROR(declare_mlp(c, p + "mlp.", d.hidden, d.intermediate, s.fp8));
    }
  }
  return declare_final(c, d, s.dense);
}

Status MoeDecoderLoader::build_rank(RankBuilder& b) const {
  const MoeDecoderSpec& s = spec_;
  const DenseDims& d = s.dims;
  FERRY_RETURN_IF_ERROR(build_embedding(b, d, s.dense));
  for (int i = 0; i < d.layers; ++i) {
    const std::string p = layer_prefix(s.dense, i);
    const int g = layer_group(i);
    FERRY_RETURN_IF_ERROR(build_layer_norms(b, d, s.dense, i));
    if (s.fp8.enabled) {
      FERRY_RETURN_IF_ERROR(build_fp8_attention(b, d, s.dense, i, s.fp8));
    } else {
      FERRY_RETURN_IF_ERROR(build_attention(b, d, s.dense, i));
    }
    if (s.moe_layer[static_cast<size_t>(i)]) {
      const std::string m = p + s.moe_module;
      FERRY_RETURN_IF_ERROR(b.replicated(m + "gate.weight", m + "gate.weight", g));
      FERRY_RETURN_IF_ERROR(build_experts(b, m + "experts.", m + "experts.", s.names, s.experts, g, s.fp8));
    } else {
      FERRY_RETURN_IF_ERROR(build_mlp(b, p + "mlp.", d.intermediate, g, b.tp(), s.fp8));
    }
  }
  return build_final(b, d, s.dense);
}

// ---------------------------------------------------------------------------------------
// Shrink

int64_t expert_tp_size(const InferenceLayout& layout) { return layout.ep > 1 ? 1 : layout.engine_size(); }

int64_t shrink_expert_count(int64_t experts, const InferenceLayout& layout) {
  if (layout.ep > 1) return layout.ep * std::min<int64_t>(experts / layout.ep, 2);
  return std::min<int64_t>(experts, 4);
}

void shrink_override(nlohmann::json& root, const std::string& field, const nlohmann::json& value, ShrinkContext& ctx) {
  for (auto it = ctx.changes->begin(); it != ctx.changes->end(); ++it) {
    if (it->field != field) continue;
    if (it->before == value.dump()) {
      ctx.changes->erase(it);
    } else {
      it->after = value.dump();
    }
    // Write without recording.
    std::vector<ShrinkChange> none;
    ShrinkContext quiet{ctx.original, ctx.layout, ctx.options, &none};
    shrink_set(root, field, value, quiet);
    return;
  }
  shrink_set(root, field, value, ctx);
}

void shrink_layer_index_list(nlohmann::json& root, const std::string& field, int64_t layers, ShrinkContext& ctx) {
  const nlohmann::json* cur = &root;
  size_t pos = 0;
  while (cur != nullptr) {
    const size_t dot = field.find('.', pos);
    const std::string key = field.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!cur->is_object() || !cur->contains(key)) return;
    cur = &(*cur)[key];
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  if (cur == nullptr || !cur->is_array()) return;
  nlohmann::json kept = nlohmann::json::array();
  for (const auto& v : *cur) {
    if (v.is_number_integer() && v.get<int64_t>() < layers) kept.push_back(v);
  }
  shrink_set(root, field, kept, ctx);
}

void shrink_per_layer_list(nlohmann::json& root, const std::string& field, int64_t old_layers, int64_t layers,
                           ShrinkContext& ctx) {
  const nlohmann::json* cur = &root;
  size_t pos = 0;
  while (true) {
    const size_t dot = field.find('.', pos);
    const std::string key = field.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!cur->is_object() || !cur->contains(key)) return;
    cur = &(*cur)[key];
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  if (!cur->is_array() || static_cast<int64_t>(cur->size()) != old_layers || layers >= old_layers) return;
  nlohmann::json cut = nlohmann::json::array();
  for (int64_t i = 0; i < layers; ++i) cut.push_back((*cur)[static_cast<size_t>(i)]);
  shrink_set(root, field, cut, ctx);
}

int64_t shrink_expert_intermediate(int64_t intermediate, const InferenceLayout& layout, int64_t also) {
  const int64_t m = std::lcm(expert_tp_size(layout), std::max<int64_t>(also, 1));
  return shrink_multiple(intermediate, m, kShrinkIntermediatePerRank * m);
}

}  // namespace ferry::models
