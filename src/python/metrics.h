// ferry.Metrics in C++: the SyncMetrics a Python ferry.Metrics holds (src/python/metrics.cpp),
// and how the options reach it (options.cpp: the `metrics` keyword).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "ferry/metrics.h"

namespace ferry::python {

struct PyMetrics {
  std::shared_ptr<SyncMetrics> metrics;
};

void register_metrics(pybind11::module_& m);

}  // namespace ferry::python
