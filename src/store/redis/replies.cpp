#include "store/redis/replies.h"

#include <mutex>

#include <algorithm>

#include "store/common.h"

namespace ferry::store_detail::redis_replies {

namespace {

bool is_string(const redisReply* r) { return r != nullptr && r->type == REDIS_REPLY_STRING && r->len <= kMaxValueBytes; }

}  // namespace

Status error_status(std::string_view op, std::string_view key, std::string_view msg) {
  std::string k = key.empty() ? std::string() : " " + quote_key(key);
  if (msg.find("WRONGPASS") != std::string_view::npos || msg.find("NOAUTH") != std::string_view::npos ||
      msg.find("invalid password") != std::string_view::npos) {
    return permission_denied("store {}{}: redis refused the token: {}", op, k, msg);
  }
  if (msg.find("overflow") != std::string_view::npos) {
    return out_of_range("store {}{}: redis: {}", op, k, msg);
  }
  if (msg.find("not an integer") != std::string_view::npos) {
    return invalid_argument("store {}{}: the value is not a decimal integer (redis: {})", op, k, msg);
  }
  if (msg.find("WRONGTYPE") != std::string_view::npos) {
    return invalid_argument("store {}{}: redis: {}", op, k, msg);
  }
  // A redis-server that restarted with its data answers LOADING until the data set is
  // in memory (BUSY: a script ran too long): the store is there but not yet serving,
  // which callers treat as they treat a store they cannot reach (retry later).
  if (msg.rfind("LOADING", 0) == 0 || msg.rfind("BUSY", 0) == 0) {
    return unavailable("store {}{}: redis is not serving yet: {}", op, k, msg);
  }
  return internal_error("store {}{}: redis error: {}", op, k, msg);
}

Status unexpected(std::string_view op, std::string_view key) {
  return peer_failed("store {}{}: unexpected reply from redis", op, key.empty() ? "" : " " + quote_key(key));
}

Result<std::string> get(const redisReply& r, std::string_view key) {
  if (r.type == REDIS_REPLY_NIL) return not_found("store get {}: no such key", quote_key(key));
  if (!is_string(&r)) return unexpected("get", key);
  return std::string(r.str, r.len);
}

Result<int64_t> integer(const redisReply& r, std::string_view op, std::string_view key) {
  if (r.type != REDIS_REPLY_INTEGER) return unexpected(op, key);
  return static_cast<int64_t>(r.integer);
}

Result<CompareSetResult> compare_set(const redisReply& r, std::string_view key) {
  if (r.type != REDIS_REPLY_ARRAY || r.elements < 1 || r.elements > 2 || r.element[0] == nullptr ||
      r.element[0]->type != REDIS_REPLY_INTEGER || (r.element[0]->integer != 0 && r.element[0]->integer != 1)) {
    return unexpected("compare_set", key);
  }
  CompareSetResult out;
  out.swapped = r.element[0]->integer == 1;
  if (r.elements == 2) {
    if (!is_string(r.element[1])) return unexpected("compare_set", key);
    out.value = std::string(r.element[1]->str, r.element[1]->len);
  } else if (out.swapped) {
    return unexpected("compare_set", key);  // a swap always returns the value it set
  }
  return out;
}

Result<ScanPage> scan_page(const redisReply& r, std::string_view key_prefix) {
  if (r.type != REDIS_REPLY_ARRAY || r.elements != 2 || !is_string(r.element[0]) || r.element[1] == nullptr ||
      r.element[1]->type != REDIS_REPLY_ARRAY) {
    return unexpected("list", "");
  }
  ScanPage page;
  page.cursor.assign(r.element[0]->str, r.element[0]->len);
  // A cursor is a decimal number: anything else would be sent back to the server as is.
  if (page.cursor.empty() || page.cursor.size() > 20 ||
      !std::all_of(page.cursor.begin(), page.cursor.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return unexpected("list", "");
  }
  const redisReply* arr = r.element[1];
  for (size_t i = 0; i < arr->elements; ++i) {
    if (!is_string(arr->element[i]) || arr->element[i]->len > key_prefix.size() + kMaxKeyBytes) {
      return unexpected("list", "");
    }
    std::string_view k(arr->element[i]->str, arr->element[i]->len);
    if (!k.starts_with(key_prefix)) continue;
    page.keys.emplace_back(k.substr(key_prefix.size()));
  }
  return page;
}

namespace {
redisReplyObjectFunctions bounded_functions;
void* (*default_create_array)(const redisReadTask*, int) = nullptr;
void* create_bounded_array(const redisReadTask* task, int elements) {
  if (elements < 0 || elements > kMaxReplyElements) return nullptr;  // the reader fails: "Out of memory"
  return default_create_array(task, elements);
}
}  // namespace

void bound_reader(redisReader* rd) {
  if (rd == nullptr || rd->fn == nullptr) return;
  static std::once_flag once;
  // Every reader hiredis makes shares its default table: copy it once, wrapping createArray.
  std::call_once(once, [rd] {
    bounded_functions = *rd->fn;
    default_create_array = rd->fn->createArray;
    bounded_functions.createArray = &create_bounded_array;
  });
  if (rd->fn->createArray == default_create_array) rd->fn = &bounded_functions;
}

}  // namespace ferry::store_detail::redis_replies
