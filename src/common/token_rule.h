// common/token_rule.h — what makes a job token too weak to prove anything, the one rule
// the store and the transport both apply (header-only; internal).
#pragma once

#include <bitset>
#include <optional>
#include <string>
#include <string_view>

namespace ferry {

// Why `token` is too weak, or nullopt (a phrase that follows "the token is"): shorter than `min_bytes`; with a space or a control
// character (a token pasted with its newline, or padding); or of fewer than 4 distinct
// bytes ("aaaaaaaaaaaaaaaa" and its like: sixteen bytes that guess in a few tries). A
// random token (`openssl rand -hex 16`, 32 hex digits) passes.
inline std::optional<std::string> token_weakness(std::string_view token, size_t min_bytes) {
  if (token.size() < min_bytes)
    return std::to_string(token.size()) + " bytes; at least " + std::to_string(min_bytes) + " are required";
  std::bitset<256> seen;
  for (char c : token) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) return "too weak: it holds a space or a control character";
    seen.set(u);
  }
  if (seen.count() < 4)
    return "too weak: " + std::to_string(seen.count()) + " distinct bytes (at least 4: a token is a random secret)";
  return std::nullopt;
}

}  // namespace ferry
