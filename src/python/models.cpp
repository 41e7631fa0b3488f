// ferry._ferry: the built-in model loaders (ferry/models.h) — plans for a HF config and
// an inference layout without writing a loader in Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "ferry/models.h"
#include "python/common.h"

namespace ferry::python {

namespace {

std::shared_ptr<const RankLoader> rank_of(const PyModelLoader& l, int global) {
  auto r = l.loader->rank(global);
  if (!r.ok()) throw_status(r.status());
  return *r;
}

template <typename T>
T value_or_raise(Result<T> r) {
  if (!r.ok()) throw_status(r.status());
  return std::move(r).value();
}

}  // namespace

void register_models(py::module_& m) {
  m.def("_supported_architectures", [] { return supported_architectures(); });
  // A copy of `plan` keeping `params` block-quantised as `quantize` (mark_quantized).
  m.def("_mark_quantized", [](const PyPlan& plan, const std::string& quantize, const std::vector<std::string>& params) {
    PyPlan out{plan.plan};
    if (Status s = mark_quantized(out.plan, value_or_raise(parse_quantize(quantize)), params); !s.ok()) throw_status(s);
    return out;
  });
  // {param: (format, block, scale name)} of the params `plan` keeps block-quantised.
  m.def("_quantized_params", [](const PyPlan& plan) {
    py::dict d;
    for (const BlockQuantize& bq : plan.plan.quantized()) {
      static constexpr const char* kFormats[] = {"fp8", "fp8-ue8m0", "mxfp8"};
      d[py::str(plan.plan.params()[bq.param].name)] =
          py::make_tuple(kFormats[bq.format < 3 ? bq.format : 0], bq.block, bq.scale_name);
    }
    return d;
  });

  py::class_<PyModelLoader>(m, "_ModelLoader")
      .def_static("create",
                  [](const std::string& config, bool is_path, const std::string& layout, const std::string& quantize,
                     const std::string& mtp) {
                    ModelConfig cfg = value_or_raise(is_path ? ModelConfig::load(config) : ModelConfig::parse(config));
                    InferenceLayout lay = value_or_raise(InferenceLayout::parse(layout));
                    LoaderOptions opts;
                    opts.quantize = value_or_raise(parse_quantize(quantize));
                    opts.mtp = value_or_raise(parse_mtp_layers(mtp));
                    std::unique_ptr<ModelLoader> loader = value_or_raise(make_model_loader(cfg, lay, opts));
                    return PyModelLoader{std::shared_ptr<const ModelLoader>(std::move(loader))};
                  })
      .def_property_readonly("architecture", [](const PyModelLoader& l) { return l.loader->config().architecture(); })
      .def_property_readonly("layout", [](const PyModelLoader& l) { return l.loader->layout().to_string(); })
      .def_property_readonly("world_size", [](const PyModelLoader& l) { return l.loader->layout().world_size(); })
      .def("checkpoint", [](const PyModelLoader& l) { return decls_to_list(l.loader->checkpoint()); })
      .def("params", [](const PyModelLoader& l, int rank) { return decls_to_list(rank_of(l, rank)->param_decls()); })
      .def("final_params", [](const PyModelLoader& l, int rank) { return decls_to_list(rank_of(l, rank)->final_params()); })
      .def("rank_info", [](const PyModelLoader& l, int rank) {
        const RankInfo& i = rank_of(l, rank)->info();
        py::dict d;
        d["global"] = i.global;
        d["replica"] = i.replica;
        d["dp"] = i.dp;
        d["tp"] = i.tp;
        d["tp_size"] = i.tp_size;
        d["dp_size"] = i.dp_size;
        d["ep_size"] = i.ep_size;
        return d;
      })
      .def("record_plan", [](const PyModelLoader& l, int rank) {
        Result<Plan> plan = Plan();
        {
          py::gil_scoped_release release;
          plan = record_plan(*l.loader, rank);
        }
        return PyPlan{value_or_raise(std::move(plan))};
      });
}

}  // namespace ferry::python
