// The TCP store's frame codec: round trips, and every truncation of every valid frame
// is rejected cleanly.
#include <gtest/gtest.h>

#include <random>

#include "store/tcp/protocol.h"

namespace ferry::store_tcp {
namespace {

std::vector<Request> sample_requests() {
  std::vector<Request> out;
  Request q;
  q.op = Op::kSet;
  q.key = "k";
  q.value = std::string("v\0v", 3);
  q.ttl_ms = 250;
  out.push_back(q);
  q = Request{};
  q.op = Op::kGet;
  q.key = "key";
  out.push_back(q);
  q = Request{};
  q.op = Op::kAdd;
  q.key = "c";
  q.delta = -42;
  out.push_back(q);
  q = Request{};
  q.op = Op::kCompareSet;
  q.key = "cas";
  q.expected = "old";
  q.value = "new";
  q.ttl_ms = 0;
  out.push_back(q);
  q.expected.reset();
  out.push_back(q);
  q = Request{};
  q.op = Op::kRemove;
  q.key = "r";
  out.push_back(q);
  q = Request{};
  q.op = Op::kList;
  q.key = "";
  out.push_back(q);
  q = Request{};
  q.op = Op::kWait;
  q.keys = {"a", "bb", "ccc"};
  q.timeout_ms = 1000;
  out.push_back(q);
  q = Request{};
  q.op = Op::kRenew;
  q.key = "lease";
  q.ttl_ms = 100;
  out.push_back(q);
  q = Request{};
  q.op = Op::kPing;
  out.push_back(q);
  return out;
}

std::vector<Response> sample_responses() {
  std::vector<Response> out;
  Response p;
  p.op = Op::kGet;
  p.value = "value";
  out.push_back(p);
  p = Response{};
  p.op = Op::kAdd;
  p.number = INT64_MIN;
  out.push_back(p);
  p = Response{};
  p.op = Op::kCompareSet;
  p.number = 1;
  p.value = "x";
  out.push_back(p);
  p.number = 0;
  p.value.reset();
  out.push_back(p);
  p = Response{};
  p.op = Op::kRemove;
  p.number = 1;
  out.push_back(p);
  p = Response{};
  p.op = Op::kList;
  p.keys = {"a", "b"};
  out.push_back(p);
  p = Response{};
  p.op = Op::kWait;
  p.code = StatusCode::kTimeout;
  p.message = "store wait: 1 of 1 keys still missing";
  out.push_back(p);
  p = Response{};
  p.op = Op::kSet;
  out.push_back(p);
  return out;
}

ByteSpan payload_of(const Bytes& frame) { return ByteSpan(frame).subspan(kFrameHeaderBytes); }

TEST(StoreProtocolTest, RequestsRoundTrip) {
  for (const Request& q : sample_requests()) {
    Bytes frame = encode_request(q);
    auto split = split_frame(frame, kMaxFrameBytes);
    ASSERT_TRUE(split.ok());
    EXPECT_EQ(split->consumed, frame.size());
    auto back = decode_request(split->payload);
    ASSERT_TRUE(back.ok()) << op_name(q.op) << ": " << back.status().to_string();
    EXPECT_EQ(*back, q) << op_name(q.op);
    EXPECT_TRUE(validate_request(q).ok()) << op_name(q.op);
  }
}

TEST(StoreProtocolTest, ResponsesRoundTrip) {
  for (const Response& p : sample_responses()) {
    Bytes frame = encode_response(p);
    auto back = decode_response(payload_of(frame));
    ASSERT_TRUE(back.ok()) << op_name(p.op) << ": " << back.status().to_string();
    EXPECT_EQ(*back, p) << op_name(p.op);
  }
}

TEST(StoreProtocolTest, HandshakeRoundTripAndProofs) {
  Challenge c;
  for (size_t i = 0; i < c.nonce.size(); ++i) c.nonce[i] = static_cast<uint8_t>(i);
  auto back = decode_challenge(payload_of(encode_challenge(c)));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->nonce, c.nonce);
  Auth a;
  a.nonce.fill(9);
  a.mac = client_proof("token", c.nonce, a.nonce);
  auto aback = decode_auth(payload_of(encode_auth(a)));
  ASSERT_TRUE(aback.ok());
  EXPECT_EQ(aback->nonce, a.nonce);
  EXPECT_TRUE(macs_equal(aback->mac, client_proof("token", c.nonce, a.nonce)));
  EXPECT_FALSE(macs_equal(aback->mac, client_proof("token2", c.nonce, a.nonce)));
  auto other = c.nonce;
  other[0] ^= 1;
  EXPECT_FALSE(macs_equal(aback->mac, client_proof("token", other, a.nonce)));
  EXPECT_FALSE(macs_equal(aback->mac, client_proof("token", c.nonce, other)));
  // The session key depends on the token and on both nonces, and is not the proof.
  const SessionKey k = session_key("token", c.nonce, a.nonce);
  EXPECT_NE(k, session_key("token2", c.nonce, a.nonce));
  EXPECT_NE(k, session_key("token", other, a.nonce));
  EXPECT_NE(k, session_key("token", c.nonce, other));
  EXPECT_NE(Mac(k), client_proof("token", c.nonce, a.nonce));
}

TEST(StoreProtocolTest, OtherVersionsAreNamed) {
  Challenge c;
  c.version = 1;
  auto ch = decode_challenge(payload_of(encode_challenge(c)));
  ASSERT_FALSE(ch.ok());
  EXPECT_EQ(ch.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(ch.status().message().find("server speaks version 1"), std::string::npos) << ch.status().message();
  // A version-1 auth (op, version, 32-byte mac) is named by its version, not "malformed".
  Bytes v1 = {static_cast<uint8_t>(Op::kAuth), 1, 0, 0, 0};
  v1.resize(v1.size() + 32, 0xab);
  auto a = decode_auth(v1);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(a.status().message().find("client speaks version 1"), std::string::npos) << a.status().message();
}

Bytes sealed_request(Channel& ch, const std::string& key) {
  Request q;
  q.op = Op::kGet;
  q.key = key;
  return ch.seal(encode_request(q));
}

TEST(StoreProtocolTest, ChannelRefusesTamperedReplayedReorderedAndReflectedFrames) {
  SessionKey key{};
  key.fill(42);
  Channel client(key, Direction::kClientToServer), server(key, Direction::kServerToClient);
  const Bytes f0 = sealed_request(client, "a"), f1 = sealed_request(client, "b"), f2 = sealed_request(client, "c");
  // The header counts the tag.
  auto split = split_frame(f0, kMaxFrameBytes);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->consumed, f0.size());
  // Reordered: frame 1 before frame 0.
  EXPECT_EQ(server.open(payload_of(f1)).status().code(), StatusCode::kPermissionDenied);
  auto b0 = server.open(payload_of(f0));
  ASSERT_TRUE(b0.ok()) << b0.status().to_string();
  auto q0 = decode_request(*b0);
  ASSERT_TRUE(q0.ok());
  EXPECT_EQ(q0->key, "a");
  // Replayed.
  EXPECT_EQ(server.open(payload_of(f0)).status().code(), StatusCode::kPermissionDenied);
  // Tampered: any one bit of body or tag.
  for (size_t i = kFrameHeaderBytes; i < f1.size(); ++i) {
    Bytes bad = f1;
    bad[i] ^= 0x10;
    EXPECT_FALSE(server.open(payload_of(bad)).ok()) << "byte " << i;
  }
  ASSERT_TRUE(server.open(payload_of(f1)).ok());
  // Too short to hold a tag.
  EXPECT_FALSE(server.open(ByteSpan(f2).subspan(kFrameHeaderBytes, 10)).ok());
  // Reflected: a client frame sent back to the client.
  Channel client2(key, Direction::kClientToServer);
  EXPECT_FALSE(client2.open(payload_of(sealed_request(client2, "x"))).ok());
  // Another session key.
  SessionKey other = key;
  other[0] ^= 1;
  Channel stranger(other, Direction::kServerToClient);
  EXPECT_FALSE(stranger.open(payload_of(f0)).ok());
  EXPECT_TRUE(server.open(payload_of(f2)).ok());
  EXPECT_EQ(server.received(), 3u);
  EXPECT_EQ(client.sent(), 3u);
}

TEST(StoreProtocolTest, EveryTruncationIsRejected) {
  for (const Request& q : sample_requests()) {
    Bytes frame = encode_request(q);
    ByteSpan payload = payload_of(frame);
    for (size_t n = 0; n < payload.size(); ++n) {
      auto r = decode_request(payload.first(n));
      EXPECT_FALSE(r.ok()) << op_name(q.op) << " truncated to " << n;
    }
    // And a trailing byte.
    Bytes longer(payload.begin(), payload.end());
    longer.push_back(0);
    EXPECT_FALSE(decode_request(longer).ok()) << op_name(q.op);
    // The frame splitter waits for the rest.
    for (size_t n = 0; n < frame.size(); ++n) {
      auto s = split_frame(ByteSpan(frame).first(n), kMaxFrameBytes);
      ASSERT_TRUE(s.ok());
      EXPECT_EQ(s->consumed, 0u);
    }
  }
  for (const Response& p : sample_responses()) {
    Bytes frame = encode_response(p);
    ByteSpan payload = payload_of(frame);
    for (size_t n = 0; n < payload.size(); ++n) {
      EXPECT_FALSE(decode_response(payload.first(n)).ok()) << op_name(p.op) << " truncated to " << n;
    }
  }
}

TEST(StoreProtocolTest, OversizeAndHostileLengths) {
  // Frame header over the limit.
  Bytes header = {0xff, 0xff, 0xff, 0xff};
  auto h = decode_frame_header(header, kMaxFrameBytes);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(split_frame(header, kMaxHandshakeFrameBytes).ok());
  // A string length that claims more than is left.
  Bytes get = {static_cast<uint8_t>(Op::kGet), 0xff, 0xff, 0xff, 0x7f, 'a'};
  EXPECT_FALSE(decode_request(get).ok());
  // A wait with 2^32-1 keys in a tiny payload must not reserve anything huge.
  Bytes wait = {static_cast<uint8_t>(Op::kWait), 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
  EXPECT_FALSE(decode_request(wait).ok());
  // A list answer claiming 2^32-1 keys.
  Bytes list = {static_cast<uint8_t>(Op::kList), 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff};
  EXPECT_FALSE(decode_response(list).ok());
  // Unknown op and unknown status code.
  EXPECT_FALSE(decode_request(Bytes{0}).ok());
  EXPECT_FALSE(decode_request(Bytes{200}).ok());
  EXPECT_FALSE(decode_response(Bytes{static_cast<uint8_t>(Op::kSet), 99, 0, 0, 0, 0}).ok());
  // Handshake ops are not requests.
  EXPECT_FALSE(decode_request(payload_of(encode_auth(Auth{}))).ok());
  // A bool that is neither 0 nor 1.
  Request q;
  q.op = Op::kCompareSet;
  q.key = "k";
  Bytes cas = encode_request(q);
  cas[kFrameHeaderBytes + 1 + 4 + 1] = 7;
  EXPECT_FALSE(decode_request(payload_of(cas)).ok());
}

// Every outcome of every decoder on random bytes is one it documents: a message that
// encodes back to exactly the input (the encoding is canonical and trailing bytes are
// refused), Corrupt, or (handshake only) FailedPrecondition for another version;
// split_frame gives a frame that is a prefix of the input, "need more", or OutOfRange.
TEST(StoreProtocolTest, RandomBytesNeverCrash) {
  auto same_payload = [](const Bytes& frame, const Bytes& input) {
    return Bytes(frame.begin() + static_cast<std::ptrdiff_t>(kFrameHeaderBytes), frame.end()) == input;
  };
  auto is_error = [](const Status& s, bool handshake) {
    return s.code() == StatusCode::kCorrupt || (handshake && s.code() == StatusCode::kFailedPrecondition);
  };
  std::mt19937 rng(1234);
  int requests = 0, frames = 0, need_more = 0, too_long = 0;
  for (int i = 0; i < 20000; ++i) {
    Bytes b(rng() % 64);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (!b.empty() && (i % 2)) b[0] = static_cast<uint8_t>(1 + rng() % 11);  // a valid op
    if (i % 4 == 0 && b.size() >= kFrameHeaderBytes) {                          // a frame length that fits
      const uint32_t n = static_cast<uint32_t>(rng() % (b.size() - kFrameHeaderBytes + 1));
      for (size_t k = 0; k < kFrameHeaderBytes; ++k) b[k] = static_cast<uint8_t>(n >> (8 * k));
    }
    SCOPED_TRACE(testing::Message() << "input " << i << " of " << b.size() << " bytes");

    auto q = decode_request(b);
    if (q.ok()) {
      ++requests;
      EXPECT_TRUE(same_payload(encode_request(*q), b));
    } else {
      EXPECT_TRUE(is_error(q.status(), false)) << q.status().to_string();
    }
    auto p = decode_response(b);
    if (p.ok()) {
      EXPECT_TRUE(same_payload(encode_response(*p), b));
    } else {
      EXPECT_TRUE(is_error(p.status(), false)) << p.status().to_string();
    }
    auto c = decode_challenge(b);
    if (c.ok()) {
      EXPECT_TRUE(same_payload(encode_challenge(*c), b));
    } else {
      EXPECT_TRUE(is_error(c.status(), true)) << c.status().to_string();
    }
    auto a = decode_auth(b);
    if (a.ok()) {
      EXPECT_TRUE(same_payload(encode_auth(*a), b));
    } else {
      EXPECT_TRUE(is_error(a.status(), true)) << a.status().to_string();
    }

    auto s = split_frame(b, kMaxHandshakeFrameBytes);
    if (!s.ok()) {
      ++too_long;
      EXPECT_EQ(s.status().code(), StatusCode::kOutOfRange) << s.status().to_string();
    } else if (s->consumed == 0) {
      ++need_more;
      EXPECT_TRUE(s->payload.empty());
    } else {
      ++frames;
      ASSERT_EQ(s->consumed, kFrameHeaderBytes + s->payload.size());
      ASSERT_LE(s->consumed, b.size());
      EXPECT_EQ(s->payload.data(), b.data() + kFrameHeaderBytes);  // a view of the input
      EXPECT_EQ(*decode_frame_header(b, kMaxHandshakeFrameBytes), s->payload.size());
    }
  }
  // Each outcome was reached, so the checks above ran on something.
  EXPECT_GT(requests, 0);
  EXPECT_GT(need_more, 0);
  EXPECT_GT(too_long, 0);
  EXPECT_GT(frames, 0);
}

TEST(StoreProtocolTest, ValidateRejectsBadArguments) {
  Request q;
  q.op = Op::kSet;
  q.key = "";
  EXPECT_EQ(validate_request(q).code(), StatusCode::kInvalidArgument);
  q.key = "k";
  q.ttl_ms = -1;
  EXPECT_EQ(validate_request(q).code(), StatusCode::kInvalidArgument);
  q.op = Op::kRenew;
  q.ttl_ms = 0;
  EXPECT_EQ(validate_request(q).code(), StatusCode::kInvalidArgument);
  q.op = Op::kWait;
  q.keys = {"a"};
  q.timeout_ms = -1;
  EXPECT_EQ(validate_request(q).code(), StatusCode::kInvalidArgument);
  q.op = Op::kAuth;
  EXPECT_EQ(validate_request(q).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::store_tcp
