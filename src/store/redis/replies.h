// store/redis/replies.h — what the Redis backend makes of a server's replies (internal).
// Every reply a server sends is untrusted input: each decoder checks the reply's shape
// and sizes (values within kMaxValueBytes) and answers kPeerFailed ("unexpected reply")
// for anything else, so a hostile or confused server is refused, never believed or
// crashed on. The decoders are free functions over hiredis' redisReply so that
// fuzz/redis_reply_fuzz.cpp can drive them with the bytes of any reply.
#pragma once

#include <hiredis.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "ferry/store.h"

namespace ferry::store_detail::redis_replies {

// The largest reply a Redis store can legitimately send: a GET of a kMaxValueBytes value,
// or a SCAN page of 1000 keys, plus framing. Readers stop buffering a reply past it
// (hiredis 0.14 has no limit of its own).
inline constexpr size_t kMaxReplyBytes = kMaxValueBytes + (size_t{8} << 20);

// The status for an error reply ("-ERR ..."): kPermissionDenied for a refused token,
// kOutOfRange for an overflow, kInvalidArgument for a value that is not an integer or of
// the wrong type, kInternal otherwise; the message names op, key and the server's text.
Status error_status(std::string_view op, std::string_view key, std::string_view msg);

// kPeerFailed "store OP KEY: unexpected reply from redis".
Status unexpected(std::string_view op, std::string_view key);

// GET: the value; kNotFound for nil.
Result<std::string> get(const redisReply& r, std::string_view key);
// INCRBY, DEL, PEXPIRE: the integer.
Result<int64_t> integer(const redisReply& r, std::string_view op, std::string_view key);
// The compare-set script's {swapped, value?}.
Result<CompareSetResult> compare_set(const redisReply& r, std::string_view key);
// One SCAN page: the next cursor (a decimal number; "0" ends the scan) and the keys that
// start with `key_prefix`, that prefix removed.
struct ScanPage {
  std::string cursor;
  std::vector<std::string> keys;
};
Result<ScanPage> scan_page(const redisReply& r, std::string_view key_prefix);

// The most elements an array reply may declare (a SCAN page is two; its key list at most
// the COUNT asked for). hiredis 0.14 allocates an array's element table as soon as it
// reads the header, so a hostile or broken server's "*544444444" made it calloc 4 GB:
// bound_reader makes `rd` refuse such a header (the read fails with hiredis' OOM
// error, which the backend reports) instead. Call once per reader, before reading.
inline constexpr int kMaxReplyElements = 1 << 20;
void bound_reader(redisReader* rd);

}  // namespace ferry::store_detail::redis_replies
