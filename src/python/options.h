// The engine's options (ferry/engine.h: EngineOptions, ProducerOptions, ConsumerOptions)
// from the keywords of ferry.Producer / ferry.Consumer, each value checked here: a value of
// the wrong type or out of range raises InvalidArgumentError naming the keyword.
// Durations are seconds (float; float('inf'): no bound, held as one day), byte counts
// integers >= 0, flags True/False.
#pragma once

#include <pybind11/pybind11.h>

#include "ferry/engine.h"

namespace ferry::python {

namespace py = pybind11;

// Every engine and producer field that a keyword in `kw` sets (absent: the C++ default);
// source_regions is the binding's (in_place=True), test_hooks never set from Python.
ProducerOptions producer_options(const py::dict& kw);
// Every engine and consumer field that a keyword in `kw` sets, but the hooks: after_group
// is the binding's (it needs the consumer's error box), before_sync and after_sync run in
// ferry.Consumer.sync.
ConsumerOptions consumer_options(const py::dict& kw);

// {field: value} of options as the engine got them (durations in seconds, the mode and
// device as their names, hooks and test_hooks as whether they are set, source_regions as
// [(base, bytes)]): what tests compare keywords with.
py::dict options_dict(const ProducerOptions& o);
py::dict options_dict(const ConsumerOptions& o);

// ferry._ferry._option_fields() (every field of the three structs and how a keyword
// reaches it) and the accessors _producer_options(kw) / _consumer_options(kw).
void register_options(py::module_& m);

}  // namespace ferry::python
