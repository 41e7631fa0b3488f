// Shared between the engine's bindings (engine.cpp: Producer, Consumer, the store server;
// targets.cpp: the targets' names and adapter slots), internal to ferry._ferry.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "ferry/engine.h"
#include "ferry/store.h"
#include "ferry/transport.h"
#include "python/common.h"

namespace ferry::python {

template <typename T>
T value_or_raise(Result<T> r) {
  if (!r.ok()) throw_status(r.status());
  return std::move(r).value();
}

// The transport and the store connection of one rank, from the binding's keywords
// (backend, token, transport_params).
std::unique_ptr<Transport> make_transport(const py::dict& kw);
std::unique_ptr<Store> open_store(const std::string& url, const py::dict& kw);
// A sync's report as a dict (the CLI's JSON keys and "text"); `trace`: a path or None.
py::dict report_dict(const SyncReport& r, bool producer, int rank, const py::object& trace);
// A numpy array over a real tensor's bytes (bf16/fp8 as raw uint16/uint8 bits), keeping
// `owner` alive.
py::array numpy_view(const Tensor& t, py::handle owner);

// The sync() calls of a Producer/Consumer in flight (the GIL released): close() from
// another thread takes the object out of use at once (under the GIL: every later call
// raises "closed") and destroys it once they have returned, never under them.
struct InFlight {
  std::mutex mu;
  std::condition_variable idle;
  int running = 0;
  struct Guard {
    InFlight& f;
    explicit Guard(InFlight& in) : f(in) {
      std::lock_guard<std::mutex> lk(f.mu);
      ++f.running;
    }
    ~Guard() {
      {
        std::lock_guard<std::mutex> lk(f.mu);
        --f.running;
      }
      f.idle.notify_all();
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
  };
  void wait_idle() {  // GIL released
    std::unique_lock<std::mutex> lk(mu);
    idle.wait(lk, [&] { return running == 0; });
  }
};

// ferry._ferry's targets (targets.cpp): _target_job, _adapter_serving, _AdapterSlots,
// _AdapterLease.
void register_targets(py::module_& m);

}  // namespace ferry::python
