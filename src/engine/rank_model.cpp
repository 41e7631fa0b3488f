#include "engine/rank_model.h"

#include <unordered_map>

#include <fmt/format.h>

#include "ferry/device.h"

namespace ferry::engine {

Result<RankModel> record_rank_model(const ModelLoader& loader, std::shared_ptr<const RankLoader> rank_loader, int rank,
                                    const std::vector<TensorDecl>& metadata) {
  RankModel out;
  auto plan = record_plan(loader, rank, metadata);
  if (!plan.ok()) return plan.status().with_context(fmt::format("consumer {} recording its plan", rank));
  out.plan = std::move(*plan);
  for (const ParamInfo& p : rank_loader->params()) {
    out.param_decls.push_back(p.decl);
    out.post_group_of[p.decl.name] = p.group;
  }
  for (const RankLoader::Group& g : rank_loader->groups()) out.post_group_names.push_back(g.name);
  out.post_process = [rank_loader](int group, TensorMap& work) {
    return rank_loader->process_weights_after_loading(group, work);
  };
  return out;
}

Result<RankModel> adopt_rank_model(ConsumerModel model, int rank, const std::vector<TensorDecl>& metadata) {
  RankModel out;
  // The plan was recorded against the loader's idea of the checkpoint: it must be the
  // trainer's (a mismatch would otherwise surface as a routing error far from its cause).
  std::unordered_map<std::string_view, const TensorDecl*> by_name;
  for (const TensorDecl& d : metadata) by_name.emplace(d.name, &d);
  for (uint32_t k = 0; k < model.plan.sources().size(); ++k) {
    const TensorDecl& s = model.plan.sources()[k];
    auto it = by_name.find(s.name);
    if (it == by_name.end())
      return invalid_argument("consumer {}: its plan reads '{}', which the trainer's metadata does not have", rank,
                              s.name);
    const TensorDecl& t = *it->second;
    if (t.shape != s.shape || (t.dtype != s.dtype && !model.plan.set_source_dtype(k, t.dtype).ok()))
      return invalid_argument("consumer {}: its plan reads '{}' as {} {}, the trainer has {} {}", rank, s.name,
                              dtype_name(s.dtype), shape_str(s.shape), dtype_name(t.dtype), shape_str(t.shape));
    // (A trainer's fp32 masters of a bf16 checkpoint, or the reverse: the plan reads them
    // as the trainer has them and its copies convert, as the built-in loaders' plans do.)
  }
  out.plan = std::move(model.plan);
  out.param_decls = out.plan.params();
  // Post-processing groups: the layer groups of the param names, as the trainer's are of
  // the checkpoint names.
  const Groups groups(out.param_decls);
  std::vector<ConsumerModel::PostGroup> post(static_cast<size_t>(groups.size()));
  for (int g = 0; g < groups.size(); ++g) post[static_cast<size_t>(g)] = {g, groups.name(g), {}};
  for (size_t i = 0; i < out.param_decls.size(); ++i) {
    const int g = groups.of_tensor(i);
    out.post_group_of[out.param_decls[i].name] = g;
    post[static_cast<size_t>(g)].params.push_back(out.param_decls[i].name);
  }
  for (const auto& g : post) out.post_group_names.push_back(g.name);
  // The params the plan keeps block-quantised (mark_quantized): those no producer
  // quantised arrive in their loaded dtype and are quantised here, as a built-in loader's
  // post-processing does, before the caller's own post-processing sees the group.
  std::vector<std::vector<std::pair<std::string, BlockQuantize>>> kept(post.size());
  for (const BlockQuantize& bq : out.plan.quantized()) {
    const std::string& name = out.param_decls[bq.param].name;
    kept[static_cast<size_t>(out.post_group_of.at(name))].emplace_back(name, bq);
  }
  if (model.post_process || !out.plan.quantized().empty()) {
    out.post_process = [post = std::move(post), kept = std::move(kept), fn = std::move(model.post_process)](
                           int group, TensorMap& work) -> Status {
      for (const auto& [name, bq] : kept[static_cast<size_t>(group)]) {
        FERRY_RETURN_IF_ERROR(quantize_kept_param(bq, name, work));
      }
      return fn ? fn(post[static_cast<size_t>(group)], work) : Status::Ok();
    };
  }
  return out;
}

Status check_param_devices(int rank, const TensorMap& params) {
  std::optional<std::pair<Device, std::string>> first;
  for (const auto& [name, t] : params) {
    if (!t.device().is_cuda()) continue;
    if (first && first->first != t.device()) {
      return invalid_argument("consumer {}: params on {} ('{}') and {} ('{}'); ferry stages for one GPU per rank", rank,
                              device_str(first->first), first->second, device_str(t.device()), name);
    }
    if (!first) first.emplace(t.device(), name);
  }
  if (!first) return Status::Ok();
  if (auto why = cuda_unusable(first->first)) {
    return unavailable("consumer {}: param '{}' is on {}, which cannot be used here: {}", rank, first->second,
                       device_str(first->first), *why);
  }
  return Status::Ok();
}

}  // namespace ferry::engine
