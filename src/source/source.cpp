// Boxes, holdings, groups, trainer layouts, classification and the layout helpers.
#include <algorithm>
#include <charconv>
#include <map>
#include <numeric>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "ferry/source.h"

namespace ferry {

// ---------------------------------------------------------------------------------------
// Box

bool Box::contains(const Box& o) const {
  if (o.start.size() != start.size()) return false;
  for (size_t k = 0; k < start.size(); ++k) {
    if (o.start[k] < start[k] || o.start[k] + o.size[k] > start[k] + size[k]) return false;
  }
  return true;
}

bool Box::intersects(const Box& o) const {
  if (o.start.size() != start.size() || empty() || o.empty()) return false;
  for (size_t k = 0; k < start.size(); ++k) {
    if (o.start[k] >= start[k] + size[k] || start[k] >= o.start[k] + o.size[k]) return false;
  }
  return true;
}

std::string Box::to_string() const {
  std::string s = "[";
  for (size_t k = 0; k < start.size(); ++k) {
    if (k) s += ", ";
    s += fmt::format("{}:{}", start[k], start[k] + size[k]);
  }
  return s + "]";
}

Box full_box(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

Status Holdings::add(const TensorDecl& decl, Box box) {
  if (box.start.size() != decl.shape.size() || box.size.size() != decl.shape.size()) {
    return invalid_argument("holdings: box {} of '{}' has {} dims, the tensor {}", box.to_string(), decl.name,
                            box.start.size(), shape_str(decl.shape));
  }
  for (size_t k = 0; k < box.start.size(); ++k) {
    if (box.start[k] < 0 || box.size[k] < 0 || box.start[k] + box.size[k] > decl.shape[k]) {
      return out_of_range("holdings: box {} is outside '{}' {}", box.to_string(), decl.name, shape_str(decl.shape));
    }
  }
  if (box.empty()) return Status::Ok();
  uint32_t idx = static_cast<uint32_t>(tensors.size());
  for (size_t i = tensors.size(); i-- > 0;) {
    if (tensors[i].name == decl.name) {
      if (tensors[i] != decl) {
        return invalid_argument("holdings: '{}' declared as {} {} and as {} {}", decl.name,
                                dtype_name(tensors[i].dtype), shape_str(tensors[i].shape), dtype_name(decl.dtype),
                                shape_str(decl.shape));
      }
      idx = static_cast<uint32_t>(i);
      break;
    }
  }
  if (idx == tensors.size()) tensors.push_back(decl);
  boxes.push_back(HeldBox{idx, std::move(box)});
  return Status::Ok();
}

uint64_t Holdings::bytes() const {
  uint64_t n = 0;
  for (const HeldBox& b : boxes) n += static_cast<uint64_t>(b.box.numel()) * dtype_size(tensors[b.tensor].dtype);
  return n;
}

// ---------------------------------------------------------------------------------------
// Groups

GroupOf group_of(std::string_view name) {
  size_t pos = 0;
  while ((pos = name.find("layers.", pos)) != std::string_view::npos) {
    const bool boundary = pos == 0 || name[pos - 1] == '.';
    size_t i = pos + 7, j = i;
    while (j < name.size() && name[j] >= '0' && name[j] <= '9') ++j;
    if (boundary && j > i && j < name.size() && name[j] == '.') {
      int64_t layer = 0;
      std::from_chars(name.data() + i, name.data() + j, layer);
      return GroupOf{GroupOf::kLayer, layer};
    }
    pos += 7;
  }
  if (name.find("embed") != std::string_view::npos) return GroupOf{GroupOf::kPre, 0};
  return GroupOf{GroupOf::kPost, 0};
}

Groups::Groups(const std::vector<TensorDecl>& metadata) {
  int64_t layers = 0;
  std::vector<GroupOf> g;
  g.reserve(metadata.size());
  for (const auto& d : metadata) {
    g.push_back(group_of(d.name));
    if (g.back().kind == GroupOf::kLayer) layers = std::max(layers, g.back().layer + 1);
  }
  names_.push_back("pre");
  for (int64_t i = 0; i < layers; ++i) names_.push_back(fmt::format("layer {}", i));
  names_.push_back("post");
  tensor_group_.reserve(g.size());
  for (const auto& x : g) {
    tensor_group_.push_back(x.kind == GroupOf::kPre     ? 0
                            : x.kind == GroupOf::kLayer ? static_cast<int>(x.layer) + 1
                                                        : static_cast<int>(layers) + 1);
  }
}

int Groups::of_name(std::string_view name) const {
  GroupOf g = group_of(name);
  if (g.kind == GroupOf::kPre) return 0;
  if (g.kind == GroupOf::kPost) return size() - 1;
  return std::min<int>(static_cast<int>(g.layer) + 1, size() - 1);
}

// ---------------------------------------------------------------------------------------
// TrainerLayout

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

Result<TrainerLayout> TrainerLayout::parse(std::string_view text) {
  static const char* kKeys[] = {"tp", "pp", "ep", "etp", "dp", "world", "fsdp", "first", "last", "dtype"};
  std::map<std::string, int> v;
  std::optional<DType> dtype;
  std::string_view rest = text;
  if (trim(rest).empty()) {
    return invalid_argument("trainer layout: empty; expected \"tp=..,pp=..,ep=..,etp=..[,dp=..][,world=..]\" or \"fsdp=N\"");
  }
  while (true) {
    const size_t comma = rest.find(',');
    std::string_view item = trim(rest.substr(0, comma));
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return invalid_argument("trainer layout '{}': item '{}' is not key=value", text, item);
    }
    const std::string key(trim(item.substr(0, eq)));
    const std::string_view val = trim(item.substr(eq + 1));
    if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) {
      return invalid_argument(
          "trainer layout '{}': unknown key '{}' (expected tp, pp, ep, etp, dp, world, first, last, fsdp or dtype)", text, key);
    }
    if (v.count(key) || (key == "dtype" && dtype)) {
      return invalid_argument("trainer layout '{}': key '{}' given twice", text, key);
    }
    if (key == "dtype") {
      auto dt = parse_dtype(val);
      if (!dt.ok() || (*dt != DType::kF32 && *dt != DType::kBF16 && *dt != DType::kF16)) {
        return invalid_argument("trainer layout '{}': dtype must be fp32, bf16 or fp16, got '{}'", text, val);
      }
      dtype = *dt;
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
      continue;
    }
    int n = 0;
    auto [p, ec] = std::from_chars(val.data(), val.data() + val.size(), n);
    if (ec != std::errc() || p != val.data() + val.size() || n <= 0) {
      return invalid_argument("trainer layout '{}': {} must be a positive integer, got '{}'", text, key, val);
    }
    if (n > kMaxRanks) {
      return invalid_argument("trainer layout '{}': {} = {} exceeds the limit of {} ranks", text, key, n, kMaxRanks);
    }
    v[key] = n;
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  TrainerLayout l;
  l.dtype = dtype;
  if (v.count("fsdp")) {
    if (v.size() != 1) {  // dtype is not in v: fsdp=8,dtype=fp32 is a layout
      return invalid_argument("trainer layout '{}': fsdp=N can't be combined with tp/pp/ep/etp/dp/world/first/last", text);
    }
    l.kind = Kind::kFsdp;
    l.fsdp = v["fsdp"];
    l.tp = l.pp = l.ep = l.etp = 1;
    l.dp = l.fsdp;
    return l;
  }
  auto get = [&](const char* k, int def) { return v.count(k) ? v[k] : def; };
  l.tp = get("tp", 1);
  l.pp = get("pp", 1);
  l.ep = get("ep", 1);
  l.etp = get("etp", 1);
  l.first = get("first", 0);
  l.last = get("last", 0);
  if ((l.first || l.last) && l.pp < 2) {
    return invalid_argument("trainer layout '{}': first/last (layers of the first/last PP stage) need pp >= 2", text);
  }
  // Products in 64 bits and bounded before anything is sized by them: tp=100000,pp=100000
  // overflowed int and then asked for a vector of that many ranks.
  const int64_t grid64 = int64_t{l.ep} * l.etp;
  if (grid64 > kMaxRanks) {
    return invalid_argument("trainer layout '{}': ep*etp = {} exceeds the limit of {} ranks", text, grid64, kMaxRanks);
  }
  if (int64_t{l.tp} * l.pp > kMaxRanks) {
    return invalid_argument("trainer layout '{}': tp*pp = {} exceeds the limit of {} ranks", text,
                            int64_t{l.tp} * l.pp, kMaxRanks);
  }
  const int grid = static_cast<int>(grid64);
  if (v.count("world")) {
    const int w = v["world"];
    if (w % (l.tp * l.pp) != 0) {
      return invalid_argument("trainer layout '{}': world {} is not a multiple of tp*pp = {}", text, w, l.tp * l.pp);
    }
    const int dp = w / (l.tp * l.pp);
    if (v.count("dp") && v["dp"] != dp) {
      return invalid_argument("trainer layout '{}': dp {} disagrees with world/(tp*pp) = {}", text, v["dp"], dp);
    }
    l.dp = dp;
  } else if (v.count("dp")) {
    l.dp = v["dp"];
  } else {
    // The smallest D with T*D a multiple of E*X, in closed form: counting D up overflowed
    // T*D in int for tp=1048573,ep=1048576 (found by fuzz_config_layout).
    l.dp = grid / std::gcd(l.tp, grid);
  }
  if (int64_t{l.tp} * l.pp * l.dp > kMaxRanks) {
    return invalid_argument("trainer layout '{}': tp*pp*dp = {} ranks exceeds the limit of {}", text,
                            int64_t{l.tp} * l.pp * l.dp, kMaxRanks);
  }
  if ((l.tp * l.dp) % grid != 0) {
    return invalid_argument(
        "trainer layout '{}': ep*etp = {} must divide tp*dp = {} (the experts of a stage are spread over its tp*dp ranks)",
        text, grid, l.tp * l.dp);
  }
  return l;
}

int TrainerLayout::world_size() const { return kind == Kind::kFsdp ? fsdp : tp * pp * dp; }

std::string TrainerLayout::to_string() const {
  const std::string held = dtype ? fmt::format(",dtype={}", *dtype == DType::kF32   ? "fp32"
                                                            : *dtype == DType::kF16 ? "fp16"
                                                                                    : "bf16")
                                 : std::string();
  if (kind == Kind::kFsdp) return fmt::format("fsdp={}{}", fsdp, held);
  std::string s = fmt::format("tp={},pp={},ep={},etp={},dp={}", tp, pp, ep, etp, dp);
  if (first) s += fmt::format(",first={}", first);
  if (last) s += fmt::format(",last={}", last);
  return s + held;
}

std::vector<TensorDecl> trainer_metadata(std::vector<TensorDecl> checkpoint, const TrainerLayout& layout) {
  if (!layout.dtype) return checkpoint;
  for (TensorDecl& d : checkpoint) {
    if (d.dtype == DType::kF32 || d.dtype == DType::kBF16 || d.dtype == DType::kF16) d.dtype = *layout.dtype;
  }
  return checkpoint;
}

ModelInfo model_info_from_config(const nlohmann::json& config) {
  ModelInfo info;
  const nlohmann::json* c = &config;
  if (config.is_object() && config.contains("text_config") && config["text_config"].is_object() &&
      !config.contains("num_attention_heads")) {
    c = &config["text_config"];
  }
  // Only positive values count (others read as missing), and a product that does not fit
  // in int64 leaves a zero: num_attention_heads=2^62 with head_dim=4 overflowed (found by
  // fuzz_config_layout).
  auto get = [&](const char* k) -> int64_t {
    if (!c->is_object() || !c->contains(k) || !(*c)[k].is_number_integer()) return 0;
    const int64_t v = (*c)[k].get<int64_t>();
    return v > 0 ? v : 0;
  };
  auto rows = [](int64_t heads, int64_t head_dim) -> int64_t {
    int64_t r = 0;
    return __builtin_mul_overflow(heads, head_dim, &r) ? 0 : r;
  };
  const int64_t heads = get("num_attention_heads");
  int64_t kv = get("num_key_value_heads");
  if (kv == 0) kv = heads;
  int64_t hd = get("head_dim");
  if (hd == 0 && heads > 0) hd = get("hidden_size") / heads;
  info.q_rows = rows(heads, hd);
  info.kv_rows = rows(kv, hd);
  return info;
}

// ---------------------------------------------------------------------------------------
// Classification

std::string_view tensor_class_name(TensorClass c) {
  switch (c) {
    case TensorClass::kReplicated: return "replicated";
    case TensorClass::kColumn: return "column";
    case TensorClass::kRow: return "row";
    case TensorClass::kVocab: return "vocab";
    case TensorClass::kFusedQkv: return "fused-qkv";
    case TensorClass::kFusedGateUp: return "fused-gate-up";
    case TensorClass::kExpertColumn: return "expert-column";
    case TensorClass::kExpertRow: return "expert-row";
    case TensorClass::kExpertsGateUp: return "experts-gate-up";
    case TensorClass::kExpertsDown: return "experts-down";
  }
  return "?";
}

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// ".experts.{e}." in the name: e, else -1.
int64_t expert_index(std::string_view name) {
  size_t pos = 0;
  while ((pos = name.find(".experts.", pos)) != std::string_view::npos) {
    size_t i = pos + 9, j = i;
    while (j < name.size() && name[j] >= '0' && name[j] <= '9') ++j;
    if (j > i && j < name.size() && name[j] == '.') {
      int64_t e = 0;
      std::from_chars(name.data() + i, name.data() + j, e);
      return e;
    }
    pos += 9;
  }
  return -1;
}

}  // namespace

TensorClass classify_tensor(std::string_view name, int64_t* expert) {
  if (expert) *expert = -1;
  if (ends_with(name, "experts.gate_up_proj")) return TensorClass::kExpertsGateUp;
  if (ends_with(name, "experts.down_proj")) return TensorClass::kExpertsDown;
  // Strip the parameter kind.
  std::string_view base = name;
  bool is_bias = false;
  for (std::string_view suffix : {".weight_scale_inv", ".weight_scale", ".weight", ".bias"}) {
    if (ends_with(base, suffix)) {
      is_bias = suffix == ".bias";
      base.remove_suffix(suffix.size());
      break;
    }
  }
  const size_t dot = base.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? base : base.substr(dot + 1);
  const int64_t e = expert_index(name);
  if (expert) *expert = e;
  if (last.find("norm") != std::string_view::npos) return TensorClass::kReplicated;
  // (DeepSeek's MTP layers share the output layer: shared_head.head is vocab-parallel.)
  if (last == "embed_tokens" || last == "lm_head" || last == "wte" || last == "tok_embeddings" ||
      last == "word_embeddings" || ends_with(base, "shared_head.head")) {
    return TensorClass::kVocab;
  }
  if (last == "qkv_proj") return TensorClass::kFusedQkv;
  if (last == "gate_up_proj") return TensorClass::kFusedGateUp;
  static constexpr std::string_view kColumn[] = {"q_proj", "k_proj", "v_proj",   "gate_proj", "up_proj",
                                                 "w1",     "w3",     "q_b_proj", "kv_b_proj", "eh_proj"};
  static constexpr std::string_view kRow[] = {"o_proj", "down_proj", "w2"};
  for (auto c : kColumn) {
    if (last == c) return e >= 0 ? TensorClass::kExpertColumn : TensorClass::kColumn;
  }
  for (auto r : kRow) {
    if (last == r) {
      // A row-parallel bias is added after the reduction: whole on every TP rank (an
      // expert's: whole on its ETP ranks, see make_holdings).
      if (is_bias && e < 0) return TensorClass::kReplicated;
      return e >= 0 ? TensorClass::kExpertRow : TensorClass::kRow;
    }
  }
  // Routers (gate, router, e_score_correction_bias), MLA's q_a_proj and
  // kv_a_proj_with_mqa, and anything unknown: whole on every TP rank.
  return TensorClass::kReplicated;
}

// ---------------------------------------------------------------------------------------
// make_holdings

namespace {

// Makes every rank's holdings, or (counting) only counts their boxes: the same walk
// and the same errors, with no rank allocated and the boxes every DP replica holds
// alike counted once per slice (count_held_boxes: what routing a layout costs, known
// in microseconds where making the holdings of 10^6 ranks takes seconds and gigabytes).
struct Builder {
  const std::vector<TensorDecl>& meta;
  const bool counting;
  std::vector<Holdings> ranks;
  std::vector<int64_t> last;  // per rank: the metadata index of its last declared tensor
  uint64_t count = 0;

  Builder(const std::vector<TensorDecl>& m, int world, bool count_only)
      : meta(m), counting(count_only), ranks(count_only ? 0 : world), last(count_only ? 0 : world, -1) {}

  void add(int rank, size_t t, const Box& box) {
    if (box.empty()) return;
    if (counting) {
      ++count;
      return;
    }
    Holdings& h = ranks[static_cast<size_t>(rank)];
    if (last[static_cast<size_t>(rank)] != static_cast<int64_t>(t)) {
      h.tensors.push_back(meta[t]);
      last[static_cast<size_t>(rank)] = static_cast<int64_t>(t);
    }
    h.boxes.push_back(HeldBox{static_cast<uint32_t>(h.tensors.size() - 1), box});
  }
  // `box` held by `n` ranks alike (replicas): counted at once when counting.
  template <typename RankOf>
  void add_each(int n, size_t t, const Box& box, RankOf rank_of) {
    if (counting) {
      if (!box.empty()) count += static_cast<uint64_t>(n);
      return;
    }
    for (int i = 0; i < n; ++i) add(rank_of(i), t, box);
  }
};

// Box of `shape` with dim `d` narrowed to [a, a+n).
Box narrowed(const Shape& shape, size_t d, int64_t a, int64_t n) {
  Box b = full_box(shape);
  b.start[d] = a;
  b.size[d] = n;
  return b;
}

Box narrowed(Box b, size_t d, int64_t a, int64_t n) {
  b.start[d] = a;
  b.size[d] = n;
  return b;
}

// torch.chunk: ceil(n/parts) each, the last ones fewer or none.
std::pair<int64_t, int64_t> chunk_range(int64_t n, int parts, int i) {
  const int64_t per = (n + parts - 1) / parts;
  const int64_t a = std::min<int64_t>(n, per * i);
  const int64_t b = std::min<int64_t>(n, a + per);
  return {a, b - a};
}

Status need_dims(const TensorDecl& d, size_t nd, TensorClass c) {
  if (d.shape.size() < nd) {
    return invalid_argument("'{}' {} is classified {} and needs at least {} dims", d.name, shape_str(d.shape),
                            tensor_class_name(c), nd);
  }
  return Status::Ok();
}

Status need_div(const TensorDecl& d, size_t dim, int64_t n, int parts, const char* what) {
  if (n % parts != 0) {
    return invalid_argument("{} {} does not divide dim {} ({}) of '{}' {}", what, parts, dim, n, d.name,
                            shape_str(d.shape));
  }
  return Status::Ok();
}

}  // namespace

namespace {

Result<TrainerHoldings> build_holdings(const std::vector<TensorDecl>& metadata, const TrainerLayout& layout,
                                       const ModelInfo& info, bool count_only, uint64_t* count) {
  // A layout built in code rather than parsed gets the same bounds before any rank is
  // allocated.
  {
    const bool fsdp = layout.kind == TrainerLayout::Kind::kFsdp;
    for (auto [key, n] : {std::pair<const char*, int>{"tp", layout.tp}, {"pp", layout.pp}, {"dp", layout.dp},
                          {"ep", layout.ep}, {"etp", layout.etp}, {"fsdp", layout.fsdp}}) {
      if (n <= 0) return invalid_argument("trainer layout {}: {} must be positive, got {}", layout.to_string(), key, n);
    }
    const int64_t world = fsdp ? int64_t{layout.fsdp} : int64_t{layout.tp} * layout.pp * layout.dp;
    if (world > TrainerLayout::kMaxRanks) {
      return invalid_argument("trainer layout {}: {} ranks exceeds the limit of {}", layout.to_string(), world,
                              TrainerLayout::kMaxRanks);
    }
    if (!fsdp && (int64_t{layout.ep} * layout.etp > int64_t{layout.tp} * layout.dp ||
                  (layout.tp * layout.dp) % (layout.ep * layout.etp) != 0)) {
      return invalid_argument("trainer layout {}: ep*etp = {} must divide tp*dp = {}", layout.to_string(),
                              int64_t{layout.ep} * layout.etp, int64_t{layout.tp} * layout.dp);
    }
    if (layout.first < 0 || layout.last < 0) {
      return invalid_argument("trainer layout {}: first/last must not be negative", layout.to_string());
    }
  }
  TrainerHoldings out;
  out.layout = layout;
  out.tensor_stage.assign(metadata.size(), 0);
  const int world = layout.world_size();
  Builder b(metadata, world, count_only);

  if (layout.kind == TrainerLayout::Kind::kFsdp) {
    for (size_t t = 0; t < metadata.size(); ++t) {
      const TensorDecl& d = metadata[t];
      if (d.shape.empty()) {
        b.add(0, t, Box{});
        // A 0-d tensor has one element: Box{} has numel 1 (empty shape).
        continue;
      }
      // Only the ranks that hold rows: with more ranks than rows (fsdp=10^6) the rest
      // hold nothing of this tensor, and visiting them would cost ranks x tensors.
      const int64_t per = (d.shape[0] + layout.fsdp - 1) / layout.fsdp;
      const int64_t holders = per > 0 ? (d.shape[0] + per - 1) / per : 0;
      if (b.counting) {  // every holder's chunk has rows: non-empty iff a row is
        b.add_each(static_cast<int>(holders), t, narrowed(d.shape, 0, 0, holders > 0 ? 1 : 0), [](int) { return 0; });
        continue;
      }
      for (int r = 0; r < holders; ++r) {
        auto [a, n] = chunk_range(d.shape[0], layout.fsdp, r);
        b.add(r, t, narrowed(d.shape, 0, a, n));
      }
    }
    out.ranks = std::move(b.ranks);
    *count = b.count;
    return out;
  }

  const Groups groups(metadata);
  // Multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers: the layers
  // after the decoder's with an eh_proj) sit in the last stage, as Megatron-Core puts
  // them, and are not counted in the split: L is the decoder's layers.
  int64_t L = groups.num_layers();
  {
    std::vector<bool> mtp(static_cast<size_t>(L), false);
    for (size_t t = 0; t < metadata.size(); ++t) {
      const int g = groups.of_tensor(t);
      if (g >= 1 && g <= L && metadata[t].name.find(".eh_proj.") != std::string::npos) mtp[static_cast<size_t>(g - 1)] = true;
    }
    while (L > 0 && mtp[static_cast<size_t>(L - 1)]) --L;
  }
  const int S = layout.tp * layout.dp;
  // Layer -> stage: contiguous. Layers of the first/last stage as given (Megatron's
  // decoder_first/last_pipeline_num_layers), the rest split evenly, the earlier stages
  // taking one more when it doesn't divide.
  std::vector<int64_t> stage_layers(static_cast<size_t>(layout.pp), 0);
  {
    const int P = layout.pp;
    int64_t rest = L;
    int lo = 0, hi = P;
    if (layout.first) {
      stage_layers[0] = layout.first;
      rest -= layout.first;
      lo = 1;
    }
    if (layout.last) {
      stage_layers[static_cast<size_t>(P - 1)] = layout.last;
      rest -= layout.last;
      hi = P - 1;
    }
    if (rest < 0 || (hi <= lo && rest != 0)) {
      return invalid_argument("trainer layout {}: first/last layers don't fit the model's {} layers over pp {}",
                              layout.to_string(), L, P);
    }
    for (int s = lo; s < hi; ++s) {
      const int64_t n = hi - lo;
      stage_layers[static_cast<size_t>(s)] = rest / n + ((s - lo) < rest % n ? 1 : 0);
    }
    // A stage without a layer holds nothing (or only embeddings or the head) and is no
    // pipeline stage at all; Megatron refuses such a split too.
    for (int s = 0; s < P; ++s) {
      if (stage_layers[static_cast<size_t>(s)] == 0) {
        return invalid_argument(
            "trainer layout {}: pp {} leaves PP stage {} without layers (the model has {} layers; every stage needs "
            "at least one, so pp must be at most {})",
            layout.to_string(), P, s, L, L);
      }
    }
  }
  std::vector<int> layer_stage;
  for (int s = 0; s < layout.pp; ++s) {
    for (int64_t i = 0; i < stage_layers[static_cast<size_t>(s)]; ++i) layer_stage.push_back(s);
  }
  auto stage_of_group = [&](int g) -> int {
    if (g == 0) return 0;
    if (g == groups.size() - 1 || g > L) return layout.pp - 1;  // the head; MTP layers
    return layer_stage[static_cast<size_t>(g - 1)];
  };
  // Experts per MoE block: the prefix before ".experts." -> count.
  std::unordered_map<std::string, int64_t> experts;
  for (const auto& d : metadata) {
    int64_t e = -1;
    classify_tensor(d.name, &e);
    if (e < 0) continue;
    const std::string prefix = d.name.substr(0, d.name.find(".experts."));
    auto& n = experts[prefix];
    n = std::max(n, e + 1);
  }

  const int tp = layout.tp, dp = layout.dp, ep = layout.ep, etp = layout.etp, edp = layout.edp();
  auto dense_rank = [&](int stage, int d, int t) { return stage * S + d * tp + t; };
  auto expert_rank = [&](int stage, int e_dp, int e_ep, int x) { return stage * S + e_dp * (ep * etp) + e_ep * etp + x; };

  for (size_t t = 0; t < metadata.size(); ++t) {
    const TensorDecl& d = metadata[t];
    const int stage = stage_of_group(groups.of_tensor(t));
    out.tensor_stage[t] = stage;
    int64_t e = -1;
    const TensorClass c = classify_tensor(d.name, &e);
    // Boxes per TP slice (dense classes), then given to every DP replica.
    std::vector<std::vector<Box>> slices;  // [tp][boxes]
    auto dense = [&](std::vector<std::vector<Box>> s) {
      if (b.counting) {
        for (int x = 0; x < tp; ++x)
          for (const Box& bx : s[static_cast<size_t>(x)]) b.add_each(dp, t, bx, [](int) { return 0; });
        return;
      }
      for (int r = 0; r < dp; ++r) {
        for (int x = 0; x < tp; ++x) {
          for (const Box& bx : s[static_cast<size_t>(x)]) b.add(dense_rank(stage, r, x), t, bx);
        }
      }
    };
    switch (c) {
      case TensorClass::kReplicated: {
        b.add_each(S, t, full_box(d.shape), [&](int r) { return stage * S + r; });
        break;
      }
      case TensorClass::kColumn:
      case TensorClass::kRow: {
        const size_t dim = c == TensorClass::kColumn ? 0 : 1;
        FERRY_RETURN_IF_ERROR(need_dims(d, dim + 1, c));
        FERRY_RETURN_IF_ERROR(need_div(d, dim, d.shape[dim], tp, "tp"));
        const int64_t n = d.shape[dim] / tp;
        slices.resize(static_cast<size_t>(tp));
        for (int x = 0; x < tp; ++x) slices[static_cast<size_t>(x)].push_back(narrowed(d.shape, dim, x * n, n));
        dense(std::move(slices));
        break;
      }
      case TensorClass::kVocab: {
        FERRY_RETURN_IF_ERROR(need_dims(d, 1, c));
        slices.resize(static_cast<size_t>(tp));
        for (int x = 0; x < tp; ++x) {
          auto [a, n] = chunk_range(d.shape[0], tp, x);
          slices[static_cast<size_t>(x)].push_back(narrowed(d.shape, 0, a, n));
        }
        dense(std::move(slices));
        break;
      }
      case TensorClass::kFusedQkv:
      case TensorClass::kFusedGateUp: {
        FERRY_RETURN_IF_ERROR(need_dims(d, 1, c));
        std::vector<int64_t> parts;
        if (c == TensorClass::kFusedGateUp) {
          FERRY_RETURN_IF_ERROR(need_div(d, 0, d.shape[0], 2, "the gate|up halves:"));
          parts = {d.shape[0] / 2, d.shape[0] / 2};
        } else {
          if (info.q_rows <= 0 || info.q_rows + 2 * info.kv_rows != d.shape[0]) {
            return invalid_argument(
                "fused '{}' {}: q rows {} + 2 x kv rows {} (from the config's heads and head_dim) don't make dim 0",
                d.name, shape_str(d.shape), info.q_rows, info.kv_rows);
          }
          parts = {info.q_rows, info.kv_rows, info.kv_rows};
        }
        slices.resize(static_cast<size_t>(tp));
        int64_t off = 0;
        for (int64_t p : parts) {
          FERRY_RETURN_IF_ERROR(need_div(d, 0, p, tp, "tp (per fused part)"));
          const int64_t n = p / tp;
          for (int x = 0; x < tp; ++x) slices[static_cast<size_t>(x)].push_back(narrowed(d.shape, 0, off + x * n, n));
          off += p;
        }
        dense(std::move(slices));
        break;
      }
      case TensorClass::kExpertColumn:
      case TensorClass::kExpertRow: {
        const std::string prefix = d.name.substr(0, d.name.find(".experts."));
        const int64_t E = experts[prefix];
        if (E % ep != 0) {
          return invalid_argument("ep {} does not divide the {} experts of '{}' (tensor '{}')", ep, E, prefix, d.name);
        }
        const int owner = static_cast<int>(e / (E / ep));
        const bool bias_like = d.shape.size() < 2 && c == TensorClass::kExpertRow;
        std::vector<Box> per_x(static_cast<size_t>(etp));
        if (bias_like) {
          for (auto& bx : per_x) bx = full_box(d.shape);
        } else {
          const size_t dim = c == TensorClass::kExpertColumn ? 0 : 1;
          FERRY_RETURN_IF_ERROR(need_dims(d, dim + 1, c));
          FERRY_RETURN_IF_ERROR(need_div(d, dim, d.shape[dim], etp, "etp"));
          const int64_t n = d.shape[dim] / etp;
          for (int x = 0; x < etp; ++x) per_x[static_cast<size_t>(x)] = narrowed(d.shape, dim, x * n, n);
        }
        for (int x = 0; x < etp; ++x) {
          b.add_each(edp, t, per_x[static_cast<size_t>(x)], [&](int r) { return expert_rank(stage, r, owner, x); });
        }
        break;
      }
      case TensorClass::kExpertsGateUp:
      case TensorClass::kExpertsDown: {
        FERRY_RETURN_IF_ERROR(need_dims(d, 3, c));
        FERRY_RETURN_IF_ERROR(need_div(d, 0, d.shape[0], ep, "ep"));
        const int64_t per = d.shape[0] / ep;
        for (int o = 0; o < ep; ++o) {
          const Box eb = narrowed(d.shape, 0, o * per, per);
          std::vector<std::vector<Box>> xb(static_cast<size_t>(etp));
          if (c == TensorClass::kExpertsDown) {
            FERRY_RETURN_IF_ERROR(need_div(d, 1, d.shape[1], etp, "etp"));
            const int64_t n = d.shape[1] / etp;
            for (int x = 0; x < etp; ++x) xb[static_cast<size_t>(x)].push_back(narrowed(eb, 1, x * n, n));
          } else {
            FERRY_RETURN_IF_ERROR(need_div(d, 2, d.shape[2], 2 * etp, "2 x etp (gate|up halves)"));
            const int64_t half = d.shape[2] / 2, n = half / etp;
            for (int part = 0; part < 2; ++part) {
              for (int x = 0; x < etp; ++x) xb[static_cast<size_t>(x)].push_back(narrowed(eb, 2, part * half + x * n, n));
            }
          }
          for (int x = 0; x < etp; ++x) {
            for (const Box& bx : xb[static_cast<size_t>(x)])
              b.add_each(edp, t, bx, [&](int r) { return expert_rank(stage, r, o, x); });
          }
        }
        break;
      }
    }
  }
  out.ranks = std::move(b.ranks);
  *count = b.count;
  return out;
}

}  // namespace

Result<TrainerHoldings> make_holdings(const std::vector<TensorDecl>& metadata, const TrainerLayout& layout,
                                      const ModelInfo& info) {
  uint64_t unused = 0;
  return build_holdings(metadata, layout, info, false, &unused);
}

Result<uint64_t> count_held_boxes(const std::vector<TensorDecl>& metadata, const TrainerLayout& layout,
                                  const ModelInfo& info) {
  uint64_t count = 0;
  FERRY_RETURN_IF_ERROR(build_holdings(metadata, layout, info, true, &count).status());
  return count;
}

}  // namespace ferry
