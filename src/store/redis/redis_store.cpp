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
//
// Replies are read with a bound: hiredis 0.14 buffers a reply until it is whole and has
// no limit of its own, so read_reply() stops a reply whose unparsed bytes pass
// kMaxReplyBytes (a hostile or confused server cannot make the client buffer without
// end), and the size of every value returned is checked against the store's limits.
#include <hiredis.h>
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "store/backends.h"
#include "store/common.h"
#include "store/redis/replies.h"

namespace ferry::store_detail {

namespace {

namespace replies = redis_replies;
using replies::error_status;
using replies::kMaxReplyBytes;
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

class RedisStore final : public Store {
 public:
  RedisStore(StoreUrl url, StoreOptions options, std::string token)
      : url_(std::move(url)), options_(std::move(options)), token_(std::move(token)) {
    // PREFIX//key: a prefix has no empty segment (parse_store_url), so the first "//" of a
    // stored key ends its prefix, and stores of prefixes x and x/j share no key (with
    // "x/" they did: x's "j/instance/..." was x/j's "instance/...", issue 49).
    if (!url_.prefix.empty()) key_prefix_ = url_.prefix + "//";
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
    return checked(replies::get(*r, key));
  }

  Result<int64_t> add(std::string_view key, int64_t delta) override {
    FERRY_RETURN_IF_ERROR(check_key("add", key));
    const std::string k = full(key), d = std::to_string(delta);
    FERRY_ASSIGN_OR_RETURN(Reply r, command("add", key, {"INCRBY", k, d}));
    return checked(replies::integer(*r, "add", key));
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
    return checked(replies::compare_set(*r, key));
  }

  Result<bool> remove(std::string_view key) override {
    FERRY_RETURN_IF_ERROR(check_key("remove", key));
    const std::string k = full(key);
    FERRY_ASSIGN_OR_RETURN(Reply r, command("remove", key, {"DEL", k}));
    FERRY_ASSIGN_OR_RETURN(int64_t n, checked(replies::integer(*r, "remove", key)));
    return n > 0;
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
      FERRY_ASSIGN_OR_RETURN(replies::ScanPage page, checked(replies::scan_page(*r, key_prefix_)));
      cursor = std::move(page.cursor);
      for (auto& k : page.keys) keys.insert(std::move(k));
    } while (cursor != "0");
    return std::vector<std::string>(keys.begin(), keys.end());
  }

  Status wait(const std::vector<std::string>& keys, Millis timeout) override {
    FERRY_RETURN_IF_ERROR(check_wait(keys.size(), timeout.count()));
    for (const auto& k : keys) FERRY_RETURN_IF_ERROR(check_key("wait", k));
    std::set<std::string> missing(keys.begin(), keys.end());
    const size_t total = missing.size();
    const auto start = Clock::now();
    const auto deadline = start + timeout;
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
                             std::chrono::duration_cast<Millis>(now - start).count(), shown);
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
    FERRY_ASSIGN_OR_RETURN(int64_t n, checked(replies::integer(*r, "renew", key)));
    if (n == 0) return not_found("store renew {}: no such key (expired or deleted)", quote_key(key));
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

  // A decoded reply; an unexpected one also drops the connection (not to be trusted any
  // more: the next call reconnects).
  template <typename T>
  Result<T> checked(Result<T> decoded) {
    if (!decoded.ok() && decoded.status().code() == StatusCode::kPeerFailed) {
      std::lock_guard<std::mutex> lock(mu_);
      ctx_.reset();
    }
    return decoded;
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
    if (redisAppendCommandArgv(ctx_.get(), static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
      Status st = transport_error(op);
      ctx_.reset();
      return st;
    }
    FERRY_RETURN_IF_ERROR(flush(op));
    FERRY_ASSIGN_OR_RETURN(Reply r, read_reply(op));
    return check_reply(op, key, std::move(r));
  }

  // Sends what redisAppendCommand* queued.
  Status flush(std::string_view op) {
    int done = 0;
    while (!done) {
      if (redisBufferWrite(ctx_.get(), &done) != REDIS_OK) {
        Status st = transport_error(op);
        ctx_.reset();
        return st;
      }
    }
    return Status::Ok();
  }

  // One reply, read as redisGetReply does but refusing to buffer more than
  // kMaxReplyBytes of it.
  Result<Reply> read_reply(std::string_view op) {
    void* raw = nullptr;
    while (true) {
      if (redisGetReplyFromReader(ctx_.get(), &raw) != REDIS_OK) break;
      if (raw != nullptr) return Reply(static_cast<redisReply*>(raw));
      const redisReader* rd = ctx_->reader;
      if (rd->len - rd->pos > kMaxReplyBytes) {
        ctx_.reset();
        return peer_failed("store {} ({}): redis sent a reply of over {} bytes; refused", op, url_.to_string(),
                           kMaxReplyBytes);
      }
      if (redisBufferRead(ctx_.get()) != REDIS_OK) break;
    }
    Status st = transport_error(op);
    ctx_.reset();
    return st;
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
    FERRY_RETURN_IF_ERROR(flush("wait"));
    for (const auto& n : names) {
      FERRY_ASSIGN_OR_RETURN(Reply r, read_reply("wait"));
      if (r->type == REDIS_REPLY_ERROR) {
        ctx_.reset();  // the rest of the pipeline is still queued: drop the connection
        return error_status("wait", n, std::string_view(r->str, r->len));
      }
      if (r->type == REDIS_REPLY_INTEGER && r->integer > 0) missing.erase(n);
    }
    return Status::Ok();
  }

  Status ensure_connected() {
    // A connection with no command in flight that is readable has been closed by the
    // server (a restarted or killed redis-server; its timeout): replace it before
    // sending, as the TCP client does, so that the first call after a restart is not
    // failed for nothing. Nothing was sent on it, so this is safe for every op.
    if (ctx_ && ctx_->fd >= 0) {
      pollfd p{ctx_->fd, POLLIN, 0};
      if (::poll(&p, 1, 0) != 0) ctx_.reset();
    }
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
    replies::bound_reader(c->reader);  // no array header allocates gigabytes
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
