// SyncMetrics against the reports it was told (ranks as threads, and reports made by hand
// for the outcomes a healthy job never has), and MetricsEndpoint answering real HTTP GETs.
// The scrape by a real Prometheus server is tests/metrics/prometheus_scrape_test.py.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "engine/engine_test_util.h"
#include "ferry/metrics.h"
#include "ferry/store.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using engine_tests::Cluster;

// Prometheus' text format as series -> value: `name{l1="v1",l2="v2"}` (labels in the
// order prometheus-cpp writes them: sorted by name) or `name` without labels.
std::map<std::string, double> parse(const std::string& text) {
  std::map<std::string, double> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

double value(const std::map<std::string, double>& m, const std::string& series) {
  auto it = m.find(series);
  EXPECT_NE(it, m.end()) << "no series " << series;
  return it == m.end() ? -1 : it->second;
}

std::string of(const char* name, const std::string& side, int rank, const std::string& extra = "") {
  // Label order: the extra label's name sorts where it sorts; callers pass it whole.
  std::map<std::string, std::string> l{{"side", side}, {"rank", std::to_string(rank)}};
  if (!extra.empty()) {
    const size_t eq = extra.find('=');
    l[extra.substr(0, eq)] = extra.substr(eq + 1);
  }
  std::string s = std::string(name) + "{";
  bool first = true;
  for (const auto& [k, v] : l) {
    s += (first ? "" : ",") + k + "=\"" + v + "\"";
    first = false;
  }
  return s + "}";
}

// Three syncs of a delta job with shadow commits, every rank telling one SyncMetrics: each
// count, byte sum and version equals what the ranks' own reports say.
TEST(SyncMetrics, EqualTheReportsOfEveryRank) {
  Cluster k({engine_tests::Backend::kInproc, engine_tests::Mode::kPull, /*shadow=*/true});
  k.eo.delta = true;
  k.eo.delta_same_host = true;  // (one host: patches over shared memory too)
  k.changes = {0.01, false};
  auto metrics = SyncMetrics::create();
  ASSERT_TRUE(metrics.ok()) << metrics.status().to_string();
  k.eo.sink = *metrics;
  ASSERT_TRUE(k.start(engine_tests::cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  std::map<std::pair<std::string, int>, SyncReport> sums;  // (side, rank) -> sums over syncs
  std::map<std::pair<std::string, int>, std::map<std::string, uint64_t>> phase_count;
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    auto add = [&](const std::string& side, int rank, const SyncReport& r) {
      SyncReport& s = sums[{side, rank}];
      s.bytes_sent += r.bytes_sent;
      s.sent_in_place += r.sent_in_place;
      s.bytes_received += r.bytes_received;
      s.patch_bytes += r.patch_bytes;
      s.patched_dense_bytes += r.patched_dense_bytes;
      s.seconds += r.seconds;
      s.commit_seconds += r.commit_seconds;
      s.version = r.version;
      s.memory = r.memory;
    };
    for (size_t p = 0; p < o.p.size(); ++p) add("producer", static_cast<int>(p), **o.p[p]);
    for (size_t c = 0; c < o.c.size(); ++c) add("consumer", static_cast<int>(c), **o.c[c]);
  }
  const auto m = parse((*metrics)->text());
  for (const auto& [who, s] : sums) {
    const auto& [side, rank] = who;
    SCOPED_TRACE(side + " " + std::to_string(rank));
    EXPECT_EQ(value(m, of("ferry_weight_update_operations_total", side, rank, "status=success")), 3);
    EXPECT_EQ(value(m, of("ferry_weight_update_operations_total", side, rank, "status=failure")), 0);
    EXPECT_EQ(value(m, of("ferry_weight_update_operation_duration_seconds_count", side, rank)), 3);
    EXPECT_NEAR(value(m, of("ferry_weight_update_operation_duration_seconds_sum", side, rank)), s.seconds, 1e-9);
    EXPECT_EQ(value(m, of("ferry_weight_update_in_flight", side, rank)), 0);
    // The stage record: every stage observed once a sync, their sums adding to the seconds'.
    double staged = 0;
    for (const char* st : {"rendezvous", "routing", "registration", "wire", "receive", "transform", "commit",
                           "unattributed"}) {
      EXPECT_EQ(value(m, of("ferry_sync_stage_seconds_count", side, rank, std::string("stage=") + st)), 3) << st;
      staged += value(m, of("ferry_sync_stage_seconds_sum", side, rank, std::string("stage=") + st));
    }
    EXPECT_NEAR(staged, s.seconds, 1e-6);
    EXPECT_EQ(value(m, of("ferry_sync_version", side, rank)), 3);
    EXPECT_EQ(value(m, of("ferry_synced_version", side, rank)), 3);
    EXPECT_EQ(value(m, of("ferry_memory_bytes", side, rank, "kind=metadata")),
              static_cast<double>(s.memory.metadata));
    // Bytes: the lanes add up to the report's totals.
    double sent = 0, received = 0;
    for (const auto& [series, v] : m) {
      if (series.rfind("ferry_sent_bytes_total{", 0) == 0 &&
          series.find("rank=\"" + std::to_string(rank) + "\"") != std::string::npos &&
          series.find("side=\"" + side + "\"") != std::string::npos)
        sent += v;
      if (series.rfind("ferry_received_bytes_total{", 0) == 0 &&
          series.find("rank=\"" + std::to_string(rank) + "\"") != std::string::npos &&
          series.find("side=\"" + side + "\"") != std::string::npos)
        received += v;
    }
    EXPECT_EQ(sent, static_cast<double>(s.bytes_sent));
    EXPECT_EQ(received, static_cast<double>(s.bytes_received));
    if (side == "producer") {
      EXPECT_GT(s.patch_bytes, 0u) << "the job sent no patch: the delta lane is not exercised";
      EXPECT_EQ(value(m, of("ferry_sent_bytes_total", side, rank, "lane=patch")), static_cast<double>(s.patch_bytes));
      EXPECT_EQ(value(m, of("ferry_patched_dense_bytes_total", side, rank)),
                static_cast<double>(s.patched_dense_bytes));
    } else {
      EXPECT_EQ(value(m, of("ferry_live_version", side, rank)), 3);
      EXPECT_EQ(value(m, of("ferry_sync_committed", side, rank)), 1);
      EXPECT_EQ(value(m, of("ferry_commit_pause_seconds_count", side, rank)), 3);
      EXPECT_NEAR(value(m, of("ferry_commit_pause_seconds_sum", side, rank)), s.commit_seconds, 1e-9);
      EXPECT_EQ(value(m, of("ferry_received_bytes_total", side, rank, "lane=patch")),
                static_cast<double>(s.patch_bytes));
    }
  }
}

// The outcomes a healthy job does not have, from reports made by hand: a producer whose
// consumers missed the version, a failed consumer sync, and control events by kind.
TEST(SyncMetrics, CountEachOutcomeAndEventKind) {
  auto metrics = SyncMetrics::create();
  ASSERT_TRUE(metrics.ok());
  SyncMetrics& sm = **metrics;
  const SyncSource producer{"producer", 1, 7}, consumer{"consumer", 4, 7};
  sm.on_begin(producer);
  sm.on_begin(consumer);
  {
    const auto m = parse(sm.text());
    EXPECT_EQ(value(m, of("ferry_weight_update_in_flight", "producer", 1)), 1);
    EXPECT_EQ(value(m, of("ferry_weight_update_in_flight", "consumer", 4)), 1);
  }
  ControlEvent drop;
  drop.kind = ControlKind::kDrop;
  drop.peer = 4;
  sm.on_control(producer, drop);
  ControlEvent missed = drop;
  missed.kind = ControlKind::kMissed;
  sm.on_control(producer, missed);
  SyncReport pr;
  pr.version = 7;
  pr.seconds = 0.5;
  pr.missed = {4};
  sm.on_report(producer, pr);
  SyncReport cr;
  cr.version = 7;
  cr.seconds = 0.25;
  cr.status = peer_failed("producer 1 dropped this consumer");
  cr.live_version = 6;
  sm.on_report(consumer, cr);
  const auto m = parse(sm.text());
  EXPECT_EQ(value(m, of("ferry_weight_update_operations_total", "producer", 1, "status=missed")), 1);
  EXPECT_EQ(value(m, of("ferry_weight_update_operations_total", "producer", 1, "status=success")), 0);
  EXPECT_EQ(value(m, of("ferry_weight_update_operations_total", "consumer", 4, "status=failure")), 1);
  EXPECT_EQ(value(m, of("ferry_weight_update_operations_total", "consumer", 4, "status=success")), 0);
  EXPECT_EQ(m.count(of("ferry_weight_update_operations_total", "consumer", 4, "status=missed")), 0u);
  EXPECT_EQ(value(m, of("ferry_weight_update_in_flight", "producer", 1)), 0);
  EXPECT_EQ(value(m, of("ferry_weight_update_in_flight", "consumer", 4)), 0);
  EXPECT_EQ(value(m, of("ferry_control_events_total", "producer", 1, "kind=drop")), 1);
  EXPECT_EQ(value(m, of("ferry_control_events_total", "producer", 1, "kind=missed")), 1);
  // The failed sync's version is begun, not synced; the live params still hold 6.
  EXPECT_EQ(value(m, of("ferry_sync_version", "consumer", 4)), 7);
  EXPECT_EQ(m.count(of("ferry_synced_version", "consumer", 4)), 0u);
  EXPECT_EQ(value(m, of("ferry_live_version", "consumer", 4)), 6);
  EXPECT_EQ(value(m, of("ferry_sync_committed", "consumer", 4)), 0);
  EXPECT_EQ(m.count(of("ferry_commit_pause_seconds_count", "consumer", 4)), 0u);
}

// Into an application's registry: ferry's families beside the application's own.
TEST(SyncMetrics, GoIntoAnApplicationsRegistry) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("app_requests_total").Help("the application's own").Register(*registry).Add({});
  auto metrics = SyncMetrics::create(registry);
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ((*metrics)->registry(), registry);
  (*metrics)->on_begin({"consumer", 0, 1});
  const std::string text = (*metrics)->text();
  EXPECT_NE(text.find("app_requests_total"), std::string::npos) << text;
  EXPECT_NE(text.find("ferry_weight_update_in_flight"), std::string::npos) << text;
  // A second SyncMetrics in the same registry shares the families (Registry merges them).
  auto again = SyncMetrics::create(registry);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
}

// GET path from 127.0.0.1:port; the whole response (headers and body).
std::string http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    ADD_FAILURE() << "connect to port " << port << " failed";
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(MetricsEndpoint, ServesTheRegistryAndTheStoreAndCountsScrapes) {
  auto metrics = SyncMetrics::create();
  ASSERT_TRUE(metrics.ok());
  (*metrics)->on_begin({"producer", 0, 5});
  auto ep = MetricsEndpoint::start("127.0.0.1:0", (*metrics)->registry());
  ASSERT_TRUE(ep.ok()) << ep.status().to_string();
  MetricsEndpoint& e = **ep;
  ASSERT_GT(e.port(), 0);
  EXPECT_EQ(e.url(), "http://127.0.0.1:" + std::to_string(e.port()) + "/metrics");
  EXPECT_EQ(e.scrapes(), 0u);
  EXPECT_FALSE(e.wait_fresh_scrape(1ms));
  // Scraped over and over (bounded) until the wait has seen one that began after it did.
  std::atomic<bool> seen{false};
  std::string first;
  std::thread scraper([&] {
    for (int i = 0; i < 500 && !seen; ++i) {
      first = http_get(e.port(), "/metrics");
      std::this_thread::sleep_for(10ms);
    }
  });
  EXPECT_TRUE(e.wait_fresh_scrape(60s));
  seen = true;
  scraper.join();
  EXPECT_NE(first.find("200 OK"), std::string::npos) << first;
  EXPECT_NE(first.find("ferry_sync_version{rank=\"0\",side=\"producer\"} 5"), std::string::npos) << first;
  const uint64_t scraped = e.scrapes();
  EXPECT_GE(scraped, 1u);
  // The store's counters, read from the server at each scrape.
  StoreServerOptions so;
  so.token = "metrics-test-token-0123456789";
  auto server = StoreServer::start(so);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  ASSERT_TRUE(e.add(store_server_metrics(**server)).ok());
  StoreOptions o;
  o.token = so.token;
  auto client = Store::open((*server)->url(), o);
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  ASSERT_TRUE((*client)->set("k", "v").ok());
  const std::string second = http_get(e.port(), "/metrics");
  const size_t body = second.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos) << second;
  const auto m = parse(second.substr(body + 4));
  bool connected = false;
  for (const auto& [series, v] : m) connected |= series == "ferry_store_connections" && v >= 1;
  EXPECT_TRUE(connected) << "no ferry_store_connections >= 1";
  EXPECT_EQ(m.count("ferry_store_refused_proofs_total"), 1u);
  EXPECT_EQ(e.scrapes(), scraped + 1);
  ep->reset();  // (the endpoint stops before the server it reads goes)
}

TEST(MetricsEndpoint, ABadOrTakenAddressIsAnError) {
  auto registry = std::make_shared<prometheus::Registry>();
  for (const char* bad : {"", "host:", "127.0.0.1:70000", "127.0.0.1:port", ":-1"}) {
    auto ep = MetricsEndpoint::start(bad, registry);
    ASSERT_FALSE(ep.ok()) << bad;
    EXPECT_EQ(ep.status().code(), StatusCode::kInvalidArgument) << bad << ": " << ep.status().to_string();
  }
  auto first = MetricsEndpoint::start("127.0.0.1:0", registry);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto second = MetricsEndpoint::start("127.0.0.1:" + std::to_string((*first)->port()), registry);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kIoError) << second.status().to_string();
  EXPECT_NE(second.status().message().find(std::to_string((*first)->port())), std::string::npos)
      << second.status().to_string();
}

}  // namespace
}  // namespace ferry
