// ferry._ferry: targets (ferry/targets.h, docs/targets.md): a target's job name, what each
// rank of an adapter target serves, and one inference rank's adapter slots with the
// readers' leases. Sync runs with the GIL released; a lease and every numpy view of it
// share one hold on its slot.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/targets.h"
#include "python/common.h"
#include "python/engine_shared.h"
#include "python/options.h"

namespace ferry::python {

namespace {

// One inference rank's adapter slots (ferry/targets.h). A sync in flight keeps close()
// waiting (as PyConsumer's); close() refuses while any lease, or any view of one, holds a
// slot (a view reads the slot's memory).
struct PyAdapterSlots {
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Store> store;
  std::unique_ptr<AdapterSlots> slots;
  int rank = -1;
  InFlight in_flight;
  AdapterSlots& live(const char* method) const {
    if (!slots) throw_status(failed_precondition("AdapterSlots.{}: closed", method));
    return *slots;
  }
  void close() {
    if (slots) {
      for (const auto& s : slots->slots())
        if (s.readers > 0)
          throw_status(failed_precondition("AdapterSlots.close: slot {} ('{}') is held by {} lease(s) or their "
                                           "views; release them first", s.slot, s.name, s.readers));
    }
    std::unique_ptr<AdapterSlots> a = std::move(slots);
    std::unique_ptr<Transport> t = std::move(transport);
    std::unique_ptr<Store> st = std::move(store);
    py::gil_scoped_release release;
    in_flight.wait_idle();  // (a sync on another thread still uses them)
    a.reset();
    t.reset();
    st.reset();
  }
  ~PyAdapterSlots() {
    try {
      if (slots || transport || store) close();
    } catch (...) {  // (a held lease keeps this object alive: none is held here)
    }
  }
};

// A hold on one slot, shared by a lease object and every numpy view of it: the slot is
// held until the last of them is gone (release() drops only the lease object's share).
// `owner` keeps the PyAdapterSlots alive as long.
struct HeldSlot {
  AdapterSlots::Lease lease;
  py::object owner;
  ~HeldSlot() {
    { AdapterSlots::Lease gone(std::move(lease)); }  // the slot first: `owner` may be the last reference
    py::gil_scoped_acquire gil;
    owner = py::object();
  }
};

struct PyAdapterLease {
  std::shared_ptr<HeldSlot> held;
  const AdapterSlots::Lease& get() const {
    if (!held) throw_status(failed_precondition("AdapterLease: released"));
    return held->lease;
  }
};

}  // namespace

void register_targets(py::module_& m) {
  m.def("_target_job", [](const std::string& job, const std::string& target) { return value_or_raise(target_job(job, target)); });
  m.def("_adapter_serving", [](const std::string& url, const py::dict& kw, const std::string& job, int n) {
    std::unique_ptr<Store> store = open_store(url, kw);
    Result<std::vector<std::optional<std::string>>> r = Status(StatusCode::kInternal, "not run");
    {
      py::gil_scoped_release release;
      r = adapter_serving(*store, job, n);
    }
    return value_or_raise(std::move(r));
  });
  py::class_<PyAdapterLease>(m, "_AdapterLease")
      .def_property_readonly("name", [](const PyAdapterLease& l) { return l.get().name(); })
      .def_property_readonly("version", [](const PyAdapterLease& l) { return l.get().version(); })
      .def_property_readonly("slot", [](const PyAdapterLease& l) { return l.get().slot(); })
      // {name: (dtype name, read-only numpy view of the slot)}: each view holds the slot
      // (its own share of the hold) until it is gone, release() or not.
      .def("params", [](const PyAdapterLease& l) {
        py::dict out;
        for (const auto& [name, t] : l.get().params()) {
          py::capsule share(new std::shared_ptr<HeldSlot>(l.held),
                            [](void* p) { delete static_cast<std::shared_ptr<HeldSlot>*>(p); });
          py::array view = numpy_view(t, share);
          view.attr("setflags")(py::arg("write") = false);
          out[py::str(name)] = py::make_tuple(std::string(dtype_name(t.dtype())), view);
        }
        return out;
      })
      .def("release", [](PyAdapterLease& l) { l.held.reset(); });
  py::class_<PyAdapterSlots>(m, "_AdapterSlots")
      .def(py::init([](const PyPlan& plan, int rank, const std::string& store_url, py::dict kw, const std::string& adapter,
                       int slots, std::vector<int> group, double switch_timeout, double slot_wait) {
        auto a = std::make_unique<PyAdapterSlots>();
        // (No hooks: the slots make versions live. Heap params, as every Python consumer's.)
        ConsumerOptions co = consumer_options(kw);
        co.own_params_in_transport_memory = false;
        ConsumerModel model;
        model.plan = plan.plan;
        AdapterSlotOptions so;
        so.adapter = adapter;
        so.slots = slots;
        so.switch_group = std::move(group);
        so.switch_timeout = std::chrono::milliseconds(static_cast<int64_t>(switch_timeout * 1000));
        so.slot_wait = std::chrono::milliseconds(static_cast<int64_t>(slot_wait * 1000));
        a->transport = make_transport(kw);
        a->store = open_store(store_url, kw);
        Result<std::unique_ptr<AdapterSlots>> made = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          made = AdapterSlots::create(std::move(model), rank, *a->transport, *a->store, co, so);
        }
        a->slots = value_or_raise(std::move(made));
        a->rank = rank;
        return a;
      }))
      .def("sync", [](PyAdapterSlots& a, uint64_t version) {
        AdapterSlots& slots = a.live("sync");
        InFlight::Guard busy(a.in_flight);  // a close() on another thread waits for it
        Result<AdapterSlots::Report> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = slots.sync(version);
        }
        if (!r.ok()) throw_status(r.status());
        py::dict out;
        out["decision"] = switch_decision_name(r->decision);
        out["unchanged"] = r->unchanged;
        out["serving"] = r->serving;
        out["slot"] = r->slot;
        out["ok"] = r->ok();
        out["report"] = report_dict(r->sync, false, a.rank, py::none());
        return out;
      })
      .def("acquire", [](py::object self) -> py::object {
        const PyAdapterSlots& a = self.cast<const PyAdapterSlots&>();
        auto lease = a.live("acquire").acquire();
        if (!lease) return py::none();
        auto l = std::make_unique<PyAdapterLease>();
        l->held = std::shared_ptr<HeldSlot>(new HeldSlot{std::move(*lease), self});
        return py::cast(std::move(l));
      })
      .def("slots", [](const PyAdapterSlots& a) {
        py::list out;
        for (const auto& s : a.live("slots").slots()) {
          py::dict d;
          d["slot"] = s.slot;
          d["name"] = s.name;
          d["version"] = s.version ? py::object(py::int_(*s.version)) : py::object(py::none());
          d["serving"] = s.serving;
          d["readers"] = s.readers;
          out.append(d);
        }
        return out;
      })
      .def_property_readonly("rank", [](const PyAdapterSlots& a) { return a.rank; })
      .def("close", &PyAdapterSlots::close);
}

}  // namespace ferry::python
