// src/models/builder.h — the building blocks every architecture is made of.
//
// An architecture is a class derived from ModelLoaderBase with two methods:
//   * declare_checkpoint(CheckpointBuilder&): every HF checkpoint tensor (name, shape,
//     dtype, group) in checkpoint order;
//   * build_rank(RankBuilder&): the params of one rank and, for each checkpoint tensor,
//     how it loads into them — usually one call of a block per param:
//       b.replicated(param, source, group)            norms, routers, biases of row-parallel
//       b.column_parallel(param, source, group, split) output rows split (dim 0)
//       b.row_parallel(param, source, group, split)    input columns split (dim 1)
//       b.qkv(param, {q, k, v}, geometry, group)       fused qkv_proj with GQA replication
//       b.qkv_fused(param, source, geometry, group)    the same from a fused checkpoint tensor
//       b.merged_column(param, {gate, up}, group)      fused gate_up_proj
//       b.merged_column_fused(param, source, sizes)    the same from a fused checkpoint tensor
//       b.vocab_parallel(param, source, vocab, group)  embedding / lm_head, padded to 64
//     and, for anything else, b.param(...) + b.route(source, params, LoadFn) with the
//     tensor-level loaders below (load_*), which mirror vLLM's weight_loader functions.
// Groups: post-processing runs per group after every shard of the group landed. By
// convention group 0 is the embedding, group 1 + i is layer i, the last is "final"
// (norm, lm_head): see ModelLoaderBase::layer_group().
//
// Extension points for the MoE / MLA / FP8-checkpoint architectures (to be written on
// top of these, each in its own arch_*.cpp):
//   * routed experts: declare w13 [E_local, 2*I_local, H] and w2 [E_local, H, I_local]
//     with b.param(); expert_range(info) gives the experts a rank owns (EP) and
//     expert_split(info) the TP split of each expert (no EP: across all T*D ranks);
//     route each `experts.{e}.{gate,up,down}_proj.weight` with load_expert_w13 /
//     load_expert_w2 (which select the expert slot and then apply the TP split), or
//     per-expert slices of a fused checkpoint tensor (Llama-4) with .select()/.transpose().
//   * FP8 checkpoints: a `X.weight_scale_inv` sibling [ceil(out/128), ceil(in/128)]
//     follows its weight at block granularity: block_shard() maps an element shard to
//     the scale blocks covering it (a block straddling two ranks goes to both), and
//     load_scale_column / load_scale_row load them.
//   * extra post-processing: b.post(group, fn) appends a PostFn to a group (e.g. MLA's
//     kv_b split), b.set_final_params() when it changes the final params.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/device.h"
#include "ferry/models.h"

namespace ferry::models {

// ---------------------------------------------------------------------------------------
// Shard math.

// A TP split: this rank's index among `size` ranks.
struct Split {
  int rank = 0;
  int size = 1;
};

// A contiguous range [start, start + length) of one dim.
struct Range {
  int64_t start = 0;
  int64_t length = 0;
  int64_t end() const { return start + length; }
};

// The rank's part of `total` split evenly (the caller checked divisibility).
inline Range even_shard(int64_t total, Split s) {
  const int64_t n = total / s.size;
  return {s.rank * n, n};
}
inline int64_t round_up(int64_t v, int64_t multiple) { return (v + multiple - 1) / multiple * multiple; }
inline int64_t ceil_div(int64_t v, int64_t d) { return (v + d - 1) / d; }

// vLLM pads the vocab of embeddings and lm_head to a multiple of 64.
inline constexpr int64_t kVocabPadding = 64;
inline int64_t padded_vocab(int64_t vocab) { return round_up(vocab, kVocabPadding); }

// FP8 block size (DeepSeek-V3's weight_block_size, and what Quantize::kFp8 produces).
inline constexpr int64_t kFp8Block = 128;
// The scale blocks (of `block` elements) covering the element range `r`. When a range
// starts mid-block (a block straddles two ranks' shards), that block is in both ranks'
// ranges: each rank gets a copy of its scale.
inline Range block_shard(Range r, int64_t block = kFp8Block) {
  const int64_t b0 = r.start / block;
  const int64_t b1 = r.length == 0 ? b0 : ceil_div(r.end(), block);
  return {b0, b1 - b0};
}

// GQA geometry of a fused qkv_proj under TP (vLLM's QKVParallelLinear).
struct QkvGeometry {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  Split tp;

  int64_t q_heads_local() const { return num_heads / tp.size; }
  // kv heads per rank: n_kv / T, or 1 when T > n_kv (replicated).
  int64_t kv_heads_local() const { return std::max<int64_t>(1, num_kv_heads / tp.size); }
  // The first kv head this rank holds: r * n_kv/T, or r / (T / n_kv) under replication.
  int64_t kv_head_start() const {
    return num_kv_heads >= tp.size ? tp.rank * kv_heads_local() : tp.rank / (tp.size / num_kv_heads);
  }
  // Rows of this rank's fused param: [q | k | v].
  int64_t local_rows() const { return (q_heads_local() + 2 * kv_heads_local()) * head_dim; }
  // heads divisible by T; n_kv divisible by T or T divisible by n_kv.
  Status validate(std::string_view what = "") const;
};

// ---------------------------------------------------------------------------------------
// Tensor-level loaders (vLLM weight_loader equivalents). `param` is the rank's whole
// param (real or recording), `src` the whole checkpoint tensor. View ops + copy_/zero_.

// param.copy_(src)
Status load_replicated(const Tensor& param, const Tensor& src);
// param <- src.narrow(dim, split.rank * n, n), n = param.size(dim) (ColumnParallelLinear
// with dim 0; RowParallelLinear with dim 1).
Status load_split(const Tensor& param, const Tensor& src, int64_t dim, Split split);
// One of q/k/v (shard 0, 1, 2) into the fused qkv param (weight [rows, H] or bias [rows]).
Status load_qkv_shard(const Tensor& param, const Tensor& src, int shard, const QkvGeometry& g);
// A fused checkpoint qkv tensor (rows q, k, v) into the fused param.
Status load_qkv_fused(const Tensor& param, const Tensor& src, const QkvGeometry& g);
// Shard `shard` of a merged column-parallel param whose full (unsplit) parts have
// `full_sizes` rows (gate_up: {I, I}): rows [sum(local sizes before), +local) of the
// param <- rows [split.rank * local, +local) of src. `dim` is the output dim.
Status load_merged_shard(const Tensor& param, const Tensor& src, int shard, const std::vector<int64_t>& full_sizes,
                         Split split, int64_t dim = 0);
// A fused checkpoint tensor holding every part (rows in order) into the merged param.
Status load_merged_fused(const Tensor& param, const Tensor& src, const std::vector<int64_t>& full_sizes, Split split,
                         int64_t dim = 0);
// Vocab-parallel rows: param rows [0, n) are padded-vocab rows [rank*n, +n); rows below
// `vocab` are copied from src, the rest zero-filled with zero_() (never read).
Status load_vocab_parallel(const Tensor& param, const Tensor& src, int64_t vocab, Split split);
// Routed experts: expert `expert` of the checkpoint into the fused expert params of a
// rank owning experts `experts` (EP range): nothing when outside; else into slot
// expert - experts.start. w13 [E_local, 2*I_local, H] takes gate (shard 0) / up (1)
// rows split by `split`; w2 [E_local, H, I_local] takes down_proj's columns.
Status load_expert_w13(const Tensor& w13, const Tensor& src, int64_t expert, Range experts, int shard,
                       int64_t intermediate, Split split);
Status load_expert_w2(const Tensor& w2, const Tensor& src, int64_t expert, Range experts, Split split);
// FP8 checkpoint scales [ceil(out/128), ceil(in/128)] of a column (dim 0) or row (dim 1)
// parallel weight whose local shard is `elements` of that dim: param <- the covering
// blocks (block_shard).
Status load_scale_split(const Tensor& param, const Tensor& src, int64_t dim, Range elements);

// Routed experts of a rank: with EP, a contiguous range of whole experts; without, all.
inline Range expert_range(const RankInfo& info, int64_t num_experts) {
  return even_shard(num_experts, Split{info.expert_ep_rank(), info.expert_ep_size()});
}
// The TP split of each expert's intermediate dim: across all T*D ranks without EP.
inline Split expert_split(const RankInfo& info) { return Split{info.expert_tp_rank(), info.expert_tp_size()}; }

// ---------------------------------------------------------------------------------------
// FP8 e4m3 block quantisation (the Quantize::kFp8 post-processing).

// Quantises a real float tensor (2-D [rows, cols], or N-D with leading batch dims) to
// float8_e4m3fn with one fp32 scale per block x block tile of the last two dims:
// scale = amax(|w|) / 448 over the tile (1 when the tile is all zero),
// q = e4m3(w / scale) rounded to nearest even. Returns {q, scale_inv} where scale_inv has
// shape [..., ceil(rows/block), ceil(cols/block)] and w ~= q * scale_inv.
// `format` (ferry/device.h, Fp8Scales): kUe8m0 gives power-of-two scales as E8M0 bytes
// (u8, same shape); kMx 1 x block tiles with E8M0 scales (u8 [..., rows, ceil(cols/block)]).
Result<std::pair<Tensor, Tensor>> quantize_fp8_blocks(const Tensor& w, int64_t block = kFp8Block,
                                                      Fp8Scales format = Fp8Scales::kF32);
// "model.layers.0.mlp.down_proj.weight" -> "model.layers.0.mlp.down_proj.weight_scale_inv"
inline std::string scale_name(const std::string& weight) { return weight + "_scale_inv"; }

// What Quantize `q` keeps of a quantizable weight: the scale format, the tile's columns
// (its rows too, but for MXFP8's single row), the scale param's name, dtype and shape.
struct QuantizedForm {
  Fp8Scales format = Fp8Scales::kF32;
  int64_t block = kFp8Block;
  std::string scale_suffix = "_scale_inv";
  DType scale_dtype = DType::kF32;
};
QuantizedForm quantized_form(Quantize q);
Shape quantized_scale_shape(const QuantizedForm& f, const Shape& weight);

// ---------------------------------------------------------------------------------------
// Builders.

class ModelLoaderBase;

// What a config may make ferry declare: a config.json is input from outside, and a
// number in it (num_experts: 1e9, intermediate_size: 2^40) must be refused for what it
// would cost before any of that work starts, not when memory runs out. The largest
// real checkpoints declare ~140k tensors (Kimi-K2: 60 MoE layers x 384 experts x 3
// linears x weight and scale) and ~2 TB; the limits leave ample room over both. A
// tensor's declaration costs ~0.5 KB of metadata before any plan is made (name, shape,
// the indexes over them), so the tensor limit bounds that to ~0.5 GB.
inline constexpr int64_t kMaxCheckpointTensors = int64_t{1} << 20;
inline constexpr int64_t kMaxCheckpointBytes = int64_t{1} << 50;  // 1 PiB

// The checkpoint's tensors, in order.
class CheckpointBuilder {
 public:
  explicit CheckpointBuilder(DType dtype) : dtype_(dtype) {}
  // Adds a tensor of the config's dtype (or `dtype`). Duplicate names are a bug
  // (kInternal). A tensor past kMaxCheckpointTensors, or one whose bytes take the
  // checkpoint past kMaxCheckpointBytes, is kInvalidArgument naming the tensor and the
  // size it would need (architectures check their counts before declaring, see
  // validate_experts; this is the bound for everything else).
  Status add(std::string name, Shape shape);
  Status add(std::string name, Shape shape, DType dtype);
  DType dtype() const { return dtype_; }
  std::vector<TensorDecl>& decls() { return decls_; }
  // Bytes of every tensor added so far.
  int64_t bytes() const { return bytes_; }

 private:
  DType dtype_;
  int64_t bytes_ = 0;
  std::vector<TensorDecl> decls_;
  std::unordered_map<std::string, size_t> index_;
};

// One rank's params and routes. The high-level blocks derive each param's shape from the
// checkpoint shapes of its sources; fp8_quantizable marks linear weights for Quantize::kFp8.
class RankBuilder {
 public:
  RankBuilder(const ModelLoaderBase& model, RankInfo info);

  const RankInfo& info() const { return loader_->info_; }
  const ModelConfig& config() const;
  const LoaderOptions& options() const;
  // Attention / dense TP split of this rank.
  Split tp() const { return Split{info().tp, info().tp_size}; }
  int final_group() const;
  int num_groups() const;
  // The checkpoint declaration of `name` (kInternal when absent: an architecture bug).
  Result<TensorDecl> source(const std::string& name) const;

  // Declares a param (kInternal on a duplicate or a bad group).
  Status param(std::string name, Shape shape, DType dtype, int group, bool fp8_quantizable = false);
  // `source` loads into `params` (already declared) with `fn`. Several routes per source
  // are allowed (tied embeddings: embed_tokens feeds the embedding and lm_head).
  Status route(const std::string& source, const std::vector<std::string>& params, LoadFn fn);
  // Appends a post-processing step to `group` (after the FP8 hook, when enabled).
  Status post(int group, PostFn fn);
  // Overrides the final params (default: params, with fp8_quantizable weights turned
  // into e4m3 + "_scale_inv" fp32 block scales when Quantize::kFp8).
  void set_final_params(std::vector<TensorDecl> decls) { final_override_ = std::move(decls); }

  // --- blocks (see the file comment) ---
  Status replicated(const std::string& param, const std::string& source, int group);
  Status column_parallel(const std::string& param, const std::string& source, int group, Split split,
                         bool quantizable = true);
  // 1-D sources (biases) are replicated, as RowParallelLinear's bias is.
  Status row_parallel(const std::string& param, const std::string& source, int group, Split split,
                      bool quantizable = true);
  Status qkv(const std::string& param, const std::vector<std::string>& qkv_sources, const QkvGeometry& g, int group,
             bool quantizable = true);
  Status qkv_fused(const std::string& param, const std::string& source, const QkvGeometry& g, int group,
                   bool quantizable = true);
  Status merged_column(const std::string& param, const std::vector<std::string>& sources, int group, Split split,
                       bool quantizable = true);
  Status merged_column_fused(const std::string& param, const std::string& source,
                             const std::vector<int64_t>& full_sizes, int group, Split split, bool quantizable = true);
  Status vocab_parallel(const std::string& param, const std::string& source, int64_t vocab, int group, Split split);

  // Validates and hands out the RankLoader (call once).
  Result<std::shared_ptr<const RankLoader>> finish();

 private:
  const ModelLoaderBase& model_;
  std::shared_ptr<RankLoader> loader_;
  std::unordered_map<std::string, size_t> param_index_;
  std::optional<std::vector<TensorDecl>> final_override_;
  std::vector<std::vector<PostFn>> extra_post_;
  Status first_error_;
};

// The ModelLoader implementation architectures derive from.
class ModelLoaderBase : public ModelLoader {
 public:
  ModelLoaderBase(ModelConfig config, InferenceLayout layout, LoaderOptions options)
      : config_(std::move(config)), layout_(layout), options_(options) {}

  // Declares the checkpoint (call once after construction; factories do).
  Status init();

  const ModelConfig& config() const override { return config_; }
  const InferenceLayout& layout() const override { return layout_; }
  const LoaderOptions& options() const override { return options_; }
  const std::vector<TensorDecl>& checkpoint() const override { return checkpoint_; }
  Result<std::shared_ptr<const RankLoader>> rank(int global) const override;

  // Groups: 0 embedding, 1..L layers, L+1 final.
  virtual int num_layers() const = 0;
  int num_groups() const { return num_layers() + 2; }
  static int embedding_group() { return 0; }
  static int layer_group(int layer) { return layer + 1; }
  int final_group() const { return num_layers() + 1; }
  std::string group_name(int group) const;

  const std::shared_ptr<const std::unordered_map<std::string, TensorDecl>>& checkpoint_index() const {
    return index_;
  }

 protected:
  virtual Status declare_checkpoint(CheckpointBuilder& c) const = 0;
  virtual Status build_rank(RankBuilder& b) const = 0;

 private:
  ModelConfig config_;
  InferenceLayout layout_;
  LoaderOptions options_;
  std::vector<TensorDecl> checkpoint_;
  std::shared_ptr<const std::unordered_map<std::string, TensorDecl>> index_;
  mutable std::mutex mu_;
  mutable std::unordered_map<int, std::shared_ptr<const RankLoader>> cache_;
};

// Makes and initialises an architecture's loader: `make<T>(cfg, layout, opts, args...)`.
template <typename T, typename... Args>
Result<std::unique_ptr<ModelLoader>> make_loader(Args&&... args) {
  auto loader = std::make_unique<T>(std::forward<Args>(args)...);
  FERRY_RETURN_IF_ERROR(loader->init());
  return std::unique_ptr<ModelLoader>(std::move(loader));
}

// "num_attention_heads 28 is not divisible by tp 8 (llama.json)"
Status require_divisible(const ModelConfig& cfg, std::string_view field, int64_t value, std::string_view by_name,
                         int64_t by);

}  // namespace ferry::models
