// The model of one job, for the tools and the tests (internal): config, loader, layouts,
// trainer holdings; synthetic checkpoints per version and bit-for-bit verification of an
// inference rank's params against a direct load of one.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/engine.h"

namespace ferry::tools {

struct JobModel {
  ModelConfig config;
  std::unique_ptr<ModelLoader> loader;
  InferenceLayout inference;
  TrainerLayout trainer;
  std::vector<TensorDecl> metadata;
  std::shared_ptr<const std::vector<Holdings>> holdings;
  std::vector<int> tensor_stage;
  uint64_t checkpoint_bytes = 0;
};

// `overrides`: JSON object merged into the config after shrinking (e.g.
// {"num_hidden_layers": 4}); empty: none.
// `loader`: the inference side's LoaderOptions (quantize: what its ranks keep).
Result<JobModel> make_job_model(const std::string& config_path, const std::string& trainer, const std::string& inference,
                                bool shrink, const std::string& overrides = "", const LoaderOptions& loader = {});
// make_job_model with the inference ranks' quantisation by name ("none", "fp8",
// "fp8-ue8m0", "mxfp8"; kInvalidArgument naming another), for the CLI's --quantize.
Result<JobModel> make_job_model_quantized(const std::string& config_path, const std::string& trainer,
                                          const std::string& inference, bool shrink, const std::string& overrides,
                                          const std::string& quantize);
Result<JobModel> make_job_model_from(const ModelConfig& config, const std::string& trainer,
                                     const std::string& inference, const LoaderOptions& loader = {});

// record_plan() of inference rank `global`, skipping the checkpoint tensors it loads
// nothing from (most of them for an EP rank of a large MoE); the plan `ferry plan` and
// `ferry simulate` route with. `metadata`: the trainer's (trainer_metadata: its dtypes),
// null for the checkpoint's. Errors: the loader's, a param no copy writes, coverage.
Result<Plan> record_rank_plan(const ModelLoader& loader, int global, const std::vector<TensorDecl>* metadata = nullptr);

// quantize_sides' inputs for `routes`, recorded from `loader`'s ranks: per plan class the
// params its loader block-quantises after loading (LoaderOptions::quantize; indices into
// PlanRoute::params, from the class's first consumer), and the tiles and scales of that
// quantisation. Empty lists under Quantize::kNone. Errors: the loader's for a rank.
struct QuantizedParams {
  std::vector<std::vector<uint32_t>> per_plan;
  BlockQuantizeFormat format;
};
Result<QuantizedParams> quantized_params(const ModelLoader& loader, const Routes& routes);

// Zeroed host buffers for every param inference rank `global` loads, by name: what an
// engine's own parameters are to a Consumer (`--caller-params` of bench and demo).
Result<TensorMap> zeroed_host_params(const ModelLoader& loader, int global);

// Compares consumer `rank`'s final params with a direct load of synthetic version
// `version` (synthetic_tensor(seed, version, ...) of every checkpoint tensor); the first
// mismatch as text, nullopt when every param matches bit for bit.
// SyntheticChanges from the CLI's words: `fraction` in [0, 1] and `layout` "scattered" or
// "clustered"; kInvalidArgument naming the bad one.
Result<SyntheticChanges> parse_synthetic_changes(double fraction, std::string_view layout);

// Consumer `rank`'s final params as a direct load of synthetic version `version` makes
// them (what verify_params compares with).
Result<TensorMap> direct_params(const JobModel& m, int rank, uint64_t seed, uint64_t version,
                                const SyntheticChanges& changes = {});

// `changes`: what the synthetic checkpoint changes per version (SyntheticChanges).
Result<std::optional<std::string>> verify_params(const JobModel& m, int rank, const TensorMap& params, uint64_t seed,
                                                 uint64_t version, const SyntheticChanges& changes = {});

}  // namespace ferry::tools
