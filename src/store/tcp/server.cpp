// The embedded TCP store server: one standalone-asio event loop on one thread.
//
// All store state lives on the event-loop thread, so it needs no locks. Each connection
// is a Session that reads one frame, answers it, and reads the next (a client has at
// most one request in flight). A `wait` that cannot be answered at once parks the
// session as a Waiter, registered under each missing key, with a timer for its timeout;
// while parked the session watches its socket so a client that hangs up is dropped at
// once rather than when its wait runs out.
//
// Admission (see StoreServerOptions in ferry/store.h for the policy and why): a new
// connection is *pending* until it authenticates. Pending sessions are kept in accept
// order, in all and per source address; a newcomer that would exceed a cap evicts the
// oldest pending session (of its address first). Each session has one deadline timer:
// before authentication the handshake deadline, after it the idle timeout (re-armed
// with every answer sent, off while a `wait` is parked).
#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <chrono>
#include <list>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <asio.hpp>

#include "ferry/store.h"
#include "store/common.h"
#include "store/tcp/protocol.h"

namespace ferry {

using store_tcp::Bytes;
using store_tcp::ByteSpan;
using store_tcp::Op;
using store_tcp::Request;
using store_tcp::Response;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

class Session;

struct Waiter {
  explicit Waiter(asio::io_context& io) : timer(io) {}
  std::weak_ptr<Session> session;
  std::unordered_set<std::string> missing;
  size_t total = 0;
  int64_t timeout_ms = 0;
  Clock::time_point start;  // when the wait began: its error says how long it really waited
  asio::steady_timer timer;
  bool done = false;
};

struct Entry {
  std::string value;
  std::optional<Clock::time_point> deadline;
};

}  // namespace

struct StoreServer::Impl {
  // State first: it must outlive the io_context (handlers own Sessions that touch it).
  StoreServerOptions options;
  std::string token;
  std::map<std::string, Entry, std::less<>> data;
  std::set<std::pair<Clock::time_point, std::string>> expiry;
  std::unordered_map<std::string, std::vector<std::weak_ptr<Waiter>>> waiters;
  std::unordered_set<Session*> sessions;
  // Unauthenticated sessions, oldest first: all of them, and per source address.
  std::list<Session*> pending;
  std::unordered_map<std::string, std::list<Session*>> pending_by_peer;
  size_t authenticated = 0;
  std::atomic<size_t> connection_count{0};
  std::atomic<size_t> evicted_count{0};
  // Wrong proofs (a wrong token, or guessing), per source address: each one within
  // kStrikeMemory of the last doubles how long that address's next proofs wait before
  // they are checked (kFirstWait up to kMostWait), so guessing from one address is
  // bounded by max_unauthenticated_per_peer / kMostWait proofs a second (newer
  // connections evict the waiting ones first); a line on stderr says so, at most once per
  // kStrikeMemory per address. Event-loop thread, but for the total.
  struct Strikes {
    uint32_t recent = 0;          // wrong proofs in a row, each within kStrikeMemory of the last
    Clock::time_point last{};
    uint64_t unlogged = 0;        // since the last line
    Clock::time_point logged{};
  };
  static constexpr Millis kFirstWait{10}, kMostWait{500}, kStrikeMemory{10000};
  std::unordered_map<std::string, Strikes> strikes;
  std::atomic<size_t> refused_proofs{0};
  // How long a proof from `peer` waits before it is checked now (0: at once).
  Millis proof_wait(const std::string& peer);
  // A wrong proof from `peer`.
  void strike(const std::string& peer);
  bool stopping = false;  // event-loop thread only

  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer sweep_timer{io};
  asio::steady_timer accept_retry{io};
  uint16_t port = 0;
  std::thread thread;
  std::mutex stop_mu;
  bool stopped = false;

  void accept();
  // Evicts the oldest pending session if one from `peer` would exceed a cap.
  void make_room(const std::string& peer);
  void sweep();
  void close_all();

  // --- the store itself (event-loop thread) ---
  Entry* live(std::string_view key);
  void erase(std::map<std::string, Entry, std::less<>>::iterator it);
  void write(std::string_view key, std::string value, int64_t ttl_ms, bool keep_ttl);
  void notify(const std::string& key);
  Response handle(const Request& q);
  // Answers at once (returns the response) or parks the session (returns nullopt).
  std::optional<Response> start_wait(const std::shared_ptr<Session>& s, const Request& q);
  void finish_wait(const std::shared_ptr<Waiter>& w, Response r);
  void unregister(const std::shared_ptr<Waiter>& w);
};

namespace {

Response error_response(Op op, const Status& st) {
  Response r;
  r.op = op;
  r.code = st.code();
  r.message = st.message();
  return r;
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(StoreServer::Impl& srv, tcp::socket sock, std::string peer)
      : srv_(srv), sock_(std::move(sock)), timer_(srv.io), proof_timer_(srv.io), peer_(std::move(peer)) {
    srv_.sessions.insert(this);
    srv_.connection_count.fetch_add(1);
    srv_.pending.push_back(this);
    pending_it_ = std::prev(srv_.pending.end());
    auto& mine = srv_.pending_by_peer[peer_];
    mine.push_back(this);
    peer_it_ = std::prev(mine.end());
    pending_ = true;
  }
  ~Session() {
    leave_pending();
    srv_.sessions.erase(this);
    srv_.connection_count.fetch_sub(1);
  }

  void start() {
    asio::error_code ec;
    sock_.set_option(tcp::no_delay(true), ec);
    store_tcp::Challenge c;
    if (!store_tcp::random_bytes(c.nonce).ok()) return close();
    nonce_ = c.nonce;
    arm(srv_.options.handshake_timeout);
    send(store_tcp::encode_challenge(c), /*close_after=*/false);
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    leave_pending();
    if (authed_) --srv_.authenticated;
    asio::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
    disarm();
    if (waiter_) {
      auto w = std::move(waiter_);
      w->done = true;
      w->timer.cancel();
      srv_.unregister(w);
    }
  }

  // Sends a response; the next request is read once it is written.
  void reply(const Response& r) {
    if (closed_) return;
    if (waiter_) {
      waiter_.reset();
      asio::error_code ec;
      sock_.cancel(ec);  // the hang-up watch of the parked wait
    }
    send(channel_->seal(store_tcp::encode_response(r)), false);
  }

  void park(std::shared_ptr<Waiter> w) {
    waiter_ = std::move(w);
    disarm();  // waiting on the server's behalf is not idleness
    // Readable while parked means the client hung up (or broke the one-request-in-
    // flight rule): either way the connection is done.
    sock_.async_wait(tcp::socket::wait_read,
                     [self = shared_from_this(), w = waiter_](const asio::error_code& ec) {
                       if (ec == asio::error::operation_aborted || w->done) return;
                       self->close();
                     });
  }

 private:
  void leave_pending() {
    if (!pending_) return;
    pending_ = false;
    srv_.pending.erase(pending_it_);
    auto it = srv_.pending_by_peer.find(peer_);
    it->second.erase(peer_it_);
    if (it->second.empty()) srv_.pending_by_peer.erase(it);
  }

  // The one deadline of this session; a later arm() or disarm() supersedes it.
  void arm(Millis after) {
    const uint64_t gen = ++timer_gen_;
    timer_.expires_after(after);
    timer_.async_wait([self = shared_from_this(), gen](const asio::error_code& e) {
      if (e || gen != self->timer_gen_ || self->closed_) return;
      self->close();
    });
  }
  void disarm() {
    ++timer_gen_;
    timer_.cancel();
  }

  void send(Bytes frame, bool close_after) {
    if (authed_ && !close_after) {
      // The idle clock runs from each answer: the client's next request must arrive
      // (whole) within idle_timeout.
      if (srv_.options.idle_timeout.count() > 0) {
        arm(srv_.options.idle_timeout);
      } else {
        disarm();
      }
    }
    out_ = std::move(frame);
    asio::async_write(sock_, asio::buffer(out_),
                      [self = shared_from_this(), close_after](const asio::error_code& ec, size_t) {
                        // closed_: a completion queued before close() still arrives with success.
                        if (ec || close_after || self->closed_) return self->close();
                        self->read_header();
                      });
  }

  void read_header() {
    if (closed_) return;
    asio::async_read(sock_, asio::buffer(header_),
                     [self = shared_from_this()](const asio::error_code& ec, size_t) {
                       if (ec || self->closed_) return self->close();
                       const size_t max =
                           self->authed_ ? store_tcp::kMaxFrameBytes : store_tcp::kMaxHandshakeFrameBytes;
                       Result<size_t> n = store_tcp::decode_frame_header(self->header_, max);
                       if (!n.ok()) return self->close();  // oversize: hang up, allocate nothing
                       self->body_.clear();
                       self->want_ = *n;
                       self->read_body();
                     });
  }

  // Reads the payload in chunks of at most kReadChunkBytes, growing body_ as bytes
  // arrive: a header claiming 64 MiB costs nothing until 64 MiB are actually sent.
  void read_body() {
    const size_t have = body_.size();
    if (have == want_) return on_payload();
    const size_t chunk = std::min(want_ - have, store_tcp::kReadChunkBytes);
    body_.resize(have + chunk);
    sock_.async_read_some(asio::buffer(body_.data() + have, chunk),
                          [self = shared_from_this(), have](const asio::error_code& ec, size_t got) {
                            if (ec || self->closed_) return self->close();
                            self->body_.resize(have + got);
                            self->read_body();
                          });
  }

  void refuse(const Status& st) {
    send(store_tcp::encode_response(error_response(Op::kAuth, st)), /*close_after=*/true);
  }

  void on_handshake() {
    Result<store_tcp::Auth> a = store_tcp::decode_auth(body_);
    body_ = Bytes();
    if (!a.ok()) {
      if (a.status().code() == StatusCode::kFailedPrecondition) return refuse(a.status());
      return close();
    }
    // An address that sent wrong proofs lately waits before its proof is checked (its
    // handshake deadline still runs: the wait is at most a quarter of the 2 s default).
    if (const Millis wait = srv_.proof_wait(peer_); wait.count() > 0) {
      auto held = std::make_shared<store_tcp::Auth>(std::move(*a));
      proof_timer_.expires_after(wait);
      proof_timer_.async_wait([self = shared_from_this(), held](const asio::error_code& e) {
        if (!e && !self->closed_) self->check_proof(*held);
      });
      return;
    }
    check_proof(*a);
  }

  void check_proof(const store_tcp::Auth& a) {
    if (!store_tcp::macs_equal(a.mac, store_tcp::client_proof(srv_.token, nonce_, a.nonce))) {
      srv_.strike(peer_);
      return refuse(permission_denied("store: the server refused the token"));
    }
    if (srv_.authenticated >= srv_.options.max_connections) {
      return refuse(unavailable("store: the server is at its limit of {} authenticated connections "
                                "(max_connections)",
                                srv_.options.max_connections));
    }
    authed_ = true;
    ++srv_.authenticated;
    leave_pending();
    channel_.emplace(store_tcp::session_key(srv_.token, nonce_, a.nonce),
                     store_tcp::Direction::kServerToClient);
    Response welcome;
    welcome.op = Op::kAuth;
    welcome.number = srv_.options.idle_timeout.count();
    send(channel_->seal(store_tcp::encode_response(welcome)), false);
  }

  void on_payload() {
    if (!authed_) return on_handshake();
    Result<ByteSpan> body = channel_->open(body_);
    if (!body.ok()) return close();  // tampered, replayed or reordered: hang up
    Result<Request> q = store_tcp::decode_request(*body);
    body_ = Bytes();
    if (!q.ok()) return close();  // malformed: hang up on this client only
    if (Status st = store_tcp::validate_request(*q); !st.ok()) return reply(error_response(q->op, st));
    if (q->op == Op::kWait) {
      std::optional<Response> r = srv_.start_wait(shared_from_this(), *q);
      if (r) reply(*r);
      return;
    }
    reply(srv_.handle(*q));
  }

  StoreServer::Impl& srv_;
  tcp::socket sock_;
  asio::steady_timer timer_;
  asio::steady_timer proof_timer_;  // a proof held back (StoreServer::Impl::proof_wait)
  uint64_t timer_gen_ = 0;
  const std::string peer_;
  std::list<Session*>::iterator pending_it_, peer_it_;
  bool pending_ = false;
  std::array<uint8_t, store_tcp::kFrameHeaderBytes> header_{};
  size_t want_ = 0;
  Bytes body_;
  Bytes out_;
  store_tcp::Nonce nonce_{};
  std::optional<store_tcp::Channel> channel_;
  bool authed_ = false;
  bool closed_ = false;
  std::shared_ptr<Waiter> waiter_;
};

}  // namespace

// --- store state --------------------------------------------------------------------

Entry* StoreServer::Impl::live(std::string_view key) {
  auto it = data.find(key);
  if (it == data.end()) return nullptr;
  if (it->second.deadline && *it->second.deadline <= Clock::now()) {
    erase(it);
    return nullptr;
  }
  return &it->second;
}

void StoreServer::Impl::erase(std::map<std::string, Entry, std::less<>>::iterator it) {
  if (it->second.deadline) expiry.erase({*it->second.deadline, it->first});
  data.erase(it);
}

void StoreServer::Impl::write(std::string_view key, std::string value, int64_t ttl_ms, bool keep_ttl) {
  auto it = data.find(key);
  if (it == data.end()) it = data.emplace(std::string(key), Entry{}).first;
  Entry& e = it->second;
  e.value = std::move(value);
  if (!keep_ttl) {
    if (e.deadline) expiry.erase({*e.deadline, it->first});
    e.deadline.reset();
    if (ttl_ms > 0) {
      e.deadline = Clock::now() + std::chrono::milliseconds(ttl_ms);
      expiry.insert({*e.deadline, it->first});
    }
  }
  notify(it->first);
}

void StoreServer::Impl::notify(const std::string& key) {
  auto it = waiters.find(key);
  if (it == waiters.end()) return;
  std::vector<std::weak_ptr<Waiter>> list = std::move(it->second);
  waiters.erase(it);
  for (auto& weak : list) {
    std::shared_ptr<Waiter> w = weak.lock();
    if (!w || w->done) continue;
    w->missing.erase(key);
    if (w->missing.empty()) {
      Response r;
      r.op = Op::kWait;
      finish_wait(w, r);
    }
  }
}

void StoreServer::Impl::unregister(const std::shared_ptr<Waiter>& w) {
  for (const auto& k : w->missing) {
    auto it = waiters.find(k);
    if (it == waiters.end()) continue;
    auto& v = it->second;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](const std::weak_ptr<Waiter>& x) {
                             auto p = x.lock();
                             return !p || p == w;
                           }),
            v.end());
    if (v.empty()) waiters.erase(it);
  }
}

void StoreServer::Impl::finish_wait(const std::shared_ptr<Waiter>& w, Response r) {
  w->done = true;
  w->timer.cancel();
  unregister(w);
  if (auto s = w->session.lock()) s->reply(r);
}

std::optional<Response> StoreServer::Impl::start_wait(const std::shared_ptr<Session>& s, const Request& q) {
  auto w = std::make_shared<Waiter>(io);
  for (const auto& k : q.keys) {
    if (!live(k)) w->missing.insert(k);
  }
  Response ok;
  ok.op = Op::kWait;
  if (w->missing.empty()) return ok;
  w->session = s;
  w->total = std::unordered_set<std::string>(q.keys.begin(), q.keys.end()).size();
  w->timeout_ms = q.timeout_ms;
  w->start = Clock::now();
  for (const auto& k : w->missing) waiters[k].push_back(w);
  w->timer.expires_after(std::chrono::milliseconds(q.timeout_ms));
  w->timer.async_wait([this, w](const asio::error_code& ec) {
    if (ec || w->done) return;
    std::vector<std::string> names(w->missing.begin(), w->missing.end());
    std::sort(names.begin(), names.end());
    std::string shown;
    for (size_t i = 0; i < names.size() && i < 8; ++i) {
      shown += (i ? ", " : "") + store_detail::quote_key(names[i]);
    }
    if (names.size() > 8) shown += ", ...";
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - w->start).count();
    finish_wait(w, error_response(Op::kWait,
                                  timeout_error("store wait: {} of {} keys still missing after {} ms: {}",
                                                names.size(), w->total, waited, shown)));
  });
  s->park(w);
  return std::nullopt;
}

Response StoreServer::Impl::handle(const Request& q) {
  Response r;
  r.op = q.op;
  const auto fail = [&](const Status& st) { return error_response(q.op, st); };
  switch (q.op) {
    case Op::kSet:
      write(q.key, q.value, q.ttl_ms, false);
      return r;
    case Op::kGet: {
      Entry* e = live(q.key);
      if (!e) return fail(not_found("store get {}: no such key", store_detail::quote_key(q.key)));
      r.value = e->value;
      return r;
    }
    case Op::kAdd: {
      Entry* e = live(q.key);
      int64_t cur = 0;
      if (e) {
        std::optional<int64_t> v = store_detail::parse_counter(e->value);
        if (!v) {
          return fail(invalid_argument("store add {}: the value is not a decimal integer",
                                       store_detail::quote_key(q.key)));
        }
        cur = *v;
      }
      int64_t next = 0;
      if (__builtin_add_overflow(cur, q.delta, &next)) {
        return fail(out_of_range("store add {}: {} + {} overflows int64", store_detail::quote_key(q.key), cur,
                                 q.delta));
      }
      write(q.key, std::to_string(next), 0, /*keep_ttl=*/e != nullptr);
      r.number = next;
      return r;
    }
    case Op::kCompareSet: {
      Entry* e = live(q.key);
      const bool match = q.expected ? (e && e->value == *q.expected) : (e == nullptr);
      if (match) {
        write(q.key, q.value, q.ttl_ms, false);
        r.number = 1;
        r.value = q.value;
      } else if (e) {
        r.value = e->value;
      }
      return r;
    }
    case Op::kRemove: {
      if (live(q.key)) {
        erase(data.find(q.key));
        r.number = 1;
      }
      return r;
    }
    case Op::kList: {
      // The only answer whose size the request does not bound: keep it within a frame.
      constexpr size_t kBudget = store_tcp::kMaxFrameBytes - 64 * 1024;
      const auto now = Clock::now();
      size_t bytes = 0;
      for (auto it = data.lower_bound(q.key); it != data.end() && it->first.starts_with(q.key); ++it) {
        if (it->second.deadline && *it->second.deadline <= now) continue;
        bytes += 4 + it->first.size();
        if (bytes > kBudget) {
          return fail(out_of_range("store list {}: the matching keys exceed the {}-byte frame limit; "
                                   "list a longer prefix",
                                   store_detail::quote_key(q.key), store_tcp::kMaxFrameBytes));
        }
        r.keys.push_back(it->first);
      }
      return r;
    }
    case Op::kRenew: {
      auto it = data.find(q.key);
      if (it == data.end() || (it->second.deadline && *it->second.deadline <= Clock::now())) {
        if (it != data.end()) erase(it);
        return fail(not_found("store renew {}: no such key (expired or deleted)", store_detail::quote_key(q.key)));
      }
      Entry& e = it->second;
      if (e.deadline) expiry.erase({*e.deadline, it->first});
      e.deadline = Clock::now() + std::chrono::milliseconds(q.ttl_ms);
      expiry.insert({*e.deadline, it->first});
      return r;
    }
    case Op::kPing:
      return r;
    case Op::kWait:
    case Op::kChallenge:
    case Op::kAuth:
      break;
  }
  return fail(internal_error("store: unhandled op {}", static_cast<int>(q.op)));
}

// --- event loop ------------------------------------------------------------------------

void StoreServer::Impl::accept() {
  acceptor.async_accept([this](const asio::error_code& ec, tcp::socket sock) {
    if (stopping) return;
    if (ec) {
      if (ec == asio::error::operation_aborted) return;
      // Out of descriptors or similar: back off briefly instead of spinning.
      accept_retry.expires_after(std::chrono::milliseconds(50));
      accept_retry.async_wait([this](const asio::error_code& e) {
        if (!e && !stopping) accept();
      });
      return;
    }
    // Not inherited by processes this one starts (asio opens sockets without
    // SOCK_CLOEXEC): a child holding a client's socket would keep it open after the
    // server dropped it.
    ::fcntl(sock.native_handle(), F_SETFD, FD_CLOEXEC);
    asio::error_code ep_ec;
    const tcp::endpoint ep = sock.remote_endpoint(ep_ec);
    std::string peer = ep_ec ? std::string("?") : ep.address().to_string();
    make_room(peer);
    std::make_shared<Session>(*this, std::move(sock), std::move(peer))->start();
    accept();
  });
}

Millis StoreServer::Impl::proof_wait(const std::string& peer) {
  auto it = strikes.find(peer);
  if (it == strikes.end()) return Millis{0};
  if (Clock::now() - it->second.last > kStrikeMemory) {
    strikes.erase(it);  // (forgotten: its next wrong proof starts again at kFirstWait)
    return Millis{0};
  }
  const uint32_t doublings = std::min<uint32_t>(it->second.recent - 1, 16);
  return std::min<Millis>(kFirstWait * (1u << doublings), kMostWait);
}

void StoreServer::Impl::strike(const std::string& peer) {
  refused_proofs.fetch_add(1);
  const auto now = Clock::now();
  if (strikes.size() >= 4096)  // (many addresses: forget the ones that stopped)
    std::erase_if(strikes, [&](const auto& kv) { return now - kv.second.last > kStrikeMemory; });
  Strikes& s = strikes[peer];
  s.recent = now - s.last > kStrikeMemory ? 1 : s.recent + 1;
  s.last = now;
  ++s.unlogged;
  if (s.logged != Clock::time_point{} && now - s.logged < kStrikeMemory) return;
  std::fprintf(stderr,
               "ferry store: %llu wrong token proof(s) from %s since the last such line (refused; its next proofs "
               "wait %lld ms before they are checked)\n",
               static_cast<unsigned long long>(s.unlogged), peer.c_str(),
               static_cast<long long>(proof_wait(peer).count()));
  s.unlogged = 0;
  s.logged = now;
}

void StoreServer::Impl::make_room(const std::string& peer) {
  Session* victim = nullptr;
  if (auto it = pending_by_peer.find(peer);
      it != pending_by_peer.end() && it->second.size() >= options.max_unauthenticated_per_peer) {
    victim = it->second.front();
  } else if (pending.size() >= options.max_unauthenticated) {
    victim = pending.front();
  }
  if (victim == nullptr) return;
  evicted_count.fetch_add(1);
  std::shared_ptr<Session> keep = victim->shared_from_this();  // close() may drop the last reference
  keep->close();
}

void StoreServer::Impl::sweep() {
  sweep_timer.expires_after(std::chrono::milliseconds(50));
  sweep_timer.async_wait([this](const asio::error_code& ec) {
    if (ec || stopping) return;
    const auto now = Clock::now();
    while (!expiry.empty() && expiry.begin()->first <= now) {
      auto it = data.find(expiry.begin()->second);
      if (it != data.end()) {
        erase(it);
      } else {
        expiry.erase(expiry.begin());
      }
    }
    sweep();
  });
}

void StoreServer::Impl::close_all() {
  stopping = true;
  asio::error_code ec;
  acceptor.close(ec);
  sweep_timer.cancel();
  accept_retry.cancel();
  // close() does not erase from `sessions` (the Session destructor does), but copy
  // anyway: a close may drop the last reference to another Session.
  std::vector<std::shared_ptr<Session>> live_sessions;
  for (Session* s : sessions) live_sessions.push_back(s->shared_from_this());
  for (auto& s : live_sessions) s->close();
}

// --- StoreServer ---------------------------------------------------------------------

StoreServer::StoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StoreServer::~StoreServer() { stop(); }

Result<std::unique_ptr<StoreServer>> StoreServer::start(const StoreServerOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::string token, store_detail::resolve_token(options.token, ""));
  if (options.handshake_timeout.count() <= 0 || options.idle_timeout.count() < 0 || options.max_connections == 0 ||
      options.max_unauthenticated == 0 || options.max_unauthenticated_per_peer == 0) {
    return invalid_argument(
        "store server: handshake_timeout ({} ms), max_connections ({}), max_unauthenticated ({}) and "
        "max_unauthenticated_per_peer ({}) must be positive and idle_timeout ({} ms) not negative",
        options.handshake_timeout.count(), options.max_connections, options.max_unauthenticated,
        options.max_unauthenticated_per_peer, options.idle_timeout.count());
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->token = std::move(token);
  asio::error_code ec;
  std::string host = options.host == "localhost" ? "127.0.0.1" : options.host;
  asio::ip::address addr = asio::ip::make_address(host, ec);
  if (ec) return invalid_argument("store server: '{}' is not an IP address: {}", options.host, ec.message());
  tcp::endpoint ep(addr, options.port);
  impl->acceptor.open(ep.protocol(), ec);
  // Close-on-exec: a process this one starts (a driver's rank workers) must not inherit
  // the listening socket, or the port stays taken after the server stops and a restart
  // on the same port fails.
  if (!ec) ::fcntl(impl->acceptor.native_handle(), F_SETFD, FD_CLOEXEC);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return io_error("store server: cannot listen on {}:{}: {}", options.host, options.port, ec.message());
  }
  impl->port = impl->acceptor.local_endpoint(ec).port();
  impl->accept();
  impl->sweep();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    // A handler should never throw; if one does (e.g. bad_alloc), keep serving the rest.
    while (true) {
      try {
        raw->io.run();
        return;
      } catch (const std::exception&) {
      }
    }
  });
  return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl)));
}

uint16_t StoreServer::port() const { return impl_->port; }

std::string StoreServer::url() const {
  StoreUrl u;
  u.scheme = StoreUrl::Scheme::kTcp;
  u.host = impl_->options.host;
  u.port = impl_->port;
  return u.to_string();
}

size_t StoreServer::connections() const { return impl_->connection_count.load(); }

size_t StoreServer::evicted() const { return impl_->evicted_count.load(); }
size_t StoreServer::refused_proofs() const { return impl_->refused_proofs.load(); }

void StoreServer::stop() {
  if (!impl_) return;
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  if (impl_->stopped) return;
  impl_->stopped = true;
  Impl* raw = impl_.get();
  asio::post(impl_->io, [raw] { raw->close_all(); });
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace ferry
