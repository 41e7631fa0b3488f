// The embedded TCP store server against hostile and broken clients: random bytes,
// oversize lengths, truncated frames, bad MACs, silent and vanishing clients. Each must
// cost only its own connection; the server keeps serving everyone else.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <thread>

#include "ferry/store.h"
#include "store/tcp/protocol.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using namespace store_tcp;
using Clock = std::chrono::steady_clock;

constexpr const char* kToken = "tcp-test-token-0123456789";

// A bare socket speaking (or abusing) the protocol by hand.
class RawConn {
 public:
  explicit RawConn(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
  ~RawConn() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  void hang_up() {
    ::close(fd_);
    fd_ = -1;
  }

  // Best effort: the server may hang up halfway through, which is fine.
  void send_bytes(const Bytes& b) {
    size_t off = 0;
    while (off < b.size()) {
      ssize_t n = ::send(fd_, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  }

  std::optional<Bytes> read_frame() {
    uint8_t h[4];
    if (!read_exact(h, 4)) return std::nullopt;
    size_t n = size_t{h[0]} | size_t{h[1]} << 8 | size_t{h[2]} << 16 | size_t{h[3]} << 24;
    if (n > kMaxFrameBytes) return std::nullopt;
    Bytes b(n);
    if (!read_exact(b.data(), n)) return std::nullopt;
    return b;
  }

  Challenge read_challenge() {
    auto f = read_frame();
    EXPECT_TRUE(f.has_value());
    auto c = f ? decode_challenge(*f) : Result<Challenge>(corrupt("no challenge"));
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? *c : Challenge{};
  }

  // Completes the handshake; returns the verdict. On success, sealed frames follow.
  Status authenticate(const std::string& token) {
    Challenge c = read_challenge();
    Auth a;
    a.nonce.fill(7);
    a.nonce[0] = static_cast<uint8_t>(++connections_made_);
    a.mac = client_proof(token, c.nonce, a.nonce);
    send_bytes(encode_auth(a));
    auto f = read_frame();
    if (!f) return unavailable("no verdict");
    channel_.emplace(session_key(token, c.nonce, a.nonce), Direction::kClientToServer);
    auto body = channel_->open(*f);
    if (!body.ok()) {
      channel_.reset();
      auto r = decode_response(*f);  // a plain refusal
      if (!r.ok()) return r.status();
      return r->status();
    }
    auto r = decode_response(*body);
    if (!r.ok()) return r.status();
    idle_timeout_ms_ = r->number;
    return r->status();
  }

  // A whole request frame, sealed with this connection's next sequence number.
  Bytes seal(const Bytes& frame) { return channel_->seal(frame); }
  int64_t idle_timeout_ms() const { return idle_timeout_ms_; }

  std::optional<Response> read_response() {
    auto f = read_frame();
    if (!f) return std::nullopt;
    auto body = channel_->open(*f);
    if (!body.ok()) return std::nullopt;
    auto r = decode_response(*body);
    if (!r.ok()) return std::nullopt;
    return *r;
  }

  std::optional<Response> call(const Request& q) {
    send_bytes(seal(encode_request(q)));
    return read_response();
  }

  // True when the server closes the connection within `within` (returns as soon as it
  // does; the default only tells "never" from a slow machine).
  bool closed_by_server(Millis within = 30000ms) {
    const auto deadline = Clock::now() + within;
    uint8_t buf[4096];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      int rc = ::poll(&p, 1, 50);
      if (rc <= 0) continue;
      ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EINTR) return true;  // reset
    }
    return false;
  }

 private:
  bool read_exact(uint8_t* p, size_t n) {
    while (n > 0) {
      ssize_t r = ::recv(fd_, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  int fd_ = -1;
  bool connected_ = false;
  std::optional<Channel> channel_;
  int64_t idle_timeout_ms_ = -1;
  static inline int connections_made_ = 0;
};

Bytes frame_of(const Bytes& payload) {
  const auto n = static_cast<uint32_t>(payload.size());
  Bytes out;
  out.reserve(4 + payload.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  for (uint8_t b : payload) out.push_back(b);
  return out;
}

// True once `pred` holds, polled for up to `within` (generous: a loaded 2-core CI box
// stalls threads for seconds; success returns at once).
bool eventually(const std::function<bool()>& pred, Millis within = 30000ms) {
  const auto deadline = Clock::now() + within;
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

class TcpServerTest : public ::testing::Test {
 protected:
  void SetUp() override { start({}); }

  void start(StoreServerOptions so) {
    so.token = kToken;
    auto s = StoreServer::start(so);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    server_ = std::move(*s);
    StoreOptions o;
    o.token = kToken;
    o.connect_timeout = 2s;
    o.io_timeout = 5s;
    auto c = Store::open(server_->url(), o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    good_ = std::move(*c);
    ASSERT_TRUE(good_->set("sentinel", "0").ok());
  }

  // The well-behaved client is still served.
  void expect_good_client_served(int round) {
    ASSERT_TRUE(good_->set("sentinel", std::to_string(round)).ok());
    EXPECT_EQ(good_->get("sentinel").value_or("?"), std::to_string(round));
    EXPECT_EQ(good_->add("rounds", 1).value_or(-1), round);
  }

  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> good_;
};

TEST_F(TcpServerTest, RandomBytesBeforeAuthCloseOnlyThatConnection) {
  std::mt19937 rng(7);
  for (int round = 1; round <= 40; ++round) {
    RawConn c(server_->port());
    ASSERT_TRUE(c.connected());
    Bytes junk(1 + rng() % 600);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    c.send_bytes(junk);
    c.hang_up();
    expect_good_client_served(round);
  }
  EXPECT_TRUE(eventually([&] { return server_->connections() == 1; })) << server_->connections();
}

TEST_F(TcpServerTest, OversizeLengthsAreRefusedWithoutAllocating) {
  {
    RawConn c(server_->port());
    c.read_challenge();
    c.send_bytes({0xff, 0xff, 0xff, 0xff});
    EXPECT_TRUE(c.closed_by_server());
  }
  {
    // Over the pre-auth limit, although under the general one.
    RawConn c(server_->port());
    c.read_challenge();
    c.send_bytes(frame_of(Bytes(kMaxHandshakeFrameBytes + 1, 0)));
    EXPECT_TRUE(c.closed_by_server());
  }
  {
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    const auto n = static_cast<uint32_t>(kMaxFrameBytes + 1);
    c.send_bytes({static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8), static_cast<uint8_t>(n >> 16),
                  static_cast<uint8_t>(n >> 24)});
    EXPECT_TRUE(c.closed_by_server());
  }
  expect_good_client_served(1);
}

TEST_F(TcpServerTest, TruncatedFramesAndHangUps) {
  for (int round = 1; round <= 10; ++round) {
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    Request q;
    q.op = Op::kSet;
    q.key = "victim";
    q.value = std::string(1000, 'x');
    Bytes frame = c.seal(encode_request(q));
    frame.resize(frame.size() / (round + 1));  // header promises more than arrives
    c.send_bytes(frame);
    c.hang_up();
    expect_good_client_served(round);
  }
  EXPECT_EQ(good_->get("victim").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(eventually([&] { return server_->connections() == 1; })) << server_->connections();
}

TEST_F(TcpServerTest, MalformedPayloadsAfterAuthCloseTheConnection) {
  std::mt19937 rng(99);
  std::vector<Bytes> payloads = {
      {},                                                            // empty frame
      {0},                                                           // op 0
      {250, 1, 2, 3},                                                // unknown op
      {static_cast<uint8_t>(Op::kGet), 10, 0, 0, 0, 'a'},            // string longer than the frame
      {static_cast<uint8_t>(Op::kSet), 1, 0, 0, 0, 'k', 0, 0, 0, 0}, // missing ttl
      {static_cast<uint8_t>(Op::kPing), 0},                          // trailing byte
      {static_cast<uint8_t>(Op::kAuth), 1, 0, 0, 0},                 // handshake op after auth
      {static_cast<uint8_t>(Op::kWait), 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0},
  };
  for (int i = 0; i < 60; ++i) {
    Bytes b(1 + rng() % 40);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    b[0] = static_cast<uint8_t>(1 + rng() % 11);
    payloads.push_back(b);
  }
  int round = 0;
  for (const Bytes& p : payloads) {
    ++round;
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    c.send_bytes(c.seal(frame_of(p)));
    // Either it happened to be a valid request (then answered) or the server hangs up.
    auto valid = decode_request(p);
    if (valid.ok()) {
      if (valid->op != Op::kWait) {
        EXPECT_TRUE(c.read_frame().has_value()) << "payload " << round;
      }
    } else {
      EXPECT_TRUE(c.closed_by_server()) << "payload " << round;
    }
    expect_good_client_served(round);
  }
}

TEST_F(TcpServerTest, WrongMacIsRefusedAndClosed) {
  RawConn c(server_->port());
  Status st = c.authenticate("wrong");
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st.to_string();
  EXPECT_TRUE(c.closed_by_server());
  // No request is served on an unauthenticated connection.
  RawConn d(server_->port());
  d.read_challenge();
  Request q;
  q.op = Op::kGet;
  q.key = "sentinel";
  d.send_bytes(encode_request(q));
  EXPECT_TRUE(d.closed_by_server());
  expect_good_client_served(1);
}

// Wrong proofs (issue 49, finding 8: 7-11k a second were tried, unthrottled and
// unlogged): each is refused and counted; an address that keeps sending them waits before
// its next proofs are checked (10 ms, doubling, up to 500 ms), one line on stderr names it
// (at most once per 10 s), and the right token from that address still gets in.
TEST_F(TcpServerTest, WrongProofsAreThrottledAndLoggedAndTheRightTokenStillGetsIn) {
  ::testing::internal::CaptureStderr();
  const auto t0 = Clock::now();
  for (int i = 0; i < 8; ++i) {
    RawConn c(server_->port());
    Status st = c.authenticate("wrong-token-guess-" + std::to_string(i));
    EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << i << ": " << st.to_string();
  }
  const auto took = Clock::now() - t0;
  RawConn ok(server_->port());
  const Status in = ok.authenticate(kToken);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(in.ok()) << in.to_string();
  EXPECT_EQ(server_->refused_proofs(), 8u);
  // Proofs 2-8 waited 10 + 20 + 40 + 80 + 160 + 320 + 500 ms before they were checked.
  EXPECT_GE(took, 1000ms);
  size_t lines = 0;
  for (size_t at = err.find("wrong token proof(s) from 127.0.0.1"); at != std::string::npos;
       at = err.find("wrong token proof(s) from 127.0.0.1", at + 1))
    ++lines;
  EXPECT_EQ(lines, 1u) << err;
  expect_good_client_served(1);
}

TEST_F(TcpServerTest, WellFormedButInvalidRequestIsAnsweredNotClosed) {
  RawConn c(server_->port());
  ASSERT_TRUE(c.authenticate(kToken).ok());
  Request q;
  q.op = Op::kSet;
  q.key = "k";
  q.ttl_ms = -5;
  auto r = c.call(q);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, StatusCode::kInvalidArgument) << r->message;
  q.op = Op::kPing;
  r = c.call(q);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, StatusCode::kOk);
}

TEST_F(TcpServerTest, SilentClientIsDroppedAfterHandshakeTimeout) {
  good_.reset();
  server_.reset();
  StoreServerOptions so;
  so.handshake_timeout = 200ms;
  start(so);
  RawConn c(server_->port());
  c.read_challenge();
  auto t0 = Clock::now();
  EXPECT_TRUE(c.closed_by_server());
  EXPECT_GE(Clock::now() - t0, 150ms);
  expect_good_client_served(1);
}

TEST_F(TcpServerTest, ClientVanishingDuringWaitIsCleanedUp) {
  {
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    Request q;
    q.op = Op::kWait;
    q.keys = {"never"};
    q.timeout_ms = 60'000;
    c.send_bytes(c.seal(encode_request(q)));
    EXPECT_TRUE(eventually([&] { return server_->connections() == 2; }));
  }  // hangs up mid-wait
  EXPECT_TRUE(eventually([&] { return server_->connections() == 1; })) << server_->connections();
  // The abandoned waiter is not woken into a dead session.
  ASSERT_TRUE(good_->set("never", "now").ok());
  expect_good_client_served(1);
}

TEST_F(TcpServerTest, AuthenticatedConnectionLimit) {
  good_.reset();
  server_.reset();
  StoreServerOptions so;
  so.max_connections = 3;
  start(so);  // the good client is connection 1
  RawConn a(server_->port()), b(server_->port());
  ASSERT_TRUE(a.authenticate(kToken).ok());
  ASSERT_TRUE(b.authenticate(kToken).ok());
  RawConn over(server_->port());
  Status st = over.authenticate(kToken);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find("limit of 3 authenticated connections"), std::string::npos) << st.to_string();
  EXPECT_TRUE(over.closed_by_server());
  expect_good_client_served(1);
}

TEST_F(TcpServerTest, StopWithParkedWaitersAndClientsIsPrompt) {
  std::vector<std::thread> waiters;
  std::atomic<int> unavailable_count{0}, connected{0};
  for (int i = 0; i < 8; ++i) {
    waiters.emplace_back([&] {
      auto s = good_->clone();
      ASSERT_TRUE(s.ok());
      connected++;
      Status st = (*s)->wait({"never"}, 60s);
      if (st.code() == StatusCode::kUnavailable) unavailable_count++;
    });
  }
  // Stop once every client is authenticated (whether its wait is parked yet or still
  // in flight, it must end with Unavailable).
  EXPECT_TRUE(eventually([&] { return connected.load() == 8; }));
  std::this_thread::sleep_for(50ms);
  server_->stop();
  for (auto& t : waiters) t.join();
  // Prompt: every waiter was woken by the stop (Unavailable), none waited out its 60 s
  // (which would end in Timeout).
  EXPECT_EQ(unavailable_count.load(), 8);
  EXPECT_EQ(server_->connections(), 0u);
  EXPECT_EQ(good_->get("sentinel").status().code(), StatusCode::kUnavailable);
  server_->stop();  // idempotent
}

TEST_F(TcpServerTest, ServerNeedsAToken) {
  ::unsetenv("FERRY_TOKEN");
  StoreServerOptions so;
  auto s = StoreServer::start(so);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  so.host = "not-an-ip";
  so.token = kToken;
  s = StoreServer::start(so);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  // Port taken.
  so.host = "127.0.0.1";
  so.port = server_->port();
  s = StoreServer::start(so);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kIoError) << s.status().to_string();
}


// --- floods, hostile lengths, idleness, impostors, tampering -------------------------

int64_t rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// Raises the descriptor limit to the hard limit (a flood needs more than 1024).
rlim_t raise_fd_limit() {
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &r);
  ::getrlimit(RLIMIT_NOFILE, &r);
  return r.rlim_cur;
}

int open_loopback_nonblocking(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The attack: sockets that connect, read the challenge and never answer, each
// re-opened as soon as the server drops it; at most `hold` at a time per thread and
// about one new one per millisecond per thread.
class Flood {
 public:
  Flood(uint16_t port, int threads, size_t hold) {
    for (int t = 0; t < threads; ++t) {
      threads_.emplace_back([this, port, hold] { run(port, hold); });
    }
  }
  ~Flood() { stop(); }
  void stop() {
    stop_ = true;
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  size_t opened() const { return opened_.load(); }

 private:
  void run(uint16_t port, size_t hold) {
    std::vector<pollfd> fds;
    const auto deadline = Clock::now() + 60s;  // bounded even if the test forgets stop()
    uint8_t buf[512];
    while (!stop_ && Clock::now() < deadline) {
      if (fds.size() < hold) {
        int fd = open_loopback_nonblocking(port);
        if (fd >= 0) {
          fds.push_back({fd, POLLIN, 0});
          opened_++;
        }
      }
      ::poll(fds.data(), fds.size(), 1);
      for (size_t i = 0; i < fds.size();) {
        bool gone = false;
        if (fds[i].revents != 0) {
          ssize_t n = ::recv(fds[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
          gone = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
        }
        if (gone) {
          ::close(fds[i].fd);
          fds[i] = fds.back();
          fds.pop_back();
        } else {
          fds[i].revents = 0;
          ++i;
        }
      }
    }
    for (auto& p : fds) ::close(p.fd);
  }
  std::atomic<bool> stop_{false};
  std::atomic<size_t> opened_{0};
  std::vector<std::thread> threads_;
};

TEST_F(TcpServerTest, FloodOfIdleUnauthenticatedSocketsDoesNotLockOutLogins) {
  ASSERT_GE(raise_fd_limit(), 1024u);
  good_.reset();
  server_.reset();
  StoreServerOptions so;
  so.max_connections = 300;  // fewer than the flood holds: the old server then refused everyone
  start(so);
  Flood flood(server_->port(), 4, 100);
  // The flood holds the server's unauthenticated slots before anyone logs in.
  ASSERT_TRUE(eventually([&] { return server_->connections() >= 250; })) << server_->connections();
  // Each client logs in afresh several times, spread over the flood.
  constexpr int kClients = 8, kLogins = 5;
  std::atomic<int> ok{0};
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      for (int login = 0; login < kLogins; ++login) {
        std::this_thread::sleep_for(100ms);
        StoreOptions o;
        o.token = kToken;
        o.connect_timeout = 8s;  // less than the old 10 s handshake timeout that freed flood slots
        o.io_timeout = 10s;
        auto s = Store::open(server_->url(), o);
        if (!s.ok()) {
          errors[i] = s.status().to_string();
          return;
        }
        const std::string key = fmt::format("client{}/{}", i, login);
        Status st = (*s)->set(key, key);
        auto v = (*s)->get(key);
        if (!st.ok() || v.value_or("?") != key) {
          errors[i] = st.ok() ? v.status().to_string() : st.to_string();
          return;
        }
        ok++;
      }
    });
  }
  for (auto& t : clients) t.join();
  const size_t opened = flood.opened();
  flood.stop();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(errors[i], "") << "client " << i;
  EXPECT_EQ(ok.load(), kClients * kLogins);
  std::printf("flood: %zu sockets opened, %zu evicted by the server, %d of %d logins succeeded\n", opened,
              server_->evicted(), ok.load(), kClients * kLogins);
  EXPECT_GE(opened, 400u);
  EXPECT_GT(server_->evicted(), 0u);  // the flood was churned through, not refused entry
  StoreOptions o;
  o.token = kToken;
  auto after = Store::open(server_->url(), o);
  ASSERT_TRUE(after.ok()) << after.status().to_string();
  EXPECT_EQ((*after)->get("client0/4").value_or("?"), "client0/4");
}

TEST_F(TcpServerTest, ClaimedLengthsAllocateNothingUntilTheBytesArrive) {
  // Authenticated connections whose headers claim the 64 MiB limit and send no body:
  // the server must not reserve 64 MiB for each (the old server held 1.3 GiB for 21).
  constexpr int kConns = 24;
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < kConns; ++i) {
    conns.push_back(std::make_unique<RawConn>(server_->port()));
    ASSERT_TRUE(conns.back()->authenticate(kToken).ok());
  }
  const int64_t before = rss_kib();
  ASSERT_GT(before, 0);
  const auto n = static_cast<uint32_t>(kMaxFrameBytes);
  for (auto& c : conns) {
    c->send_bytes({static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8), static_cast<uint8_t>(n >> 16),
                   static_cast<uint8_t>(n >> 24), 1, 2, 3});
  }
  // Once the good client's request is answered the server has read those headers (they
  // were sent first); sample a while longer to catch a slow loop.
  int64_t peak = 0;
  for (int i = 0; i < 20; ++i) {
    expect_good_client_served(i + 1);
    peak = std::max(peak, rss_kib());
    std::this_thread::sleep_for(10ms);
  }
  std::printf("RSS: %lld KiB before, %lld KiB peak after %d headers claiming %zu bytes\n",
              static_cast<long long>(before), static_cast<long long>(peak), kConns, kMaxFrameBytes);
  EXPECT_LT(peak - before, 200 * 1024) << "RSS grew from " << before << " KiB to " << peak << " KiB";
  EXPECT_EQ(server_->connections(), static_cast<size_t>(kConns + 1));  // still waiting for their bodies
}

TEST_F(TcpServerTest, IdleConnectionsAreClosedAndClientsReconnectTransparently) {
  good_.reset();
  server_.reset();
  StoreServerOptions so;
  so.idle_timeout = 300ms;
  start(so);
  // The server announces the timeout and drops a connection that stays silent.
  RawConn idle(server_->port());
  ASSERT_TRUE(idle.authenticate(kToken).ok());
  EXPECT_EQ(idle.idle_timeout_ms(), 300);
  EXPECT_TRUE(idle.closed_by_server());
  // A parked wait is not idleness: the waiter outlives the idle timeout and is answered.
  RawConn waiter(server_->port());
  ASSERT_TRUE(waiter.authenticate(kToken).ok());
  Request q;
  q.op = Op::kWait;
  q.keys = {"later"};
  q.timeout_ms = 30'000;
  waiter.send_bytes(waiter.seal(encode_request(q)));
  // A lease (renewed every ttl/3) keeps its own connection busy.
  auto lease = good_->hold_lease("alive", "1", 600ms);
  ASSERT_TRUE(lease.ok()) << lease.status().to_string();
  std::this_thread::sleep_for(900ms);  // three idle timeouts
  ASSERT_TRUE(good_->set("later", "now").ok());  // the idle client reconnects transparently
  auto answer = waiter.read_response();
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code, StatusCode::kOk) << answer->message;
  EXPECT_FALSE((*lease)->lost());
  EXPECT_TRUE((*lease)->last_error().ok()) << (*lease)->last_error().to_string();
  EXPECT_EQ(good_->get("alive").value_or("?"), "1");
  // Every call after an idle spell still succeeds.
  for (int round = 1; round <= 3; ++round) {
    std::this_thread::sleep_for(400ms);
    expect_good_client_served(round);
  }
}

// A listening socket on 127.0.0.1 at a port the kernel picks (stored in `port`).
int listen_on_loopback(uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(fd, 8);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  port = ntohs(a.sin_port);
  return fd;
}

// A listener that speaks the protocol without knowing the token: it sends a challenge,
// reads the client's answer and replies with `verdict(challenge nonce, auth)`.
class FakeServer {
 public:
  using Verdict = std::function<Bytes(const Challenge&, const Auth&)>;
  explicit FakeServer(Verdict verdict) : verdict_(std::move(verdict)) {
    listen_ = listen_on_loopback(port_);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
    ::close(listen_);
  }
  std::string url() const { return "tcp://127.0.0.1:" + std::to_string(port_); }
  int answered() const { return answered_.load(); }

 private:
  void serve() {
    const auto deadline = Clock::now() + 30s;
    while (!stop_ && Clock::now() < deadline) {
      pollfd p{listen_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      int fd = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      timeval tv{5, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      Challenge c;
      c.nonce.fill(3);
      Bytes ch = encode_challenge(c);
      ::send(fd, ch.data(), ch.size(), MSG_NOSIGNAL);
      uint8_t buf[512];
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n > static_cast<ssize_t>(kFrameHeaderBytes)) {
        auto a = decode_auth(ByteSpan(buf + kFrameHeaderBytes, static_cast<size_t>(n) - kFrameHeaderBytes));
        if (a.ok()) {
          Bytes v = verdict_(c, *a);
          // (counted before it is sent: the client may act on the answer, and the test
          // read the count, before this thread ran again; seen in CI's ASan pass)
          answered_++;
          ::send(fd, v.data(), v.size(), MSG_NOSIGNAL);
        }
      }
      ::recv(fd, buf, sizeof(buf), 0);  // until the client hangs up (or 5 s)
      ::close(fd);
    }
  }
  Verdict verdict_;
  int listen_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> answered_{0};
  std::thread thread_;
};

TEST(TcpStoreClientTest, ServerWithoutTheTokenIsRefused) {
  StoreOptions o;
  o.token = kToken;
  o.connect_timeout = 3s;
  o.io_timeout = 5s;
  // 1. "OK" in the clear, which is all a server without the token can say (and all
  //    the version-1 client checked).
  {
    FakeServer fake([](const Challenge&, const Auth&) {
      Response ok;
      ok.op = Op::kAuth;
      return encode_response(ok);
    });
    auto s = Store::open(fake.url(), o);
    ASSERT_FALSE(s.ok()) << "the client trusted a server that never proved the token";
    EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().to_string();
    EXPECT_NE(s.status().message().find("did not prove"), std::string::npos) << s.status().to_string();
    EXPECT_EQ(fake.answered(), 1);
  }
  // 2. A welcome sealed with a key from another token.
  {
    FakeServer fake([](const Challenge& c, const Auth& a) {
      Channel ch(session_key("a-different-token-0123", c.nonce, a.nonce), Direction::kServerToClient);
      Response ok;
      ok.op = Op::kAuth;
      return ch.seal(encode_response(ok));
    });
    auto s = Store::open(fake.url(), o);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().to_string();
  }
  // 3. A welcome replayed from another connection (sealed for a different client nonce).
  {
    FakeServer fake([](const Challenge& c, const Auth&) {
      Nonce other{};
      other.fill(1);
      Channel ch(session_key(kToken, c.nonce, other), Direction::kServerToClient);
      Response ok;
      ok.op = Op::kAuth;
      return ch.seal(encode_response(ok));
    });
    auto s = Store::open(fake.url(), o);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().to_string();
  }
}

TEST_F(TcpServerTest, TamperedReplayedReorderedOrUnsealedFramesAreRefused) {
  Request set;
  set.op = Op::kSet;
  set.key = "tampered";
  set.value = "original";
  Request ping;
  ping.op = Op::kPing;
  {  // replayed
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    const Bytes f = c.seal(encode_request(ping));
    c.send_bytes(f);
    auto r = c.read_response();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->code, StatusCode::kOk);
    c.send_bytes(f);
    EXPECT_TRUE(c.closed_by_server());
  }
  {  // tampered: one bit of the value
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    Bytes f = c.seal(encode_request(set));
    f[f.size() - kMacBytes - 9] ^= 0x01;  // inside "original"
    c.send_bytes(f);
    EXPECT_TRUE(c.closed_by_server());
  }
  {  // reordered
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    const Bytes first = c.seal(encode_request(ping));
    const Bytes second = c.seal(encode_request(set));
    c.send_bytes(second);
    EXPECT_TRUE(c.closed_by_server());
  }
  {  // unsealed (a version-1 request after the handshake)
    RawConn c(server_->port());
    ASSERT_TRUE(c.authenticate(kToken).ok());
    c.send_bytes(encode_request(set));
    EXPECT_TRUE(c.closed_by_server());
  }
  EXPECT_EQ(good_->get("tampered").status().code(), StatusCode::kNotFound);
  expect_good_client_served(1);
}

// A man in the middle that relays one connection and flips one bit of the
// `flip_frame`-th frame from the server (0: the challenge).
class FlippingProxy {
 public:
  FlippingProxy(uint16_t server_port, int flip_frame) : server_port_(server_port), flip_frame_(flip_frame) {
    listen_ = listen_on_loopback(port_);
    thread_ = std::thread([this] { relay(); });
  }
  ~FlippingProxy() {
    stop_ = true;
    thread_.join();
    ::close(listen_);
  }
  std::string url() const { return "tcp://127.0.0.1:" + std::to_string(port_); }
  bool flipped() const { return flipped_.load(); }

 private:
  void relay() {
    const auto deadline = Clock::now() + 30s;
    pollfd lp{listen_, POLLIN, 0};
    while (!stop_ && Clock::now() < deadline && ::poll(&lp, 1, 20) <= 0) {
    }
    if (stop_ || Clock::now() >= deadline) return;
    int client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    int server = open_loopback_nonblocking(server_port_);
    pollfd wp{server, POLLOUT, 0};
    ::poll(&wp, 1, 5000);
    Bytes from_server;
    int frames = 0;
    uint8_t buf[65536];
    while (!stop_ && Clock::now() < deadline) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 20) <= 0) continue;
      if (p[0].revents) {
        ssize_t n = ::recv(client, buf, sizeof(buf), MSG_DONTWAIT);
        if (n <= 0) break;
        ::send(server, buf, static_cast<size_t>(n), MSG_NOSIGNAL);
      }
      if (p[1].revents) {
        ssize_t n = ::recv(server, buf, sizeof(buf), MSG_DONTWAIT);
        if (n <= 0) break;
        from_server.insert(from_server.end(), buf, buf + n);
        while (true) {  // forward whole frames, flipping one bit of the chosen one
          auto split = split_frame(from_server, kMaxFrameBytes);
          if (!split.ok() || split->consumed == 0) break;
          Bytes frame(from_server.begin(), from_server.begin() + static_cast<ptrdiff_t>(split->consumed));
          from_server.erase(from_server.begin(), from_server.begin() + static_cast<ptrdiff_t>(split->consumed));
          if (frames++ == flip_frame_) {
            frame[kFrameHeaderBytes + 1] ^= 0x01;  // the status code of a response
            flipped_ = true;
          }
          ::send(client, frame.data(), frame.size(), MSG_NOSIGNAL);
        }
      }
    }
    ::close(client);
    ::close(server);
  }
  uint16_t server_port_;
  int flip_frame_;
  int listen_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> flipped_{false};
  std::thread thread_;
};

TEST_F(TcpServerTest, ClientRefusesATamperedAnswer) {
  ASSERT_TRUE(good_->set("k", "v").ok());
  // Frames from the server: 0 challenge, 1 welcome, 2 the answer to the first request.
  FlippingProxy proxy(server_->port(), 2);
  StoreOptions o;
  o.token = kToken;
  o.connect_timeout = 3s;
  o.io_timeout = 5s;
  auto s = Store::open(proxy.url(), o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  auto v = (*s)->get("k");  // the proxy turns "OK" into another status code
  ASSERT_FALSE(v.ok()) << "accepted a tampered answer: " << *v;
  EXPECT_EQ(v.status().code(), StatusCode::kPeerFailed) << v.status().to_string();
  EXPECT_NE(v.status().message().find("integrity"), std::string::npos) << v.status().to_string();
  EXPECT_TRUE(proxy.flipped());
}

}  // namespace
}  // namespace ferry
