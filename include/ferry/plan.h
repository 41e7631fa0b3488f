// ferry/plan.h — a ShardPlan: the exact element map from checkpoint (source) tensors
// into one inference rank's parameter buffers, and the executor that replays it.
//
// How a plan is made: run a model loader with recording tensors inside a Recorder
// scope. Every `copy_` from a recording source appends a Copy; every `zero_` on a
// recording param appends a Zero (padding). Then `canonicalize()`:
//   * in each copy, merges dims contiguous on both sides and drops size-1 dims;
//   * sorts copies by (param, destination offset) and coalesces adjacent copies
//     (same source and param, same strides, consecutive) into one;
// so that two loaders that write the same element map produce byte-identical
// encodings, equal hashes and the fewest copies.
//
// Ownership: a Plan is a value; it names tensors, it holds no data.
// Threading: concurrent readers are safe; the setters (set_quantized, set_source_dtype)
// and canonicalize() change it and need it to themselves.
// A Recorder is bound to the thread that created it and must be destroyed there.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry {

// A named tensor with its dtype and full shape.
struct TensorDecl {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;
  friend bool operator==(const TensorDecl&, const TensorDecl&) = default;
};

// Elements of sources[source] at `src` go to params[param] at `dst`, matched
// index by index (src.shape == dst.shape). Offsets and strides are in elements of
// each tensor's flat row-major storage. Float dtypes may differ (converted on replay).
struct Copy {
  uint32_t source = 0;
  uint32_t param = 0;
  Layout src;
  Layout dst;
  friend bool operator==(const Copy&, const Copy&) = default;
};

// Elements of params[param] at `dst` are zero (padding never read from a source).
struct Zero {
  uint32_t param = 0;
  Layout dst;
  friend bool operator==(const Zero&, const Zero&) = default;
};

// The consumer keeps params[param] block-quantised to FP8 e4m3 (issue 29): a scale per
// tile of its last two dims (block x block, or 1 x block for MXFP8), leading dims each on
// their own, and the scales as a param of its own named `scale_name`. What post-processing
// does today on the consumer; stating it in the plan lets the router give the job to a
// producer that holds a tile's every element (RouterOptions::quantize_on), bit for bit
// the same. `format` is ferry/device.h's Fp8Scales (0: fp32 inverse scales, 1: UE8M0
// bytes, 2: MXFP8), kept as a byte so that plans need no device header.
struct BlockQuantize {
  uint32_t param = 0;
  uint8_t format = 0;
  uint32_t block = 128;
  std::string scale_name;
  friend bool operator==(const BlockQuantize&, const BlockQuantize&) = default;
};

struct PlanStats {
  uint64_t copies = 0;
  uint64_t zeros = 0;
  uint64_t elements = 0;       // elements copied from sources
  uint64_t bytes = 0;          // source bytes read (what a transfer moves)
  uint64_t zero_elements = 0;  // padding elements
};

class Plan {
 public:
  // Current binary encoding version (see encode()): 2 adds the quantised params, and is
  // written only where there are some (a plan without them encodes and hashes as before).
  static constexpr uint32_t kEncodingVersion = 2;
  // Decoding refuses counts and sizes beyond these (a hostile blob can't allocate
  // unbounded memory).
  static constexpr uint64_t kMaxTensors = 1u << 24;
  static constexpr uint64_t kMaxEntries = 1u << 28;
  static constexpr uint64_t kMaxRank = 16;
  static constexpr uint64_t kMaxNameLength = 4096;

  const std::vector<TensorDecl>& sources() const { return sources_; }
  const std::vector<TensorDecl>& params() const { return params_; }
  const std::vector<Copy>& copies() const { return copies_; }
  const std::vector<Zero>& zeros() const { return zeros_; }
  // Sorted by param; at most one per param.
  const std::vector<BlockQuantize>& quantized() const { return quantized_; }
  // The params the consumer keeps block-quantised (replacing any earlier list). Errors: a
  // param index out of range or listed twice, a param that is not a float matrix
  // (at least 2 dims), a format above 2, a block of 0 or above 2^16, a scale name that is
  // empty, names a param of the plan or is used twice.
  Status set_quantized(std::vector<BlockQuantize> quantized);

  // Reads source `index` as `dtype` instead of its declared dtype: a trainer that holds a
  // checkpoint's 16-bit tensors as fp32 masters (or the reverse) serves the plan, and its
  // copies convert, as a plan recorded against the trainer's dtype would. Only between
  // f32, bf16 and f16 (kInvalidArgument naming the source otherwise); kOutOfRange for an
  // index past sources().
  Status set_source_dtype(uint32_t index, DType dtype);

  // Index of a declared tensor, adding it when new. Fails when the name is declared
  // with a different dtype or shape.
  Result<uint32_t> declare_source(const TensorDecl& decl);
  Result<uint32_t> declare_param(const TensorDecl& decl);
  std::optional<uint32_t> find_source(std::string_view name) const;
  std::optional<uint32_t> find_param(std::string_view name) const;

  // Appends after checking indices, equal shapes and bounds against the declarations.
  Status add_copy(Copy copy);
  Status add_zero(Zero zero);

  // See the file comment. Idempotent.
  void canonicalize();

  // Every layout within its tensor's bounds, copy shapes equal, dtypes compatible.
  Status validate() const;

  // xxHash64 of the encoding (canonicalize first for a layout-independent hash).
  uint64_t hash() const;
  // Compact, versioned, little-endian binary encoding (varints).
  std::string encode() const;
  // Bounds-checked decoding of untrusted bytes; never reads outside `bytes`, never
  // allocates beyond the limits above, and validates the result.
  static Result<Plan> decode(std::span<const std::byte> bytes);
  static Result<Plan> decode(std::string_view bytes);

  PlanStats stats() const;

  // For each param, how many copies or zeros write each element: fails naming the first
  // param with an element written by none (unless `allow_unwritten`) or by two.
  Status check_coverage(bool allow_unwritten = false) const;

  // Human-readable dump, one copy per line (for debugging and `ferry` verbose output).
  std::string to_string() const;

  friend bool operator==(const Plan&, const Plan&) = default;

 private:
  std::vector<TensorDecl> sources_;
  std::vector<TensorDecl> params_;
  std::vector<Copy> copies_;
  std::vector<Zero> zeros_;
  std::vector<BlockQuantize> quantized_;
  std::unordered_map<std::string, uint32_t> source_index_;
  std::unordered_map<std::string, uint32_t> param_index_;
};

// Records copies made on this thread while it lives (scoped; nests by restoring the
// previous sink on destruction). The first failed record is kept in status() and
// returned from every later record, so a loader can check once at the end.
class Recorder final : public RecordSink {
 public:
  Recorder();
  ~Recorder() override;
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  Status record_copy(const Tensor& dst, const Tensor& src) override;
  Status record_zero(const Tensor& dst) override;

  const Status& status() const { return status_; }
  const Plan& plan() const { return plan_; }
  // The canonicalised plan, or the first recording error.
  Result<Plan> finish();

 private:
  Plan plan_;
  Status status_;
  RecordSink* previous_ = nullptr;
};

using TensorMap = std::unordered_map<std::string, Tensor>;

struct ExecuteOptions {
  int threads = 0;                         // 0: hardware concurrency
  uint64_t parallel_min_bytes = 8u << 20;  // below this, one thread
  void* stream = nullptr;                  // CUDA plans: the cudaStream_t the copies run on (null: default)
};

// Replays `plan` from real `sources` into real `params` (both by name; contiguous; dtype
// and shape must match the declarations, errors name the tensor). Zeros are written.
// Tensors in the maps that the plan does not name are ignored. Every tensor in host
// memory, or every one on the same CUDA device: then the copies and zeros run there as
// one batch (ferry/device.h's copy_batch, on options.stream; it returns when they are
// done) and source and param dtypes must agree (a GPU copy moves bytes).
Status execute(const Plan& plan, const TensorMap& sources, const TensorMap& params,
               const ExecuteOptions& options = {});

}  // namespace ferry
