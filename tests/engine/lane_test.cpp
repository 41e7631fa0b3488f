// The consumer's transport lane (engine/lane.h) over the in-process transport: staged
// bytes into the receive slot, in-place bytes from a source region straight into a
// param's landing (which touches the param set), chunked posts, and what it refuses
// (a producer not connected, a source region not imported); viable / why_not follow
// connect and disconnect, and rma_path says how its reads travel.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "engine/lane.h"
#include "engine/param_set.h"
#include "engine/schedule.h"
#include "ferry/transport.h"

namespace ferry::engine {
namespace {

std::unique_ptr<Transport> inproc() {
  TransportOptions o;
  o.backend = "inproc";
  auto t = Transport::create(o);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return std::move(*t);
}

TEST(TransportLane, ReadsStagedBytesIntoTheSlotAndInPlaceBytesIntoParams) {
  auto producer = inproc(), consumer = inproc();
  // The producer's staging ring and one source region, filled with patterns.
  auto staging = producer->allocate_memory(4096);
  auto source = producer->allocate_memory(8192);
  ASSERT_TRUE(staging.ok() && source.ok());
  auto* st = static_cast<uint8_t*>(staging->base);
  auto* src = static_cast<uint8_t*>(source->base);
  for (int i = 0; i < 4096; ++i) st[i] = static_cast<uint8_t>(i * 7);
  for (int i = 0; i < 8192; ++i) src[i] = static_cast<uint8_t>(i * 13 + 1);
  auto peer = consumer->connect(producer->address());
  ASSERT_TRUE(peer.ok());
  auto sk = producer->export_key(*staging);
  auto rk = producer->export_key(*source);
  ASSERT_TRUE(sk.ok() && rk.ok());
  auto rstaging = consumer->import_key(*sk);
  auto rsource = consumer->import_key(*rk);
  ASSERT_TRUE(rstaging.ok() && rsource.ok());

  // The consumer: a receive ring and a param set whose one param is placed for direct landing.
  auto ring = consumer->allocate_memory(2048);
  ASSERT_TRUE(ring.ok());
  auto set = ParamSet::create(ParamSetOptions{0, false, 0}, {TensorDecl{"w", DType::kU8, {3000}}}, {},
                              transport_param_memory(*consumer));
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  ASSERT_EQ((*set)->placements().count("w"), 1u);
  const ParamTable::Param* w = &(*set)->placements().at("w");

  TransportLane lane(7, *consumer, *ring, **set);
  EXPECT_EQ(lane.kind(), LaneKind::kTransport);
  EXPECT_FALSE(lane.viable(2));
  EXPECT_NE(lane.why_not(2).find("producer 2"), std::string::npos);
  EXPECT_EQ(lane.rma_path(2).status().code(), StatusCode::kNotFound);
  lane.connect(2, *rstaging, {*rsource});
  EXPECT_TRUE(lane.viable(2));
  EXPECT_EQ(lane.why_not(2), "");
  ASSERT_TRUE(lane.rma_path(2).ok());
  EXPECT_EQ(*lane.rma_path(2), RmaPath::kNative);  // inproc: memcpy

  // Staged: 1000 bytes at staging offset 100 of the slot announced at 1024, into slot 512 + 64.
  SubRead staged;
  staged.recv_offset = 64;
  staged.length = 1000;
  staged.remote = 100;
  staged.producer = 2;
  // In place: 3000 bytes of the source region at 500, into the param at 0, in two chunks.
  SubRead direct;
  direct.length = 3000;
  direct.param = w;
  direct.region = 0;
  direct.remote = 500;
  direct.producer = 2;
  (*set)->begin(1);
  EXPECT_FALSE((*set)->torn());
  std::vector<Completion> ops;
  ASSERT_TRUE(lane.post(Transfer{LaneKind::kTransport, 3, 2, &staged}, 0, 1000, 1024, 512, ops).ok());
  ASSERT_TRUE(lane.post(Transfer{LaneKind::kTransport, 3, 2, &direct}, 0, 1024, 0, 0, ops).ok());
  ASSERT_TRUE(lane.post(Transfer{LaneKind::kTransport, 3, 2, &direct}, 1024, 1976, 0, 0, ops).ok());
  ASSERT_TRUE(wait_all(ops, std::chrono::milliseconds(5000)).ok());
  EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(ring->base) + 512 + 64, st + 1024 + 100, 1000), 0);
  EXPECT_EQ(std::memcmp((*set)->landing(direct).data, src + 500, 3000), 0);
  (*set)->abort();
  EXPECT_TRUE((*set)->torn()) << "a read into params must touch the param set";

  // Refused: a source region the producer has not got; a producer not connected.
  SubRead bad = direct;
  bad.region = 1;
  Status s = lane.post(Transfer{LaneKind::kTransport, 3, 2, &bad}, 0, 10, 0, 0, ops);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s.to_string();
  lane.disconnect(2);
  EXPECT_FALSE(lane.viable(2));
  s = lane.post(Transfer{LaneKind::kTransport, 3, 2, &staged}, 0, 10, 0, 0, ops);
  EXPECT_EQ(s.code(), StatusCode::kPeerFailed) << s.to_string();
  EXPECT_NE(s.message().find("consumer 7"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("group 3"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("producer 2"), std::string::npos) << s.to_string();
}

std::unique_ptr<Transport> ucx_over_tcp() {
  TransportOptions o;
  o.backend = "ucx";
  o.params = {{"tls", "tcp,self"}, {"net_devices", "lo"}};
  auto t = Transport::create(o);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return std::move(*t);
}

// The relay lane: a member copies whole groups from the slot its relay offers into its
// own slot; it is viable for the connected relay only; a key it cannot import or a ring
// reached only by messages is refused (nothing connected); after disconnect a post
// fails naming the consumer and the group.
TEST(RelayLane, CopiesFromTheRelaysOfferedSlotAndIsViableForItAlone) {
  auto relay = inproc(), member = inproc();
  auto relay_ring = relay->allocate_memory(4096);
  auto member_ring = member->allocate_memory(4096);
  ASSERT_TRUE(relay_ring.ok() && member_ring.ok());
  auto* from = static_cast<uint8_t*>(relay_ring->base);
  for (int i = 0; i < 4096; ++i) from[i] = static_cast<uint8_t>(i * 5 + 3);
  std::memset(member_ring->base, 0, 4096);
  auto key = relay->export_key(*relay_ring);
  ASSERT_TRUE(key.ok());
  ASSERT_TRUE(member->connect(relay->address()).ok());
  RelayLane lane(4, *member, *member_ring);
  EXPECT_EQ(lane.kind(), LaneKind::kRelay);
  EXPECT_FALSE(lane.viable(0));
  EXPECT_EQ(lane.why_not(0), "no relay connected");
  Status bad = lane.connect(0, "not a key");
  EXPECT_EQ(bad.code(), StatusCode::kUnavailable) << bad.to_string();
  EXPECT_NE(bad.message().find("relay consumer 0's receive ring not imported"), std::string::npos) << bad.to_string();
  EXPECT_EQ(lane.relay(), -1);
  ASSERT_TRUE(lane.connect(0, std::string(reinterpret_cast<const char*>(key->data()), key->size())).ok());
  EXPECT_EQ(lane.relay(), 0);
  EXPECT_TRUE(lane.viable(0));
  EXPECT_FALSE(lane.viable(1));
  EXPECT_NE(lane.why_not(1).find("consumer 1 is not the relay (0 is)"), std::string::npos) << lane.why_not(1);
  // Group 2's 1000 bytes lie in the relay's slot at 2048 (its offer) and land in ours at 1024.
  const SubRead whole{0, 0, 1000, nullptr, 0, -1, 0, 0};
  std::vector<Completion> ops;
  ASSERT_TRUE(lane.post(Transfer{LaneKind::kRelay, 2, -1, &whole}, 0, 1000, 2048, 1024, ops).ok());
  ASSERT_TRUE(wait_all(ops, std::chrono::milliseconds(5000)).ok());
  auto* to = static_cast<uint8_t*>(member_ring->base);
  EXPECT_EQ(std::memcmp(to + 1024, from + 2048, 1000), 0);
  EXPECT_EQ(to[1023], 0);
  EXPECT_EQ(to[2024], 0);
  lane.disconnect();
  EXPECT_FALSE(lane.viable(0));
  Status s = lane.post(Transfer{LaneKind::kRelay, 2, -1, &whole}, 0, 1000, 2048, 1024, ops);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("consumer 4 copying group 2"), std::string::npos) << s.to_string();

  // A ring the transport reaches only by messages (UCX over TCP) is not taken.
  auto tcp_relay = ucx_over_tcp(), tcp_member = ucx_over_tcp();
  auto tcp_ring = tcp_relay->allocate_memory(4096), tcp_member_ring = tcp_member->allocate_memory(4096);
  ASSERT_TRUE(tcp_ring.ok() && tcp_member_ring.ok());
  auto tcp_key = tcp_relay->export_key(*tcp_ring);
  ASSERT_TRUE(tcp_key.ok());
  ASSERT_TRUE(tcp_member->connect(tcp_relay->address()).ok());
  RelayLane tcp_lane(5, *tcp_member, *tcp_member_ring);
  Status by_message = tcp_lane.connect(1, std::string(reinterpret_cast<const char*>(tcp_key->data()), tcp_key->size()));
  EXPECT_EQ(by_message.code(), StatusCode::kUnavailable) << by_message.to_string();
  EXPECT_NE(by_message.message().find("not reached natively"), std::string::npos) << by_message.to_string();
  EXPECT_FALSE(tcp_lane.viable(1));
}

TEST(LaneNames, AreStable) {
  EXPECT_STREQ(lane_name(LaneKind::kTransport), "transport");
  EXPECT_STREQ(lane_name(LaneKind::kCudaIpc), "cuda_ipc");
  EXPECT_STREQ(lane_name(LaneKind::kRelay), "relay");
  EXPECT_STREQ(rma_path_name(RmaPath::kNative), "native");
  EXPECT_STREQ(rma_path_name(RmaPath::kByMessage), "by message");
}

}  // namespace
}  // namespace ferry::engine
