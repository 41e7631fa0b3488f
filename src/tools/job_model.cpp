#include "tools/job_model.h"

#include "models/builder.h"
#include "tools/config_path.h"

#include <string_view>
#include <unordered_map>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace ferry::tools {

Result<JobModel> make_job_model_from(const ModelConfig& config, const std::string& trainer,
                                     const std::string& inference, const LoaderOptions& loader) {
  JobModel m;
  m.config = config;
  FERRY_ASSIGN_OR_RETURN(m.inference, InferenceLayout::parse(inference));
  FERRY_ASSIGN_OR_RETURN(m.trainer, TrainerLayout::parse(trainer));
  FERRY_ASSIGN_OR_RETURN(m.loader, make_model_loader(m.config, m.inference, loader));
  m.metadata = trainer_metadata(m.loader->checkpoint(), m.trainer);
  {  // A layout whose routing is out of bounds is refused before its holdings are made.
    auto boxes = count_held_boxes(m.metadata, m.trainer, model_info_from_config(m.config.json()));
    if (!boxes.ok()) return boxes.status().with_context(fmt::format("trainer layout {}", trainer));
    RoutingCost cost{static_cast<uint64_t>(m.trainer.world_size()), static_cast<uint64_t>(m.inference.engine_size()),
                     static_cast<uint64_t>(Groups(m.metadata).size()), *boxes};
    FERRY_RETURN_IF_ERROR(check_routing_cost(cost).with_context(fmt::format("trainer layout {}", trainer)));
  }
  auto th = make_holdings(m.metadata, m.trainer, model_info_from_config(m.config.json()));
  if (!th.ok()) return th.status().with_context(fmt::format("trainer layout {}", trainer));
  m.holdings = std::make_shared<const std::vector<Holdings>>(std::move(th->ranks));
  m.tensor_stage = std::move(th->tensor_stage);
  for (const auto& d : m.metadata) m.checkpoint_bytes += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  return m;
}

Result<JobModel> make_job_model_quantized(const std::string& config_path, const std::string& trainer,
                                          const std::string& inference, bool shrink, const std::string& overrides,
                                          const std::string& quantize) {
  auto q = parse_quantize(quantize);
  if (!q.ok()) return q.status().with_context("--quantize");
  LoaderOptions lo;
  lo.quantize = *q;
  return make_job_model(config_path, trainer, inference, shrink, overrides, lo);
}

Result<JobModel> make_job_model(const std::string& config_path, const std::string& trainer, const std::string& inference,
                                bool shrink, const std::string& overrides, const LoaderOptions& loader) {
  FERRY_ASSIGN_OR_RETURN(auto found, find_model_config(config_path));
  FERRY_ASSIGN_OR_RETURN(auto config, ModelConfig::load(found));
  if (shrink) {
    FERRY_ASSIGN_OR_RETURN(auto layout, InferenceLayout::parse(inference));
    FERRY_ASSIGN_OR_RETURN(auto s, shrink_config(config, layout, loader));
    config = s.config;
  }
  if (!overrides.empty()) {
    nlohmann::json j = config.json();
    try {
      j.merge_patch(nlohmann::json::parse(overrides));
    } catch (const std::exception& e) {
      return invalid_argument("config overrides: {}", e.what());
    }
    FERRY_ASSIGN_OR_RETURN(config, ModelConfig::from_json(j, config.path()));
  }
  return make_job_model_from(config, trainer, inference, loader);
}

Result<Plan> record_rank_plan(const ModelLoader& loader, int global, const std::vector<TensorDecl>* metadata) {
  FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(global));
  std::vector<TensorDecl> loaded;
  for (const TensorDecl& d : metadata ? *metadata : loader.checkpoint()) {
    if (!rl->groups_written_by(d.name).empty()) loaded.push_back(d);
  }
  return record_plan(loader, global, loaded);
}

Result<QuantizedParams> quantized_params(const ModelLoader& loader, const Routes& routes) {
  QuantizedParams out;
  const models::QuantizedForm form = models::quantized_form(loader.options().quantize);
  out.format.block = form.block;
  out.format.block_rows = form.format == Fp8Scales::kMx ? 1 : form.block;
  out.format.scale_bytes = static_cast<uint32_t>(dtype_size(form.scale_dtype));
  out.per_plan.resize(routes.plans.size());
  if (loader.options().quantize == Quantize::kNone) return out;
  std::vector<bool> seen(routes.plans.size(), false);
  for (size_t c = 0; c < routes.consumer_plan.size(); ++c) {
    const uint32_t k = routes.consumer_plan[c];
    if (seen[k]) continue;
    seen[k] = true;
    FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(static_cast<int>(c)));
    std::unordered_map<std::string_view, uint32_t> index;
    for (uint32_t i = 0; i < routes.plans[k].params.size(); ++i) index.emplace(routes.plans[k].params[i].name, i);
    for (const ParamInfo& pi : rl->params()) {
      auto it = index.find(pi.decl.name);
      if (pi.fp8_quantizable && it != index.end()) out.per_plan[k].push_back(it->second);
    }
  }
  return out;
}

Result<TensorMap> zeroed_host_params(const ModelLoader& loader, int global) {
  FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(global));
  TensorMap params;
  for (const TensorDecl& d : rl->param_decls()) {
    Tensor t = Tensor::empty(d.shape, d.dtype, d.name);
    FERRY_RETURN_IF_ERROR(t.zero_());
    params.emplace(d.name, std::move(t));
  }
  return params;
}

Result<SyntheticChanges> parse_synthetic_changes(double fraction, std::string_view layout) {
  if (layout != "scattered" && layout != "clustered")
    return invalid_argument("--changes '{}': expected scattered or clustered", layout);
  const SyntheticChanges c{fraction, layout == "clustered"};
  FERRY_RETURN_IF_ERROR(check_synthetic_changes(c).with_context("--changed-fraction"));
  return c;
}

Result<TensorMap> direct_params(const JobModel& m, int rank, uint64_t seed, uint64_t version,
                                const SyntheticChanges& changes) {
  // One checkpoint tensor at a time: every rank of a bench verifies at once, and a whole
  // synthetic checkpoint per rank is what ran a 1.6 GB bench out of memory.
  std::unordered_map<std::string_view, const TensorDecl*> held_by_name;
  for (const TensorDecl& d : m.metadata) held_by_name.emplace(d.name, &d);
  return load_rank_direct(*m.loader, rank, [&](const TensorDecl& d) -> Result<Tensor> {
    // As the trainer holds it (fp32 masters: converted as loaded).
    auto held = held_by_name.find(d.name);
    return synthetic_tensor(seed, version, held == held_by_name.end() ? d : *held->second, changes);
  });
}

Result<std::optional<std::string>> verify_params(const JobModel& m, int rank, const TensorMap& params, uint64_t seed,
                                                 uint64_t version, const SyntheticChanges& changes) {
  FERRY_ASSIGN_OR_RETURN(auto direct, direct_params(m, rank, seed, version, changes));
  FERRY_ASSIGN_OR_RETURN(auto rl, m.loader->rank(rank));
  FERRY_ASSIGN_OR_RETURN(auto mm, compare_params(rl->final_params(), direct, params));
  if (!mm.has_value()) return std::optional<std::string>{};
  return std::optional<std::string>(fmt::format("param '{}' index {}: {}", mm->param, mm->index, mm->detail));
}

}  // namespace ferry::tools
