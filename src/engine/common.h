// Internal helpers of the engine: control messages, store blobs, JSON of holdings.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <set>
#include <vector>

#include "ferry/engine.h"

namespace ferry::engine {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

inline constexpr uint32_t kTag = 0xFE770001u;
inline constexpr uint32_t kMagic = 0x46455231u;  // "FER1"

enum class MsgType : uint8_t {
  kAnnounce = 1,  // p -> c: group (version, group) packed at slot_offset of the staging ring
  kRelease = 2,   // c -> p: done reading (version, group)
  kDropped = 3,   // p -> c: you were dropped from sync `version`
  kReady = 4,     // c -> p (push): receive slot `slot` is free for (version, group)
  kPushed = 5,    // p -> c (push): (version, group) written and flushed into slot `slot`
  kAbort = 6,     // c -> p: this consumer gave up sync `version`
  kFailover = 7,  // c -> p: restart sync `version` with the routes `routes_hash` (producers in {job}/dead/ excluded)
  kDone = 8,      // c -> p: committed `version`
  kRoutes = 9,    // p -> c: this producer runs sync `version` with routes `routes_hash` (after a failover)
  kFlushed = 10,  // p -> c (push): answer to FAILOVER `routes_hash`: no write of other routes to c in flight
};

struct Msg {
  uint32_t magic = kMagic;
  uint8_t type = 0;
  uint8_t pad[3] = {0, 0, 0};
  uint32_t rank = 0;  // sender's rank (producer or consumer)
  int32_t group = 0;
  uint64_t version = 0;
  uint64_t routes_hash = 0;
  uint64_t slot_offset = 0;  // announce: byte offset of the group in the staging ring
  uint64_t checksum = 0;     // announce/pushed with checksums on: xxHash64 of the segment
  uint32_t slot = 0;         // push: receive slot
  uint32_t has_checksum = 0;
};
static_assert(sizeof(Msg) == 56);

std::vector<std::byte> encode_msg(const Msg& m);
// Length- and magic-checked decoding.
Result<Msg> decode_msg(std::span<const std::byte> bytes);

// A store blob: length-prefixed fields.
std::string encode_fields(const std::vector<std::string>& fields);
Result<std::vector<std::string>> decode_fields(std::string_view blob, size_t expected);

inline std::string bytes_to_string(std::span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}
inline std::span<const std::byte> string_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::string u64_field(uint64_t v);
Result<uint64_t> parse_u64_field(std::string_view s);

std::string encode_decls(const std::vector<TensorDecl>& decls);
Result<std::vector<TensorDecl>> decode_decls(std::string_view text);
std::string encode_holdings(const Holdings& h);
Result<Holdings> decode_holdings(std::string_view text);

// Keys under the job prefix.
std::string key_meta(const std::string& job);
std::string key_holdings(const std::string& job, int p);
std::string key_plan(const std::string& job, int c);
std::string key_producer(const std::string& job, int p);
std::string key_consumer(const std::string& job, int c);

std::string key_dead(const std::string& job, int p);
std::string key_dead_prefix(const std::string& job);

// What routes are built from, fetched once at rendezvous.
struct RouteInputs {
  std::vector<TensorDecl> metadata;
  std::vector<Holdings> holdings;  // per producer
  std::vector<Plan> plans;         // per consumer
};
// Waits for every producer's holdings and every consumer's plan.
Result<RouteInputs> rendezvous_inputs(Store& store, const EngineOptions& o, const std::vector<TensorDecl>& metadata);
// build_routes with the holdings of `dead` producers emptied (indices kept).
Result<Routes> build_routes_excluding(const RouteInputs& in, const std::set<int>& dead);
// Producers marked dead in the store ({job}/dead/{p}).
Result<std::set<int>> read_dead(Store& store, const std::string& job);

// Zeroed host memory allocated and registered by a transport (Transport::allocate_memory).
struct RegisteredBuffer {
  Transport* transport = nullptr;
  std::byte* data = nullptr;
  uint64_t bytes = 0;
  MemoryRegion region;
  RegisteredBuffer() = default;
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  ~RegisteredBuffer() { reset(); }
  Status allocate(Transport& t, uint64_t n);
  void reset();
};

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ferry::engine
