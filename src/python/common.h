// Shared between the translation units of ferry._ferry (module.cpp, models.cpp, engine.cpp).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <nlohmann/json.hpp>

#include <exception>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ferry/plan.h"
#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry {
class ModelLoader;
}

// ferry::Shape (ferry/shape.h) crosses as a list, from any sequence of ints, as the
// std::vector<int64_t> it stands in for did.
namespace pybind11::detail {
template <>
struct type_caster<ferry::Shape> : list_caster<ferry::Shape, int64_t> {};
}  // namespace pybind11::detail

namespace ferry::python {

namespace py = pybind11;

// A Status on its way to Python; `cls` names the class in ferry.errors (empty: by code).
struct StatusError : std::exception {
  Status status;
  std::string cls;
  // A failed sync's report (engine/report_json.h's JSON, with "text"): the Python
  // exception's `report` (a dict, as a successful sync returns). Null: none.
  std::shared_ptr<const nlohmann::json> report;
  StatusError(Status s, std::string c = "") : status(std::move(s)), cls(std::move(c)) {}
  const char* what() const noexcept override { return status.message().c_str(); }
};

// Raise `st` in Python as the ferry.errors class `cls` (empty: chosen by code/message).
[[noreturn]] void throw_status(Status st, std::string cls = "");
void check(const Status& st);
Tensor checked(Tensor t);
DType dtype_from_name(const std::string& name);
py::tuple to_tuple(const Shape& s);
py::list decls_to_list(const std::vector<TensorDecl>& decls);

struct PyPlan {
  Plan plan;
};

// What must stay alive while C++ uses memory borrowed from Python objects.
struct Holders {
  std::vector<py::object> objects;                      // torch tensors: kept alive
  std::vector<std::unique_ptr<py::buffer_info>> views;  // buffer exports: released after
};

// A real Tensor over the memory of a numpy array / torch tensor / DLPack array (zero-copy),
// checked against `decl` (errors name the tensor: "<what> '<name>'", e.g. what = "replay:
// param" or "Consumer: param").
// `allow_cuda`: a torch CUDA tensor binds as device memory (Tensor::borrow_device);
// otherwise it is refused naming its device.
Tensor bind_object(py::handle obj, const TensorDecl& decl, const char* what, bool writable, Holders& holders,
                   bool allow_cuda = false);
// Binds every tensor the plan reads (sources) or writes (params) from a name mapping, for
// Plan.replay (torch CUDA tensors bind as device memory).
TensorMap bind_all(const Plan& plan, py::handle mapping, bool params, Holders& holders);

// Waits for the work queued so far on torch's current stream of each CUDA device in
// `devices` (the caller's writes to a tensor it hands ferry, or its reads of a param
// ferry is about to overwrite): ferry's copies run on their own stream. Nothing when
// torch cannot use CUDA (then the CUDA plugin refuses the memory, saying why). GIL held.
void sync_torch_streams(const std::set<int>& devices);

// ferry._ferry._ModelLoader (models.cpp): shared so that a Consumer can keep it alive.
struct PyModelLoader {
  std::shared_ptr<const ModelLoader> loader;
};

void register_models(py::module_& m);  // models.cpp (when the models module is built)
void register_engine(py::module_& m);  // engine.cpp (when the engine is built)
void register_rank(py::module_& m);    // rank.cpp (when the tools are built)

}  // namespace ferry::python
