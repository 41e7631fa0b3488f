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

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "ferry/engine.h"
#include "ferry/source.h"
#include "ferry/store.h"
#include "ferry/transport.h"
#include "python/common.h"

namespace ferry::python {

namespace {

template <typename T>
T value_or_raise(Result<T> r) {
  if (!r.ok()) throw_status(r.status());
  return std::move(r).value();
}

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
    }
    py::gil_scoped_acquire gil;
    auto holders = std::make_unique<Holders>();
    std::vector<LocalBox> out;
    const std::string where = fmt::format("WeightSource.materialize({})", group);
    try {
      py::object got = obj_.attr("materialize")(group);
      if (!py::hasattr(got, "keys")) {
        return invalid_argument("{}: must return a mapping from tensor name to array, got {}", where,
                                std::string(py::str(py::type::handle_of(got).attr("__qualname__"))));
      }
      for (uint32_t i = 0; i < mine_->boxes.size(); ++i) {
        const HeldBox& hb = mine_->boxes[i];
        const TensorDecl& decl = mine_->tensors[hb.tensor];
        if (groups_.of_name(decl.name) != group) continue;
        py::str key(decl.name);
        if (!got.attr("__contains__")(key).cast<bool>()) {
          return not_found("{}: '{}' (box {}) is missing", where, decl.name, hb.box.to_string());
        }
        TensorDecl box_decl{decl.name, decl.dtype, hb.box.size};
        Tensor t = bind_object(got.attr("__getitem__")(key), box_decl, "materialized tensor", false, *holders);
        out.push_back(LocalBox{i, std::move(t)});
      }
    } catch (py::error_already_set& e) {
      return status_from_python(e, where);
    } catch (const StatusError& e) {
      return e.status.with_context(where);
    }
    holders_ = std::move(holders);  // the previous group's arrays are released here
    return out;
  }

 private:
  py::object obj_;
  std::vector<TensorDecl> meta_;
  std::unordered_map<std::string, size_t> index_;
  Groups groups_;
  int rank_ = 0;
  int world_ = 1;
  std::optional<Holdings> mine_;
  std::unique_ptr<Holders> holders_;
};

std::chrono::milliseconds ms(double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)); }

void fill_engine_options(EngineOptions& o, const py::dict& kw) {
  if (kw.contains("job")) o.job = kw["job"].cast<std::string>();
  if (kw.contains("num_producers")) o.num_producers = kw["num_producers"].cast<int>();
  if (kw.contains("num_consumers")) o.num_consumers = kw["num_consumers"].cast<int>();
  if (kw.contains("mode")) o.mode = value_or_raise(parse_sync_mode(kw["mode"].cast<std::string>()));
  if (kw.contains("rendezvous_timeout")) o.rendezvous_timeout = ms(kw["rendezvous_timeout"].cast<double>());
  if (kw.contains("timeout")) o.timeout = ms(kw["timeout"].cast<double>());
  if (kw.contains("stall_timeout")) o.stall_timeout = ms(kw["stall_timeout"].cast<double>());
  if (kw.contains("lease_ttl")) o.lease_ttl = ms(kw["lease_ttl"].cast<double>());
  if (kw.contains("checksums")) o.checksums = kw["checksums"].cast<bool>();
}

std::unique_ptr<Transport> make_transport(const py::dict& kw) {
  TransportOptions t;
  if (kw.contains("backend")) t.backend = kw["backend"].cast<std::string>();
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

py::dict report_dict(const SyncReport& r) {
  py::dict d;
  d["version"] = r.version;
  d["ok"] = r.status.ok();
  d["error"] = r.status.ok() ? py::object(py::none()) : py::object(py::str(r.status.to_string()));
  d["bytes_sent"] = r.bytes_sent;          // producer
  d["sent_in_place"] = r.sent_in_place;
  d["bytes_received"] = r.bytes_received;  // consumer
  d["received_into_params"] = r.received_into_params;
  d["bytes"] = r.bytes_sent + r.bytes_received;  // this side's bytes (one of the two is zero)
  d["seconds"] = r.seconds;
  d["materialize_seconds"] = r.materialize_seconds;
  d["pack_seconds"] = r.pack_seconds;
  d["wait_seconds"] = r.wait_seconds;
  d["read_seconds"] = r.read_seconds;
  d["unpack_seconds"] = r.unpack_seconds;
  d["post_seconds"] = r.post_seconds;
  py::dict peers;
  for (const auto& [peer, bytes] : r.bytes_per_peer) peers[py::int_(peer)] = bytes;
  d["bytes_per_peer"] = peers;
  d["dropped"] = r.dropped;
  d["failures"] = r.failures;
  d["text"] = r.to_string();
  return d;
}

struct PyProducer {
  std::unique_ptr<PySource> source;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Store> store;
  std::unique_ptr<Producer> producer;

  void close() {
    py::gil_scoped_release release;
    producer.reset();
    transport.reset();
    store.reset();
  }
  ~PyProducer() {
    if (producer || transport || store) close();
    // source: its destructor takes the GIL itself.
  }
};

struct PyConsumer {
  std::shared_ptr<const ModelLoader> loader;  // kept alive while the consumer lives
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Store> store;
  std::unique_ptr<Consumer> consumer;
  Holders holders;  // the caller's param arrays

  void close() {
    py::gil_scoped_release release;
    consumer.reset();
    transport.reset();
    store.reset();
  }
  ~PyConsumer() {
    if (consumer || transport || store) close();
  }
};

struct PyStoreServer {
  std::unique_ptr<StoreServer> server;
};

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

}  // namespace

void register_engine(py::module_& m) {
  m.def("_groups", [](py::handle metadata) {
    std::vector<TensorDecl> meta = decls_from_python(metadata);
    Groups g(meta);
    std::vector<std::string> names;
    for (int i = 0; i < g.size(); ++i) names.push_back(g.name(i));
    return py::make_tuple(names, g.tensor_groups());
  });
  // Megatron/FSDP holdings of every trainer rank: [[(name, start, size), ...] per rank].
  m.def("_make_holdings", [](py::handle metadata, const std::string& layout, int64_t q_rows, int64_t kv_rows) {
    std::vector<TensorDecl> meta = decls_from_python(metadata);
    TrainerLayout lay = value_or_raise(TrainerLayout::parse(layout));
    ModelInfo info;
    info.q_rows = q_rows;
    info.kv_rows = kv_rows;
    TrainerHoldings th = value_or_raise(make_holdings(meta, lay, info));
    py::list ranks;
    for (const Holdings& h : th.ranks) {
      py::list boxes;
      for (const HeldBox& b : h.boxes) {
        boxes.append(py::make_tuple(h.tensors[b.tensor].name, to_tuple(b.box.start), to_tuple(b.box.size)));
      }
      ranks.append(boxes);
    }
    return ranks;
  });
  m.def("_transport_backends", [] { return Transport::backends(); });

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
        ProducerOptions po;
        fill_engine_options(po, kw);
        if (!kw.contains("num_producers")) po.num_producers = world;
        if (kw.contains("staging_budget")) po.staging_budget = kw["staging_budget"].cast<uint64_t>();
        p->transport = make_transport(kw);
        p->store = open_store(store_url, kw);
        Result<std::unique_ptr<Producer>> made = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          made = Producer::create(*p->source, *p->transport, *p->store, po);
        }
        p->producer = value_or_raise(std::move(made));
        return p;
      }))
      .def("sync", [](PyProducer& p, uint64_t version) {
        if (!p.producer) throw_status(failed_precondition("Producer.sync: the producer is closed"));
        Result<SyncReport> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = p.producer->sync(version);
        }
        return report_dict(value_or_raise(std::move(r)));
      })
      .def_property_readonly("rank", [](const PyProducer& p) { return p.producer ? p.producer->rank() : -1; })
      .def("close", &PyProducer::close);

  py::class_<PyConsumer>(m, "_Consumer")
      .def(py::init([](py::object model_loader, int rank, const std::string& store_url, py::object params, py::dict kw) {
        auto c = std::make_unique<PyConsumer>();
        // model_loader: a ferry._ferry._ModelLoader (shares the C++ loader).
        c->loader = model_loader.cast<const PyModelLoader&>().loader;
        ConsumerOptions co;
        fill_engine_options(co, kw);
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
            pm.emplace(d.name, bind_object(params.attr("__getitem__")(key), d, "param", true, c->holders));
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
        return c;
      }))
      .def("sync", [](PyConsumer& c, uint64_t version) {
        if (!c.consumer) throw_status(failed_precondition("Consumer.sync: the consumer is closed"));
        Result<SyncReport> r = Status(StatusCode::kInternal, "not run");
        {
          py::gil_scoped_release release;
          r = c.consumer->sync(version);
        }
        return report_dict(value_or_raise(std::move(r)));
      })
      .def("state", [](const PyConsumer& c) {
        ConsumerState s = c.consumer->state();
        py::dict d;
        d["version"] = s.has_version ? py::object(py::int_(s.version)) : py::object(py::none());
        d["torn"] = s.torn;
        return d;
      })
      // {name: (ferry dtype name, numpy array over the consumer's memory; bf16/fp8 as raw bits)}
      .def("params", [](py::object self) {
        const PyConsumer& c = self.cast<const PyConsumer&>();
        py::dict out;
        for (const auto& [name, t] : c.consumer->params()) {
          out[py::str(name)] = py::make_tuple(std::string(dtype_name(t.dtype())), numpy_view(t, self));
        }
        return out;
      })
      .def_property_readonly("rank", [](const PyConsumer& c) { return c.consumer ? c.consumer->rank() : -1; })
      .def("close", &PyConsumer::close);
}

}  // namespace ferry::python
