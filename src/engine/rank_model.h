// engine/rank_model.h — what one consumer rank loads into and how it post-processes,
// worked out before any byte moves (internal): from one of ferry's loaders (its plan
// recorded against the trainer's metadata) or from a caller's ConsumerModel (its plan
// checked against that metadata), plus the local checks of the caller's params that
// come before any rendezvous. Pure: no transport, no store.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "ferry/models.h"
#include "ferry/plan.h"

namespace ferry::engine {

struct RankModel {
  Plan plan;                                 // the rank's element map (canonical)
  std::vector<TensorDecl> param_decls;       // as loaded, in declaration order
  std::map<std::string, int> post_group_of;  // param -> post-processing group
  std::vector<std::string> post_group_names;
  std::function<Status(int group, TensorMap& params)> post_process;  // empty: none
  // A consumer's params as the first routes declared them (producer-quantised ones e4m3,
  // their scales added; set by its create): its buffers are made for these, so later
  // routes must agree.
  std::vector<TensorDecl> routed_params;
};

// Records `rank_loader`'s plan (loader.rank(rank)) against the trainer's metadata;
// post-processing is the loader's process_weights_after_loading per group. The
// recorder's error, with the rank, otherwise.
Result<RankModel> record_rank_model(const ModelLoader& loader, std::shared_ptr<const RankLoader> rank_loader, int rank,
                                    const std::vector<TensorDecl>& metadata);

// Takes `model`'s plan after checking that every source it reads is in the trainer's
// metadata with the same shape and dtype, or a float dtype it converts from (f32, bf16,
// f16: the plan then reads the trainer's, Plan::set_source_dtype; kInvalidArgument naming
// the tensor otherwise); its post-processing groups are the layer groups of the param
// names, with the plan's block-quantised params quantised first where no producer did.
// model.params is not used (the caller keeps the buffers).
Result<RankModel> adopt_rank_model(ConsumerModel model, int rank, const std::vector<TensorDecl>& metadata);

// The caller's params before any rendezvous (a consumer refused for its own params
// fails at once, not after the trainer came up): GPU params all on one device, and that
// device usable here (the plugin loaded, the driver reports it).
Status check_param_devices(int rank, const TensorMap& params);

}  // namespace ferry::engine
