#include "engine/rendezvous.h"

#include <nlohmann/json.hpp>

namespace ferry::engine {

namespace {
nlohmann::json decl_json(const TensorDecl& d) {
  return nlohmann::json{{"name", d.name}, {"dtype", std::string(dtype_name(d.dtype))}, {"shape", d.shape}};
}
Result<TensorDecl> json_decl(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("name") || !j.contains("dtype") || !j.contains("shape"))
    return corrupt("tensor declaration must have name, dtype and shape");
  TensorDecl d;
  d.name = j["name"].get<std::string>();
  FERRY_ASSIGN_OR_RETURN(d.dtype, parse_dtype(j["dtype"].get<std::string>()));
  d.shape = j["shape"].get<Shape>();
  return d;
}
}  // namespace

std::string encode_decls(const std::vector<TensorDecl>& decls) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& d : decls) a.push_back(decl_json(d));
  return a.dump();
}

Result<std::vector<TensorDecl>> decode_decls(std::string_view text) {
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_array()) return corrupt("metadata is not a JSON array");
    std::vector<TensorDecl> out;
    for (const auto& e : j) {
      FERRY_ASSIGN_OR_RETURN(auto d, json_decl(e));
      out.push_back(std::move(d));
    }
    return out;
  } catch (const std::exception& e) {
    return corrupt("metadata JSON: {}", e.what());
  }
}

std::string encode_holdings(const Holdings& h) {
  nlohmann::json t = nlohmann::json::array();
  for (const auto& d : h.tensors) t.push_back(decl_json(d));
  nlohmann::json b = nlohmann::json::array();
  for (const auto& x : h.boxes) b.push_back(nlohmann::json{{"t", x.tensor}, {"start", x.box.start}, {"size", x.box.size}});
  return nlohmann::json{{"tensors", t}, {"boxes", b}}.dump();
}

Result<Holdings> decode_holdings(std::string_view text) {
  try {
    auto j = nlohmann::json::parse(text);
    Holdings h;
    for (const auto& e : j.at("tensors")) {
      FERRY_ASSIGN_OR_RETURN(auto d, json_decl(e));
      h.tensors.push_back(std::move(d));
    }
    for (const auto& e : j.at("boxes")) {
      HeldBox b;
      b.tensor = e.at("t").get<uint32_t>();
      if (b.tensor >= h.tensors.size()) return corrupt("holdings box names tensor {} of {}", b.tensor, h.tensors.size());
      b.box.start = e.at("start").get<Shape>();
      b.box.size = e.at("size").get<Shape>();
      h.boxes.push_back(std::move(b));
    }
    return h;
  } catch (const std::exception& e) {
    return corrupt("holdings JSON: {}", e.what());
  }
}

Result<RouteInputs> rendezvous_inputs(Store& store, const JobKeys& keys, const EngineOptions& o,
                                      const std::vector<TensorDecl>& metadata) {
  std::vector<std::string> wanted;
  for (int p = 0; p < o.num_producers; ++p) wanted.push_back(keys.holdings(p));
  for (int c = 0; c < o.num_consumers; ++c) wanted.push_back(keys.plan(c));
  FERRY_RETURN_IF_ERROR(store.wait(wanted, o.rendezvous_timeout).with_context("engine rendezvous"));
  RouteInputs in;
  in.metadata = metadata;
  for (int p = 0; p < o.num_producers; ++p) {
    FERRY_ASSIGN_OR_RETURN(auto text, store.get(keys.holdings(p)));
    auto h = decode_holdings(text);
    if (!h.ok()) return h.status().with_context(fmt::format("holdings of producer {}", p));
    in.holdings.push_back(std::move(*h));
  }
  for (int c = 0; c < o.num_consumers; ++c) {
    FERRY_ASSIGN_OR_RETURN(auto text, store.get(keys.plan(c)));
    auto plan = Plan::decode(text);
    if (!plan.ok()) return plan.status().with_context(fmt::format("plan of consumer {}", c));
    in.plans.push_back(std::move(*plan));
  }
  return in;
}

Result<Routes> RouteState::start(RouteInputs inputs) {
  inputs_ = std::move(inputs);
  FERRY_ASSIGN_OR_RETURN(dead_, read_dead());
  return routes_without(dead_);
}

Result<std::set<int>> RouteState::read_dead() const {
  std::set<int> out;
  if (!failover_) return out;
  const std::string prefix = keys_.dead_prefix();
  FERRY_ASSIGN_OR_RETURN(auto listed, store_.list(prefix));
  for (const auto& k : listed) {
    try {
      out.insert(std::stoi(k.substr(prefix.size())));
    } catch (const std::exception&) {
    }
  }
  return out;
}

Result<Routes> RouteState::routes_without(const std::set<int>& dead) const {
  RouterInput in;
  in.metadata = inputs_.metadata;
  in.producers = inputs_.holdings;
  for (int p : dead) {
    if (p >= 0 && static_cast<size_t>(p) < in.producers.size()) in.producers[static_cast<size_t>(p)] = Holdings{};
  }
  for (const auto& p : inputs_.plans) in.consumers.push_back(&p);
  auto routes = build_routes(in);
  if (!routes.ok()) return routes.status().with_context("building routes");
  FERRY_RETURN_IF_ERROR(routes->validate());
  return routes;
}

Status RouteState::mark_dead(const std::set<int>& dead) const {
  for (int p : dead) FERRY_RETURN_IF_ERROR(store_.set(keys_.dead(p), "1"));
  return Status::Ok();
}

Status RouteState::refresh(const std::function<Status(Routes)>& apply) {
  if (!failover_) return Status::Ok();
  FERRY_ASSIGN_OR_RETURN(auto d, read_dead());
  if (d == dead_) return Status::Ok();
  FERRY_ASSIGN_OR_RETURN(auto r, routes_without(d));
  return adopt(d, std::move(r), apply);
}

Status RouteState::adopt(const std::set<int>& dead, Routes routes, const std::function<Status(Routes)>& apply) {
  FERRY_RETURN_IF_ERROR(apply(std::move(routes)));
  dead_ = dead;
  return Status::Ok();
}

}  // namespace ferry::engine
