// ferry/metrics.h — Prometheus metrics of a process's syncs (docs/metrics.md lists every
// metric, its labels and what it means).
//
// SyncMetrics is a SyncSink (EngineOptions::sink): give one to every rank of a process. It
// keeps counters and histograms over all their syncs and gauges of the latest, each series
// labelled with the rank's side ("producer"/"consumer") and rank, in a prometheus-cpp
// Registry: its own, or an application's (which then serves ferry's metrics beside its
// own; prometheus-cpp's Registry merges families of the same name). MetricsEndpoint serves
// a registry over HTTP for Prometheus to scrape (`ferry serve/fetch/store --metrics-port`).
//
// Threading: every method of both classes may be called from any thread. Errors: Status /
// Result; nothing here throws (prometheus-cpp's exceptions are caught at this boundary).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "ferry/engine.h"
#include "ferry/status.h"

namespace prometheus {
class Collectable;
class Registry;
}

namespace ferry {

class StoreServer;

// The histogram buckets of sync durations, in seconds: vLLM's for weight-update operations
// (0.01 .. 600 s), so that dashboards built for one read the other.
inline constexpr double kSyncSecondsBuckets[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                                 5,    10,    25,   50,  100, 250,  600};

class SyncMetrics final : public SyncSink {
 public:
  // Into `registry`, or into a registry of its own when null (registry() returns it).
  static Result<std::shared_ptr<SyncMetrics>> create(std::shared_ptr<prometheus::Registry> registry = nullptr);
  ~SyncMetrics() override;
  SyncMetrics(const SyncMetrics&) = delete;
  SyncMetrics& operator=(const SyncMetrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const;
  // Every metric of the registry in Prometheus' text format (what a scrape returns).
  std::string text() const;

  void on_begin(const SyncSource& from) override;
  void on_control(const SyncSource& from, const ControlEvent& event) override;
  void on_report(const SyncSource& from, const SyncReport& report) override;
  void on_commit(const SyncSource& from, double seconds) override;

  struct Impl;

 private:
  explicit SyncMetrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A store server's own counters (open connections, evicted connections, refused token
// proofs) as ferry_store_* metrics, read from it at each scrape: for MetricsEndpoint::add.
// It refers to `server`, which must outlive every endpoint it is added to.
std::shared_ptr<prometheus::Collectable> store_server_metrics(const StoreServer& server);

// An HTTP endpoint serving a registry at /metrics (prometheus-cpp's Exposer, civetweb).
class MetricsEndpoint final {
 public:
  // Listens on `address`: "PORT" (every interface) or "HOST:PORT"; port 0 picks a free one
  // (port() says which). IoError naming the address when it cannot listen there.
  static Result<std::unique_ptr<MetricsEndpoint>> start(const std::string& address,
                                                        std::shared_ptr<prometheus::Registry> registry);
  ~MetricsEndpoint();  // stops listening
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // Serves `collectable` too (at the same /metrics), as long as the endpoint lives.
  Status add(std::shared_ptr<prometheus::Collectable> collectable);

  int port() const;
  std::string url() const;  // http://HOST:PORT/metrics (HOST 127.0.0.1 when every interface)
  // How many scrapes (GET /metrics) the endpoint has answered.
  uint64_t scrapes() const;
  // Waits until a scrape that began after this call has collected everything, or
  // `timeout` passes; whether one did. A rank calls it after its last sync so that
  // Prometheus, which pulls, has its final values before it exits.
  bool wait_fresh_scrape(std::chrono::milliseconds timeout) const;

  struct Impl;

 private:
  explicit MetricsEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
