// The embedded TCP store's wire protocol: frames, messages, and the auth challenge.
//
// A frame is a u32 little-endian payload length followed by the payload. Payloads:
//
//   challenge (server → client, first frame):  u8 op=kChallenge, u32 version, 32-byte nonce
//   auth      (client → server, answer):       u8 op=kAuth, u32 version, 32-byte mac
//                                               mac = HMAC-SHA256(token, kAuthLabel || nonce)
//   request:   u8 op, then the op's fields (below)
//   response:  u8 op (echoed), u8 status code, str message, then (status OK only) the body
//
//   str = u32 little-endian length + bytes; i64 = 8 bytes little-endian two's complement.
//
//   op          request fields                              response body
//   kAuth       (above)                                     —
//   kSet        str key, str value, i64 ttl_ms              —
//   kGet        str key                                     str value
//   kAdd        str key, i64 delta                          i64 new value
//   kCompareSet str key, u8 has_expected, [str expected],   u8 swapped, u8 has_value,
//               str desired, i64 ttl_ms                     [str value]
//   kRemove     str key                                     u8 existed
//   kList       str prefix                                  u32 n, n × str key
//   kWait       u32 n, n × str key, i64 timeout_ms          —
//   kRenew      str key, i64 ttl_ms                         —
//   kPing       —                                           —
//
// Every decoder here is a pure function over a byte span: it validates every length
// against what is left and against the limits in ferry/store.h, rejects unknown ops,
// unknown status codes and trailing bytes, and never allocates more than the input
// could justify. That is what fuzz_store_frame exercises.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry::store_tcp {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 4;
inline constexpr size_t kMaxFrameBytes = size_t{64} << 20;  // payload limit after auth
inline constexpr size_t kMaxHandshakeFrameBytes = 256;      // payload limit before auth
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr std::string_view kAuthLabel = "ferry-store-auth-v1";

using Bytes = std::vector<uint8_t>;
using ByteSpan = std::span<const uint8_t>;

enum class Op : uint8_t {
  kChallenge = 1,
  kAuth = 2,
  kSet = 3,
  kGet = 4,
  kAdd = 5,
  kCompareSet = 6,
  kRemove = 7,
  kList = 8,
  kWait = 9,
  kRenew = 10,
  kPing = 11,
};
const char* op_name(Op op);

struct Challenge {
  uint32_t version = kProtocolVersion;
  std::array<uint8_t, kNonceBytes> nonce{};
};

struct Auth {
  uint32_t version = kProtocolVersion;
  std::array<uint8_t, kMacBytes> mac{};
};

// One request; which fields are meaningful depends on `op` (see the table above).
struct Request {
  Op op = Op::kPing;
  std::string key;                      // set/get/add/cas/remove/renew; list: the prefix
  std::string value;                    // set: value; cas: desired
  std::optional<std::string> expected;  // cas
  int64_t delta = 0;                    // add
  int64_t ttl_ms = 0;                   // set, cas, renew
  int64_t timeout_ms = 0;               // wait
  std::vector<std::string> keys;        // wait
  friend bool operator==(const Request&, const Request&) = default;
};

struct Response {
  Op op = Op::kPing;
  StatusCode code = StatusCode::kOk;
  std::string message;
  // Body, only when code == kOk:
  std::optional<std::string> value;  // get: the value; cas: the value after the call
  int64_t number = 0;                // add: new value; remove: existed; cas: swapped
  std::vector<std::string> keys;     // list
  friend bool operator==(const Response&, const Response&) = default;
  Status status() const { return code == StatusCode::kOk ? Status::Ok() : Status(code, message); }
};

// Frame header: the payload length, or OutOfRange when it exceeds `max_payload`.
Result<size_t> decode_frame_header(ByteSpan header4, size_t max_payload);

// Splits the first frame off `buffer`. `payload` is empty and `consumed` 0 while more
// bytes are needed; an error means the stream is malformed (close it).
struct FrameSplit {
  size_t consumed = 0;
  ByteSpan payload;
};
Result<FrameSplit> split_frame(ByteSpan buffer, size_t max_payload);

// Encoders return a whole frame (header + payload).
Bytes encode_challenge(const Challenge& c);
Bytes encode_auth(const Auth& a);
Bytes encode_request(const Request& r);
Bytes encode_response(const Response& r);

// Decoders take one payload (without the header).
Result<Challenge> decode_challenge(ByteSpan payload);
Result<Auth> decode_auth(ByteSpan payload);
Result<Request> decode_request(ByteSpan payload);
Result<Response> decode_response(ByteSpan payload);

// Checks a request's arguments against the store's limits (key length, value size,
// ttl and timeout ranges). decode_request checks structure only, so that the server can
// answer a well-formed but invalid request with InvalidArgument instead of hanging up.
Status validate_request(const Request& r);

// HMAC-SHA256(token, kAuthLabel || nonce).
std::array<uint8_t, kMacBytes> auth_mac(std::string_view token,
                                        const std::array<uint8_t, kNonceBytes>& nonce);
bool macs_equal(const std::array<uint8_t, kMacBytes>& a, const std::array<uint8_t, kMacBytes>& b);
// Cryptographically random bytes (OpenSSL RAND_bytes).
Status random_bytes(std::span<uint8_t> out);

}  // namespace ferry::store_tcp
