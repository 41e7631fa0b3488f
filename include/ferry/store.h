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
//  * Tokens. Every connection is authenticated with a shared token of at least
//    kMinTokenBytes bytes: the first of StoreOptions::token, the URL's TOKEN, the
//    FERRY_TOKEN environment variable, the file named by FERRY_TOKEN_FILE (see
//    read_token_file). None of them set, or a shorter token, is InvalidArgument naming
//    the length. Prefer the environment or a file to a URL or argv: those show in `ps`.
//    The TCP store authenticates both ways (the client checks the server too) and
//    protects every later frame with an HMAC (src/store/tcp/protocol.h); Redis uses AUTH.
//  * Connections. `open` connects and authenticates eagerly (retrying a refused
//    connection until StoreOptions::connect_timeout, so clients may start before the
//    server), so a wrong token or a dead server is reported by `open`. When a call
//    fails with Unavailable or Timeout the connection is dropped and the *next* call
//    reconnects; the failed call itself is not retried (it may or may not have been
//    applied — `add` in particular is not idempotent). A TCP connection the server
//    would drop for idleness (StoreServerOptions::idle_timeout, announced in the
//    handshake) is replaced before the next call is sent, so an idle client never sees
//    that drop as an error.
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
// Shortest token the store accepts (client and server, both backends): 16 bytes, e.g.
// `openssl rand -hex 16` (32 characters, 128 bits).
inline constexpr size_t kMinTokenBytes = 16;

// Reads a token from a file: the whole file, less one trailing "\n" or "\r\n".
// NotFound/IoError naming the file when it cannot be read; InvalidArgument when it is
// empty, shorter than kMinTokenBytes, or over 4096 bytes.
Result<std::string> read_token_file(const std::string& path);

struct StoreOptions {
  // Shared secret; empty means: the URL's token, else FERRY_TOKEN, else FERRY_TOKEN_FILE.
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

  // hold_lease, but only when `key` is absent (one compare_set): a lease another holder
  // keeps alive is never taken over, so at most one holder at a time, across processes
  // and hosts. `value` names the claimant and should be unique to it (a key that already
  // holds exactly `value` is taken as this claimant's own). AlreadyExists naming the key
  // and quoting the holder's value when it is held (the value in *holder, when given);
  // other errors as compare_set. A holder that dies lets the key lapse within `ttl`: a
  // successor retries until then.
  Result<std::unique_ptr<Lease>> claim_lease(std::string_view key, std::string_view value, Millis ttl,
                                             std::string* holder = nullptr);

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

  // A renewal that finds the key gone (it expired while the holder or the store was
  // paused — a GC, a swap, a busy host, a Redis fsync — or a restarted store lost it)
  // re-creates it with the same value, but only if it is still absent (compare_set):
  // the holder is alive again and rejoins. reacquired() counts those. If someone else
  // wrote the key meanwhile (a restarted instance of the same rank took over), the lease
  // is lost for good: lost() turns true, the heartbeat stops and the key is left alone.
  bool lost() const { return lost_.load(); }
  uint64_t reacquired() const { return reacquired_.load(); }

  // The last renewal's error (OK if it succeeded, or none ran yet); renewals keep
  // retrying transient errors.
  Status last_error() const;

  // Replaces the key's value (a holder publishing what changed, e.g. the version it
  // serves) while it is still ours; renewals keep the new value from then on. An
  // expired key is re-created with it, as a renewal would. kFailedPrecondition when the
  // lease is released or lost (another holder's value is left alone), the store's error
  // otherwise (the old value then stays).
  Status update(std::string value);

  // Stops the heartbeat and deletes the key (unless lost, or the store was unreachable
  // at the last renewal: the key then lapses within its ttl by itself). Idempotent. May
  // wait for a renewal in flight, which the store's timeouts bound (connect_timeout +
  // io_timeout when the store is unreachable).
  Status release();

 private:
  friend class Store;
  Lease(std::unique_ptr<Store> store, std::string key, std::string value, Millis ttl);
  void heartbeat();

  std::unique_ptr<Store> store_;
  std::string key_;
  std::string value_;                   // mu_
  std::optional<std::string> pending_;  // mu_: update() between its write and value_
  std::mutex update_mu_;                // one update() at a time
  Millis ttl_;
  std::atomic<bool> lost_{false};
  std::atomic<uint64_t> reacquired_{0};
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
// Wire protocol (src/store/tcp/protocol.h): length-prefixed binary frames, at most
// 64 MiB (256 bytes before authentication), read into buffers that grow as bytes
// arrive, never to the claimed length. A mutual HMAC-SHA256 challenge-response over
// nonces from both sides, then an HMAC with a sequence number on every frame. A
// malformed or tampered frame closes that client's connection and nothing else.
//
// Unauthenticated connections cannot lock legitimate clients out. They are kept apart
// from authenticated ones and capped (max_unauthenticated in all,
// max_unauthenticated_per_peer per source address); a connection that would exceed a
// cap evicts the *oldest* unauthenticated connection (of that address, else of all),
// and every one is dropped at handshake_timeout. A real client answers the challenge
// in one round trip, so it is evicted only when more than the cap of connections from
// its address arrive within its round trip; an idle flood is churned through instead
// of filling the server. (All local clients share 127.0.0.1, so refusing new
// connections at a per-address cap would lock local clients out; evicting the oldest
// does not. Evicting silent connections first would not help: a flood can send one
// byte to look busy.) A client evicted mid-handshake sees Unavailable and retries.
struct StoreServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port (see StoreServer::port)
  std::string token;  // empty: FERRY_TOKEN, then FERRY_TOKEN_FILE; none is InvalidArgument
  // How long a new connection may take to authenticate. 2 s: a client answers within
  // one round trip plus two HMACs (well under 100 ms even across a WAN, and the client
  // retries a dropped attempt), while a silent socket holds a slot only briefly.
  Millis handshake_timeout{2000};
  // An authenticated connection with no request for this long is closed (0: never).
  // Clients learn it in the handshake and reconnect before it, and leases renew every
  // ttl/3, so only abandoned connections are dropped.
  Millis idle_timeout{300000};
  // Authenticated connections; one more is refused with Unavailable.
  size_t max_connections = 4096;
  size_t max_unauthenticated = 1024;
  size_t max_unauthenticated_per_peer = 256;
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
  // Number of open client connections, authenticated or not (for tests and monitoring).
  size_t connections() const;
  // Connections closed to make room for a newer unauthenticated one (see above).
  size_t evicted() const;
  // Handshakes refused for a wrong token proof. An address that sent one waits before
  // its next proofs are checked, 10 ms doubling with each further one up to 500 ms
  // (forgotten after 10 s without one), which bounds guessing from one address to
  // max_unauthenticated_per_peer / 0.5 s proofs a second; each address's wrong proofs
  // are logged on stderr at most once per 10 s.
  size_t refused_proofs() const;
  // Closes every connection and joins the event-loop thread. Idempotent; thread-safe.
  void stop();

  struct Impl;

 private:
  explicit StoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
