// SyncMetrics, the store's metrics and MetricsEndpoint over prometheus-cpp (ferry/metrics.h;
// docs/metrics.md lists every metric). The names follow Prometheus' conventions (base
// units, _total for counters) and vLLM's weight-update metrics where they mean the same.
#include "ferry/metrics.h"

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "ferry/store.h"
#include "ferry/trace.h"

namespace ferry {

namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;
using prometheus::Labels;

// The commit pause a serving engine sees: microseconds (a pointer swap) to seconds (a
// shadow copied back).
const Histogram::BucketBoundaries kPauseBuckets = {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                                                   0.05, 0.1,    0.25, 0.5,  1,      2.5,  5,    10};
// A phase of a sync, summed over its groups: from a millisecond up.
const Histogram::BucketBoundaries kPhaseBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                   2.5,   5,      10,    25,   50,    100,  250, 600};

Labels rank_labels(const SyncSource& from) { return {{"side", from.side}, {"rank", std::to_string(from.rank)}}; }

Labels with(Labels l, const char* name, std::string value) {
  l.emplace(name, std::move(value));
  return l;
}

}  // namespace

struct SyncMetrics::Impl {
  std::shared_ptr<prometheus::Registry> registry;
  Family<Counter>* operations = nullptr;
  Family<Histogram>* duration = nullptr;
  Family<Gauge>* in_flight = nullptr;
  Family<Histogram>* phase = nullptr;
  Family<Histogram>* stage = nullptr;
  Family<Histogram>* pause = nullptr;
  Family<Counter>* sent = nullptr;
  Family<Counter>* received = nullptr;
  Family<Counter>* patches = nullptr;
  Family<Counter>* patched_dense = nullptr;
  Family<Counter>* delta_elements = nullptr;
  Family<Counter>* delta_changed = nullptr;
  Family<Counter>* quantized = nullptr;
  Family<Counter>* events = nullptr;
  Family<Gauge>* sync_version = nullptr;
  Family<Gauge>* synced_version = nullptr;
  Family<Gauge>* live_version = nullptr;
  Family<Gauge>* committed = nullptr;
  Family<Gauge>* memory = nullptr;
  Family<Gauge>* last_seconds = nullptr;

  void report(const SyncSource& from, const SyncReport& r);
};

Result<std::shared_ptr<SyncMetrics>> SyncMetrics::create(std::shared_ptr<prometheus::Registry> registry) {
  auto m = std::make_unique<Impl>();
  m->registry = registry ? std::move(registry) : std::make_shared<prometheus::Registry>();
  prometheus::Registry& reg = *m->registry;
  try {
    m->operations = &prometheus::BuildCounter()
                         .Name("ferry_weight_update_operations_total")
                         .Help("Syncs by side, rank and status: success (this side finished and, on a producer, every "
                               "consumer it serves committed), missed (a producer finished but consumers it serves "
                               "did not commit), failure")
                         .Register(reg);
    m->duration = &prometheus::BuildHistogram()
                       .Name("ferry_weight_update_operation_duration_seconds")
                       .Help("Wall time of each sync() (SyncReport seconds), whatever its outcome")
                       .Register(reg);
    m->in_flight = &prometheus::BuildGauge()
                        .Name("ferry_weight_update_in_flight")
                        .Help("Syncs begun and not yet returned")
                        .Register(reg);
    m->phase = &prometheus::BuildHistogram()
                    .Name("ferry_sync_phase_seconds")
                    .Help("Seconds a sync spent in each phase (ferry/trace.h TracePhase: materialize, pack, wait, "
                          "read, unpack, post, commit...), summed over its groups; phases overlap")
                    .Register(reg);
    m->stage = &prometheus::BuildHistogram()
                    .Name("ferry_sync_stage_seconds")
                    .Help("The stage record of each sync (SyncReport stages: rendezvous, routing, registration, wire, "
                          "receive, transform, commit, unattributed): one at a time, summing to the sync's seconds")
                    .Register(reg);
    m->pause = &prometheus::BuildHistogram()
                    .Name("ferry_commit_pause_seconds")
                    .Help("Consumer: the commit of each committed sync (SyncReport commit_seconds), the pause a "
                          "serving engine sees")
                    .Register(reg);
    m->sent = &prometheus::BuildCounter()
                   .Name("ferry_sent_bytes_total")
                   .Help("Bytes this rank sent, by lane (transport, in_place, cuda_ipc, patch, relay); each consumer's "
                         "share counted")
                   .Register(reg);
    m->received = &prometheus::BuildCounter()
                       .Name("ferry_received_bytes_total")
                       .Help("Bytes this rank received, by lane (transport, in_place, cuda_ipc, patch, relay)")
                       .Register(reg);
    m->patches = &prometheus::BuildCounter()
                      .Name("ferry_patches_total")
                      .Help("Delta patches sent (producer) or received (consumer), one per group and peer")
                      .Register(reg);
    m->patched_dense = &prometheus::BuildCounter()
                            .Name("ferry_patched_dense_bytes_total")
                            .Help("Producer: the dense bytes its patches stood for")
                            .Register(reg);
    m->delta_elements = &prometheus::BuildCounter()
                             .Name("ferry_delta_compared_elements_total")
                             .Help("Producer: elements compared with its kept copy")
                             .Register(reg);
    m->delta_changed = &prometheus::BuildCounter()
                            .Name("ferry_delta_changed_elements_total")
                            .Help("Producer: of those, elements that changed")
                            .Register(reg);
    m->quantized = &prometheus::BuildCounter()
                        .Name("ferry_quantized_bytes_total")
                        .Help("Producer: FP8 values and scales it quantised and staged")
                        .Register(reg);
    m->events = &prometheus::BuildCounter()
                     .Name("ferry_control_events_total")
                     .Help("Control decisions by kind (drop, missed, failover, follow, rejoin, restart, relay-lost, "
                           "relay-unreached, repair, republish, store, note, weights: ferry/trace.h ControlKind)")
                     .Register(reg);
    m->sync_version = &prometheus::BuildGauge()
                           .Name("ferry_sync_version")
                           .Help("The version of the latest sync begun")
                           .Register(reg);
    m->synced_version = &prometheus::BuildGauge()
                             .Name("ferry_synced_version")
                             .Help("The version of the latest sync that succeeded on this rank")
                             .Register(reg);
    m->live_version = &prometheus::BuildGauge()
                           .Name("ferry_live_version")
                           .Help("Consumer: the version its live params hold (absent until one is committed)")
                           .Register(reg);
    m->committed = &prometheus::BuildGauge()
                        .Name("ferry_sync_committed")
                        .Help("Consumer: 1 when the latest sync's version was committed, else 0 (received and held "
                              "for commit(), or failed)")
                        .Register(reg);
    m->memory = &prometheus::BuildGauge()
                     .Name("ferry_memory_bytes")
                     .Help("The engine's memory by kind as of the latest sync (MemoryUse: staging_ring, receive_ring, "
                           "shadow, kept_copy, metadata, transport_allowance, registered_in_place, own_params)")
                     .Register(reg);
    m->last_seconds = &prometheus::BuildGauge()
                           .Name("ferry_last_sync_seconds")
                           .Help("Wall time of the latest sync")
                           .Register(reg);
  } catch (const std::exception& e) {
    // A family of one of these names and another type is already in the registry.
    return invalid_argument("metrics: registering ferry's metrics: {}", e.what());
  }
  return std::shared_ptr<SyncMetrics>(new SyncMetrics(std::move(m)));
}

SyncMetrics::SyncMetrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SyncMetrics::~SyncMetrics() = default;

const std::shared_ptr<prometheus::Registry>& SyncMetrics::registry() const { return impl_->registry; }

std::string SyncMetrics::text() const {
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

void SyncMetrics::on_begin(const SyncSource& from) {
  const Labels l = rank_labels(from);
  impl_->in_flight->Add(l).Increment();
  impl_->sync_version->Add(l).Set(static_cast<double>(from.version));
}

void SyncMetrics::on_control(const SyncSource& from, const ControlEvent& event) {
  impl_->events->Add(with(rank_labels(from), "kind", std::string(control_kind_name(event.kind)))).Increment();
}

void SyncMetrics::on_report(const SyncSource& from, const SyncReport& report) { impl_->report(from, report); }

void SyncMetrics::on_commit(const SyncSource& from, double seconds) {
  const Labels l = rank_labels(from);
  impl_->committed->Add(l).Set(1);
  impl_->pause->Add(l, kPauseBuckets).Observe(seconds);
  impl_->live_version->Add(l).Set(static_cast<double>(from.version));
}

void SyncMetrics::Impl::report(const SyncSource& from, const SyncReport& r) {
  const Labels l = rank_labels(from);
  const bool consumer = std::string_view(from.side) == "consumer";
  const char* status = !r.status.ok() ? "failure" : r.missed.empty() ? "success" : "missed";
  // Every status's series exists from the first report, so a rate() over it starts at 0.
  for (const char* s : {"success", "missed", "failure"}) {
    if (consumer && std::string_view(s) == "missed") continue;
    Counter& c = operations->Add(with(l, "status", s));
    if (std::string_view(s) == status) c.Increment();
  }
  const std::vector<double> sync_buckets(std::begin(kSyncSecondsBuckets), std::end(kSyncSecondsBuckets));
  duration->Add(l, sync_buckets).Observe(r.seconds);
  last_seconds->Add(l).Set(r.seconds);
  in_flight->Add(l).Decrement();
  if (r.status.ok()) synced_version->Add(l).Set(static_cast<double>(r.version));

  // Bytes by lane and phase seconds from the trace (the report's own sums come from it).
  std::map<std::string_view, uint64_t> sent_by, received_by;
  std::map<std::string_view, int64_t> phase_ns;
  uint64_t patch_count = 0;
  for (const TraceEvent& e : r.trace) {
    if (!e.is_transfer()) {
      phase_ns[trace_phase_name(e.phase)] += e.t1_ns - e.t0_ns;
      continue;
    }
    if (!e.counted) continue;
    (e.phase == TracePhase::kSend ? sent_by : received_by)[trace_lane_name(e.lane)] += e.bytes;
    if (e.lane == TraceLane::kPatch) ++patch_count;
  }
  for (const auto& [lane, bytes] : sent_by) sent->Add(with(l, "lane", std::string(lane))).Increment(static_cast<double>(bytes));
  for (const auto& [lane, bytes] : received_by)
    received->Add(with(l, "lane", std::string(lane))).Increment(static_cast<double>(bytes));
  for (const auto& [name, ns] : phase_ns)
    phase->Add(with(l, "phase", std::string(name)), kPhaseBuckets).Observe(static_cast<double>(ns) * 1e-9);
  for (const auto& [name, secs] : r.stages.named()) stage->Add(with(l, "stage", std::string(name)), sync_buckets).Observe(secs);
  if (patch_count) patches->Add(l).Increment(static_cast<double>(patch_count));
  if (r.patched_dense_bytes) patched_dense->Add(l).Increment(static_cast<double>(r.patched_dense_bytes));
  if (r.delta_elements) delta_elements->Add(l).Increment(static_cast<double>(r.delta_elements));
  if (r.delta_changed) delta_changed->Add(l).Increment(static_cast<double>(r.delta_changed));
  if (r.quantized_bytes) quantized->Add(l).Increment(static_cast<double>(r.quantized_bytes));

  if (consumer) {
    committed->Add(l).Set(r.committed ? 1 : 0);
    if (r.committed) pause->Add(l, kPauseBuckets).Observe(r.commit_seconds);
    if (r.live_version) live_version->Add(l).Set(static_cast<double>(*r.live_version));
  }
  const std::pair<const char*, uint64_t> kinds[] = {
      {"staging_ring", r.memory.staging_ring}, {"receive_ring", r.memory.receive_ring},
      {"shadow", r.memory.shadow},             {"kept_copy", r.memory.kept_copy},
      {"metadata", r.memory.metadata},         {"transport_allowance", r.memory.transport_allowance},
      {"registered_in_place", r.memory.registered_in_place}, {"own_params", r.memory.own_params}};
  if (r.memory.metadata != 0) {  // (a sync that failed before it knew its routes has none)
    for (const auto& [kind, bytes] : kinds) memory->Add(with(l, "kind", kind)).Set(static_cast<double>(bytes));
  }
}

// ---- the store's metrics -------------------------------------------------------------

namespace {

class StoreServerMetrics final : public prometheus::Collectable {
 public:
  explicit StoreServerMetrics(const StoreServer& server) : server_(server) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    auto one = [](const char* name, const char* help, prometheus::MetricType type, double value) {
      prometheus::MetricFamily f{name, help, type, {}};
      prometheus::ClientMetric m;
      if (type == prometheus::MetricType::Counter) {
        m.counter.value = value;
      } else {
        m.gauge.value = value;
      }
      f.metric.push_back(std::move(m));
      return f;
    };
    return {one("ferry_store_connections", "Open client connections, authenticated or not",
                prometheus::MetricType::Gauge, static_cast<double>(server_.connections())),
            one("ferry_store_evicted_connections_total",
                "Unauthenticated connections closed to make room for newer ones", prometheus::MetricType::Counter,
                static_cast<double>(server_.evicted())),
            one("ferry_store_refused_proofs_total", "Handshakes refused for a wrong token proof",
                prometheus::MetricType::Counter, static_cast<double>(server_.refused_proofs()))};
  }

 private:
  const StoreServer& server_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> store_server_metrics(const StoreServer& server) {
  return std::make_shared<StoreServerMetrics>(server);
}

// ---- the endpoint --------------------------------------------------------------------

namespace metrics_internal {

// Marks the scrapes of an endpoint. A scrape collects its collectables in the order they
// were registered: a Mark registered first sees it begin, one registered last sees it end
// with everything collected.
struct ScrapeCount {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t begun = 0, ended = 0;
};

class ScrapeMark final : public prometheus::Collectable {
 public:
  ScrapeMark(std::shared_ptr<ScrapeCount> count, bool end) : count_(std::move(count)), end_(end) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      std::lock_guard<std::mutex> lk(count_->mu);
      ++(end_ ? count_->ended : count_->begun);
    }
    count_->cv.notify_all();
    return {};
  }

 private:
  std::shared_ptr<ScrapeCount> count_;
  bool end_;
};

}  // namespace metrics_internal

struct MetricsEndpoint::Impl {
  std::string host;
  int port = 0;
  // Kept alive here: the exposer holds weak pointers. `begin` is registered first, `end`
  // last (re-registered after anything added).
  std::vector<std::shared_ptr<prometheus::Collectable>> served;
  std::shared_ptr<metrics_internal::ScrapeCount> count = std::make_shared<metrics_internal::ScrapeCount>();
  std::shared_ptr<prometheus::Collectable> begin = std::make_shared<metrics_internal::ScrapeMark>(count, false);
  std::shared_ptr<prometheus::Collectable> end = std::make_shared<metrics_internal::ScrapeMark>(count, true);
  std::unique_ptr<prometheus::Exposer> exposer;  // last: stops before the above go
};

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::start(const std::string& address,
                                                                std::shared_ptr<prometheus::Registry> registry) {
  if (!registry) return invalid_argument("metrics endpoint {}: no registry", address);
  auto m = std::make_unique<Impl>();
  const size_t colon = address.rfind(':');
  const std::string port_part = colon == std::string::npos ? address : address.substr(colon + 1);
  m->host = colon == std::string::npos ? "0.0.0.0" : address.substr(0, colon);
  if (port_part.empty() || port_part.find_first_not_of("0123456789") != std::string::npos || port_part.size() > 5 ||
      std::stoi(port_part) > 65535)
    return invalid_argument("metrics endpoint '{}': not PORT or HOST:PORT with a port 0..65535", address);
  try {
    // civetweb's options: one listening port, two threads (a scrape a second at most).
    m->exposer = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", fmt::format("{}:{}", m->host, port_part), "num_threads", "2"});
  } catch (const std::exception& e) {
    return io_error("metrics endpoint: cannot listen on {}:{} ({}): is the port taken?", m->host, port_part, e.what());
  }
  const std::vector<int> ports = m->exposer->GetListeningPorts();
  if (ports.empty()) return io_error("metrics endpoint: listening on {}:{} gave no port", m->host, port_part);
  m->port = ports.front();
  m->served.push_back(std::move(registry));
  m->exposer->RegisterCollectable(m->begin);
  m->exposer->RegisterCollectable(m->served.back());
  m->exposer->RegisterCollectable(m->end);
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(m)));
}

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsEndpoint::~MetricsEndpoint() = default;

Status MetricsEndpoint::add(std::shared_ptr<prometheus::Collectable> collectable) {
  if (!collectable) return invalid_argument("metrics endpoint: add: no collectable");
  impl_->served.push_back(std::move(collectable));
  impl_->exposer->RemoveCollectable(impl_->end);
  impl_->exposer->RegisterCollectable(impl_->served.back());
  impl_->exposer->RegisterCollectable(impl_->end);
  return Status::Ok();
}

int MetricsEndpoint::port() const { return impl_->port; }

std::string MetricsEndpoint::url() const {
  const std::string host = impl_->host == "0.0.0.0" || impl_->host.empty() ? "127.0.0.1" : impl_->host;
  return fmt::format("http://{}:{}/metrics", host, impl_->port);
}

uint64_t MetricsEndpoint::scrapes() const {
  std::lock_guard<std::mutex> lk(impl_->count->mu);
  return impl_->count->ended;
}

bool MetricsEndpoint::wait_fresh_scrape(std::chrono::milliseconds timeout) const {
  metrics_internal::ScrapeCount& c = *impl_->count;
  std::unique_lock<std::mutex> lk(c.mu);
  // Scrapes end in the order they began (one at a time, as Prometheus scrapes a target):
  // the one that ends after every scrape begun so far began after this call.
  const uint64_t begun = c.begun;
  return c.cv.wait_for(lk, timeout, [&] { return c.ended > begun; });
}

}  // namespace ferry
