// JSON (nlohmann) to Python objects, for the reports ferry._ferry returns: every report
// dict is the JSON the CLI prints (engine/report_json.h), converted here, so their keys
// never differ.
#pragma once

#include <pybind11/pybind11.h>

#include <nlohmann/json.hpp>

namespace ferry::python {

inline pybind11::object json_to_python(const nlohmann::json& j) {
  namespace py = pybind11;
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      py::dict d;
      for (const auto& [k, v] : j.items()) d[py::str(k)] = json_to_python(v);
      return d;
    }
    case nlohmann::json::value_t::array: {
      py::list l;
      for (const auto& v : j) l.append(json_to_python(v));
      return l;
    }
    case nlohmann::json::value_t::string: return py::str(j.get<std::string>());
    case nlohmann::json::value_t::boolean: return py::bool_(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return py::int_(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: return py::int_(j.get<uint64_t>());
    case nlohmann::json::value_t::number_float: return py::float_(j.get<double>());
    default: return py::none();
  }
}

}  // namespace ferry::python
