// ferry._ferry._Metrics and _MetricsEndpoint: ferry/metrics.h for ferry.Metrics (python/
// ferry/_metrics.py). A _Metrics is handed to Producer/Consumer as `metrics=` (its
// SyncMetrics is their EngineOptions::sink: options.cpp).
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "ferry/metrics.h"
#include "python/common.h"
#include "python/metrics.h"

namespace ferry::python {

namespace py = pybind11;

namespace {

struct PyEndpoint {
  std::unique_ptr<MetricsEndpoint> endpoint;
  const MetricsEndpoint& live() const {
    if (!endpoint) throw_status(failed_precondition("MetricsEndpoint: closed"));
    return *endpoint;
  }
};

}  // namespace

void register_metrics(py::module_& m) {
  py::class_<PyMetrics>(m, "_Metrics")
      .def(py::init([] {
        auto made = SyncMetrics::create();
        if (!made.ok()) throw_status(made.status());
        return PyMetrics{std::move(*made)};
      }))
      // Prometheus' text format: what a scrape returns (the GIL released: the ranks' threads
      // update the counters meanwhile).
      .def("text", [](const PyMetrics& p) {
        py::gil_scoped_release nogil;
        return p.metrics->text();
      });

  py::class_<PyEndpoint>(m, "_MetricsEndpoint")
      .def_static("start", [](const std::string& address, const PyMetrics& p) {
        auto ep = MetricsEndpoint::start(address, p.metrics->registry());
        if (!ep.ok()) throw_status(ep.status());
        return PyEndpoint{std::move(*ep)};
      })
      .def_property_readonly("port", [](const PyEndpoint& e) { return e.live().port(); })
      .def_property_readonly("url", [](const PyEndpoint& e) { return e.live().url(); })
      .def_property_readonly("scrapes", [](const PyEndpoint& e) { return e.live().scrapes(); })
      .def("wait_fresh_scrape", [](const PyEndpoint& e, double seconds) {
        const MetricsEndpoint& ep = e.live();
        py::gil_scoped_release nogil;
        return ep.wait_fresh_scrape(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
      })
      // Stopping the listener takes up to a couple of seconds (civetweb's poll): without the GIL.
      .def("close", [](PyEndpoint& e) {
        std::unique_ptr<MetricsEndpoint> gone = std::move(e.endpoint);
        py::gil_scoped_release nogil;
        gone.reset();
      });
}

}  // namespace ferry::python
