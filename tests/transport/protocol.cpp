// Compiled with -O2 even in Debug/ASan builds (see CMakeLists): it touches GiBs.
#include "transport/protocol.h"

#include <xxhash.h>

#include <limits>
#include <string>

namespace ferry::transport_test {
namespace {
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
inline uint64_t word(uint64_t w, uint64_t seed) { return mix(w ^ (seed * 0x100000001b3ULL)); }
inline std::byte byte_at(uint64_t off, uint64_t seed) { return std::byte(uint8_t(word(off >> 3, seed) >> (8 * (off & 7)))); }
}  // namespace

void fill_pattern(std::byte* dst, uint64_t off, uint64_t length, uint64_t seed) {
  uint64_t i = 0;
  while (i < length && ((off + i) & 7) != 0) {
    dst[i] = byte_at(off + i, seed);
    ++i;
  }
  for (; i + 8 <= length; i += 8) {
    uint64_t w = word((off + i) >> 3, seed);
    std::memcpy(dst + i, &w, 8);
  }
  for (; i < length; ++i) dst[i] = byte_at(off + i, seed);
}

uint64_t check_pattern(const std::byte* src, uint64_t off, uint64_t length, uint64_t seed) {
  uint64_t i = 0;
  while (i < length && ((off + i) & 7) != 0) {
    if (src[i] != byte_at(off + i, seed)) return i;
    ++i;
  }
  for (; i + 8 <= length; i += 8) {
    uint64_t w = word((off + i) >> 3, seed), got;
    std::memcpy(&got, src + i, 8);
    if (got != w) break;
  }
  for (; i < length; ++i) {
    if (src[i] != byte_at(off + i, seed)) return i;
  }
  return std::numeric_limits<uint64_t>::max();
}

uint64_t hash_bytes(const std::byte* p, uint64_t length) { return XXH3_64bits(p, length); }

std::string to_hex(std::span<const std::byte> b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(b.size() * 2);
  for (std::byte x : b) {
    s.push_back(d[uint8_t(x) >> 4]);
    s.push_back(d[uint8_t(x) & 15]);
  }
  return s;
}

bool from_hex(const std::string& s, std::vector<std::byte>* out) {
  if (s.size() % 2) return false;
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); i += 2) {
    int a = nib(s[i]), b = nib(s[i + 1]);
    if (a < 0 || b < 0) return false;
    out->push_back(std::byte(uint8_t(a * 16 + b)));
  }
  return true;
}

}  // namespace ferry::transport_test
