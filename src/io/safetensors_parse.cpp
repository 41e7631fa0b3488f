// Parsing and validation of safetensors headers: a pure function over bytes.
//
// nlohmann::json is used without exceptions: the SAX parser below records errors
// instead of throwing, and every value is type-checked before it is read.
#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "ferry/safetensors.h"

namespace ferry {
namespace {

using json = nlohmann::json;

// Builds the DOM through nlohmann's own DOM builder (exceptions off), keeping the
// parse error's text and refusing duplicate top-level keys (two tensors with one
// name would otherwise silently collapse into one).
class HeaderSax {
 public:
  explicit HeaderSax(json& root) : dom_(root, /*allow_exceptions=*/false) {}

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) { return dom_.number_float(v, s); }
  bool string(json::string_t& s) { return dom_.string(s); }
  bool binary(json::binary_t& b) { return dom_.binary(b); }
  bool start_object(std::size_t n) { ++depth_; return dom_.start_object(n); }
  bool end_object() { --depth_; return dom_.end_object(); }
  bool start_array(std::size_t n) { ++depth_; return dom_.start_array(n); }
  bool end_array() { --depth_; return dom_.end_array(); }
  bool key(json::string_t& k) {
    if (depth_ == 1 && !top_keys_.insert(k).second) {
      duplicate_ = k;
      has_duplicate_ = true;
      return false;
    }
    return dom_.key(k);
  }
  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& ex) {
    error_ = ex.what();
    // "[json.exception.parse_error.101] parse error at ..." -> "parse error at ..."
    if (auto p = error_.find("] "); !error_.empty() && error_[0] == '[' && p != std::string::npos) {
      error_.erase(0, p + 2);
    }
    dom_.parse_error(position, last_token, ex);
    return false;
  }

  bool has_duplicate() const { return has_duplicate_; }
  const std::string& duplicate() const { return duplicate_; }
  const std::string& error() const { return error_; }

 private:
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  int depth_ = 0;
  std::set<std::string> top_keys_;
  bool has_duplicate_ = false;
  std::string duplicate_;
  std::string error_;
};

// A short description of a JSON value for messages: "number -1", "string \"x\"", "array".
std::string show(const json& j) {
  switch (j.type()) {
    case json::value_t::number_integer: return fmt::format("number {}", j.get_ref<const json::number_integer_t&>());
    case json::value_t::number_unsigned: return fmt::format("number {}", j.get_ref<const json::number_unsigned_t&>());
    case json::value_t::number_float: return fmt::format("number {}", j.get_ref<const json::number_float_t&>());
    case json::value_t::string: {
      const std::string& s = j.get_ref<const std::string&>();
      if (s.size() <= 40) return fmt::format("string \"{}\"", s);
      size_t cut = 40;
      while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // whole code points
      return fmt::format("string \"{}...\"", s.substr(0, cut));
    }
    default: return j.type_name();
  }
}

// The known dtypes by their safetensors names (torch names are not accepted here).
bool dtype_from_safetensors_name(std::string_view name, DType* out) {
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto d = static_cast<DType>(i);
    if (dtype_name(d) == name) {
      *out = d;
      return true;
    }
  }
  return false;
}

std::string known_dtypes() {
  std::string s;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (i) s += ", ";
    s += dtype_name(static_cast<DType>(i));
  }
  return s;
}

// A non-negative integer that fits `max`.
bool as_uint(const json& j, uint64_t max, uint64_t* out) {
  if (!j.is_number_unsigned()) {
    // nlohmann stores non-negative literals as unsigned; "0" may come as integer too.
    if (j.is_number_integer() && j.get_ref<const json::number_integer_t&>() >= 0) {
      *out = static_cast<uint64_t>(j.get_ref<const json::number_integer_t&>());
      return *out <= max;
    }
    return false;
  }
  *out = j.get_ref<const json::number_unsigned_t&>();
  return *out <= max;
}

Status parse_entry(const std::string& name, const json& e, uint64_t data_size, SafetensorsTensorInfo* out) {
  auto fail = [&](const std::string& what) { return corrupt("tensor '{}': {}", name, what); };
  if (!e.is_object()) return fail(fmt::format("entry is not a JSON object (got {})", show(e)));
  out->name = name;

  // dtype
  auto it = e.find("dtype");
  if (it == e.end()) return fail("missing 'dtype'");
  if (!it->is_string()) return fail(fmt::format("'dtype' is not a string (got {})", show(*it)));
  const std::string& dt = it->get_ref<const std::string&>();
  if (!dtype_from_safetensors_name(dt, &out->dtype)) {
    return fail(fmt::format("unknown dtype '{}' (ferry reads {})", dt, known_dtypes()));
  }

  // shape
  it = e.find("shape");
  if (it == e.end()) return fail("missing 'shape'");
  if (!it->is_array()) return fail(fmt::format("'shape' is not an array (got {})", show(*it)));
  out->shape.clear();
  out->shape.reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    const json& d = (*it)[i];
    uint64_t v = 0;
    if (!as_uint(d, std::numeric_limits<uint64_t>::max(), &v)) {
      return fail(fmt::format("shape entry {} is not a non-negative integer (got {})", i, show(d)));
    }
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return fail(fmt::format("shape entry {} is {}, more than 2^63 - 1", i, v));
    }
    out->shape.push_back(static_cast<int64_t>(v));
  }
  // Every partial product of the non-zero sizes must fit int64 (Layout arithmetic
  // multiplies prefixes and suffixes of the shape).
  uint64_t numel = 1;
  bool any_zero = false;
  for (int64_t s : out->shape) {
    if (s == 0) {
      any_zero = true;
      continue;
    }
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return fail(fmt::format("shape {} has too many elements (the product overflows 64 bits)",
                              shape_str(out->shape)));
    }
  }
  const uint64_t spanned = numel;  // (the product of the non-zero sizes)
  if (any_zero) numel = 0;

  // data_offsets
  it = e.find("data_offsets");
  if (it == e.end()) return fail("missing 'data_offsets'");
  if (!it->is_array() || it->size() != 2) {
    return fail(fmt::format("'data_offsets' is not an array of 2 integers (got {}{})", show(*it),
                            it->is_array() ? fmt::format(" of {}", it->size()) : std::string()));
  }
  uint64_t off[2];
  for (size_t i = 0; i < 2; ++i) {
    if (!as_uint((*it)[i], std::numeric_limits<uint64_t>::max(), &off[i])) {
      return fail(fmt::format("data_offsets entry {} is not a non-negative integer (got {})", i, show((*it)[i])));
    }
  }
  out->begin = off[0];
  out->end = off[1];
  if (out->begin > out->end) {
    return fail(fmt::format("data_offsets [{}, {}] are reversed (begin > end)", out->begin, out->end));
  }
  if (out->end > data_size) {
    return fail(fmt::format("data_offsets [{}, {}] are out of range: the byte buffer holds {} bytes",
                            out->begin, out->end, data_size));
  }
  const uint64_t es = dtype_size(out->dtype);
  uint64_t need = 0;
  if (__builtin_mul_overflow(numel, es, &need)) {
    return fail(fmt::format("shape {} x {} needs more than 2^64 bytes", shape_str(out->shape), dt));
  }
  if (need != out->nbytes()) {
    return fail(fmt::format("data_offsets [{}, {}] hold {} bytes but shape {} x {} needs {}", out->begin,
                            out->end, out->nbytes(), shape_str(out->shape), dt, need));
  }
  // Past what a tensor may span (kMaxShapeElements, a zero size counted as one): accepted
  // here, the tensor that borrows the bytes refused it (found by fuzz_safetensors_header:
  // [4294, 12972, 4694967296, 0], no element and no byte).
  if (spanned > static_cast<uint64_t>(kMaxShapeElements)) {
    return fail(fmt::format("shape {} spans {} elements (a zero size counted as one), more than a tensor's 2^56",
                            shape_str(out->shape), spanned));
  }
  return Status::Ok();
}

}  // namespace

Result<SafetensorsHeader> parse_safetensors_header(std::span<const std::byte> file) {
  const uint64_t size = file.size();
  if (size < 8) {
    return corrupt("file is {} bytes, too short for the 8-byte header length", size);
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[static_cast<size_t>(i)]);
  if (n > kSafetensorsMaxHeaderSize) {
    return corrupt("header length {} exceeds the limit of {} bytes", n, kSafetensorsMaxHeaderSize);
  }
  if (n > size - 8) {
    return corrupt("header length {} exceeds the {} bytes after the length field (truncated file?)", n, size - 8);
  }

  SafetensorsHeader h;
  h.header_size = n;
  h.data_size = size - 8 - n;

  const char* text = reinterpret_cast<const char*>(file.data() + 8);
  json root;
  HeaderSax sax(root);
  const bool parsed = json::sax_parse(text, text + n, &sax, json::input_format_t::json, /*strict=*/true,
                                      /*ignore_comments=*/false);
  if (sax.has_duplicate()) return corrupt("tensor '{}' appears twice in the header", sax.duplicate());
  if (!parsed || root.is_discarded()) {
    return corrupt("header is not valid JSON: {}", sax.error().empty() ? "parse failed" : sax.error());
  }
  if (!root.is_object()) return corrupt("header is not a JSON object (got {})", show(root));

  h.tensors.reserve(root.size());
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) return corrupt("__metadata__ is not a JSON object (got {})", show(v));
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return corrupt("__metadata__ entry '{}' is not a string (got {})", m.key(), show(m.value()));
        }
        h.metadata.emplace(m.key(), m.value().get_ref<const std::string&>());
      }
      continue;
    }
    SafetensorsTensorInfo info;
    FERRY_RETURN_IF_ERROR(parse_entry(key, v, h.data_size, &info));
    h.tensors.push_back(std::move(info));
  }

  // File order; then the buffer must be covered exactly, tensor after tensor.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  uint64_t pos = 0;
  const SafetensorsTensorInfo* prev = nullptr;  // the tensor that ends at pos
  for (const auto& t : h.tensors) {
    if (t.begin < pos) {
      return corrupt("tensor '{}': data_offsets [{}, {}] overlap tensor '{}' at [{}, {}]", t.name, t.begin, t.end,
                     prev->name, prev->begin, prev->end);
    }
    if (t.begin > pos) {
      return corrupt("byte buffer has a hole: bytes [{}, {}) before tensor '{}' belong to no tensor{}", pos,
                     t.begin, t.name, prev ? fmt::format(" (after tensor '{}')", prev->name) : std::string());
    }
    pos = t.end;  // t.begin == pos <= t.end
    prev = &t;
  }
  if (pos != h.data_size) {
    return corrupt("byte buffer has {} trailing bytes [{}, {}) that belong to no tensor{}", h.data_size - pos, pos,
                   h.data_size, prev ? fmt::format(" (after tensor '{}')", prev->name) : std::string());
  }
  return h;
}

}  // namespace ferry
