// ferry._ferry — the C++ half of the Python bindings (the torch-like API lives in
// python/ferry/*.py, over the thin handles defined here).
//
//  * _Tensor: a ferry::Tensor (recording source/param); every op either returns a
//    new handle or raises (ops never return error tensors to Python).
//  * _Recorder: a ferry::Recorder bound to the thread that made it; finish() returns
//    the canonical _Plan.
//  * _Plan: a ferry::Plan; replay() binds numpy arrays (buffer protocol) and CPU torch
//    tensors (data_ptr) zero-copy and runs the executor with the GIL released.
//  * Errors: a ferry::Status becomes an instance of a Python class chosen by its code
//    (and, for a few messages, by what they say); the classes are defined in
//    ferry/errors.py and handed over by _set_error_classes() when the package loads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ferry/device.h"
#include "ferry/plan.h"
#include "ferry/status.h"
#include "ferry/tensor.h"
#include "ferry/version.h"
#include "python/common.h"
#include "python/json.h"
#ifdef FERRY_PYTHON_METRICS
#include "python/metrics.h"
#endif

namespace py = pybind11;

namespace ferry::python {

// ---------------------------------------------------------------------------------------
// Errors


// The error classes by name, set once by ferry/__init__.py (never freed: lives as long as
// the interpreter; avoids destructor-order problems at exit).
py::dict* g_error_classes = nullptr;

std::string class_for(const Status& st) {
  const std::string& m = st.message();
  switch (st.code()) {
    case StatusCode::kFailedPrecondition:
      if (m.find("is recording") != std::string::npos) return "RecordingError";
      return "FailedPreconditionError";
    case StatusCode::kInvalidArgument:
      if (m.find("cannot record") != std::string::npos) return "RecordingError";
      // Index and dim errors of view ops: IndexError, as torch raises.
      if (m.find(" out of range") != std::string::npos) return "OutOfRangeError";
      return "InvalidArgumentError";
    case StatusCode::kOutOfRange: return "OutOfRangeError";
    case StatusCode::kNotFound: return "NotFoundError";
    case StatusCode::kAlreadyExists: return "AlreadyExistsError";
    case StatusCode::kCorrupt: return "CorruptError";
    case StatusCode::kIoError: return "IOError";
    case StatusCode::kTimeout: return "TimeoutError";
    case StatusCode::kUnavailable: return "UnavailableError";
    case StatusCode::kPeerFailed: return "PeerFailedError";
    case StatusCode::kPermissionDenied: return "PermissionDeniedError";
    case StatusCode::kCancelled: return "CancelledError";
    case StatusCode::kUnimplemented: return "UnimplementedError";
    case StatusCode::kInternal: return "InternalError";
    case StatusCode::kOk: break;
  }
  return "Error";
}

void raise_python(const StatusError& e) {
  const std::string cls = e.cls.empty() ? class_for(e.status) : e.cls;
  py::object type;
  if (g_error_classes != nullptr) {
    if (g_error_classes->contains(cls)) {
      type = (*g_error_classes)[cls.c_str()];
    } else if (g_error_classes->contains("Error")) {
      type = (*g_error_classes)["Error"];
    }
  }
  if (!type) {
    PyErr_SetString(PyExc_RuntimeError, e.status.to_string().c_str());
    return;
  }
  try {
    py::object inst = type(e.status.message());
    inst.attr("code") = py::str(status_code_name(e.status.code()));
    if (e.report) inst.attr("report") = json_to_python(*e.report);
    PyErr_SetObject(type.ptr(), inst.ptr());
  } catch (py::error_already_set& err) {
    err.restore();
  }
}

[[noreturn]] void throw_status(Status st, std::string cls) { throw StatusError(std::move(st), std::move(cls)); }

void check(const Status& st) {
  if (!st.ok()) throw_status(st);
}

Tensor checked(Tensor t) {
  if (!t.ok()) throw_status(t.status());
  return t;
}

DType dtype_from_name(const std::string& name) {
  auto d = parse_dtype(name);
  if (!d.ok()) throw_status(d.status());
  return *d;
}

// ---------------------------------------------------------------------------------------
// _Tensor

struct PyTensor {
  Tensor t;
};

std::vector<PyTensor> wrap_list(const TensorList& list) {
  if (!list.ok()) throw_status(list.status());
  std::vector<PyTensor> out;
  out.reserve(list.size());
  for (const Tensor& t : list) out.push_back(PyTensor{checked(t)});
  return out;
}

py::tuple to_tuple(const Shape& s) {
  py::tuple t(s.size());
  for (size_t i = 0; i < s.size(); ++i) t[i] = py::int_(s[i]);
  return t;
}

const char* kind_name(StorageKind k) {
  switch (k) {
    case StorageKind::kSource: return "source";
    case StorageKind::kParam: return "param";
    case StorageKind::kReal: return "real";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------
// _Recorder


class PyRecorder {
 public:
  PyRecorder() : rec_(std::make_unique<Recorder>()), thread_(std::this_thread::get_id()) {}
  ~PyRecorder() {
    // A Recorder must be destroyed on its thread (it restores that thread's sink). One
    // dropped without finish() on another thread (garbage collection) is leaked instead.
    if (rec_ && std::this_thread::get_id() != thread_) (void)rec_.release();
  }

  PyPlan finish() {
    check_thread("finish");
    auto plan = rec_->finish();
    rec_.reset();
    if (!plan.ok()) throw_status(plan.status());
    return PyPlan{std::move(plan).value()};
  }
  void abort() {
    if (!rec_) return;
    check_thread("abort");
    rec_.reset();
  }
  bool active() const { return rec_ != nullptr; }

 private:
  void check_thread(const char* op) {
    if (!rec_) throw_status(failed_precondition("record.{}: the recording is already finished", op));
    if (std::this_thread::get_id() != thread_) {
      throw_status(failed_precondition("record.{}: a recording must end on the thread that started it", op));
    }
  }
  std::unique_ptr<Recorder> rec_;
  std::thread::id thread_;
};

// ---------------------------------------------------------------------------------------
// Binding numpy arrays and torch tensors for replay


// DLPack (https://dmlc.github.io/dlpack): the ABI-stable structs, declared here so no
// extra header is needed. Consumed from any object with __dlpack__ (CPU memory only).
struct DLDevice {
  int32_t device_type;  // 1: CPU
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: C-contiguous
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

Result<DType> dtype_from_dlpack(DLDataType t) {
  if (t.lanes == 1) {
    if (t.code == 2 && t.bits == 16) return DType::kF16;
    if (t.code == 2 && t.bits == 32) return DType::kF32;
    if (t.code == 4 && t.bits == 16) return DType::kBF16;
    if (t.code == 0 && t.bits == 8) return DType::kI8;
    if (t.code == 0 && t.bits == 16) return DType::kI16;
    if (t.code == 0 && t.bits == 32) return DType::kI32;
    if (t.code == 0 && t.bits == 64) return DType::kI64;
    if (t.code == 1 && t.bits == 8) return DType::kU8;
    if (t.code == 6 && t.bits == 8) return DType::kBool;
  }
  return invalid_argument("DLPack dtype (code {}, bits {}, lanes {}) has no ferry dtype", t.code, t.bits, t.lanes);
}

bool is_torch_tensor(py::handle obj) {
  return py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size") && py::hasattr(obj, "is_contiguous") &&
         py::hasattr(obj, "device");
}

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__qualname__")); }

// The dtype of a buffer-protocol format ("<f", "e", "q", ...), or an error.
Result<DType> dtype_from_format(std::string fmt, py::ssize_t itemsize) {
  if (!fmt.empty() && (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<' || fmt[0] == '|')) fmt.erase(0, 1);
  if (fmt.size() == 1) {
    switch (fmt[0]) {
      case 'e': return DType::kF16;
      case 'f': return DType::kF32;
      case 'b': return DType::kI8;
      case 'B': return DType::kU8;
      case '?': return DType::kBool;
      case 'h': return DType::kI16;
      case 'i':
      case 'l':
      case 'q':
        if (itemsize == 4) return DType::kI32;
        if (itemsize == 8) return DType::kI64;
        break;
      default: break;
    }
  }
  return invalid_argument("buffer format '{}' (itemsize {}) has no ferry dtype", fmt, itemsize);
}

// A real ferry::Tensor over the memory of `obj` (zero-copy), checked against `decl`.
Tensor bind_object(py::handle obj, const TensorDecl& decl, const char* kind, bool writable, Holders& holders,
                   bool allow_cuda) {
  // `kind` says who binds it ("replay: param", "Consumer: param", "materialized tensor"),
  // so an engine error is not presented as a replay one.
  auto where = [&] { return fmt::format("{} '{}'", kind, decl.name); };
  void* data = nullptr;
  Shape shape;
  DType dtype = decl.dtype;
  std::string dtype_str;
  Device where_bytes = Device::host();
  if (is_torch_tensor(obj)) {
    const std::string device = py::str(obj.attr("device").attr("type"));
    if (device == "cuda" && allow_cuda) {
      py::object index = obj.attr("device").attr("index");
      where_bytes = Device::cuda(index.is_none() ? 0 : index.cast<int>());
    } else if (device != "cpu") {
      if (allow_cuda) {
        throw_status(invalid_argument("{} is a torch tensor on device '{}'; ferry takes cpu or cuda memory", where(),
                                      device));
      }
      throw_status(invalid_argument("{} is a torch tensor on device '{}'; it needs CPU memory here", where(), device));
    }
    std::string tname = py::str(obj.attr("dtype"));
    if (tname.rfind("torch.", 0) == 0) tname.erase(0, 6);
    auto d = parse_dtype(tname);
    if (!d.ok()) {
      throw_status(invalid_argument("{} has dtype {} but the plan expects {}", where(), tname, dtype_name(decl.dtype)),
                   "DTypeMismatchError");
    }
    dtype = *d;
    dtype_str = dtype_name(dtype);
    for (py::handle s : obj.attr("shape")) shape.push_back(s.cast<int64_t>());
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw_status(invalid_argument("{} {} is not contiguous; pass .contiguous() (or the parameter itself)", where(),
                                    shape_str(shape)));
    }
    data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
    holders.objects.push_back(py::reinterpret_borrow<py::object>(obj));
  } else if (PyObject_CheckBuffer(obj.ptr())) {
    std::unique_ptr<py::buffer_info> info;
    try {
      info = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(obj).request(writable));
    } catch (py::error_already_set& e) {
      throw_status(invalid_argument("{}: cannot take its buffer{}: {}", where(), writable ? " for writing" : "", e.what()));
    }
    auto d = dtype_from_format(info->format, info->itemsize);
    if (!d.ok()) {
      throw_status(invalid_argument("{} has {} but the plan expects {}", where(), d.status().message(), dtype_name(decl.dtype)),
                   "DTypeMismatchError");
    }
    dtype = *d;
    shape.assign(info->shape.begin(), info->shape.end());
    // C-contiguous (size-1 dims may have any stride).
    int64_t expect = info->itemsize;
    for (size_t k = shape.size(); k-- > 0;) {
      if (shape[k] != 1 && info->strides[k] != expect) {
        throw_status(invalid_argument("{} {} is not C-contiguous; pass numpy.ascontiguousarray(...) (a copy)", where(),
                                      shape_str(shape)));
      }
      expect *= shape[k];
    }
    data = info->ptr;
    holders.views.push_back(std::move(info));
  } else if (py::hasattr(obj, "__dlpack__")) {
    py::object capsule;
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      throw_status(invalid_argument("{}: __dlpack__ failed: {}", where(), e.what()));
    }
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    if (managed == nullptr) {
      PyErr_Clear();
      throw_status(invalid_argument("{}: __dlpack__ did not return a 'dltensor' capsule", where()));
    }
    // The capsule keeps the memory alive and calls the deleter when it is released.
    holders.objects.push_back(capsule);
    holders.objects.push_back(py::reinterpret_borrow<py::object>(obj));
    const DLTensor& t = managed->dl_tensor;
    if (t.device.device_type != 1) {
      throw_status(invalid_argument("{} is on DLPack device type {}; replay needs CPU memory", where(), t.device.device_type));
    }
    auto d = dtype_from_dlpack(t.dtype);
    if (!d.ok()) {
      throw_status(invalid_argument("{} has {} but the plan expects {}", where(), d.status().message(), dtype_name(decl.dtype)),
                   "DTypeMismatchError");
    }
    dtype = *d;
    shape.assign(t.shape, t.shape + t.ndim);
    if (t.strides != nullptr) {
      int64_t expect = 1;
      for (size_t k = shape.size(); k-- > 0;) {
        if (shape[k] != 1 && t.strides[k] != expect) {
          throw_status(invalid_argument("{} {} is not C-contiguous", where(), shape_str(shape)));
        }
        expect *= shape[k];
      }
    }
    data = static_cast<std::byte*>(t.data) + t.byte_offset;
  } else {
    throw_status(invalid_argument("{} must be a numpy array (or another buffer), a CPU torch tensor or a DLPack "
                                  "(__dlpack__) CPU array, got {}",
                                  where(), type_name(obj)));
  }
  if (dtype != decl.dtype) {
    throw_status(invalid_argument("{} has dtype {} but the plan expects {}", where(), dtype_name(dtype), dtype_name(decl.dtype)),
                 "DTypeMismatchError");
  }
  if (shape != decl.shape) {
    throw_status(invalid_argument("{} has shape {} but the plan expects {}", where(), shape_str(shape), shape_str(decl.shape)),
                 "ShapeMismatchError");
  }
  static std::byte empty_storage[16];
  if (data == nullptr && shape_numel(shape) == 0) data = empty_storage;
  if (!where_bytes.is_host()) return checked(Tensor::borrow_device(data, shape, dtype, where_bytes, nullptr, decl.name));
  return checked(Tensor::borrow(data, shape, dtype, nullptr, decl.name));
}

void sync_torch_streams(const std::set<int>& devices) {
  if (devices.empty()) return;
  py::object torch = py::module_::import("sys").attr("modules").attr("get")("torch");
  if (torch.is_none() || !torch.attr("cuda").attr("is_available")().cast<bool>()) return;
  for (int d : devices) torch.attr("cuda").attr("current_stream")(d).attr("synchronize")();
}

// Binds every tensor the plan reads (sources) or writes (params).
TensorMap bind_all(const Plan& plan, py::handle mapping, bool params, Holders& holders) {
  const auto& decls = params ? plan.params() : plan.sources();
  std::vector<bool> used(decls.size(), false);
  for (const Copy& c : plan.copies()) used[params ? c.param : c.source] = true;
  if (params) {
    for (const Zero& z : plan.zeros()) used[z.param] = true;
  }
  const char* kind = params ? "param" : "source";
  const char* bind_kind = params ? "replay: param" : "replay: source";
  if (!PyMapping_Check(mapping.ptr()) || !py::hasattr(mapping, "keys")) {
    throw_status(invalid_argument("replay: the {}s must be a mapping from name to array, got {}", kind, type_name(mapping)));
  }
  py::object map = py::reinterpret_borrow<py::object>(mapping);
  TensorMap out;
  for (size_t i = 0; i < decls.size(); ++i) {
    if (!used[i]) continue;
    const TensorDecl& d = decls[i];
    py::str key(d.name);
    if (!map.attr("__contains__")(key).cast<bool>()) {
      throw_status(not_found("replay: {} '{}' {} {} is missing", kind, d.name, shape_str(d.shape), dtype_name(d.dtype)));
    }
    py::object obj = map.attr("__getitem__")(key);
    out.emplace(d.name, bind_object(obj, d, bind_kind, params, holders, /*allow_cuda=*/true));
  }
  return out;
}

py::list decls_to_list(const std::vector<TensorDecl>& decls) {
  py::list out;
  for (const TensorDecl& d : decls) out.append(py::make_tuple(d.name, to_tuple(d.shape), std::string(dtype_name(d.dtype))));
  return out;
}

}  // namespace ferry::python

PYBIND11_MODULE(_ferry, m) {
  using namespace ferry;
  using namespace ferry::python;
  m.doc() = "ferry's C++ core (use the ferry package, not this module)";
  m.attr("__version__") = FERRY_VERSION_STRING;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      raise_python(e);
    }
  });

  m.def("_set_error_classes", [](py::dict classes) {
    if (g_error_classes == nullptr) g_error_classes = new py::dict();
    *g_error_classes = std::move(classes);
  });

  m.def("dtype_size", [](const std::string& name) { return dtype_size(dtype_from_name(name)); });
  m.def("dtype_name", [](const std::string& name) { return std::string(ferry::dtype_name(dtype_from_name(name))); });

  py::class_<PyTensor>(m, "_Tensor")
      .def_static("source", [](std::string name, Shape shape, const std::string& dtype) {
        return PyTensor{checked(Tensor::source(std::move(name), std::move(shape), dtype_from_name(dtype)))};
      })
      .def_static("param", [](std::string name, Shape shape, const std::string& dtype) {
        return PyTensor{checked(Tensor::param(std::move(name), std::move(shape), dtype_from_name(dtype)))};
      })
      .def_property_readonly("shape", [](const PyTensor& s) { return to_tuple(s.t.shape()); })
      .def_property_readonly("strides", [](const PyTensor& s) { return to_tuple(s.t.strides()); })
      .def_property_readonly("offset", [](const PyTensor& s) { return s.t.offset(); })
      .def_property_readonly("dtype", [](const PyTensor& s) { return std::string(dtype_name(s.t.dtype())); })
      .def_property_readonly("itemsize", [](const PyTensor& s) { return dtype_size(s.t.dtype()); })
      .def_property_readonly("name", [](const PyTensor& s) { return s.t.name(); })
      .def_property_readonly("kind", [](const PyTensor& s) { return std::string(kind_name(s.t.storage_kind())); })
      .def_property_readonly("root_shape", [](const PyTensor& s) { return to_tuple(s.t.root_shape()); })
      .def_property_readonly("numel", [](const PyTensor& s) { return s.t.numel(); })
      .def_property_readonly("ndim", [](const PyTensor& s) { return s.t.dim(); })
      .def_property_readonly("is_contiguous", [](const PyTensor& s) { return s.t.is_contiguous(); })
      .def_property_readonly("is_recorded_copy", [](const PyTensor& s) { return s.t.is_recorded_copy(); })
      .def("describe", [](const PyTensor& s) { return s.t.describe(); })
      .def("narrow", [](const PyTensor& s, int64_t d, int64_t start, int64_t len) { return PyTensor{checked(s.t.narrow(d, start, len))}; })
      .def("select", [](const PyTensor& s, int64_t d, int64_t i) { return PyTensor{checked(s.t.select(d, i))}; })
      .def("slice", [](const PyTensor& s, int64_t d, std::optional<int64_t> b, std::optional<int64_t> e, int64_t step) {
        return PyTensor{checked(s.t.slice(d, b, e, step))};
      })
      .def("view", [](const PyTensor& s, Shape shape) { return PyTensor{checked(s.t.view(std::move(shape)))}; })
      .def("reshape", [](const PyTensor& s, Shape shape) { return PyTensor{checked(s.t.reshape(std::move(shape)))}; })
      .def("transpose", [](const PyTensor& s, int64_t a, int64_t b) { return PyTensor{checked(s.t.transpose(a, b))}; })
      .def("t", [](const PyTensor& s) { return PyTensor{checked(s.t.t())}; })
      .def("permute", [](const PyTensor& s, std::vector<int64_t> dims) { return PyTensor{checked(s.t.permute(std::move(dims)))}; })
      .def("flatten", [](const PyTensor& s, int64_t a, int64_t b) { return PyTensor{checked(s.t.flatten(a, b))}; })
      .def("unflatten", [](const PyTensor& s, int64_t d, Shape sizes) { return PyTensor{checked(s.t.unflatten(d, std::move(sizes)))}; })
      .def("unsqueeze", [](const PyTensor& s, int64_t d) { return PyTensor{checked(s.t.unsqueeze(d))}; })
      .def("squeeze", [](const PyTensor& s, std::optional<int64_t> d) {
        return PyTensor{checked(d ? s.t.squeeze(*d) : s.t.squeeze())};
      })
      .def("chunk", [](const PyTensor& s, int64_t n, int64_t d) { return wrap_list(s.t.chunk(n, d)); })
      .def("split", [](const PyTensor& s, int64_t size, int64_t d) { return wrap_list(s.t.split(size, d)); })
      .def("split_sizes", [](const PyTensor& s, std::vector<int64_t> sizes, int64_t d) { return wrap_list(s.t.split(std::move(sizes), d)); })
      .def("unbind", [](const PyTensor& s, int64_t d) { return wrap_list(s.t.unbind(d)); })
      .def("contiguous", [](const PyTensor& s) { return PyTensor{checked(s.t.contiguous())}; })
      .def("copy_", [](const PyTensor& s, const PyTensor& src) { check(s.t.copy_(src.t)); })
      .def("zero_", [](const PyTensor& s) { check(s.t.zero_()); });

  py::class_<PyPlan>(m, "_Plan")
      .def(py::init<>())
      .def_static("decode", [](py::bytes b) {
        std::string_view v = b;
        auto p = Plan::decode(v);
        if (!p.ok()) throw_status(p.status());
        return PyPlan{std::move(p).value()};
      })
      .def("encode", [](const PyPlan& p) { return py::bytes(p.plan.encode()); })
      .def("hash", [](const PyPlan& p) { return p.plan.hash(); })
      .def("to_string", [](const PyPlan& p) { return p.plan.to_string(); })
      .def("equals", [](const PyPlan& a, const PyPlan& b) { return a.plan == b.plan; })
      .def("sources", [](const PyPlan& p) { return decls_to_list(p.plan.sources()); })
      .def("params", [](const PyPlan& p) { return decls_to_list(p.plan.params()); })
      .def("stats", [](const PyPlan& p) {
        const PlanStats s = p.plan.stats();
        py::dict d;
        d["copies"] = s.copies;
        d["zeros"] = s.zeros;
        d["elements"] = s.elements;
        d["bytes"] = s.bytes;
        d["zero_elements"] = s.zero_elements;
        d["sources"] = p.plan.sources().size();
        d["params"] = p.plan.params().size();
        return d;
      })
      .def("check_coverage", [](const PyPlan& p, bool allow_unwritten) { check(p.plan.check_coverage(allow_unwritten)); })
      .def("replay", [](const PyPlan& p, py::handle sources, py::handle params, int threads, py::object stream) {
        Holders holders;
        TensorMap smap = bind_all(p.plan, sources, false, holders);
        TensorMap pmap = bind_all(p.plan, params, true, holders);
        ExecuteOptions opts;
        opts.threads = threads;
        // CUDA tensors: the copies run on `stream` (a cudaStream_t as an int), by default
        // torch's current stream of their device, so they are ordered with the caller's work.
        std::optional<Device> cuda;
        for (const auto* m : {&smap, &pmap}) {
          for (const auto& [name, t] : *m) {
            if (t.device().is_cuda()) cuda = t.device();
          }
        }
        if (cuda) {
          if (stream.is_none()) {
            stream = py::module_::import("torch").attr("cuda").attr("current_stream")(cuda->index).attr("cuda_stream");
          }
          opts.stream = reinterpret_cast<void*>(stream.cast<uintptr_t>());
        }
        Status st;
        {
          py::gil_scoped_release release;
          st = execute(p.plan, smap, pmap, opts);
        }
        check(st);
      });

#ifdef FERRY_PYTHON_MODELS
  register_models(m);
#endif
#ifdef FERRY_PYTHON_ENGINE
  register_engine(m);
#endif
#ifdef FERRY_PYTHON_METRICS
  register_metrics(m);
#endif
#ifdef FERRY_PYTHON_RANK
  register_rank(m);
#endif

  py::class_<PyRecorder>(m, "_Recorder")
      .def(py::init<>())
      .def("finish", &PyRecorder::finish)
      .def("abort", &PyRecorder::abort)
      .def_property_readonly("active", &PyRecorder::active);
}
