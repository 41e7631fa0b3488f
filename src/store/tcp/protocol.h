// The embedded TCP store's wire protocol (version 2): frames, messages, the mutual
// handshake and the per-frame integrity check.
//
// A frame is a u32 little-endian payload length followed by the payload.
//
// Handshake (both sides prove the token; it never crosses the wire):
//
//   1. challenge (server -> client):  u8 op=kChallenge, u32 version, 32-byte Ns
//      (the layout of version 1, so an old client reads the version and says so)
//   2. auth (client -> server):       u8 op=kAuth, u32 version, 32-byte Nc, 32-byte proof
//        proof = HMAC-SHA256(token, kClientProofLabel || Ns || Nc)
//      The server checks the proof in constant time. Refused: it sends one *plain*
//      response {op=kAuth, code, message} (PermissionDenied, a version mismatch, or
//      Unavailable when it is at max_connections) and hangs up.
//   3. welcome (server -> client): the first *sealed* frame, a response {op=kAuth, OK,
//      number = the server's idle timeout in ms (0: none)}. Sealing it needs the
//      session key, which needs the token: a client that can open it knows that the
//      server holds the token and answered *this* connection's Nc. Anything else is
//      PermissionDenied ("the server did not prove the token").
//
//   session key K = HMAC-SHA256(token, kSessionKeyLabel || Ns || Nc)
//
// After the handshake every frame in both directions is sealed: payload = body || tag,
//   tag = HMAC-SHA256(K, direction || u64 seq || body)
// with direction 1 for client->server and 2 for server->client, and seq counting the
// sealed frames sent in that direction from 0 (the welcome is server seq 0). seq is not
// sent: each side keeps its own counters, so a tampered, replayed, reordered, dropped
// or reflected frame fails the tag, and the receiver hangs up. Frames are
// integrity-protected, not encrypted: values are readable on the wire.
//
// Bodies:
//   request:   u8 op, then the op's fields (below)
//   response:  u8 op (echoed), u8 status code, str message, then (status OK only) the body
//
//   str = u32 little-endian length + bytes; i64 = 8 bytes little-endian two's complement.
//
//   op          request fields                              response body
//   kAuth       (handshake, above)                          i64 idle timeout ms (welcome)
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
// could justify. That is what fuzz_store_frame exercises. Readers of a frame (server
// and client) grow the payload buffer as its bytes arrive, never to a claimed length.
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

inline constexpr uint32_t kProtocolVersion = 2;
inline constexpr size_t kFrameHeaderBytes = 4;
inline constexpr size_t kMaxFrameBytes = size_t{64} << 20;  // payload limit after auth (tag included)
inline constexpr size_t kMaxHandshakeFrameBytes = 256;      // payload limit before auth
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kKeyBytes = 32;
inline constexpr std::string_view kClientProofLabel = "ferry-store-v2 client proof";
inline constexpr std::string_view kSessionKeyLabel = "ferry-store-v2 session key";
// Reads of a frame's payload grow the buffer by at most this much at a time.
inline constexpr size_t kReadChunkBytes = 64 * 1024;

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
  std::array<uint8_t, kNonceBytes> nonce{};  // the client's nonce Nc
  std::array<uint8_t, kMacBytes> mac{};      // client_proof(token, Ns, Nc)
};

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;
using SessionKey = std::array<uint8_t, kKeyBytes>;

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

// HMAC-SHA256(token, kClientProofLabel || Ns || Nc).
Mac client_proof(std::string_view token, const Nonce& server_nonce, const Nonce& client_nonce);
// HMAC-SHA256(token, kSessionKeyLabel || Ns || Nc).
SessionKey session_key(std::string_view token, const Nonce& server_nonce, const Nonce& client_nonce);
// Constant-time comparison.
bool macs_equal(const Mac& a, const Mac& b);

enum class Direction : uint8_t { kClientToServer = 1, kServerToClient = 2 };

// One side of an authenticated connection: seals the frames it sends and opens the
// frames it receives, each direction with its own sequence counter (see the top of
// this file). Not thread-safe: one per connection, used under that connection's lock.
class Channel {
 public:
  // `sends`: the direction this side sends in (the client: kClientToServer).
  Channel(const SessionKey& key, Direction sends);

  // Appends the tag to a whole frame from an encode_* function (header + body) and
  // fixes its length field; counts one sent frame.
  Bytes seal(Bytes frame);
  // Checks the tag of one received payload against the next expected sequence number;
  // the body (the payload without its tag) on success, counting one received frame.
  // PermissionDenied when the tag does not match (tampered, replayed, reordered,
  // dropped or reflected); the connection must then be closed.
  Result<ByteSpan> open(ByteSpan payload);

  uint64_t sent() const { return send_seq_; }
  uint64_t received() const { return recv_seq_; }

 private:
  Mac tag(Direction dir, uint64_t seq, ByteSpan body) const;
  SessionKey key_;
  Direction sends_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
};
// Cryptographically random bytes (OpenSSL RAND_bytes).
Status random_bytes(std::span<uint8_t> out);

}  // namespace ferry::store_tcp
