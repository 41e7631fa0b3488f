// The embedded TCP store server against hostile and broken clients: random bytes,
// oversize lengths, truncated frames, bad MACs, silent and vanishing clients. Each must
// cost only its own connection; the server keeps serving everyone else.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include "ferry/store.h"
#include "store/tcp/protocol.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using namespace store_tcp;
using Clock = std::chrono::steady_clock;

constexpr const char* kToken = "tcp-test-token";

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

  // Completes the handshake; returns the verdict.
  Status authenticate(const std::string& token) {
    Challenge c = read_challenge();
    Auth a;
    a.mac = auth_mac(token, c.nonce);
    send_bytes(encode_auth(a));
    auto f = read_frame();
    if (!f) return unavailable("no verdict");
    auto r = decode_response(*f);
    if (!r.ok()) return r.status();
    return r->status();
  }

  std::optional<Response> call(const Request& q) {
    send_bytes(encode_request(q));
    auto f = read_frame();
    if (!f) return std::nullopt;
    auto r = decode_response(*f);
    if (!r.ok()) return std::nullopt;
    return *r;
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
    Bytes frame = encode_request(q);
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
    c.send_bytes(frame_of(p));
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
    c.send_bytes(encode_request(q));
    EXPECT_TRUE(eventually([&] { return server_->connections() == 2; }));
  }  // hangs up mid-wait
  EXPECT_TRUE(eventually([&] { return server_->connections() == 1; })) << server_->connections();
  // The abandoned waiter is not woken into a dead session.
  ASSERT_TRUE(good_->set("never", "now").ok());
  expect_good_client_served(1);
}

TEST_F(TcpServerTest, ConnectionLimit) {
  good_.reset();
  server_.reset();
  StoreServerOptions so;
  so.max_connections = 3;
  start(so);  // the good client is connection 1
  RawConn a(server_->port()), b(server_->port());
  a.read_challenge();
  b.read_challenge();
  EXPECT_TRUE(eventually([&] { return server_->connections() == 3; }));
  RawConn over(server_->port());
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
  so.token = "t";
  s = StoreServer::start(so);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  // Port taken.
  so.host = "127.0.0.1";
  so.port = server_->port();
  s = StoreServer::start(so);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kIoError) << s.status().to_string();
}

}  // namespace
}  // namespace ferry
