// Store front end: URL parsing, argument checks shared by the backends, open(), Lease.
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/token_rule.h"
#include "store/backends.h"
#include "store/common.h"

namespace ferry {

namespace store_detail {

std::string quote_key(std::string_view key) {
  constexpr size_t kShown = 64;
  std::string out = "'";
  for (size_t i = 0; i < key.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  out += "'";
  if (key.size() > kShown) out += fmt::format(" (+{} bytes)", key.size() - kShown);
  return out;
}

Status check_key(std::string_view op, std::string_view key) {
  if (key.empty()) return invalid_argument("store {}: empty key", op);
  if (key.size() > kMaxKeyBytes) {
    return invalid_argument("store {}: key {} is {} bytes, over the limit of {}", op, quote_key(key),
                            key.size(), kMaxKeyBytes);
  }
  return Status::Ok();
}

Status check_value(std::string_view op, std::string_view key, std::string_view value) {
  if (value.size() > kMaxValueBytes) {
    return invalid_argument("store {} {}: value is {} bytes, over the limit of {}", op, quote_key(key),
                            value.size(), kMaxValueBytes);
  }
  return Status::Ok();
}

Status check_ttl(std::string_view op, std::string_view key, int64_t ttl_ms, bool positive) {
  if (ttl_ms < 0 || ttl_ms > kMaxTtl.count() || (positive && ttl_ms == 0)) {
    return invalid_argument("store {} {}: ttl {} ms is outside [{}, {}] ms", op, quote_key(key), ttl_ms,
                            positive ? 1 : 0, kMaxTtl.count());
  }
  return Status::Ok();
}

Status check_wait(size_t nkeys, int64_t timeout_ms) {
  if (nkeys > kMaxWaitKeys) {
    return invalid_argument("store wait: {} keys, over the limit of {}", nkeys, kMaxWaitKeys);
  }
  if (timeout_ms < 0 || timeout_ms > kMaxWaitTimeout.count()) {
    return invalid_argument("store wait: timeout {} ms is outside [0, {}] ms", timeout_ms,
                            kMaxWaitTimeout.count());
  }
  return Status::Ok();
}

std::optional<int64_t> parse_counter(std::string_view text) {
  if (text.empty() || text.size() > 20) return std::nullopt;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  // Canonical form only: no leading zeros, no "-0".
  if (std::to_string(v) != text) return std::nullopt;
  return v;
}

Status check_token(std::string_view token, std::string_view from) {
  if (auto weak = token_weakness(token, kMinTokenBytes))
    return invalid_argument("store: the token (from {}) is {} (e.g. `openssl rand -hex 16`)", from, *weak);
  return Status::Ok();
}

Result<std::string> resolve_token(const std::string& explicit_token, const std::string& url_token) {
  std::string token, from;
  if (!explicit_token.empty()) {
    token = explicit_token;
    from = "the options";
  } else if (!url_token.empty()) {
    token = url_token;
    from = "the URL";
  } else if (const char* env = std::getenv("FERRY_TOKEN"); env != nullptr && env[0] != '\0') {
    token = env;
    from = "FERRY_TOKEN";
  } else if (const char* file = std::getenv("FERRY_TOKEN_FILE"); file != nullptr && file[0] != '\0') {
    FERRY_ASSIGN_OR_RETURN(token, read_token_file(file));
    return token;
  } else {
    return invalid_argument(
        "store: no token: pass one in StoreOptions::token or the URL (scheme://:TOKEN@host:port), or set "
        "FERRY_TOKEN or FERRY_TOKEN_FILE");
  }
  FERRY_RETURN_IF_ERROR(check_token(token, from));
  return token;
}

namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

Result<std::string> percent_decode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size()) {
      return invalid_argument("store url: truncated %-escape");
    }
    const int hi = hex_value(s[i + 1]), lo = hex_value(s[i + 2]);
    if (hi < 0 || lo < 0) return invalid_argument("store url: bad %-escape");
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

}  // namespace
}  // namespace store_detail

Result<std::string> read_token_file(const std::string& path) {
  constexpr size_t kMaxTokenFileBytes = 4096;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    if (err == ENOENT) return not_found("store: token file '{}' does not exist", path);
    return io_error("store: cannot open token file '{}': {}", path, std::strerror(err));
  }
  std::string text(kMaxTokenFileBytes + 1, '\0');
  const size_t n = std::fread(text.data(), 1, text.size(), f);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return io_error("store: cannot read token file '{}'", path);
  if (n > kMaxTokenFileBytes) {
    return invalid_argument("store: token file '{}' is over {} bytes; it should hold only the token", path,
                            kMaxTokenFileBytes);
  }
  text.resize(n);
  if (text.ends_with("\n")) text.pop_back();
  if (text.ends_with("\r")) text.pop_back();
  if (text.empty()) return invalid_argument("store: token file '{}' is empty", path);
  FERRY_RETURN_IF_ERROR(store_detail::check_token(text, fmt::format("file '{}'", path)));
  return text;
}

std::string StoreUrl::to_string() const {
  const bool v6 = host.find(':') != std::string::npos;
  std::string out = fmt::format("{}://{}{}{}:{}", scheme == Scheme::kTcp ? "tcp" : "redis", v6 ? "[" : "",
                                host, v6 ? "]" : "", port);
  if (!prefix.empty()) out += "/" + prefix;
  return out;
}

Result<StoreUrl> parse_store_url(std::string_view url) {
  StoreUrl u;
  std::string_view rest;
  const auto bad = [&](std::string_view why) {
    // Never echo the URL itself: it may carry the token.
    return invalid_argument("store url: {} (expected tcp://[:TOKEN@]HOST:PORT or "
                            "redis://[:TOKEN@]HOST:PORT[/PREFIX])",
                            why);
  };
  if (url.starts_with("tcp://")) {
    u.scheme = StoreUrl::Scheme::kTcp;
    rest = url.substr(6);
  } else if (url.starts_with("redis://")) {
    u.scheme = StoreUrl::Scheme::kRedis;
    rest = url.substr(8);
  } else {
    return bad("unknown scheme");
  }
  std::string_view authority = rest, path;
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    authority = rest.substr(0, slash);
    path = rest.substr(slash + 1);
  }
  if (auto at = authority.rfind('@'); at != std::string_view::npos) {
    std::string_view userinfo = authority.substr(0, at);
    authority = authority.substr(at + 1);
    if (userinfo.empty() || userinfo[0] != ':') return bad("credentials must be ':TOKEN' (no user name)");
    FERRY_ASSIGN_OR_RETURN(u.token, store_detail::percent_decode(userinfo.substr(1)));
  }
  std::string_view host, port;
  if (authority.starts_with("[")) {
    auto close = authority.find(']');
    if (close == std::string_view::npos) return bad("unterminated '[' in host");
    host = authority.substr(1, close - 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.starts_with(":")) return bad("missing port");
    port = after.substr(1);
  } else {
    auto colon = authority.rfind(':');
    if (colon == std::string_view::npos) return bad("missing port");
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
  }
  if (host.empty()) return bad("missing host");
  unsigned p = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || p == 0 || p > 65535) {
    return bad(fmt::format("bad port '{}'", port));
  }
  u.host = std::string(host);
  u.port = static_cast<uint16_t>(p);
  if (!path.empty()) {
    if (u.scheme == StoreUrl::Scheme::kTcp) return bad("tcp:// URLs take no path");
    if (path.find_first_of("?#") != std::string_view::npos) return bad("query strings are not supported");
    while (path.ends_with("/")) path.remove_suffix(1);
    if (path.starts_with("/") || path.find("//") != std::string_view::npos)
      return bad(fmt::format("prefix '{}' has an empty segment (\"//\": it ends a prefix in the keys stored)", path));
    u.prefix = std::string(path);
  }
  return u;
}

Result<std::unique_ptr<Store>> Store::open(std::string_view url, const StoreOptions& options) {
  FERRY_ASSIGN_OR_RETURN(StoreUrl u, parse_store_url(url));
  if (options.connect_timeout.count() < 0 || options.io_timeout.count() <= 0) {
    return invalid_argument("store open: timeouts must be positive");
  }
  if (u.scheme == StoreUrl::Scheme::kTcp) return store_detail::open_tcp_store(u, options);
  return store_detail::open_redis_store(u, options);
}

// --- Lease ------------------------------------------------------------------------

Result<std::unique_ptr<Lease>> Store::hold_lease(std::string_view key, std::string_view value,
                                                 Millis ttl) const {
  FERRY_RETURN_IF_ERROR(store_detail::check_key("hold_lease", key));
  FERRY_RETURN_IF_ERROR(store_detail::check_ttl("hold_lease", key, ttl.count(), true));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Store> own, clone());
  FERRY_RETURN_IF_ERROR(own->set(key, value, ttl));
  return std::unique_ptr<Lease>(new Lease(std::move(own), std::string(key), std::string(value), ttl));
}

Result<std::unique_ptr<Lease>> Store::claim_lease(std::string_view key, std::string_view value, Millis ttl,
                                                  std::string* holder) {
  FERRY_RETURN_IF_ERROR(store_detail::check_key("claim_lease", key));
  FERRY_RETURN_IF_ERROR(store_detail::check_ttl("claim_lease", key, ttl.count(), true));
  FERRY_ASSIGN_OR_RETURN(CompareSetResult cs, compare_set(key, std::nullopt, value, ttl));
  if (!cs.swapped && cs.value != value) {
    const std::string held = cs.value.value_or("");
    if (holder) *holder = held;
    return already_exists("store claim_lease {}: held by {}", store_detail::quote_key(key),
                          store_detail::quote_key(held));
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Store> own, clone());
  return std::unique_ptr<Lease>(new Lease(std::move(own), std::string(key), std::string(value), ttl));
}

Lease::Lease(std::unique_ptr<Store> store, std::string key, std::string value, Millis ttl)
    : store_(std::move(store)), key_(std::move(key)), value_(std::move(value)), ttl_(ttl) {
  thread_ = std::thread([this] { heartbeat(); });
}

Lease::~Lease() { release().ignore(); }

Status Lease::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

void Lease::heartbeat() {
  const Millis interval = std::max(Millis{5}, ttl_ / 3);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (cv_.wait_for(lock, interval, [this] { return stop_; })) return;
    const std::string value = value_;
    lock.unlock();
    // Renew only while the key is still ours (a plain renew would keep alive the key of
    // a restarted instance that took the rank over); re-create it if it expired while
    // we or the store were paused (see lost()).
    Result<CompareSetResult> cs = store_->compare_set(key_, value, value, ttl_);
    bool healed = false;
    if (cs.ok() && !cs->swapped && !cs->value) {
      cs = store_->compare_set(key_, std::nullopt, value, ttl_);
      healed = true;
    }
    lock.lock();
    if (!cs.ok()) {  // transient (the store is away): retry
      last_error_ = cs.status();
      continue;
    }
    last_error_ = Status::Ok();  // (reachable again)
    if (cs->swapped) {
      if (healed) reacquired_.fetch_add(1);
      continue;
    }
    // Ours after all: re-created by a racing renewal, or an update() wrote it meanwhile.
    if (cs->value == value_ || (pending_ && cs->value == *pending_)) continue;
    last_error_ = failed_precondition("lease '{}' was taken over by another holder", key_);
    lost_.store(true);
    return;
  }
}

Status Lease::update(std::string value) {
  std::lock_guard<std::mutex> one(update_mu_);
  std::string old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_ || lost_.load()) return failed_precondition("lease '{}' is {}", key_, released_ ? "released" : "lost");
    if (value == value_) return Status::Ok();
    old = value_;
    pending_ = value;
  }
  Result<CompareSetResult> cs = store_->compare_set(key_, old, value, ttl_);
  if (cs.ok() && !cs->swapped && !cs->value) cs = store_->compare_set(key_, std::nullopt, value, ttl_);
  std::lock_guard<std::mutex> lock(mu_);
  pending_.reset();
  if (!cs.ok()) return cs.status().with_context(fmt::format("updating lease '{}'", key_));
  if (!cs->swapped && cs->value != value) {
    last_error_ = failed_precondition("lease '{}' was taken over by another holder", key_);
    lost_.store(true);
    return last_error_;
  }
  value_ = std::move(value);
  return Status::Ok();
}

Status Lease::release() {
  std::lock_guard<std::mutex> one(update_mu_);  // (an update in flight finishes first)
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return Status::Ok();
    released_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (lost_.load()) return Status::Ok();
  {
    // The store was unreachable at the last renewal: the key lapses within its ttl by
    // itself, and asking a store that is gone would wait out its connect timeout twice
    // (a rank closed after the job's store stopped waited 40 s, seen in Python).
    std::lock_guard<std::mutex> lock(mu_);
    if (!last_error_.ok()) return Status::Ok();
  }
  // Not another holder's key (one that took over since the last renewal).
  if (Result<std::string> v = store_->get(key_); v.ok() && *v != value_) return Status::Ok();
  Result<bool> r = store_->remove(key_);
  return r.status().with_context("releasing lease");
}

}  // namespace ferry
