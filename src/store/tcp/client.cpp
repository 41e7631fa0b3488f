// The embedded TCP store's client: blocking POSIX sockets with poll() deadlines, one
// connection guarded by a mutex. Frames are built and parsed by store/tcp/protocol.h;
// the client checks the server's proof of the token in the handshake and the tag of
// every frame after it.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "store/backends.h"
#include "store/common.h"
#include "store/tcp/protocol.h"

namespace ferry::store_detail {

namespace {

using Clock = std::chrono::steady_clock;
using store_tcp::Bytes;
using store_tcp::Op;
using store_tcp::Request;
using store_tcp::Response;

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 1'000'000'000 ? 1'000'000'000 : static_cast<int>(left);
}

// Waits until `fd` is ready for `events` or the deadline passes.
Status poll_fd(int fd, short events, Clock::time_point deadline, std::string_view what) {
  while (true) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return Status::Ok();
    if (rc == 0) return timeout_error("store: timed out {}", what);
    if (errno != EINTR) return unavailable("store: poll while {}: {}", what, std::strerror(errno));
  }
}

Status write_all(int fd, const uint8_t* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      FERRY_RETURN_IF_ERROR(poll_fd(fd, POLLOUT, deadline, "sending a request"));
      continue;
    }
    return unavailable("store: send failed: {}", std::strerror(errno));
  }
  return Status::Ok();
}

Status read_exact(int fd, uint8_t* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return unavailable("store: the server closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      FERRY_RETURN_IF_ERROR(poll_fd(fd, POLLIN, deadline, "waiting for the server's answer"));
      continue;
    }
    return unavailable("store: recv failed: {}", std::strerror(errno));
  }
  return Status::Ok();
}

Result<Bytes> read_frame(int fd, size_t max_payload, Clock::time_point deadline) {
  std::array<uint8_t, store_tcp::kFrameHeaderBytes> header{};
  FERRY_RETURN_IF_ERROR(read_exact(fd, header.data(), header.size(), deadline));
  Result<size_t> n = store_tcp::decode_frame_header(header, max_payload);
  if (!n.ok()) return peer_failed("store: bad frame from the server: {}", n.status().message());
  // Grown as bytes arrive: a hostile server's claimed length costs nothing by itself.
  Bytes payload;
  while (payload.size() < *n) {
    const size_t have = payload.size();
    const size_t chunk = std::min(*n - have, store_tcp::kReadChunkBytes);
    payload.resize(have + chunk);
    FERRY_RETURN_IF_ERROR(read_exact(fd, payload.data() + have, chunk, deadline));
  }
  return payload;
}

// True when the server has closed (or written to) a connection that has no request in
// flight: the connection must be replaced before it is used.
bool closed_while_idle(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) != 0;
}

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    reset();
    fd_ = std::exchange(o.fd_, -1);
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// One connect attempt to one address, bounded by `deadline`.
Result<Fd> connect_once(const addrinfo* ai, Clock::time_point deadline) {
  Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
  if (!fd.valid()) return unavailable("store: socket: {}", std::strerror(errno));
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return unavailable("store: connect: {}", std::strerror(errno));
    FERRY_RETURN_IF_ERROR(poll_fd(fd.get(), POLLOUT, deadline, "connecting"));
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return unavailable("store: connect: {}", std::strerror(err));
  }
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

class TcpStore final : public Store {
 public:
  TcpStore(StoreUrl url, StoreOptions options, std::string token)
      : url_(std::move(url)), options_(std::move(options)), token_(std::move(token)) {}

  Status connect() {
    std::lock_guard<std::mutex> lock(mu_);
    return ensure_connected();
  }

  Status set(std::string_view key, std::string_view value, Millis ttl) override {
    Request q;
    q.op = Op::kSet;
    q.key = key;
    q.value = value;
    q.ttl_ms = ttl.count();
    return call(q).status();
  }

  Result<std::string> get(std::string_view key) override {
    Request q;
    q.op = Op::kGet;
    q.key = key;
    FERRY_ASSIGN_OR_RETURN(Response r, call(q));
    return std::move(r.value).value_or(std::string());
  }

  Result<int64_t> add(std::string_view key, int64_t delta) override {
    Request q;
    q.op = Op::kAdd;
    q.key = key;
    q.delta = delta;
    FERRY_ASSIGN_OR_RETURN(Response r, call(q));
    return r.number;
  }

  Result<CompareSetResult> compare_set(std::string_view key, std::optional<std::string_view> expected,
                                       std::string_view desired, Millis ttl) override {
    Request q;
    q.op = Op::kCompareSet;
    q.key = key;
    if (expected) q.expected = std::string(*expected);
    q.value = desired;
    q.ttl_ms = ttl.count();
    FERRY_ASSIGN_OR_RETURN(Response r, call(q));
    return CompareSetResult{r.number != 0, std::move(r.value)};
  }

  Result<bool> remove(std::string_view key) override {
    Request q;
    q.op = Op::kRemove;
    q.key = key;
    FERRY_ASSIGN_OR_RETURN(Response r, call(q));
    return r.number != 0;
  }

  Result<std::vector<std::string>> list(std::string_view prefix) override {
    Request q;
    q.op = Op::kList;
    q.key = prefix;
    FERRY_ASSIGN_OR_RETURN(Response r, call(q));
    return std::move(r.keys);
  }

  Status wait(const std::vector<std::string>& keys, Millis timeout) override {
    if (keys.empty()) return check_wait(0, timeout.count());
    Request q;
    q.op = Op::kWait;
    q.keys = keys;
    q.timeout_ms = timeout.count();
    return call(q, timeout).status();
  }

  Status renew(std::string_view key, Millis ttl) override {
    Request q;
    q.op = Op::kRenew;
    q.key = key;
    q.ttl_ms = ttl.count();
    return call(q).status();
  }

  Result<std::unique_ptr<Store>> clone() const override {
    auto s = std::make_unique<TcpStore>(url_, options_, token_);
    FERRY_RETURN_IF_ERROR(s->connect());
    return std::unique_ptr<Store>(std::move(s));
  }

  std::string url() const override { return url_.to_string(); }

 private:
  // Sends one request and reads its answer; any transport failure drops the connection.
  Result<Response> call(const Request& q, Millis extra = Millis{0}) {
    FERRY_RETURN_IF_ERROR(store_tcp::validate_request(q));
    const Bytes frame = store_tcp::encode_request(q);
    if (frame.size() > store_tcp::kMaxFrameBytes + store_tcp::kFrameHeaderBytes) {
      return invalid_argument("store {}: request of {} bytes exceeds the frame limit", store_tcp::op_name(q.op),
                              frame.size());
    }
    std::lock_guard<std::mutex> lock(mu_);
    drop_if_stale();
    FERRY_RETURN_IF_ERROR(ensure_connected());
    const auto deadline = Clock::now() + options_.io_timeout + extra;
    Result<Response> r = exchange(frame, deadline);
    last_used_ = Clock::now();
    if (!r.ok()) {
      fd_.reset();
      return r.status().with_context(fmt::format("store {} ({})", store_tcp::op_name(q.op), url_.to_string()));
    }
    if (r->op != q.op) {
      fd_.reset();
      return peer_failed("store {}: the server answered a '{}'", store_tcp::op_name(q.op), store_tcp::op_name(r->op));
    }
    if (r->code != StatusCode::kOk) return r->status();
    return r;
  }

  Result<Response> exchange(const Bytes& frame, Clock::time_point deadline) {
    const Bytes sealed = channel_->seal(frame);
    FERRY_RETURN_IF_ERROR(write_all(fd_.get(), sealed.data(), sealed.size(), deadline));
    FERRY_ASSIGN_OR_RETURN(Bytes payload, read_frame(fd_.get(), store_tcp::kMaxFrameBytes, deadline));
    Result<store_tcp::ByteSpan> body = channel_->open(payload);
    if (!body.ok()) return peer_failed("store: answer from the server refused: {}", body.status().message());
    Result<Response> r = store_tcp::decode_response(*body);
    if (!r.ok()) return peer_failed("store: bad answer from the server: {}", r.status().message());
    return r;
  }

  // Replaces, before a request is sent, a connection the server has closed or is about
  // to close for idleness. Nothing is in flight, so this is safe for every op (unlike
  // retrying a failed call). Half the announced idle timeout leaves room for a slow
  // request to arrive whole before the server's deadline.
  void drop_if_stale() {
    if (!fd_.valid()) return;
    const bool idle_too_long =
        server_idle_timeout_.count() > 0 && Clock::now() - last_used_ >= server_idle_timeout_ / 2;
    if (idle_too_long || closed_while_idle(fd_.get())) fd_.reset();
  }

  // Connects (retrying refused connections until connect_timeout) and authenticates.
  Status ensure_connected() {
    if (fd_.valid()) return Status::Ok();
    const auto deadline = Clock::now() + options_.connect_timeout;
    Status last;
    auto backoff = Millis{5};
    while (true) {
      Status st = connect_and_auth(deadline);
      if (st.ok()) return st;
      // A refused token or a version mismatch will not get better by retrying.
      if (st.code() == StatusCode::kPermissionDenied || st.code() == StatusCode::kFailedPrecondition ||
          st.code() == StatusCode::kInvalidArgument) {
        return st;
      }
      last = st;
      if (Clock::now() + backoff >= deadline) break;
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, Millis{200});
    }
    return unavailable("store: cannot reach {} within {} ms: {}", url_.to_string(), options_.connect_timeout.count(),
                       last.message());
  }

  Status connect_and_auth(Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(url_.port);
    int rc = ::getaddrinfo(url_.host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) return unavailable("store: cannot resolve '{}': {}", url_.host, ::gai_strerror(rc));
    Status last = unavailable("store: no address for '{}'", url_.host);
    Fd fd;
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      Result<Fd> f = connect_once(ai, deadline);
      if (f.ok()) {
        fd = std::move(*f);
        break;
      }
      last = f.status();
    }
    ::freeaddrinfo(res);
    if (!fd.valid()) return last;
    // Handshake: challenge -> our nonce and proof -> the server's sealed welcome.
    FERRY_ASSIGN_OR_RETURN(Bytes ch, read_frame(fd.get(), store_tcp::kMaxHandshakeFrameBytes, deadline));
    FERRY_ASSIGN_OR_RETURN(store_tcp::Challenge c, store_tcp::decode_challenge(ch));
    store_tcp::Auth a;
    FERRY_RETURN_IF_ERROR(store_tcp::random_bytes(a.nonce));
    a.mac = store_tcp::client_proof(token_, c.nonce, a.nonce);
    const Bytes auth = store_tcp::encode_auth(a);
    FERRY_RETURN_IF_ERROR(write_all(fd.get(), auth.data(), auth.size(), deadline));
    Result<Bytes> verdict = read_frame(fd.get(), store_tcp::kMaxHandshakeFrameBytes, deadline);
    if (!verdict.ok()) return verdict.status().with_context("store: during authentication");
    store_tcp::Channel channel(store_tcp::session_key(token_, c.nonce, a.nonce),
                               store_tcp::Direction::kClientToServer);
    Result<store_tcp::ByteSpan> welcome = channel.open(*verdict);
    if (!welcome.ok()) {
      // Not sealed: either a refusal (plain, by design: it may come from a server that
      // does not share our token) or an impostor.
      Result<Response> refusal = store_tcp::decode_response(*verdict);
      if (refusal.ok() && refusal->op == Op::kAuth && refusal->code != StatusCode::kOk) return refusal->status();
      return permission_denied(
          "store: the server at {} did not prove that it holds the token (a different token, or not a ferry "
          "store)",
          url_.to_string());
    }
    Result<Response> r = store_tcp::decode_response(*welcome);
    if (!r.ok() || r->op != Op::kAuth || r->code != StatusCode::kOk || r->number < 0) {
      return peer_failed("store: unexpected answer to authentication from {}", url_.to_string());
    }
    fd_ = std::move(fd);
    channel_.emplace(std::move(channel));
    server_idle_timeout_ = Millis{r->number};
    last_used_ = Clock::now();
    return Status::Ok();
  }

  const StoreUrl url_;
  const StoreOptions options_;
  const std::string token_;
  std::mutex mu_;
  Fd fd_;
  // Valid with fd_ (same connection): its integrity state and the server's idle timeout.
  std::optional<store_tcp::Channel> channel_;
  Millis server_idle_timeout_{0};
  Clock::time_point last_used_;
};

}  // namespace

Result<std::unique_ptr<Store>> open_tcp_store(const StoreUrl& url, const StoreOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::string token, resolve_token(options.token, url.token));
  auto s = std::make_unique<TcpStore>(url, options, std::move(token));
  FERRY_RETURN_IF_ERROR(s->connect());
  return std::unique_ptr<Store>(std::move(s));
}

}  // namespace ferry::store_detail
