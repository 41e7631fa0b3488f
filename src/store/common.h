// Internal helpers shared by the store backends: argument checks and small utilities.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ferry/status.h"
#include "ferry/store.h"

namespace ferry::store_detail {

// A printable, bounded rendering of a key for error messages.
std::string quote_key(std::string_view key);

Status check_key(std::string_view op, std::string_view key);
Status check_value(std::string_view op, std::string_view key, std::string_view value);
// ttl in [0, kMaxTtl]; when `positive`, ttl must be > 0.
Status check_ttl(std::string_view op, std::string_view key, int64_t ttl_ms, bool positive);
Status check_wait(size_t nkeys, int64_t timeout_ms);

// Parses a canonical decimal int64 ("0", "-12", no sign '+', no leading zeros or
// spaces), as Redis does for INCRBY.
std::optional<int64_t> parse_counter(std::string_view text);

// InvalidArgument naming `from` and the length when `token` is shorter than kMinTokenBytes.
Status check_token(std::string_view token, std::string_view from);

// The token to use: explicit, else from the URL, else FERRY_TOKEN, else the file named by
// FERRY_TOKEN_FILE; InvalidArgument if none, or if it is too short (check_token).
Result<std::string> resolve_token(const std::string& explicit_token, const std::string& url_token);

}  // namespace ferry::store_detail
