// ferry._ferry: the sync engine — a WeightSource implemented in Python, Producer and
// Consumer, the embedded store server.
//
// GIL: Producer/Consumer creation (rendezvous) and sync() run with the GIL released; the
// engine calls back into the Python WeightSource (holdings, materialize) after taking it.
// Python errors in those callbacks become a Status naming the method (the engine reports
// them like any source failure); they never unwind through C++.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/engine.h"
#include "ferry/source.h"
#include "ferry/store.h"
#include "ferry/transport.h"
#include "engine/report_json.h"
#include "python/common.h"
#include "python/engine_shared.h"
#include "python/json.h"
#include "python/options.h"

namespace ferry::python {

namespace {

std::vector<TensorDecl> decls_from_python(py::handle items) {
  std::vector<TensorDecl> out;
  auto one = [&](py::handle name, py::handle shape, py::handle dtype) {
    TensorDecl d;
    d.name = py::str(name);
    for (py::handle s : shape) d.shape.push_back(s.cast<int64_t>());
    d.dtype = dtype_from_name(py::str(dtype));
    out.push_back(std::move(d));
  };
  for (py::handle it : items) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(it);
    if (t.size() != 3) throw_status(invalid_argument("metadata: each entry must be (name, shape, dtype)"));
    one(t[0], t[1], t[2]);
  }
  return out;
}

Status status_from_python(py::error_already_set& e, const std::string& where) {
  return invalid_argument("{}: {}", where, e.what());
}

// Memory of a trainer's tensor that materialize returned: [base, base + bytes). For a
// torch tensor its whole storage (so every view of one parameter names one region).
struct Extent {
  const std::byte* base = nullptr;
  uint64_t bytes = 0;
};

bool is_torch(py::handle obj) {
  py::object torch = py::module_::import("sys").attr("modules").attr("get")("torch");
  return !torch.is_none() && py::isinstance(obj, torch.attr("Tensor"));
}

// A real ferry Tensor over a materialized array *as it lies* — a torch view or numpy
// array with any non-negative strides (a row range of a fused weight, a column range),
// no copy — checked against `decl` (the box). Other objects (DLPack) must be
// contiguous (bind_object). `extent` receives the memory the tensor lives in.
Tensor bind_view(py::handle obj, const TensorDecl& decl, Holders& holders, Extent& extent) {
  auto where = [&] { return fmt::format("materialized tensor '{}'", decl.name); };
  auto check = [&](DType dtype, const Shape& shape) {
    if (dtype != decl.dtype) {
      throw_status(invalid_argument("{} has dtype {} but the metadata says {}", where(), dtype_name(dtype),
                                    dtype_name(decl.dtype)),
                   "DTypeMismatchError");
    }
    if (shape != decl.shape) {
      throw_status(invalid_argument("{} has shape {} but its box is {}", where(), shape_str(shape), shape_str(decl.shape)),
                   "ShapeMismatchError");
    }
  };
  const int64_t es = static_cast<int64_t>(dtype_size(decl.dtype));
  if (is_torch(obj)) {
    const std::string device = py::str(obj.attr("device").attr("type"));
    if (device == "cuda") {
      // GPU memory: the engine packs it with a kernel (contiguous boxes only), never in place.
      extent = Extent{};
      return bind_object(obj, decl, "materialized tensor", false, holders, /*allow_cuda=*/true);
    }
    if (device != "cpu") {
      throw_status(invalid_argument("{} is on device '{}'; ferry takes cpu or cuda memory", where(), device));
    }
    std::string tname = py::str(obj.attr("dtype"));
    if (tname.rfind("torch.", 0) == 0) tname.erase(0, 6);
    auto d = parse_dtype(tname);
    if (!d.ok()) throw_status(invalid_argument("{} has dtype {} but the metadata says {}", where(), tname, dtype_name(decl.dtype)), "DTypeMismatchError");
    Layout l;
    for (py::handle x : obj.attr("shape")) l.shape.push_back(x.cast<int64_t>());
    check(*d, l.shape);
    for (py::handle x : obj.attr("stride")()) l.strides.push_back(x.cast<int64_t>());
    py::object storage = py::hasattr(obj, "untyped_storage") ? obj.attr("untyped_storage")() : obj.attr("storage")();
    auto* base = reinterpret_cast<std::byte*>(storage.attr("data_ptr")().cast<uintptr_t>());
    const auto nbytes = storage.attr("nbytes")().cast<int64_t>();
    l.offset = obj.attr("storage_offset")().cast<int64_t>();
    holders.objects.push_back(py::reinterpret_borrow<py::object>(obj));
    extent = Extent{base, static_cast<uint64_t>(nbytes)};
    static std::byte empty_storage[16];
    if (base == nullptr && l.numel() == 0) base = empty_storage;
    return checked(Tensor::borrow_strided(base, nbytes / es, std::move(l), *d, nullptr, decl.name));
  }
  if (PyObject_CheckBuffer(obj.ptr())) {
    auto info = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(obj).request());
    DType dtype = decl.dtype;
    if (info->itemsize != es) {
      throw_status(invalid_argument("{} has {}-byte elements but the metadata says {}", where(), info->itemsize,
                                    dtype_name(decl.dtype)),
                   "DTypeMismatchError");
    }
    Layout l;
    l.shape.assign(info->shape.begin(), info->shape.end());
    check(dtype, l.shape);
    for (py::ssize_t st : info->strides) {
      if (st < 0 || st % es != 0) {
        throw_status(invalid_argument("{}: stride of {} bytes is not a non-negative multiple of {}", where(), st, es));
      }
      l.strides.push_back(st / es);
    }
    const int64_t numel = l.numel() == 0 ? 0 : l.max_offset() + 1;
    auto* base = static_cast<std::byte*>(info->ptr);
    extent = Extent{base, static_cast<uint64_t>(numel * es)};
    holders.views.push_back(std::move(info));
    static std::byte empty_storage[16];
    if (base == nullptr) base = empty_storage;
    return checked(Tensor::borrow_strided(base, numel, std::move(l), dtype, nullptr, decl.name));
  }
  extent = Extent{};
  return bind_object(obj, decl, "materialized tensor", false, holders, /*allow_cuda=*/true);
}

// A WeightSource whose methods are those of a Python object (ferry.WeightSource).
class PySource final : public WeightSource {
 public:
  PySource(py::object obj, std::vector<TensorDecl> metadata, int rank, int world)
      : obj_(std::move(obj)), meta_(std::move(metadata)), groups_(meta_), rank_(rank), world_(world) {
    for (size_t i = 0; i < meta_.size(); ++i) index_.emplace(meta_[i].name, i);
  }
  ~PySource() override {
    py::gil_scoped_acquire gil;
    holders_.reset();
    kept_.clear();
    obj_ = py::object();
  }

  const std::vector<TensorDecl>& metadata() const override { return meta_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Result<Holdings> holdings(int rank) const override {
    py::gil_scoped_acquire gil;
    try {
      py::object boxes = obj_.attr("_ferry_holdings")(rank);
      Holdings h;
      for (py::handle it : boxes) {
        py::tuple t = py::reinterpret_borrow<py::tuple>(it);
        const std::string name = py::str(t[0]);
        auto found = index_.find(name);
        if (found == index_.end()) return not_found("holdings({}): '{}' is not in the metadata", rank, name);
        Box b;
        for (py::handle s : t[1]) b.start.push_back(s.cast<int64_t>());
        for (py::handle s : t[2]) b.size.push_back(s.cast<int64_t>());
        FERRY_RETURN_IF_ERROR(h.add(meta_[found->second], std::move(b)));
      }
      return h;
    } catch (py::error_already_set& e) {
      return status_from_python(e, fmt::format("WeightSource.holdings({})", rank));
    } catch (const StatusError& e) {
      return e.status;
    } catch (const std::exception& e) {
      return invalid_argument("WeightSource.holdings({}): {}", rank, e.what());
    }
  }

  Result<std::vector<LocalBox>> materialize(int group) override {
    if (!mine_) {
      FERRY_ASSIGN_OR_RETURN(Holdings h, holdings(rank_));
      mine_ = std::move(h);
      // Per group, its boxes grouped by tensor (holdings order): one pass, not one per group.
      boxes_of_group_.assign(static_cast<size_t>(groups_.size()), {});
      std::unordered_map<uint32_t, size_t> slot;  // tensor -> its entry in its group's list
      for (uint32_t i = 0; i < mine_->boxes.size(); ++i) {
        const uint32_t tensor = mine_->boxes[i].tensor;
        auto& of_group = boxes_of_group_[static_cast<size_t>(groups_.of_name(mine_->tensors[tensor].name))];
        auto [it, fresh] = slot.emplace(tensor, of_group.size());
        if (fresh) of_group.emplace_back();
        of_group[it->second].push_back(i);
      }
    }
    if (group < 0 || group >= groups_.size()) return out_of_range("materialize: group {} of {}", group, groups_.size());
    py::gil_scoped_acquire gil;
    if (auto kept = kept_.find(group); kept != kept_.end()) {
      // What the in-place pass got (keep_results): handed over once, not asked again.
      Kept k = std::move(kept->second);
      kept_.erase(kept);
      holders_ = std::move(k.holders);  // the previous group's arrays are released here
      return std::move(k.boxes);
    }
    auto holders = std::make_unique<Holders>();
    std::vector<LocalBox> out;
    const std::string where = fmt::format("WeightSource.materialize({})", group);
    try {
      py::object got = obj_.attr("materialize")(group);
      if (!py::hasattr(got, "keys")) {
        return invalid_argument("{}: must return a mapping from tensor name to array, got {}", where,
                                std::string(py::str(py::type::handle_of(got).attr("__qualname__"))));
      }
      for (const std::vector<uint32_t>& of_tensor : boxes_of_group_[static_cast<size_t>(group)]) {
        const TensorDecl& decl = mine_->tensors[mine_->boxes[of_tensor[0]].tensor];
        py::str key(decl.name);
        if (!got.attr("__contains__")(key).cast<bool>()) {
          return not_found("{}: '{}' (box {}) is missing", where, decl.name, mine_->boxes[of_tensor[0]].box.to_string());
        }
        py::object value = got.attr("__getitem__")(key);
        // Several boxes of one tensor (e.g. the q rows of two kv groups): a list, in holdings order.
        const bool listed = py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value);
        if (of_tensor.size() > 1 && (!listed || py::len(value) != of_tensor.size())) {
          return invalid_argument("{}: this rank holds {} boxes of '{}'; give a list of {} arrays in holdings order", where,
                                  of_tensor.size(), decl.name, of_tensor.size());
        }
        for (size_t k = 0; k < of_tensor.size(); ++k) {
          const HeldBox& hb = mine_->boxes[of_tensor[k]];
          py::object obj = listed ? py::reinterpret_borrow<py::object>(value[py::int_(k)]) : value;
          TensorDecl box_decl{decl.name, decl.dtype, hb.box.size};
          Extent e;
          Tensor t = bind_view(obj, box_decl, *holders, e);
          if (collect_extents_ && e.bytes > 0) extents_.push_back(e);
          out.push_back(LocalBox{of_tensor[k], std::move(t)});
        }
      }
      // The trainer's writes to its CUDA tensors may still be queued on its stream.
      std::set<int> gpus;
      for (const LocalBox& lb : out) {
        if (lb.data.device().is_cuda()) gpus.insert(lb.data.device().index);
      }
      sync_torch_streams(gpus);
    } catch (py::error_already_set& e) {
      return status_from_python(e, where);
    } catch (const StatusError& e) {
      return e.status.with_context(where);
    }
    if (keep_results_) {
      kept_[group] = Kept{out, std::move(holders)};
    } else {
      holders_ = std::move(holders);  // the previous group's arrays are released here
    }
    return out;
  }

  // In-place serving materialises every group in the binding (to register the memory of
  // what it returns) before Producer::create materialises every group again (to find
  // each box in those regions): with keep_results on, each group's result (and the
  // arrays it borrows) is kept and handed to the next materialize of that group instead
  // of asking Python twice. In place, those arrays are the trainer's own storage: keeping
  // them costs no copy. drop_kept() (GIL held) releases what create did not take.
  void keep_results(bool on) { keep_results_ = on; }
  void drop_kept() { kept_.clear(); }

  // The memory of every array materialize returned since the last call, merged where
  // it overlaps (what in-place serving registers with the transport).
  void collect_extents(bool on) { collect_extents_ = on; }
  std::vector<Extent> take_extents() {
    std::vector<Extent> e = std::move(extents_);
    extents_.clear();
    std::sort(e.begin(), e.end(), [](const Extent& a, const Extent& b) { return a.base < b.base; });
    std::vector<Extent> merged;
    for (const Extent& x : e) {
      if (!merged.empty() && x.base <= merged.back().base + merged.back().bytes) {
        const std::byte* end = std::max(merged.back().base + merged.back().bytes, x.base + x.bytes);
        merged.back().bytes = static_cast<uint64_t>(end - merged.back().base);
      } else {
        merged.push_back(x);
      }
    }
    return merged;
  }

 private:
  py::object obj_;
  std::vector<TensorDecl> meta_;
  std::unordered_map<std::string, size_t> index_;
  Groups groups_;
  int rank_ = 0;
  int world_ = 1;
  std::optional<Holdings> mine_;
  std::vector<std::vector<std::vector<uint32_t>>> boxes_of_group_;  // group -> tensor -> box indices
  std::unique_ptr<Holders> holders_;
  bool collect_extents_ = false;
  std::vector<Extent> extents_;
  struct Kept {
    std::vector<LocalBox> boxes;
    std::unique_ptr<Holders> holders;
  };
  bool keep_results_ = false;
  std::map<int, Kept> kept_;  // group -> the in-place pass's result (keep_results)
};

// A failed sync raises `st` with the sync's report (the engine's last_report: as far as
// it went, its failures and events) as the exception's `report`, and its trace written
// where `trace` says.
[[noreturn]] void raise_with_report(Status st, const SyncReport& r, bool producer, int rank, const py::object& trace) {
  if (!trace.is_none()) report_dict(r, producer, rank, trace);
  nlohmann::json j = engine::sync_report_json(r);
  j["text"] = r.to_string();
  StatusError e(std::move(st));
  e.report = std::make_shared<const nlohmann::json>(std::move(j));
  throw e;
}

struct PyProducer {
  std::unique_ptr<PySource> source;
  std::unique_ptr<Transport> transport;
  std::vector<MemoryRegion> source_regions;  // in place: the trainer's memory, registered
  std::unique_ptr<Store> store;
  std::unique_ptr<Producer> producer;
  ProducerOptions options;  // as create got them (options())
  int rank = -1;            // kept after close() (identity, not use)

  // The producer, or FailedPreconditionError naming `method` once closed (every use of
  // a closed producer raises; none reaches the engine's freed state).
  Producer& live(const char* method) const {
    if (!producer) throw_status(failed_precondition("Producer.{}: the producer is closed", method));
    return *producer;
  }

  InFlight in_flight;

  void close() {
    std::unique_ptr<Producer> p = std::move(producer);
    std::unique_ptr<Transport> t = std::move(transport);
    std::unique_ptr<Store> s = std::move(store);
    py::gil_scoped_release release;
    in_flight.wait_idle();
    p.reset();
    t.reset();
    s.reset();
  }
  ~PyProducer() {
    if (producer || transport || store) close();
    // source: its destructor takes the GIL itself.
  }
};

// A Python object that C++ may hold on any thread: its reference is dropped under the
// GIL (the engine destroys its hooks with the GIL released).
struct GilObject {
  py::object obj;
  explicit GilObject(py::object o) : obj(std::move(o)) {}
  ~GilObject() {
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
};

// The first error a Python hook raised on the consumer's background thread (the C++
// after_group hook returns nothing); sync() raises it once the engine returns.
struct HookErrors {
  std::mutex mu;
  Status first;
  void add(Status st) {
    std::lock_guard<std::mutex> lk(mu);
    if (first.ok()) first = std::move(st);
  }
  Status take() {
    std::lock_guard<std::mutex> lk(mu);
    return std::exchange(first, Status::Ok());
  }
};

std::string python_error(py::error_already_set& e) {
  std::string type = py::str(e.type().attr("__name__"));
  return fmt::format("{}: {}", type, std::string(py::str(e.value())));
}

struct PyConsumer {
  std::shared_ptr<const ModelLoader> loader;  // kept alive while the consumer lives (loader= path)
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Store> store;
  std::unique_ptr<Consumer> consumer;
  Holders holders;  // the caller's param arrays
  std::vector<TensorDecl> bound;  // the params bound from the caller's arrays (check_params)
  ConsumerOptions options;        // as create got them (options())
  std::shared_ptr<HookErrors> hook_errors = std::make_shared<HookErrors>();
  int rank = -1;  // kept after close() (identity, not use)

  // The consumer, or FailedPreconditionError naming `method` once closed: state(),
  // params(), sync() of a closed consumer read the engine's freed state (SIGSEGV).
  Consumer& live(const char* method) const {
    if (!consumer) throw_status(failed_precondition("Consumer.{}: the consumer is closed", method));
    return *consumer;
  }

  InFlight in_flight;

  void close() {
    std::unique_ptr<Consumer> c = std::move(consumer);
    std::unique_ptr<Transport> t = std::move(transport);
    std::unique_ptr<Store> s = std::move(store);
    py::gil_scoped_release release;
    in_flight.wait_idle();
    c.reset();
    t.reset();
    s.reset();
  }
  ~PyConsumer() {
    if (consumer || transport || store) close();
  }
};

// A Python callable as an engine hook, called on the consumer's background thread with
// the GIL held; what it raises is kept in `errors` (failing that sync), never thrown onto
// the engine's thread. `arg_names` name the arguments in the error ("version 3, group 1").
template <typename... Args>
std::function<void(Args...)> engine_hook(py::handle callable, std::string hook, std::shared_ptr<HookErrors> errors,
                                         std::array<const char*, sizeof...(Args)> arg_names) {
  auto fn = std::make_shared<GilObject>(py::reinterpret_borrow<py::object>(callable));
  return [fn, errors, hook = std::move(hook), arg_names](Args... args) {
    py::gil_scoped_acquire gil;
    auto where = [&] {
      std::vector<std::string> parts;
      size_t i = 0;
      (parts.push_back(fmt::format("{} {}", arg_names[i++], args)), ...);
      return fmt::format("{}", fmt::join(parts, ", "));
    };
    try {
      fn->obj(args...);
    } catch (py::error_already_set& e) {
      errors->add(invalid_argument("{} hook ({}): {}", hook, where(), python_error(e)));
    } catch (const std::exception& e) {  // nothing may escape onto the engine's thread
      errors->add(internal_error("{} hook ({}): {}", hook, where(), e.what()));
    }
  };
}

// Engine options plus the Python hooks the engine runs itself: after_group
// (callable(version, group)), and under commit="groups" before_commit/after_commit
// (callable(version), around each layer group's commit; under "shadow",
// ferry.Consumer.commit runs them on the caller's thread). before_sync/after_sync run in
// ferry.Consumer.sync on the caller's thread (a raise there needs no C++ help).
ConsumerOptions fill_consumer_options(const py::dict& kw, PyConsumer& c) {
  ConsumerOptions co = consumer_options(kw);
  // ferry's own buffers in pull stay valid after close() (views keep them): heap memory,
  // not the transport's (docs/python.md; a catch-up from them on one host goes by message).
  co.own_params_in_transport_memory = false;
  auto given = [&](const char* name) { return kw.contains(name) && !kw[name].is_none(); };
  if (given("after_group"))
    co.after_group = engine_hook<uint64_t, int>(kw["after_group"], "after_group", c.hook_errors, {"version", "group"});
  if (co.commit == CommitPolicy::kGroups) {
    if (given("before_commit"))
      co.before_commit = engine_hook<uint64_t>(kw["before_commit"], "before_commit", c.hook_errors, {"version"});
    if (given("after_commit"))
      co.after_commit = engine_hook<uint64_t>(kw["after_commit"], "after_commit", c.hook_errors, {"version"});
  }
  return co;
}

// Where a param object's memory is now, as a tensor of the param's decl (torch: its
// data_ptr() and device; a buffer: its address; anything else, e.g. DLPack: bound again),
// for Consumer::check_params, which compares device and address only.
Tensor param_memory(py::handle obj, const TensorDecl& decl, Holders& holders) {
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "device") && py::hasattr(obj, "element_size")) {
    auto* data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
    if (std::string(py::str(obj.attr("device").attr("type"))) == "cuda") {
      py::object index = obj.attr("device").attr("index");
      return Tensor::borrow_device(data, decl.shape, decl.dtype, Device::cuda(index.is_none() ? 0 : index.cast<int>()));
    }
    return Tensor::borrow(data, decl.shape, decl.dtype);
  }
  if (PyObject_CheckBuffer(obj.ptr())) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
    return Tensor::borrow(info.ptr, decl.shape, decl.dtype);
  }
  return bind_object(obj, decl, "Consumer.sync: param", false, holders, /*allow_cuda=*/true);
}

struct PyStoreServer {
  std::unique_ptr<StoreServer> server;
};

}  // namespace

// Shared with the other engine bindings (python/engine_shared.h).

std::unique_ptr<Transport> make_transport(const py::dict& kw) {
  TransportOptions t;
  if (kw.contains("backend")) t.backend = kw["backend"].cast<std::string>();
  if (kw.contains("token")) t.token = kw["token"].cast<std::string>();  // the store's token guards the data plane too
  if (kw.contains("transport_params")) {
    for (auto item : kw["transport_params"].cast<py::dict>()) t.params[py::str(item.first)] = py::str(item.second);
  }
  return value_or_raise(Transport::create(t));
}


std::unique_ptr<Store> open_store(const std::string& url, const py::dict& kw) {
  StoreOptions so;
  if (kw.contains("token")) so.token = kw["token"].cast<std::string>();
  return value_or_raise(Store::open(url, so));
}


// The report as the CLI prints it (engine/report_json.h: one serialiser, the same keys),
// with "text" (SyncReport::to_string). `trace`: a path (str; ferry._engine passes os.fspath) or None:
// write the sync's trace there (Chrome trace-event JSON, tools/trace_file.h).
py::dict report_dict(const SyncReport& r, bool producer, int rank, const py::object& trace) {
  py::dict d = json_to_python(engine::sync_report_json(r)).cast<py::dict>();
  d["text"] = r.to_string();
  if (!trace.is_none()) {
    engine::TraceFile f(trace.cast<std::string>());
    f.add(producer, rank, r);
    check(f.write());
  }
  return d;
}


// A numpy array over a real tensor's bytes (bf16/fp8 as raw uint16/uint8 bits), keeping
// `owner` alive.
py::array numpy_view(const Tensor& t, py::handle owner) {
  std::string fmt;
  switch (t.dtype()) {
    case DType::kF16: fmt = "e"; break;
    case DType::kF32: fmt = "f"; break;
    case DType::kBF16:
    case DType::kI16: fmt = t.dtype() == DType::kI16 ? "h" : "H"; break;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kU8: fmt = "B"; break;
    case DType::kI8: fmt = "b"; break;
    case DType::kI32: fmt = "i"; break;
    case DType::kI64: fmt = "q"; break;
    case DType::kBool: fmt = "?"; break;
  }
  auto p = t.data_ptr();
  if (!p.ok()) throw_status(p.status());
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  std::vector<py::ssize_t> strides;
  for (int64_t s : t.strides()) strides.push_back(static_cast<py::ssize_t>(s * static_cast<int64_t>(dtype_size(t.dtype()))));
  return py::array(py::dtype(fmt), shape, strides, *p, owner);
}


void register_engine(py::module_& m) {
  register_options(m);
  m.def("_groups", [](py::handle metadata) {
    std::vector<TensorDecl> meta = decls_from_python(metadata);
    Groups g(meta);
    std::vector<std::string> names;
    for (int i = 0; i < g.size(); ++i) names.push_back(g.name(i));
    return py::make_tuple(names, g.tensor_groups());
  });
  // Megatron/FSDP holdings of every trainer rank, computed once; rank(r) converts one
  // rank's boxes to Python ([(name, start, size)]), so a trainer rank of a 1024-rank
  // layout pays for its own boxes only.
  py::class_<TrainerHoldings>(m, "_LayoutHoldings")
      .def(py::init([](py::handle metadata, const std::string& layout, int64_t q_rows, int64_t kv_rows) {
        std::vector<TensorDecl> meta = decls_from_python(metadata);
        TrainerLayout lay = value_or_raise(TrainerLayout::parse(layout));
        ModelInfo info;
        info.q_rows = q_rows;
        info.kv_rows = kv_rows;
        return value_or_raise(make_holdings(meta, lay, info));
      }))
      .def_property_readonly("world_size", [](const TrainerHoldings& th) { return th.ranks.size(); })
      .def("rank", [](const TrainerHoldings& th, int rank) {
        if (rank < 0 || static_cast<size_t>(rank) >= th.ranks.size()) {
          throw_status(out_of_range("holdings: rank {} outside the layout {} of {} ranks", rank, th.layout.to_string(),
                                    th.ranks.size()));
        }
        const Holdings& h = th.ranks[static_cast<size_t>(rank)];
        py::list boxes;
        for (const HeldBox& b : h.boxes) {
          boxes.append(py::make_tuple(h.tensors[b.tensor].name, to_tuple(b.box.start), to_tuple(b.box.size)));
        }
        return boxes;
      });
  m.def("_transport_backends", [] { return Transport::backends(); });
  // The keys of every report (engine/report_json.h), for the tests that check that the
  // reports of the CLI, ferry.serve/fetch and Producer/Consumer.sync agree.
  m.def("_report_keys", [] {
    py::list keys;
    const nlohmann::json report = engine::sync_report_json(SyncReport{});
    for (const auto& [k, v] : report.items()) keys.append(py::str(k));
    return keys;
  });
  // Each consumer's CommittedState as (version or None, mixed, torn, newer or None).
  m.def("_committed_states", [](const std::string& url, const py::dict& kw, const std::string& job, int n) {
    auto store = open_store(url, kw);
    auto r = [&] {
      py::gil_scoped_release nogil;
      return committed_states(*store, job, n);
    }();
    py::list out;
    for (const CommittedState& st : value_or_raise(std::move(r))) {
      out.append(py::make_tuple(st.version ? py::object(py::int_(*st.version)) : py::object(py::none()), st.mixed,
                                st.torn, st.newer ? py::object(py::int_(*st.newer)) : py::object(py::none())));
    }
    return out;
  });

  py::class_<PyStoreServer>(m, "_StoreServer")
      .def_static("start", [](const std::string& host, int port, const std::string& token) {
        StoreServerOptions o;
        o.host = host;
        o.port = static_cast<uint16_t>(port);
        o.token = token;
        return PyStoreServer{value_or_raise(StoreServer::start(o))};
      })
      .def_property_readonly("url", [](const PyStoreServer& s) { return s.server->url(); })
      .def_property_readonly("port", [](const PyStoreServer& s) { return s.server->port(); })
      .def("stop", [](PyStoreServer& s) {
        py::gil_scoped_release release;
        s.server->stop();
      });

  py::class_<PyProducer>(m, "_Producer")
      .def(py::init([](py::object source, py::handle metadata, int rank, int world, const std::string& store_url,
                       py::dict kw) {
        auto p = std::make_unique<PyProducer>();
        p->source = std::make_unique<PySource>(source, decls_from_python(metadata), rank, world);
        ProducerOptions po = producer_options(kw);
        if (!kw.contains("num_producers")) po.num_producers = world;
        p->transport = make_transport(kw);
        p->store = open_store(store_url, kw);
        if (kw.contains("in_place") && kw["in_place"].cast<bool>()) {
          // Serving in place: materialise every group once, register the memory the
          // arrays live in (a torch tensor's whole storage) with the transport, and let
          // create() find each box in those regions (ProducerOptions::source_regions).
          // The Python objects that own that memory (the trainer's parameters) must keep
          // it at the same address; a box that moved fails its sync, naming the tensor.
          // create() gets this pass's results (keep_results): materialize runs once per
          // group here, not twice.
          p->source->collect_extents(true);
          p->source->keep_results(true);
          const int groups = Groups(p->source->metadata()).size();
          for (int g = 0; g < groups; ++g) {
            Result<std::vector<LocalBox>> got = Status(StatusCode::kInternal, "not run");
            {
              py::gil_scoped_release release;
              got = p->source->materialize(g);
            }
            if (!got.ok()) throw_status(got.status().with_context("Producer(in_place=True)"));
          }
          p->source->collect_extents(false);
          p->source->keep_results(false);
          for (const Extent& e : p->source->take_extents()) {
            p->source_regions.push_back(value_or_raise(p->transport->register_memory(const_cast<std::byte*>(e.base), e.bytes)));
          }
          po.source_regions = p->source_regions;
        }
        Result<std::unique_ptr<Producer>> made = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          made = Producer::create(*p->source, *p->transport, *p->store, po);
        }
        p->source->drop_kept();
        p->producer = value_or_raise(std::move(made));
        p->options = po;
        p->rank = p->producer->rank();
        return p;
      }))
      .def("sync", [](PyProducer& p, uint64_t version, const py::object& trace) {
        Producer& producer = p.live("sync");
        InFlight::Guard busy(p.in_flight);  // a close() on another thread waits for it
        Result<SyncReport> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = producer.sync(version);
        }
        if (!r.ok()) raise_with_report(r.status(), producer.last_report(), true, producer.rank(), trace);
        return report_dict(*r, true, producer.rank(), trace);
      }, py::arg("version"), py::arg("trace") = py::none())
      // The options create() got, as options_dict shows them (what tests compare keywords with).
      .def("options", [](const PyProducer& p) { return options_dict(p.options); })
      .def_property_readonly("rank", [](const PyProducer& p) { return p.rank; })
      .def_property_readonly("closed", [](const PyProducer& p) { return !p.producer; })
      .def("close", &PyProducer::close);

  py::class_<PyConsumer>(m, "_Consumer")
      .def(py::init([](py::object model_loader, int rank, const std::string& store_url, py::object params, py::dict kw) {
        auto c = std::make_unique<PyConsumer>();
        // model_loader: a ferry._ferry._ModelLoader (shares the C++ loader).
        c->loader = model_loader.cast<const PyModelLoader&>().loader;
        ConsumerOptions co = fill_consumer_options(kw, *c);
        TensorMap pm;
        if (!params.is_none()) {
          auto r = c->loader->rank(rank);
          if (!r.ok()) throw_status(r.status());
          for (const TensorDecl& d : (*r)->param_decls()) {
            py::str key(d.name);
            if (!params.attr("__contains__")(key).cast<bool>()) {
              throw_status(not_found("Consumer: param '{}' {} {} is missing from params", d.name, shape_str(d.shape),
                                     dtype_name(d.dtype)));
            }
            pm.emplace(d.name, bind_object(params.attr("__getitem__")(key), d, "Consumer: param", true, c->holders,
                                           /*allow_cuda=*/true));
            c->bound.push_back(d);
          }
        }
        c->transport = make_transport(kw);
        c->store = open_store(store_url, kw);
        Result<std::unique_ptr<Consumer>> made = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          made = Consumer::create(*c->loader, rank, *c->transport, *c->store, co, std::move(pm));
        }
        c->consumer = value_or_raise(std::move(made));
        c->options = std::move(co);
        c->rank = c->consumer->rank();
        return c;
      }))
      // A consumer of a plan recorded anywhere (ferry.record_load, ferry.record): `params`
      // a mapping name -> array/tensor written in place (names the plan lacks are
      // ignored; plan params missing from it are allocated by the engine), post_process
      // (group name, {name: param}) or None.
      .def_static("from_plan", [](const PyPlan& plan, int rank, const std::string& store_url, py::object params,
                                  py::object post_process, py::dict kw) {
        auto c = std::make_unique<PyConsumer>();
        ConsumerOptions co = fill_consumer_options(kw, *c);
        ConsumerModel model;
        model.plan = plan.plan;
        if (!params.is_none()) {
          for (const TensorDecl& d : model.plan.params()) {
            py::str key(d.name);
            if (!params.attr("__contains__")(key).cast<bool>()) continue;
            model.params.emplace(d.name, bind_object(params.attr("__getitem__")(key), d, "Consumer: param", true,
                                                     c->holders, /*allow_cuda=*/true));
            c->bound.push_back(d);
          }
        }
        if (!post_process.is_none()) {
          auto fn = std::make_shared<GilObject>(post_process);
          auto user = std::make_shared<GilObject>(params);
          model.post_process = [fn, user](const ConsumerModel::PostGroup& group, TensorMap& all) -> Status {
            py::gil_scoped_acquire gil;
            try {
              py::dict arg;
              for (const std::string& name : group.params) {
                py::str key(name);
                if (!user->obj.is_none() && user->obj.attr("__contains__")(key).cast<bool>()) {
                  arg[key] = user->obj.attr("__getitem__")(key);
                } else if (auto it = all.find(name); it != all.end()) {
                  arg[key] = numpy_view(it->second, py::none());
                }
              }
              fn->obj(group.name, arg);
              return Status::Ok();
            } catch (py::error_already_set& e) {
              return invalid_argument("post_process('{}'): {}", group.name, python_error(e));
            } catch (const StatusError& e) {
              return e.status.with_context(fmt::format("post_process('{}')", group.name));
            } catch (const std::exception& e) {  // nothing may escape onto the engine's thread
              return internal_error("post_process('{}'): {}", group.name, e.what());
            }
          };
        }
        c->transport = make_transport(kw);
        c->store = open_store(store_url, kw);
        Result<std::unique_ptr<Consumer>> made = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          made = Consumer::create(std::move(model), rank, *c->transport, *c->store, co);
        }
        c->consumer = value_or_raise(std::move(made));
        c->options = std::move(co);
        c->rank = c->consumer->rank();
        return c;
      })
      .def("sync", [](PyConsumer& c, uint64_t version, const py::object& trace, bool commit) {
        Consumer& consumer = c.live("sync");
        InFlight::Guard busy(c.in_flight);  // a close() on another thread waits for it
        // The caller's work that reads its CUDA params (inference) finishes before ferry
        // overwrites them; ferry's unpack is done when sync returns.
        std::set<int> gpus;
        for (const auto& [name, t] : consumer.params()) {
          if (t.device().is_cuda()) gpus.insert(t.device().index);
        }
        sync_torch_streams(gpus);
        Result<SyncReport> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = consumer.sync(version, commit);
        }
        // A hook that raised fails the sync with its own error (the engine's, if any, first).
        Status hook = c.hook_errors->take();
        if (!r.ok()) raise_with_report(r.status(), consumer.last_report(), false, consumer.rank(), trace);
        if (!hook.ok()) raise_with_report(std::move(hook), *r, false, consumer.rank(), trace);
        return report_dict(*r, false, consumer.rank(), trace);
      }, py::arg("version"), py::arg("trace") = py::none(), py::arg("commit") = true)
      // Shadow: Consumer::commit (the seconds it took) and Consumer::discard; the hooks
      // around a commit are ferry.Consumer's (Python, on the caller's thread).
      .def("commit", [](PyConsumer& c) {
        Consumer& consumer = c.live("commit");
        InFlight::Guard busy(c.in_flight);
        Result<double> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = consumer.commit();
        }
        return value_or_raise(std::move(r));
      })
      .def("discard", [](PyConsumer& c) { check(c.live("discard").discard()); })
      .def("leave", [](PyConsumer& c) { check(c.live("leave").leave()); })
      // Consumer::catch_up: the live version from the replicas that hold it; the report
      // dict, or the error with the report as far as it went.
      .def("catch_up", [](PyConsumer& c, const py::object& trace) {
        Consumer& consumer = c.live("catch_up");
        InFlight::Guard busy(c.in_flight);
        Result<SyncReport> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = consumer.catch_up();
        }
        if (!r.ok()) raise_with_report(r.status(), consumer.last_report(), false, consumer.rank(), trace);
        return report_dict(*r, false, consumer.rank(), trace);
      }, py::arg("trace") = py::none())
      // Consumer::check_params over the caller's params now (`params`: the mapping, or
      // None when it passed none): FailedPreconditionError naming a param re-bound since.
      .def("check_params", [](const PyConsumer& c, py::object params) {
        const Consumer& consumer = c.live("sync");
        Holders holders;
        TensorMap current;
        for (const TensorDecl& d : c.bound) {
          py::str key(d.name);
          if (params.is_none() || !params.attr("__contains__")(key).cast<bool>()) continue;
          current.emplace(d.name, checked(param_memory(params.attr("__getitem__")(key), d, holders)));
        }
        check(consumer.check_params(current).with_context("Consumer.sync"));
      })
      .def("options", [](const PyConsumer& c) { return options_dict(c.options); })
      .def("check_weights", [](PyConsumer& c) {
        Consumer& consumer = c.live("check_weights");
        InFlight::Guard busy(c.in_flight);
        Result<WeightCheck> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = consumer.check_weights();
        }
        const WeightCheck w = value_or_raise(std::move(r));
        py::dict d;
        d["version"] = w.version ? py::object(py::int_(*w.version)) : py::object(py::none());
        d["ok"] = w.ok();
        d["changed"] = w.changed;
        d["drifted"] = w.drifted;
        d["bytes_checked"] = w.bytes_checked;
        d["bytes"] = w.bytes;
        d["coverage"] = w.coverage();
        d["replicated_boxes"] = w.replicated_boxes;
        d["replicated_checked"] = w.replicated_checked;
        d["text"] = w.to_string();
        return d;
      })
      .def("state", [](const PyConsumer& c) {
        ConsumerState s = c.live("state").state();
        py::dict d;
        d["version"] = s.has_version ? py::object(py::int_(s.version)) : py::object(py::none());
        d["torn"] = s.torn;
        d["mixed"] = s.mixed;
        d["received"] = s.received ? py::object(py::int_(*s.received)) : py::object(py::none());
        return d;
      })
      // {name: (ferry dtype name, numpy array over the consumer's memory; bf16/fp8 as raw
      // bits; None for a param in GPU memory)}. Each array keeps alive both this object
      // (the caller's arrays, in holders) and a copy of the param's Tensor, which shares
      // its storage: ferry's own buffers (the pull arena, post-processing outputs) then
      // outlive close(). In push the arena is the transport's memory, freed by close()
      // (Consumer::params(): copy them to keep them).
      .def("params", [](py::object self) {
        const PyConsumer& c = self.cast<const PyConsumer&>();
        py::dict out;
        for (const auto& [name, t] : c.live("params").params()) {
          // GPU memory has no numpy view: None (the Python side returns the caller's tensor).
          py::object view = py::none();
          if (t.device().is_host()) {
            py::capsule storage(new Tensor(t), [](void* p) { delete static_cast<Tensor*>(p); });
            view = numpy_view(t, py::make_tuple(self, storage));
          }
          out[py::str(name)] = py::make_tuple(std::string(dtype_name(t.dtype())), view);
        }
        return out;
      })
      .def_property_readonly("rank", [](const PyConsumer& c) { return c.rank; })
      .def_property_readonly("closed", [](const PyConsumer& c) { return !c.consumer; })
      .def("close", &PyConsumer::close);

  register_targets(m);
}

}  // namespace ferry::python
