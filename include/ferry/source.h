// ferry/source.h — what a trainer exposes to ferry (shared/DESIGN.md §4): its tensors
// in HF format, which boxes of them each trainer rank holds, and the local data of one
// layer group on demand. Plus layout helpers that derive holdings for Megatron-style
// (TP/PP/EP/ETP/DP) and FSDP-style trainers from a model's tensor list, the layer
// groups, and a synthetic in-memory source for tests, benchmarks and the demo.
//
// Coordinates: every box is a box of the *HF-format* tensor (per-dimension [start,
// start+size)), whatever the trainer's native layout. A trainer whose native layout
// differs (e.g. fused qkv in Megatron's interleaved order) converts inside
// materialize(), locally, without communication.
//
// Classification (Megatron helper): tensors are classified by name suffix, not by
// architecture; see the table in docs/routing.md and `classify_tensor`.
//
// Errors: nothing here throws; messages name the tensor, the field and the constraint.
// Threading: layouts, holdings and MegatronHoldings are values; a WeightSource is used
// from one thread at a time unless its implementation says otherwise.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "ferry/plan.h"
#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry {

// ---------------------------------------------------------------------------------------
// Boxes and holdings

// A box of a tensor's index space: dims k cover [start[k], start[k] + size[k]).
// A 0-d tensor's only box has empty start and size.
struct Box {
  Shape start;
  Shape size;
  int64_t numel() const { return shape_numel(size); }
  bool empty() const { return numel() == 0; }
  bool contains(const Box& other) const;
  bool intersects(const Box& other) const;
  std::string to_string() const;  // "[0:4, 2:6]"
  friend bool operator==(const Box&, const Box&) = default;
  friend auto operator<=>(const Box&, const Box&) = default;
};

// The whole of a tensor of `shape`.
Box full_box(const Shape& shape);

// One box of one tensor held by a trainer rank; `tensor` indexes Holdings::tensors.
struct HeldBox {
  uint32_t tensor = 0;
  Box box;
  friend bool operator==(const HeldBox&, const HeldBox&) = default;
};

// What one trainer rank holds: the tensors it holds anything of, as it sees them (name,
// dtype, full HF shape — the router checks them against the metadata and against the
// other holders), and its boxes. A rank may hold several boxes of one tensor (e.g. the
// q, k and v rows of a fused qkv_proj); boxes of one rank must not overlap.
struct Holdings {
  std::vector<TensorDecl> tensors;
  std::vector<HeldBox> boxes;

  // Adds a box of `decl` (declaring it when new; same name with another dtype/shape is
  // an error naming the tensor). Empty boxes are ignored.
  Status add(const TensorDecl& decl, Box box);
  uint64_t bytes() const;  // bytes of all boxes
  friend bool operator==(const Holdings&, const Holdings&) = default;
};

// ---------------------------------------------------------------------------------------
// Groups: the unit of a sync's pipeline.

// Group of a tensor by name: "layers.{i}." anywhere in the name -> layer i; otherwise a
// name containing "embed" is in the pre group, everything else (final norm, lm_head) in
// the post group.
struct GroupOf {
  enum Kind : uint8_t { kPre, kLayer, kPost } kind = kPre;
  int64_t layer = 0;
};
GroupOf group_of(std::string_view name);

// Groups of a tensor list, ordered pre, layer 0..L-1, post (L = largest layer index + 1);
// group ids index that order. Empty groups (no tensor) are kept, so ids are stable.
class Groups {
 public:
  Groups() = default;
  explicit Groups(const std::vector<TensorDecl>& metadata);
  int size() const { return static_cast<int>(names_.size()); }
  int num_layers() const { return size() - 2; }
  // Group id of metadata[i].
  int of_tensor(size_t i) const { return tensor_group_[i]; }
  int of_name(std::string_view name) const;
  const std::string& name(int group) const { return names_[static_cast<size_t>(group)]; }  // "pre", "layer 3", "post"
  const std::vector<int>& tensor_groups() const { return tensor_group_; }

 private:
  std::vector<std::string> names_;
  std::vector<int> tensor_group_;
};

// ---------------------------------------------------------------------------------------
// Trainer layouts

// How a trainer's ranks hold the model.
//   Megatron: "tp=T,pp=P,ep=E,etp=X[,dp=D][,world=W][,first=F][,last=L]". Global rank =
//     stage*(T*D) + dp*T + tp for dense weights; the same ranks of a stage re-factored as
//     edp*(E*X) + ep*X + etp for routed experts (Megatron's expert grid), so T*D must be a
//     multiple of E*X. D defaults to W/(T*P) when world is given, else to the smallest D
//     with T*D a multiple of E*X. Layers split contiguously over PP: F layers in the
//     first stage and L in the last when given, the rest evenly (earlier stages take the
//     remainder); embeddings in the first stage, final norm and lm_head in the last, and
//     so are multi-token-prediction layers (trailing layers with an eh_proj: DeepSeek-V3's
//     MTP), which the split does not count.
//   FSDP: "fsdp=N": every tensor split on dim 0 over N ranks, torch.chunk style
//     (ceil(n/N) rows each, the last ranks may hold fewer or none; 0-d tensors on rank 0).
struct TrainerLayout {
  enum class Kind : uint8_t { kMegatron, kFsdp } kind = Kind::kMegatron;
  int tp = 1, pp = 1, ep = 1, etp = 1, dp = 1;
  int fsdp = 1;
  // Layers of the first and last PP stage (0: even split). Megatron's
  // decoder_first/last_pipeline_num_layers: the other stages split the rest evenly.
  int first = 0, last = 0;
  // `dtype=fp32|bf16|fp16`: the dtype the trainer holds the checkpoint's 16/32-bit float
  // tensors in (fp32 master weights of a bf16 checkpoint); unset: the checkpoint's own.
  // FP8 and integer tensors are held as the checkpoint has them.
  std::optional<DType> dtype;

  // The most ranks a layout may have (each value and every product of them), the same
  // bound as InferenceLayout's: checked before anything is sized by a rank count.
  static constexpr int kMaxRanks = 1 << 20;

  // Parses the --trainer string. Errors: unknown or repeated key, a value that is not a
  // positive integer (dtype: not fp32, bf16 or fp16), fsdp mixed with Megatron keys, T*D not a multiple of E*X, world
  // not a multiple of T*P, a value or a product (T*P*D, E*X) over kMaxRanks.
  static Result<TrainerLayout> parse(std::string_view text);
  int world_size() const;
  int stage_size() const { return kind == Kind::kFsdp ? fsdp : tp * dp; }
  int edp() const { return tp * dp / (ep * etp); }
  std::string to_string() const;  // "tp=4,pp=2,ep=8,etp=1,dp=2" | "fsdp=8" (",dtype=fp32")
};

// The metadata a trainer of `layout` publishes for `checkpoint`: the checkpoint's tensors,
// the bf16/fp16/fp32 ones in layout.dtype when it is set.
std::vector<TensorDecl> trainer_metadata(std::vector<TensorDecl> checkpoint, const TrainerLayout& layout);

// What the layout helpers need beyond names and shapes (for fused Phi-3 qkv_proj rows).
struct ModelInfo {
  int64_t q_rows = 0;   // num_attention_heads * head_dim
  int64_t kv_rows = 0;  // num_key_value_heads * head_dim
};
// From an HF config (fields at the top level or under text_config). Missing or
// non-positive fields, and rows that overflow int64, leave zeros (a fused qkv_proj then
// fails naming the tensor).
ModelInfo model_info_from_config(const nlohmann::json& config);

// How a tensor is split across a Megatron trainer's ranks (see docs/routing.md).
enum class TensorClass : uint8_t {
  kReplicated,     // every TP rank of the stage holds the whole tensor (norms, routers, ...)
  kColumn,         // dim 0 split over TP (q/k/v_proj, gate/up_proj, w1/w3, q_b/kv_b_proj, MTP eh_proj)
  kRow,            // dim 1 split over TP (o_proj, down_proj, w2)
  kVocab,          // dim 0 split over TP (embed_tokens, lm_head, MTP shared_head.head)
  kFusedQkv,       // dim 0 = [q | k | v], each part split over TP (Phi-3 qkv_proj)
  kFusedGateUp,    // dim 0 = [gate | up], each half split over TP (Phi-3 gate_up_proj)
  kExpertColumn,   // one routed expert ("experts.{e}."), dim 0 split over ETP
  kExpertRow,      // one routed expert, dim 1 split over ETP
  kExpertsGateUp,  // fused experts [E, H, 2I]: dim 0 over EP, dim 2 = [gate | up] over ETP
  kExpertsDown,    // fused experts [E, I, H]: dim 0 over EP, dim 1 over ETP
};
std::string_view tensor_class_name(TensorClass c);
// Classification by name suffix; `expert` receives e for "experts.{e}." names.
TensorClass classify_tensor(std::string_view name, int64_t* expert = nullptr);

// Holdings of every rank of a trainer layout, for a tensor list, plus the PP stage of
// every tensor (what the broadcast baseline needs).
struct TrainerHoldings {
  TrainerLayout layout;
  std::vector<Holdings> ranks;     // world_size() entries
  std::vector<int> tensor_stage;   // per metadata tensor: the PP stage that holds it
};
// Errors name the tensor and the constraint ("tp 4 does not divide dim 0 (6) of
// 'model.layers.0.self_attn.k_proj.weight'", "24 experts of layer 3 are not divisible
// by ep 16"), or the layout's: more than kMaxRanks ranks, a non-positive value, a PP
// stage left without layers (pp larger than the model's layers), all checked before
// any rank's holdings are allocated.
Result<TrainerHoldings> make_holdings(const std::vector<TensorDecl>& metadata, const TrainerLayout& layout,
                                      const ModelInfo& info = {});
// How many boxes make_holdings would make over every rank, with the same checks and
// errors, without making any (no rank allocated; O(tensors x tp), not O(ranks)): what
// routing the layout costs grows with (route.h, RoutingCost).
Result<uint64_t> count_held_boxes(const std::vector<TensorDecl>& metadata, const TrainerLayout& layout,
                                  const ModelInfo& info = {});

// ---------------------------------------------------------------------------------------
// WeightSource

// The local data of one held box: a real tensor of the box's shape, in the tensor's
// dtype; any non-negative strides (a view of the trainer's own memory, e.g. a row range
// of a fused weight or a column range: packed straight from there). Contiguous boxes
// can also be served in place (ProducerOptions::source_regions). `box` indexes
// Holdings::boxes.
struct LocalBox {
  uint32_t box = 0;
  Tensor data;
};

// What a trainer implements to adopt ferry. One instance per trainer rank.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Every HF-format tensor: name, dtype, full shape.
  virtual const std::vector<TensorDecl>& metadata() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Boxes held by `rank` (a source built from a layout helper knows every rank's; one
  // that only knows its own returns kUnimplemented for other ranks).
  virtual Result<Holdings> holdings(int rank) const = 0;
  // This rank's data for group `group` (Groups(metadata()) ids): one LocalBox per held
  // box whose tensor is in that group, in holdings order. The tensors stay valid until
  // the next materialize() call at least.
  virtual Result<std::vector<LocalBox>> materialize(int group) = 0;
};

// How much of a synthetic checkpoint changes from one version to the next (delta syncs,
// docs/delta.md). fraction 1 (the default): every element is drawn afresh at every
// version. fraction f < 1: each element (scattered) or each whole tensor (clustered: an
// expert, a projection) is redrawn once every 1/f versions, at a phase of its own, so
// that a fraction f of them is redrawn between any two consecutive versions (a redrawn
// element keeps its value with the chance of drawing it again: 1/128 for bf16). Values
// stay a closed form of (seed, version, name, index): every replica and every direct
// load agrees without replaying versions. f == 0: nothing changes after version 0.
struct SyntheticChanges {
  double fraction = 1.0;
  bool clustered = false;
  friend bool operator==(const SyntheticChanges&, const SyntheticChanges&) = default;
};
// kInvalidArgument unless 0 <= fraction <= 1.
Status check_synthetic_changes(const SyntheticChanges& changes);

// Value of element `index` (flat, row-major, of the full tensor) of tensor `name` at
// version `version`: a hash of (seed, the version it was last redrawn at under
// `changes`, name, index) mapped to a value exactly representable in `dtype` (integers
// in [-64, 64) / 8 for floats; FP8 e4m3 too).
double synthetic_value(uint64_t seed, uint64_t version, std::string_view name, int64_t index, DType dtype,
                       const SyntheticChanges& changes = {});
// The whole tensor `decl` at `version`, as a real tensor (for direct-load references).
Tensor synthetic_tensor(uint64_t seed, uint64_t version, const TensorDecl& decl, const SyntheticChanges& changes = {});

// An in-memory source: rank `rank` of a trainer whose holdings are given; materialize()
// fills each box from synthetic_value at the current version.
class SyntheticSource final : public WeightSource {
 public:
  SyntheticSource(std::vector<TensorDecl> metadata, std::shared_ptr<const std::vector<Holdings>> holdings, int rank,
                  uint64_t seed);
  const std::vector<TensorDecl>& metadata() const override { return metadata_; }
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(holdings_->size()); }
  Result<Holdings> holdings(int rank) const override;
  Result<std::vector<LocalBox>> materialize(int group) override;

  void set_version(uint64_t version) { version_ = version; }
  uint64_t version() const { return version_; }
  // What changes between versions (default: everything); checked by the caller
  // (check_synthetic_changes).
  void set_changes(const SyntheticChanges& changes) { changes_ = changes; }
  const SyntheticChanges& changes() const { return changes_; }

 private:
  std::vector<TensorDecl> metadata_;
  std::shared_ptr<const std::vector<Holdings>> holdings_;
  Groups groups_;
  int rank_ = 0;
  uint64_t seed_ = 0;
  uint64_t version_ = 0;
  SyntheticChanges changes_;
};

}  // namespace ferry
