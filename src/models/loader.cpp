// RankLoader, ModelLoader conveniences, and the drivers: record_plan, direct and plan
// loads, random checkpoints, comparison.
#include <cstring>

#include "models/builder.h"

namespace ferry {

// ---------------------------------------------------------------------------------------
// RankLoader

std::vector<TensorDecl> RankLoader::param_decls() const {
  std::vector<TensorDecl> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(p.decl);
  return out;
}

Status RankLoader::load(std::string_view source_name, const Tensor& source, const TensorMap& params) const {
  const std::string name(source_name);
  auto known = checkpoint_index_->find(name);
  if (known == checkpoint_index_->end()) {
    return not_found("{}: unknown checkpoint tensor '{}' (not in this model's checkpoint)", architecture_, name);
  }
  if (!source.ok()) return source.status().with_context(fmt::format("loading '{}'", name));
  const TensorDecl& d = known->second;
  // A trainer may hold a 16/32-bit float tensor in another of those dtypes (fp32 master
  // weights of a bf16 checkpoint): the loader's copies convert it.
  auto wide_float = [](DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; };
  const bool held_as_float = wide_float(source.dtype()) && wide_float(d.dtype);
  if (source.shape() != d.shape || (source.dtype() != d.dtype && !held_as_float)) {
    return invalid_argument("checkpoint tensor '{}': got {} {}, the model expects {} {}", name, shape_str(source.shape()),
                            dtype_name(source.dtype()), shape_str(d.shape), dtype_name(d.dtype));
  }
  auto it = loads_.find(name);
  if (it == loads_.end()) return Status::Ok();
  for (const TensorLoad& r : it->second) {
    FERRY_RETURN_IF_ERROR(r.fn(source, params).with_context(fmt::format("{}: loading '{}'", info_.to_string(), name)));
  }
  return Status::Ok();
}

std::vector<int> RankLoader::groups_written_by(std::string_view source_name) const {
  auto it = loads_.find(std::string(source_name));
  if (it == loads_.end()) return {};
  std::vector<int> out;
  for (const TensorLoad& r : it->second) {
    for (int g : r.groups) {
      if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
    }
  }
  return out;
}

Status RankLoader::process_weights_after_loading(int group, TensorMap& params) const {
  if (group < 0 || static_cast<size_t>(group) >= groups_.size()) {
    return out_of_range("process_weights_after_loading: group {} outside [0, {})", group, groups_.size());
  }
  for (const PostFn& fn : groups_[static_cast<size_t>(group)].post) {
    FERRY_RETURN_IF_ERROR(fn(params).with_context(
        fmt::format("{}: post-processing {}", info_.to_string(), groups_[static_cast<size_t>(group)].name)));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// ModelLoader conveniences

Result<std::vector<TensorDecl>> ModelLoader::params(int global) const {
  FERRY_ASSIGN_OR_RETURN(auto r, rank(global));
  return r->param_decls();
}

Status ModelLoader::load(int global, std::string_view source_name, const Tensor& source, const TensorMap& params) const {
  FERRY_ASSIGN_OR_RETURN(auto r, rank(global));
  return r->load(source_name, source, params);
}

Status ModelLoader::process_weights_after_loading(int global, int group, TensorMap& params) const {
  FERRY_ASSIGN_OR_RETURN(auto r, rank(global));
  return r->process_weights_after_loading(group, params);
}

// ---------------------------------------------------------------------------------------
// record_plan

Result<Plan> record_plan(const ModelLoader& loader, int global) {
  return record_plan(loader, global, loader.checkpoint());
}

Result<Plan> record_plan(const ModelLoader& loader, int global, const std::vector<TensorDecl>& metadata) {
  FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(global));
  TensorMap params;
  params.reserve(rl->params().size());
  for (const auto& p : rl->params()) params.emplace(p.decl.name, Tensor::param(p.decl.name, p.decl.shape, p.decl.dtype));
  Plan plan;
  {
    Recorder rec;
    for (const TensorDecl& d : metadata) {
      Tensor src = Tensor::source(d.name, d.shape, d.dtype);
      FERRY_RETURN_IF_ERROR(rl->load(d.name, src, params));
    }
    FERRY_ASSIGN_OR_RETURN(plan, rec.finish());
  }
  for (const auto& p : rl->params()) {
    if (!plan.find_param(p.decl.name)) {
      return invalid_argument("{}: param '{}' {} is written by no copy (no checkpoint tensor loads into it)",
                              rl->info().to_string(), p.decl.name, shape_str(p.decl.shape));
    }
  }
  FERRY_RETURN_IF_ERROR(plan.check_coverage().with_context(rl->info().to_string()));
  // What the consumer keeps block-quantised, stated in the plan (issue 29): the router may
  // then leave the quantising to a producer that holds a tile's every element.
  if (loader.options().quantize != Quantize::kNone) {
    std::vector<std::string> quantized;
    for (const auto& p : rl->params())
      if (p.fp8_quantizable) quantized.push_back(p.decl.name);
    if (!quantized.empty()) {
      FERRY_RETURN_IF_ERROR(
          mark_quantized(plan, loader.options().quantize, quantized).with_context(rl->info().to_string()));
    }
  }
  return plan;
}

Status mark_quantized(Plan& plan, Quantize quantize, const std::vector<std::string>& params) {
  if (quantize == Quantize::kNone) return invalid_argument("mark_quantized: quantize is none (fp8, fp8-ue8m0 or mxfp8)");
  if (params.empty()) return invalid_argument("mark_quantized: no param to quantise");
  const models::QuantizedForm form = models::quantized_form(quantize);
  std::vector<BlockQuantize> quantized;
  quantized.reserve(params.size());
  for (const std::string& name : params) {
    const std::optional<uint32_t> p = plan.find_param(name);
    if (!p) return invalid_argument("mark_quantized: '{}' is not a param of the plan", name);
    quantized.push_back(BlockQuantize{*p, static_cast<uint8_t>(form.format), static_cast<uint32_t>(form.block),
                                      name + form.scale_suffix});
  }
  return plan.set_quantized(std::move(quantized)).with_context(fmt::format("mark_quantized {}", quantize_name(quantize)));
}

Status quantize_kept_param(const BlockQuantize& bq, const std::string& name, TensorMap& params) {
  auto it = params.find(name);
  if (it == params.end()) return not_found("fp8 quantisation: param '{}' missing", name);
  if (it->second.dtype() == DType::kF8E4M3) {
    // Quantised by a producer (EngineOptions::quantize_on): it arrived with its scales.
    if (!params.count(bq.scale_name)) {
      return not_found("fp8 quantisation: param '{}' arrived quantised without its scales '{}'", name, bq.scale_name);
    }
    return Status::Ok();
  }
  auto q = models::quantize_fp8_blocks(it->second, bq.block, static_cast<Fp8Scales>(bq.format));
  if (!q.ok()) return q.status().with_context(fmt::format("fp8 quantisation of '{}'", name));
  it->second = q->first;
  params[bq.scale_name] = q->second;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Direct and plan loads

namespace {

TensorMap allocate_params(const RankLoader& rl) {
  TensorMap params;
  params.reserve(rl.params().size());
  for (const auto& p : rl.params()) {
    params.emplace(p.decl.name, Tensor::empty(p.decl.shape, p.decl.dtype, p.decl.name));
  }
  return params;
}

// Keeps exactly the final params (post-processing may have replaced some).
Result<TensorMap> final_params(const RankLoader& rl, TensorMap params) {
  TensorMap out;
  for (const auto& d : rl.final_params()) {
    auto it = params.find(d.name);
    if (it == params.end()) return internal_error("{}: final param '{}' missing after post-processing", rl.info().to_string(), d.name);
    if (it->second.shape() != d.shape || it->second.dtype() != d.dtype) {
      return internal_error("{}: final param '{}' is {} {}, declared {} {}", rl.info().to_string(), d.name,
                            shape_str(it->second.shape()), dtype_name(it->second.dtype()), shape_str(d.shape),
                            dtype_name(d.dtype));
    }
    out.emplace(d.name, it->second);
  }
  return out;
}

}  // namespace

namespace {

// Direct load through `fetch`, one checkpoint tensor at a time, each group processed
// once its last tensor is in (groups fed by none first). `every_tensor`: fetch and
// check every checkpoint tensor, also those that land nowhere on this rank.
Result<TensorMap> load_direct(const ModelLoader& loader, int global, const FetchTensor& fetch, bool every_tensor) {
  FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(global));
  TensorMap params = allocate_params(*rl);
  const auto& decls = loader.checkpoint();
  std::vector<int> pending(rl->groups().size(), 0);
  for (const auto& d : decls) {
    for (int g : rl->groups_written_by(d.name)) ++pending[static_cast<size_t>(g)];
  }
  for (size_t g = 0; g < pending.size(); ++g) {
    if (pending[g] == 0) FERRY_RETURN_IF_ERROR(rl->process_weights_after_loading(static_cast<int>(g), params));
  }
  for (const auto& d : decls) {
    const std::vector<int> groups = rl->groups_written_by(d.name);
    if (groups.empty() && !every_tensor) continue;  // nothing of it lands on this rank
    FERRY_ASSIGN_OR_RETURN(Tensor t, fetch(d));
    FERRY_RETURN_IF_ERROR(rl->load(d.name, t, params));
    for (int g : groups) {
      if (--pending[static_cast<size_t>(g)] == 0) FERRY_RETURN_IF_ERROR(rl->process_weights_after_loading(g, params));
    }
  }
  return final_params(*rl, std::move(params));
}

}  // namespace

Result<TensorMap> load_rank_direct(const ModelLoader& loader, int global, const FetchTensor& fetch) {
  return load_direct(loader, global, fetch, false);
}

Result<TensorMap> load_rank_direct(const ModelLoader& loader, int global, const TensorMap& checkpoint) {
  return load_direct(
      loader, global,
      [&checkpoint](const TensorDecl& d) -> Result<Tensor> {
        auto it = checkpoint.find(d.name);
        if (it == checkpoint.end()) return not_found("checkpoint tensor '{}' is missing", d.name);
        return it->second;
      },
      true);
}

Result<TensorMap> load_rank_from_plan(const ModelLoader& loader, int global, const Plan& plan,
                                      const TensorMap& checkpoint, const ExecuteOptions& options) {
  FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(global));
  TensorMap params = allocate_params(*rl);
  FERRY_RETURN_IF_ERROR(execute(plan, checkpoint, params, options).with_context(rl->info().to_string()));
  for (size_t g = 0; g < rl->groups().size(); ++g) {
    FERRY_RETURN_IF_ERROR(rl->process_weights_after_loading(static_cast<int>(g), params));
  }
  return final_params(*rl, std::move(params));
}

// ---------------------------------------------------------------------------------------
// Checkpoints

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

Result<TensorMap> random_checkpoint(const std::vector<TensorDecl>& decls, uint64_t seed) {
  TensorMap out;
  out.reserve(decls.size());
  for (const auto& d : decls) {
    Tensor t = Tensor::empty(d.shape, d.dtype, d.name);
    if (!t.ok()) return t.status();
    const int64_t n = t.numel();
    if (n > 0) {
      FERRY_ASSIGN_OR_RETURN(std::byte * p, t.data_ptr());
      const uint64_t base = splitmix64(seed ^ fnv1a(d.name));
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t h = splitmix64(base + static_cast<uint64_t>(i));
        switch (d.dtype) {
          case DType::kBF16: {
            // sign, exponent in [2^-7, 2^4), 7 mantissa bits: finite, ~2.8k values.
            const uint16_t bits = static_cast<uint16_t>(((h & 1) << 15) | ((120 + (h >> 8) % 11) << 7) | ((h >> 16) & 0x7f));
            std::memcpy(p + 2 * i, &bits, 2);
            break;
          }
          case DType::kF32: {
            const uint32_t bits =
                static_cast<uint32_t>(((h & 1) << 31) | ((120 + (h >> 8) % 11) << 23) | ((h >> 16) & 0x7fffff));
            std::memcpy(p + 4 * i, &bits, 4);
            break;
          }
          case DType::kF16:
          case DType::kF8E4M3:
          case DType::kF8E5M2: {
            const double v = (static_cast<double>((h >> 8) % 1793) - 896.0) / 128.0;  // [-7, 7]
            store_element(p + static_cast<int64_t>(dtype_size(d.dtype)) * i, d.dtype, v);
            break;
          }
          case DType::kBool:
            store_element(p + i, d.dtype, static_cast<double>(h & 1));
            break;
          default: {
            const size_t es = dtype_size(d.dtype);
            std::memcpy(p + static_cast<int64_t>(es) * i, &h, es);  // little-endian low bytes
            break;
          }
        }
      }
    }
    out.emplace(d.name, std::move(t));
  }
  return out;
}

Status check_checkpoint(const std::vector<TensorDecl>& decls, const TensorMap& checkpoint) {
  std::unordered_map<std::string, const TensorDecl*> index;
  for (const auto& d : decls) index.emplace(d.name, &d);
  for (const auto& d : decls) {
    auto it = checkpoint.find(d.name);
    if (it == checkpoint.end()) return not_found("checkpoint tensor '{}' {} {} is missing", d.name, shape_str(d.shape), dtype_name(d.dtype));
    if (it->second.shape() != d.shape || it->second.dtype() != d.dtype) {
      return invalid_argument("checkpoint tensor '{}': has {} {}, the model expects {} {}", d.name,
                              shape_str(it->second.shape()), dtype_name(it->second.dtype()), shape_str(d.shape),
                              dtype_name(d.dtype));
    }
  }
  if (checkpoint.size() != decls.size()) {
    std::vector<std::string> unknown;
    for (const auto& [name, t] : checkpoint) {
      if (!index.count(name)) unknown.push_back(name);
    }
    std::sort(unknown.begin(), unknown.end());
    if (!unknown.empty()) {
      return not_found("unknown checkpoint tensor '{}' (not in the model's checkpoint{})", unknown[0],
                       unknown.size() > 1 ? fmt::format("; {} more", unknown.size() - 1) : "");
    }
  }
  return Status::Ok();
}

#ifndef FERRY_MODELS_HAVE_IO
Result<TensorMap> read_checkpoint_dir(const std::string& dir) {
  return unimplemented("reading checkpoint '{}': this ferry was built without the io (safetensors) module", dir);
}
#endif

Result<std::optional<Mismatch>> compare_params(const std::vector<TensorDecl>& decls, const TensorMap& a,
                                               const TensorMap& b) {
  for (const auto& d : decls) {
    auto ia = a.find(d.name);
    auto ib = b.find(d.name);
    if (ia == a.end() || ib == b.end()) return not_found("compare: param '{}' missing", d.name);
    const Tensor ta = ia->second.contiguous(), tb = ib->second.contiguous();
    if (ta.shape() != tb.shape() || ta.dtype() != tb.dtype()) {
      return std::optional<Mismatch>(Mismatch{d.name, 0,
                                              fmt::format("{} {} vs {} {}", shape_str(ta.shape()), dtype_name(ta.dtype()),
                                                          shape_str(tb.shape()), dtype_name(tb.dtype()))});
    }
    if (ta.numel() == 0) continue;
    FERRY_ASSIGN_OR_RETURN(const std::byte* pa, ta.data_ptr());
    FERRY_ASSIGN_OR_RETURN(const std::byte* pb, tb.data_ptr());
    const size_t n = static_cast<size_t>(ta.nbytes());
    if (std::memcmp(pa, pb, n) == 0) continue;
    const size_t es = dtype_size(ta.dtype());
    for (size_t i = 0; i < n; i += es) {
      if (std::memcmp(pa + i, pb + i, es) != 0) {
        uint64_t va = 0, vb = 0;
        std::memcpy(&va, pa + i, std::min<size_t>(es, 8));
        std::memcpy(&vb, pb + i, std::min<size_t>(es, 8));
        return std::optional<Mismatch>(Mismatch{d.name, static_cast<int64_t>(i / es),
                                                fmt::format("0x{:0{}x} vs 0x{:0{}x}", va, 2 * es, vb, 2 * es)});
      }
    }
  }
  return std::optional<Mismatch>();
}

}  // namespace ferry
