// ferry._ferry: the engine's options from ferry.Producer / ferry.Consumer keywords
// (options.h), and the table of how each field is reached.
#include "python/options.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "ferry/device.h"
#include "python/common.h"
#ifdef FERRY_PYTHON_METRICS
#include "python/metrics.h"
#endif

namespace ferry::python {

namespace {

// How a Python keyword reaches each field of the three option structs. "keyword": the
// binding sets it from the keyword of that name (options_dict shows it); "hook": a Python
// callable the binding (after_group) or ferry.Consumer.sync (before_sync, after_sync)
// runs; "in_place": source_regions are the memory of what materialize returns, registered
// by the binding when in_place=True; "internal": ferry's own fault injection, no keyword;
// "native": C++ only, no keyword (the binding decides it).
// tests/python/test_options.py compares these fields with the header's structs, so a
// field added to include/ferry/engine.h without a row here (and a keyword) fails it.
struct OptionField {
  const char* options;
  const char* field;
  const char* keyword;
  const char* how;
  const char* classes;  // which of ferry.Producer / ferry.Consumer take the keyword
};
constexpr OptionField kOptionFields[] = {
    {"EngineOptions", "job", "job", "keyword", "Producer Consumer"},
    {"EngineOptions", "num_producers", "num_producers", "keyword", "Producer Consumer"},
    {"EngineOptions", "num_consumers", "num_consumers", "keyword", "Producer Consumer"},
    {"EngineOptions", "mode", "mode", "keyword", "Producer Consumer"},
    {"EngineOptions", "rendezvous_timeout", "rendezvous_timeout", "keyword", "Producer Consumer"},
    {"EngineOptions", "timeout", "timeout", "keyword", "Producer Consumer"},
    {"EngineOptions", "stall_timeout", "stall_timeout", "keyword", "Producer Consumer"},
    // Stragglers are the producer's policy: a consumer never reads these three.
    {"EngineOptions", "straggler_floor", "straggler_floor", "keyword", "Producer"},
    {"EngineOptions", "straggler_factor", "straggler_factor", "keyword", "Producer"},
    {"EngineOptions", "join_window", "join_window", "keyword", "Producer"},
    {"EngineOptions", "lease_ttl", "lease_ttl", "keyword", "Producer Consumer"},
    {"EngineOptions", "checksums", "checksums", "keyword", "Producer Consumer"},
    {"EngineOptions", "failover", "failover", "keyword", "Producer Consumer"},
    {"EngineOptions", "group_order", "group_order", "keyword", "Producer Consumer"},
    {"EngineOptions", "convert_on", "convert_on", "keyword", "Producer Consumer"},
    {"EngineOptions", "quantize_on", "quantize_on", "keyword", "Producer Consumer"},
    {"EngineOptions", "delta", "delta", "keyword", "Producer Consumer"},
    // Full syncs are the producer's choice: a consumer never reads it.
    {"EngineOptions", "delta_full_every", "delta_full_every", "keyword", "Producer"},
    {"EngineOptions", "delta_block_bytes", "delta_block_bytes", "keyword", "Producer"},
    {"EngineOptions", "delta_same_host", "delta_same_host", "keyword", "Producer Consumer"},
    {"EngineOptions", "weight_digests", "weight_digests", "keyword", "Producer Consumer"},
    {"EngineOptions", "test_hooks", "", "internal", ""},
    // A C++ object called on the engine's threads, sometimes under its locks: no Python
    // callback (it would need the GIL); a ferry.Metrics (its C++ SyncMetrics) is the sink.
    {"EngineOptions", "sink", "metrics", "metrics", "Producer Consumer"},
    {"ProducerOptions", "source_regions", "in_place", "in_place", "Producer"},
    {"ProducerOptions", "direct_min_bytes", "direct_min_bytes", "keyword", "Producer"},
    {"ProducerOptions", "staging_budget", "staging_budget", "keyword", "Producer"},
    {"ProducerOptions", "staging_device", "staging_device", "keyword", "Producer"},
    {"ConsumerOptions", "commit", "commit", "keyword", "Consumer"},
    {"ConsumerOptions", "cuda_ipc", "cuda_ipc", "keyword", "Consumer"},
    {"ConsumerOptions", "direct_min_bytes", "direct_min_bytes", "keyword", "Consumer"},
    {"ConsumerOptions", "relay", "relay", "keyword", "Consumer"},
    // Fixed by the binding (false): ferry's own buffers stay valid after close() (views keep them).
    {"ConsumerOptions", "own_params_in_transport_memory", "", "native", ""},
    {"ConsumerOptions", "check_weights_each_sync", "check_weights_each_sync", "keyword", "Consumer"},
    {"ConsumerOptions", "before_sync", "before_sync", "hook", "Consumer"},
    {"ConsumerOptions", "after_group", "after_group", "hook", "Consumer"},
    {"ConsumerOptions", "after_sync", "after_sync", "hook", "Consumer"},
    // Run by ferry.Consumer.sync / commit around the engine's commit (shadow).
    {"ConsumerOptions", "before_commit", "before_commit", "hook", "Consumer"},
    {"ConsumerOptions", "after_commit", "after_commit", "hook", "Consumer"},
};

std::string shown(py::handle value) { return std::string(py::repr(value)); }

[[noreturn]] void refuse(const char* name, const char* expected, py::handle value) {
  throw_status(invalid_argument("{}: expected {}, got {} ({})", name, expected, shown(value),
                                std::string(py::str(py::type::handle_of(value).attr("__name__")))));
}

// An integer keyword (anything with __index__: int, numpy integers; not float, not str).
py::int_ integer(const py::dict& kw, const char* name, const char* expected) {
  py::handle v = kw[name];
  PyObject* index = PyNumber_Index(v.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    refuse(name, expected, v);
  }
  return py::reinterpret_steal<py::int_>(index);
}

// A world size: an integer >= 1 that fits an int.
int world_size(const py::dict& kw, const char* name) {
  py::int_ n = integer(kw, name, "an integer >= 1");
  const long long value = PyLong_AsLongLong(n.ptr());
  if (PyErr_Occurred() != nullptr || value < 1 || value > std::numeric_limits<int>::max()) {
    PyErr_Clear();
    refuse(name, "an integer >= 1", kw[name]);
  }
  return static_cast<int>(value);
}

// A byte count: an integer in [0, 2**64 - 1].
uint64_t byte_count(const py::dict& kw, const char* name) {
  py::int_ n = integer(kw, name, "a byte count, an integer in [0, 2**64 - 1]");
  const unsigned long long value = PyLong_AsUnsignedLongLong(n.ptr());
  if (PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    refuse(name, "a byte count, an integer in [0, 2**64 - 1]", kw[name]);
  }
  return value;
}

// An integer in [0, 2**32 - 1].
uint32_t count32(const py::dict& kw, const char* name) {
  py::int_ n = integer(kw, name, "an integer in [0, 2**32 - 1]");
  const unsigned long long value = PyLong_AsUnsignedLongLong(n.ptr());
  if (PyErr_Occurred() != nullptr || value > 0xffffffffull) {
    PyErr_Clear();
    refuse(name, "an integer in [0, 2**32 - 1]", kw[name]);
  }
  return static_cast<uint32_t>(value);
}

// True or False (numpy's bools and the integers 0 and 1 too; not a string: "false" is
// not False).
bool flag(const py::dict& kw, const char* name) {
  py::handle v = kw[name];
  if (PyBool_Check(v.ptr())) return v.ptr() == Py_True;
  if (PyLong_Check(v.ptr())) {
    const long long x = PyLong_AsLongLong(v.ptr());
    if (PyErr_Occurred() == nullptr && (x == 0 || x == 1)) return x == 1;
    PyErr_Clear();
  } else if (py::hasattr(v, "dtype") && py::hasattr(v, "shape") &&
             std::string(py::str(v.attr("dtype").attr("kind"))) == "b" && py::len(v.attr("shape")) == 0) {
    return PyObject_IsTrue(v.ptr()) == 1;  // a numpy bool scalar
  }
  refuse(name, "True or False", v);
}

// A real number (int, float, numpy floats; not str).
double number(const py::dict& kw, const char* name, const char* expected) {
  py::handle v = kw[name];
  if (PyUnicode_Check(v.ptr()) || PyBytes_Check(v.ptr())) refuse(name, expected, v);
  const double x = PyFloat_AsDouble(v.ptr());
  if (x == -1.0 && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    refuse(name, expected, v);
  }
  return x;
}

// A duration in seconds. inf (or anything longer) means "no bound" and becomes kNoBound,
// one day: the longest wait the store accepts (Store::wait), and far from where a
// steady_clock deadline (now + duration, in ns) would overflow int64.
std::chrono::milliseconds seconds(const py::dict& kw, const char* name) {
  constexpr double kNoBound = 86400;
  const double s = number(kw, name, "seconds >= 0 (float('inf'): no bound)");
  if (std::isnan(s) || s < 0) {
    throw_status(invalid_argument("{}: must be >= 0 seconds (float('inf'): no bound), got {}", name, s));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::min(s, kNoBound) * 1000));
}

std::string text(const py::dict& kw, const char* name) {
  py::handle v = kw[name];
  if (!PyUnicode_Check(v.ptr())) refuse(name, "a string", v);
  return v.cast<std::string>();
}

void fill_engine(EngineOptions& o, const py::dict& kw) {
  if (kw.contains("job")) o.job = text(kw, "job");
  if (kw.contains("num_producers")) o.num_producers = world_size(kw, "num_producers");
  if (kw.contains("num_consumers")) o.num_consumers = world_size(kw, "num_consumers");
  if (kw.contains("mode")) {
    auto mode = parse_sync_mode(text(kw, "mode"));
    if (!mode.ok()) throw_status(mode.status().with_context("mode"));
    o.mode = *mode;
  }
  if (kw.contains("rendezvous_timeout")) o.rendezvous_timeout = seconds(kw, "rendezvous_timeout");
  if (kw.contains("timeout")) o.timeout = seconds(kw, "timeout");
  if (kw.contains("stall_timeout")) o.stall_timeout = seconds(kw, "stall_timeout");
  if (kw.contains("straggler_floor")) o.straggler_floor = seconds(kw, "straggler_floor");
  if (kw.contains("straggler_factor")) {
    // A multiple of a measured time, in a duration: inf would overflow it.
    const double f = number(kw, "straggler_factor", "a finite number >= 0");
    if (!std::isfinite(f) || f < 0) refuse("straggler_factor", "a finite number >= 0", kw["straggler_factor"]);
    o.straggler_factor = f;
  }
  if (kw.contains("join_window")) o.join_window = seconds(kw, "join_window");
  if (kw.contains("lease_ttl")) o.lease_ttl = seconds(kw, "lease_ttl");
  if (kw.contains("checksums")) o.checksums = flag(kw, "checksums");
  if (kw.contains("weight_digests")) o.weight_digests = flag(kw, "weight_digests");
#ifdef FERRY_PYTHON_METRICS
  if (kw.contains("metrics") && !kw["metrics"].is_none()) {
    if (!py::isinstance<PyMetrics>(kw["metrics"])) refuse("metrics", "a ferry.Metrics", kw["metrics"]);
    o.sink = kw["metrics"].cast<const PyMetrics&>().metrics;
  }
#endif
  if (kw.contains("failover")) o.failover = flag(kw, "failover");
  if (kw.contains("group_order")) {
    auto order = parse_group_order_kind(text(kw, "group_order"));
    if (!order.ok()) throw_status(order.status().with_context("group_order"));
    o.group_order = *order;
  }
  if (kw.contains("convert_on")) {
    const std::string where = text(kw, "convert_on");
    auto c = parse_convert_on(where);
    if (!c) throw_status(invalid_argument("convert_on: '{}' is not \"producer\" or \"consumer\"", where));
    o.convert_on = *c;
  }
  if (kw.contains("quantize_on")) {
    const std::string where = text(kw, "quantize_on");
    auto q = parse_quantize_on(where);
    if (!q) throw_status(invalid_argument("quantize_on: '{}' is not \"producer\" or \"consumer\"", where));
    o.quantize_on = *q;
  }
  if (kw.contains("delta")) o.delta = flag(kw, "delta");
  if (kw.contains("delta_full_every")) o.delta_full_every = count32(kw, "delta_full_every");
  if (kw.contains("delta_block_bytes")) o.delta_block_bytes = byte_count(kw, "delta_block_bytes");
  if (kw.contains("delta_same_host")) o.delta_same_host = flag(kw, "delta_same_host");
}

double secs(std::chrono::milliseconds d) { return static_cast<double>(d.count()) / 1000; }

void engine_dict(py::dict& d, const EngineOptions& o) {
  d["job"] = o.job;
  d["num_producers"] = o.num_producers;
  d["num_consumers"] = o.num_consumers;
  d["mode"] = std::string(sync_mode_name(o.mode));
  d["rendezvous_timeout"] = secs(o.rendezvous_timeout);
  d["timeout"] = secs(o.timeout);
  d["stall_timeout"] = secs(o.stall_timeout);
  d["straggler_floor"] = secs(o.straggler_floor);
  d["straggler_factor"] = o.straggler_factor;
  d["join_window"] = secs(o.join_window);
  d["lease_ttl"] = secs(o.lease_ttl);
  d["checksums"] = o.checksums;
  d["weight_digests"] = o.weight_digests;
  d["failover"] = o.failover;
  d["group_order"] = std::string(group_order_kind_name(o.group_order));
  d["convert_on"] = std::string(convert_on_name(o.convert_on));
  d["quantize_on"] = std::string(quantize_on_name(o.quantize_on));
  d["delta"] = o.delta;
  d["delta_full_every"] = o.delta_full_every;
  d["delta_block_bytes"] = o.delta_block_bytes;
  d["delta_same_host"] = o.delta_same_host;
  d["test_hooks"] = o.test_hooks != nullptr;
  d["sink"] = o.sink != nullptr;
}

}  // namespace

ProducerOptions producer_options(const py::dict& kw) {
  ProducerOptions o;
  fill_engine(o, kw);
  if (kw.contains("direct_min_bytes")) o.direct_min_bytes = byte_count(kw, "direct_min_bytes");
  if (kw.contains("staging_budget")) o.staging_budget = byte_count(kw, "staging_budget");
  if (kw.contains("staging_device")) {
    // "cpu", "cuda", "cuda:N", or a torch.device (its str is one of those).
    py::handle v = kw["staging_device"];
    const bool torch_device = py::hasattr(v, "type") && py::hasattr(v, "index") && !PyUnicode_Check(v.ptr());
    if (!PyUnicode_Check(v.ptr()) && !torch_device) refuse("staging_device", "\"cpu\", \"cuda:N\" or a torch.device", v);
    auto device = parse_device(std::string(py::str(v)));
    if (!device.ok()) throw_status(device.status().with_context("staging_device"));
    o.staging_device = *device;
  }
  return o;
}

ConsumerOptions consumer_options(const py::dict& kw) {
  ConsumerOptions o;
  fill_engine(o, kw);
  if (kw.contains("cuda_ipc")) o.cuda_ipc = flag(kw, "cuda_ipc");
  if (kw.contains("relay")) o.relay = flag(kw, "relay");
  if (kw.contains("check_weights_each_sync")) o.check_weights_each_sync = flag(kw, "check_weights_each_sync");
  if (kw.contains("direct_min_bytes")) o.direct_min_bytes = byte_count(kw, "direct_min_bytes");
  if (kw.contains("commit")) {
    auto policy = parse_commit_policy(text(kw, "commit"));
    if (!policy.ok()) throw_status(policy.status().with_context("commit"));
    o.commit = *policy;
  }
  return o;
}

py::dict options_dict(const ProducerOptions& o) {
  py::dict d;
  engine_dict(d, o);
  py::list regions;
  for (const MemoryRegion& r : o.source_regions) {
    regions.append(py::make_tuple(reinterpret_cast<uintptr_t>(r.base), r.length));
  }
  d["source_regions"] = regions;
  d["direct_min_bytes"] = o.direct_min_bytes;
  d["staging_budget"] = o.staging_budget;
  d["staging_device"] = device_str(o.staging_device);
  return d;
}

py::dict options_dict(const ConsumerOptions& o) {
  py::dict d;
  engine_dict(d, o);
  d["commit"] = std::string(commit_policy_name(o.commit));
  d["cuda_ipc"] = o.cuda_ipc;
  d["relay"] = o.relay;
  d["check_weights_each_sync"] = o.check_weights_each_sync;
  d["direct_min_bytes"] = o.direct_min_bytes;
  d["before_commit"] = static_cast<bool>(o.before_commit);
  d["after_commit"] = static_cast<bool>(o.after_commit);
  d["before_sync"] = static_cast<bool>(o.before_sync);
  d["after_group"] = static_cast<bool>(o.after_group);
  d["after_sync"] = static_cast<bool>(o.after_sync);
  return d;
}

void register_options(py::module_& m) {
  m.def("_option_fields", [] {
    py::list out;
    for (const OptionField& f : kOptionFields) {
      py::dict row;
      row["options"] = f.options;
      row["field"] = f.field;
      row["keyword"] = f.keyword;
      row["how"] = f.how;
      row["classes"] = py::str(f.classes).attr("split")();
      out.append(row);
    }
    return out;
  });
  m.def("_producer_options", [](const py::dict& kw) { return options_dict(producer_options(kw)); });
  m.def("_consumer_options", [](const py::dict& kw) { return options_dict(consumer_options(kw)); });
}

}  // namespace ferry::python
