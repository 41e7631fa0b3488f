// src/models/shrink.h — helpers to derive a structurally equal small config.
//
// An architecture's ShrinkFn rewrites the config JSON in place with shrink_set(), which
// records every change; shrink_dense_fields() handles the fields every decoder has, and
// MoE architectures add their own (num_experts / n_routed_experts divisible by ep,
// moe_intermediate_size divisible by T*D without EP, first_k_dense_replace below the
// layer count, MLA ranks, ...) with shrink_multiple().
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/models.h"

namespace ferry::models {

struct ShrinkContext {
  const ModelConfig& original;
  InferenceLayout layout;
  LoaderOptions options;
  std::vector<ShrinkChange>* changes;
};

using ShrinkFn = std::function<Status(nlohmann::json& root, ShrinkContext& ctx)>;

// Sets the (dotted) field to `value`, recording a change when it differs. `before` is the
// text to report when the field was absent ("(derived 128)"); default "(absent)".
void shrink_set(nlohmann::json& root, const std::string& field, const nlohmann::json& value, ShrinkContext& ctx,
                const std::string& before = "");
// The value of a dotted integer field, or `fallback`.
int64_t shrink_get_int(const nlohmann::json& root, const std::string& field, int64_t fallback);

// `value` when it is at most `target`; else the smallest multiple of `multiple` that is
// at least `target` (and at most `value`). Keeps divisibility by `multiple`.
int64_t shrink_multiple(int64_t value, int64_t multiple, int64_t target);

// Targets of the generic shrink.
inline constexpr int64_t kShrinkLayers = 2;
inline constexpr int64_t kShrinkHidden = 128;  // one FP8 block
inline constexpr int64_t kShrinkHeadDim = 16;
inline constexpr int64_t kShrinkIntermediatePerRank = 96;  // not a multiple of 128: partial FP8 blocks

// Shrinks the decoder fields under `prefix` ("" or "text_config."):
//   num_hidden_layers -> min(L, 2) (and layer_types truncated); hidden_size -> 128;
//   num_key_value_heads -> tp * min(n_kv/tp, 2) when n_kv >= tp, else unchanged
//   (kv replication stays replication); num_attention_heads -> n_kv' * min(q per kv, 2)
//   (the original ratio when needed for tp); head_dim -> min(head_dim, 16), written
//   explicitly; intermediate_size -> 96 * tp; vocab_size -> the padded vocab's smallest
//   multiple of 64 (at least 512) divisible by tp, minus the original's padding, so the
//   number of zero padding rows is unchanged.
Status shrink_dense_fields(nlohmann::json& root, const std::string& prefix, ShrinkContext& ctx);

}  // namespace ferry::models
