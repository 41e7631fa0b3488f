#include "store/tcp/protocol.h"

#include <cstring>
#include <initializer_list>
#include <limits>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "common/hmac.h"
#include "store/common.h"

namespace ferry::store_tcp {

const char* op_name(Op op) {
  switch (op) {
    case Op::kChallenge: return "challenge";
    case Op::kAuth: return "auth";
    case Op::kSet: return "set";
    case Op::kGet: return "get";
    case Op::kAdd: return "add";
    case Op::kCompareSet: return "compare_set";
    case Op::kRemove: return "remove";
    case Op::kList: return "list";
    case Op::kWait: return "wait";
    case Op::kRenew: return "renew";
    case Op::kPing: return "ping";
  }
  return "unknown";
}

namespace {

bool known_op(uint8_t v) { return v >= static_cast<uint8_t>(Op::kChallenge) && v <= static_cast<uint8_t>(Op::kPing); }
bool known_code(uint8_t v) { return v <= static_cast<uint8_t>(StatusCode::kInternal); }

// --- encoding ---------------------------------------------------------------------
class Writer {
 public:
  Writer() { out_.resize(kFrameHeaderBytes); }
  void u8(uint8_t v) { out_.push_back(v); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void i64(int64_t v) {
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<uint8_t>(u >> (8 * i)));
  }
  void raw(const uint8_t* p, size_t n) { out_.insert(out_.end(), p, p + n); }
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    raw(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  Bytes finish() {
    const size_t n = out_.size() - kFrameHeaderBytes;
    for (int i = 0; i < 4; ++i) out_[i] = static_cast<uint8_t>(n >> (8 * i));
    return std::move(out_);
  }

 private:
  Bytes out_;
};

// --- decoding: every read is bounds-checked against what is left -------------------
class Reader {
 public:
  explicit Reader(ByteSpan in) : in_(in) {}
  size_t left() const { return in_.size() - pos_; }
  bool u8(uint8_t& v) {
    if (left() < 1) return false;
    v = in_[pos_++];
    return true;
  }
  bool u32(uint32_t& v) {
    if (left() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in_[pos_ + i]) << (8 * i);
    pos_ += 4;
    return true;
  }
  bool i64(int64_t& v) {
    if (left() < 8) return false;
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
    pos_ += 8;
    v = static_cast<int64_t>(u);
    return true;
  }
  bool raw(uint8_t* out, size_t n) {
    if (left() < n) return false;
    std::memcpy(out, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool str(std::string& s, size_t max) {
    uint32_t n = 0;
    if (!u32(n)) return false;
    if (n > max || n > left()) return false;
    s.assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return true;
  }

 private:
  ByteSpan in_;
  size_t pos_ = 0;
};

Status malformed(std::string_view what) {
  return corrupt("store protocol: malformed {}", what);
}

}  // namespace

Result<size_t> decode_frame_header(ByteSpan header4, size_t max_payload) {
  if (header4.size() < kFrameHeaderBytes) return malformed("frame header (truncated)");
  uint32_t n = 0;
  for (size_t i = 0; i < 4; ++i) n |= static_cast<uint32_t>(header4[i]) << (8 * i);
  if (n > max_payload) {
    return out_of_range("store protocol: frame of {} bytes exceeds the limit of {} bytes", n, max_payload);
  }
  return static_cast<size_t>(n);
}

Result<FrameSplit> split_frame(ByteSpan buffer, size_t max_payload) {
  if (buffer.size() < kFrameHeaderBytes) return FrameSplit{};
  FERRY_ASSIGN_OR_RETURN(size_t n, decode_frame_header(buffer.first(kFrameHeaderBytes), max_payload));
  if (buffer.size() - kFrameHeaderBytes < n) return FrameSplit{};
  return FrameSplit{kFrameHeaderBytes + n, buffer.subspan(kFrameHeaderBytes, n)};
}

Bytes encode_challenge(const Challenge& c) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kChallenge));
  w.u32(c.version);
  w.raw(c.nonce.data(), c.nonce.size());
  return w.finish();
}

Bytes encode_auth(const Auth& a) {
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kAuth));
  w.u32(a.version);
  w.raw(a.nonce.data(), a.nonce.size());
  w.raw(a.mac.data(), a.mac.size());
  return w.finish();
}

Result<Challenge> decode_challenge(ByteSpan payload) {
  Reader r(payload);
  uint8_t op = 0;
  Challenge c;
  if (!r.u8(op) || op != static_cast<uint8_t>(Op::kChallenge)) return malformed("challenge (op)");
  if (!r.u32(c.version) || !r.raw(c.nonce.data(), c.nonce.size()) || r.left() != 0) {
    return malformed("challenge");
  }
  if (c.version != kProtocolVersion) {
    return failed_precondition("store protocol: server speaks version {}, this client {}; run client and server "
                               "from the same ferry release",
                               c.version, kProtocolVersion);
  }
  return c;
}

Result<Auth> decode_auth(ByteSpan payload) {
  Reader r(payload);
  uint8_t op = 0;
  Auth a;
  if (!r.u8(op) || op != static_cast<uint8_t>(Op::kAuth)) return malformed("auth (op)");
  if (!r.u32(a.version)) return malformed("auth");
  // The version before the rest: another version's auth may be laid out differently.
  if (a.version != kProtocolVersion) {
    return failed_precondition("store protocol: client speaks version {}, this server {}; upgrade the client",
                               a.version, kProtocolVersion);
  }
  if (!r.raw(a.nonce.data(), a.nonce.size()) || !r.raw(a.mac.data(), a.mac.size()) || r.left() != 0) {
    return malformed("auth");
  }
  return a;
}

Status validate_request(const Request& q) {
  using namespace store_detail;
  const char* op = op_name(q.op);
  switch (q.op) {
    case Op::kSet:
      FERRY_RETURN_IF_ERROR(check_key(op, q.key));
      FERRY_RETURN_IF_ERROR(check_value(op, q.key, q.value));
      return check_ttl(op, q.key, q.ttl_ms, false);
    case Op::kGet:
    case Op::kRemove:
      return check_key(op, q.key);
    case Op::kAdd:
      return check_key(op, q.key);
    case Op::kCompareSet:
      FERRY_RETURN_IF_ERROR(check_key(op, q.key));
      FERRY_RETURN_IF_ERROR(check_value(op, q.key, q.value));
      if (q.expected) FERRY_RETURN_IF_ERROR(check_value(op, q.key, *q.expected));
      return check_ttl(op, q.key, q.ttl_ms, false);
    case Op::kList:
      if (q.key.size() > kMaxKeyBytes) return invalid_argument("store list: prefix of {} bytes is too long", q.key.size());
      return Status::Ok();
    case Op::kWait:
      for (const auto& k : q.keys) FERRY_RETURN_IF_ERROR(check_key(op, k));
      return check_wait(q.keys.size(), q.timeout_ms);
    case Op::kRenew:
      FERRY_RETURN_IF_ERROR(check_key(op, q.key));
      return check_ttl(op, q.key, q.ttl_ms, true);
    case Op::kPing:
      return Status::Ok();
    case Op::kChallenge:
    case Op::kAuth:
      break;
  }
  return invalid_argument("store protocol: op {} is not a request", static_cast<int>(q.op));
}

Bytes encode_request(const Request& q) {
  Writer w;
  w.u8(static_cast<uint8_t>(q.op));
  switch (q.op) {
    case Op::kSet:
      w.str(q.key);
      w.str(q.value);
      w.i64(q.ttl_ms);
      break;
    case Op::kGet:
    case Op::kRemove:
    case Op::kList:
      w.str(q.key);
      break;
    case Op::kAdd:
      w.str(q.key);
      w.i64(q.delta);
      break;
    case Op::kCompareSet:
      w.str(q.key);
      w.u8(q.expected ? 1 : 0);
      if (q.expected) w.str(*q.expected);
      w.str(q.value);
      w.i64(q.ttl_ms);
      break;
    case Op::kWait:
      w.u32(static_cast<uint32_t>(q.keys.size()));
      for (const auto& k : q.keys) w.str(k);
      w.i64(q.timeout_ms);
      break;
    case Op::kRenew:
      w.str(q.key);
      w.i64(q.ttl_ms);
      break;
    case Op::kPing:
    case Op::kChallenge:
    case Op::kAuth:
      break;
  }
  return w.finish();
}

Result<Request> decode_request(ByteSpan payload) {
  Reader r(payload);
  uint8_t op = 0;
  if (!r.u8(op)) return malformed("request (empty)");
  if (!known_op(op)) return malformed("request (unknown op)");
  Request q;
  q.op = static_cast<Op>(op);
  bool ok = true;
  switch (q.op) {
    case Op::kSet:
      ok = r.str(q.key, kMaxKeyBytes) && r.str(q.value, kMaxValueBytes) && r.i64(q.ttl_ms);
      break;
    case Op::kGet:
    case Op::kRemove:
    case Op::kList:
      ok = r.str(q.key, kMaxKeyBytes);
      break;
    case Op::kAdd:
      ok = r.str(q.key, kMaxKeyBytes) && r.i64(q.delta);
      break;
    case Op::kCompareSet: {
      uint8_t has = 0;
      ok = r.str(q.key, kMaxKeyBytes) && r.u8(has) && has <= 1;
      if (ok && has) {
        q.expected.emplace();
        ok = r.str(*q.expected, kMaxValueBytes);
      }
      ok = ok && r.str(q.value, kMaxValueBytes) && r.i64(q.ttl_ms);
      break;
    }
    case Op::kWait: {
      uint32_t n = 0;
      // Each key takes at least 4 bytes on the wire: bounds the reserve below.
      ok = r.u32(n) && n <= kMaxWaitKeys && n <= r.left() / 4;
      if (ok) {
        q.keys.reserve(n);
        for (uint32_t i = 0; ok && i < n; ++i) ok = r.str(q.keys.emplace_back(), kMaxKeyBytes);
      }
      ok = ok && r.i64(q.timeout_ms);
      break;
    }
    case Op::kRenew:
      ok = r.str(q.key, kMaxKeyBytes) && r.i64(q.ttl_ms);
      break;
    case Op::kPing:
      break;
    case Op::kChallenge:
    case Op::kAuth:
      return malformed("request (handshake op after the handshake)");
  }
  if (!ok) return malformed(fmt::format("{} request", op_name(q.op)));
  if (r.left() != 0) return malformed(fmt::format("{} request (trailing bytes)", op_name(q.op)));
  return q;
}

Bytes encode_response(const Response& p) {
  Writer w;
  w.u8(static_cast<uint8_t>(p.op));
  w.u8(static_cast<uint8_t>(p.code));
  w.str(p.message);
  if (p.code != StatusCode::kOk) return w.finish();
  switch (p.op) {
    case Op::kAuth:
      w.i64(p.number);
      break;
    case Op::kGet:
      w.str(p.value.value_or(std::string()));
      break;
    case Op::kAdd:
      w.i64(p.number);
      break;
    case Op::kCompareSet:
      w.u8(p.number ? 1 : 0);
      w.u8(p.value ? 1 : 0);
      if (p.value) w.str(*p.value);
      break;
    case Op::kRemove:
      w.u8(p.number ? 1 : 0);
      break;
    case Op::kList:
      w.u32(static_cast<uint32_t>(p.keys.size()));
      for (const auto& k : p.keys) w.str(k);
      break;
    default:
      break;
  }
  return w.finish();
}

Result<Response> decode_response(ByteSpan payload) {
  Reader r(payload);
  uint8_t op = 0, code = 0;
  if (!r.u8(op) || !known_op(op)) return malformed("response (op)");
  if (!r.u8(code) || !known_code(code)) return malformed("response (status code)");
  Response p;
  p.op = static_cast<Op>(op);
  p.code = static_cast<StatusCode>(code);
  if (!r.str(p.message, 64 * 1024)) return malformed("response (message)");
  bool ok = true;
  if (p.code == StatusCode::kOk) {
    switch (p.op) {
      case Op::kAuth:
        ok = r.i64(p.number);
        break;
      case Op::kGet:
        ok = r.str(p.value.emplace(), kMaxValueBytes);
        break;
      case Op::kAdd:
        ok = r.i64(p.number);
        break;
      case Op::kCompareSet: {
        uint8_t swapped = 0, has = 0;
        ok = r.u8(swapped) && swapped <= 1 && r.u8(has) && has <= 1;
        p.number = swapped;
        if (ok && has) ok = r.str(p.value.emplace(), kMaxValueBytes);
        break;
      }
      case Op::kRemove: {
        uint8_t existed = 0;
        ok = r.u8(existed) && existed <= 1;
        p.number = existed;
        break;
      }
      case Op::kList: {
        uint32_t n = 0;
        ok = r.u32(n) && n <= r.left() / 4;
        if (ok) {
          p.keys.reserve(n);
          for (uint32_t i = 0; ok && i < n; ++i) ok = r.str(p.keys.emplace_back(), kMaxKeyBytes);
        }
        break;
      }
      case Op::kChallenge:
        ok = false;  // a challenge is not a response
        break;
      default:
        break;
    }
  }
  if (!ok) return malformed(fmt::format("{} response", op_name(p.op)));
  if (r.left() != 0) return malformed(fmt::format("{} response (trailing bytes)", op_name(p.op)));
  return p;
}

namespace {

using crypto::hmac_sha256;

ByteSpan bytes_of(std::string_view s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

}  // namespace

Mac client_proof(std::string_view token, const Nonce& server_nonce, const Nonce& client_nonce) {
  return hmac_sha256(bytes_of(token), {bytes_of(kClientProofLabel), server_nonce, client_nonce});
}

SessionKey session_key(std::string_view token, const Nonce& server_nonce, const Nonce& client_nonce) {
  return hmac_sha256(bytes_of(token), {bytes_of(kSessionKeyLabel), server_nonce, client_nonce});
}

bool macs_equal(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

Channel::Channel(const SessionKey& key, Direction sends) : key_(key), sends_(sends) {}

Mac Channel::tag(Direction dir, uint64_t seq, ByteSpan body) const {
  std::array<uint8_t, 9> head{};
  head[0] = static_cast<uint8_t>(dir);
  for (int i = 0; i < 8; ++i) head[1 + i] = static_cast<uint8_t>(seq >> (8 * i));
  return hmac_sha256(key_, {head, body});
}

Bytes Channel::seal(Bytes frame) {
  const ByteSpan body = ByteSpan(frame).subspan(kFrameHeaderBytes);
  const Mac t = tag(sends_, send_seq_++, body);
  frame.insert(frame.end(), t.begin(), t.end());
  const size_t n = frame.size() - kFrameHeaderBytes;
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<uint8_t>(n >> (8 * i));
  return frame;
}

Result<ByteSpan> Channel::open(ByteSpan payload) {
  const Direction from =
      sends_ == Direction::kClientToServer ? Direction::kServerToClient : Direction::kClientToServer;
  if (payload.size() < kMacBytes) {
    return permission_denied("store protocol: frame {} of {} bytes is too short to carry its integrity tag",
                             recv_seq_, payload.size());
  }
  const ByteSpan body = payload.first(payload.size() - kMacBytes);
  Mac got{};
  std::memcpy(got.data(), payload.data() + body.size(), kMacBytes);
  if (!macs_equal(got, tag(from, recv_seq_, body))) {
    return permission_denied(
        "store protocol: frame {} failed its integrity check (tampered, replayed, reordered or not from the "
        "peer that holds the token)",
        recv_seq_);
  }
  ++recv_seq_;
  return body;
}

Status random_bytes(std::span<uint8_t> out) {
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return internal_error("store: RAND_bytes failed");
  }
  return Status::Ok();
}

}  // namespace ferry::store_tcp
