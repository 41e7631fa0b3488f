// ferry/models.h — model loaders: the inference side's weight loading, written once
// against Tensor, for the major architectures (shared/DESIGN.md §3).
//
// A ModelLoader is made from an HF config.json (ModelConfig), an inference layout
// (InferenceLayout: "tp=T,dp=D,ep=E,replicas=R") and options (LoaderOptions). It says
//   * which tensors the checkpoint holds (HF name, dtype, full shape: what a trainer
//     exposes as metadata) — checkpoint();
//   * which params each inference rank holds (vLLM's names, dtypes, local shapes) and
//     how one checkpoint tensor loads into them — rank(r) -> RankLoader, whose load()
//     uses only Tensor view ops + copy_/zero_, like vLLM's weight_loader code. So the
//     same code loads real tensors (direct load) and, under a Recorder with recording
//     tensors, yields the rank's exact ShardPlan (record_plan);
//   * what runs after a group's (layer's) shards landed (vLLM's
//     process_weights_after_loading), e.g. FP8 block quantisation of bf16 shards.
//
// Sharding follows vLLM: column-parallel linears split output rows, row-parallel split
// input columns; q/k/v fuse into qkv_proj [q | k | v] with kv heads replicated when
// tp > num_kv_heads (rank r takes kv head r / (tp / n_kv)); gate/up fuse into
// gate_up_proj [gate | up]; embedding and lm_head are vocab-parallel over the vocab
// padded to a multiple of 64, padding rows zero-filled (zero_), never read; norms are
// replicated. Each DP rank holds its own TP-split copy of attention and dense weights.
//
// Errors: nothing here throws. Config errors name the field and the file; layout errors
// name the field and the constraint; load errors name the checkpoint tensor and param.
// Threading: a ModelLoader and the RankLoaders it hands out are immutable after
// creation and safe to use from several threads (rank() caches under a mutex).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "ferry/plan.h"
#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry {

namespace models {
class RankBuilder;
}

// ---------------------------------------------------------------------------------------
// ModelConfig: an HF config.json.

class ModelConfig {
 public:
  // Reads and parses `path`. Errors: kNotFound/kIoError (file), kInvalidArgument
  // (not JSON, not an object, `architectures` missing or not a non-empty string list).
  static Result<ModelConfig> load(const std::string& path);
  // Parses JSON text; `path` is only used in messages.
  static Result<ModelConfig> parse(std::string_view text, std::string path = "<config>");
  static Result<ModelConfig> from_json(const nlohmann::json& json, std::string path = "<config>");

  const std::string& path() const { return path_; }
  // architectures[0]: what selects the loader.
  const std::string& architecture() const { return architecture_; }
  const std::string& model_type() const { return model_type_; }
  // torch_dtype ("bfloat16" when absent): the dtype of the checkpoint's tensors.
  DType dtype() const { return dtype_; }
  const nlohmann::json& json() const { return *json_; }
  std::string dump() const;  // pretty-printed JSON

  // Field accessors. `field` is a name or a dotted path into nested objects
  // ("text_config.hidden_size"). Errors name the field and the file:
  //   "llama.json: missing field 'hidden_size'",
  //   "llama.json: field 'hidden_size' must be an integer, got string \"x\"".
  // The *_or variants return `fallback` when the field is absent or null.
  bool has(std::string_view field) const;
  Result<int64_t> get_int(std::string_view field) const;
  Result<int64_t> get_int_or(std::string_view field, int64_t fallback) const;
  Result<double> get_number(std::string_view field) const;
  Result<bool> get_bool_or(std::string_view field, bool fallback) const;
  Result<std::string> get_string_or(std::string_view field, std::string fallback) const;
  Result<std::vector<int64_t>> get_int_list_or(std::string_view field, std::vector<int64_t> fallback) const;

 private:
  std::string path_;
  std::string architecture_;
  std::string model_type_;
  DType dtype_ = DType::kBF16;
  std::shared_ptr<const nlohmann::json> json_;
};

// ---------------------------------------------------------------------------------------
// Inference layout and rank numbering.

// One inference rank. Global rank = replica*(D*T) + dp*T + tp; the rank within its
// engine (its EP rank when EP is on) is dp*T + tp.
struct RankInfo {
  int global = 0;
  int replica = 0;
  int dp = 0;
  int tp = 0;
  int tp_size = 1;
  int dp_size = 1;
  int ep_size = 1;  // 1 (off) or tp_size * dp_size

  int engine_rank() const { return dp * tp_size + tp; }
  int engine_size() const { return dp_size * tp_size; }
  bool ep_enabled() const { return ep_size > 1; }
  // Routed experts: with EP, rank engine_rank() of ep_size owns a contiguous range of
  // whole experts; without EP every expert is TP-split across all T*D engine ranks.
  int expert_ep_rank() const { return ep_enabled() ? engine_rank() : 0; }
  int expert_ep_size() const { return ep_size; }
  int expert_tp_rank() const { return ep_enabled() ? 0 : engine_rank(); }
  int expert_tp_size() const { return ep_enabled() ? 1 : engine_size(); }
  // "rank 5 (replica 1, dp 0, tp 1)"
  std::string to_string() const;
};

struct InferenceLayout {
  int tp = 1;
  int dp = 1;
  int ep = 1;
  int replicas = 1;

  // "tp=T,dp=D,ep=E,replicas=R": any subset in any order, defaults 1, spaces allowed
  // around items. Errors: unknown key, repeated key, a value that is not a positive
  // integer, E not 1 or T*D.
  static Result<InferenceLayout> parse(std::string_view text);

  int engine_size() const { return tp * dp; }
  int world_size() const { return replicas * tp * dp; }
  // kOutOfRange when `global` is not in [0, world_size()).
  Result<RankInfo> rank(int global) const;
  // "tp=2,dp=1,ep=1,replicas=2"
  std::string to_string() const;
};

// What the inference ranks keep of their linear weights (post-processing after loading).
// Each is e4m3 values with a scale per tile; the scale's tile, value and storage differ
// (ferry/device.h, Fp8Scales), and so does the scale param (X.weight + suffix):
enum class Quantize : uint8_t {
  kNone,
  kFp8,       // "fp8": 128x128 tiles, fp32 amax/448 (vLLM/DeepSeek), "_scale_inv" f32
  kFp8Ue8m0,  // "fp8-ue8m0": 128x128 tiles, power-of-two scales as E8M0 bytes (DeepGEMM/SGLang), "_scale_inv" u8
  kMxfp8,     // "mxfp8": 1x32 runs of a row, E8M0 scales (OCP MX v1.0), "_scale" u8 [.., rows, cols/32]
};
// "none" | "fp8" | "fp8-ue8m0" | "mxfp8"
Result<Quantize> parse_quantize(std::string_view text);
std::string_view quantize_name(Quantize q);

// A checkpoint's multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers:
// model.layers.{L..L+n-1}.* after the L decoder layers), the draft model of speculative
// decoding. What the loader does with them:
enum class MtpLayers : uint8_t {
  kNone,   // "none": the checkpoint has none (a checkpoint with them is refused, naming the first)
  kSkip,   // "skip": the checkpoint has them; nothing is loaded from them (vLLM's DeepseekV3ForCausalLM)
  kDraft,  // "draft": loaded into the draft's params as vLLM's DeepSeekMTP names them: model.layers.{i}.
           // {embed_tokens, enorm, hnorm, eh_proj, shared_head.norm, shared_head.head} and the decoder
           // layer under model.layers.{i}.mtp_block., sharded as the main layers
};
// "none" | "skip" | "draft"
Result<MtpLayers> parse_mtp_layers(std::string_view text);
std::string_view mtp_layers_name(MtpLayers m);

struct LoaderOptions {
  Quantize quantize = Quantize::kNone;
  // Architectures with MTP layers (DeepseekV3ForCausalLM); the others have none to load.
  MtpLayers mtp = MtpLayers::kNone;
};

// ---------------------------------------------------------------------------------------
// Loaders.

// One param of a rank as loaded (before post-processing).
struct ParamInfo {
  TensorDecl decl;
  int group = 0;                 // post-processing group (embedding, layer i, final)
  bool fp8_quantizable = false;  // a linear weight the FP8 hook quantises (Quantize::kFp8)
};

// Loads one checkpoint tensor into params (real or recording). Mirrors a vLLM
// weight_loader: only view ops and copy_/zero_ on the params found in the map.
using LoadFn = std::function<Status(const Tensor& source, const TensorMap& params)>;
// Post-processing of one group's params on real tensors; may replace params (e.g. a
// bf16 weight by its FP8 version) and add new ones (its scales).
using PostFn = std::function<Status(TensorMap& params)>;

// What one inference rank holds and how it loads. Made by ModelLoader::rank().
class RankLoader {
 public:
  // How one checkpoint tensor is loaded (a tensor may have several, e.g. q, k and v
  // into a fused qkv): the load function and the post-processing groups it writes.
  struct TensorLoad {
    LoadFn fn;
    std::vector<int> groups;  // post-processing groups of the params it writes
  };
  // A post-processing group (not a sync's layer group, Routes::group_names): params
  // post-processed together once all of them landed (vLLM's process_weights_after_loading).
  struct Group {
    std::string name;          // "embedding", "layer 3", "final"
    std::vector<PostFn> post;  // in order
  };

  const RankInfo& info() const { return info_; }
  // Params as loaded (what a plan writes), in declaration order.
  const std::vector<ParamInfo>& params() const { return params_; }
  std::vector<TensorDecl> param_decls() const;
  // Params after post-processing (what the inference engine finally holds).
  const std::vector<TensorDecl>& final_params() const { return final_params_; }
  const std::vector<Group>& groups() const { return groups_; }

  // Loads checkpoint tensor `source_name` (`source` must have the checkpoint's dtype, or
  // for a bf16/fp16/fp32 tensor another of those three, which the copies convert: fp32
  // master weights; and its full shape) into `params`. A checkpoint tensor this rank holds nothing of is a no-op;
  // a name that is not in the checkpoint is kNotFound.
  Status load(std::string_view source_name, const Tensor& source, const TensorMap& params) const;
  // The groups whose params `source_name` writes on this rank (empty for none).
  std::vector<int> groups_written_by(std::string_view source_name) const;
  // Runs group `group`'s post-processing on real params (after all its shards landed).
  Status process_weights_after_loading(int group, TensorMap& params) const;

 private:
  friend class models::RankBuilder;
  RankInfo info_;
  std::string architecture_;
  std::shared_ptr<const std::unordered_map<std::string, TensorDecl>> checkpoint_index_;
  std::vector<ParamInfo> params_;
  std::vector<TensorDecl> final_params_;
  std::unordered_map<std::string, std::vector<TensorLoad>> loads_;  // by checkpoint tensor name
  std::vector<Group> groups_;
};

class ModelLoader {
 public:
  virtual ~ModelLoader() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const InferenceLayout& layout() const = 0;
  virtual const LoaderOptions& options() const = 0;
  // Every checkpoint tensor, in checkpoint order (embedding, layers, final).
  virtual const std::vector<TensorDecl>& checkpoint() const = 0;
  // Rank `global` of the layout (cached; kOutOfRange for a rank outside the layout).
  virtual Result<std::shared_ptr<const RankLoader>> rank(int global) const = 0;

  // Conveniences over rank().
  Result<std::vector<TensorDecl>> params(int global) const;
  Status load(int global, std::string_view source_name, const Tensor& source, const TensorMap& params) const;
  Status process_weights_after_loading(int global, int group, TensorMap& params) const;
};

// Architectures by config.json's architectures[0], sorted.
std::vector<std::string> supported_architectures();
// The loader for config.architecture(). kInvalidArgument for an unknown architecture
// (the message lists the supported ones) and for a layout the model can't be sharded
// over (names the field and the constraint: "num_attention_heads 28 is not divisible by
// tp 8").
Result<std::unique_ptr<ModelLoader>> make_model_loader(const ModelConfig& config, const InferenceLayout& layout,
                                                       const LoaderOptions& options = {});

// ---------------------------------------------------------------------------------------
// Plans, direct loads, checkpoints.

// Runs every tensor of `metadata` (default: loader.checkpoint()) as a Tensor::source
// through rank `global`'s load() under a Recorder and returns the canonical plan.
// Errors: an unknown source name (kNotFound); a param written by no copy, or an element
// written by no copy (padding is recorded with zero_) or by two (kInvalidArgument,
// naming the param).
Result<Plan> record_plan(const ModelLoader& loader, int global);
Result<Plan> record_plan(const ModelLoader& loader, int global, const std::vector<TensorDecl>& metadata);

// FP8 from a plan recorded anywhere (ferry.record_load, a Recorder over an engine's own
// loader): marks `params` as kept block-quantised the way a built-in loader with `quantize`
// keeps its linear weights (the same tiles, scale format and scale param: the weight's
// name + the form's suffix, e.g. "_scale_inv"). Producers then quantise them wherever
// one holds a tile's every element (EngineOptions::quantize_on), and the consumer
// quantises the rest after they land (quantize_kept_param), bit for bit the same.
// Replaces any earlier marks. Errors (kInvalidArgument): kNone, an empty list, a name
// that is not a param of the plan (naming it), a param listed twice, one that is not a
// float tensor of at least 2 dims, a scale name that is a param of the plan.
Status mark_quantized(Plan& plan, Quantize quantize, const std::vector<std::string>& params);

// The consumer's step for one param a plan keeps block-quantised (`bq`, Plan::quantized;
// `name` is the param's): still in its loaded dtype in `params`, it is quantised as the
// built-in loaders do (params[name] replaced by e4m3, params[bq.scale_name] added);
// arrived as e4m3 (a producer quantised it), its scale must be there (kNotFound
// otherwise). kNotFound when params has no `name`.
Status quantize_kept_param(const BlockQuantize& bq, const std::string& name, TensorMap& params);

// Loads rank `global` from real checkpoint tensors with the loader itself, running each
// group's post-processing as soon as every checkpoint tensor feeding it has landed.
// Returns the final params (RankLoader::final_params()).
Result<TensorMap> load_rank_direct(const ModelLoader& loader, int global, const TensorMap& checkpoint);
// The same with each checkpoint tensor fetched when the loader needs it and dropped once
// loaded (a checkpoint too big to hold at once: memory is the params plus one tensor).
// Tensors the rank loads nothing from are not fetched. fetch's errors are returned.
using FetchTensor = std::function<Result<Tensor>(const TensorDecl& decl)>;
Result<TensorMap> load_rank_direct(const ModelLoader& loader, int global, const FetchTensor& fetch);
// Loads rank `global` by executing `plan` on the checkpoint, then post-processes every
// group in order. Returns the final params.
Result<TensorMap> load_rank_from_plan(const ModelLoader& loader, int global, const Plan& plan,
                                      const TensorMap& checkpoint, const ExecuteOptions& options = {});

// A checkpoint with deterministic pseudo-random values (a hash of seed, tensor name and
// element index): every element finite, neighbours distinct in almost all cases.
Result<TensorMap> random_checkpoint(const std::vector<TensorDecl>& decls, uint64_t seed);
// Every declared tensor present with its dtype and shape, and no other tensor
// (kNotFound for a missing or an unknown name, kInvalidArgument for a dtype or shape
// disagreement; messages name the tensor).
Status check_checkpoint(const std::vector<TensorDecl>& decls, const TensorMap& checkpoint);

// Every tensor of the *.safetensors files in `dir` (a sharded HF checkpoint), borrowed
// from read-only mappings. kUnimplemented when ferry was built without the io module.
Result<TensorMap> read_checkpoint_dir(const std::string& dir);

// The first element where two real tensor maps differ bit for bit over `decls`.
struct Mismatch {
  std::string param;
  int64_t index = 0;  // flat, row-major
  std::string detail;  // "direct 0x3f80, plan 0x0000"
};
Result<std::optional<Mismatch>> compare_params(const std::vector<TensorDecl>& decls, const TensorMap& a,
                                               const TensorMap& b);

// ---------------------------------------------------------------------------------------
// Shrink: a structurally equal small variant of a config for a layout.

struct ShrinkChange {
  std::string field;
  std::string before;  // JSON text; "(absent)" or "(derived N)" when not in the file
  std::string after;
};
struct ShrinkResult {
  ModelConfig config;
  std::vector<ShrinkChange> changes;
};
// Fewer layers, smaller dims, fewer heads (and experts, per architecture), keeping
// every divisibility `layout` needs (heads by tp or kv replication, padded vocab by tp,
// intermediate sizes by tp, hidden a multiple of 128, the vocab's padding remainder).
// Fails like make_model_loader when the original config can't take the layout.
Result<ShrinkResult> shrink_config(const ModelConfig& config, const InferenceLayout& layout,
                                   const LoaderOptions& options = {});

}  // namespace ferry
