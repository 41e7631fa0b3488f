// The engine's wire and store formats (engine/protocol.h): every message and lease
// round-trips, and every malformed input is refused as kCorrupt, never misread.
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "engine/cuda_ipc.h"
#include "engine/in_place.h"
#include "engine/protocol.h"
#include "ferry/device.h"
#include "test_paths.h"

namespace ferry::engine {
namespace {

std::vector<Message> one_of_each() {
  return {Announce{1, 7, 2, 0xabcdef, 4096, 0x1234},
          Announce{1, 7, 2, 0xabcdef, 4096, std::nullopt},
          Announce{1, 7, 2, 0xabcdef, 4096, 0x1234, 6, 77, 1 << 20, 4096},
          Release{3, 7, 2, 0xabcdef},
          Release{3, 7, 2, 0xabcdef, Release::kPatch},
          Ready{3, 7, 2, 0xabcdef, 1, 1},
          Ready{3, 7, 2, 0xabcdef, 1, 1, 6},
          Pushed{1, 7, 2, 0xabcdef, 1, 99},
          Pushed{1, 7, 2, 0xabcdef, 1, std::nullopt},
          Pushed{1, 7, 2, 0xabcdef, 1, std::nullopt, 6, 40},
          Dropped{1, 7, 5, "stalled: group 3 not released within 3000 ms"},
          Dropped{1, 7, 5, ""},
          Abort{3, 7, 5, "reading group 2 from producer 1: it died"},
          Done{3, 7, 5},
          Failover{3, 7, 5},
          RoutesNotice{1, 7, 5},
          Flushed{1, 8, 5},
          Join{3, 7, 5},
          Leave{3, 7, 5},
          Relay{3, 7, 2, 5, Relay::kAsk, 0},
          Relay{4, 7, 2, 5, Relay::kOffer, 1 << 20},
          Relay{4, 7, 2, 5, Relay::kCut, 0},
          Replica{3, 7, 0x1234, Replica::kAsk, 0, 0},
          Replica{4, 7, 0x1234, Replica::kOffer, 1, 0xfeed},
          Replica{4, 7, 0x1234, Replica::kRevoked, 0, 0}};
}

TEST(EngineProtocol, EveryMessageRoundTrips) {
  std::set<size_t> types;
  for (const Message& m : one_of_each()) {
    const auto bytes = encode_message(m);
    auto back = decode_message(bytes);
    ASSERT_TRUE(back.ok()) << message_name(m) << ": " << back.status().to_string();
    EXPECT_EQ(*back, m) << message_name(m);
    EXPECT_EQ(sender_of(*back), sender_of(m));
    EXPECT_EQ(version_of(*back), version_of(m));
    types.insert(m.index());
  }
  EXPECT_EQ(types.size(), std::variant_size_v<Message>) << "a message type without a round-trip case";
  EXPECT_EQ(sender_of(Release{3, 7, 2, 1}), 3u);
  EXPECT_EQ(sender_of(Announce{1, 7, 2, 1, 0, std::nullopt}), 1u);
}

TEST(EngineProtocol, EveryTruncationAndExtensionIsCorrupt) {
  for (const Message& m : one_of_each()) {
    const auto bytes = encode_message(m);
    for (size_t n = 0; n < bytes.size(); ++n) {
      auto r = decode_message(std::span<const std::byte>(bytes.data(), n));
      ASSERT_FALSE(r.ok()) << message_name(m) << " truncated to " << n;
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
    }
    auto longer = bytes;
    longer.push_back(std::byte{0});
    auto r = decode_message(longer);
    ASSERT_FALSE(r.ok()) << message_name(m) << " with a trailing byte";
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  }
}

TEST(EngineProtocol, BadMagicTypeAndFlagAreCorrupt) {
  auto bytes = encode_message(Announce{1, 7, 2, 3, 4, 5});
  auto bad = bytes;
  bad[0] ^= std::byte{1};
  EXPECT_EQ(decode_message(bad).status().code(), StatusCode::kCorrupt);
  for (uint8_t type : {uint8_t{0}, static_cast<uint8_t>(std::variant_size_v<Message> + 1), uint8_t{255}}) {
    bad = bytes;
    bad[4] = std::byte{type};
    auto r = decode_message(bad);
    ASSERT_FALSE(r.ok()) << "type " << int(type);
    EXPECT_NE(r.status().message().find("unknown type"), std::string::npos) << r.status().to_string();
  }
  // The checksum flag is the byte before the last 8.
  bad = bytes;
  bad[bad.size() - 9] = std::byte{2};
  EXPECT_EQ(decode_message(bad).status().code(), StatusCode::kCorrupt);
  // An absent checksum is all zeros: one encoding per message.
  bad = encode_message(Announce{1, 7, 2, 3, 4, std::nullopt});
  bad[bad.size() - 1] = std::byte{1};
  EXPECT_EQ(decode_message(bad).status().code(), StatusCode::kCorrupt);
  // Patch fields: none without a base, a base with a non-empty patch, flags 0/1.
  Announce a{1, 7, 2, 3, 4, std::nullopt};
  a.patch_bytes = 5;
  EXPECT_EQ(decode_message(encode_message(a)).status().code(), StatusCode::kCorrupt);
  a = Announce{1, 7, 2, 3, 4, std::nullopt};
  a.dense_offset = 64;
  EXPECT_EQ(decode_message(encode_message(a)).status().code(), StatusCode::kCorrupt);
  a = Announce{1, 7, 2, 3, 4, std::nullopt, 6, 0, 64};
  EXPECT_EQ(decode_message(encode_message(a)).status().code(), StatusCode::kCorrupt);
  a = Announce{1, 7, 2, 3, 4, std::nullopt};
  a.patch_offset = 128;
  EXPECT_EQ(decode_message(encode_message(a)).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode_message(encode_message(Pushed{1, 7, 2, 3, 0, std::nullopt, std::nullopt, 9})).status().code(),
            StatusCode::kCorrupt);
  EXPECT_TRUE(decode_message(encode_message(Release{3, 7, 2, 9, Release::kRepaired})).ok());
  EXPECT_TRUE(decode_message(encode_message(Release{3, 7, 2, 9, Release::kRelayed})).ok());  // relayed: nothing read
  EXPECT_EQ(decode_message(encode_message(Release{3, 7, 2, 9, 4})).status().code(), StatusCode::kCorrupt);
  // A relay message of an unknown kind, or with an offset that is no offer.
  EXPECT_EQ(decode_message(encode_message(Relay{3, 7, 2, 9, 6, 0})).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode_message(encode_message(Relay{3, 7, 2, 9, Relay::kAsk, 64})).status().code(), StatusCode::kCorrupt);
  // A catch-up message of an unknown kind, a set other than 0/1, or a table without an offer.
  EXPECT_EQ(decode_message(encode_message(Replica{3, 7, 9, 6, 0, 0})).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode_message(encode_message(Replica{3, 7, 9, Replica::kOffer, 2, 5})).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode_message(encode_message(Replica{3, 7, 9, Replica::kAsk, 0, 5})).status().code(), StatusCode::kCorrupt);
  // Bytes of one type retyped as another of a different layout are refused (length).
  auto release = encode_message(Release{3, 7, 2, 9});
  release[4] = std::byte{static_cast<uint8_t>(Message(Ready{}).index() + 1)};
  EXPECT_FALSE(decode_message(release).ok());
}

// The fuzz target's message seeds (fuzz/seeds/fuzz_engine_protocol) are messages of
// today's format: each decodes and encodes back to the same bytes.
TEST(EngineProtocol, FuzzSeedsAreMessagesOfTodaysFormat) {
  const std::string dir = std::string(FERRY_SOURCE_DIR) + "/fuzz/seeds/fuzz_engine_protocol/";
  for (const char* name : {"announce", "release", "ready", "pushed", "done", "relay"}) {
    std::ifstream f(dir + name, std::ios::binary);
    ASSERT_TRUE(f.good()) << dir << name;
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(text.data()), text.size());
    auto m = decode_message(bytes);
    ASSERT_TRUE(m.ok()) << name << ": " << m.status().to_string();
    const auto again = encode_message(*m);
    EXPECT_TRUE(again.size() == bytes.size() && std::equal(again.begin(), again.end(), bytes.begin())) << name;
  }
}

TEST(EngineProtocol, LeasesRoundTripAndAreNotConfused) {
  const ProducerLease p{"addr\0x", "key", 4096, "table", "ipc"};
  const ConsumerLease c{"caddr", "ckey", 128, "params", "host-a"};
  auto pb = decode_producer_lease(encode_lease(p));
  ASSERT_TRUE(pb.ok()) << pb.status().to_string();
  EXPECT_EQ(*pb, p);
  auto cb = decode_consumer_lease(encode_lease(c));
  ASSERT_TRUE(cb.ok()) << cb.status().to_string();
  EXPECT_EQ(*cb, c);
  EXPECT_EQ(decode_producer_lease(encode_lease(c)).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode_consumer_lease(encode_lease(p)).status().code(), StatusCode::kCorrupt);
  const std::string blob = encode_lease(p);
  for (size_t n = 0; n < blob.size(); ++n)
    EXPECT_FALSE(decode_producer_lease(std::string_view(blob).substr(0, n)).ok()) << "truncated to " << n;
  // The versions a consumer holds travel in its lease; its instance() leaves them out.
  ConsumerLease v = c;
  v.committed = 7;
  v.received = 9;
  auto vb = decode_consumer_lease(encode_lease(v));
  ASSERT_TRUE(vb.ok()) << vb.status().to_string();
  EXPECT_EQ(*vb, v);
  EXPECT_EQ(v.instance(), c);
  v.received.reset();
  EXPECT_EQ(*decode_consumer_lease(encode_lease(v)), v);
  // A wrong-width number is refused, not read short; so are the old (FCL1, FCL2) leases.
  const std::string odd = encode_fields({"FCL3", "a", "k", "1234567", "", "", "", "h"});
  EXPECT_EQ(decode_consumer_lease(odd).status().code(), StatusCode::kCorrupt);
  const std::string odd_version = encode_fields({"FCL3", "a", "k", u64_field(1), "", "123", "", "h"});
  EXPECT_EQ(decode_consumer_lease(odd_version).status().code(), StatusCode::kCorrupt);
  const std::string fcl2 = encode_fields({"FCL2", "a", "k", u64_field(1), "", "", ""});
  EXPECT_EQ(decode_consumer_lease(fcl2).status().code(), StatusCode::kCorrupt);
  const std::string old = encode_fields({"FCL1", "a", "k", u64_field(1), ""});
  EXPECT_EQ(decode_consumer_lease(old).status().code(), StatusCode::kCorrupt);
}

TEST(EngineProtocol, FieldsAreCountedBeforeTheyAreKept) {
  const std::string three = encode_fields({"a", "b", "c"});
  EXPECT_TRUE(decode_fields(three, 3).ok());
  auto r = decode_fields(three, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than 2"), std::string::npos) << r.status().to_string();
  std::string overrun = encode_fields({"abc"});
  overrun.pop_back();
  EXPECT_EQ(decode_fields(overrun, 1).status().code(), StatusCode::kCorrupt);
}

TEST(EngineProtocol, JobKeysStayUnderTheJobPrefix) {
  const JobKeys k("jobA");
  for (const std::string& key : {k.meta(), k.holdings(1), k.plan(2), k.producer(3), k.consumer(4), k.dead(5)})
    EXPECT_EQ(key.rfind("jobA/", 0), 0u) << key;
  EXPECT_EQ(k.dead(5).rfind(k.dead_prefix(), 0), 0u);
  EXPECT_NE(k.producer(1), k.consumer(1));
  EXPECT_NE(k.holdings(1), k.plan(1));
}

// Issue 30: a job named 'j/dead/1' wrote j/dead/1/meta, which job 'j' listed under its
// dead prefix and read as "producer 1 is dead" (stoi("1/meta") = 1). Names containing
// the separator are refused, so no job's keys lie under another's.
TEST(EngineProtocol, JobNamesThatCouldCollideAreRefused) {
  for (const char* ok : {"ferry", "rl-run-7", "job.1_x", "j"}) EXPECT_TRUE(JobKeys::check(ok).ok()) << ok;
  auto sep = JobKeys::check("j/dead/1");
  ASSERT_EQ(sep.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(sep.message().find("contains '/'"), std::string::npos) << sep.to_string();
  EXPECT_EQ(JobKeys::check("").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(JobKeys::check(std::string(JobKeys::kMaxJobBytes + 1, 'a')).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(JobKeys::check(std::string(JobKeys::kMaxJobBytes, 'a')).ok());
  EXPECT_EQ(JobKeys::check("a\nb").code(), StatusCode::kInvalidArgument);
  // Two valid names never share a key or a listed prefix: the first '/' ends the name.
  const JobKeys j("j"), jd("j-dead");
  EXPECT_NE(jd.meta().rfind(j.dead_prefix(), 0), 0u);
}

// Every key listed back is parsed whole: a canonical decimal in int range, nothing after.
TEST(EngineProtocol, ListedKeysAreParsedExactly) {
  const JobKeys k("j");
  EXPECT_EQ(k.dead_rank(k.dead(1)), 1);
  EXPECT_EQ(k.dead_rank(k.dead(0)), 0);
  EXPECT_EQ(k.dead_rank("j/dead/2147483647"), 2147483647);
  for (const char* bad : {"j/dead/1/meta", "j/dead/01", "j/dead/+1", "j/dead/-1", "j/dead/ 1", "j/dead/1 ",
                          "j/dead/", "j/dead/2147483648", "j/dead/99999999999", "j/dead/1x", "j/deadx/1", "k/dead/1",
                          "j/dead/0x1"})
    EXPECT_FALSE(k.dead_rank(bad).has_value()) << bad;
  auto w = k.world_of(k.world("consumer", 3, 2, 4, "rotated.producer"));
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->role, "consumer");
  EXPECT_EQ(w->rank, 3);
  EXPECT_EQ(w->num_producers, 2);
  EXPECT_EQ(w->num_consumers, 4);
  EXPECT_EQ(w->routing, "rotated.producer");
  for (const char* bad : {"j/world/producer/0/2/3/x/y", "j/world/producer/0/2/3", "j/world/producer/0/+2/3/x",
                          "j/world/producer/0/2/03/x", "j/world/trainer/0/2/3/x", "j/world/producer/-1/2/3/x",
                          "j/world/producer/0/2/3/", "j/world/producer//2/3/x", "j/world/producer/0/2/4294967299/x"})
    EXPECT_FALSE(k.world_of(bad).has_value()) << bad;
  for (int rank : {0, 5, -1, -7, 2147483647}) {
    auto f = k.failed_of(k.failed("producer", rank));
    ASSERT_TRUE(f.has_value()) << rank;
    EXPECT_EQ(f->role, "producer");
    EXPECT_EQ(f->rank, rank);
  }
  for (const char* bad : {"j/failed/consumer/1/x", "j/failed/consumer/01", "j/failed/consumer/-0",
                          "j/failed/consumer/--1", "j/failed/consumer/+1", "j/failed/consumer/", "j/failed/consumer",
                          "j/failed/trainer/1", "j/failed//1", "j/failed/consumer/2147483648", "k/failed/consumer/1",
                          "j/failedx/consumer/1"})
    EXPECT_FALSE(k.failed_of(bad).has_value()) << bad;
}

Holdings bf16_boxes(std::vector<int64_t> sizes) {
  Holdings h;
  h.tensors.push_back({"t", DType::kBF16, {int64_t{1} << 40}});
  for (int64_t n : sizes) h.boxes.push_back(HeldBox{0, Box{{0}, {n}}});
  return h;
}

TEST(InPlaceTable, RoundTripAndMalformedBytes) {
  InPlaceTable t;
  t.min_bytes = 4096;
  t.keys = {"key-a", "key-b"};
  t.boxes = {{0, 128}, {-1, 0}, {1, 1 << 20}};
  const Holdings three = bf16_boxes({64, 64, 64});
  const std::string bytes = t.encode();
  auto d = InPlaceTable::decode(bytes, three);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->min_bytes, 4096u);
  EXPECT_EQ(d->keys, t.keys);
  ASSERT_EQ(d->boxes.size(), 3u);
  EXPECT_EQ(d->boxes[2].region, 1);
  EXPECT_EQ(d->boxes[2].offset, uint64_t{1} << 20);
  EXPECT_TRUE(InPlaceTable::decode("", three)->empty());  // no source regions
  EXPECT_EQ(InPlaceTable::decode(bytes, bf16_boxes({1, 1, 1, 1})).status().code(), StatusCode::kCorrupt);  // box count
  for (size_t n = 1; n < bytes.size(); n += 7)
    EXPECT_FALSE(InPlaceTable::decode(bytes.substr(0, n), three).ok()) << "truncated at " << n;
  t.boxes[1].region = 2;  // names a region the table lacks
  EXPECT_EQ(InPlaceTable::decode(t.encode(), three).status().code(), StatusCode::kCorrupt);
}

// Issue 30: decode did not bound region offsets. A box in place whose offset plus its
// bytes wraps past 2^64 is refused by decode (it knows the holdings); one that lies past
// its region's end is refused once the region's length is known (check_regions).
TEST(InPlaceTable, OffsetsAreBoundedByTheBoxesAndTheRegions) {
  InPlaceTable t;
  t.keys = {"key-a"};
  const Holdings h = bf16_boxes({64, 1024});  // 128 and 2048 bytes
  t.boxes = {{0, 0}, {0, UINT64_MAX - 1000}};  // box 1's 2048 bytes wrap
  auto wrapped = InPlaceTable::decode(t.encode(), h);
  ASSERT_EQ(wrapped.status().code(), StatusCode::kCorrupt) << wrapped.status().to_string();
  EXPECT_NE(wrapped.status().message().find("box 1"), std::string::npos) << wrapped.status().to_string();
  t.boxes[1].offset = UINT64_MAX - 2048;  // ends exactly at 2^64 - 1: representable
  EXPECT_TRUE(InPlaceTable::decode(t.encode(), h).ok());
  // A box whose bytes themselves overflow (2^40 x 2^40 elements) is refused too.
  Holdings huge = h;
  huge.tensors[0].shape = {int64_t{1} << 40, int64_t{1} << 40};
  huge.boxes[0].box = Box{{0, 0}, {1, 64}};
  huge.boxes[1].box = Box{{0, 0}, {int64_t{1} << 40, int64_t{1} << 40}};
  t.boxes[1].offset = 0;
  EXPECT_EQ(InPlaceTable::decode(t.encode(), huge).status().code(), StatusCode::kCorrupt);

  // Inside a region of 4096 bytes: box 1 at 2048 fits exactly; at 2049 it does not.
  t.boxes = {{0, 0}, {0, 2048}};
  auto ok = InPlaceTable::decode(t.encode(), h);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  RemoteRegion region;
  region.length = 4096;
  EXPECT_TRUE(ok->check_regions({region}, h).ok());
  t.boxes[1].offset = 2049;
  auto past = InPlaceTable::decode(t.encode(), h);
  ASSERT_TRUE(past.ok());  // decode cannot know the region's length
  Status s = past->check_regions({region}, h);
  ASSERT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_NE(s.message().find("box 1 (2048 bytes at offset 2049) lies outside source region 0 (4096 bytes)"),
            std::string::npos)
      << s.to_string();
  t.boxes[1].offset = UINT64_MAX;  // past any region, and no wrap on the way
  Holdings empty_box = bf16_boxes({64, 0});
  auto far = InPlaceTable::decode(t.encode(), empty_box);
  ASSERT_TRUE(far.ok());
  EXPECT_EQ(far->check_regions({region}, empty_box).code(), StatusCode::kCorrupt);
  EXPECT_EQ(ok->check_regions({}, h).code(), StatusCode::kCorrupt);  // regions missing
}

// A producer's GPU staging as its lease carries it: round trip; truncated, foreign or
// malformed blobs refused; mapped only on the host that exported it, and in its own
// process only on its own device (there the pointer itself is used).
TEST(EngineCudaIpc, ExportRoundTripsAndIsMappedOnlyWhereItCanBe) {
  const CudaIpcExport e{host_identity(), static_cast<uint64_t>(getpid()), process_token(), 0, 0x7000, 1 << 20,
                        std::string(kCudaIpcHandleBytes, 'h')};
  const std::string blob = encode_cuda_ipc(e);
  auto back = decode_cuda_ipc(blob);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, e);
  for (size_t n = 0; n < blob.size(); ++n) EXPECT_FALSE(decode_cuda_ipc(std::string_view(blob).substr(0, n)).ok()) << n;
  CudaIpcExport short_handle = e;
  short_handle.handle = "xyz";
  EXPECT_EQ(decode_cuda_ipc(encode_cuda_ipc(short_handle)).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(decode_cuda_ipc(encode_lease(ProducerLease{"a", "k", 1, "", ""})).status().code(), StatusCode::kCorrupt);
  // The identity names this host's network namespace (so emulated hosts differ).
  EXPECT_NE(host_identity().find("net:["), std::string::npos) << host_identity();
  CudaIpcExport elsewhere = e;
  elsewhere.host = "another-host|boot|net:[1]";
  auto m = map_cuda_ipc(elsewhere, Device::cuda(0));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(m.status().message().find("another host"), std::string::npos) << m.status().to_string();
  m = map_cuda_ipc(e, Device::cuda(0));  // this process: the pointer itself
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->get()), 0x7000u);
  m = map_cuda_ipc(e, Device::cuda(1));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("cuda:1"), std::string::npos) << m.status().to_string();
  // Another process of this host (the same pid in another PID namespace, too): opened
  // with CUDA IPC, which needs a device here.
  CudaIpcExport other = e;
  other.process = e.process + 1;
  m = map_cuda_ipc(other, Device::cuda(0));
  if (!cuda_status().usable()) {
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kUnavailable) << m.status().to_string();
    EXPECT_NE(m.status().message().find("cuda_ipc_open"), std::string::npos) << m.status().to_string();
  }
}

}  // namespace
}  // namespace ferry::engine
