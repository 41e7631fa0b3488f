// The embedded TCP store server: one standalone-asio event loop on one thread.
//
// All store state lives on the event-loop thread, so it needs no locks. Each connection
// is a Session that reads one frame, answers it, and reads the next (a client has at
// most one request in flight). A `wait` that cannot be answered at once parks the
// session as a Waiter, registered under each missing key, with a timer for its timeout;
// while parked the session watches its socket so a client that hangs up is dropped at
// once rather than when its wait runs out.
#include <algorithm>
#include <atomic>
#include <chrono>
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
  std::atomic<size_t> connection_count{0};
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
  Session(StoreServer::Impl& srv, tcp::socket sock)
      : srv_(srv), sock_(std::move(sock)), handshake_timer_(srv.io) {
    srv_.sessions.insert(this);
    srv_.connection_count.fetch_add(1);
  }
  ~Session() {
    srv_.sessions.erase(this);
    srv_.connection_count.fetch_sub(1);
  }

  void start() {
    asio::error_code ec;
    sock_.set_option(tcp::no_delay(true), ec);
    store_tcp::Challenge c;
    if (!store_tcp::random_bytes(c.nonce).ok()) return close();
    nonce_ = c.nonce;
    handshake_timer_.expires_after(srv_.options.handshake_timeout);
    handshake_timer_.async_wait([self = shared_from_this()](const asio::error_code& e) {
      if (!e && !self->authed_) self->close();
    });
    send(store_tcp::encode_challenge(c), /*close_after=*/false);
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    asio::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
    handshake_timer_.cancel();
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
    send(store_tcp::encode_response(r), false);
  }

  void park(std::shared_ptr<Waiter> w) {
    waiter_ = std::move(w);
    // Readable while parked means the client hung up (or broke the one-request-in-
    // flight rule): either way the connection is done.
    sock_.async_wait(tcp::socket::wait_read,
                     [self = shared_from_this(), w = waiter_](const asio::error_code& ec) {
                       if (ec == asio::error::operation_aborted || w->done) return;
                       self->close();
                     });
  }

 private:
  void send(Bytes frame, bool close_after) {
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
                       self->read_body(*n);
                     });
  }

  void read_body(size_t n) {
    body_.resize(n);
    asio::async_read(sock_, asio::buffer(body_),
                     [self = shared_from_this()](const asio::error_code& ec, size_t) {
                       if (ec || self->closed_) return self->close();
                       self->on_payload();
                     });
  }

  void on_payload() {
    if (!authed_) {
      Result<store_tcp::Auth> a = store_tcp::decode_auth(body_);
      if (!a.ok()) {
        if (a.status().code() == StatusCode::kFailedPrecondition) {
          return send(store_tcp::encode_response(error_response(Op::kAuth, a.status())), true);
        }
        return close();
      }
      if (!store_tcp::macs_equal(a->mac, store_tcp::auth_mac(srv_.token, nonce_))) {
        return send(store_tcp::encode_response(error_response(
                        Op::kAuth, permission_denied("store: the server refused the token"))),
                    true);
      }
      authed_ = true;
      handshake_timer_.cancel();
      Response ok;
      ok.op = Op::kAuth;
      return send(store_tcp::encode_response(ok), false);
    }
    Result<Request> q = store_tcp::decode_request(body_);
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
  asio::steady_timer handshake_timer_;
  std::array<uint8_t, store_tcp::kFrameHeaderBytes> header_{};
  Bytes body_;
  Bytes out_;
  std::array<uint8_t, store_tcp::kNonceBytes> nonce_{};
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
    finish_wait(w, error_response(Op::kWait,
                                  timeout_error("store wait: {} of {} keys still missing after {} ms: {}",
                                                names.size(), w->total, w->timeout_ms, shown)));
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
    if (sessions.size() >= options.max_connections) {
      asio::error_code ignored;
      sock.close(ignored);
    } else {
      std::make_shared<Session>(*this, std::move(sock))->start();
    }
    accept();
  });
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
  if (options.handshake_timeout.count() <= 0 || options.max_connections == 0) {
    return invalid_argument("store server: handshake_timeout and max_connections must be positive");
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
