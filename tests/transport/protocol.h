// The test peers' message protocol and data pattern (tests only).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace ferry::transport_test {

enum Tag : uint32_t {
  kEcho = 1,       // payload: anything; reply kEchoReply with the same bytes
  kHash = 2,       // payload: u64 offset, u64 length; reply kHashReply: offset, length, xxh3, ok(0/1)
  kFill = 3,       // payload: u64 offset, u64 length, u64 seed; reply kFillReply: offset, length, ok
  kExit = 4,       // the peer exits (process) / stops serving
  kReadLoop = 5,   // payload: a key of the sender's region; the peer reads from it in a
                   // loop (64 KiB reads, 8 in flight) until it fails; reply kReadLoopStarted
                   // once the first reads completed
  kWriteLoop = 6,  // the same with writes (each window flushed)
  kWideReadLoop = 7,  // kReadLoop with 1 MiB reads, 16 in flight (more than a tcp socket
                      // buffer holds, so the target has sends waiting)
  kCopy = 8,       // payload: u64 write(0/1), u64 offset, u64 length, then a key of the
                   // sender's region. read: the peer reads [offset, offset + length) of
                   // it into its own region at 0; write: the peer writes its region's
                   // [0, length) there and flushes. Reply kCopyReply: ok(0/1), xxh3 of
                   // its region's [0, length), and whether the operation went by
                   // message (TransportStats::reads/writes_by_message moved: 0/1)
  kSendLoop = 9,   // the peer sends kFlood messages (64 bytes) to the sender, 16 in
                   // flight, until one fails; kReadLoopStarted after the first 256
  kEchoReply = 101,
  kHashReply = 102,
  kFillReply = 103,
  kReadLoopStarted = 105,
  kCopyReply = 108,
  kFlood = 109,  // counted by the Mailbox, never queued
};

// The pattern byte at absolute offset `off` of a region filled with `seed`.
void fill_pattern(std::byte* dst, uint64_t region_offset, uint64_t length, uint64_t seed);
// Index of the first byte that differs from the pattern, or UINT64_MAX.
uint64_t check_pattern(const std::byte* src, uint64_t region_offset, uint64_t length, uint64_t seed);
uint64_t hash_bytes(const std::byte* p, uint64_t length);

inline std::vector<std::byte> pack_u64s(std::initializer_list<uint64_t> v) {
  std::vector<std::byte> out(v.size() * 8);
  size_t i = 0;
  for (uint64_t x : v) std::memcpy(out.data() + 8 * i++, &x, 8);
  return out;
}
// False when `in` does not hold exactly n u64s (never trust a message).
inline bool unpack_u64s(std::span<const std::byte> in, size_t n, uint64_t* out) {
  if (in.size() != n * 8) return false;
  std::memcpy(out, in.data(), n * 8);
  return true;
}

std::string to_hex(std::span<const std::byte> b);
bool from_hex(const std::string& s, std::vector<std::byte>* out);

}  // namespace ferry::transport_test
