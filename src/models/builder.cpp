// The building blocks of model loaders: shard loaders, RankBuilder, ModelLoaderBase.
#include "models/builder.h"

#include <numeric>

namespace ferry::models {

Status QkvGeometry::validate(std::string_view what) const {
  const std::string ctx = what.empty() ? std::string() : std::string(what) + ": ";
  if (num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return invalid_argument("{}heads {} / kv heads {} / head_dim {} must be positive", ctx, num_heads, num_kv_heads,
                            head_dim);
  }
  if (num_heads % tp.size != 0) {
    return invalid_argument("{}num_attention_heads {} is not divisible by tp {}", ctx, num_heads, tp.size);
  }
  if (num_kv_heads % tp.size != 0 && tp.size % num_kv_heads != 0) {
    return invalid_argument(
        "{}num_key_value_heads {} and tp {}: one must divide the other (kv heads are split, or replicated when tp "
        "exceeds them)",
        ctx, num_kv_heads, tp.size);
  }
  if (num_heads % num_kv_heads != 0) {
    return invalid_argument("{}num_attention_heads {} is not a multiple of num_key_value_heads {}", ctx, num_heads,
                            num_kv_heads);
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Tensor-level loaders

Status load_replicated(const Tensor& param, const Tensor& src) { return param.copy_(src); }

Status load_split(const Tensor& param, const Tensor& src, int64_t dim, Split split) {
  const int64_t n = param.size(dim);
  return param.copy_(src.narrow(dim, split.rank * n, n));
}

Status load_qkv_shard(const Tensor& param, const Tensor& src, int shard, const QkvGeometry& g) {
  const int64_t q_rows = g.q_heads_local() * g.head_dim;
  const int64_t kv_rows = g.kv_heads_local() * g.head_dim;
  int64_t offset = 0, size = 0, start = 0;
  switch (shard) {
    case 0:
      offset = 0;
      size = q_rows;
      start = g.tp.rank * q_rows;
      break;
    case 1:
    case 2:
      offset = q_rows + (shard - 1) * kv_rows;
      size = kv_rows;
      start = g.kv_head_start() * g.head_dim;
      break;
    default:
      return internal_error("load_qkv_shard: shard {} is not q (0), k (1) or v (2)", shard);
  }
  return param.narrow(0, offset, size).copy_(src.narrow(0, start, size));
}

Status load_qkv_fused(const Tensor& param, const Tensor& src, const QkvGeometry& g) {
  const int64_t q = g.num_heads * g.head_dim, kv = g.num_kv_heads * g.head_dim;
  TensorList parts = src.split(std::vector<int64_t>{q, kv, kv}, 0);
  if (!parts.ok()) return parts.status();
  for (int s = 0; s < 3; ++s) FERRY_RETURN_IF_ERROR(load_qkv_shard(param, parts[static_cast<size_t>(s)], s, g));
  return Status::Ok();
}

Status load_merged_shard(const Tensor& param, const Tensor& src, int shard, const std::vector<int64_t>& full_sizes,
                         Split split, int64_t dim) {
  if (shard < 0 || static_cast<size_t>(shard) >= full_sizes.size()) {
    return internal_error("load_merged_shard: shard {} of {}", shard, full_sizes.size());
  }
  int64_t offset = 0;
  for (int i = 0; i < shard; ++i) offset += full_sizes[static_cast<size_t>(i)] / split.size;
  const int64_t size = full_sizes[static_cast<size_t>(shard)] / split.size;
  return param.narrow(dim, offset, size).copy_(src.narrow(dim, split.rank * size, size));
}

Status load_merged_fused(const Tensor& param, const Tensor& src, const std::vector<int64_t>& full_sizes, Split split,
                         int64_t dim) {
  TensorList parts = src.split(full_sizes, dim);
  if (!parts.ok()) return parts.status();
  for (size_t s = 0; s < full_sizes.size(); ++s) {
    FERRY_RETURN_IF_ERROR(load_merged_shard(param, parts[s], static_cast<int>(s), full_sizes, split, dim));
  }
  return Status::Ok();
}

Status load_vocab_parallel(const Tensor& param, const Tensor& src, int64_t vocab, Split split) {
  const int64_t n = param.size(0);
  const int64_t start = split.rank * n;
  const int64_t real = std::clamp<int64_t>(vocab - start, 0, n);
  if (real > 0) FERRY_RETURN_IF_ERROR(param.narrow(0, 0, real).copy_(src.narrow(0, start, real)));
  if (real < n) FERRY_RETURN_IF_ERROR(param.narrow(0, real, n - real).zero_());
  return Status::Ok();
}

Status load_expert_w13(const Tensor& w13, const Tensor& src, int64_t expert, Range experts, int shard,
                       int64_t intermediate, Split split) {
  if (expert < experts.start || expert >= experts.end()) return Status::Ok();
  return load_merged_shard(w13.select(0, expert - experts.start), src, shard, {intermediate, intermediate}, split, 0);
}

Status load_expert_w2(const Tensor& w2, const Tensor& src, int64_t expert, Range experts, Split split) {
  if (expert < experts.start || expert >= experts.end()) return Status::Ok();
  return load_split(w2.select(0, expert - experts.start), src, 1, split);
}

Status load_scale_split(const Tensor& param, const Tensor& src, int64_t dim, Range elements) {
  const Range blocks = block_shard(elements);
  return param.copy_(src.narrow(dim, blocks.start, blocks.length));
}

// ---------------------------------------------------------------------------------------
// CheckpointBuilder

Status CheckpointBuilder::add(std::string name, Shape shape) { return add(std::move(name), std::move(shape), dtype_); }

Status CheckpointBuilder::add(std::string name, Shape shape, DType dtype) {
  int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
  bool overflow = false;
  for (int64_t d : shape) {
    if (d < 0) return internal_error("checkpoint tensor '{}' has a negative dim {}", name, shape_str(shape));
    overflow = overflow || __builtin_mul_overflow(bytes, d, &bytes);
  }
  int64_t total = 0;
  if (overflow || __builtin_add_overflow(bytes_, bytes, &total) || total > kMaxCheckpointBytes) {
    return invalid_argument("checkpoint tensor '{}' {} {} takes the checkpoint to {} bytes, over ferry's limit of {} "
                            "bytes (1 PiB): the config's sizes are implausible",
                            name, dtype_name(dtype), shape_str(shape),
                            overflow ? std::string("more than 2^63") : std::to_string(total), kMaxCheckpointBytes);
  }
  if (static_cast<int64_t>(decls_.size()) >= kMaxCheckpointTensors) {
    return invalid_argument("checkpoint tensor '{}' would be tensor {} of the checkpoint, over ferry's limit of {} "
                            "tensors: the config's counts are implausible",
                            name, decls_.size() + 1, kMaxCheckpointTensors);
  }
  if (!index_.emplace(name, decls_.size()).second) {
    return internal_error("checkpoint tensor '{}' declared twice", name);
  }
  decls_.push_back(TensorDecl{std::move(name), dtype, std::move(shape)});
  bytes_ = total;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// RankBuilder

RankBuilder::RankBuilder(const ModelLoaderBase& model, RankInfo info) : model_(model), loader_(new RankLoader()) {
  loader_->info_ = info;
  loader_->architecture_ = model.config().architecture();
  loader_->checkpoint_index_ = model.checkpoint_index();
  loader_->groups_.resize(static_cast<size_t>(model.num_groups()));
  for (int g = 0; g < model.num_groups(); ++g) loader_->groups_[static_cast<size_t>(g)].name = model.group_name(g);
  extra_post_.resize(static_cast<size_t>(model.num_groups()));
}

int RankBuilder::final_group() const { return model_.final_group(); }
int RankBuilder::num_groups() const { return model_.num_groups(); }
const ModelConfig& RankBuilder::config() const { return model_.config(); }
const LoaderOptions& RankBuilder::options() const { return model_.options(); }

Result<TensorDecl> RankBuilder::source(const std::string& name) const {
  auto it = model_.checkpoint_index()->find(name);
  if (it == model_.checkpoint_index()->end()) {
    return internal_error("{}: rank {} routes checkpoint tensor '{}', which the checkpoint does not declare",
                          config().architecture(), info().global, name);
  }
  return it->second;
}

Status RankBuilder::param(std::string name, Shape shape, DType dtype, int group, bool fp8_quantizable) {
  if (group < 0 || group >= model_.num_groups()) {
    return internal_error("param '{}': group {} outside [0, {})", name, group, model_.num_groups());
  }
  for (int64_t d : shape) {
    if (d < 0) return internal_error("param '{}' has a negative dim {}", name, shape_str(shape));
  }
  if (!param_index_.emplace(name, loader_->params_.size()).second) {
    return internal_error("param '{}' declared twice", name);
  }
  loader_->params_.push_back(ParamInfo{TensorDecl{std::move(name), dtype, std::move(shape)}, group, fp8_quantizable});
  return Status::Ok();
}

Status RankBuilder::route(const std::string& source, const std::vector<std::string>& params, LoadFn fn) {
  FERRY_RETURN_IF_ERROR(this->source(source).status());
  RankLoader::TensorLoad r;
  r.fn = std::move(fn);
  for (const auto& p : params) {
    auto it = param_index_.find(p);
    if (it == param_index_.end()) return internal_error("route from '{}' into undeclared param '{}'", source, p);
    const int g = loader_->params_[it->second].group;
    if (std::find(r.groups.begin(), r.groups.end(), g) == r.groups.end()) r.groups.push_back(g);
  }
  loader_->loads_[source].push_back(std::move(r));
  return Status::Ok();
}

Status RankBuilder::post(int group, PostFn fn) {
  if (group < 0 || group >= model_.num_groups()) return internal_error("post: group {} out of range", group);
  extra_post_[static_cast<size_t>(group)].push_back(std::move(fn));
  return Status::Ok();
}

namespace {
// A param's source lookup for LoadFns: the params map must hold it.
Result<Tensor> find_param(const TensorMap& params, const std::string& name) {
  auto it = params.find(name);
  if (it == params.end()) return not_found("param '{}' is not in the params given to load()", name);
  return it->second;
}
}  // namespace

Status RankBuilder::replicated(const std::string& param, const std::string& source, int group) {
  FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(source));
  FERRY_RETURN_IF_ERROR(this->param(param, s.shape, s.dtype, group, false));
  return route(source, {param}, [param](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
    return load_replicated(p, src);
  });
}

Status RankBuilder::column_parallel(const std::string& param, const std::string& source, int group, Split split,
                                    bool quantizable) {
  FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(source));
  if (s.shape.empty() || s.shape[0] % split.size != 0) {
    return invalid_argument("{}: dim 0 of {} is not divisible by {} ranks", s.name, shape_str(s.shape), split.size);
  }
  Shape shape = s.shape;
  shape[0] /= split.size;
  FERRY_RETURN_IF_ERROR(this->param(param, shape, s.dtype, group, quantizable && shape.size() == 2));
  return route(source, {param}, [param, split](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
    return load_split(p, src, 0, split);
  });
}

Status RankBuilder::row_parallel(const std::string& param, const std::string& source, int group, Split split,
                                 bool quantizable) {
  FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(source));
  if (s.shape.size() == 1) return replicated(param, source, group);
  if (s.shape.size() != 2 || s.shape[1] % split.size != 0) {
    return invalid_argument("{}: dim 1 of {} is not divisible by {} ranks", s.name, shape_str(s.shape), split.size);
  }
  Shape shape = s.shape;
  shape[1] /= split.size;
  FERRY_RETURN_IF_ERROR(this->param(param, shape, s.dtype, group, quantizable));
  return route(source, {param}, [param, split](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
    return load_split(p, src, 1, split);
  });
}

Status RankBuilder::qkv(const std::string& param, const std::vector<std::string>& qkv_sources, const QkvGeometry& g,
                        int group, bool quantizable) {
  if (qkv_sources.size() != 3) return internal_error("qkv '{}': needs 3 sources", param);
  FERRY_ASSIGN_OR_RETURN(TensorDecl q, this->source(qkv_sources[0]));
  Shape shape = q.shape;
  if (shape.empty()) return internal_error("qkv '{}': 0-D source", param);
  shape[0] = g.local_rows();
  FERRY_RETURN_IF_ERROR(this->param(param, shape, q.dtype, group, quantizable && shape.size() == 2));
  for (int s = 0; s < 3; ++s) {
    FERRY_RETURN_IF_ERROR(route(qkv_sources[static_cast<size_t>(s)], {param},
                                [param, s, g](const Tensor& src, const TensorMap& params) -> Status {
                                  FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
                                  return load_qkv_shard(p, src, s, g);
                                }));
  }
  return Status::Ok();
}

Status RankBuilder::qkv_fused(const std::string& param, const std::string& source, const QkvGeometry& g, int group,
                              bool quantizable) {
  FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(source));
  Shape shape = s.shape;
  if (shape.empty()) return internal_error("qkv '{}': 0-D source", param);
  shape[0] = g.local_rows();
  FERRY_RETURN_IF_ERROR(this->param(param, shape, s.dtype, group, quantizable && shape.size() == 2));
  return route(source, {param}, [param, g](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
    return load_qkv_fused(p, src, g);
  });
}

Status RankBuilder::merged_column(const std::string& param, const std::vector<std::string>& sources, int group,
                                  Split split, bool quantizable) {
  std::vector<int64_t> sizes;
  Shape shape;
  DType dtype = DType::kBF16;
  for (const auto& name : sources) {
    FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(name));
    if (s.shape.empty() || s.shape[0] % split.size != 0) {
      return invalid_argument("{}: dim 0 of {} is not divisible by {} ranks", s.name, shape_str(s.shape), split.size);
    }
    if (shape.empty()) {
      shape = s.shape;
      shape[0] = 0;
      dtype = s.dtype;
    }
    sizes.push_back(s.shape[0]);
    shape[0] += s.shape[0] / split.size;
  }
  FERRY_RETURN_IF_ERROR(this->param(param, shape, dtype, group, quantizable && shape.size() == 2));
  for (size_t i = 0; i < sources.size(); ++i) {
    const int shard = static_cast<int>(i);
    FERRY_RETURN_IF_ERROR(route(sources[i], {param},
                                [param, shard, sizes, split](const Tensor& src, const TensorMap& params) -> Status {
                                  FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
                                  return load_merged_shard(p, src, shard, sizes, split);
                                }));
  }
  return Status::Ok();
}

Status RankBuilder::merged_column_fused(const std::string& param, const std::string& source,
                                        const std::vector<int64_t>& full_sizes, int group, Split split,
                                        bool quantizable) {
  FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(source));
  const int64_t total = std::accumulate(full_sizes.begin(), full_sizes.end(), int64_t{0});
  if (s.shape.empty() || s.shape[0] != total) {
    return invalid_argument("{}: dim 0 of {} is not the sum {} of its fused parts", s.name, shape_str(s.shape), total);
  }
  for (int64_t part : full_sizes) {
    if (part % split.size != 0) {
      return invalid_argument("{}: fused part of {} rows is not divisible by {} ranks", s.name, part, split.size);
    }
  }
  Shape shape = s.shape;
  shape[0] = total / split.size;
  FERRY_RETURN_IF_ERROR(this->param(param, shape, s.dtype, group, quantizable && shape.size() == 2));
  return route(source, {param}, [param, full_sizes, split](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
    return load_merged_fused(p, src, full_sizes, split);
  });
}

Status RankBuilder::vocab_parallel(const std::string& param, const std::string& source, int64_t vocab, int group,
                                   Split split) {
  FERRY_ASSIGN_OR_RETURN(TensorDecl s, this->source(source));
  if (s.shape.size() != 2 || s.shape[0] != vocab) {
    return invalid_argument("{}: shape {} is not [vocab_size {}, hidden]", s.name, shape_str(s.shape), vocab);
  }
  const int64_t padded = padded_vocab(vocab);
  if (padded % split.size != 0) {
    return invalid_argument("vocab_size {} padded to {} is not divisible by tp {}", vocab, padded, split.size);
  }
  FERRY_RETURN_IF_ERROR(this->param(param, Shape{padded / split.size, s.shape[1]}, s.dtype, group, false));
  return route(source, {param}, [param, vocab, split](const Tensor& src, const TensorMap& params) -> Status {
    FERRY_ASSIGN_OR_RETURN(Tensor p, find_param(params, param));
    return load_vocab_parallel(p, src, vocab, split);
  });
}

Result<std::shared_ptr<const RankLoader>> RankBuilder::finish() {
  RankLoader& l = *loader_;
  const bool fp8 = options().quantize != Quantize::kNone;
  const QuantizedForm form = quantized_form(options().quantize);
  // Default post-processing: FP8 block quantisation of the quantizable weights.
  if (fp8) {
    std::vector<std::vector<std::string>> by_group(l.groups_.size());
    for (const auto& p : l.params_) {
      if (p.fp8_quantizable) by_group[static_cast<size_t>(p.group)].push_back(p.decl.name);
    }
    for (size_t g = 0; g < by_group.size(); ++g) {
      if (by_group[g].empty()) continue;
      l.groups_[g].post.push_back([names = by_group[g], form](TensorMap& params) -> Status {
        for (const auto& name : names) {
          const BlockQuantize bq{0, static_cast<uint8_t>(form.format), static_cast<uint32_t>(form.block),
                                 name + form.scale_suffix};
          FERRY_RETURN_IF_ERROR(quantize_kept_param(bq, name, params));
        }
        return Status::Ok();
      });
    }
  }
  for (size_t g = 0; g < extra_post_.size(); ++g) {
    for (auto& fn : extra_post_[g]) l.groups_[g].post.push_back(std::move(fn));
  }
  if (final_override_) {
    l.final_params_ = *final_override_;
  } else {
    for (const auto& p : l.params_) {
      if (fp8 && p.fp8_quantizable) {
        l.final_params_.push_back(TensorDecl{p.decl.name, DType::kF8E4M3, p.decl.shape});
        l.final_params_.push_back(TensorDecl{p.decl.name + form.scale_suffix, form.scale_dtype,
                                             quantized_scale_shape(form, p.decl.shape)});
      } else {
        l.final_params_.push_back(p.decl);
      }
    }
  }
  return std::shared_ptr<const RankLoader>(std::move(loader_));
}

// ---------------------------------------------------------------------------------------
// ModelLoaderBase

Status ModelLoaderBase::init() {
  CheckpointBuilder c(config_.dtype());
  FERRY_RETURN_IF_ERROR(declare_checkpoint(c));
  checkpoint_ = std::move(c.decls());
  auto index = std::make_shared<std::unordered_map<std::string, TensorDecl>>();
  index->reserve(checkpoint_.size());
  for (const auto& d : checkpoint_) index->emplace(d.name, d);
  index_ = std::move(index);
  return Status::Ok();
}

std::string ModelLoaderBase::group_name(int group) const {
  if (group == embedding_group()) return "embedding";
  if (group == final_group()) return "final";
  return fmt::format("layer {}", group - 1);
}

Result<std::shared_ptr<const RankLoader>> ModelLoaderBase::rank(int global) const {
  FERRY_ASSIGN_OR_RETURN(RankInfo info, layout_.rank(global));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(global);
    if (it != cache_.end()) return it->second;
  }
  RankBuilder b(*this, info);
  FERRY_RETURN_IF_ERROR(build_rank(b).with_context(fmt::format("{} {}", config_.architecture(), info.to_string())));
  FERRY_ASSIGN_OR_RETURN(auto loader, b.finish());
  std::lock_guard<std::mutex> lock(mu_);
  cache_.emplace(global, loader);
  return loader;
}

Status require_divisible(const ModelConfig& cfg, std::string_view field, int64_t value, std::string_view by_name,
                         int64_t by) {
  if (by <= 0 || value % by != 0) {
    return invalid_argument("{} {} is not divisible by {} {} ({})", field, value, by_name, by, cfg.path());
  }
  return Status::Ok();
}

}  // namespace ferry::models
