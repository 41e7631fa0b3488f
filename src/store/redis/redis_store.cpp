// The Redis backend: one hiredis connection per Store, guarded by a mutex.
//
//   set          SET k v [PX ttl]
//   get          GET k
//   add          INCRBY k delta           (keeps an existing TTL, as the TCP store does)
//   compare_set  EVAL of kCompareSetLua   (atomic on the server)
//   remove       DEL k
//   list         SCAN 0.. MATCH <escaped prefix>* COUNT 1000, then sorted
//   wait         pipelined EXISTS per missing key, polled with backoff (1 ms → 50 ms),
//                the connection released between polls, bounded by the timeout
//   renew        PEXPIRE k ttl            (0: absent → NotFound)
// Every key is stored as "PREFIX/key" when the URL has a PREFIX.
#include <hiredis.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "store/backends.h"
#include "store/common.h"

namespace ferry::store_detail {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCompareSetLua = R"lua(
local cur = redis.call('GET', KEYS[1])
local match
if ARGV[1] == '0' then match = (cur == false) else match = (cur == ARGV[2]) end
if match then
  if ARGV[4] == '0' then
    redis.call('SET', KEYS[1], ARGV[3])
  else
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
  end
  return {1, ARGV[3]}
end
if cur == false then return {0} end
return {0, cur}
)lua";

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct ContextDeleter {
  void operator()(redisContext* c) const {
    if (c) redisFree(c);
  }
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;

timeval to_timeval(Millis ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

// Escapes Redis glob metacharacters so a prefix matches literally.
std::string glob_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

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
  return internal_error("store {}{}: redis error: {}", op, k, msg);
}

class RedisStore final : public Store {
 public:
  RedisStore(StoreUrl url, StoreOptions options, std::string token)
      : url_(std::move(url)), options_(std::move(options)), token_(std::move(token)) {
    if (!url_.prefix.empty()) key_prefix_ = url_.prefix + "/";
  }

  Status connect() {
    std::lock_guard<std::mutex> lock(mu_);
    return ensure_connected();
  }

  Status set(std::string_view key, std::string_view value, Millis ttl) override {
    FERRY_RETURN_IF_ERROR(check_key("set", key));
    FERRY_RETURN_IF_ERROR(check_value("set", key, value));
    FERRY_RETURN_IF_ERROR(check_ttl("set", key, ttl.count(), false));
    const std::string k = full(key);
    std::vector<std::string_view> argv = {"SET", k, value};
    std::string px;
    if (ttl.count() > 0) {
      px = std::to_string(ttl.count());
      argv.push_back("PX");
      argv.push_back(px);
    }
    FERRY_ASSIGN_OR_RETURN(Reply r, command("set", key, argv));
    return Status::Ok();
  }

  Result<std::string> get(std::string_view key) override {
    FERRY_RETURN_IF_ERROR(check_key("get", key));
    const std::string k = full(key);
    FERRY_ASSIGN_OR_RETURN(Reply r, command("get", key, {"GET", k}));
    if (r->type == REDIS_REPLY_NIL) return not_found("store get {}: no such key", quote_key(key));
    if (r->type != REDIS_REPLY_STRING) return unexpected("get", key);
    return std::string(r->str, r->len);
  }

  Result<int64_t> add(std::string_view key, int64_t delta) override {
    FERRY_RETURN_IF_ERROR(check_key("add", key));
    const std::string k = full(key), d = std::to_string(delta);
    FERRY_ASSIGN_OR_RETURN(Reply r, command("add", key, {"INCRBY", k, d}));
    if (r->type != REDIS_REPLY_INTEGER) return unexpected("add", key);
    return static_cast<int64_t>(r->integer);
  }

  Result<CompareSetResult> compare_set(std::string_view key, std::optional<std::string_view> expected,
                                       std::string_view desired, Millis ttl) override {
    FERRY_RETURN_IF_ERROR(check_key("compare_set", key));
    FERRY_RETURN_IF_ERROR(check_value("compare_set", key, desired));
    if (expected) FERRY_RETURN_IF_ERROR(check_value("compare_set", key, *expected));
    FERRY_RETURN_IF_ERROR(check_ttl("compare_set", key, ttl.count(), false));
    const std::string k = full(key), t = std::to_string(ttl.count());
    FERRY_ASSIGN_OR_RETURN(Reply r, command("compare_set", key,
                                            {"EVAL", kCompareSetLua, "1", k, expected ? "1" : "0",
                                             expected.value_or(std::string_view()), desired, t}));
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || r->elements > 2 ||
        r->element[0]->type != REDIS_REPLY_INTEGER) {
      return unexpected("compare_set", key);
    }
    CompareSetResult out;
    out.swapped = r->element[0]->integer == 1;
    if (r->elements == 2) {
      if (r->element[1]->type != REDIS_REPLY_STRING) return unexpected("compare_set", key);
      out.value = std::string(r->element[1]->str, r->element[1]->len);
    }
    return out;
  }

  Result<bool> remove(std::string_view key) override {
    FERRY_RETURN_IF_ERROR(check_key("remove", key));
    const std::string k = full(key);
    FERRY_ASSIGN_OR_RETURN(Reply r, command("remove", key, {"DEL", k}));
    if (r->type != REDIS_REPLY_INTEGER) return unexpected("remove", key);
    return r->integer > 0;
  }

  Result<std::vector<std::string>> list(std::string_view prefix) override {
    if (prefix.size() > kMaxKeyBytes) {
      return invalid_argument("store list: prefix of {} bytes is too long", prefix.size());
    }
    const std::string pattern = glob_escape(key_prefix_) + glob_escape(prefix) + "*";
    std::set<std::string> keys;  // SCAN may return a key more than once
    std::string cursor = "0";
    do {
      FERRY_ASSIGN_OR_RETURN(Reply r, command("list", "", {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}));
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
          r->element[1]->type != REDIS_REPLY_ARRAY) {
        return unexpected("list", "");
      }
      cursor.assign(r->element[0]->str, r->element[0]->len);
      const redisReply* arr = r->element[1];
      for (size_t i = 0; i < arr->elements; ++i) {
        if (arr->element[i]->type != REDIS_REPLY_STRING) return unexpected("list", "");
        std::string_view k(arr->element[i]->str, arr->element[i]->len);
        if (!k.starts_with(key_prefix_)) continue;
        keys.emplace(k.substr(key_prefix_.size()));
      }
    } while (cursor != "0");
    return std::vector<std::string>(keys.begin(), keys.end());
  }

  Status wait(const std::vector<std::string>& keys, Millis timeout) override {
    FERRY_RETURN_IF_ERROR(check_wait(keys.size(), timeout.count()));
    for (const auto& k : keys) FERRY_RETURN_IF_ERROR(check_key("wait", k));
    std::set<std::string> missing(keys.begin(), keys.end());
    const size_t total = missing.size();
    const auto deadline = Clock::now() + timeout;
    auto backoff = Millis{1};
    while (!missing.empty()) {
      FERRY_RETURN_IF_ERROR(poll_exists(missing));
      if (missing.empty()) break;
      const auto now = Clock::now();
      if (now >= deadline) {
        std::string shown;
        size_t i = 0;
        for (auto it = missing.begin(); it != missing.end() && i < 8; ++it, ++i) {
          shown += (i ? ", " : "") + quote_key(*it);
        }
        if (missing.size() > 8) shown += ", ...";
        return timeout_error("store wait: {} of {} keys still missing after {} ms: {}", missing.size(), total,
                             timeout.count(), shown);
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, Millis{50});
    }
    return Status::Ok();
  }

  Status renew(std::string_view key, Millis ttl) override {
    FERRY_RETURN_IF_ERROR(check_key("renew", key));
    FERRY_RETURN_IF_ERROR(check_ttl("renew", key, ttl.count(), true));
    const std::string k = full(key), t = std::to_string(ttl.count());
    FERRY_ASSIGN_OR_RETURN(Reply r, command("renew", key, {"PEXPIRE", k, t}));
    if (r->type != REDIS_REPLY_INTEGER) return unexpected("renew", key);
    if (r->integer == 0) return not_found("store renew {}: no such key (expired or deleted)", quote_key(key));
    return Status::Ok();
  }

  Result<std::unique_ptr<Store>> clone() const override {
    auto s = std::make_unique<RedisStore>(url_, options_, token_);
    FERRY_RETURN_IF_ERROR(s->connect());
    return std::unique_ptr<Store>(std::move(s));
  }

  std::string url() const override { return url_.to_string(); }

 private:
  std::string full(std::string_view key) const { return key_prefix_ + std::string(key); }

  Status unexpected(std::string_view op, std::string_view key) {
    std::lock_guard<std::mutex> lock(mu_);
    ctx_.reset();  // do not trust this connection any more
    return peer_failed("store {}{}: unexpected reply from redis", op, key.empty() ? "" : " " + quote_key(key));
  }

  // One command; transport failures drop the connection (the next call reconnects).
  Result<Reply> command(std::string_view op, std::string_view key, const std::vector<std::string_view>& args) {
    std::lock_guard<std::mutex> lock(mu_);
    FERRY_RETURN_IF_ERROR(ensure_connected());
    return run(op, key, args);
  }

  Result<Reply> run(std::string_view op, std::string_view key, const std::vector<std::string_view>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    Reply r(static_cast<redisReply*>(
        redisCommandArgv(ctx_.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
    return check_reply(op, key, std::move(r));
  }

  Result<Reply> check_reply(std::string_view op, std::string_view key, Reply r) {
    if (!r) {
      Status st = transport_error(op);
      ctx_.reset();
      return st;
    }
    if (r->type == REDIS_REPLY_ERROR) return error_status(op, key, std::string_view(r->str, r->len));
    return r;
  }

  Status transport_error(std::string_view op) {
    std::string what = ctx_ ? std::string(ctx_->errstr) : "no connection";
    const bool timed_out = ctx_ && ctx_->err == REDIS_ERR_IO &&
                           (what.find("temporarily unavailable") != std::string::npos ||
                            what.find("timed out") != std::string::npos);
    if (timed_out) return timeout_error("store {} ({}): redis did not answer in time", op, url_.to_string());
    return unavailable("store {} ({}): connection to redis lost: {}", op, url_.to_string(), what);
  }

  // EXISTS for each missing key, pipelined; removes the keys that exist.
  Status poll_exists(std::set<std::string>& missing) {
    std::lock_guard<std::mutex> lock(mu_);
    FERRY_RETURN_IF_ERROR(ensure_connected());
    std::vector<std::string> names(missing.begin(), missing.end());
    for (const auto& n : names) {
      const std::string k = full(n);
      const char* argv[2] = {"EXISTS", k.data()};
      const size_t lens[2] = {6, k.size()};
      if (redisAppendCommandArgv(ctx_.get(), 2, argv, lens) != REDIS_OK) {
        Status st = transport_error("wait");
        ctx_.reset();
        return st;
      }
    }
    for (const auto& n : names) {
      void* raw = nullptr;
      if (redisGetReply(ctx_.get(), &raw) != REDIS_OK) {
        Status st = transport_error("wait");
        ctx_.reset();
        return st;
      }
      Reply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_ERROR) {
        ctx_.reset();  // the rest of the pipeline is still queued: drop the connection
        return error_status("wait", n, std::string_view(r->str, r->len));
      }
      if (r->type == REDIS_REPLY_INTEGER && r->integer > 0) missing.erase(n);
    }
    return Status::Ok();
  }

  Status ensure_connected() {
    if (ctx_) return Status::Ok();
    const auto deadline = Clock::now() + options_.connect_timeout;
    auto backoff = Millis{5};
    Status last;
    while (true) {
      Status st = connect_once(deadline);
      if (st.ok()) return st;
      if (st.code() == StatusCode::kPermissionDenied) return st;
      last = st;
      if (Clock::now() + backoff >= deadline) break;
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, Millis{200});
    }
    return unavailable("store: cannot reach {} within {} ms: {}", url_.to_string(), options_.connect_timeout.count(),
                       last.message());
  }

  Status connect_once(Clock::time_point deadline) {
    auto left = std::max(Millis{1}, std::chrono::duration_cast<Millis>(deadline - Clock::now()));
    Context c(redisConnectWithTimeout(url_.host.c_str(), url_.port, to_timeval(left)));
    if (!c) return unavailable("store: cannot allocate a redis context");
    if (c->err) return unavailable("store: connect to redis: {}", c->errstr);
    if (redisSetTimeout(c.get(), to_timeval(options_.io_timeout)) != REDIS_OK) {
      return unavailable("store: redis: cannot set the socket timeout");
    }
    ctx_ = std::move(c);
    Result<Reply> auth = run("auth", "", {"AUTH", token_});
    if (!auth.ok()) {
      ctx_.reset();
      if (auth.status().code() == StatusCode::kInternal) {
        // e.g. "ERR AUTH <password> called without any password configured"
        return permission_denied("store: redis refused AUTH: {}", auth.status().message());
      }
      return auth.status();
    }
    return Status::Ok();
  }

  const StoreUrl url_;
  const StoreOptions options_;
  const std::string token_;
  std::string key_prefix_;
  std::mutex mu_;
  Context ctx_;
};

}  // namespace

Result<std::unique_ptr<Store>> open_redis_store(const StoreUrl& url, const StoreOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::string token, resolve_token(options.token, url.token));
  auto s = std::make_unique<RedisStore>(url, options, std::move(token));
  FERRY_RETURN_IF_ERROR(s->connect());
  return std::unique_ptr<Store>(std::move(s));
}

}  // namespace ferry::store_detail
