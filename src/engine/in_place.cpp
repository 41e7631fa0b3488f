#include "engine/in_place.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "engine/protocol.h"

namespace ferry::engine {

std::string InPlaceTable::encode() const {
  if (empty()) return {};
  std::string at(boxes.size() * 16, '\0');
  for (size_t i = 0; i < boxes.size(); ++i) {
    const int64_t r = boxes[i].region;
    std::memcpy(at.data() + 16 * i, &r, 8);
    std::memcpy(at.data() + 16 * i + 8, &boxes[i].offset, 8);
  }
  return encode_fields({u64_field(min_bytes), u64_field(keys.size()), at, encode_fields(keys)});
}

namespace {
// The bytes of held box `i`: numel x dtype size, nullopt when that overflows.
std::optional<uint64_t> box_bytes(const Holdings& h, size_t i) {
  const HeldBox& b = h.boxes[i];
  if (b.tensor >= h.tensors.size()) return std::nullopt;
  uint64_t n = dtype_size(h.tensors[b.tensor].dtype);
  for (int64_t s : b.box.size) {
    if (s < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(s), &n)) return std::nullopt;
  }
  return n;
}
}  // namespace

Result<InPlaceTable> InPlaceTable::decode(std::string_view bytes, const Holdings& holdings) {
  InPlaceTable t;
  if (bytes.empty()) return t;
  const size_t num_boxes = holdings.boxes.size();
  FERRY_ASSIGN_OR_RETURN(auto f, decode_fields(bytes, 4));
  FERRY_ASSIGN_OR_RETURN(t.min_bytes, parse_u64_field(f[0]));
  if (f[2].size() / 16 != num_boxes || f[2].size() % 16 != 0)
    return corrupt("in-place table describes {} bytes of boxes, the producer holds {} boxes", f[2].size(), num_boxes);
  FERRY_ASSIGN_OR_RETURN(const uint64_t nkeys, parse_u64_field(f[1]));
  if (nkeys == 0 || nkeys > kMaxRegions) return corrupt("in-place table names {} regions", nkeys);
  FERRY_ASSIGN_OR_RETURN(t.keys, decode_fields(f[3], nkeys));
  t.boxes.resize(num_boxes);
  for (size_t i = 0; i < num_boxes; ++i) {
    int64_t r;
    std::memcpy(&r, f[2].data() + 16 * i, 8);
    std::memcpy(&t.boxes[i].offset, f[2].data() + 16 * i + 8, 8);
    if (r < -1 || r >= static_cast<int64_t>(t.keys.size()))
      return corrupt("in-place table: box {} names region {} of {}", i, r, t.keys.size());
    t.boxes[i].region = static_cast<int32_t>(r);
    if (r < 0) continue;
    const auto n = box_bytes(holdings, i);
    uint64_t end = 0;
    if (!n || __builtin_add_overflow(t.boxes[i].offset, *n, &end))
      return corrupt("in-place table: box {} at offset {} of region {} overflows ({} bytes)", i, t.boxes[i].offset, r,
                     n ? fmt::format("{}", *n) : std::string("too many"));
  }
  return t;
}

Status InPlaceTable::check_regions(const std::vector<RemoteRegion>& regions, const Holdings& holdings) const {
  if (empty()) return Status::Ok();
  if (regions.size() != keys.size() || boxes.size() != holdings.boxes.size())
    return corrupt("in-place table: {} regions and {} boxes for {} keys and {} held boxes", regions.size(),
                   boxes.size(), keys.size(), holdings.boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) {
    const At& at = boxes[i];
    if (at.region < 0) continue;
    const uint64_t length = regions[static_cast<size_t>(at.region)].length;
    const auto n = box_bytes(holdings, i);
    if (!n || at.offset > length || *n > length - at.offset)
      return corrupt("in-place table: box {} ({} bytes at offset {}) lies outside source region {} ({} bytes)", i,
                     n ? *n : 0, at.offset, at.region, length);
  }
  return Status::Ok();
}

std::string ParamTable::encode() const {
  if (empty()) return {};
  std::vector<std::string> entries;
  entries.reserve(params.size());
  for (const auto& [name, p] : params)
    entries.push_back(encode_fields({name, u64_field(p.key), u64_field(p.offset), u64_field(p.bytes)}));
  return encode_fields({u64_field(min_bytes), u64_field(keys.size()), encode_fields(keys), u64_field(entries.size()),
                        encode_fields(entries), u64_field(other_keys.size()), encode_fields(other_keys)});
}

Result<ParamTable> ParamTable::decode(std::string_view bytes) {
  ParamTable t;
  if (bytes.empty()) return t;
  FERRY_ASSIGN_OR_RETURN(auto f, decode_fields(bytes, 7));
  FERRY_ASSIGN_OR_RETURN(t.min_bytes, parse_u64_field(f[0]));
  FERRY_ASSIGN_OR_RETURN(const uint64_t nkeys, parse_u64_field(f[1]));
  if (nkeys == 0 || nkeys > kMaxRegions) return corrupt("param table names {} regions", nkeys);
  FERRY_ASSIGN_OR_RETURN(t.keys, decode_fields(f[2], nkeys));
  FERRY_ASSIGN_OR_RETURN(const uint64_t nparams, parse_u64_field(f[3]));
  // Each entry takes at least its four length prefixes: a count beyond that is a lie.
  if (nparams > f[4].size()) return corrupt("param table names {} params in {} bytes", nparams, f[4].size());
  FERRY_ASSIGN_OR_RETURN(auto entries, decode_fields(f[4], nparams));
  for (const std::string& e : entries) {
    FERRY_ASSIGN_OR_RETURN(auto x, decode_fields(e, 4));
    Param p;
    FERRY_ASSIGN_OR_RETURN(const uint64_t key, parse_u64_field(x[1]));
    FERRY_ASSIGN_OR_RETURN(p.offset, parse_u64_field(x[2]));
    FERRY_ASSIGN_OR_RETURN(p.bytes, parse_u64_field(x[3]));
    if (key >= nkeys) return corrupt("param table: param '{}' names region {} of {}", x[0], key, nkeys);
    if (p.offset + p.bytes < p.offset) return corrupt("param table: param '{}' at {} + {} bytes overflows", x[0], p.offset, p.bytes);
    p.key = static_cast<uint32_t>(key);
    if (!t.params.emplace(x[0], p).second) return corrupt("param table: param '{}' appears twice", x[0]);
  }
  FERRY_ASSIGN_OR_RETURN(const uint64_t nother, parse_u64_field(f[5]));
  if (nother != 0 && nother != nkeys) return corrupt("param table: a second set of {} regions, not {}", nother, nkeys);
  if (nother != 0) {
    FERRY_ASSIGN_OR_RETURN(t.other_keys, decode_fields(f[6], nother));
  }
  if (nother == 0 && !f[6].empty()) return corrupt("param table: bytes after an empty second set");
  return t;
}

std::vector<InPlacePiece> in_place_pieces(const ProducerGroup& group, const Holdings& holdings,
                                          const InPlaceTable& table) {
  std::vector<InPlacePiece> out;
  if (table.empty()) return out;
  for (const PackOp& op : group.packs) {
    if (op.box >= table.boxes.size() || op.box >= holdings.boxes.size()) continue;
    const InPlaceTable::At& at = table.boxes[op.box];
    if (at.region < 0 || !op.src.is_contiguous() || op.src.offset < 0) continue;
    // A pack that converts (RouterOptions::convert_on) is not the trainer's bytes.
    const HeldBox& hb = holdings.boxes[op.box];
    if (hb.tensor >= holdings.tensors.size() || holdings.tensors[hb.tensor].dtype != op.dtype) continue;
    const uint64_t es = dtype_size(op.dtype);
    const uint64_t bytes = static_cast<uint64_t>(op.src.numel()) * es;
    if (bytes == 0 || bytes < table.min_bytes) continue;
    out.push_back(InPlacePiece{op.offset, bytes, at.region, at.offset + static_cast<uint64_t>(op.src.offset) * es});
  }
  std::sort(out.begin(), out.end(), [](const InPlacePiece& a, const InPlacePiece& b) { return a.offset < b.offset; });
  return out;
}

}  // namespace ferry::engine
