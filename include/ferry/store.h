// ferry/store.h — rendezvous and membership: a small, authenticated key-value store.
//
// Ranks find each other through a Store: they publish their addresses and remote keys
// under agreed names, `wait` for the names of their peers, count arrivals with `add`,
// elect with `compare_set`, and advertise liveness with leases (keys with a
// time-to-live that a heartbeat keeps renewing).
//
// Backends, chosen by URL (Store::open):
//   tcp://[:TOKEN@]HOST:PORT               ferry's embedded store (StoreServer below, or
//                                          `ferry store --port P`); the default.
//   redis://[:TOKEN@]HOST:PORT[/PREFIX]    a real redis-server (hiredis). With a PREFIX
//                                          every key is stored as "PREFIX/key" and `list`
//                                          strips it again, so several jobs can share
//                                          one Redis.
//
// Contract (both backends behave the same; the shared test suite holds them to it):
//
//  * Errors. Nothing throws. Every call returns Status or Result<T>:
//      NotFound          get/renew of a key that does not exist (or has expired);
//      InvalidArgument   empty or oversize key, oversize value, negative ttl/timeout,
//                        `add` on a value that is not a canonical decimal int64, bad URL;
//      OutOfRange        `add` would overflow int64;
//      Timeout           `wait` ran out, or the server did not answer within
//                        StoreOptions::io_timeout;
//      Unavailable       cannot connect, or the connection broke mid-call;
//      PermissionDenied  the token was refused;
//      PeerFailed        the server broke the protocol.
//  * Tokens. Every connection is authenticated with a shared token: the first of
//    StoreOptions::token, the URL's TOKEN, the FERRY_TOKEN environment variable. None of
//    them set is InvalidArgument. The TCP store answers a server nonce with
//    HMAC-SHA256(token, nonce) (the token never crosses the wire); Redis uses AUTH.
//  * Connections. `open` connects and authenticates eagerly (retrying a refused
//    connection until StoreOptions::connect_timeout, so clients may start before the
//    server), so a wrong token or a dead server is reported by `open`. When a call
//    fails with Unavailable or Timeout the connection is dropped and the *next* call
//    reconnects; the failed call itself is not retried (it may or may not have been
//    applied — `add` in particular is not idempotent).
//  * Threading. A Store is thread-safe: any number of threads may share one. Calls on
//    one Store are serialised on its single connection, so a blocking `wait` on the
//    TCP backend holds that connection until it returns; give threads that wait
//    concurrently their own connection with `clone()`. Leases always use their own
//    connection, so a heartbeat never queues behind a wait.
//  * Timeouts. Every call is bounded: a request/response exchange by io_timeout,
//    `wait` by its timeout plus io_timeout, and a call that must reconnect first by
//    connect_timeout more. Nothing in this API blocks forever.
//  * Values are arbitrary bytes (NULs allowed) up to kMaxValueBytes; keys are 1 to
//    kMaxKeyBytes bytes. Counters (`add`) are stored as decimal text, so `get` of a
//    counter returns e.g. "42", and `add` on a key absent starts at 0.
//  * Time-to-live. A key written with ttl > 0 disappears ttl after the set,
//    compare_set or renew that last gave it a ttl; an expired key is absent for every op. `set`/`compare_set` with ttl 0 make
//    the key persistent again; `add` keeps an existing ttl (as Redis INCRBY does).
//  * Ownership. Store::open returns a unique_ptr; destroying it closes the connection.
//    A Lease owns its own connection and may outlive the Store it was made from.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ferry/status.h"

namespace ferry {

using Millis = std::chrono::milliseconds;

inline constexpr size_t kMaxKeyBytes = 4096;
inline constexpr size_t kMaxValueBytes = size_t{32} << 20;  // 32 MiB
inline constexpr size_t kMaxWaitKeys = 65536;
inline constexpr Millis kMaxTtl = std::chrono::hours(24 * 30);
inline constexpr Millis kMaxWaitTimeout = std::chrono::hours(24);

struct StoreOptions {
  // Shared secret; empty means: the URL's token, else FERRY_TOKEN.
  std::string token;
  // How long `open` (and a reconnect) keeps retrying a refused or unreachable server.
  Millis connect_timeout{10000};
  // Bound on one request/response exchange (plus the timeout of a `wait`).
  Millis io_timeout{30000};
};

// A parsed store URL. Exposed for tests and tools; Store::open parses for you.
struct StoreUrl {
  enum class Scheme { kTcp, kRedis };
  Scheme scheme = Scheme::kTcp;
  std::string host;
  uint16_t port = 0;
  std::string token;   // may be empty
  std::string prefix;  // redis only; may be empty
  // The URL without its token (safe to log).
  std::string to_string() const;
};
Result<StoreUrl> parse_store_url(std::string_view url);

struct CompareSetResult {
  bool swapped = false;
  // The key's value after the call: `desired` when swapped, else the current value
  // (nullopt: the key does not exist).
  std::optional<std::string> value;
};

class Lease;

class Store {
 public:
  // Opens a connection to the store named by `url` (see the top of this file).
  static Result<std::unique_ptr<Store>> open(std::string_view url, const StoreOptions& options = {});

  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Writes `value` under `key`; ttl > 0 makes it expire ttl from now, ttl 0 never.
  virtual Status set(std::string_view key, std::string_view value, Millis ttl = Millis{0}) = 0;

  // The value of `key`; NotFound when absent or expired.
  virtual Result<std::string> get(std::string_view key) = 0;

  // Atomically adds `delta` to the decimal counter at `key` (absent counts as 0) and
  // returns the new value.
  virtual Result<int64_t> add(std::string_view key, int64_t delta) = 0;

  // Atomically: if the key's current state matches `expected` (nullopt: the key must be
  // absent; a value: it must equal that value), write `desired` (with `ttl` as in set).
  // Not swapping is not an error; see CompareSetResult.
  virtual Result<CompareSetResult> compare_set(std::string_view key,
                                               std::optional<std::string_view> expected,
                                               std::string_view desired,
                                               Millis ttl = Millis{0}) = 0;

  // Deletes `key`; true when it existed.
  virtual Result<bool> remove(std::string_view key) = 0;

  // Every live key that starts with `prefix` ("" lists all), sorted bytewise. The TCP
  // store answers OutOfRange when the keys would not fit one 64 MiB frame.
  virtual Result<std::vector<std::string>> list(std::string_view prefix) = 0;

  // Blocks until every key in `keys` has been seen to exist at some moment since the
  // call began (keys need not exist simultaneously), or `timeout` passes: Timeout, with
  // the missing keys named. An empty `keys` returns OK at once. The TCP store is woken
  // by the write itself; the Redis backend polls (1 ms backoff up to 50 ms), so there a
  // key that exists only for a few milliseconds may be missed.
  virtual Status wait(const std::vector<std::string>& keys, Millis timeout) = 0;

  // Resets the time-to-live of an existing key to `ttl` (> 0) from now; NotFound when
  // the key is absent or has already expired.
  virtual Status renew(std::string_view key, Millis ttl) = 0;

  // A new, independent connection to the same store with the same options.
  virtual Result<std::unique_ptr<Store>> clone() const = 0;

  // The URL this store was opened with, without its token.
  virtual std::string url() const = 0;

  // Writes `key` = `value` with `ttl` and keeps renewing it (every ttl/3) from a
  // heartbeat thread on a connection of its own, until the Lease is released or
  // destroyed. Use it to advertise liveness: the key disappears ttl after the holder
  // dies or hangs.
  Result<std::unique_ptr<Lease>> hold_lease(std::string_view key, std::string_view value,
                                            Millis ttl) const;

 protected:
  Store() = default;
};

// A key kept alive by a heartbeat thread. Thread-safe.
class Lease {
 public:
  ~Lease();  // release(), ignoring its status
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  const std::string& key() const { return key_; }

  // True once a renewal found the key gone (it expired because the heartbeat was
  // starved for longer than the ttl, or someone deleted it). A lost lease stops its
  // heartbeat and is never re-created: others may already have declared us dead.
  bool lost() const { return lost_.load(); }

  // The last error a renewal hit (OK if none); renewals keep retrying transient errors.
  Status last_error() const;

  // Stops the heartbeat and deletes the key (unless lost). Idempotent. May wait for a
  // renewal in flight, which the store's timeouts bound (connect_timeout + io_timeout
  // when the store is unreachable).
  Status release();

 private:
  friend class Store;
  Lease(std::unique_ptr<Store> store, std::string key, Millis ttl);
  void heartbeat();

  std::unique_ptr<Store> store_;
  std::string key_;
  Millis ttl_;
  std::atomic<bool> lost_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool released_ = false;
  Status last_error_;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------
// The embedded TCP store server: one event-loop thread (standalone asio) serving any
// number of clients. Start it inside any process (e.g. on trainer rank 0) or run
// `ferry store --port P`. The data lives in memory and dies with the server.
//
// Wire protocol: length-prefixed binary frames (u32 little-endian payload length, then
// the payload), at most 64 MiB (256 bytes before authentication). A malformed frame
// closes that client's connection and nothing else. A client that has not answered the
// challenge within handshake_timeout is dropped.
struct StoreServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port (see StoreServer::port)
  std::string token;  // empty: FERRY_TOKEN; both empty is InvalidArgument
  Millis handshake_timeout{10000};
  size_t max_connections = 4096;
};

class StoreServer {
 public:
  // Binds, listens and starts the event-loop thread. IoError if the address is taken.
  static Result<std::unique_ptr<StoreServer>> start(const StoreServerOptions& options);

  ~StoreServer();  // stop()
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  uint16_t port() const;
  // "tcp://HOST:PORT" (no token), what clients pass to Store::open.
  std::string url() const;
  // Number of open client connections (for tests and monitoring).
  size_t connections() const;
  // Closes every connection and joins the event-loop thread. Idempotent; thread-safe.
  void stop();

  struct Impl;

 private:
  explicit StoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
