// Generic config shrinking (see shrink.h).
#include "models/shrink.h"

#include "models/builder.h"

namespace ferry::models {

namespace {

nlohmann::json* walk(nlohmann::json& root, const std::string& field, bool create) {
  nlohmann::json* cur = &root;
  size_t pos = 0;
  while (true) {
    const size_t dot = field.find('.', pos);
    const std::string key = field.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end()) {
      if (!create) return nullptr;
      cur = &(*cur)[key];
    } else {
      cur = &*it;
    }
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
  }
}

}  // namespace

void shrink_set(nlohmann::json& root, const std::string& field, const nlohmann::json& value, ShrinkContext& ctx,
                const std::string& before) {
  nlohmann::json* cur = walk(root, field, false);
  if (cur != nullptr && *cur == value) return;
  std::string old = cur != nullptr ? cur->dump() : (before.empty() ? "(absent)" : before);
  cur = walk(root, field, true);
  if (cur == nullptr) return;
  *cur = value;
  ctx.changes->push_back(ShrinkChange{field, std::move(old), value.dump()});
}

int64_t shrink_get_int(const nlohmann::json& root, const std::string& field, int64_t fallback) {
  const nlohmann::json* cur = walk(const_cast<nlohmann::json&>(root), field, false);
  if (cur == nullptr || !cur->is_number_integer()) return fallback;
  return cur->get<int64_t>();
}

int64_t shrink_multiple(int64_t value, int64_t multiple, int64_t target) {
  if (value <= target || multiple <= 0) return value;
  return std::min(value, round_up(target, multiple));
}

Status shrink_dense_fields(nlohmann::json& root, const std::string& prefix, ShrinkContext& ctx) {
  const int64_t tp = ctx.layout.tp;
  auto f = [&](const char* name) { return prefix + name; };
  // Validated by the caller (the original config takes the layout), so the reads hold.
  const int64_t layers = shrink_get_int(root, f("num_hidden_layers"), 0);
  const int64_t hidden = shrink_get_int(root, f("hidden_size"), 0);
  const int64_t heads = shrink_get_int(root, f("num_attention_heads"), 0);
  const bool has_kv = walk(root, f("num_key_value_heads"), false) != nullptr &&
                      !walk(root, f("num_key_value_heads"), false)->is_null();
  const int64_t kv = has_kv ? shrink_get_int(root, f("num_key_value_heads"), heads) : heads;
  const bool has_hd = walk(root, f("head_dim"), false) != nullptr && !walk(root, f("head_dim"), false)->is_null();
  const int64_t head_dim = has_hd ? shrink_get_int(root, f("head_dim"), 0) : (heads > 0 ? hidden / heads : 0);
  if (layers <= 0 || hidden <= 0 || heads <= 0 || kv <= 0) {
    return invalid_argument("{}: shrink needs positive {}num_hidden_layers, hidden_size, num_attention_heads",
                            ctx.original.path(), prefix);
  }

  if (layers > kShrinkLayers) {
    shrink_set(root, f("num_hidden_layers"), kShrinkLayers, ctx);
    if (nlohmann::json* lt = walk(root, f("layer_types"), false); lt != nullptr && lt->is_array() &&
                                                                  static_cast<int64_t>(lt->size()) == layers) {
      nlohmann::json cut = nlohmann::json::array();
      for (int64_t i = 0; i < kShrinkLayers; ++i) cut.push_back((*lt)[static_cast<size_t>(i)]);
      shrink_set(root, f("layer_types"), cut, ctx);
    }
  }
  if (hidden > kShrinkHidden) shrink_set(root, f("hidden_size"), kShrinkHidden, ctx);

  // Heads: keep the regime (kv split vs kv replication) and GQA.
  int64_t kv2 = kv >= tp ? tp * std::min<int64_t>(kv / tp, 2) : kv;
  const int64_t group = heads / kv;
  int64_t group2 = std::min<int64_t>(group, 2);
  if ((kv2 * group2) % tp != 0) group2 = group;
  if (!has_kv) kv2 = kv2 * group2, group2 = 1;  // MHA stays MHA
  const int64_t heads2 = kv2 * group2;
  if (has_kv) shrink_set(root, f("num_key_value_heads"), kv2, ctx);
  shrink_set(root, f("num_attention_heads"), heads2, ctx);
  const int64_t hd2 = std::min<int64_t>(head_dim, kShrinkHeadDim);
  if (has_hd) {
    shrink_set(root, f("head_dim"), hd2, ctx);
  } else if (hidden > kShrinkHidden || heads2 != heads) {
    shrink_set(root, f("head_dim"), hd2, ctx, fmt::format("(derived {})", head_dim));
  }

  if (const int64_t inter = shrink_get_int(root, f("intermediate_size"), 0); inter > 0) {
    shrink_set(root, f("intermediate_size"), shrink_multiple(inter, tp, kShrinkIntermediatePerRank * tp), ctx);
  }
  if (const int64_t vocab = shrink_get_int(root, f("vocab_size"), 0); vocab > 0) {
    const int64_t pad = padded_vocab(vocab) - vocab;
    int64_t padded = 512;
    while (padded % tp != 0) padded += kVocabPadding;
    if (padded - pad < vocab) shrink_set(root, f("vocab_size"), padded - pad, ctx);
  }
  return Status::Ok();
}

}  // namespace ferry::models
