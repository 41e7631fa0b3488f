// ModelConfig (HF config.json), InferenceLayout, options.
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ferry/models.h"

namespace ferry {

using Json = nlohmann::json;

namespace {

std::string type_of(const Json& j) {
  if (j.is_null()) return "null";
  if (j.is_boolean()) return "boolean";
  if (j.is_number_integer() || j.is_number_unsigned()) return "integer";
  if (j.is_number_float()) return "number";
  if (j.is_string()) return "string";
  if (j.is_array()) return "array";
  if (j.is_object()) return "object";
  return "value";
}

std::string short_dump(const Json& j) {
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Walks a dotted path; nullptr when a component is absent.
const Json* find_field(const Json& root, std::string_view field) {
  const Json* cur = &root;
  size_t pos = 0;
  while (true) {
    const size_t dot = field.find('.', pos);
    const std::string key(field.substr(pos, dot == std::string_view::npos ? std::string_view::npos : dot - pos));
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end()) return nullptr;
    cur = &*it;
    if (dot == std::string_view::npos) return cur;
    pos = dot + 1;
  }
}

}  // namespace

Result<ModelConfig> ModelConfig::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("{}: cannot open model config", path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return io_error("{}: read failed", path);
  return parse(ss.str(), path);
}

Result<ModelConfig> ModelConfig::parse(std::string_view text, std::string path) {
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("{}: not valid JSON", path);
  return from_json(j, std::move(path));
}

Result<ModelConfig> ModelConfig::from_json(const Json& j, std::string path) {
  if (!j.is_object()) return invalid_argument("{}: a config.json must be a JSON object, got {}", path, type_of(j));
  ModelConfig c;
  c.path_ = std::move(path);
  auto arch = j.find("architectures");
  if (arch == j.end()) return invalid_argument("{}: missing field 'architectures'", c.path_);
  if (!arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return invalid_argument("{}: field 'architectures' must be a non-empty list of strings, got {}", c.path_,
                            short_dump(*arch));
  }
  c.architecture_ = (*arch)[0].get<std::string>();
  c.json_ = std::make_shared<const Json>(j);
  auto mt = c.get_string_or("model_type", "");
  if (!mt.ok()) return mt.status();
  c.model_type_ = *mt;
  // torch_dtype, possibly only in text_config (multimodal configs).
  std::string dtype_field = "torch_dtype";
  if (!c.has(dtype_field) && c.has("text_config.torch_dtype")) dtype_field = "text_config.torch_dtype";
  auto dt = c.get_string_or(dtype_field, "bfloat16");
  if (!dt.ok()) return dt.status();
  auto parsed = parse_dtype(*dt);
  if (!parsed.ok()) {
    return invalid_argument("{}: field '{}' is not a dtype: {}", c.path_, dtype_field, parsed.status().message());
  }
  c.dtype_ = *parsed;
  return c;
}

std::string ModelConfig::dump() const { return json_->dump(2, ' ', false, Json::error_handler_t::replace); }

bool ModelConfig::has(std::string_view field) const {
  const Json* v = find_field(*json_, field);
  return v != nullptr && !v->is_null();
}

Result<int64_t> ModelConfig::get_int(std::string_view field) const {
  const Json* v = find_field(*json_, field);
  if (v == nullptr || v->is_null()) return not_found("{}: missing field '{}'", path_, field);
  if (v->is_number_integer() || v->is_number_unsigned()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return invalid_argument("{}: field '{}' is too large: {}", path_, field, short_dump(*v));
    }
    return v->get<int64_t>();
  }
  if (v->is_number_float()) {
    // Range first: casting a double outside int64 (1e300) is undefined behaviour.
    const double d = v->get<double>();
    if (d >= -9e15 && d <= 9e15 && d == std::trunc(d)) return static_cast<int64_t>(d);
  }
  return invalid_argument("{}: field '{}' must be an integer, got {} {}", path_, field, type_of(*v), short_dump(*v));
}

Result<int64_t> ModelConfig::get_int_or(std::string_view field, int64_t fallback) const {
  if (!has(field)) return fallback;
  return get_int(field);
}

Result<double> ModelConfig::get_number(std::string_view field) const {
  const Json* v = find_field(*json_, field);
  if (v == nullptr || v->is_null()) return not_found("{}: missing field '{}'", path_, field);
  if (!v->is_number()) {
    return invalid_argument("{}: field '{}' must be a number, got {} {}", path_, field, type_of(*v), short_dump(*v));
  }
  return v->get<double>();
}

Result<bool> ModelConfig::get_bool_or(std::string_view field, bool fallback) const {
  const Json* v = find_field(*json_, field);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_boolean()) {
    return invalid_argument("{}: field '{}' must be true or false, got {} {}", path_, field, type_of(*v),
                            short_dump(*v));
  }
  return v->get<bool>();
}

Result<std::string> ModelConfig::get_string_or(std::string_view field, std::string fallback) const {
  const Json* v = find_field(*json_, field);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_string()) {
    return invalid_argument("{}: field '{}' must be a string, got {} {}", path_, field, type_of(*v), short_dump(*v));
  }
  return v->get<std::string>();
}

Result<std::vector<int64_t>> ModelConfig::get_int_list_or(std::string_view field, std::vector<int64_t> fallback) const {
  const Json* v = find_field(*json_, field);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_array()) {
    return invalid_argument("{}: field '{}' must be a list of integers, got {} {}", path_, field, type_of(*v),
                            short_dump(*v));
  }
  std::vector<int64_t> out;
  for (const auto& e : *v) {
    if (!e.is_number_integer()) {
      return invalid_argument("{}: field '{}' must be a list of integers, got element {}", path_, field, short_dump(e));
    }
    out.push_back(e.get<int64_t>());
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Layout

std::string RankInfo::to_string() const {
  return fmt::format("rank {} (replica {}, dp {}, tp {})", global, replica, dp, tp);
}

Result<InferenceLayout> InferenceLayout::parse(std::string_view text) {
  InferenceLayout l;
  bool seen_tp = false, seen_dp = false, seen_ep = false, seen_r = false;
  auto trim = [](std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
  };
  const std::string expected = "expected \"tp=T,dp=D,ep=E,replicas=R\" (any subset, defaults 1)";
  if (trim(text).empty()) return invalid_argument("inference layout is empty; {}", expected);
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    std::string_view item = trim(text.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos));
    pos = comma == std::string_view::npos ? text.size() + 1 : comma + 1;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return invalid_argument("inference layout '{}': item '{}' is not key=value; {}", text, item, expected);
    }
    const std::string_view key = trim(item.substr(0, eq));
    const std::string_view val = trim(item.substr(eq + 1));
    int v = 0;
    auto [ptr, ec] = std::from_chars(val.data(), val.data() + val.size(), v);
    if (ec != std::errc() || ptr != val.data() + val.size() || v <= 0 || v > (1 << 20)) {
      return invalid_argument("inference layout '{}': {} must be a positive integer, got '{}'", text, key, val);
    }
    bool* seen = nullptr;
    int* field = nullptr;
    if (key == "tp") {
      seen = &seen_tp, field = &l.tp;
    } else if (key == "dp") {
      seen = &seen_dp, field = &l.dp;
    } else if (key == "ep") {
      seen = &seen_ep, field = &l.ep;
    } else if (key == "replicas") {
      seen = &seen_r, field = &l.replicas;
    } else {
      return invalid_argument("inference layout '{}': unknown key '{}'; {}", text, key, expected);
    }
    if (*seen) return invalid_argument("inference layout '{}': {} given twice", text, key);
    *seen = true;
    *field = v;
  }
  if (static_cast<int64_t>(l.tp) * l.dp * l.replicas > (1 << 20)) {
    return invalid_argument("inference layout '{}': {} ranks is too many", text,
                            static_cast<int64_t>(l.tp) * l.dp * l.replicas);
  }
  if (l.ep != 1 && l.ep != l.tp * l.dp) {
    return invalid_argument("inference layout '{}': ep must be 1 (off) or tp*dp = {}, got {}", text, l.tp * l.dp, l.ep);
  }
  return l;
}

Result<RankInfo> InferenceLayout::rank(int global) const {
  if (global < 0 || global >= world_size()) {
    return out_of_range("rank {} is outside the layout {} ({} ranks)", global, to_string(), world_size());
  }
  RankInfo r;
  r.global = global;
  r.replica = global / engine_size();
  const int e = global % engine_size();
  r.dp = e / tp;
  r.tp = e % tp;
  r.tp_size = tp;
  r.dp_size = dp;
  r.ep_size = ep;
  return r;
}

std::string InferenceLayout::to_string() const {
  return fmt::format("tp={},dp={},ep={},replicas={}", tp, dp, ep, replicas);
}

Result<Quantize> parse_quantize(std::string_view text) {
  if (text == "none" || text.empty()) return Quantize::kNone;
  if (text == "fp8") return Quantize::kFp8;
  if (text == "fp8-ue8m0") return Quantize::kFp8Ue8m0;
  if (text == "mxfp8") return Quantize::kMxfp8;
  return invalid_argument("quantize: unknown mode '{}' (supported: none, fp8, fp8-ue8m0, mxfp8)", text);
}

Result<MtpLayers> parse_mtp_layers(std::string_view text) {
  if (text == "none" || text.empty()) return MtpLayers::kNone;
  if (text == "skip") return MtpLayers::kSkip;
  if (text == "draft") return MtpLayers::kDraft;
  return invalid_argument("mtp: unknown choice '{}' (supported: none, skip, draft)", text);
}

std::string_view mtp_layers_name(MtpLayers m) {
  switch (m) {
    case MtpLayers::kSkip: return "skip";
    case MtpLayers::kDraft: return "draft";
    default: return "none";
  }
}

std::string_view quantize_name(Quantize q) {
  switch (q) {
    case Quantize::kFp8: return "fp8";
    case Quantize::kFp8Ue8m0: return "fp8-ue8m0";
    case Quantize::kMxfp8: return "mxfp8";
    default: return "none";
  }
}

}  // namespace ferry
