// The sync trace on its own: the recorder, the report's sums derived from it, the one
// JSON serialiser and the Chrome trace events.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <thread>

#include "engine/report_json.h"
#include "engine/schedule.h"
#include "engine/sync_trace.h"

namespace ferry::engine {
namespace {

using std::chrono::microseconds;

TEST(SyncTrace, RecordsRelativeTimesAttemptsAndUncountsAbandonedTransfers) {
  SyncTrace t;
  const auto start = Clock::now();
  t.begin(start);
  t.record(TracePhase::kWait, 0, 1, start + microseconds(10), start + microseconds(30));
  t.record(TracePhase::kReceive, 0, 1, start, start + microseconds(40), TraceLane::kTransport, 100);
  t.new_attempt(false);
  t.record(TracePhase::kReceive, 0, 1, start + microseconds(50), start + microseconds(60), TraceLane::kTransport, 100);
  const auto ev = t.take();
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].t0_ns, 10'000);
  EXPECT_EQ(ev[0].t1_ns, 30'000);
  EXPECT_EQ(ev[0].attempt, 0);
  EXPECT_TRUE(ev[0].counted);  // not a transfer: durations always count
  EXPECT_FALSE(ev[1].counted);
  EXPECT_EQ(ev[2].attempt, 1);
  EXPECT_TRUE(ev[2].counted);
  EXPECT_GT(t.start_unix_ns(), 0);
  t.begin(start);
  EXPECT_TRUE(t.take().empty());
}

TEST(SyncTrace, RecordsFromManyThreads) {
  SyncTrace t;
  const auto start = Clock::now();
  t.begin(start);
  std::vector<std::thread> th;
  for (int k = 0; k < 4; ++k) {
    th.emplace_back([&, k] {
      for (int i = 0; i < 1000; ++i) t.record(TracePhase::kUnpack, i, k, start, start + microseconds(1));
    });
  }
  for (auto& x : th) x.join();
  const auto ev = t.take();
  ASSERT_EQ(ev.size(), 4000u);
  std::map<int, int> per;
  for (const auto& e : ev) ++per[e.peer];
  for (int k = 0; k < 4; ++k) EXPECT_EQ(per[k], 1000);
}

TraceEvent ev(TracePhase p, int g, int peer, int64_t t0_us, int64_t t1_us, TraceLane lane = TraceLane::kNone,
              uint64_t bytes = 0, bool into_params = false, bool counted = true) {
  TraceEvent e;
  e.phase = p;
  e.group = g;
  e.peer = peer;
  e.t0_ns = t0_us * 1000;
  e.t1_ns = t1_us * 1000;
  e.lane = lane;
  e.bytes = bytes;
  e.into_params = into_params;
  e.counted = counted;
  return e;
}

TEST(SyncTrace, ProducerSumsAreDerivedFromTheTrace) {
  SyncReport r;
  r.bytes_sent = 12345;  // stale: replaced
  r.trace = {ev(TracePhase::kWait, 0, -1, 0, 1000),
             ev(TracePhase::kMaterialize, 0, -1, 1000, 3000),
             ev(TracePhase::kPack, 0, -1, 3000, 3500),
             ev(TracePhase::kSend, 0, 0, 3500, 5000, TraceLane::kTransport, 700),
             ev(TracePhase::kSend, 0, 0, 3500, 5000, TraceLane::kInPlace, 300),
             ev(TracePhase::kSend, 0, 1, 3500, 5500, TraceLane::kTransport, 1000),
             ev(TracePhase::kPack, 1, -1, 5000, 5500),
             ev(TracePhase::kWait, -1, -1, 6000, 8000)};
  derive_report_sums(r);
  EXPECT_EQ(r.bytes_sent, 2000u);
  EXPECT_EQ(r.sent_in_place, 300u);
  EXPECT_EQ(r.bytes_received, 0u);
  EXPECT_EQ(r.bytes_per_peer, (std::map<int, uint64_t>{{0, 1000}, {1, 1000}}));
  EXPECT_DOUBLE_EQ(r.wait_seconds, 3e-3);
  EXPECT_DOUBLE_EQ(r.materialize_seconds, 2e-3);
  EXPECT_DOUBLE_EQ(r.pack_seconds, 1e-3);
  EXPECT_DOUBLE_EQ(r.read_seconds, 0);
}

TEST(SyncTrace, ConsumerSumsCountOnlyTheTransfersOfTheAttemptThatLanded) {
  SyncReport r;
  r.trace = {ev(TracePhase::kReceive, 0, 0, 0, 10, TraceLane::kTransport, 500, false, /*counted=*/false),
             ev(TracePhase::kWait, 0, 0, 0, 5),
             ev(TracePhase::kRead, 0, 0, 5, 10),
             ev(TracePhase::kReceive, 0, 0, 20, 30, TraceLane::kTransport, 400),
             ev(TracePhase::kReceive, 0, 0, 20, 30, TraceLane::kInPlace, 100, /*into_params=*/true),
             ev(TracePhase::kReceive, 1, 2, 30, 40, TraceLane::kCudaIpc, 50),
             ev(TracePhase::kUnpack, 0, -1, 30, 45),
             ev(TracePhase::kPost, 0, -1, 45, 46)};
  derive_report_sums(r);
  EXPECT_EQ(r.bytes_received, 550u);
  EXPECT_EQ(r.received_into_params, 100u);
  EXPECT_EQ(r.received_via_cuda_ipc, 50u);
  EXPECT_EQ(r.bytes_sent, 0u);
  EXPECT_EQ(r.bytes_per_peer, (std::map<int, uint64_t>{{0, 500}, {2, 50}}));
  EXPECT_DOUBLE_EQ(r.wait_seconds, 5e-6);
  EXPECT_DOUBLE_EQ(r.read_seconds, 5e-6);
  EXPECT_DOUBLE_EQ(r.unpack_seconds, 15e-6);
  EXPECT_DOUBLE_EQ(r.post_seconds, 1e-6);
}

TEST(SyncTrace, ReceivesAreSplitByProducerLaneAndDestination) {
  ParamTable::Param param{};
  ConsumerGroupSchedule gs;
  auto read = [&](uint32_t p, uint64_t len, int32_t region, bool into) {
    SubRead sr;
    sr.producer = p;
    sr.length = len;
    sr.region = region;
    sr.param = into ? &param : nullptr;
    gs.reads.push_back(sr);
  };
  read(0, 10, -1, false);
  read(0, 20, -1, false);
  read(0, 5, 3, true);
  read(1, 7, -1, true);
  SyncTrace t;
  const auto start = Clock::now();
  t.begin(start);
  record_receives(t, 4, gs, false, start, start + microseconds(3));
  record_receives(t, 5, gs, true, start, start + microseconds(3));
  auto evs = t.take();
  std::map<std::tuple<int, int, TraceLane, bool>, uint64_t> got;
  for (const auto& e : evs) {
    EXPECT_EQ(e.phase, TracePhase::kReceive);
    EXPECT_TRUE(got.emplace(std::make_tuple(e.group, e.peer, e.lane, e.into_params), e.bytes).second) << "twice";
  }
  using K = std::tuple<int, int, TraceLane, bool>;
  EXPECT_EQ(got, (std::map<K, uint64_t>{{K{4, 0, TraceLane::kTransport, false}, 30},
                                        {K{4, 0, TraceLane::kInPlace, true}, 5},
                                        {K{4, 1, TraceLane::kTransport, true}, 7},
                                        {K{5, 0, TraceLane::kCudaIpc, false}, 30},
                                        {K{5, 0, TraceLane::kCudaIpc, true}, 5},
                                        {K{5, 1, TraceLane::kCudaIpc, true}, 7}}));
}

TEST(SyncReportJson, OneKeySetOkOrFailed) {
  SyncReport ok;
  ok.version = 3;
  ok.trace = {ev(TracePhase::kReceive, 0, 1, 0, 10, TraceLane::kTransport, 64)};
  derive_report_sums(ok);
  ok.seconds = 0.5;
  SyncReport failed = ok;
  failed.status = peer_failed("producer 1 failed");
  const auto a = sync_report_json(ok), b = sync_report_json(failed);
  std::set<std::string> ka, kb;
  for (const auto& [k, v] : a.items()) ka.insert(k);
  for (const auto& [k, v] : b.items()) kb.insert(k);
  EXPECT_EQ(ka, kb);
  EXPECT_TRUE(a["ok"].get<bool>());
  EXPECT_TRUE(a["error"].is_null());
  EXPECT_EQ(a["bytes"], 64u);
  EXPECT_EQ(a["bytes_per_peer"]["1"], 64u);
  EXPECT_FALSE(b["ok"].get<bool>());
  EXPECT_EQ(b["code"], "PeerFailed");
  EXPECT_NE(b["error"].get<std::string>().find("producer 1 failed"), std::string::npos);
  EXPECT_EQ(b["seconds"], 0.5);  // a failed sync's JSON carries seconds and bytes too
  EXPECT_EQ(b["bytes"], 64u);
  EXPECT_EQ(nlohmann::json::parse(ok.to_json()), a);
}

TEST(ChromeTrace, SlicesOfATrackNeverOverlapAndBytesInFlightReturnToZero) {
  SyncReport r;
  r.start_unix_ns = 1'000'000'000;
  // Sends to consumer 0 of groups 0 and 1 overlap (two staging slots): two sub-tracks.
  r.trace = {ev(TracePhase::kPack, 0, -1, 0, 10),
             ev(TracePhase::kSend, 0, 0, 10, 50, TraceLane::kTransport, 100),
             ev(TracePhase::kPack, 1, -1, 10, 20),
             ev(TracePhase::kSend, 1, 0, 20, 60, TraceLane::kTransport, 200),
             ev(TracePhase::kSend, 2, 0, 60, 70, TraceLane::kTransport, 300)};
  nlohmann::json events = nlohmann::json::array();
  const ChromeProcess p = chrome_process(true, 0);
  for (auto& m : chrome_process_metadata(p, 1)) events.push_back(m);
  append_chrome_events(events, p, r);
  std::map<int, std::vector<std::pair<double, double>>> by_tid;
  std::map<int, std::string> names;
  int64_t last_counter = -1, max_counter = 0;
  uint64_t bytes = 0;
  for (const auto& e : events) {
    EXPECT_EQ(e["pid"], p.pid);
    if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") {
      by_tid[e["tid"].get<int>()].emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
      if (e["cat"] == "transfer") bytes += e["args"]["bytes"].get<uint64_t>();
    }
    if (e["ph"] == "C") {
      last_counter = e["args"]["bytes"].get<int64_t>();
      max_counter = std::max(max_counter, last_counter);
    }
  }
  EXPECT_EQ(bytes, 600u);
  EXPECT_EQ(last_counter, 0);
  EXPECT_EQ(max_counter, 300);
  for (auto& [tid, spans] : by_tid) {
    EXPECT_TRUE(names.count(tid)) << "track " << tid << " has no name";
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << names[tid];
  }
  EXPECT_EQ(by_tid.size(), 3u);  // sync thread, and the lane to consumer 0 split in two
  EXPECT_EQ(events[0]["args"]["name"], "trainer 0");
  EXPECT_DOUBLE_EQ(by_tid.begin()->second.front().first, 1'000'000.0);  // microseconds since the epoch
}

}  // namespace
}  // namespace ferry::engine
