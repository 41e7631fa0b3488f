// ferry._ferry: the rank entry points (`ferry serve` / `ferry fetch`, tools/rank_entry.h)
// as _serve(spec) / _fetch(spec): one trainer or inference rank run in the calling
// process, the GIL released for the whole run (setup, rendezvous, every sync). They
// return the per-sync reports as dicts built from the very JSON the commands print
// (rank_report_json), so the two never differ in keys; a setup error raises by its code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "python/common.h"
#include "python/json.h"
#include "tools/rank_entry.h"

namespace ferry::python {

namespace {

template <typename T>
void take(const py::dict& spec, const char* key, T& field) {
  if (spec.contains(key) && !spec[key].is_none()) field = spec[key].cast<T>();
}

tools::RankSpec spec_from(const py::dict& d) {
  tools::RankSpec s;
  take(d, "store", s.store);
  take(d, "token", s.token);
  take(d, "job", s.job);
  take(d, "model", s.model);
  take(d, "trainer", s.trainer);
  take(d, "inference", s.inference);
  take(d, "checkpoint", s.checkpoint);
  take(d, "output", s.output);
  take(d, "rank", s.rank);
  take(d, "mode", s.mode);
  take(d, "checksums", s.checksums);
  take(d, "read_checkpoint", s.read_checkpoint);
  take(d, "device", s.device);
  take(d, "gpu_staging", s.gpu_staging);
  take(d, "cuda_ipc", s.cuda_ipc);
  take(d, "leave", s.leave);
  take(d, "catch_up", s.catch_up);
  take(d, "first_version", s.first_version);
  take(d, "syncs", s.syncs);
  take(d, "timeout_ms", s.timeout_ms);
  take(d, "rendezvous_ms", s.rendezvous_ms);
  take(d, "trace", s.trace);
  return s;
}

// `on_report` (callable or None) gets each sync's dict as soon as the sync ends, with the
// GIL taken for the call. An exception it raises cannot stop the rank (the job's other
// ranks are in the syncs too): the first one is raised once every sync ran.
py::list run(bool producer, const py::dict& d, const py::object& on_report) {
  const tools::RankSpec s = spec_from(d);
  std::optional<Result<std::vector<tools::RankReport>>> reports;
  std::optional<py::error_already_set> raised;
  tools::RankReportSink sink;
  if (!on_report.is_none()) {
    sink = [&](const tools::RankReport& r) {
      py::gil_scoped_acquire gil;
      if (raised) return;
      try {
        on_report(json_to_python(tools::rank_report_json(r)));
      } catch (py::error_already_set& e) {
        raised.emplace(std::move(e));
      }
    };
  }
  {
    py::gil_scoped_release nogil;
    reports.emplace(producer ? tools::serve_rank(s, sink) : tools::fetch_rank(s, sink));
  }
  if (raised) throw std::move(*raised);
  if (!reports->ok()) throw_status(reports->status());
  py::list out;
  for (const auto& r : **reports) out.append(json_to_python(tools::rank_report_json(r)));
  return out;
}

}  // namespace

void register_rank(py::module_& m) {
  m.def("_serve", [](const py::dict& spec, const py::object& on_report) { return run(true, spec, on_report); },
        py::arg("spec"), py::arg("on_report") = py::none(),
        "Be one trainer rank (tools::serve_rank); returns one report dict per sync");
  m.def("_fetch", [](const py::dict& spec, const py::object& on_report) { return run(false, spec, on_report); },
        py::arg("spec"), py::arg("on_report") = py::none(),
        "Be one inference rank (tools::fetch_rank); returns one report dict per sync");
}

}  // namespace ferry::python
