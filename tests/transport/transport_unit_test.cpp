// Backend-independent pieces: the wire formats (never trust bytes from outside), the
// factory, Completion, and inproc-only target-side checks.
#include <gtest/gtest.h>

#include <random>

#include "ferry/transport.h"
#include "transport/wire.h"

namespace ferry {
namespace {

namespace wire = ferry::transport_wire;
using namespace std::chrono_literals;

TEST(TransportWire, AddressRoundTripAndRejects) {
  wire::Address a{wire::Backend::kUcx, 0x1234, 77, 99, {std::byte{1}, std::byte{2}, std::byte{3}}};
  auto bytes = wire::encode_address(a);
  auto d = wire::decode_address(bytes, wire::Backend::kUcx);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->instance_id, 0x1234u);
  EXPECT_EQ(d->payload, a.payload);
  EXPECT_EQ(d->pid, 77u);
  EXPECT_EQ(d->host_tag, 99u);
  // Wrong backend: a clear InvalidArgument.
  EXPECT_EQ(wire::decode_address(bytes, wire::Backend::kInproc).status().code(), StatusCode::kInvalidArgument);
  // Every truncation and every extension is refused.
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_EQ(wire::decode_address(std::span(bytes).first(n), wire::Backend::kUcx).status().code(),
              StatusCode::kCorrupt) << n;
  }
  auto longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_EQ(wire::decode_address(longer, wire::Backend::kUcx).status().code(), StatusCode::kCorrupt);
  // A payload length field claiming more than is there, or a huge one.
  auto lie = bytes;
  lie[28] = std::byte{0xff};
  lie[29] = std::byte{0xff};
  lie[30] = std::byte{0xff};
  lie[31] = std::byte{0xff};
  EXPECT_EQ(wire::decode_address(lie, wire::Backend::kUcx).status().code(), StatusCode::kCorrupt);
}

TEST(TransportWire, KeyRoundTripAndRejects) {
  wire::Key k{wire::Backend::kInproc, MemoryKind::kHost, 7, 9, 0x1000, 4096, {}};
  auto bytes = wire::encode_key(k);
  auto d = wire::decode_key(bytes, wire::Backend::kInproc);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->owner_id, 7u);
  EXPECT_EQ(d->region_id, 9u);
  EXPECT_EQ(d->base, 0x1000u);
  EXPECT_EQ(d->length, 4096u);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(wire::decode_key(std::span(bytes).first(n), wire::Backend::kInproc).ok()) << n;
  }
  // base + length wrapping, zero length, unknown memory kind.
  wire::Key wrap = k;
  wrap.base = ~0ull - 10;
  EXPECT_EQ(wire::decode_key(wire::encode_key(wrap), wire::Backend::kInproc).status().code(), StatusCode::kCorrupt);
  wire::Key zero = k;
  zero.length = 0;
  EXPECT_EQ(wire::decode_key(wire::encode_key(zero), wire::Backend::kInproc).status().code(), StatusCode::kCorrupt);
  auto kind = bytes;
  kind[6] = std::byte{9};
  EXPECT_EQ(wire::decode_key(kind, wire::Backend::kInproc).status().code(), StatusCode::kCorrupt);
}

TEST(TransportWire, MessageHeaderRejects) {
  std::byte h[wire::kMessageHeaderSize];
  wire::encode_message_header({42, 7, 100}, h);
  std::span<const std::byte> hs(h, sizeof h);
  auto d = wire::decode_message_header(hs, 100, 1000);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->sender_id, 42u);
  EXPECT_EQ(d->tag, 7u);
  EXPECT_FALSE(wire::decode_message_header(hs, 99, 1000).ok());   // length disagrees
  EXPECT_FALSE(wire::decode_message_header(hs, 100, 50).ok());    // over the limit
  EXPECT_FALSE(wire::decode_message_header(hs.first(23), 100, 1000).ok());
  std::byte bad[wire::kMessageHeaderSize];
  std::memcpy(bad, h, sizeof h);
  bad[0] = std::byte{0};
  EXPECT_FALSE(wire::decode_message_header(std::span<const std::byte>(bad, sizeof bad), 100, 1000).ok());
}

// Random mutations of valid frames: never a crash; anything accepted is self-consistent.
TEST(TransportWire, MutatedFramesNeverCrash) {
  std::mt19937_64 rng(1);
  auto key = wire::encode_key({wire::Backend::kUcx, MemoryKind::kHost, 1, 2, 4096, 65536,
                               std::vector<std::byte>(40, std::byte{7})});
  auto addr = wire::encode_address({wire::Backend::kUcx, 5, 1, 2, std::vector<std::byte>(100, std::byte{1})});
  for (int i = 0; i < 20000; ++i) {
    auto k = (i & 1) ? key : addr;
    int flips = 1 + int(rng() % 4);
    for (int f = 0; f < flips; ++f) k[rng() % k.size()] = std::byte(uint8_t(rng()));
    if (rng() % 4 == 0) k.resize(rng() % (k.size() + 8));
    if (i & 1) {
      auto d = wire::decode_key(k, wire::Backend::kUcx);
      if (d.ok()) {
        EXPECT_GT(d->length, 0u);
        EXPECT_LE(d->base, ~0ull - d->length);
        EXPECT_EQ(k.size(), 44 + d->payload.size());
      }
    } else {
      auto d = wire::decode_address(k, wire::Backend::kUcx);
      if (d.ok()) {
        EXPECT_EQ(k.size(), 32 + d->payload.size());
      }
    }
  }
}

TEST(TransportFactory, UnknownBackendAndEmptyCompletion) {
  TransportOptions o;
  o.backend = "carrier-pigeon";
  EXPECT_EQ(Transport::create(o).status().code(), StatusCode::kNotFound);
  Completion c;
  EXPECT_FALSE(c.valid());
  EXPECT_FALSE(c.done());
  EXPECT_EQ(c.wait(1ms).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Transport::backends(), (std::vector<std::string>{"inproc", "ucx"}));
}

TEST(TransportInproc, TargetSideChecksAndCrashedSelf) {
  TransportOptions o;
  o.backend = "inproc";
  auto a = Transport::create(o);
  auto b = Transport::create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<std::byte> ma(4096), mb(4096);
  auto ra = (*a)->register_memory(ma.data(), ma.size());
  auto rb = (*b)->register_memory(mb.data(), mb.size());
  ASSERT_TRUE(ra.ok() && rb.ok());
  auto peer = (*a)->connect((*b)->address());
  ASSERT_TRUE(peer.ok());
  EXPECT_EQ(*peer, (*b)->id());
  auto key = (*b)->export_key(*rb);
  ASSERT_TRUE(key.ok());
  // A key for another backend is refused with a clear message.
  EXPECT_EQ((*a)->import_key(std::vector<std::byte>(key->size())).status().code(), StatusCode::kCorrupt);
  auto remote = (*a)->import_key(*key);
  ASSERT_TRUE(remote.ok());
  // The target deregisters: the initiator's later read fails on the target side.
  ASSERT_TRUE((*b)->deregister_memory(*rb).ok());
  auto r = (*a)->read(*ra, 0, *remote, 0, 16);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->wait(5s).code(), StatusCode::kNotFound);
  // The target re-registers a smaller region under a new id: the old key still fails.
  auto rb2 = (*b)->register_memory(mb.data(), 16);
  ASSERT_TRUE(rb2.ok());
  auto r2 = (*a)->read(*ra, 0, *remote, 0, 16);
  ASSERT_TRUE(r2.ok());
  EXPECT_FALSE(r2->wait(5s).ok());
  // Unsupported memory kind.
  EXPECT_EQ((*a)->register_memory(ma.data(), 16, MemoryKind::kCuda).status().code(), StatusCode::kUnimplemented);
  // Waiting from the progress thread does not deadlock.
  std::atomic<int> code{-1};
  auto s = (*a)->send(*peer, 1, {}, [&](const Status&) {
    auto inner = (*a)->flush(*peer);
    code = inner.ok() ? int(inner->wait(5s).code()) : -2;
  });
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(s->wait(5s).ok());
  EXPECT_EQ(code.load(), int(StatusCode::kFailedPrecondition));
  // A crashed transport refuses its own calls.
  ASSERT_TRUE((*b)->simulate_crash().ok());
  EXPECT_EQ((*b)->register_memory(mb.data(), 16).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*a)->read(*ra, 0, *remote, 0, 1).status().code(), StatusCode::kPeerFailed);
}

}  // namespace
}  // namespace ferry
