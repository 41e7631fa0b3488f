// common/fields.h — a blob of length-prefixed fields (internal, header only): each field
// a u64 length in host byte order (every reader runs on the same kind of machine as the
// writer: the store is the job's own) and its bytes. The engine's leases are framed so
// (engine/protocol.h), and so are the tools' own store blobs (ferry bench's raw-read
// rendezvous), without the tools reaching into the engine's wire format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry::fields {

inline std::string encode_fields(const std::vector<std::string>& fields) {
  std::string out;
  for (const auto& f : fields) {
    const uint64_t n = f.size();
    out.append(reinterpret_cast<const char*>(&n), sizeof(n));
    out += f;
  }
  return out;
}

// Exactly `expected` fields; kCorrupt for a length past the bytes left, a truncated
// length, or another count.
inline Result<std::vector<std::string>> decode_fields(std::string_view blob, size_t expected) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < blob.size()) {
    uint64_t n = 0;
    if (blob.size() - pos < sizeof(n)) return corrupt("store blob truncated at byte {}", pos);
    if (out.size() == expected) return corrupt("store blob has more than {} fields", expected);
    std::memcpy(&n, blob.data() + pos, sizeof(n));
    pos += sizeof(n);
    if (n > blob.size() - pos) return corrupt("store blob field of {} bytes overruns the blob", n);
    out.emplace_back(blob.substr(pos, n));
    pos += n;
  }
  if (out.size() != expected) return corrupt("store blob has {} fields, expected {}", out.size(), expected);
  return out;
}

inline std::string u64_field(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
// kCorrupt unless `s` is 8 bytes.
inline Result<uint64_t> parse_u64_field(std::string_view s) {
  if (s.size() != 8) return corrupt("u64 field of {} bytes", s.size());
  uint64_t v;
  std::memcpy(&v, s.data(), 8);
  return v;
}

inline std::string bytes_to_string(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}
inline std::span<const std::byte> string_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

}  // namespace ferry::fields
