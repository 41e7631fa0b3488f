// Untrusted bytes as a Redis server's replies (RESP2): parsed by hiredis' reader, as the
// Redis backend parses what a server sends, then given to every decoder of
// store/redis/replies.h. Nothing crashes or reads outside the reply; whatever a decoder
// accepts keeps the store's limits (values within kMaxValueBytes, decimal cursors, a
// swap that names its value).
#include <hiredis.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "store/redis/replies.h"

namespace replies = ferry::store_detail::redis_replies;

namespace {

void check(const redisReply& r) {
  if (r.type == REDIS_REPLY_ERROR) {
    const ferry::Status st = replies::error_status("get", "k", std::string_view(r.str, r.len));
    if (st.ok()) std::abort();
    return;
  }
  if (auto v = replies::get(r, "k"); v.ok() && v->size() > ferry::kMaxValueBytes) std::abort();
  (void)replies::integer(r, "add", "k");
  if (auto c = replies::compare_set(r, "k"); c.ok()) {
    if (c->swapped && !c->value) std::abort();
    if (c->value && c->value->size() > ferry::kMaxValueBytes) std::abort();
  }
  for (std::string_view prefix : {std::string_view(), std::string_view("job/")}) {
    if (auto p = replies::scan_page(r, prefix); p.ok()) {
      if (p->cursor.empty() || p->cursor.size() > 20) std::abort();
      for (char ch : p->cursor)
        if (ch < '0' || ch > '9') std::abort();
      for (const auto& k : p->keys)
        if (k.size() > ferry::kMaxKeyBytes) std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  redisReader* rd = redisReaderCreate();
  if (rd == nullptr) return 0;
  replies::bound_reader(rd);  // as the backend's reader
  // Fed in two pieces (split at the first byte's value), as replies arrive over a socket.
  const size_t cut = size == 0 ? 0 : std::min<size_t>(data[0], size);
  bool ok = redisReaderFeed(rd, reinterpret_cast<const char*>(data), cut) == REDIS_OK &&
            redisReaderFeed(rd, reinterpret_cast<const char*>(data) + cut, size - cut) == REDIS_OK;
  for (int i = 0; ok && i < 64; ++i) {
    void* raw = nullptr;
    if (redisReaderGetReply(rd, &raw) != REDIS_OK || raw == nullptr) break;
    check(*static_cast<const redisReply*>(raw));
    freeReplyObject(raw);
  }
  redisReaderFree(rd);
  return 0;
}
